"""Checks for lesson 08 (LoRA, QLoRA, LISA): how many parameters LoRA trains, how many bytes an NF4 base
takes, and how much optimizer state LISA can hold at most.

Expected values come from the library: apply_lora on a copy of the learner's model and counted,
quantize_nf4 on a real tensor of the asked shape, and lisa_bound on a LISA built over the model.
"""

from __future__ import annotations

import copy
import functools
import numbers
import random

import torch
import torch.nn as nn

from labkit.peft import LISA, apply_lora, count_parameters, find_layers, find_targets, lisa_bound
from labkit.quant import nbytes_nf4, nf4_bytes_for, quantize_nf4

from . import Inputs, checked_choice, close, failed, integer, not_answered, passed, unanswered

inputs = Inputs(__name__, {  # each exercise's inputs: the lesson's own first, then what a course may draw
    "lora_params": {"targets": (("query", "value"), ("query", "key", "value")), "r": (8, 4, 16, 32)},
    "nf4_base_bytes": {"shape": ((4096, 4096), (2048, 2048), (5632, 2048), (3072, 3072), (2560, 2560))},
    "lisa_opt_bytes": {"gamma": (1, 2)},  # at most the smoke profile's 2 blocks (LISA refuses more)
})


# ---- exercise 1: parameters LoRA trains --------------------------------------------------------------
def lora_params(model: nn.Module, targets, r: int) -> int:
    """Trainable parameter elements after apply_lora(copy of model, targets, r) (adapters only)."""
    m = copy.deepcopy(model)
    apply_lora(m, list(targets), r=r)
    return count_parameters(m).trainable


