"""Every reference solution passes its check; blank answers and plausible wrong answers fail, with a message."""

import pytest

from labkit.exercises import lesson00, lesson01
from labkit.memory import GiB, MiB
from labkit.models.gpt import GPT, GPTConfig
from labkit.models.hf import get_config

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)


# ---- lesson 00 ----------------------------------------------------------------------------------
def test_weight_bytes_solution_passes(sol00, says):
    assert lesson00.check_weight_bytes(sol00.weight_bytes(GPT(CFG)), CFG) is True
    says("✅")


def test_weight_bytes_blank_fails(blank, says):
    assert lesson00.check_weight_bytes(blank, CFG) is False
    says("❌", "not answered yet")


def test_weight_bytes_wrong_answers_fail_with_a_hint(says):
    model = GPT(CFG)
    n = sum(p.numel() for p in model.parameters())
    assert lesson00.check_weight_bytes(n, CFG) is False  # forgot the 4 bytes
    says("❌", "4 bytes")
    assert lesson00.check_weight_bytes(4 * (n + CFG.vocab_size * CFG.n_embd), CFG) is False  # tied counted twice
    says("❌", "tied")
    assert lesson00.check_weight_bytes("lots", CFG) is False
    says("❌", "expected a number")


def test_gpt_params_solution_passes_on_fresh_configs(sol00, says):
    assert lesson00.check_gpt_params(sol00.gpt_params, seed=1) is True
    says("✅", "fresh configurations")
    assert lesson00.check_gpt_params(sol00.gpt_params, seed=2) is True
    assert lesson00._configs(1) != lesson00._configs(2)
    assert {c.bias for c in lesson00._configs(1)} == {True, False}
    assert lesson00.gpt_params(CFG) == sum(p.numel() for p in GPT(CFG).parameters())  # meta == real


def test_gpt_params_slips_fail_with_a_hint(sol00, says, blank):
    def untied(cfg):
        return sol00.gpt_params(cfg) + cfg.vocab_size * cfg.n_embd

    assert lesson00.check_gpt_params(untied, seed=1) is False
    says("❌", "tied")

    def no_positions(cfg):
        return sol00.gpt_params(cfg) - cfg.block_size * cfg.n_embd

    assert lesson00.check_gpt_params(no_positions, seed=1) is False
    says("❌", "wpe")

    def no_linear_biases(cfg):
        return sol00.gpt_params(cfg) - (cfg.n_layer * 9 * cfg.n_embd if cfg.bias else 0)

    assert lesson00.check_gpt_params(no_linear_biases, seed=1) is False  # the first config has biases
    says("❌", "bias of its output size")

    def boom(cfg):
        raise KeyError("n_embd")

    assert lesson00.check_gpt_params(boom, seed=1) is False
    says("❌", "raised KeyError")
    assert lesson00.check_gpt_params(lambda cfg: 12, seed=1) is False
    says("❌", "print(GPT(cfg))")
    assert lesson00.check_gpt_params(blank) is False
    says("❌", "not answered")


def test_why_peak(sol00, says, blank):
    assert lesson00.check_why_peak(sol00.WHY_PEAK) is True
    says("✅", "lesson 01")
    assert lesson00.check_why_peak("a") is False
    says("❌", "categories")
    assert lesson00.check_why_peak("c") is False
    says("❌", "logical bytes")
    assert lesson00.check_why_peak("d") is False
    says("❌", "one of")
    assert lesson00.check_why_peak(blank) is False
    says("❌", "not answered")


# ---- lesson 01, exercise 1: bytes per parameter ----------------------------------------------------
@pytest.mark.parametrize("model", ["gpt2", "llama-tiny"])
def test_bytes_per_param_solutions_pass(sol01, model, says):
    assert lesson01.check_bytes_per_param(sol01.BYTES_PER_PARAM_FP32, sol01.BYTES_PER_PARAM_MIXED, model=model,
                                          optimizer="sgd-momentum")
    assert lesson01.check_bytes_per_param(sol01.ADAMW_BYTES_PER_PARAM_FP32, sol01.ADAMW_BYTES_PER_PARAM_MIXED,
                                          model=model, optimizer="adamw")
    out = says("✅")
    assert "❌" not in out


def test_bytes_per_param_expected_values_come_from_the_terms():
    assert lesson01.model_state_bytes_per_param("gpt2", "fp32") == pytest.approx(16, abs=1e-3)
    assert lesson01.model_state_bytes_per_param("gpt2", "mixed-bf16") == pytest.approx(18, abs=0.05)
    assert lesson01.model_state_bytes_per_param("gpt2", "fp32", "sgd-momentum") == pytest.approx(12, abs=1e-3)
    assert lesson01.model_state_bytes_per_param("gpt2", "fp32", "sgd") == pytest.approx(8, abs=1e-3)


