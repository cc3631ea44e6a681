"""Recipe.quant_set: which Linears a quantized LoRA base stores (issue 43, item 2).

"all-linear" (the default) is transformers + bitsandbytes' convention (load_in_4bit quantizes every Linear but
the head, whatever the LoRA targets); "targets" is torchtune's qlora builders' (only the LoRA-wrapped Linears).
"""

import json

import pytest
import torch

from estimate_checks import estimate_and_measure
from labkit.cli import main
from labkit.estimate import Recipe, estimate, peft_terms
from labkit.estimate.spec import spec_from
from labkit.memory import Category, GiB, MiB
from labkit.memory.report import TermKey as K
from labkit.run import apply_peft, build_model

TARGETS = {"gpt2-tiny": "c_attn", "llama-tiny": "q_proj,v_proj"}  # each family's attention names


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("dtype", ["fp32", "mixed-bf16"])
@pytest.mark.parametrize("qset", ["all-linear", "targets"])
@pytest.mark.parametrize("model", list(TARGETS))
def test_estimate_matches_measure_step_per_category(model, qset, dtype):
    r = Recipe.of(model, 4, 64, dtype=dtype, lora_rank=8, lora_targets=TARGETS[model], quant="nf4",
                  quant_set=qset)
    e, m = estimate_and_measure(r)
    # the quantized buffers are exact (the model's own buffers, rotary inv_freq, apart)
    own = sum(b.numel() * b.element_size() for b in build_model(model, dtype).buffers())
    assert e.phases["optimizer"].bytes[Category.BUFFER] + own == \
        m.phases["optimizer"].bytes[Category.BUFFER]


def test_int8_all_linear_within_3_percent():
    r = Recipe.of("llama-tiny", 4, 64, lora_rank=8, lora_targets="q_proj,v_proj", quant="int8")
    estimate_and_measure(r)


def _quantized_modules(m) -> set[str]:
    from labkit.quant import Int8Linear
    from labkit.quant.nf4 import NF4Linear

    return {n.removesuffix(".base") for n, x in m.named_modules() if isinstance(x, (NF4Linear, Int8Linear))}


@pytest.mark.parametrize("model", list(TARGETS))
def test_the_measured_model_quantizes_the_set_the_estimate_names(model):
    for qset in ("all-linear", "targets"):
        m = build_model(model)
        peft = apply_peft(m, "fp32", 8, TARGETS[model], "nf4", quant_set=qset)
        names = {name for name, *_ in peft.quantized}
        assert _quantized_modules(m) == names
        adapted = {name for name, *_ in peft.targets}
        assert (names == adapted) == (qset == "targets")
        assert not any(p.requires_grad for n, p in m.named_parameters() if "lora_" not in n)
        assert not any("lm_head" in n for n in names)


