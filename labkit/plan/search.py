"""Search training configurations, keep those labkit's estimator says fit, rank them by fidelity, then time.

The search space, for a model, a device count and a memory budget per device:
  method       full training; with PEFT allowed also LISA (2 active layers, Pan et al. 2024's default), LoRA
               (rank 16 on every linear layer but the head) and QLoRA (the same on an NF4 base)
  precision    the dtypes at least as precise as min_precision: fp32, mixed (autocast over fp32 weights), pure
               16-bit (bf16, or fp16 on a device without bf16); fp32 is tried only where mixed does not fit
               (the same fidelity, its matmuls off the tensor cores)
  optimizer    AdamW, 8-bit AdamW, Adafactor, Lion, GaLore and 8-bit GaLore (rank = the smaller side of the
               model's matrices / 4, the GaLore paper's ratio: rank 128 to 1024 for hidden 512 to 4096)
  layout       with several devices every dp x tp x pp = devices, ZeRO stage 0-3 over dp (what the estimator
               cannot estimate yet, e.g. dp combined with tp or pp, is skipped: it appears once it can)
  settings     checkpointing (none, selective, sqrt, full), micro-batch (divisors of each rank's batch),
               step in backward, optimizer offload, ZeRO-Offload (activation offload is costed by
               labkit.plan.cost but not searched: checkpointing saves the same bytes without the host link)
A family is everything but the settings. Each family gets its fastest setting that fits: its settings are
tried in the order of predicted time (labkit.plan.cost), skipping any that saves no more memory on every axis
than one that already failed; the family's most memory-saving setting is tried first, and when even that does
not fit the family is out. Families are searched by fidelity class, best first (labkit.plan.cost.Fidelity),
and the search stops after the class where it has `top` plans.

Ranking: fidelity first (higher first: fp32 master weights above pure 16-bit weights, then the method, then the
optimizer; labkit.plan.cost), then predicted step time (faster first). A plan whose peak is within `headroom`
(default 10 %) of the budget is flagged (Plan.tight and a why-line): the estimate counts logical bytes, and the
caching allocator's rounding and fragmentation and the CUDA context (a few hundred MiB) come on top.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field
from typing import NamedTuple

from labkit.estimate.recipe import Recipe
from labkit.memory.report import Category
from labkit.memory.units import HEADROOM, fmt_bytes, is_tight  # HEADROOM, is_tight: the one fit rule

from . import cost
from .devices import Device, closest, get_device

OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "lion", "galore", "galore8bit")
PRECISIONS = ("fp32", "mixed", "16-bit")  # min_precision levels; "bf16"/"fp16" mean 16-bit, "mixed-*" mixed
PRECISION_LEVELS = {"fp32": 0, "mixed": 1, "mixed-bf16": 1, "mixed-fp16": 1, "16-bit": 2, "bf16": 2, "fp16": 2}
CHECKPOINTS = ("none", "selective", "sqrt", "full")
LOSS_CHUNKS = 8  # the chunked output loss's chunks plan tries (torchtune's default)
LORA_RANK = 16  # as labkit.estimate.wall's LoRA and QLoRA rows
LISA_LAYERS = 2  # LISA's gamma (Pan et al. 2024)
MAX_MICRO_CHOICES = 6  # micro-batch sizes tried per family (a geometric subset of the divisors)
MAX_TRIES = 16  # estimates per family before it is given up
MAX_DEVICES = 4096


class NoPlanError(ValueError):
    """No configuration fits: names the smallest predicted peak found and the budget."""


@dataclass(frozen=True)
class SearchOptions:
    """What plan() searches and how many plans it returns (beyond the model, the devices and the tokens)."""

    peft: bool | str = False  # False: full training only; True: PEFT only (LISA, LoRA, QLoRA); "allow": both
    min_precision: str = "bf16"  # the least precise dtype allowed (fp32, mixed-bf16, bf16, ...)
    top: int | None = 5  # how many plans (None: every family's best)
    optimizers: tuple[str, ...] = OPTIMIZERS  # those allowed (one name or several, of OPTIMIZERS)
    headroom: float = HEADROOM  # a plan whose peak is above (1 - headroom) x memory is flagged tight

    def __post_init__(self) -> None:
        if self.peft not in (False, True, "allow"):
            raise ValueError(f"peft must be False, True or 'allow', got {self.peft!r}")
        if self.min_precision not in PRECISION_LEVELS:
            raise ValueError(f"min_precision must be one of fp32, mixed-bf16, mixed-fp16, bf16, fp16, "
                             f"got {self.min_precision!r}")
        if self.top is not None and (isinstance(self.top, bool) or not isinstance(self.top, int) or self.top <= 0):
            raise ValueError(f"top must be a positive integer or None, got {self.top!r}")
        opts = (self.optimizers,) if isinstance(self.optimizers, str) else tuple(self.optimizers)
        bad = [o for o in opts if o not in OPTIMIZERS]
        if bad or not opts:
            raise ValueError(f"optimizers must name some of {', '.join(OPTIMIZERS)}, got {bad or list(opts)!r}")
        object.__setattr__(self, "optimizers", opts)
        h = self.headroom
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise ValueError(f"headroom must be a fraction of the budget from 0 to below 1 (e.g. 0.1), got {h!r}")


@dataclass(frozen=True)
class Plan:
    """One feasible configuration, its predicted peak per device, time and fidelity, and why."""

    recipe: Recipe
    peak: int  # bytes on the device that needs the most
    peak_phase: str
    peak_where: str  # the peak moment
    binding: str  # the largest term at the peak moment
    binding_bytes: int
    time: cost.StepTime
    relative: float  # predicted step time / the fastest returned plan's
    fidelity: cost.Fidelity
    why: tuple[str, ...]
    memory: int  # the budget per device, bytes
    device: str  # the device preset whose speeds the times assume
    headroom: float = HEADROOM  # the share of the budget a plan should leave free
    tight: bool = False  # the peak is within `headroom` of the budget

    @property
    def seconds(self) -> float:
        return self.time.total

    @property
    def method(self) -> str:
        return cost.method_of(self.recipe)

    def summary(self) -> str:
        """The recipe's choices in one line."""
        return describe_recipe(self.recipe)

    def as_dict(self) -> dict:
        r = self.recipe
        keys = ("batch", "seq", "dtype", "optimizer", "rank", "checkpoint", "micro_batch", "step_in_backward",
                "optimizer_offload", "offload_activations", "lora_rank", "quant", "base_dtype", "lisa_layers", "dp",
                "zero",
                "zero_offload", "tp", "pp", "loss_chunks")
        return {
            "recipe": {k: getattr(r, k) for k in keys} | {"micro_batch": r.micro},
            "summary": self.summary(), "method": self.method, "peak": int(self.peak), "peak_phase": self.peak_phase,
            "peak_where": self.peak_where, "binding": self.binding, "binding_bytes": int(self.binding_bytes),
            "memory": int(self.memory), "seconds": self.seconds, "relative": self.relative,
            "time_parts": self.time.parts(), "fidelity": [self.fidelity.method, self.fidelity.precision,
                                                          self.fidelity.optimizer],
            "fidelity_text": self.fidelity.describe(), "why": list(self.why), "device": self.device,
            "headroom": self.headroom, "tight": self.tight,
        }


