"""The checks that get a lesson's own objects compute their expected value through another path than the answer
function (which the student build stubs, issue 41): each path agrees with the answer function it
replaces, on
the profiles' GPTs and on configurations the lessons do not use."""

import pytest
import torch

from labkit.exercises import lesson01, lesson02, lesson03, lesson05, lesson07, lesson08, lesson10
from labkit.models.gpt import GPT, GPTConfig

CONFIGS = [GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256, dropout=0.0),  # smoke
           GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, vocab_size=256, dropout=0.0),  # cpu
           GPTConfig(n_layer=3, n_head=2, n_embd=48, block_size=128, vocab_size=300, bias=False)]


@pytest.mark.parametrize("model", ["gpt2", "llama3.2-1b", *CONFIGS])
@pytest.mark.parametrize("dtype, optimizer", [("fp32", "adamw"), ("fp32", "sgd-momentum"),
                                              ("mixed-bf16", "adamw"), ("mixed-bf16", "sgd")])
def test_lesson01_states_from_the_whole_step(model, dtype, optimizer):
    from labkit.estimate.spec import spec_from

    got = lesson01._states_per_param(spec_from(model), dtype, optimizer)
    assert got == pytest.approx(lesson01.model_state_bytes_per_param(model, dtype, optimizer), rel=1e-12)


@pytest.mark.parametrize("grads", [torch.tensor([3e-9, 2e-7, 5e-5, 1e-2, 4.0]), torch.tensor([1e-6, 0.5, 30.0]),
                                   torch.tensor([0.25, 1.0, 0.0])])
def test_lesson02_scale_window_property(grads, capsys):
    lo, hi = lesson02.scale_window(grads)
    assert lesson02.check_scale_window(lo, hi, grads) is True
    assert lesson02.check_scale_window(2 * lo, hi, grads) is False
    assert lesson02.check_scale_window(lo, hi / 2, grads) is False
    if lo > 1:
        assert lesson02.check_scale_window(lo / 2, hi, grads) is False
    assert lesson02.check_scale_window(lo, 2 * hi, grads) is False


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("batch, seq, dtype", [(4, 64, "fp32"), (2, 32, "bf16")])
def test_lesson03_checkpoint_input_from_the_whole_step(cfg, batch, seq, dtype):
    assert lesson03._checkpoint_input(cfg, batch, seq, dtype) == lesson03.kept_per_block(cfg, batch, seq, dtype)


@pytest.mark.parametrize("cfg", CONFIGS)
def test_lesson03_crossover_is_where_the_gap_closes(cfg):
    s = lesson03.scores_crossover(cfg, 2, 64)
    assert abs(lesson03._gap(cfg, 2, s, "fp32", "cpu")) < 0.002
    assert abs(lesson03._gap(cfg, 2, 1.1 * s, "fp32", "cpu")) > 0.005


@pytest.mark.parametrize("cfg", CONFIGS)
def test_lesson05_largest_gradient(cfg):
    assert lesson05._largest_gradient(cfg, 4) == lesson05.step_in_backward_grad_bytes(cfg, 4)
    assert lesson05._largest_gradient(GPT(cfg), 2) == lesson05.step_in_backward_grad_bytes(cfg, 2)


def test_lesson07_zeros_by_rounding(capsys):
    g = torch.Generator().manual_seed(3)
    for scale in (1.0, 30.0):
        w = torch.randn(64, 64, generator=g)
        w[0, 0] = scale * 40
        assert lesson07.check_zeros_per_tensor(lesson07.zeros_per_tensor(w), w) is True


@pytest.mark.parametrize("cfg", CONFIGS)
def test_lesson08_adapters_and_lisa_from_shapes(cfg, capsys):
    model = GPT(cfg)
    for targets in (("c_attn",), ("c_attn", "c_fc"), ("all-linear",)):
        names = lesson08.find_targets(model, "all-linear") if targets == ("all-linear",) else targets
        assert lesson08._adapters(model, names, 4) == lesson08.lora_params(model, names, 4)
    for gamma in (1, 2):
        assert lesson08.check_lisa_opt_bytes(lesson08.lisa_opt_bound(model, gamma), model, gamma) is True


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_lesson10_stage0_and_tp_from_the_per_rank_estimate(cfg, schedule, capsys):
    from dataclasses import replace

    cfg = replace(cfg, n_layer=8)
    want = lesson10.stage0_activation_bytes(cfg, 16, 32, 4, 8, schedule)
    assert lesson10._stage0(cfg, 16, 32, 4, 8, schedule) == want
    assert lesson10.check_tp_param_bytes(lesson10.tp_param_bytes(cfg, 2), cfg, t=2) is True
