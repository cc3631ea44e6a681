"""Pipeline parallelism from scratch: a GPT cut by layers into stages, one per rank, micro-batches passed
from stage to stage with send/recv, run under GPipe or 1F1B.

    stages = split_layers(n_layer=4, n_stages=2)            # [(0, 2), (2, 4)]: blocks per stage
    stage = build_stage(model, rank, n_stages)              # embeddings + blocks 0-1, or blocks 2-3 + head
    actions = schedule("1f1b", m=4, n_stages=2, stage=rank) # [("F", 0), ("F", 1), ("B", 0), ...]
    run = run_step(stage, actions, x, y, m)                 # loss, per-action timestamps, in-flight counts
    # (a middle stage of 3 or more has neither ids nor targets: run_step(stage, actions, None, None, m,
    #  batch_shape=(B, T)) sizes what it receives)
    sync_tied_grads(stage)                                  # the embedding shared by the first and last stage

Schedules (Huang et al. 2019, GPipe; Narayanan et al. 2021, PipeDream-Flush / Megatron's 1F1B): with p
stages and m micro-batches both leave the same bubble, an idle fraction (p - 1) / (m + p - 1) of the
step, but GPipe keeps the activations of all m micro-batches until its backwards begin, while 1F1B
starts backwards after p - s forwards on stage s and so holds at most min(p - s, m) of them.

Communication goes through labkit.distributed.comms only (send/isend/recv and one all-reduce of the tied
embedding's gradient), so a CommLog sees every byte.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.distributed import comms
from labkit.memory.report import Category
from labkit.recompute.checkpoint import checkpoint as recompute

__all__ = ["split_layers", "Stage", "build_stage", "schedule", "gpipe", "one_f_one_b", "run_step", "StepRun",
           "sync_tied_grads", "p2p_group", "simulate", "durations_of", "bubble_fraction", "measured_bubble",
           "max_in_flight"]

SCHEDULES = ("gpipe", "1f1b")


# ---- the model cut into stages -------------------------------------------------------------------------
def split_layers(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    """[start, stop) of the blocks each stage holds: as equal as possible, the first stages one more."""
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"pipeline: the number of stages must be a positive integer, got {n_stages!r}")
    if n_stages > n_layer:
        raise ValueError(f"pipeline: {n_stages} stages for a model of {n_layer} layers: each stage needs at "
                         f"least one block (use at most {n_layer} stages)")
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        stop = start + base + (1 if s < extra else 0)
        out.append((start, stop))
        start = stop
    return out


class Embed(nn.Module):
    """Stage 0's front: token + learned position embeddings, then dropout (labkit's GPT and GPT-2 alike)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class Head(nn.Module):
    """The last stage's end: final LayerNorm and the output projection to the vocabulary."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)


class Stage(nn.Module):
    """One pipeline stage: (Embed on the first stage) + consecutive blocks + (Head on the last stage).

    `tied` is True on the first and last stage of a model whose output head shares the embedding matrix:
    each of the two holds its own copy and their gradients are summed after backward (sync_tied_grads),
    as Megatron-LM does with its "embedding group". `checkpoint`: each block runs under
    labkit.recompute.checkpoint (full activation recomputation of each block):
    a micro-batch in flight holds its blocks' inputs only."""

    def __init__(self, blocks: list[nn.Module], index: int, n_stages: int, embed: Embed | None = None,
                 head: Head | None = None, tied: bool = False, layers: tuple[int, int] = (0, 0),
                 checkpoint: bool = False):
        super().__init__()
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head
        self.index, self.n_stages, self.tied, self.layers = index, n_stages, tied, layers
        self.checkpoint = checkpoint

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)  # token ids (B, T) -> (B, T, C)
        for block in self.blocks:
            x = recompute(block, x) if self.checkpoint else block(x)
        return self.head(x) if self.head is not None else x  # logits (B, T, V) or the hidden state (B, T, C)

    def tied_weight(self) -> nn.Parameter | None:
        """The shared embedding matrix this stage holds (first: the token embedding, last: the head)."""
        if not self.tied:
            return None
        return self.embed.wte.weight if self.is_first else self.head.lm_head.weight


def _parts(model: nn.Module):
    """(wte, wpe, drop, blocks, ln_f, lm_head) of labkit's GPT or a transformers GPT-2."""
    if hasattr(model, "blocks") and hasattr(model, "wte"):  # labkit.models.GPT
        return model.wte, model.wpe, model.drop, model.blocks, model.ln_f, model.lm_head
    tr = getattr(model, "transformer", None)
    if tr is not None and hasattr(tr, "h"):  # transformers GPT2LMHeadModel
        return tr.wte, tr.wpe, tr.drop, tr.h, tr.ln_f, model.lm_head
    raise ValueError(f"pipeline: cannot cut a {type(model).__name__} into stages; labkit's GPT and "
                     "transformers' GPT-2 are supported")


