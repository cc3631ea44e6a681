"""Predict the bytes of one training step, by category and phase, from formulas with named sources.

Peak memory is the largest of the phases' peaks (end of forward, during backward, optimizer step),
never their sum. Every term is a small function whose docstring gives its formula and source.
"""

from __future__ import annotations

from dataclasses import dataclass

from .families import WALKS
from .optim_terms import OPTIMIZERS, TORCH_STATES
from . import optim_terms
from .phases import POLICIES, StepBytes, step_phases
from .report import Breakdown, Category, Estimate, Term
from .spec import ModelSpec, spec_from
from .walk import Walk

DTYPES = ("fp32", "fp16", "bf16", "mixed-fp16", "mixed-bf16")


@dataclass(frozen=True)
class Precision:
    """How a dtype scheme stores things. mixed-*: fp32 master weights in the model + autocast."""

    weight: int  # bytes per parameter element (and per gradient and optimizer-state element)
    autocast: bool  # matmuls on 16-bit copies of weights and inputs

    @classmethod
    def of(cls, dtype: str) -> "Precision":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return cls(4 if dtype in ("fp32", "mixed-fp16", "mixed-bf16") else 2, dtype.startswith("mixed"))


# ---- model states ------------------------------------------------------------------------------
def param_bytes(spec: ModelSpec, prec: Precision) -> int:
    """N x bytes per weight: 4 in fp32 and in mixed precision (the fp32 master copy is the model's own
    weights), 2 in pure fp16/bf16. Source: every predictor (predictors.md section 4)."""
    return spec.n_params * prec.weight


def autocast_copy_bytes(spec: ModelSpec, prec: Precision) -> int:
    """2 x (parameters that enter a matmul): autocast casts each Linear weight and bias to 16-bit
    once per forward and the matmul keeps the copy until backward. This is the '2 bytes of fp16
    weights' of the 18 bytes/parameter in the HF docs (predictors.md section 4)."""
    return 2 * spec.matmul_params if prec.autocast else 0


def grad_bytes(spec: ModelSpec, prec: Precision) -> int:
    """N x bytes per weight: gradients take the parameters' dtype, so fp32 under mixed precision
    (4N, the term Playbook discussion #104 says is missing from 16N; ml-engineering #23)."""
    return spec.n_params * prec.weight


def optimizer_state_bytes(spec: ModelSpec, prec: Precision, optimizer: str, rank: int | None = None) -> int:
    """k x N x bytes per weight + 4 bytes of step counter per tensor for Adam.
    k = 0 (SGD), 1 (momentum buffer), 2 (Adam's m and v). torch.optim keeps state in the
    parameters' dtype: 8N for fp32 Adam (12N with the master copy, as ZeRO's K = 12 counts).
    8-bit Adam, Lion, Adafactor and GaLore: see labkit.memory.optim_terms."""
    return optim_terms.state_bytes(spec, prec.weight, optimizer, rank)


def optimizer_temp_bytes(spec: ModelSpec, prec: Precision, optimizer: str, foreach: bool,
                         rank: int | None = None) -> int:
    """Adam's step makes sqrt(v) and sqrt(v)/c before adding eps in place: 2 temporaries the size
    of the largest parameter one tensor at a time (torch.optim single-tensor path, CPU default),
    or of all parameters at once in the foreach path (CUDA default). SGD works in place.
    Others: labkit.memory.optim_terms.temp_bytes."""
    return optim_terms.temp_bytes(spec, prec.weight, optimizer, foreach, rank)


# ---- activations -------------------------------------------------------------------------------
def input_bytes(batch: int, seq: int) -> int:
    """Token ids and targets: 2 x B x S x 8 bytes (int64)."""
    return 2 * batch * seq * 8


def walk_activations(spec: ModelSpec, prec: Precision, batch: int, seq: int, device: str):
    """Bytes saved for backward by the forward walk of the model's family (labkit.memory.families):
    per layer this reproduces Korthikanti et al.'s sbh(34 + 5as/h) for their layer and precision,
    and adds the logits' log-softmax, B x S x V (4 bytes when the loss runs in fp32)."""
    w = Walk(x_bytes=prec.weight, autocast=prec.autocast, device=device)
    marks: list[int] = []
    WALKS[spec.family](w, spec, batch, seq, marks)
    return w, marks