@pytest.mark.parametrize("fp32, mixed", [(None, 18), (16, None), (..., ...)])
def test_bytes_per_param_blanks_fail(fp32, mixed, says):
    assert lesson01.check_bytes_per_param(fp32, mixed) is False
    says("❌", "not answered yet")


@pytest.mark.parametrize("optimizer, fp32, mixed, hint", [
    ("adamw", 12, 18, "gradients are missing"),
    ("adamw", 8, 18, "optimizer state is missing"),
    ("adamw", 16, 16, "ZeRO's count"),  # a 16-bit model and gradients: another scheme
    ("adamw", 16, 20, "16-bit gradient"),
    ("adamw", 16, 14, "master copy"),
    ("adamw", 16 * 124_439_808, 18, "whole model"),
    ("sgd-momentum", 16, 14, "momentum buffer"),  # AdamW's count for SGD with momentum
    ("sgd-momentum", 12, 18, "momentum buffer"),
    ("sgd-momentum", 12, 12, "ZeRO's count"),
])
def test_bytes_per_param_wrong_answers_fail_with_a_hint(optimizer, fp32, mixed, hint, says):
    assert lesson01.check_bytes_per_param(fp32, mixed, "gpt2", optimizer) is False
    says("❌", hint)


# ---- lesson 01, exercise 2: the logits term ----------------------------------------------------------
def test_logits_solution_passes(sol01, says):
    assert lesson01.check_logits_bytes(sol01.LOGSOFTMAX_BYTES, "llama3.2-1b", 4, 4096) is True
    says("✅")
    assert lesson01.check_logits_bytes(sol01.logsoftmax_bytes(8, 1024, 50257), "gpt2", 8, 1024) is True
    vocab = get_config("llama-tiny").vocab_size
    assert lesson01.check_logits_bytes(sol01.logsoftmax_bytes(3, 100, vocab), "llama-tiny", 3, 100) is True


def test_logits_blank_fails(blank, says):
    assert lesson01.check_logits_bytes(blank) is False
    says("❌", "not answered yet")


