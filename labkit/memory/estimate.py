"""Predict the bytes of one training step, by category and phase, from formulas with named sources.

Peak memory is the largest of the phases' peaks (end of forward, during backward, optimizer step),
never their sum. Every term is a small function whose docstring gives its formula and source.
"""

from __future__ import annotations

from dataclasses import dataclass

from .families import WALKS
from .report import Breakdown, Category, Estimate, Term
from .spec import ModelSpec, spec_from
from .walk import Walk

DTYPES = ("fp32", "fp16", "bf16", "mixed-fp16", "mixed-bf16")
OPTIMIZERS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}  # fp states per parameter


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


def optimizer_state_bytes(spec: ModelSpec, prec: Precision, optimizer: str) -> int:
    """k x N x bytes per weight + 4 bytes of step counter per tensor for Adam.
    k = 0 (SGD), 1 (momentum buffer), 2 (Adam's m and v). torch.optim keeps state in the
    parameters' dtype: 8N for fp32 Adam (12N with the master copy, as ZeRO's K = 12 counts)."""
    k = OPTIMIZERS[optimizer]
    counters = 4 * len(spec.param_numels) if optimizer in ("adam", "adamw") else 0
    return k * spec.n_params * prec.weight + counters


def optimizer_temp_bytes(spec: ModelSpec, prec: Precision, optimizer: str, foreach: bool) -> int:
    """Adam's step makes sqrt(v) and sqrt(v)/c before adding eps in place: 2 temporaries the size
    of the largest parameter one tensor at a time (torch.optim single-tensor path, CPU default),
    or of all parameters at once in the foreach path (CUDA default). SGD works in place."""
    if optimizer not in ("adam", "adamw"):
        return 0
    return (spec.n_params if foreach else 2 * spec.largest_param) * prec.weight


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
             device: str = "cpu", foreach: bool | None = None, **overrides) -> Estimate:
    """Predict one steady-state training step (gradients set to None between steps).

    model: preset name, config path, hub id, GPTConfig, GPT or transformers model/config.
    device: "cpu" or "cuda" (fused attention and dropout masks differ); foreach: Adam's foreach
    path (default: on CUDA only, as torch.optim does).
    """
    for name, v in (("batch", batch), ("seq", seq)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    prec = Precision.of(dtype)
    spec = spec_from(model, **overrides)
    if spec.max_positions and seq > spec.max_positions:
        raise ValueError(f"seq {seq} exceeds the model's {spec.max_positions} positions")
    foreach = (device == "cuda") if foreach is None else foreach
    return _phases(spec, prec, batch, seq, dtype, optimizer, device, foreach)


def _phases(spec, prec, B, S, dtype, optimizer, device, foreach) -> Estimate:
    P, C = param_bytes(spec, prec), autocast_copy_bytes(spec, prec)
    G, O = grad_bytes(spec, prec), optimizer_state_bytes(spec, prec, optimizer)
    w, marks = walk_activations(spec, prec, B, S, device)
    A = w.saved_bytes + input_bytes(B, S)
    r, h, V, gb = B * S, spec.hidden, spec.vocab, prec.weight
    mm = w.mm_bytes
    lsm = next(t for t in w.saved.values() if t.name == "log_softmax(logits)").nbytes
    logits = r * V * mm
    upcast = r * V * 4 if lsm // (r * V) != mm else 0  # the fp32 copy the loss makes

    def bd(param=0, grad=0, opt=0, act=0, temp=0) -> Breakdown:
        return Breakdown({Category.PARAM: param, Category.GRAD: grad, Category.OPT: opt,
                          Category.ACT: act, Category.TEMP: temp, Category.BUFFER: 0})

    # forward peak: at the log-softmax, with the logits (and their fp32 copy) still alive
    fwd = bd(P + C, 0, O, A, logits + upcast)
    # backward: (1) the loss's two B*S*V gradients; (2) the head's matmul backward; (3) layer
    # boundaries with a transient of the block's MLP backward; (4) the embedding backward.
    L, layer_A = spec.n_layer, (marks[-1] - marks[0]) // max(spec.n_layer, 1)
    C_layer = 2 * spec.layer_matmul_params if prec.autocast else 0
    C_head = 2 * V * h if prec.autocast else 0
    G_head = (V * h + 2 * h) * gb  # output matrix and final norm
    stream = r * h * gb
    # MLP backward: the gradient into the activation and out of it are both alive while the
    # activation's own output is already freed: +1 (exact GELU) or +2 (GELU/SwiGLU in Python ops)
    # B*S*ffn tensors, plus one weight gradient in the compute dtype.
    tau = (1 if spec.family == "labkit-gpt" else 2) * r * spec.ffn * mm
    tau_grad = spec.ffn * h * mm  # that projection's weight gradient, made before it is accumulated
    start = bd(P + C, 0, O, A, 2 * lsm)
    head = bd(P + C, V * h * (4 if prec.autocast else gb), O, A - lsm,
              r * V * mm + r * h * mm + (V * h * mm if prec.autocast else 0))
    bounds = []
    for i in (L - 1, 0):
        act = A - (w.saved_bytes - marks[-1]) - (L - 1 - i) * layer_A
        bounds.append(bd(P + C - C_head - (L - 1 - i) * C_layer,
                         G_head + (L - 1 - i) * spec.layer_params * gb + tau_grad, O, act, stream + tau))
    emb_temp = 2 * V * h * gb if spec.tied else 0  # tied: the dense embedding gradient and the sum
    end = bd(P, G, O, input_bytes(B, S), stream + emb_temp)
    bwd = max([start, head, *bounds, end], key=lambda b: b.total)
    opt = bd(P, G, O, input_bytes(B, S), optimizer_temp_bytes(spec, prec, optimizer, foreach))
    terms = _terms(spec, prec, optimizer, B, S, w, P, C, G, O, lsm, logits + upcast)
    label = f"{spec.name} B={B} S={S} {dtype} {optimizer}"
    return Estimate(label, spec.n_params, {"forward": fwd, "backward": bwd, "optimizer": opt}, terms)


def _terms(spec, prec, optimizer, B, S, w, P, C, G, O, lsm, logit_temp) -> list[Term]:
    scores = sum(t.nbytes for t in w.saved.values() if "attention probs" in t.name or "attention dropout" in t.name)
    blocks = w.saved_bytes - lsm - scores
    return [
        Term("parameters", Category.PARAM, P, f"N x {prec.weight} B = {spec.n_params:,} x {prec.weight}", "all predictors"),
        Term("autocast 16-bit weight copies", Category.PARAM, C, "2 x matmul parameters", "torch.autocast weight cache"),
        Term("gradients", Category.GRAD, G, f"N x {prec.weight} B", "Playbook #104; ml-engineering #23"),
        Term("optimizer state", Category.OPT, O, f"{OPTIMIZERS[optimizer]} x N x {prec.weight} B (+ step counters)", "ZeRO K; HF docs"),
        Term("activations saved by the blocks", Category.ACT, blocks, "forward walk per layer ~ sbh(34 + ...)", "Korthikanti et al. 2022"),
        Term("attention scores (s^2)", Category.ACT, scores, "L x B x a x S^2 x bytes (x2-3 with dropout)", "Korthikanti et al. 2022: 5as/h"),
        Term("log-softmax of the logits", Category.ACT, lsm, "B x S x V x bytes (4 if the loss runs in fp32)", "predictors.md 3.10"),
        Term("token ids and targets", Category.ACT, input_bytes(B, S), "2 x B x S x 8", "int64 inputs"),
        Term("logits (+ fp32 copy) during the loss", Category.TEMP, logit_temp, "B x S x V x bytes", "predictors.md 3.10"),
    ]
