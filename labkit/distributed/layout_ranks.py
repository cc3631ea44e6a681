"""Rank functions for pipeline and tensor parallelism (lesson 10 and tests/distributed): spawned ranks import
them from here by name. Each builds the same model from the same seed (a `Workload`: the model and its batch),
runs labkit's version and PyTorch's, and returns plain tensors and numbers (they are pickled back to the caller).

    launch(pipeline_parity, 2, args=(Workload(cfg, batch=8, seq=32), 4))   # 4 micro-batches
"""

from __future__ import annotations

import contextlib

import gc
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.distributed import comms
from labkit.distributed import pipeline as pl


FAMILIES = ("labkit", "gpt2", "llama")


@dataclass(frozen=True)
class Workload:
    """What every rank of a layout builds and feeds alike: the model, from the same seed, and one batch."""

    cfg: dict               # the model's fields: labkit's GPTConfig, or overrides of transformers' gpt2-tiny preset
    batch: int              # rows of the batch: the whole pipeline's (cut into micro-batches), or each tp rank's
    seq: int                # tokens per row
    family: str = "labkit"  # "labkit" (labkit's GPT), "gpt2" (transformers' GPT-2, for the pipeline only) or
    # "llama" (transformers' Llama from the llama-tiny preset, for tensor parallelism only)

    def __post_init__(self):
        from labkit.optim.base import check_int

        if not isinstance(self.cfg, dict):
            raise ValueError(f"cfg must be a dict of the model's fields, got {type(self.cfg).__name__}")
        check_int("batch", self.batch)
        check_int("seq", self.seq)
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}: 'labkit', 'gpt2' or 'llama'")


def _labkit_only(work: Workload) -> Workload:
    if work.family != "labkit":  # tensor parallelism here splits labkit's GPT only
        raise ValueError(f"tensor parallel runs labkit's GPT, not family {work.family!r}")
    return work


def build_model(work: Workload) -> torch.nn.Module:
    """`work`'s model, fp32, from seed 0: labkit's GPT or transformers' GPT-2 (from the gpt2-tiny preset)."""
    torch.manual_seed(0)
    if work.family in ("gpt2", "llama"):
        from labkit.models.hf import build

        return build(f"{work.family}-tiny", device="cpu", **work.cfg)
    from labkit.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(**work.cfg))


