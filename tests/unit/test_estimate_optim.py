"""Estimator terms for labkit.optim's optimizers, offload and step-in-backward, against the ledger."""

import dataclasses
import math

import pytest
import torch
import transformers.optimization

from labkit.memory import Category
from labkit.estimate import Precision, estimate, spec_from
from labkit.run import make_optimizer, measure_step
from labkit.estimate.optim_terms import adam8bit_state, galore_matrix_state, state_bytes
from labkit.models.gpt import GPT, GPTConfig
from labkit.optim import Adafactor, StepInBackward

G = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)

CASES = [("adamw8bit", {}), ("lion", {}), ("adafactor", {}), ("galore", dict(rank=16)), ("galore8bit", dict(rank=16)),
         ("adamw", dict(optimizer_offload="cpu")), ("adamw", dict(step_in_backward=True))]


@pytest.mark.parametrize("optimizer, kw", CASES, ids=[c[0] + "-" + "-".join(c[1]) for c in CASES])
def test_within_3_percent_and_state_exact(optimizer, kw):
    e = estimate(G, 4, 64, "fp32", optimizer, **kw)
    m = measure_step(G, 4, 64, "fp32", optimizer, steps=2, **kw)
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total
    # state is complete in the second step's backward (the first step makes it lazily)
    assert e.phases["backward"][Category.OPT] == m.phases["backward"][Category.OPT]


def test_state_formulas():
    assert adam8bit_state(4095) == 8 * 4095 and adam8bit_state(4096) == 2 * 4096 + 8 * 16
    assert galore_matrix_state(128, 512, 16, 4, False) == 4 * 16 * (128 + 2 * 512)
    spec = spec_from(G)
    n = spec.n_params
    wide = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=64)  # big matrices dominate, as in real models
    adam = estimate(wide, 1, 8, "fp32", "adamw").phases["optimizer"][Category.OPT]
    eight = estimate(wide, 1, 8, "fp32", "adamw8bit").phases["optimizer"][Category.OPT]
    assert eight <= 0.26 * adam  # 8-bit Adam: at least 74 % smaller
    lion = estimate(G, 1, 8, "fp32", "lion").phases["optimizer"][Category.OPT]
    assert lion == 4 * n
    factored = sum(4 * (s[0] + s[1]) if len(s) == 2 else 4 * math.prod(s) for s in spec.param_shapes)  # GPT: 1-2 dims
    assert estimate(G, 1, 8, "fp32", "adafactor").phases["optimizer"][Category.OPT] == factored
    off = estimate(G, 1, 8, "fp32", "adamw", optimizer_offload="disk")
    assert off.phases["optimizer"][Category.OPT] == 0
    sib = estimate(G, 4, 64, "fp32", "adamw", step_in_backward=True)
    assert sib.phases["backward"][Category.GRAD] <= spec.largest_param * 4
    assert Precision.of("fp32").weight == 4


@pytest.mark.parametrize("kw, match", [
    (dict(optimizer="galore"), "rank"), (dict(optimizer="galore", rank=0), "rank"),
    (dict(optimizer="galore", rank=1000), "rank"), (dict(optimizer_offload="nvme"), "optimizer_offload"),
    (dict(optimizer="lion", optimizer_offload="cpu"), "adamw"),
    (dict(step_in_backward=True, micro_batch=2), "step_in_backward"),
])
def test_bad_optimizer_options(kw, match):
    with pytest.raises(ValueError, match=match):
        estimate(G, 4, 32, **kw)


SIB = [("adamw", {}), ("adamw8bit", {}), ("lion", {}), ("adafactor", {}), ("galore", dict(rank=16)),
       ("galore8bit", dict(rank=16))]


@pytest.mark.parametrize("optimizer, kw", SIB, ids=[c[0] for c in SIB])
def test_step_in_backward_within_1_percent(optimizer, kw):
    """Every optimizer steps inside backward. The step's temporaries exist only while a parameter steps
    (the ledger's "optimizer" phase, inside backward): measured 0.00-0.01 % off, peak and that phase."""
    e = estimate(G, 4, 64, "fp32", optimizer, step_in_backward=True, **kw)
    m = measure_step(G, 4, 64, "fp32", optimizer, steps=2, step_in_backward=True, **kw)
    assert abs(e.peak.total - m.peak.total) <= 0.01 * m.peak.total
    assert e.phases["backward"][Category.OPT] == m.phases["backward"][Category.OPT]
    if not optimizer.startswith("galore"):  # GaLore's estimate holds a projector refresh (SVD): not in step 2
        assert abs(e.phases["optimizer"].total - m.phases["optimizer"].total) <= 0.01 * m.phases["optimizer"].total


def test_make_optimizer_steps_any_optimizer_in_backward():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    opt = make_optimizer(model, "galore8bit", rank=4, step_in_backward=True)
    assert isinstance(opt, StepInBackward) and len(opt.optimizers) == len(list(model.parameters()))
    assert "GaLoreAdamW8bit" in repr(opt) and {g.get("rank") for g in opt.param_groups} == {None, 4}
    assert isinstance(next(iter(make_optimizer(model, "adafactor", step_in_backward=True).optimizers.values())),
                      Adafactor)
    with pytest.raises(ValueError, match="^step_in_backward and optimizer_offload"):
        make_optimizer(model, "adamw", optimizer_offload="cpu", step_in_backward=True)
    with pytest.raises(ValueError, match="^step_in_backward and optimizer_offload"):
        estimate(G, 4, 32, optimizer_offload="cpu", step_in_backward=True)
    with pytest.raises(ValueError, match="^step_in_backward cannot accumulate"):
        measure_step(G, 4, 32, micro_batch=2, step_in_backward=True)


