"""Gradient compression for data parallelism: Deep Gradient Compression (DGC) from scratch, and the byte and
memory formulas of PyTorch's PowerSGD hook, so each rank sends far fewer bytes than a dense all-reduce.

DGC (Lin et al., "Deep Gradient Compression", ICLR 2018, arXiv 1712.01887) sends only the largest k entries of
each gradient tensor (top-k sparsification) as (values, indices) and keeps the rest locally, added to the next
step's gradient, so nothing is lost, only delayed. Four techniques keep accuracy (each switchable here):

- momentum correction: accumulate the *momentum* u = m u + g locally, not the raw gradient, and step plain SGD;
- local gradient clipping: clip each rank's gradient before it is accumulated (norm threshold x N^(-1/2));
- momentum factor masking: zero u where an entry was sent, so stale momentum does not push it again;
- warm-up: sparsity rises exponentially, 75 % -> 93.75 % -> 98.4375 % -> 99.6 % -> the final 99.9 %.

Per tensor and step (paper, Algorithm 1 with momentum correction):

    g = clip(g, c / sqrt(N))                 # local gradient clipping
    u = m * u + g                             # momentum correction (else u is just g)
    v = v + u                                 # residual: what was not sent yet
    idx = top-k(|v|);  send v[idx], idx       # all-gather (values, indices) from every rank
    v[idx] = 0;  u[idx] = 0                   # u[idx] = 0 is momentum factor masking
    g_avg = scatter-add(every rank's values) / N

Two ways to run it, which give the same parameters bit for bit (the per-tensor arithmetic is the same code):
`DGC.hook` is a DDP communication hook (`ddp.register_comm_hook(dgc, DGC.hook)`), and `DGC.sync_gradients`
compresses a plain model's `.grad`s after backward. DGC saves communication, not memory: it keeps one fp32
residual per parameter, plus one momentum buffer with momentum correction (`dgc_state_bytes`).

This implementation compresses every tensor (the paper's code leaves 1-D tensors dense); clipping is per
tensor (a comm hook sees one bucket at a time, never the whole model's norm).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comms

__all__ = ["DGCConfig", "PowerSGDConfig", "DGC", "topk_sparsify", "warmup_density", "density_at", "dgc_state_bytes",
           "dgc_wire_bytes", "dense_wire_bytes", "powersgd_wire_bytes", "powersgd_state_bytes",
           "check_sparsity", "check_rank"]

INDEX_DTYPE = torch.int32  # 4-byte indices on the wire (a tensor here has fewer than 2^31 elements)


def check_sparsity(sparsity) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 < sparsity < 1.0:
        raise ValueError(f"sparsity must be a number in (0, 1) (the fraction of entries not sent), got {sparsity!r}")
    return float(sparsity)


def check_rank(rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"PowerSGD rank must be an integer >= 1, got {rank!r}")
    return rank


@dataclass(frozen=True)
class DGCConfig:
    """What DGC does; each of the paper's four techniques can be switched off."""

    sparsity: float = 0.999           # final fraction of each tensor's entries NOT sent (0.999: 0.1 % sent)
    momentum: float = 0.9             # m of momentum SGD
    momentum_correction: bool = True  # accumulate m u + g (then step plain SGD); off: accumulate g, SGD applies m
    clip_norm: float | None = 1.0     # local clipping: each tensor's gradient norm <= clip_norm / sqrt(N); None: off
    momentum_masking: bool = True     # zero the momentum u where an entry was sent
    warmup_steps: int = 4             # steps per warm-up stage (sparsity 75 %, 93.75 %, ...); 0: final sparsity at once
    warmup_start: float = 0.75        # sparsity of the first warm-up stage; each stage keeps this fraction fewer

    def __post_init__(self):
        check_sparsity(self.sparsity)
        check_sparsity(self.warmup_start)
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be a positive number or None, got {self.clip_norm!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")

    def without(self, technique: str) -> "DGCConfig":
        """The same config with one technique off: "momentum_correction", "clipping", "masking" or "warmup"."""
        off = {"momentum_correction": {"momentum_correction": False}, "clipping": {"clip_norm": None},
               "masking": {"momentum_masking": False}, "warmup": {"warmup_steps": 0}}
        if technique not in off:
            raise ValueError(f"technique must be one of {', '.join(off)}, got {technique!r}")
        return DGCConfig(**{**self.__dict__, **off[technique]})

    @property
    def sgd_momentum(self) -> float:
        """The momentum the optimizer must apply: 0 with momentum correction (u already holds it), else m."""
        return 0.0 if self.momentum_correction else self.momentum


@dataclass(frozen=True)
class PowerSGDConfig:
    """What PyTorch's PowerSGD DDP hook does (labkit.distributed.comm_ranks hands these to its PowerSGDState)."""

    rank: int = 1                # matrix_approximation_rank: columns of P and Q (1: the most compression)
    start_iter: int = 2          # steps of plain all-reduce before it compresses (DDP rebuilds its buckets in step 1)
    error_feedback: bool = True  # keep each bucket's compression error and add it to the next step's gradient
    warm_start: bool = True      # start each step's power iteration from the last step's Q
    bucket_mb: float = 25        # DDP's bucket size in MB (its default); the hook compresses one bucket at a time

    def __post_init__(self):
        check_rank(self.rank)
        if isinstance(self.start_iter, bool) or not isinstance(self.start_iter, int) or self.start_iter < 0:
            raise ValueError(f"PowerSGD start_iter must be an integer >= 0, got {self.start_iter!r}")
        if (self.error_feedback or self.warm_start) and self.start_iter < 2:
            raise ValueError(f"PowerSGD start_iter must be >= 2 with error feedback or warm start (the hook "
                             f"compresses only after DDP's first two steps), got {self.start_iter}")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise ValueError(f"PowerSGD bucket_mb must be a positive number of MB, got {self.bucket_mb!r}")


# ---- the pieces, each a pure function ---------------------------------------------------------------
def warmup_density(stage: int, final_sparsity: float, warmup_start: float = 0.75) -> float:
    """Fraction of entries sent in warm-up stage `stage` (0, 1, ...): (1 - warmup_start)^(stage + 1), never
    below the final 1 - final_sparsity. With 0.75 and 0.999: 25 %, 6.25 %, 1.5625 %, 0.39 %, then 0.1 %."""
    check_sparsity(final_sparsity)
    check_sparsity(warmup_start)
    if stage < 0:
        raise ValueError(f"stage must be >= 0, got {stage!r}")
    return max((1.0 - warmup_start) ** (stage + 1), 1.0 - final_sparsity)


def density_at(step: int, cfg: DGCConfig) -> float:
    """Fraction of entries sent at `step` (from 0): the warm-up stage step // warmup_steps, or the final one."""
    if cfg.warmup_steps == 0:
        return 1.0 - cfg.sparsity
    return warmup_density(step // cfg.warmup_steps, cfg.sparsity, cfg.warmup_start)


def k_of(numel: int, density: float) -> int:
    """Entries sent of a tensor of `numel`: ceil(numel x density), at least 1."""
    return max(1, math.ceil(numel * density - 1e-9))


def topk_sparsify(t: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k entries of flat `t` largest in magnitude; indices int32."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1 (entries to send), got {k!r}")
    flat = t.reshape(-1)
    if k > flat.numel():
        raise ValueError(f"k = {k} is more than the tensor's {flat.numel()} entries")
    idx = flat.abs().topk(k, sorted=False).indices
    return flat[idx], idx.to(INDEX_DTYPE)


def dgc_state_bytes(n_params: int, cfg: DGCConfig, bytes_per_value: int = 4) -> int:
    """Bytes DGC keeps per rank: a residual v per parameter, and a momentum u per parameter with momentum
    correction: (1 + momentum_correction) x params x 4 in fp32."""
    return (1 + int(cfg.momentum_correction)) * n_params * bytes_per_value


def dense_wire_bytes(n_params: int, world: int, bytes_per_value: int = 4) -> float:
    """Bytes each rank sends for a dense all-reduce of the gradients: 2 (N-1)/N x 4 x params."""
    return comms.wire_bytes("all_reduce", n_params * bytes_per_value, world)


def dgc_wire_bytes(numels: list[int], density: float, world: int) -> float:
    """Bytes each rank sends for one DGC step: an all-gather of k values (fp32) and k indices (int32) per tensor
    from every rank: (N-1)/N x N x 8 sum(k)."""
    ks = sum(k_of(n, density) for n in numels)
    return comms.wire_bytes("all_gather", world * ks * 4, world) + comms.wire_bytes("all_gather", world * ks * 4, world)


def _as_matrix(shape) -> tuple[int, int]:
    """How PowerSGD views a tensor: (shape[0], the rest)."""
    n = shape[0] if len(shape) else 1
    numel = math.prod(shape)
    return n, numel // n


def powersgd_payload(shapes: list[tuple], rank: int, min_compression_rate: float = 2) -> dict[str, int]:
    """Elements of the three all-reduces PyTorch's powerSGD_hook issues for one bucket of these tensor shapes:
    the uncompressed tensors, all the P = M Q (n x r each) and all the Q = M^T P (m x r each). A tensor is
    compressed when (n + m) r' min_compression_rate < n m, with r' = min(n, m, rank)."""
    check_rank(rank)
    out = {"uncompressed": 0, "P": 0, "Q": 0}
    for s in shapes:
        n, m = _as_matrix(s)
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            out["P"] += n * r
            out["Q"] += m * r
        else:
            out["uncompressed"] += n * m
    return out


def powersgd_wire_bytes(buckets: list[list[tuple]], rank: int, world: int, min_compression_rate: float = 2,
                        bytes_per_value: int = 4) -> float:
    """Bytes each rank sends per compressed step: three ring all-reduces per bucket (uncompressed, P, Q)."""
    total = 0.0
    for shapes in buckets:
        for n in powersgd_payload(shapes, rank, min_compression_rate).values():
            total += comms.wire_bytes("all_reduce", n * bytes_per_value, world)
    return total


def powersgd_state_bytes(buckets: list[list[tuple]], rank: int, min_compression_rate: float = 2,
                         use_error_feedback: bool = True, warm_start: bool = True, bytes_per_value: int = 4) -> int:
    """Bytes the hook keeps between steps: with error feedback a residual as large as each bucket (all its
    elements), with warm start the P and Q memories of the compressed tensors."""
    total = 0
    for shapes in buckets:
        if use_error_feedback:
            total += sum(math.prod(s) for s in shapes)
        if warm_start:
            pay = powersgd_payload(shapes, rank, min_compression_rate)
            total += pay["P"] + pay["Q"]
    return total * bytes_per_value


# ---- DGC on a rank --------------------------------------------------------------------------------------
class DGC:
    """DGC's per-rank state (residual v and momentum u per parameter) and its two entry points.

    Plain path: after backward, `dgc.sync_gradients()` replaces every `.grad` by the average over ranks of the
    sparse updates. DDP path: `ddp.register_comm_hook(dgc, DGC.hook)`; DDP hands it one bucket at a time.
    Then step SGD with momentum `cfg.sgd_momentum`. Call `dgc.next_step()` after each optimizer step."""

    def __init__(self, named_params, cfg: DGCConfig = DGCConfig(), group=None):
        self.cfg, self.group = cfg, group
        self.params = [(n, p) for n, p in named_params if p.requires_grad]
        self.names = {p: n for n, p in self.params}
        self.step = 0
        self.v: dict[str, torch.Tensor] = {}  # residual (accumulated, not yet sent), one per parameter
        self.u: dict[str, torch.Tensor] = {}  # momentum, one per parameter (momentum correction only)
        self.sent: list[int] = []             # entries this rank sent per exchange (a step, or a DDP bucket)

    @property
    def density(self) -> float:
        return density_at(self.step, self.cfg)

    def buffers(self) -> list[torch.Tensor]:
        return [*self.v.values(), *self.u.values()]

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    # -- one tensor: clip, accumulate, pick top-k, clear what is sent --
    @torch.no_grad()
    def _compress(self, name: str, g: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        g = g.reshape(-1)
        if cfg.clip_norm is not None:
            limit = cfg.clip_norm / math.sqrt(world)
            norm = g.norm()
            if norm > limit:
                g = g * (limit / norm)
        if name not in self.v:
            self.v[name] = torch.zeros_like(g)
            if cfg.momentum_correction:
                self.u[name] = torch.zeros_like(g)
        v = self.v[name]
        if cfg.momentum_correction:
            u = self.u[name]
            u.mul_(cfg.momentum).add_(g)
            v.add_(u)
        else:
            v.add_(g)
        values, idx = topk_sparsify(v, k_of(v.numel(), self.density))
        values = values.clone()
        v[idx.long()] = 0
        if cfg.momentum_correction and cfg.momentum_masking:
            self.u[name][idx.long()] = 0
        return values, idx

    def _exchange(self, parts: list[tuple[str, torch.Tensor]], tag: str) -> list[torch.Tensor]:
        """Compress each (name, gradient), all-gather every rank's values and indices in one call each, and
        return each tensor's average over ranks (dense, flat)."""
        world = dist.get_world_size(self.group)
        vals, idxs, ks = [], [], []
        for name, g in parts:
            v, i = self._compress(name, g, world)
            vals.append(v)
            idxs.append(i)
            ks.append(v.numel())
        sent_v, sent_i = torch.cat(vals), torch.cat(idxs)  # (sum k,)
        all_v = torch.empty(world * sent_v.numel(), dtype=sent_v.dtype)
        all_i = torch.empty(world * sent_i.numel(), dtype=sent_i.dtype)
        comms.all_gather(all_v, sent_v, group=self.group, tag=f"dgc values {tag}")
        comms.all_gather(all_i, sent_i, group=self.group, tag=f"dgc indices {tag}")
        all_v, all_i = all_v.view(world, -1), all_i.view(world, -1)
        self.sent.append(sent_v.numel())
        out, off = [], 0
        for (name, g), k in zip(parts, ks):
            dense = torch.zeros(g.numel(), dtype=g.dtype)
            for r in range(world):  # rank order: the same sums on every rank and in both paths
                dense.index_add_(0, all_i[r, off:off + k].long(), all_v[r, off:off + k])
            out.append(dense.div_(world))
            off += k
        return out

    # -- plain path --
    @torch.no_grad()
    def sync_gradients(self) -> None:
        parts = [(n, p.grad) for n, p in self.params]
        for (n, p), avg in zip(self.params, self._exchange(parts, "all")):
            p.grad.copy_(avg.view_as(p.grad))

    def next_step(self) -> None:
        self.step += 1

    # -- DDP path --
    @staticmethod
    def hook(state: "DGC", bucket):  # no annotations: DDP checks them, and this module's are strings
        """DDP communication hook: the bucket's gradients, DGC-compressed, exchanged and averaged, as one flat
        tensor of the bucket's size (a completed future: the exchange is done when it returns)."""
        with torch.no_grad():
            parts = [(state.names[p], g) for p, g in zip(bucket.parameters(), bucket.gradients())]
            avgs = state._exchange(parts, f"bucket {bucket.index()}")
            flat = torch.cat(avgs).to(bucket.buffer().dtype)
        fut = torch.futures.Future()
        fut.set_result(flat)
        return fut