def estimate(model, batch: int, seq: int, dtype: str = "fp32", optimizer: str = "adamw", *,
             device: str = "cpu", foreach: bool | None = None, checkpoint: str = "none",
             segments: int | None = None, offload_activations: bool = False, micro_batch: int | None = None,
             rank: int | None = None, optimizer_offload: str | None = None, step_in_backward: bool = False,
             **overrides) -> Estimate:
    """Predict one steady-state training step (gradients set to None between steps).

    model: preset name, config path, hub id, GPTConfig, GPT or transformers model/config.
    device: "cpu" or "cuda" (fused attention and dropout masks differ); foreach: Adam's foreach
    path (default: on CUDA only, as torch.optim does).
    checkpoint: "none", "full" (k = `segments` segments, default every block), "sqrt" or
    "selective" (keep matmul outputs), as labkit.recompute.checkpoint_blocks applies them.
    offload_activations: saved activations live in host memory (labkit.recompute.offload_activations).
    micro_batch: rows per micro-batch, dividing `batch` (gradient accumulation).
    rank: GaLore's rank (optimizer "galore" or "galore8bit").
    optimizer_offload: "cpu" or "disk": AdamW's state lives off the device (labkit.optim.OffloadAdamW).
    step_in_backward: each parameter steps as soon as its gradient is ready (labkit.optim.StepInBackward).
    """
    for name, v in (("batch", batch), ("seq", seq)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if checkpoint not in POLICIES:
        raise ValueError(f"checkpoint must be one of {', '.join(POLICIES)}, got {checkpoint!r}")
    micro = batch if micro_batch is None else micro_batch
    if not isinstance(micro, int) or isinstance(micro, bool) or micro <= 0 or batch % micro:
        raise ValueError(f"micro_batch must be a positive integer dividing batch ({batch}), got {micro_batch!r}")
    if optimizer.startswith("galore") and (not isinstance(rank, int) or rank <= 0):
        raise ValueError(f"rank must be a positive integer for {optimizer}, got {rank!r}")
    if optimizer_offload not in (None, "cpu", "disk"):
        raise ValueError(f"optimizer_offload must be None, 'cpu' or 'disk', got {optimizer_offload!r}")
    if optimizer_offload and optimizer != "adamw":
        raise ValueError(f"optimizer_offload works with adamw (labkit.optim.OffloadAdamW), not {optimizer!r}")
    if step_in_backward and micro_batch not in (None, batch):
        raise ValueError("step_in_backward cannot accumulate gradients over micro-batches")
    prec = Precision.of(dtype)
    spec = spec_from(model, **overrides)
    if optimizer.startswith("galore") and spec.galore_shapes and rank > min(min(s) for s in spec.galore_shapes):
        raise ValueError(f"rank {rank} exceeds the smaller side of a GaLore matrix "
                         f"({min(min(s) for s in spec.galore_shapes)})")
    if spec.max_positions and seq > spec.max_positions:
        raise ValueError(f"seq {seq} exceeds the model's {spec.max_positions} positions")
    if (checkpoint != "none" or offload_activations) and spec.family != "labkit-gpt":
        raise ValueError("checkpoint and offload_activations are modelled for labkit's GPT (the blocks "
                         "labkit.recompute wraps); use a GPTConfig")
    foreach = (device == "cuda") if foreach is None else foreach
    b, w = step_bytes(spec, prec, batch, micro, seq, optimizer, device, foreach, rank)
    if optimizer_offload:  # state and the step's work live in host memory
        b.O = b.opt_temp = 0
    phases = step_phases(b, spec.n_layer, checkpoint, segments, offload_activations, step_in_backward=step_in_backward)
    if micro < batch:  # later micro-batches: every gradient already exists
        later = step_phases(b, spec.n_layer, checkpoint, segments, offload_activations, grads_exist=True)
        phases = {k: max(phases[k], later[k], key=lambda x: x.total) for k in phases}
    terms = _terms(spec, prec, optimizer, micro, seq, w, b)
    extras = [f"checkpoint={checkpoint}"] * (checkpoint != "none") + ["offload"] * offload_activations
    extras += [f"micro_batch={micro}"] * (micro < batch) + [f"rank={rank}"] * optimizer.startswith("galore")
    extras += [f"optimizer_offload={optimizer_offload}"] * bool(optimizer_offload)
    extras += ["step_in_backward"] * step_in_backward
    label = " ".join([f"{spec.name} B={batch} S={seq} {dtype} {optimizer}", *extras])
    return Estimate(label, spec.n_params, phases, terms)


def step_bytes(spec, prec, B, micro, S, optimizer, device, foreach, rank=None) -> tuple[StepBytes, Walk]:
    """Every byte count the phases need, from the model states and the forward walk of a micro-batch."""
    w, marks = walk_activations(spec, prec, micro, S, device)
    r, h, V, gb, mm = micro * S, spec.hidden, spec.vocab, prec.weight, w.mm_bytes
    lsm = next(t for t in w.saved.values() if t.name == "log_softmax(logits)").nbytes
    probs = sum(t.nbytes for t in w.saved.values() if t.name == "attention probs")
    upcast = r * V * 4 if lsm // (r * V) != mm else 0  # the fp32 copy the loss makes
    L = max(spec.n_layer, 1)
    layer = (marks[-1][0] - marks[0][0]) // L
    kept = (marks[-1][1] - marks[0][1]) // L
    proj_out = 2 * r * h * mm  # the two output projections' results: kept, never saved by autograd
    return StepBytes(
        P=param_bytes(spec, prec), C=autocast_copy_bytes(spec, prec), G=grad_bytes(spec, prec),
        O=optimizer_state_bytes(spec, prec, optimizer, rank),
        opt_temp=optimizer_temp_bytes(spec, prec, optimizer, foreach, rank),
        largest_grad=spec.largest_param * gb,
        inputs=input_bytes(B, S), before=marks[0][0], layer=layer, kept=kept, kept_saved=kept - proj_out,
        after=w.saved_bytes - marks[-1][0], lsm=lsm, logits=r * V * mm + upcast,
        head_temp=r * V * mm + r * h * mm + (V * h * mm if prec.autocast else 0),
        head_grad=(V * h + 2 * h) * gb, stream=r * h * gb,
        # MLP backward: the gradients into and out of the activation are alive while its output is
        # already freed: +1 (exact GELU) or +2 (GELU/SwiGLU in Python ops) B*S*ffn tensors.
        tau=(1 if spec.family == "labkit-gpt" else 2) * r * spec.ffn * mm, tau_grad=spec.ffn * h * mm,
        layer_grad=spec.layer_params * gb, layer_copy=2 * spec.layer_matmul_params if prec.autocast else 0,
        head_copy=2 * V * h if prec.autocast else 0, seg_input=r * h * gb,
        emb_temp=2 * V * h * gb if spec.tied else 0,  # tied: the dense embedding gradient and the sum
        fwd_block=2 * r * h * gb + r * h * (4 if prec.autocast else gb) + (r * h * mm if prec.autocast else 0)
        + 2 * r * spec.ffn * mm,
        offload_back=max(3 * r * spec.ffn * mm, 3 * probs // L + 2 * r * h * mm),
    ), w


def _terms(spec, prec, optimizer, B, S, w, b: StepBytes) -> list[Term]:
    scores = sum(t.nbytes for t in w.saved.values() if "attention probs" in t.name or "attention dropout" in t.name)
    blocks = w.saved_bytes - b.lsm - scores
    return [
        Term("parameters", Category.PARAM, b.P, f"N x {prec.weight} B = {spec.n_params:,} x {prec.weight}", "all predictors"),
        Term("autocast 16-bit weight copies", Category.PARAM, b.C, "2 x matmul parameters", "torch.autocast weight cache"),
        Term("gradients", Category.GRAD, b.G, f"N x {prec.weight} B", "Playbook #104; ml-engineering #23"),
        Term("optimizer state", Category.OPT, b.O, _state_formula(optimizer, prec.weight), "ZeRO K; HF docs; labkit.optim"),
        Term("activations saved by the blocks", Category.ACT, blocks, "forward walk per layer ~ sbh(34 + ...)", "Korthikanti et al. 2022"),
        Term("attention scores (s^2)", Category.ACT, scores, "L x B x a x S^2 x bytes (x2-3 with dropout)", "Korthikanti et al. 2022: 5as/h"),
        Term("log-softmax of the logits", Category.ACT, b.lsm, "B x S x V x bytes (4 if the loss runs in fp32)", "predictors.md 3.10"),
        Term("token ids and targets", Category.ACT, b.inputs, "2 x B x S x 8", "int64 inputs"),
        Term("logits (+ fp32 copy) during the loss", Category.TEMP, b.logits, "B x S x V x bytes", "predictors.md 3.10"),
    ]


def _state_formula(optimizer: str, d: int) -> str:
    return {"adamw8bit": "2N + 8 per 256-block (fp32 below 4096 elements)", "adam8bit": "2N + 8 per 256-block",
            "lion": f"N x {d} B (one momentum)", "adafactor": "4(m + n) per matrix, 4n per vector",
            "galore": f"{d} x r(k + 2K) per attention/MLP matrix, Adam elsewhere",
            "galore8bit": f"{d} x r k + 8-bit moments per matrix"}.get(
        optimizer, f"{TORCH_STATES.get(optimizer, 0)} x N x {d} B (+ step counters)")