def check_lora_params(answer, model: nn.Module, targets=("query", "value"), r: int = 8) -> bool:
    name = f"parameters LoRA rank {r} trains on {', '.join(targets)}"
    value = integer(answer, name)
    if value is None:
        return False
    layers = [model.get_submodule(n) for n in find_targets(model, list(targets))]
    expected = _adapters(model, targets, r)
    shapes = sorted({(lin.in_features, lin.out_features) for lin in layers})
    example = f"r x (d_in + d_out) = {r} x ({shapes[0][0]} + {shapes[0][1]})"
    if value == expected:
        return passed(f"{name}: {expected:,} = {len(layers)} layers x {example}: A is r x d_in, B is d_out x r; "
                      f"{expected / count_parameters(model).total:.2%} of the model's {count_parameters(model).total:,}.")
    if value == sum(r * lin.in_features for lin in layers) or value == sum(r * lin.out_features for lin in layers):
        return failed(f"{name}: that counts one of the two matrices; LoRA trains A (r x d_in) and B (d_out x r).")
    if value == sum(lin.in_features * lin.out_features for lin in layers):
        return failed(f"{name}: that is the size of the frozen weights themselves; LoRA trains the low-rank factors.")
    if value == sum(lin.weight.numel() + (lin.bias.numel() if lin.bias is not None else 0) for lin in layers):
        return failed(f"{name}: that is the frozen weights and biases of those layers; LoRA freezes them.")
    if value == _adapters(model, ["query"], r) or value == expected // len(layers):
        return failed(f"{name}: count every targeted layer: {len(layers)} of them ({', '.join(targets)} in every block).")
    if value == _adapters(model, find_targets(model, "all-linear"), r):
        return failed(f"{name}: that is all-linear; the question targets only {', '.join(targets)}.")
    if value in (2 * expected, expected // 2):
        return failed(f"{name}: off by a factor of 2: one A (r x d_in) and one B (d_out x r) per layer.")
    return failed(f"{name}: per targeted Linear, r x (d_in + d_out); add them up over the {len(layers)} layers.")


def _adapters(model: nn.Module, targets, r: int) -> int:
    """The check's path (not lora_params, which the student build stubs): the targeted Linear layers' shapes,
    A (r x d_in) and B (d_out x r) each."""
    layers = [model.get_submodule(n) for n in find_targets(model, list(targets))]
    return sum(r * (lin.in_features + lin.out_features) for lin in layers)


# ---- exercise 2: bytes of a frozen NF4 base -------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def nf4_base_bytes(rows: int, cols: int, double_quant: bool = True) -> int:
    """Bytes labkit.quant holds for a (rows, cols) weight in NF4, blocks of 64, measured on a real tensor."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    return nbytes_nf4(*quantize_nf4(w, 64, double_quant))


def check_nf4_base_bytes(answer, shape=(4096, 4096)) -> bool:
    rows, cols = shape
    n = rows * cols
    name = f"bytes of a frozen {rows} x {cols} weight in NF4 with double quantization"
    value = integer(answer, name)
    if value is None:
        return False
    expected = nf4_base_bytes(rows, cols)
    blocks = n // 64
    if value == expected:
        return passed(f"{name}: {expected:,} = {n // 2:,} (codes, 2 per byte) + {blocks:,} (an 8-bit absmax per 64) "
                      f"+ {4 * blocks // 256:,} (an fp32 scale per 256 blocks) + 4 (the offset): "
                      f"{expected / (2 * n):.1%} of its bf16 bytes.")
    if value == nf4_bytes_for(n) - 4:
        return failed(f"{name}: almost: double quantization also keeps one fp32 offset (the mean absmax) per tensor.")
    if value in (nf4_base_bytes(rows, cols, False), nf4_bytes_for(n, double_quant=False)):
        return failed(f"{name}: that keeps an fp32 absmax per block (4.5 bits): without double quantization.")
    if value == n // 2:
        return failed(f"{name}: the 4-bit codes alone; every block of 64 also needs its absmax.")
    if value in (n * 2, n * 4):
        return failed(f"{name}: that is the bf16/fp32 weight; NF4 takes about 4.13 bits per value.")
    if close(value, 8 * expected, rel=0.01) or close(value, 4.127 * n, rel=0.01):
        return failed(f"{name}: that looks like bits; give bytes.")
    return failed(f"{name}: add up: n/2 bytes of codes, one byte per block of 64, 4 bytes per 256 blocks, 4 more.")


# ---- exercise 3: the most optimizer state LISA holds ----------------------------------------------------
def lisa_opt_bound(model: nn.Module, gamma: int) -> int:
    """lisa_bound(...)["OPT"] for LISA(gamma) over a copy of the model with fp32 AdamW."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters())
    return lisa_bound(LISA(m, opt, gamma=gamma, interval=1))["OPT"]


def check_lisa_opt_bytes(answer, model: nn.Module, gamma: int = 1) -> bool:
    name = f"the most AdamW state bytes LISA (gamma={gamma}) holds"
    value = integer(answer, name)
    if value is None:
        return False
    _, layers = find_layers(model)
    in_layers = {id(p) for p in layers.parameters()}
    outside = {id(p): p for p in model.parameters() if id(p) not in in_layers}
    out_n, out_t = sum(p.numel() for p in outside.values()), len(outside)
    layer = max(layers, key=lambda lay: sum(p.numel() for p in lay.parameters()))
    lay_n, lay_t = sum(p.numel() for p in layer.parameters()), len(list(layer.parameters()))
    # the check's path (not lisa_opt_bound, which the student build stubs): the model's tensors, 8 B per value and
    # 4 B per tensor for what is trained at once, the always-trained part and the gamma largest layers
    sizes = sorted(((sum(p.numel() for p in lay.parameters()), len(list(lay.parameters()))) for lay in layers),
                   reverse=True)[:gamma]
    expected = 8 * (out_n + sum(n for n, _ in sizes)) + 4 * (out_t + sum(t for _, t in sizes))
    if value == expected:
        return passed(f"{name}: {expected:,} = 8 x ({out_n:,} always-trained + {gamma} x {lay_n:,} per layer) + 4 x "
                      f"{out_t + gamma * lay_t} step counters; full fine-tuning's AdamW holds "
                      f"{8 * count_parameters(model).total:,}.")
    if value == 8 * (out_n + gamma * lay_n):
        return failed(f"{name}: almost: torch's AdamW also keeps a 4-byte step counter per parameter tensor.")
    if value == 8 * gamma * lay_n + 4 * gamma * lay_t or value == 8 * gamma * lay_n:
        return failed(f"{name}: the embeddings, final norm and head are always trained; their state counts too.")
    if value == 8 * count_parameters(model).total + 4 * len(list(model.parameters())) or \
            value == 8 * count_parameters(model).total:
        return failed(f"{name}: that is full fine-tuning's state (what the naive LISA grows to); the real LISA "
                      "frees the state of every layer it freezes again.")
    if value == 4 * (out_n + gamma * lay_n) + 4 * (out_t + gamma * lay_t) or value == 4 * (out_n + gamma * lay_n):
        return failed(f"{name}: AdamW keeps two fp32 moments, m and v: 8 bytes per trained parameter.")
    return failed(f"{name}: 8 bytes per parameter trained at once (outside the layers + {gamma} layer(s)), "
                  "plus 4 per tensor.")


# ---- exercise 4: LoRA's trainable parameters on a whole GPT, as a function, checked on fresh configurations ----
GPT_LINEARS = ("c_attn", "attn.c_proj", "c_fc", "mlp.c_proj", "c_proj", "lm_head")  # names apply_lora matches


def gpt_lora_trainable(cfg, r: int, targets) -> int:
    """Reference: trainable parameter elements after apply_lora(GPT(cfg), targets, r), counted by count_parameters
    (built on the meta device: no memory)."""
    from labkit.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(cfg)
    apply_lora(model, list(targets), r=r)
    return count_parameters(model).trainable


def _gpt_targets(seed: int):
    """Fresh questions: two or three small GPTConfigs, each with a rank and a non-empty list of target names."""
    from labkit.models.gpt import GPTConfig

    rng = random.Random(seed)
    out = []
    for i in range(rng.randint(2, 3)):
        heads = rng.choice([1, 2, 4])
        cfg = GPTConfig(vocab_size=rng.randint(50, 600), block_size=rng.choice([32, 64, 128]),
                        n_layer=rng.randint(1, 6), n_head=heads, n_embd=heads * rng.randint(4, 48),
                        bias=rng.random() < 0.5)
        names = ["c_attn", "c_proj", "c_fc", "lm_head"] if i == 0 else \
            rng.sample(GPT_LINEARS, rng.randint(1, 3))
        if "c_proj" in names:  # it matches both projections: "attn.c_proj" or "mlp.c_proj" beside it adds nothing
            names = [n for n in names if not n.endswith(".c_proj")]
        out.append((cfg, rng.choice([1, 2, 4, 8, 16]), names))
    return out


def _gpt_lora_slips(cfg, r: int, targets) -> dict[int, str]:
    """What common slips give, and a hint for each that does not say the answer."""
    d, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    shape = {"c_attn": (d, 3 * d), "attn.c_proj": (d, d), "c_fc": (d, 4 * d), "mlp.c_proj": (4 * d, d)}
    layers = [(a, b, L) for n, (a, b) in shape.items() if n in targets or (n.endswith("c_proj") and "c_proj" in targets)]
    layers += [(d, V, 1)] * ("lm_head" in targets)
    one_side = {sum(r * a * k for a, b, k in layers), sum(r * b * k for a, b, k in layers)}
    square = sum(2 * r * d * k for a, b, k in layers)
    once = sum(r * (a + b) for a, b, k in layers)
    slips = {s: "that is one of the two adapter matrices; look at the shapes of A and B" for s in one_side}
    slips[square] = "not every targeted layer is d x d: print(GPT(cfg)) shows each one's in and out features"
    if L > 1:
        slips[once] = "every block has its own copy of each targeted layer"
    if "c_proj" in targets:
        only_attn = sum(r * (a + b) * k for a, b, k in layers) - L * r * 5 * d
        slips[only_attn] = "apply_lora matches a name by its ending: which modules end in 'c_proj'?"
    return slips


def check_gpt_lora_trainable(fn, seed: int | None = None) -> bool:
    what = "gpt_lora_trainable(cfg, r, targets)"
    if unanswered(fn):
        return not_answered(what)
    if not callable(fn):
        return failed(f"{what}: expected a function, got {type(fn).__name__}")
    cases = _gpt_targets(random.randrange(1 << 30) if seed is None else seed)
    for cfg, r, targets in cases:
        short = (f"GPTConfig(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, vocab_size={cfg.vocab_size}, "
                 f"bias={cfg.bias}), r={r}, targets={targets}")
        try:
            got = fn(cfg, r, list(targets))
        except Exception as e:  # the learner's code: say what failed, do not stop the notebook
            return failed(f"{what} raised {type(e).__name__}: {e} for {short}")
        want = gpt_lora_trainable(cfg, r, targets)
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or got != want:
            hint = _gpt_lora_slips(cfg, r, targets).get(
                got, "the frozen weights and biases train nothing; for each targeted layer, look at the shapes "
                     "of A and B, then add up over the layers and the blocks")
            return failed(f"{what}: wrong for {short} ({hint}).")
    return passed(f"{what}: right on {len(cases)} fresh GPT configurations and target lists, as apply_lora + "
                  "count_parameters count them.")


# ---- exercise 5: why LISA always trains the embeddings and the head -----------------------------------------
WHY_LISA = {
    "a": "PyTorch cannot freeze an embedding whose weight is tied to the head",
    "b": "their optimizer state is too small to matter, so training them is free",
    "c": "measuring LoRA fine-tuning, the LISA paper found the embedding and head layers' weight norms far larger "
         "than the blocks' (they take most of the change), so it keeps them always trained and samples only the "
         "blocks",
}


def check_why_lisa(answer) -> bool:
    what = "why LISA trains the embeddings, the final norm and the head at every step"
    return checked_choice(
        answer, what, WHY_LISA, right="c",
        praise=f"{what}: right: LISA (Pan et al. 2024) starts from that skew of the layer-wise weight norms; "
                 f"sampling the middle blocks a few at a time is its way of giving them their share of the update.",
        hints={"a": f"{what}: requires_grad is per parameter, tied or not; look at what the LISA paper measured "
                 f"first, layer by layer."},
        otherwise=f"{what}: exercise 3 counted it: the embeddings and head of a large-vocabulary model are among its "
                 f"largest tensors; look at what the LISA paper measured first, layer by layer.")