def build_stage(model: nn.Module, index: int, n_stages: int, checkpoint: bool = False) -> Stage:
    """Stage `index` of `n_stages`: deep copies of its modules from `model` (every rank builds the whole
    model from the same seed and keeps its own stage; a real job would build only its part); checkpoint:
    each block checkpointed (Stage)."""
    wte, wpe, drop, blocks, ln_f, lm_head = _parts(model)
    if not 0 <= index < n_stages:
        raise ValueError(f"pipeline: stage {index} does not exist in {n_stages} stages")
    start, stop = split_layers(len(blocks), n_stages)[index]
    is_first, is_last = index == 0, index == n_stages - 1
    shared = lm_head.weight is wte.weight
    full_names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        full_names.setdefault(id(p), name)  # a tied matrix: the name it has first (the embedding's)
    parts = {"embed": Embed(wte, wpe, drop) if is_first else None, "head": Head(ln_f, lm_head) if is_last else None,
             **{f"blocks.{j}": b for j, b in enumerate(blocks[start:stop])}}
    copies = {k: copy.deepcopy(v) for k, v in parts.items() if v is not None}
    if is_first and is_last and shared:  # one stage: keep the tie itself
        copies["head"].lm_head.weight = copies["embed"].wte.weight
    stage = Stage([copies[f"blocks.{j}"] for j in range(stop - start)], index, n_stages, copies.get("embed"),
                  copies.get("head"), tied=shared and n_stages > 1 and (is_first or is_last), layers=(start, stop),
                  checkpoint=checkpoint)
    stage.origin = {}  # this stage's parameter name -> the whole model's name for it
    for key, part in copies.items():
        for (name, _), (_, orig) in zip(part.named_parameters(remove_duplicate=False),
                                        parts[key].named_parameters(remove_duplicate=False)):
            stage.origin.setdefault(f"{key}.{name}", full_names[id(orig)])
    return stage


def sync_tied_grads(stage: Stage, group=None) -> None:
    """Sum the shared embedding's gradient over the first and last stage (both hold it): the gradient
    one process would have, where the one matrix collects both uses. `group` holds those two ranks."""
    w = stage.tied_weight()
    if w is not None and w.grad is not None:
        comms.all_reduce(w.grad, group=group, tag="tied embedding grad")


def tied_group(n_stages: int):
    """The process group of the first and last stage (every rank must call this, in the same order)."""
    return comms.new_group([0, n_stages - 1]) if n_stages > 1 else None


_P2P: dict = {}


def p2p_group():
    """The process group the stages' sends and receives go on: every rank, without the DETAIL wrapper
    (comms.plain_group), made once per default group. On the default group the wrapper counts each send and
    receive in its sequence number: a middle stage (p >= 3) sends and receives twice as often as the first and
    last, so the next collective there (a barrier, the optimizer's all-reduce) would fail its cross-rank check.
    run_step makes it on its first call (every rank calls run_step, so every rank makes it, in the same order)."""
    import torch.distributed as dist

    key = id(dist.group.WORLD)
    if key not in _P2P:
        _P2P.clear()
        _P2P[key] = comms.plain_group()
    return _P2P[key]