def batch_of(batch: int, seq: int, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _one_process_grads(model, x, y) -> tuple[float, dict[str, torch.Tensor]]:
    logits = model(x)
    logits = getattr(logits, "logits", logits)  # a transformers model returns an output object
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _stage_grads(stage: pl.Stage) -> dict[str, torch.Tensor]:
    """{the whole model's parameter name: this stage's gradient}."""
    return {stage.origin[n]: p.grad.clone() for n, p in stage.named_parameters()}


# ---- pipeline ------------------------------------------------------------------------------------------------
def pipeline_parity(rank, world_size, work: Workload, m: int, schedules=("gpipe", "1f1b"), torch_ref=True):
    """For each schedule: labkit's pipeline and torch.distributed.pipelining's on the same stage, and one
    process on the whole batch of m micro-batches. Returns {"reference": grads of this stage's parameters,
    schedule: {...}}."""
    model = build_model(work)
    x, y = batch_of(work.batch, work.seq, model.config.vocab_size)
    ref_loss, ref = _one_process_grads(model, x, y)
    group = pl.tied_group(world_size)
    out = {"reference_loss": ref_loss, "reference": None}
    for name in schedules:
        stage = pl.build_stage(model, rank, world_size)
        if out["reference"] is None:
            out["reference"] = {stage.origin[n]: ref[stage.origin[n]] for n, _ in stage.named_parameters()}
        actions = pl.schedule(name, m, world_size, rank)
        run = pl.run_step(stage, actions, x if stage.is_first else None, y if stage.is_last else None, m,
                          batch_shape=tuple(x.shape))
        pl.sync_tied_grads(stage, group)
        res = {"grads": _stage_grads(stage), "loss": run.loss, "in_flight": max(run.in_flight),
               "wire": run.wire_bytes}
        if torch_ref:
            res["torch"], res["torch_loss"] = _torch_pipelining(model, rank, world_size, name, m, x, y, group)
        out[name] = res
    return out


def _torch_pipelining(model, rank, world_size, name, m, x, y, group):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage = pl.build_stage(model, rank, world_size)
    ps = PipelineStage(stage, rank, world_size, torch.device("cpu"), group=pl.p2p_group())

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    sched = cls(ps, n_microbatches=m, loss_fn=loss_fn)  # scale_grads=True: divides gradients by m
    losses: list = []
    if stage.is_first:
        sched.step(x)
    elif stage.is_last:
        sched.step(target=y, losses=losses)
    else:
        sched.step()
    pl.sync_tied_grads(stage, group)
    loss = float(torch.stack(losses).detach().mean()) if losses else None
    return _stage_grads(stage), loss


def pipeline_memory(rank, world_size, work: Workload, m: int, name: str, steps: int = 2, fail_stage=None,
                    checkpoint: bool = False, prepare=None, optimizer_offload: str | None = None,
                    offload_activations: bool = False, paged: bool = False, galore_rank: int = 0):
    """`steps` AdamW steps of one stage under schedule `name` with m micro-batches, measured by its own ledger:
    per-category peaks of the last step, the most activation bytes held, when each forward and backward ran, and
    the in-flight counts. A `fail_stage` raises in its first forward (to test that a failing stage ends the run).
    checkpoint: each block of the stage checkpointed (pipeline.Stage), or a policy name ("selective", "sqrt":
    labkit.recompute.checkpoint_blocks over the stage's blocks). prepare: changes the whole model before
    the stage is cut from it (e.g. functools.partial(labkit.run.apply_peft, lora_rank=8): LoRA; AdamW then
    steps the trained parameters only). optimizer_offload: "cpu" or "disk" steps them with
    labkit.optim.OffloadAdamW instead (the state in host memory). paged: the optimizer state counted in CUDA
    unified memory, off the device (bitsandbytes' paged states; as labkit.run.measure_step measures them).
    galore_rank: GaLoreAdamW (labkit.optim) of that rank on the stage's attention and MLP matrices (its first
    step makes the projectors; the measured last step reuses them)."""
    from labkit.memory.ledger import Ledger
    from labkit.memory.report import Category

    from labkit.recompute import checkpoint_blocks

    model = build_model(work)
    if prepare is not None:
        prepare(model)
    vocab = model.config.vocab_size
    # checkpoint: True (or "full") each block by the Stage; another policy ("selective", "sqrt") over the
    # stage's own blocks by labkit.recompute.checkpoint_blocks
    policy = checkpoint if isinstance(checkpoint, str) else ("full" if checkpoint else "none")
    stage = pl.build_stage(model, rank, world_size, checkpoint=policy == "full")
    ckpt = checkpoint_blocks(stage, policy if policy != "full" else "none")
    del model
    trained = [p for p in stage.parameters() if p.requires_grad]
    if optimizer_offload:
        from labkit.optim import OffloadAdamW

        opt = OffloadAdamW(trained, lr=1e-3, offload=optimizer_offload)
    elif galore_rank:
        from labkit.optim import GaLoreAdamW, galore_param_groups

        opt = GaLoreAdamW(galore_param_groups(stage, galore_rank), lr=1e-3)
    else:
        opt = torch.optim.AdamW(trained, lr=1e-3)
    group = pl.tied_group(world_size)
    actions = pl.schedule(name, m, world_size, rank)
    if fail_stage == rank:  # this stage dies in its first forward: its peers wait in send/recv
        def fail(*_):
            raise RuntimeError(f"stage {rank} failed on purpose in its forward")

        stage.register_forward_hook(fail)
    comms.barrier()
    with ckpt, Ledger(stage, opt) as led:
        x, y = (t.clone() for t in batch_of(work.batch, work.seq, vocab))  # contiguous; the stage keeps what it reads
        x, y = (x if stage.is_first else None), (y if stage.is_last else None)
        for _ in range(steps):
            comms.barrier()
            from labkit.recompute import offload_activations as offloaded

            with offloaded() if offload_activations else contextlib.nullcontext():
                run = pl.run_step(stage, actions, x, y, m, ledger=led, batch_shape=(work.batch, work.seq))
            pl.sync_tied_grads(stage, group)
            opt.step()
            opt.zero_grad(set_to_none=True)
    meas = _paged(led.measurement(), paged).of_step(steps)
    act = max(meas.timeline.bytes[Category.ACT][i] for i in range(len(meas.timeline.total)))
    return {"peak": meas.peak.as_dict(), "peak_phase": meas.peak_phase,
            "phases": {k: v.as_dict() for k, v in meas.phases.items()},
            "act_peak": _act_peak_last_step(meas, steps), "act_any": act,
            "times": run.times, "in_flight": max(run.in_flight), "loss": run.loss, "wire": run.wire_bytes,
            "layers": stage.layers, "n_params": sum(p.numel() for p in stage.parameters()),
            "unified": meas.unified}


def _paged(meas, paged: bool):
    """Paged optimizer states live in CUDA unified memory, which max_memory_allocated does not count: the
    same optimizer runs here (a CPU has none to page), and its state's bytes leave the device's timeline
    (Measurement.as_unified), as labkit.run.measure_step does on one device."""
    return meas.as_unified() if paged else meas


def _act_peak_last_step(meas, step: int) -> int:
    """The most ACT bytes live during step `step` (the ledger's timeline between that step's markers)."""
    from labkit.memory.report import Category

    marks = meas.timeline.phase_starts
    idx = [ev for ev, _, s in marks if s == step]
    ends = [ev for ev, _, s in marks if s > step]
    lo, hi = min(idx), (min(ends) if ends else len(meas.timeline.total))
    return max(meas.timeline.bytes[Category.ACT][lo:hi], default=0)


# ---- tensor parallel -----------------------------------------------------------------------------------------------
def _shard_of(name: str, full: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """This rank's slice of a whole-model tensor under the Megatron split (column: rows; row: columns)."""
    if ".c_attn." in name or ".c_fc." in name:  # column-parallel: weight and bias split along outputs
        n = full.shape[0] // t
        return full[rank * n:(rank + 1) * n]
    if ".c_proj.weight" in name:  # row-parallel: weight split along inputs, bias whole
        n = full.shape[1] // t
        return full[:, rank * n:(rank + 1) * n]
    return full


def _llama_shard_of(name: str, full: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    """This rank's slice of a whole Llama's tensor (tensor_parallel.LlamaTP: nn.Linear weights are (out, in))."""
    column = any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    row = ".o_proj." in name or ".down_proj." in name
    if column and not name.endswith("lora_A"):  # the weight and LoRA's B: split by rows (outputs)
        n = full.shape[0] // t
        return full[rank * n:(rank + 1) * n]
    if row and not name.endswith("lora_B"):  # the weight and LoRA's A: split by columns (inputs)
        n = full.shape[1] // t
        return full[:, rank * n:(rank + 1) * n]
    return full  # replicated: norms, embeddings, the head, a column adapter's A, a row adapter's B


def llama_tensor_parallel_parity(rank, world_size, work: Workload, prepare=None):
    """tensor_parallel.LlamaTP against one process (the whole model): the loss and this rank's gradients of
    what trains, as the largest absolute differences. prepare: changes the model before it is split (e.g.
    functools.partial(labkit.run.apply_peft, lora_rank=8): LoRA adapters, split with their Linears)."""
    import copy

    from labkit.distributed import tensor_parallel as tp

    model = build_model(work)
    if prepare is not None:
        prepare(model)
    x, y = batch_of(work.batch, work.seq, model.config.vocab_size)
    whole = copy.deepcopy(model)
    loss = whole(input_ids=x, labels=y, use_cache=False).loss
    loss.backward()
    m = tp.parallelize_llama(model, rank, world_size)
    ls = m(x, y)
    ls.backward()
    tp.sync_replicated_grads(m)
    grads = dict(whole.named_parameters())
    worst = max((p.grad - _llama_shard_of(n, grads[n].grad, rank, world_size)).abs().max().item()
                for n, p in m.model.named_parameters() if p.requires_grad)
    return {"loss": abs(ls.item() - loss.item()), "grad": worst, "n_params": sum(p.numel() for p in m.parameters())}


def tensor_parallel_parity(rank, world_size, work: Workload, torch_ref=True):
    """labkit's tensor parallel (plain and sequence parallel) and PyTorch's parallelize_module
    (ColwiseParallel / RowwiseParallel) against one process: logits, loss and this rank's gradients."""
    from labkit.distributed import tensor_parallel as tp

    model = build_model(_labkit_only(work))
    x, y = batch_of(work.batch, work.seq, model.config.vocab_size)
    base_logits = model(x).detach()
    head = tp.to_headwise(__import__("copy").deepcopy(model))
    logits = head(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    ref = {n: _shard_of(n, p.grad, rank, world_size) for n, p in head.named_parameters()}
    out = {"headwise_vs_model": (logits.detach() - base_logits).abs().max().item(), "loss": loss.item(),
           "logits": logits.detach(), "reference": ref}
    for sp in (False, True):
        m = tp.parallelize(model, rank, world_size, sequence_parallel=sp)
        with comms.CommLog() as log:
            lg = m(x)
            ls = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1))
            ls.backward()
            tp.sync_replicated_grads(m)
        out["sp" if sp else "tp"] = {"logits": lg.detach(), "loss": ls.item(), "comms": log.summary(),
                                     "grads": {n: p.grad.clone() for n, p in m.named_parameters()}}
    if torch_ref:
        out["torch"] = _torch_tp(head, world_size, x, y)
    return out


def _torch_tp(head_model, t, x, y):
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = copy.deepcopy(head_model)
    m.zero_grad(set_to_none=True)
    mesh = init_device_mesh("cpu", (t,))
    plan = {}
    for i in range(len(m.blocks)):
        plan.update({f"blocks.{i}.attn.c_attn": ColwiseParallel(), f"blocks.{i}.attn.c_proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.c_fc": ColwiseParallel(), f"blocks.{i}.mlp.c_proj": RowwiseParallel()})
    parallelize_module(m, mesh, plan)
    lg = m(x)
    ls = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), y.reshape(-1))
    ls.backward()
    grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for n, p in m.named_parameters()}
    return {"logits": torch.as_tensor(lg.detach()).clone(), "loss": ls.item(), "grads": grads}