def test_logits_wrong_answers_fail_with_a_hint(sol01, says):
    right = sol01.logsoftmax_bytes(8, 1024, 50257)  # gpt2, the check's default numbers
    assert lesson01.check_logits_bytes(right // 4) is False  # elements, not bytes
    says("❌", "elements")
    assert lesson01.check_logits_bytes(right / GiB) is False  # GiB, not bytes
    says("❌", "GiB")
    assert lesson01.check_logits_bytes(8 * 1024 * 768 * 4) is False  # the hidden state
    says("❌", "hidden state")
    assert lesson01.check_logits_bytes(right * 2) is False
    says("❌", "vocab")


# ---- lesson 01, exercise 3: the largest batch that fits ------------------------------------------------
@pytest.mark.parametrize("model, seq, budget, device", [
    (CFG, 64, 8 * MiB, "cpu"), ("gpt2", 1024, 16 * GiB, "cpu"), ("gpt2", 1024, 16 * GiB, "cuda"),
    ("llama2-7b", 1024, 16 * GiB, "cpu"),
])
def test_largest_batch_solution_passes(sol01, model, seq, budget, device, says):
    b = sol01.largest_batch(model, seq, budget, device=device)
    assert lesson01.check_largest_batch(b, model, seq, budget, device=device) is True
    says("✅")
    if model == "llama2-7b":
        assert b == 0  # 16 bytes per parameter of a 6.7B model alone overflow 16 GiB


def test_largest_batch_blank_fails(blank, says):
    assert lesson01.check_largest_batch(blank, CFG, 64, 8 * MiB) is False
    says("❌", "not answered yet")


def test_largest_batch_wrong_answers_fail_with_a_hint(sol01, says):
    b = sol01.largest_batch(CFG, 64, 8 * MiB)
    assert b > 2
    assert lesson01.check_largest_batch(b + 1, CFG, 64, 8 * MiB) is False
    says("❌", "does not fit", "smaller")
    assert lesson01.check_largest_batch(b - 1, CFG, 64, 8 * MiB) is False
    says("❌", "fits too", "larger")
    assert lesson01.check_largest_batch(2.5, CFG, 64, 8 * MiB) is False
    says("❌", "whole number")
    assert lesson01.check_largest_batch(-1, CFG, 64, 8 * MiB) is False
    says("❌", "negative")


# ---- per-student inputs (labkit.exercises.Inputs): lessons 00 and 01 ------------------------------------
def _two_students(inputs, key, answer, n=40):
    """Two students' drawn inputs whose right answers differ: (first student's, another's)."""
    drawn = [inputs(key, f"s{i}", quiet=True) for i in range(n)]
    return drawn[0], next(d for d in drawn[1:] if answer(d) != answer(drawn[0]))


def test_lessons_00_01_own_inputs_on_your_own(monkeypatch):
    monkeypatch.delenv("LABKIT_STUDENT", raising=False)
    assert lesson00.inputs("weight_bytes") == {"dtype": "fp32"}
    assert lesson01.inputs("bytes_per_param") == {"optimizer": "sgd-momentum"}
    assert lesson01.inputs("logits_bytes") == {"batch": 4, "seq": 4096}
    assert lesson01.inputs("largest_batch") == {"seq": 1024, "budget": 16 * GiB}


def test_weight_bytes_solution_passes_on_every_input(sol00, says):
    model = GPT(CFG)
    for drawn in lesson00.inputs.every("weight_bytes"):
        assert lesson00.check_weight_bytes(sol00.weight_bytes(model, **drawn), CFG, **drawn) is True, drawn
    assert "❌" not in says("✅")
    assert sol00.weight_bytes(model) == 4 * sum(p.numel() for p in model.parameters())  # the lesson's: fp32


def test_weight_bytes_another_students_answer_fails(sol00, says):
    model = GPT(CFG)
    mine, theirs = _two_students(lesson00.inputs, "weight_bytes", lambda d: sol00.weight_bytes(model, **d))
    assert lesson00.check_weight_bytes(sol00.weight_bytes(model, **mine), CFG, **theirs) is False
    says("❌", "bytes per number")  # the hint names the dtype's bytes


def test_bytes_per_param_solution_passes_on_every_input(sol01, says):
    for drawn in lesson01.inputs.every("bytes_per_param"):
        fp32, mixed = sol01.bytes_per_param_for(drawn.optimizer)
        assert lesson01.check_bytes_per_param(fp32, mixed, model="gpt2", **drawn) is True, drawn
    assert "❌" not in says("✅")
    assert sol01.bytes_per_param_for("sgd-momentum") == (sol01.BYTES_PER_PARAM_FP32, sol01.BYTES_PER_PARAM_MIXED)


def test_bytes_per_param_another_students_answer_fails(sol01, says):
    mine, theirs = _two_students(lesson01.inputs, "bytes_per_param", lambda d: sol01.bytes_per_param_for(**d))
    assert lesson01.check_bytes_per_param(*sol01.bytes_per_param_for(**mine), model="gpt2", **theirs) is False
    says("❌")


def test_logits_solution_passes_on_every_input(sol01, says):
    vocab = get_config("llama3.2-1b").vocab_size
    tokens = set()
    for drawn in lesson01.inputs.every("logits_bytes"):
        answer = sol01.logsoftmax_bytes(drawn.batch, drawn.seq, vocab)
        assert lesson01.check_logits_bytes(answer, model="llama3.2-1b", **drawn) is True, drawn
        tokens.add(drawn.batch * drawn.seq)
    assert "❌" not in says("✅")
    assert len(tokens) == len(lesson01.inputs.every("logits_bytes"))  # no two inputs share an answer


def test_logits_another_students_answer_fails(sol01, says):
    vocab = get_config("llama3.2-1b").vocab_size
    mine, theirs = _two_students(lesson01.inputs, "logits_bytes",
                                 lambda d: sol01.logsoftmax_bytes(d.batch, d.seq, vocab))
    answer = sol01.logsoftmax_bytes(mine.batch, mine.seq, vocab)
    assert lesson01.check_logits_bytes(answer, model="llama3.2-1b", **theirs) is False
    says("❌")


def test_largest_batch_solution_passes_on_drawn_inputs(sol01, says):
    """Six students (the reference solution bisects with the estimator: a second or so per input)."""
    for i in range(6):
        drawn = lesson01.inputs("largest_batch", f"s{i}", quiet=True)
        b = sol01.largest_batch("gpt2", drawn.seq, drawn.budget, device="cpu")
        assert b > 0, drawn  # every input fits gpt2 at batch 1
        assert lesson01.check_largest_batch(b, "gpt2", dtype="fp32", optimizer="adamw", device="cpu", **drawn), drawn
    assert "❌" not in says("✅")


def test_largest_batch_another_students_answer_fails(sol01, says):
    def answer(d):
        return sol01.largest_batch("gpt2", d.seq, d.budget, device="cpu")

    mine, theirs = _two_students(lesson01.inputs, "largest_batch", answer, n=6)
    assert lesson01.check_largest_batch(answer(mine), "gpt2", device="cpu", **theirs) is False
    says("❌")