# ---- schedules: the order of forwards (F) and backwards (B) of micro-batches on one stage -----------------
def gpipe(m: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    """All m forwards, then all m backwards (Huang et al. 2019)."""
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(m: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    """Warm-up: p - s - 1 forwards; steady state: one forward, one backward; cool-down: the last backwards.
    Stage s never holds more than min(p - s, m) micro-batches (Narayanan et al. 2021, section 2.2)."""
    warm = min(n_stages - stage - 1, m)
    out = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < m:
        out += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    out += [("B", i) for i in range(b, m)]
    return out


def schedule(name: str, m: int, n_stages: int, stage: int) -> list[tuple[str, int]]:
    """The actions of `stage` under schedule `name` ("gpipe" or "1f1b") for m micro-batches."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline: schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"pipeline: the number of micro-batches must be an integer >= 1, got {m!r}")
    return (gpipe if name == "gpipe" else one_f_one_b)(m, n_stages, stage)


def max_in_flight(actions: list[tuple[str, int]]) -> int:
    """The most micro-batches whose forward ran and whose backward has not: the activations a stage holds."""
    live = most = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


# ---- running one step ---------------------------------------------------------------------------------------
@dataclass
class StepRun:
    """What one stage did in one step: the loss (last stage), when each action ran, and in-flight counts."""

    stage: int
    loss: float | None = None  # mean loss over the micro-batches (last stage only)
    times: list[tuple[str, int, float, float]] = field(default_factory=list)  # (F/B, micro-batch, start, end)
    in_flight: list[int] = field(default_factory=list)  # micro-batches held after each action
    wire_bytes: float = 0.0  # bytes this stage sent (activations forward, gradients backward)


def run_step(stage: Stage, actions: list[tuple[str, int]], inputs: torch.Tensor | None,
             targets: torch.Tensor | None, m: int, ledger=None, ranks: list[int] | None = None,
             batch_shape: tuple[int, int] | None = None) -> StepRun:
    """Run one stage's actions for one training step; gradients accumulate in the stage's parameters.

    inputs: token ids (B, T) on the first stage; targets: (B, T) on the last; both split into m micro-batches
    of B / m rows. Each micro-batch's loss is the mean over its rows divided by m, so the gradients are
    those of the mean loss over the whole batch (torch.distributed.pipelining does the same: it divides
    by m). Activations go to the next stage with isend (the stage goes on at once); gradients come back
    with recv. `ledger` (labkit.memory.Ledger), if given, is told that a received input is an activation.
    `ranks`: the global rank of each stage (default 0 .. p - 1; one pipeline of several, beside data
    parallelism, has its own, see labkit.distributed.mesh).
    `batch_shape`: (B, T) of the whole batch, for a middle stage (p >= 3), which holds neither the token ids
    nor the targets but must size the activations it receives; the first and last stage read it from theirs.
    """
    xs = inputs.chunk(m) if inputs is not None else None
    ys = targets.chunk(m) if targets is not None else None
    if stage.is_first and (xs is None or len(xs) != m):
        raise ValueError(f"pipeline: stage 0 needs inputs whose batch divides into {m} micro-batches")
    if stage.is_last and (ys is None or len(ys) != m):
        raise ValueError(f"pipeline: the last stage needs targets whose batch divides into {m} micro-batches")
    link = _Link(stage, ranks, _hidden_shape(stage, xs, ys, batch_shape, m), ledger)
    run = StepRun(stage.index)
    with comms.CommLog() as log:
        for kind, i in actions:
            if kind == "F":  # the first stage reads its ids, the last its targets; the others receive
                t0, t1 = link.forward(i, xs[i] if stage.is_first else None, ys[i] if stage.is_last else None, m)
            else:
                t0, t1 = link.backward(i)
            run.times.append((kind, i, t0, t1))
            run.in_flight.append(len(link.held))
        link.finish()
    run.wire_bytes = log.wire()
    if stage.is_last:
        run.loss = float(torch.stack(link.losses).sum())
    return run


class _Link:
    """One stage's side of a step: it receives from and sends to its neighbours, and holds each micro-batch from
    its forward to its backward. `forward` and `backward` return when the computation started and ended."""

    def __init__(self, stage: Stage, ranks, shape: tuple[int, int, int], ledger):
        p = stage.n_stages
        ranks = list(range(p)) if ranks is None else list(ranks)
        if len(ranks) != p:
            raise ValueError(f"pipeline: ranks must name one global rank per stage ({p}), got {ranks!r}")
        self.stage, self.shape, self.ledger = stage, shape, ledger
        self.prev = None if stage.is_first else ranks[stage.index - 1]
        self.next = None if stage.is_last else ranks[stage.index + 1]
        self.group = p2p_group() if p > 1 else None
        self.dtype = next(stage.parameters()).dtype
        self.held: dict[int, tuple] = {}  # micro-batch -> (its input, its output or loss, the send of its output)
        self.grad_send = None  # the last gradient sent back (one in flight at a time)
        self.losses: list[torch.Tensor] = []  # each micro-batch's loss / m (last stage)

    def forward(self, i: int, x: torch.Tensor | None, y: torch.Tensor | None, m: int) -> tuple[float, float]:
        """Micro-batch i's forward on input x (received when None), to its loss on targets y or sent on."""
        if x is None:
            x = comms.recv(torch.empty(self.shape, dtype=self.dtype), src=self.prev, group=self.group,
                           tag=f"activation {i}")
            x.requires_grad_(True)
            if self.ledger is not None:
                self.ledger.track(x, Category.ACT)
        t0 = time.perf_counter()
        out = self.stage(x)
        if y is not None:
            out = F.cross_entropy(out.view(-1, out.shape[-1]), y.reshape(-1)) / m
            self.losses.append(out.detach())
        t1 = time.perf_counter()
        # the send holds the output until it completes: it is waited on (done, since its gradient came back) at
        # this micro-batch's backward
        sent = None if self.next is None else comms.isend(out.detach(), dst=self.next, group=self.group,
                                                          tag=f"activation {i}")
        self.held[i] = (x, out, sent)
        return t0, t1

    def backward(self, i: int) -> tuple[float, float]:
        """Micro-batch i's backward from its loss or the next stage's gradient; its input's gradient goes back."""
        x, out, sent = self.held.pop(i)
        if self.next is None:
            t0 = time.perf_counter()
            out.backward()
        else:
            grad = comms.recv(torch.empty_like(out), src=self.next, group=self.group, tag=f"grad {i}")
            sent.wait()
            t0 = time.perf_counter()
            torch.autograd.backward(out, grad)
            if self.ledger is not None:  # made between two forwards, it is no activation: say so
                self.ledger.track(grad, Category.TEMP)
            del grad
        t1 = time.perf_counter()
        del out, sent
        if self.prev is not None:
            if self.grad_send is not None:
                self.grad_send.wait()
            self.grad_send = comms.isend(x.grad, dst=self.prev, group=self.group, tag=f"grad {i}")
        return t0, t1

    def finish(self) -> None:  # waits for the last gradient sent back
        if self.grad_send is not None:
            self.grad_send.wait()
        self.grad_send = None


def _hidden_shape(stage: Stage, xs, ys, batch_shape, m: int) -> tuple[int, int, int]:
    """(rows per micro-batch, T, C) of what passes between stages."""
    blk = stage.blocks[0]
    C = next(p for n, p in blk.named_parameters() if n.endswith("weight")).shape[-1]
    if xs is not None or ys is not None:
        ref = xs[0] if xs is not None else ys[0]
        return (ref.shape[0], ref.shape[1], C)
    if batch_shape is None or len(batch_shape) != 2:
        raise ValueError(f"pipeline: stage {stage.index} of {stage.n_stages} is a middle stage (no token ids, no "
                         f"targets): give batch_shape=(B, T) of the whole batch so it can size what it receives")
    B, T = batch_shape
    if B % m:
        raise ValueError(f"pipeline: a batch of {B} rows does not divide into {m} micro-batches")
    return (B // m, T, C)


# ---- the bubble ---------------------------------------------------------------------------------------------
def bubble_fraction(n_stages: int, m: int) -> Fraction:
    """(p - 1) / (m + p - 1): the idle share of a step of p equal stages with m micro-batches (GPipe, 1F1B)."""
    return Fraction(n_stages - 1, m + n_stages - 1)


def simulate(name: str, m: int, n_stages: int, t_f: float = 1.0, t_b: float = 2.0,
             durations: dict | None = None) -> list[list[tuple]]:
    """Each stage's actions with start and end times when every forward takes t_f and every backward t_b
    (or, given `durations` {(stage, kind, i): seconds}, what each action took when measured), and an action
    starts as soon as its stage is free and its input has arrived (communication free):
    [[(kind, micro-batch, start, end), ...] per stage]."""
    acts = [schedule(name, m, n_stages, s) for s in range(n_stages)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, i, stage) -> end time
    pos, free = [0] * n_stages, [0.0] * n_stages
    out: list[list[tuple]] = [[] for _ in range(n_stages)]
    while any(pos[s] < len(acts[s]) for s in range(n_stages)):
        progressed = False
        for s in range(n_stages):
            if pos[s] == len(acts[s]):
                continue
            kind, i = acts[s][pos[s]]
            dep = ("F", i, s - 1) if kind == "F" and s > 0 else ("B", i, s + 1) if kind == "B" and s < n_stages - 1 \
                else None
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0.0)
            if durations is not None:
                end = start + durations[(s, kind, i)]
            else:
                end = start + (t_f if kind == "F" else t_b)
            done[(kind, i, s)], free[s] = end, end
            out[s].append((kind, i, start, end))
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline: schedule {name!r} deadlocks")  # cannot happen for gpipe and 1f1b
    return out


def durations_of(timelines: list[list[tuple]]) -> dict:
    """{(stage, kind, i): end - start} of measured timelines (StepRun.times per stage), for simulate()."""
    return {(s, kind, i): end - start for s, tl in enumerate(timelines) for kind, i, start, end in tl}


def measured_bubble(timelines: list[list[tuple]]) -> float:
    """Idle share of the step from each stage's (kind, i, start, end): 1 - busy / (stages x span), where the
    span runs from the first action's start to the last action's end over all stages."""
    start = min(t[2] for tl in timelines for t in tl)
    end = max(t[3] for tl in timelines for t in tl)
    busy = sum(t[3] - t[2] for tl in timelines for t in tl)
    return 1.0 - busy / (len(timelines) * (end - start))
