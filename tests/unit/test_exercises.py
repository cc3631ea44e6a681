"""Every reference solution passes its check; blank answers and plausible wrong answers fail, with a message."""

import importlib.util
from pathlib import Path

import pytest

from labkit.exercises import lesson00, lesson01
from labkit.memory import GiB, MiB
from labkit.models.gpt import GPT, GPTConfig
from labkit.models.hf import get_config

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions"
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
BLANKS = [None, ...]


def _solutions(name: str):
    spec = importlib.util.spec_from_file_location(f"solutions_{name}", SOLUTIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sol00():
    return _solutions("lesson00")


@pytest.fixture(scope="module")
def sol01():
    return _solutions("lesson01")


def _says(capsys, mark: str, *words: str) -> str:
    out = capsys.readouterr().out
    assert mark in out, out
    for w in words:
        assert w in out, out
    return out


# ---- lesson 00 ----------------------------------------------------------------------------------
def test_weight_bytes_solution_passes(sol00, capsys):
    assert lesson00.check_weight_bytes(sol00.weight_bytes(GPT(CFG)), CFG) is True
    _says(capsys, "✅")


@pytest.mark.parametrize("blank", BLANKS)
def test_weight_bytes_blank_fails(blank, capsys):
    assert lesson00.check_weight_bytes(blank, CFG) is False
    _says(capsys, "❌", "not answered yet")


def test_weight_bytes_wrong_answers_fail_with_a_hint(capsys):
    model = GPT(CFG)
    n = sum(p.numel() for p in model.parameters())
    assert lesson00.check_weight_bytes(n, CFG) is False  # forgot the 4 bytes
    _says(capsys, "❌", "4 bytes")
    assert lesson00.check_weight_bytes(4 * (n + CFG.vocab_size * CFG.n_embd), CFG) is False  # tied counted twice
    _says(capsys, "❌", "tied")
    assert lesson00.check_weight_bytes("lots", CFG) is False
    _says(capsys, "❌", "expected a number")


# ---- lesson 01, exercise 1: bytes per parameter ----------------------------------------------------
@pytest.mark.parametrize("model", ["gpt2", "llama-tiny"])
def test_bytes_per_param_solutions_pass(sol01, model, capsys):
    assert lesson01.check_bytes_per_param(sol01.BYTES_PER_PARAM_FP32, sol01.BYTES_PER_PARAM_MIXED, model=model,
                                          optimizer="sgd-momentum")
    assert lesson01.check_bytes_per_param(sol01.ADAMW_BYTES_PER_PARAM_FP32, sol01.ADAMW_BYTES_PER_PARAM_MIXED,
                                          model=model, optimizer="adamw")
    out = _says(capsys, "✅")
    assert "❌" not in out


def test_bytes_per_param_expected_values_come_from_the_terms():
    assert lesson01.model_state_bytes_per_param("gpt2", "fp32") == pytest.approx(16, abs=1e-3)
    assert lesson01.model_state_bytes_per_param("gpt2", "mixed-bf16") == pytest.approx(18, abs=0.05)
    assert lesson01.model_state_bytes_per_param("gpt2", "fp32", "sgd-momentum") == pytest.approx(12, abs=1e-3)
    assert lesson01.model_state_bytes_per_param("gpt2", "fp32", "sgd") == pytest.approx(8, abs=1e-3)


@pytest.mark.parametrize("fp32, mixed", [(None, 18), (16, None), (..., ...)])
def test_bytes_per_param_blanks_fail(fp32, mixed, capsys):
    assert lesson01.check_bytes_per_param(fp32, mixed) is False
    _says(capsys, "❌", "not answered yet")


@pytest.mark.parametrize("optimizer, fp32, mixed, hint", [
    ("adamw", 12, 18, "gradients are missing"),
    ("adamw", 8, 18, "optimizer state is missing"),
    ("adamw", 16, 16, "Playbook"),  # discussion #104: the fp32 gradients forgotten
    ("adamw", 16, 20, "16-bit gradient"),
    ("adamw", 16, 14, "master copy"),
    ("adamw", 16 * 124_439_808, 18, "whole model"),
    ("sgd-momentum", 16, 14, "momentum buffer"),  # AdamW's count for SGD with momentum
    ("sgd-momentum", 12, 18, "momentum buffer"),
    ("sgd-momentum", 12, 12, "Playbook"),
])
def test_bytes_per_param_wrong_answers_fail_with_a_hint(optimizer, fp32, mixed, hint, capsys):
    assert lesson01.check_bytes_per_param(fp32, mixed, "gpt2", optimizer) is False
    _says(capsys, "❌", hint)


# ---- lesson 01, exercise 2: the logits term ----------------------------------------------------------
def test_logits_solution_passes(sol01, capsys):
    assert lesson01.check_logits_bytes(sol01.LOGSOFTMAX_BYTES, "llama3.2-1b", 4, 4096) is True
    _says(capsys, "✅")
    assert lesson01.check_logits_bytes(sol01.logsoftmax_bytes(8, 1024, 50257), "gpt2", 8, 1024) is True
    vocab = get_config("llama-tiny").vocab_size
    assert lesson01.check_logits_bytes(sol01.logsoftmax_bytes(3, 100, vocab), "llama-tiny", 3, 100) is True


@pytest.mark.parametrize("blank", BLANKS)
def test_logits_blank_fails(blank, capsys):
    assert lesson01.check_logits_bytes(blank) is False
    _says(capsys, "❌", "not answered yet")


def test_logits_wrong_answers_fail_with_a_hint(sol01, capsys):
    right = sol01.logsoftmax_bytes(8, 1024, 50257)  # gpt2, the check's default numbers
    assert lesson01.check_logits_bytes(right // 4) is False  # elements, not bytes
    _says(capsys, "❌", "elements")
    assert lesson01.check_logits_bytes(right / GiB) is False  # GiB, not bytes
    _says(capsys, "❌", "GiB")
    assert lesson01.check_logits_bytes(8 * 1024 * 768 * 4) is False  # the hidden state
    _says(capsys, "❌", "hidden state")
    assert lesson01.check_logits_bytes(right * 2) is False
    _says(capsys, "❌", "vocab")


# ---- lesson 01, exercise 3: the largest batch that fits ------------------------------------------------
@pytest.mark.parametrize("model, seq, budget, device", [
    (CFG, 64, 8 * MiB, "cpu"), ("gpt2", 1024, 16 * GiB, "cpu"), ("gpt2", 1024, 16 * GiB, "cuda"),
    ("llama2-7b", 1024, 16 * GiB, "cpu"),
])
def test_largest_batch_solution_passes(sol01, model, seq, budget, device, capsys):
    b = sol01.largest_batch(model, seq, budget, device=device)
    assert lesson01.check_largest_batch(b, model, seq, budget, device=device) is True
    _says(capsys, "✅")
    if model == "llama2-7b":
        assert b == 0  # 16 bytes per parameter of a 6.7B model alone overflow 16 GiB


@pytest.mark.parametrize("blank", BLANKS)
def test_largest_batch_blank_fails(blank, capsys):
    assert lesson01.check_largest_batch(blank, CFG, 64, 8 * MiB) is False
    _says(capsys, "❌", "not answered yet")


def test_largest_batch_wrong_answers_fail_with_a_hint(sol01, capsys):
    b = sol01.largest_batch(CFG, 64, 8 * MiB)
    assert b > 2
    assert lesson01.check_largest_batch(b + 1, CFG, 64, 8 * MiB) is False
    _says(capsys, "❌", "does not fit", "smaller")
    assert lesson01.check_largest_batch(b - 1, CFG, 64, 8 * MiB) is False
    _says(capsys, "❌", "fits too", "larger")
    assert lesson01.check_largest_batch(2.5, CFG, 64, 8 * MiB) is False
    _says(capsys, "❌", "whole number")
    assert lesson01.check_largest_batch(-1, CFG, 64, 8 * MiB) is False
    _says(capsys, "❌", "negative")