def tp_activation_memory(rank, world_size, work: Workload, dtype="bf16"):
    """Activation bytes one rank's blocks save, measured by its ledger: the unsplit blocks (t = 1, no
    communication), tensor parallel, and tensor + sequence parallel. Returns {layout: bytes per layer}."""
    from labkit.distributed import tensor_parallel as tp
    from labkit.memory.ledger import Ledger

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    model = build_model(_labkit_only(work)).to(dt)
    L, C = model.config.n_layer, model.config.n_embd
    batch, seq = work.batch, work.seq
    layouts = {"t=1": tp.to_headwise(__import__("copy").deepcopy(model)).blocks,
               "tp": tp.parallelize(model, rank, world_size).blocks,
               "tp+sp": tp.parallelize(model, rank, world_size, sequence_parallel=True).blocks}
    out = {}
    for name, blocks in layouts.items():
        T = seq // world_size if name == "tp+sp" else seq
        torch.manual_seed(10 + rank)  # dropout masks: any; the bytes do not depend on them
        x = torch.randn(batch, T, C, dtype=dt, requires_grad=True)
        g = torch.randn(batch, T, C, dtype=dt)
        gc.collect()  # the previous layout's graph and tensors gone before this ledger starts
        with Ledger() as led:
            y = x
            for b in blocks:
                y = b(y)
            # the stack's output is held here (as the next layer's input would save it) and block 0's
            # input was made outside the ledger (as the previous layer's output): the two are the same size.
            # gloo's worker thread keeps the last all-reduce's tensor (the MLP output, dropout's input) until it
            # has cleaned up after the work, a moment after wait() returns: had backward started in that moment,
            # the ledger would count it as saved (1 run in ~8 on a busy CPU). Collectives queued behind it on
            # both worker threads let it go first.
            for _ in range(2):
                comms.barrier()
            torch.autograd.backward(y, g)
            del y
        out[name] = led.measurement().saved / L
    return out