def describe_recipe(r: Recipe) -> str:
    m = cost.method_of(r)
    parts = [cost.METHOD_TITLES[m] + (f" r={r.lora_rank}" if r.lora_rank else "")
             + (f" ({r.lisa_layers} layers)" if r.lisa_layers else "")
             + (f" over a {r.base_dtype} base" if r.base_dtype else ""), r.dtype,
             r.optimizer + (f" rank {r.rank}" if r.rank else "")]
    if r.world_size > 1:
        parts.append(" ".join(f"{k}={v}" for k, v in (("dp", r.dp), ("tp", r.tp), ("pp", r.pp)) if v > 1)
                     + (f" ZeRO-{r.zero}" if r.zero else "") + (" +offload" if r.zero_offload else ""))
    parts.append(f"checkpoint {r.checkpoint}")
    parts.append(f"micro-batch {r.micro}" + (f" (x{r.rank_batch // r.micro} accumulated)" if r.micro < r.rank_batch
                                              else ""))
    parts += [x for x, on in (("step in backward", r.step_in_backward), ("optimizer offload", r.optimizer_offload),
                              ("activation offload", r.offload_activations),
                              (f"loss in {r.loss_chunks} chunks", r.loss_chunks)) if on]
    return ", ".join(parts)


# ----------------------------------------------------------------------------- the space
def allowed_dtypes(min_precision: str, device: Device) -> list[str]:
    """The dtypes at least as precise as min_precision, in the device's 16-bit format, cheapest first."""
    if min_precision not in PRECISION_LEVELS:
        raise ValueError(f"min_precision must be one of fp32, mixed-bf16, mixed-fp16, bf16, fp16, got {min_precision!r}")
    h = device.half
    return [d for d, lv in ((h, 2), (f"mixed-{h}", 1), ("fp32", 0)) if lv <= PRECISION_LEVELS[min_precision]]