@pytest.mark.parametrize("model", list(TARGETS))
def test_all_linear_is_what_transformers_and_bitsandbytes_quantize(model):
    """transformers' own replacement (what from_pretrained(quantization_config=...) runs), on the meta device:
    every Linear (GPT-2's Conv1D too) but the head, whatever the LoRA targets; and the export's skip list
    for quant_set 'targets' leaves exactly the targets."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    from labkit.models import hf
    from labkit.plan.export import training_arguments

    spec = spec_from(model)
    for qset in ("all-linear", "targets"):
        r = Recipe.of(model, 1, 16, dtype="mixed-bf16", lora_rank=8, lora_targets=TARGETS[model], quant="nf4",
                      quant_set=qset)
        q = training_arguments(r)["peft"]["quantization"]
        assert ("llm_int8_skip_modules" in q) == (qset == "targets")
        skip = q.get("llm_int8_skip_modules") or get_keys_to_not_convert(hf.build(model, device="meta"))
        m = replace_with_bnb_linear(hf.build(model, device="meta"), skip, BitsAndBytesConfig(**q))
        theirs = {n for n, x in m.named_modules() if isinstance(x, bnb.nn.Linear4bit)}
        assert theirs == {name for name, *_ in peft_terms.of_recipe(spec, r).quantized}


def test_llama2_7b_base_bytes_under_both_conventions():
    """The issue's figure: llama2-7b, B=4, S=512, bf16, LoRA r=16 on q_proj,v_proj over NF4."""
    spec = spec_from("llama2-7b")
    out = {}
    for qset in ("all-linear", "targets"):
        e = estimate(Recipe.of("llama2-7b", 4, 512, dtype="bf16", device="cuda", lora_rank=16,
                               lora_targets="q_proj,v_proj", quant="nf4", quant_set=qset))
        t = {x.key: x.bytes for x in e.terms}
        out[qset] = (t[K.QUANTIZED_BASE], t[K.FROZEN_BASE], e.peak.total)
        print(f"{qset:10s}: NF4 {t[K.QUANTIZED_BASE] / GiB:.2f} GiB, 16-bit {t[K.FROZEN_BASE] / MiB:.1f} MiB, "
              f"peak {e.peak.total / GiB:.2f} GiB  ({e.label})")
    h, V, L = spec.hidden, spec.vocab, spec.n_layer
    # all-linear: only the embedding, the (untied) head and the norms (2 per layer + the final one) stay 16-bit
    assert out["all-linear"][1] == 2 * (2 * V * h + (2 * L + 1) * h)
    linears = peft_terms.resolve_targets(spec, "all-linear")
    assert out["all-linear"][0] == sum(peft_terms.nf4_bytes(i * o) for _, i, o, _ in linears)
    # targets: q and v in NF4, everything else 16-bit
    qv = [lin for lin in linears if lin[0].endswith(("q_proj", "v_proj"))]
    assert out["targets"][0] == sum(peft_terms.nf4_bytes(i * o) for _, i, o, _ in qv)
    assert out["targets"][1] == 2 * (spec.n_params - sum(i * o for _, i, o, _ in qv))
    assert out["all-linear"][2] < 13.5 * GiB < 20 * GiB < out["targets"][2]


def test_the_label_names_the_convention():
    kw = dict(lora_rank=8, lora_targets="q_proj,v_proj", quant="nf4")
    assert "transformers + bitsandbytes" in estimate("llama-tiny", 1, 16, **kw).label
    assert "torchtune" in estimate("llama-tiny", 1, 16, quant_set="targets", **kw).label
    assert "bitsandbytes" not in estimate("llama-tiny", 1, 16, lora_rank=8).label


@pytest.mark.parametrize("kw, match", [
    (dict(quant_set="targets"), "give quant too"),
    (dict(lora_rank=8, quant="nf4", quant_set="heads"), "quant_set must be one of all-linear, targets"),
])
def test_bad_quant_sets_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        Recipe.of("llama-tiny", 1, 16, **kw)


def test_the_cli_takes_quant_set(capsys):
    base = ["estimate", "--model", "llama-tiny", "--batch", "2", "--seq", "32", "--lora-rank", "8",
            "--lora-targets", "q_proj,v_proj", "--quant", "nf4"]
    assert main(base + ["--quant-set", "targets", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    e = estimate("llama-tiny", 2, 32, "mixed-bf16", lora_rank=8, lora_targets="q_proj,v_proj", quant="nf4",
                 quant_set="targets")
    assert d["peak"] == e.peak.total and d["options"]["quant_set"] == "targets"
    assert main(base) == 0
    assert "transformers + bitsandbytes" in capsys.readouterr().out
    assert main(base[:-2] + ["--quant-set", "targets"]) == 2
    assert "--quant-set targets chooses which Linears --quant stores" in capsys.readouterr().err


def test_wall_takes_targets_and_quant_set(capsys):
    """wall's qlora rows over llama2-7b with r=16 on q_proj,v_proj: the issue's two figures."""
    base = ["wall", "--models", "llama2-7b", "--methods", "qlora", "--batch", "4", "--seq", "512",
            "--lora-rank", "16", "--checkpoint", "none", "--micro-batch", "4", "--lora-targets",
            "q_proj,v_proj", "--json"]
    peaks = {}
    for qset in ("all-linear", "targets"):
        assert main(base + ["--quant-set", qset]) == 0
        peaks[qset] = json.loads(capsys.readouterr().out)["rows"][0]["peak"]
        r = Recipe.of("llama2-7b", 4, 512, dtype="bf16", device="cuda", lora_rank=16,
                      lora_targets="q_proj,v_proj", quant="nf4", quant_set=qset)
        assert peaks[qset] == estimate(r).peak.total
    assert peaks["all-linear"] < peaks["targets"]
    assert main(base[:4] + ["lora", "--quant-set", "targets"]) == 2
    assert "add qlora to --methods" in capsys.readouterr().err