def tp_step_memory(rank, world_size, work: Workload, micro_batch=None, sequence_parallel=False, steps=2,
                   optimizer_offload: str | None = None, paged: bool = False, checkpoint: str = "none",
                   step_in_backward: bool = False, offload_activations: bool = False, prepare=None, lisa=None):
    """One tensor-parallel rank's training step (AdamW, fp32; micro-batches of `micro_batch` rows, default the
    whole batch) measured by its own ledger: the last step's peaks. optimizer_offload: "cpu" or "disk" steps
    the rank's parameters with labkit.optim.OffloadAdamW (the state in host memory). paged: the state in
    unified memory (pipeline_memory). checkpoint: the rank's blocks checkpointed by that policy
    (labkit.recompute.checkpoint_blocks; a recomputed block runs its all-reduces again in backward).
    step_in_backward: each parameter steps as its gradient is made (labkit.optim.StepInBackward; without
    sequence parallelism a replicated parameter's gradient is already the same on every rank).
    offload_activations: the saved tensors go to host memory (labkit.recompute.offload_activations).
    prepare: changes the whole model before it is split (Llama: LoRA adapters, llama_tensor_parallel_parity);
    the optimizer then steps what trains. lisa: Llama only, a factory (model, optimizer) -> an object whose
    step() runs before each optimizer step (functools.partial(labkit.peft.LISA, gamma=1, interval=20, seed=0):
    the optimizer is then over every parameter, as LISA requires)."""
    from labkit.recompute import checkpoint_blocks
    from labkit.recompute import offload_activations as offloaded

    from labkit.distributed import tensor_parallel as tp
    from labkit.memory.ledger import Ledger

    if work.family == "llama":  # transformers' Llama: no sequence parallelism here
        if sequence_parallel:
            raise ValueError("sequence parallelism runs labkit's GPT only (tensor_parallel.TPGPT)")
        base = build_model(work)
        if prepare is not None:
            prepare(base)
        model = tp.parallelize_llama(base, rank, world_size)
    else:
        model = tp.parallelize(build_model(_labkit_only(work)), rank, world_size,
                               sequence_parallel=sequence_parallel)
    if step_in_backward and sequence_parallel:
        raise ValueError("step_in_backward with sequence parallelism: the norms' gradients are partial sums "
                         "until sync_replicated_grads, after backward")
    if optimizer_offload:
        from labkit.optim import OffloadAdamW

        opt = OffloadAdamW(model.parameters(), lr=1e-3, offload=optimizer_offload)
    elif step_in_backward:
        from labkit.optim import StepInBackward

        opt = StepInBackward(model.parameters(), torch.optim.AdamW, lr=1e-3)
    else:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad or lisa], lr=1e-3)
    before = lisa(model.model, opt).step if lisa is not None else (lambda: None)
    batch = work.batch
    micro = micro_batch or batch
    with checkpoint_blocks(model.model if work.family == "llama" else model, checkpoint), Ledger(model, opt) as led:
        x, y = (t.clone() for t in batch_of(batch, work.seq, model.config.vocab_size))
        for _ in range(steps):
            before()
            for xs, ys in zip(x.split(micro), y.split(micro)):
                with offloaded() if offload_activations else contextlib.nullcontext():
                    loss = model(xs, ys) * (micro / batch)
                    loss.backward()
                del loss
            tp.sync_replicated_grads(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
    meas = _paged(led.measurement(), paged).of_step(steps)
    return {"peak": meas.peak.as_dict(), "peak_phase": meas.peak_phase,
            "phases": {k: v.as_dict() for k, v in meas.phases.items()},
            "n_params": sum(p.numel() for p in model.parameters()), "unified": meas.unified}


def pipeline_memories(rank, world_size, work: Workload, m: int, names=("gpipe", "1f1b"), checkpoint: bool = False,
                      prepare=None, optimizer_offload: str | None = None, offload_activations: bool = False,
                      paged: bool = False, galore_rank: int = 0):
    """pipeline_memory for several schedules in one launch: {schedule: result}."""
    return {name: pipeline_memory(rank, world_size, work, m, name, checkpoint=checkpoint, prepare=prepare,
                                  optimizer_offload=optimizer_offload, offload_activations=offload_activations,
                                  paged=paged, galore_rank=galore_rank)
            for name in names}


def tp_memories(rank, world_size, layer: Workload, step: Workload, micro_batch: int):
    """tp_activation_memory of `layer` (bf16; Korthikanti et al.'s setting wants dropout and materialised
    attention in its cfg) and tp_step_memory of `step` in micro-batches of `micro_batch` rows, without and with
    sequence parallelism, in one launch."""
    return {"layer": tp_activation_memory(rank, world_size, layer),
            "step": {sp: tp_step_memory(rank, world_size, step, micro_batch, sp) for sp in (False, True)}}


def many(rank, world_size, calls):
    """Several rank functions of this module in one launch (start-up is the slow part on a busy CPU):
    calls = [(name, args), ...]; returns their results in order."""
    return [globals()[name](rank, world_size, *args) for name, args in calls]