def _divisors(n: int) -> list[int]:
    """Descending; at most MAX_MICRO_CHOICES of them, spread geometrically, always n and 1."""
    ds = sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)
    if len(ds) <= MAX_MICRO_CHOICES:
        return ds
    picks = {ds[round(i * (len(ds) - 1) / (MAX_MICRO_CHOICES - 1))] for i in range(MAX_MICRO_CHOICES)}
    return sorted(picks, reverse=True)


def layouts(devices: int, spec) -> list[tuple[int, int, int, int]]:
    """(dp, tp, pp, zero) with dp x tp x pp = devices: data parallel first, ZeRO stages 0-3 where dp > 1."""
    out = []
    for tp in range(1, devices + 1):
        if devices % tp or (tp > 1 and (spec.family != "labkit-gpt" or spec.n_head % tp)):
            continue
        for pp in range(1, devices // tp + 1):
            if (devices // tp) % pp or pp > max(spec.n_layer, 1):
                continue
            dp = devices // tp // pp
            out += [(dp, tp, pp, z) for z in ((0, 1, 2, 3) if dp > 1 else (0,))]
    return sorted(out, key=lambda x: (x[1] * x[2], x[0] == 1, x[3]))


class FamilyKey(NamedTuple):
    """What makes a family of plans: its layout, method, precision and optimizer (the search varies the
    memory settings within it)."""

    dp: int
    tp: int
    pp: int
    zero: int
    method: str  # cost.METHODS: "full", "lora", "qlora" or "lisa"
    dtype: str  # Recipe.dtype
    optimizer: str  # Recipe.optimizer

    def layout(self) -> tuple:
        return self.dp, self.tp, self.pp, self.zero

    def same_but(self, other: "FamilyKey", *fields: str) -> bool:
        """Equal in every field but `fields`."""
        return all(getattr(self, f) == getattr(other, f) for f in self._fields if f not in fields)


@dataclass
class _Family:
    key: FamilyKey
    base: Recipe  # the family's choices; settings are applied on top
    fidelity: cost.Fidelity
    best: Recipe | None = None
    smallest: tuple[int, Recipe] | None = None  # the smallest predicted peak seen and its recipe
    bound: int | None = None  # its weights' bytes, when that alone rules it out (no estimate made)
    note: str = ""  # why no plan (when best is None)
    ran: bool = False  # run_family has searched it (the search stops once it has `top` plans)


@dataclass
class _Search:
    model: object
    spec: object
    memory: int
    device: Device
    batch: int
    seq: int
    headroom: float = HEADROOM
    cache: dict = field(default_factory=dict)
    act_cache: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The Recipe's device: "cpu" for the cpu preset (its attention and dropout paths), else "cuda"."""
        return "cpu" if self.device.name == "cpu" else "cuda"

    def estimate(self, r: Recipe):
        """(Estimate, None) or (None, the estimator's refusal); cached. The estimate reads the spec read once
        (a recipe's model is the name the user gave; the cache keys on everything else)."""
        key = r.replace(model=0)
        if key not in self.cache:
            from labkit.estimate import estimate

            try:
                self.cache[key] = (estimate(r.replace(model=self.spec)), None)
            except ValueError as err:
                self.cache[key] = (None, str(err))
        return self.cache[key]

    def cached(self, r: Recipe) -> bool:
        return r.replace(model=0) in self.cache

    def peak(self, r: Recipe) -> int | None:
        e, _ = self.estimate(r)
        return None if e is None else e.peak.total

    # activations of one row, for the cost of selective recompute and activation offload
    def act_row(self, r: Recipe, checkpoint: str) -> float:
        key = (r.lora_rank, r.quant, r.lisa_layers, r.dtype, r.base_dtype, checkpoint)
        if key not in self.act_cache:
            one = Recipe(self.model, 1, self.seq, dtype=r.dtype, device=self.kind, checkpoint=checkpoint,
                         lora_rank=r.lora_rank, quant=r.quant, lisa_layers=r.lisa_layers, base_dtype=r.base_dtype,
                         overrides=r.overrides)
            e, _ = self.estimate(one)
            self.act_cache[key] = 0.0 if e is None else float(max(m.breakdown()[Category.ACT] for m in e.moments))
        return self.act_cache[key]

    def time(self, r: Recipe) -> cost.StepTime:
        key = ("time", r.replace(model=0))
        if key not in self.act_cache:
            self.act_cache[key] = self._time(r)
        return self.act_cache[key]

    def _time(self, r: Recipe) -> cost.StepTime:
        sel = 0.0
        if r.checkpoint == "selective":
            sel = max(self.act_row(r, "none") - self.act_row(r, "selective"), 0.0) * r.micro
        act = self.act_row(r, r.checkpoint) * r.micro if r.offload_activations else 0.0
        return cost.step_time(r.replace(model=self.spec), self.device, self.spec, act_bytes=act, selective_bytes=sel)

    # ------------------------------------------------------------------------- one family
    def settings(self, fam: _Family) -> list[Recipe]:
        b = fam.base
        full = cost.method_of(b) == "full"
        out = []
        # the chunked output loss on one device (over several, not yet checked against a ledger)
        chunks = (None, LOSS_CHUNKS) if b.world_size == 1 and self.seq >= LOSS_CHUNKS else (None,)
        for ck in CHECKPOINTS:
            for micro in _divisors(b.rank_batch):
                for sib in ((False, True) if full else (False,)):
                    for off in ((None, "cpu") if full and b.optimizer == "adamw" else (None,)):
                        for zoff in ((False, True) if b.zero else (False,)):
                            for lc in chunks:
                                try:
                                    out.append(b.replace(checkpoint=ck, micro_batch=micro,
                                                         step_in_backward=sib, optimizer_offload=off,
                                                         zero_offload=zoff, loss_chunks=lc))
                                except ValueError:  # one the Recipe refuses (e.g. step in backward
                                    pass  # with micro-batches)
        return out

    def run_family(self, fam: _Family) -> None:
        fam.ran = True
        low = weights_lower_bound(fam.base, self.spec)
        if low > self.memory:
            fam.bound = low
            fam.note = f"its weights alone take {fmt_bytes(low)} per device"
            return
        cands = self.settings(fam)
        if not cands:
            fam.note = "no valid setting"
            return
        timed = sorted(cands, key=lambda r: self.time(r).total)
        # first: can anything in this family fit? Its most memory-saving settings (one with step in backward,
        # which rules out micro-batches and offload, one without) bound every other one
        probes = [min(group, key=_savings_rank) for group in
                  ([r for r in cands if r.step_in_backward], [r for r in cands if not r.step_in_backward]) if group]
        failed, errors, fits = [], [], False
        for probe in probes:
            e, err = self.estimate(probe)
            if e is None:
                errors.append(err)
                continue
            if fam.smallest is None or e.peak.total < fam.smallest[0]:
                fam.smallest = (e.peak.total, probe)
            fits = fits or e.peak.total <= self.memory
            if e.peak.total > self.memory:
                failed.append(probe)
        if not fits:
            if fam.smallest is not None:
                fam.note = f"its most memory-saving settings peak at {fmt_bytes(fam.smallest[0])} or more"
                return
            if self.estimate(min(cands, key=_plain_rank))[0] is None:
                fam.note = "not estimated: " + errors[0]  # refused with and without every saving: the family itself
                return
        tries = 1
        points: dict[tuple, list[tuple[int, int]]] = {}  # the other axes -> [(micro-batch, peak)] estimated
        for r in timed:  # then the fastest setting that fits (a fitting probe ends the walk when reached)
            if not self.cached(r):
                if any(_dominated(r, f) for f in failed):
                    continue
                if _predicted(points.get(_axes(r), []), r) > PREDICT_MARGIN * self.memory:
                    continue
                if tries >= MAX_TRIES:  # from here on only what is already estimated (the probes)
                    fam.note = f"estimated {MAX_TRIES} settings; the rest were not tried"
                    continue
                tries += 1
            e, err = self.estimate(r)
            if e is None:
                errors.append(err)
                continue
            p = e.peak.total
            points.setdefault(_axes(r), []).append((r.micro, p))
            if fam.smallest is None or p < fam.smallest[0]:
                fam.smallest = (p, r)
            if p <= self.memory:
                fam.best = r
                fam.note = ""
                return
            failed.append(r)
        if fam.smallest is None:
            fam.note = "not estimated: " + (errors[0] if errors else err or "no setting")


def weights_lower_bound(r: Recipe, spec) -> int:
    """Bytes of the weights alone on the device that holds the most (no estimate needed): every plan needs at
    least these, so a family whose bound exceeds the budget is out. ZeRO-3 shards them over dp, tp and pp split
    them (at best evenly); a 4-bit base keeps 0.5 B per quantized weight; a frozen base its own dtype's bytes
    (2 B for a bf16 base under fp32 adapters: Recipe.frozen_dtype)."""
    d = cost.weight_bytes(r) if not r.lora_rank else (4 if r.frozen_dtype == "fp32" else 2)
    n = spec.n_params
    q = 0
    if r.lora_rank and r.quant != "none":
        from labkit.estimate import peft_terms

        q = peft_terms.quantized_weights(spec, cost._peft(r, spec))
    per_q = 1 if r.quant == "int8" else 0.5
    total = (n - q) * d + q * per_q
    return int(total / (r.dp if r.zero == 3 else 1) / (r.tp * r.pp))


_CK = {"none": 0, "selective": 1, "sqrt": 2, "full": 2}


def _savings_rank(r: Recipe) -> tuple:
    """Smaller saves more memory (for picking a family's most memory-saving setting)."""
    return (-_CK[r.checkpoint], r.checkpoint != "full", r.micro, -r.step_in_backward, -bool(r.optimizer_offload),
            -r.zero_offload, -bool(r.loss_chunks))


PREDICT_MARGIN = 1.15  # a setting predicted to need more than this x the budget is not estimated


def _axes(r: Recipe) -> tuple:
    """Everything a setting chooses but the micro-batch, and whether it accumulates."""
    return (r.checkpoint, r.step_in_backward, r.optimizer_offload, r.zero_offload, r.micro < r.rank_batch,
            r.loss_chunks)


def _predicted(points: list[tuple[int, int]], r: Recipe) -> float:
    """The peak at r's micro-batch by the straight line through two estimated micro-batch sizes with the same other
    choices (activations grow with the rows of a micro-batch; the rest stays): 0 when there are not two, or when
    r's would be read off beyond the larger (only smaller micro-batches are predicted, where the line is an
    upper-side guess the margin covers)."""
    if len(points) < 2:
        return 0.0
    (m1, p1), (m2, p2) = sorted(points)[:2]
    if m1 == m2 or r.micro >= m1:
        return 0.0
    return p1 + (p2 - p1) * (r.micro - m1) / (m2 - m1)


def _plain_rank(r: Recipe) -> tuple:
    """Smaller uses fewer techniques (the family's plainest setting first)."""
    return (_CK[r.checkpoint], -r.micro, r.step_in_backward, bool(r.optimizer_offload), r.zero_offload,
            bool(r.loss_chunks))


def _dominated(r: Recipe, failed: Recipe) -> bool:
    """r saves no more memory than `failed` on any axis, so it cannot fit either."""
    ck = r.checkpoint == failed.checkpoint or _CK[r.checkpoint] < _CK[failed.checkpoint]
    return (ck and r.micro >= failed.micro and r.step_in_backward <= failed.step_in_backward
            and bool(r.optimizer_offload) <= bool(failed.optimizer_offload)
            and r.offload_activations <= failed.offload_activations and r.zero_offload <= failed.zero_offload
            and bool(r.loss_chunks) <= bool(failed.loss_chunks))


# ----------------------------------------------------------------------------- the planner
def _batch_seq(spec, tokens, batch, seq) -> tuple[int, int]:
    if tokens is not None:
        if batch is not None or seq is not None:
            raise ValueError("give tokens or batch and seq, not both")
        if isinstance(tokens, str):
            parts = tokens.replace("x", "*").replace("X", "*").split("*")
            if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
                raise ValueError(f"tokens must be written B*S (rows times tokens per row, e.g. 8*1024), got {tokens!r}")
            batch, seq = (int(p) for p in parts)
        else:
            try:
                batch, seq = tokens
            except (TypeError, ValueError):
                raise ValueError(f"tokens must be (batch, seq) or 'B*S', got {tokens!r}") from None
    batch = 1 if batch is None else batch
    seq = min(1024, spec.max_positions or 1024) if seq is None else seq
    for name, v in (("batch", batch), ("seq", seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return batch, seq


def _families(s: _Search, devices: int, peft, dtypes, optimizers) -> list[_Family]:
    """Every (layout, method, dtype, optimizer) to search, with its fidelity."""
    spec = s.spec
    methods = {False: ["full"], True: ["lisa", "lora", "qlora"], "allow": ["full", "lisa", "lora", "qlora"]}[peft]
    sides = [min(sh) for sh in spec.galore_shapes]
    galore_rank = max(1, min(sides) // 4) if sides else None
    out = []
    for dp, tp, pp, zero in layouts(devices, spec):
        for method in methods:
            if method == "lisa" and spec.n_layer < 2 * LISA_LAYERS:
                continue
            peft_kw = {"lisa": dict(lisa_layers=LISA_LAYERS), "lora": dict(lora_rank=LORA_RANK),
                       "qlora": dict(lora_rank=LORA_RANK, quant="nf4"), "full": {}}[method]
            opts = optimizers if method in ("full", "lisa") else [o for o in optimizers if o == "adamw"] or \
                [o for o in optimizers if not o.startswith("galore")][:1]
            for dtype in dtypes:
                # LoRA / QLoRA under autocast: the frozen base in the 16-bit format (peft's usual setup)
                base_kw = dict(base_dtype=dtype[6:]) if method in ("lora", "qlora") and dtype.startswith("mixed") \
                    else {}
                for opt in opts:
                    if method == "lisa" and opt.startswith("galore"):
                        continue  # LISA and GaLore are two ways to shrink the state (the estimator refuses both)
                    if opt.startswith("galore") and galore_rank is None:
                        continue
                    try:
                        base = Recipe(s.model, s.batch, s.seq, dtype=dtype, optimizer=opt, device=s.kind,
                                      rank=galore_rank if opt.startswith("galore") else None, dp=dp, tp=tp, pp=pp,
                                      zero=zero, **peft_kw, **base_kw)
                    except ValueError:
                        continue
                    key = FamilyKey(dp, tp, pp, zero, method, dtype, opt)
                    out.append(_Family(key, base, cost.Fidelity.of(base)))
    return out


def plan(model, devices: int = 1, memory: int | str | None = None, device_preset=None, tokens=None,
         batch: int | None = None, seq: int | None = None, options: SearchOptions = SearchOptions()) -> list[Plan]:
    """Plans that fit `memory` bytes per device on `devices` devices, best first (fidelity, then time).

    model: a preset name, config path or hub id (as labkit.estimate takes it). memory: bytes or a size such as
    "24GiB" (default: the preset's memory). device_preset: a name of labkit.plan.devices.PRESETS or "cpu" (default:
    the preset closest to `memory`), whose speeds the times assume. tokens: "B*S" or (B, S), or batch and seq
    (default batch 1, seq min(1024, the model's positions)); batch is the global batch. options: what to search
    (peft, min_precision, optimizers) and return (top, headroom), a SearchOptions (default: full training, bf16
    or more precise, every optimizer, 5 plans, 10 % headroom).
    memory as a string: "24GiB" is 24 x 2**30 bytes, "24GB" 24 x 10**9 (labkit.memory.units.parse_bytes).
    Raises NoPlanError when nothing fits, naming the smallest predicted peak found and the budget.
    """
    from labkit.estimate.spec import shapes_only, spec_from
    from labkit.memory.units import parse_bytes

    if isinstance(devices, bool) or not isinstance(devices, int) or not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"devices must be an integer from 1 to {MAX_DEVICES}, got {devices!r}")
    if not isinstance(options, SearchOptions):
        raise ValueError(f"options must be a SearchOptions, got {options!r}")
    top = options.top
    if memory is None and device_preset is None:
        raise ValueError("give the memory per device, a device preset, or both")
    if memory is not None:
        memory = parse_bytes(memory)
    device = get_device(device_preset) if device_preset is not None else closest(memory)
    memory = device.memory if memory is None else memory
    dtypes = allowed_dtypes(options.min_precision, device)
    with shapes_only():
        spec = spec_from(model)
    batch, seq = _batch_seq(spec, tokens, batch, seq)
    if spec.max_positions and seq > spec.max_positions:
        raise ValueError(f"seq {seq} exceeds the model's {spec.max_positions} positions")
    s = _Search(model, spec, memory, device, batch, seq, options.headroom)
    fams = _families(s, devices, options.peft, dtypes, list(options.optimizers))
    if not fams:
        raise NoPlanError(f"no configuration to try for {devices} device(s) with batch {batch}: each layout's "
                          f"data-parallel ranks must divide the batch")
    classes = sorted({f.fidelity for f in fams}, reverse=True)
    found: list[_Family] = []
    for fid in classes:
        members = sorted([f for f in fams if f.fidelity == fid], key=lambda f: f.key.dtype == "fp32")
        for f in members:
            if f.base.dtype == "fp32":
                twin = next((g for g in members if g.key.same_but(f.key, "dtype")
                             and g.key.dtype.startswith("mixed")), None)
                if twin is not None and twin.best is not None:
                    f.note = f"not tried: {twin.base.dtype} fits with the same fidelity and faster matmuls"
                    continue
            s.run_family(f)
            if f.best is not None:
                found.append(f)
        if top is not None and len(found) >= top:
            break
    if not found:
        seen = [f.smallest for f in fams if f.smallest is not None]
        if not seen and any(f.bound for f in fams):  # every family ruled out by its weights: estimate the lightest
            f = min((f for f in fams if f.bound), key=lambda f: f.bound)
            cands = s.settings(f)
            e, _ = s.estimate(min(cands, key=_savings_rank)) if cands else (None, None)
            if e is not None:
                seen = [(e.peak.total, min(cands, key=_savings_rank))]
        if not seen:
            raise NoPlanError(f"no plan fits {fmt_bytes(memory)} per device: the estimator refused every "
                              f"configuration tried ({next((f.note for f in fams if f.note), 'no reason given')})")
        p, r = min(seen, key=lambda x: x[0])
        raise NoPlanError(f"no plan fits {fmt_bytes(memory)} per device: the smallest predicted peak found is "
                          f"{fmt_bytes(p)} ({describe_recipe(r)})")
    ranked = sorted(found, key=lambda f: (tuple(-x for x in astuple(f.fidelity)), s.time(f.best).total))
    if top is not None:
        ranked = ranked[:top]
    fastest = min(s.time(f.best).total for f in ranked)
    return [_make_plan(s, f, fams, fastest, first=i == 0) for i, f in enumerate(ranked)]


NO_PEFT_NOTE = ("PEFT: LoRA, QLoRA and LISA were not considered (full training only); add --peft "
                "(SearchOptions(peft='allow')) to search them too")


def _make_plan(s: _Search, fam: _Family, fams: list[_Family], fastest: float, first: bool = False) -> Plan:
    r = fam.best
    e, _ = s.estimate(r)
    top = e.peak_moment
    biggest = max(top.terms, key=lambda t: t.bytes) if top is not None else None
    t = s.time(r)
    full_only = first and all(f.key.method == "full" for f in fams)
    why = tuple(_why(s, fam, fams) + ([NO_PEFT_NOTE] if full_only else []))
    return Plan(r, e.peak.total, e.peak_phase, top.where if top else e.peak_phase,
                biggest.name if biggest else "", biggest.bytes if biggest else 0, t, t.total / fastest,
                fam.fidelity, why, s.memory, s.device.name, s.headroom, _tight(s, e.peak.total))


def _tight(s: _Search, peak: int) -> bool:
    return is_tight(peak, s.memory, s.headroom)


def _searched(s: _Search, fams, pred) -> list[_Family]:
    """The families that match `pred`, each searched first if the search stopped before it (so
    that what a plan says of the others does not depend on how many plans were asked for)."""
    out = [f for f in fams if pred(f)]
    for f in out:
        if not f.ran:
            s.run_family(f)
    return out


def _smallest(s: _Search, fams, pred) -> tuple[int, str] | None:
    """The least memory the matching families need, as (bytes, "its smallest peak found is X" or "its weights
    alone take X"); each searched first (`_searched`)."""
    fams = _searched(s, fams, pred)
    seen = [(f.smallest[0], "its smallest peak found is") for f in fams if pred(f) and f.smallest is not None]
    seen += [(f.bound, "its weights alone take") for f in fams if pred(f) and f.bound is not None]
    if not seen:
        return None
    b, text = min(seen, key=lambda x: x[0])
    return b, f"{text} {fmt_bytes(b)}"


def _why(s: _Search, fam: _Family, fams: list[_Family]) -> list[str]:
    """Short lines: why each technique was chosen or left out, with the peaks that decided it."""
    r, budget = fam.best, fmt_bytes(s.memory)
    lines = []
    method = cost.method_of(r)
    better = [m for m, v in cost.METHODS.items() if v > cost.METHODS[method]]
    if better:
        for m in better:
            same = _searched(s, fams, lambda f: cost.method_of(f.base) == m
                             and f.key.layout() == fam.key.layout())
            sm = _smallest(s, same, lambda f: True)
            fit = [f for f in same if f.best is not None]
            if fit:
                lines.append(f"{cost.METHOD_TITLES[m]}: fits only with lower fidelity here: "
                             f"{max(f.fidelity for f in fit).describe()}")
            elif sm is not None and sm[0] > s.memory:
                lines.append(f"{cost.METHOD_TITLES[m]}: does not fit: {sm[1]} > {budget}")
            elif any(cost.method_of(f.base) == m for f in fams):
                lines.append(f"{cost.METHOD_TITLES[m]}: fits in another layout or ranks elsewhere (see the other plans)")
    lines.append(f"method: {cost.METHOD_TITLES[method]} ({fam.fidelity.describe()})")
    if r.dtype in ("bf16", "fp16"):
        sm = _smallest(s, fams, lambda f: f.key.same_but(fam.key, "dtype") and f.key.dtype != r.dtype)
        lost = cost.LOST_UPDATE[r.dtype]
        lines.append(f"precision: pure {r.dtype}, no fp32 master weights"
                     + (" for the trained adapters (their frozen base takes no update)" if r.lora_rank else "")
                     + f": an update below 2**{math.log2(lost):.0f} "
                     f"of its weight rounds away, so small updates are lost (stale weights: a step of 1e-5 moves no "
                     f"weight above {1e-5 / lost:.2g}) and labkit's optimizers do not round stochastically"
                     + (f"; with fp32 master weights {sm[1]} > {budget}" if sm and sm[0] > s.memory
                        else " (higher precision not allowed, not estimated or ranked elsewhere)"))
    else:
        lines.append(f"precision: {r.dtype}: fp32 master weights" + (", matmuls in 16 bits under autocast"
                                                                   if r.dtype.startswith("mixed") else "")
                     + (f"; the frozen base in {r.base_dtype} (a frozen weight takes no update: nothing to lose)"
                        if r.base_dtype not in (None, "fp32") else ""))
    if r.optimizer != "adamw":
        sm = _smallest(s, fams, lambda f: f.key.same_but(fam.key, "optimizer") and f.key.optimizer == "adamw")
        tail = (f": with AdamW {sm[1]} > {budget}" if sm and sm[0] > s.memory
                else ": AdamW is not estimated or not allowed here" if sm is None else
                ": AdamW fits too (see the other plans)")
        lines.append(f"optimizer: {r.optimizer}" + (f" rank {r.rank}" if r.rank else "") + tail)
    else:
        lines.append("optimizer: AdamW")

    def without(name: str, change: dict, on: str, off: str) -> None:
        try:
            alt = r.replace(**change)
        except ValueError:
            return
        p = s.peak(alt)
        if p is None:
            lines.append(f"{name}: {on} (without it: not estimated)")
        elif p > s.memory:
            lines.append(f"{name}: {on}: needed: without it the peak is {fmt_bytes(p)} > {budget}")
        else:
            lines.append(f"{name}: {on}: without it the peak is {fmt_bytes(p)} (fits), but {off}")

    faster = "this plan is faster overall"
    # (used, name, the change that drops it, how it is used, why it stays though it fits without, line if unused)
    savings = [
        (r.checkpoint != "none", "checkpointing", dict(checkpoint="none"), r.checkpoint, faster,
         "checkpointing: not needed"),
        (r.micro < r.rank_batch, "gradient accumulation", dict(micro_batch=r.rank_batch),
         f"{r.rank_batch // r.micro} micro-batches of {r.micro}", faster,
         "gradient accumulation: not needed (the whole batch at once)"),
        (r.step_in_backward, "per-layer updates (step in backward)", dict(step_in_backward=False), "on",
         "it costs nothing here", None),
        (r.optimizer_offload, "optimizer offload", dict(optimizer_offload=None), "to host memory", faster, None),
        (r.offload_activations, "activation offload", dict(offload_activations=False), "to host memory", faster, None),
        (r.zero_offload, "ZeRO-Offload", dict(zero_offload=False), "optimizer shards in host memory", faster, None),
        (r.loss_chunks, "chunked loss", dict(loss_chunks=None),
         f"{r.loss_chunks} chunks along the sequence", "it costs no compute here", None),
        (r.dp > 1 and r.zero, f"ZeRO-{r.zero}", dict(zero=r.zero - 1, zero_offload=r.zero_offload and r.zero > 1),
         f"stage {r.zero}", faster, "ZeRO: not needed (plain data parallel)" if r.dp > 1 else None),
    ]
    for used, name, change, on, off, unused in savings:
        if used:
            without(name, change, on, off)
        elif unused:
            lines.append(unused)
    if _tight(s, s.peak(r)):
        lines.append(f"headroom: tight: the peak is within {s.headroom:.0%} of the budget "
                     f"({fmt_bytes(s.memory - s.peak(r))} left of {budget}); the allocator's rounding and "
                     "fragmentation and the CUDA context are not in these logical bytes: verify it on the device")
    if r.world_size > 1:
        lines.append(f"layout: dp={r.dp} tp={r.tp} pp={r.pp} on {r.world_size} devices; communication "
                     f"{s.time(r).comm * 1e3:.1f} ms of the step")
    return lines
