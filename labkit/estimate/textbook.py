"""The textbook layer: the published formulas a lesson quotes, one per function, each with its source.

`figure` adds them up for a recipe: the number a published calculator would give. The exact layer (predict's
op-level walk and replay, labkit.estimate.tape) starts from the same states and names each correction;
`Estimate.explain()` shows this figure, then the corrections, then the exact peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.memory.report import Category, Term, TermKey
from labkit.memory.state import TORCH_STATES

from .recipe import DTYPES

STATES = {**TORCH_STATES, "lion": 1}  # states per parameter, weight dtype (Lion: its momentum)
STATES_8BIT = {"adam8bit": 2, "adamw8bit": 2}  # 1-byte states per parameter
ZERO = "ZeRO, Rajbhandari et al. 2020 (arXiv 1910.02054), section 5 and Figure 1"
KORTHIKANTI = "Korthikanti et al. 2022 (arXiv 2205.05198), section 4, eq. 1-4"
LOGITS = "pytorch/pytorch tools/autograd/derivatives.yaml: _log_softmax's backward reads its result"
HF_ANATOMY = "HF docs, Model training anatomy (huggingface.co/docs/transformers/model_memory_anatomy)"


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


def param_bytes(n: int, d: int) -> int:
    """n x d: d = 4 in fp32 and mixed precision (the master copy is the model's weights), 2 in fp16/bf16.
    Source: ZeRO (Rajbhandari et al. 2020), section 3.1; the HF docs' "Model training anatomy"."""
    return n * d


def copy16_bytes(n: int) -> int:
    """2 x n: the 16-bit copies mixed precision computes with (the '2 B of fp16 weights' of HF's 18 B/param)."""
    return 2 * n


def grad_bytes(n: int, d: int) -> int:
    """n x d: gradients in the weights' dtype, 4 B under mixed precision (Playbook discussion #104; ml-eng #23)."""
    return n * d


def optimizer_state_bytes(n: int, d: int, optimizer: str) -> int:
    """k n d: k = 0 (SGD), 1 (momentum, Lion), 2 (Adam's m and v); 8-bit Adam 2 n x 1 B (Dettmers et al. 2022,
    arXiv 2110.02861). Factored (Adafactor) and projected (GaLore) states: their own functions below."""
    if optimizer in STATES_8BIT:
        return STATES_8BIT[optimizer] * n
    return STATES[optimizer] * n * d


def factored_state_elements(shapes) -> int:
    """Adafactor: a row and a column of second moments per matrix (m + n), a full one per vector (Shazeer and
    Stern 2018, arXiv 1804.04235, section 3)."""
    return sum(s[0] + s[1] if len(s) == 2 else s[0] for s in shapes)


def galore_state_elements(shapes, r: int) -> int:
    """GaLore: per (m, n) matrix, m <= n, a projector m r and Adam's two moments r n; 2 per element of the other
    parameters (Zhao et al. 2024, arXiv 2403.03507, Table 1: mr + 2nr)."""
    return sum(min(s) * r + 2 * max(s) * r if len(s) == 2 else 2 * s[0] for s in shapes)


def layer_activation_bytes(s: int, b: int, h: int, a: int, e: int = 2, recompute: str = "none") -> int:
    """One transformer layer's saved activations with e-byte values and 1-byte dropout masks:
    sbh(16e + 2) + (2e + 1) a s^2 b (e = 2: Korthikanti's sbh(34 + 5as/h)); selective recompute keeps the
    first part; full recompute the layer's input, e sbh (Korthikanti et al. 2022, section 4-5; the EleutherAI
    cookbook's byte-width form)."""
    linear, scores = s * b * h * (16 * e + 2), (2 * e + 1) * a * s * s * b
    return {"none": linear + scores, "selective": linear, "full": e * s * b * h}[recompute]


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Activation bytes per layer and tensor-parallel rank (16-bit activations, 1-byte dropout masks, scores kept):
    sbh(10 + 24/t + 5as/(ht)), with sequence parallelism sbh(34/t + 5as/(ht)) (Korthikanti et al. 2022, eq. 2-4)."""
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t))


def logits_bytes(b: int, s: int, v: int) -> int:
    """B S V x 4: the fp32 log-softmax of the logits the loss keeps for backward (cross_entropy is log_softmax then
    nll_loss, and _log_softmax's backward reads its result: tools/autograd/derivatives.yaml in pytorch/pytorch)."""
    return 4 * b * s * v


def zero_shares(p: float, g: float, o: float, world: int, stage: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) per rank: stage 1 divides the state by N, stage 2 also the
    gradients, stage 3 also the parameters (ZeRO, section 5)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"the number of data-parallel ranks must be an integer >= 1, got {world!r}")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {stage!r}")
    return p / (world if stage >= 3 else 1), g / (world if stage >= 2 else 1), o / (world if stage >= 1 else 1)


def paper_bytes(n_params: float, world: int, stage: int, k: int = 12) -> float:
    """The model states per rank of ZeRO's Figure 1: (2 + 2 + K) Psi, the parts stage `stage` shards over N."""
    return sum(zero_shares(2 * n_params, 2 * n_params, k * n_params, world, stage))


def in_flight(schedule: str, m: int, n_stages: int, stage: int) -> int:
    """Micro-batches whose activations stage `stage` holds at once: m (GPipe), min(p - s, m) (1F1B; Narayanan et
    al. 2021, arXiv 2104.04473, section 2.2)."""
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")
    return m if schedule == "gpipe" else min(n_stages - stage, m)


def nf4_bytes(n: int) -> float:
    """QLoRA's frozen weights: 4 bits + double-quantized constants, 4.127 bits per weight (Dettmers et al. 2023,
    arXiv 2305.14314, section 3); int8: 1 B per weight."""
    return n * 4.127 / 8


def figure(spec, r, n_train: int, n_quant: int = 0, stage: int = 0,
           adapters: bool = False) -> list[Term]:
    """The textbook peak of a recipe on its busiest rank: model states (shared as ZeRO, TP and PP
    divide them), all of them live, plus one layer formula x layers x micro-batches in flight, plus
    the log-softmax (on the last pipeline stage, which runs the loss). n_train: trained parameters (LoRA's adapters, LISA's active layers); n_quant:
    weights stored in int8/NF4. A 16-bit frozen base (r.base_dtype) keeps 2 B per weight and needs
    no autocast copy: only what trains is cast. stage: the pipeline stage whose micro-batches in
    flight are counted (one device: one micro-batch at a time, as gradient accumulation runs them).
    adapters: LoRA/QLoRA, whose n_train adapters are parameters beside the frozen base. Each term's
    key is the exact layer's for the same bytes (explain() sets them side by side)."""
    d, n = Precision.of(r.dtype).weight, spec.n_params / (r.tp * r.pp)
    fd = 2 if getattr(r, "base_dtype", None) in ("bf16", "fp16") else d  # the frozen base's bytes per weight
    qbytes = (nf4_bytes(n_quant) if r.quant == "nf4" else n_quant * (1 if r.quant == "int8" else 0.5))
    state = (factored_state_elements(spec.param_shapes) * d if r.optimizer == "adafactor" else
             galore_state_elements(spec.param_shapes, r.rank) * (d if r.optimizer == "galore" else 1)
             if r.optimizer.startswith("galore") else optimizer_state_bytes(n_train, d, r.optimizer))
    p, g, o = zero_shares(param_bytes(n - n_quant, fd), grad_bytes(n_train, d), state, r.dp, r.zero)
    e = 2 if r.dtype != "fp32" else 4
    b, s, layers = r.micro, r.seq, -(-spec.n_layer // r.pp)
    policy = r.checkpoint.replace("sqrt", "full")
    if r.tp > 1:
        layer = korthikanti_layer_bytes(s, b, spec.hidden, spec.n_head, r.tp, r.sequence_parallel)
    else:
        layer = layer_activation_bytes(s, b, spec.hidden, spec.n_head, e, policy)
    flying = in_flight(r.schedule, r.rank_batch // b, r.pp, stage) if r.pp > 1 else 1
    acts = layers * layer * flying * (not r.offload_activations)
    copied = n_train if fd == 2 else n  # a 16-bit frozen base is not cast
    kept = (f"{layers} layers x the layer formula ({r.checkpoint})"
            + (f" x {flying} micro-batches in flight ({r.schedule})" if r.pp > 1 else ""))
    base = TermKey.FROZEN_BASE if adapters else TermKey.PARAMETERS
    acts_key = TermKey.SAVED_ACTIVATIONS if r.checkpoint == "none" else TermKey.CHECKPOINT_INPUTS
    copies = copy16_bytes(int(copied)) if r.dtype.startswith("mixed") else 0
    terms = [Term("frozen base weights" if adapters else "parameters", Category.PARAM, int(p),
                  f"N x {fd} B" + (", sharded" if r.zero >= 3 else ""), ZERO, key=base),
             Term("adapters", Category.PARAM, param_bytes(n_train, d) if adapters else 0,
                  f"N_train x {d} B", "Hu et al. 2021 (arXiv 2106.09685)", key=TermKey.ADAPTERS),
             Term("autocast 16-bit weight copies", Category.PARAM, copies,
                  "2 x N" if fd == d else "2 x N_train", HF_ANATOMY, key=TermKey.COPIES_16BIT),
             Term("frozen base, quantized", Category.BUFFER, int(qbytes), "4.127 bits (NF4) or 1 B (int8) per weight",
                  "Dettmers et al. 2023", key=TermKey.QUANTIZED_BASE),
             Term("gradients", Category.GRAD, int(g), f"N_train x {d} B", "Playbook #104", key=TermKey.GRADIENTS),
             Term("optimizer state", Category.OPT, int(o), f"{r.optimizer} on N_train = {n_train:,}", ZERO,
                  key=TermKey.OPTIMIZER_STATE),
             Term("activations", Category.ACT, int(acts), kept, KORTHIKANTI, key=acts_key),
             Term("log-softmax of the logits", Category.ACT,
                  logits_bytes(b, s, spec.vocab) if stage == r.pp - 1 else 0,  # the last stage's loss only
                  "B S V x 4", LOGITS, key=TermKey.LOG_SOFTMAX)]
    return [t for t in terms if t.bytes]