def test_adafactor_state_of_a_3d_tensor_as_transformers():
    """transformers' Adafactor factors any tensor of 2+ dims over its last two: rows shape[:-1], columns
    shape[:-2] + shape[-1:]. It also keeps a 0-dim "RMS" tensor per parameter (4 B); labkit does not."""
    ref_cls = transformers.optimization.Adafactor
    shape = (8, 3, 5, 7)  # a conv weight (out, in, kh, kw)
    spec = dataclasses.replace(spec_from(G), param_shapes=[shape], param_numels=[math.prod(shape)])
    predicted = state_bytes(spec, 4, "adafactor")
    w = torch.nn.Parameter(torch.randn(shape))
    w.grad = torch.randn(shape)
    ref = ref_cls([w])
    ref.step()
    held = {k: v.numel() * 4 for k, v in ref.state[w].items() if isinstance(v, torch.Tensor) and k != "RMS"}
    assert predicted == sum(held.values()) == 4 * (8 * 3 * 5 + 8 * 3 * 7)


# ---- the optimizer step's own memory, derived from its ops (labkit.estimate.optim_terms.tensor_step_bytes) ----
STEPPERS = ["sgd", "sgd-momentum", "adam", "adamw", "adamw8bit", "adam8bit", "lion", "adafactor"]
# a vector, a matrix under 8-bit Adam's 4096-element limit, a tall matrix, a 3-D tensor (Adafactor factors
# its last two dims), and a matrix of more than one 8-bit chunk (2^20 values)
SHAPES = [(300,), (40, 50), (3000, 5), (4, 30, 50), (1100, 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("optimizer", STEPPERS)
def test_one_tensor_step_as_the_ledger_counts_it(optimizer, dtype, shape):
    """One parameter's step: the estimate's (PARAM, TEMP) at its worst op equals the ledger's optimizer-phase
    peak: PARAM beyond the parameter itself (fp32 working copies p.float() of a 16-bit one) and TEMP."""
    from labkit.memory import Ledger
    from labkit.run import optimizer_class
    from labkit.estimate.optim_terms import tensor_step_bytes

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(shape).to(dtype))
    cls, kw = optimizer_class(optimizer)
    opt = cls([p], **kw)
    with Ledger(optimizer=opt) as led:
        for _ in range(2):  # the first step makes the state, the second is the steady one
            p.grad = torch.randn(shape).to(dtype)
            opt.step()
    measured = led.measurement().phases["optimizer"]
    d = torch.finfo(dtype).bits // 8
    assert tensor_step_bytes(shape, d, optimizer) == (measured[Category.PARAM] - p.numel() * d,
                                                      measured[Category.TEMP])


TINY = GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=16)  # every tensor under 4096 values: 8-bit Adam's fp32 path
# wpe (512, 32) comes after wte (256, 32): torch's single-tensor Adam still holds wte's denom while wpe steps
SMALL = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=512)
STEP16 = [(SMALL, "bf16", "adafactor", {}), (SMALL, "fp16", "adamw8bit", {}), (TINY, "bf16", "adam8bit", {}),
          (SMALL, "bf16", "adamw", {}), (SMALL, "fp16", "adam", dict(foreach=True)),
          (SMALL, "bf16", "adamw8bit", dict(step_in_backward=True)),
          (SMALL, "fp16", "adafactor", dict(step_in_backward=True))]


@pytest.mark.parametrize("model, dtype, optimizer, kw", STEP16,
                         ids=[f"{'tiny' if c[0] is TINY else 'small'}-{c[1]}-{c[2]}-{'-'.join(c[3])}" for c in STEP16])
def test_optimizer_moment_of_16bit_parameters_as_the_ledger(model, dtype, optimizer, kw):
    """16-bit parameters, small model and batch: the optimizer step sets the peak. labkit.optim's steps work
    on fp32 copies of the parameter (PARAM in the ledger) and of its gradient (TEMP); the estimate's
    optimizer moment has each in its category, byte for byte."""
    e = estimate(model, 2, 4, dtype, optimizer, device="cpu", **kw)
    m = measure_step(model, 2, 4, dtype, optimizer, steps=2, **kw)
    assert e.peak_phase == m.peak_phase == "optimizer"
    est, meas = e.phases["optimizer"], m.phases["optimizer"]
    for cat in (Category.PARAM, Category.GRAD, Category.OPT):
        assert est[cat] == meas[cat], cat
    # the token ids are ACT, or TEMP when made after a backward that stepped (step in backward: no optimizer
    # phase before the next forward). Not in the estimate: train_step's 0-dim tensors, the fp32 loss total
    # and, while a step runs inside backward, the loss and its seed gradient: at most 3 x 4 bytes
    assert abs((est[Category.TEMP] + est[Category.ACT]) - (meas[Category.TEMP] + meas[Category.ACT])) <= 3 * 4
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total


def test_step_in_backward_under_autocast_frees_the_stepping_matrix_copy():
    """Mixed precision, step in backward: when a block's largest matrix (the MLP's output projection) steps,
    its own 16-bit autocast copy is gone, the other matrices' copies and the tied head's fp32 gradient are
    not. The copy freed is that matrix's (2 x 4h x h), not the model's largest tensor's (the embedding)."""
    small = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)
    e = estimate(small, 1, 4, "mixed-bf16", "adamw", step_in_backward=True)
    m = measure_step(small, 1, 4, "mixed-bf16", "adamw", steps=2, step_in_backward=True)
    assert m.peak_phase == "optimizer"
    assert abs(e.phases["optimizer"].total - m.phases["optimizer"].total) <= 0.01 * m.peak.total
    assert abs(e.peak.total - m.peak.total) <= 0.01 * m.peak.total
