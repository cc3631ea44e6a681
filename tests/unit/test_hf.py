"""labkit.models.hf: offline presets with exact parameter counts, meta builds, and real tiny models."""

import math

import pytest
import torch

from labkit.models import hf

COUNTS = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama3.2-1b": 1_235_814_400,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama-65b": 65_285_660_672,
    # models the training configs name (hf.CONFIG_PRESETS), counts from their model cards' weights
    "llama3-8b": 8_030_261_248,
    "llama3.1-8b": 8_030_261_248,
    "llama3.2-3b": 3_212_749_824,
    "llama3.1-70b": 70_553_706_496,
    "llama3.1-405b": 405_853_388_800,
    "code-llama2-7b": 6_738_546_688,
    "mistral-7b": 7_241_732_096,
}


def formula(d: dict) -> int:
    """Parameters from the architecture facts alone (an independent check on build and describe)."""
    h, L, V, f = d["hidden"], d["n_layer"], d["vocab"], d["intermediate"]
    if d["family"] == "gpt2":
        block = 2 * 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)  # 2 LN, qkv, proj, MLP
        return V * h + d["max_positions"] * h + L * block + 2 * h + (0 if d["tied"] else V * h)
    kv = d["n_kv_head"] * (h // d["n_head"])  # K and V width under grouped-query attention
    block = 2 * h + h * h + 2 * h * kv + h * h + 3 * h * f  # 2 RMSNorm, q, k+v, o, SwiGLU
    return V * h + L * block + h + (0 if d["tied"] else V * h)


@pytest.mark.parametrize("name", list(COUNTS))
def test_preset_exact_counts(name):
    assert hf.count_params(name) == COUNTS[name]
    assert formula(hf.describe(name)) == COUNTS[name]


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tiny_counts_match_formula(name):
    n = hf.count_params(name)
    assert n == formula(hf.describe(name))
    assert 50_000 < n < 500_000


def test_llama32_1b_config():
    c = hf.get_config("llama3.2-1b")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (128256, 2048, 16)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (32, 8, 8192)
    assert c.rope_parameters["rope_theta"] == 500000.0
    assert c.tie_word_embeddings is True


def test_llama2_70b_uses_gqa():
    c = hf.get_config("llama2-70b")
    assert (c.num_key_value_heads, c.intermediate_size, c.num_attention_heads) == (8, 28672, 64)


def test_presets_are_fresh_objects():
    c = hf.get_config("gpt2", n_layer=2)
    assert c.n_layer == 2 and hf.get_config("gpt2").n_layer == 12


def test_meta_build_of_70b_costs_no_memory():
    model = hf.build("llama2-70b")
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert model.training and model.config.use_cache is False
    assert model.config._attn_implementation == "sdpa"


def test_describe_gpt2():
    assert hf.describe("gpt2") == {
        "family": "gpt2", "n_layer": 12, "hidden": 768, "n_head": 12, "n_kv_head": 12,
        "intermediate": 3072, "vocab": 50257, "max_positions": 1024, "tied": True,
        "embd_pdrop": 0.1, "attn_pdrop": 0.1, "resid_pdrop": 0.1, "n_params": 124_439_808,
    }  # fmt: skip


def test_describe_llama2_7b():
    assert hf.describe("llama2-7b") == {
        "family": "llama", "n_layer": 32, "hidden": 4096, "n_head": 32, "n_kv_head": 32,
        "intermediate": 11008, "vocab": 32000, "max_positions": 4096, "tied": False,
        "attention_dropout": 0.0, "n_params": 6_738_415_616,
    }  # fmt: skip


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tiny_forward_backward_on_cpu(name):
    torch.manual_seed(0)
    model = hf.build(name, device="cpu")
    assert model.training and all(p.device.type == "cpu" for p in model.parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 16, model.config.vocab_size)
    assert abs(out.loss.item() - math.log(256)) < 0.5  # random init: close to uniform over 256 tokens
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_tied_embedding_is_one_tensor():
    gpt2 = hf.build("gpt2-tiny", device="cpu")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    llama = hf.build("llama-tiny", device="cpu")
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight


def test_build_dtype_and_attention():
    model = hf.build("gpt2-tiny", device="cpu", dtype=torch.bfloat16, attn_implementation="eager")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config._attn_implementation == "eager"


def test_overrides():
    assert hf.count_params("gpt2", n_layer=2) == formula({**hf.describe("gpt2"), "n_layer": 2})
    assert hf.get_config("gpt2-tiny", attn_implementation="eager")._attn_implementation == "eager"
    assert hf.describe("llama-tiny", num_hidden_layers=3)["n_layer"] == 3
    with pytest.raises(ValueError, match="no attribute 'n_layers'"):
        hf.get_config("gpt2", n_layers=2)


def test_local_config_dir_and_json(tmp_path):
    hf.get_config("llama-tiny").save_pretrained(tmp_path)
    for path in (tmp_path, tmp_path / "config.json"):
        c = hf.get_config(str(path))
        assert (c.model_type, c.num_key_value_heads) == ("llama", 2)
        assert hf.count_params(str(path)) == hf.count_params("llama-tiny")


def test_unknown_name_offline_is_one_clear_line(monkeypatch):
    calls = []

    def offline(name, **kw):  # what transformers does with no network and no cache
        calls.append(kw.get("local_files_only"))
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(hf.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ValueError) as err:
        hf.get_config("gpt3-ultra")
    msg = str(err.value)
    assert "\n" not in msg and "unknown model 'gpt3-ultra'" in msg and "online" in msg
    assert all(name in msg for name in hf.PRESETS)
    assert calls == [True]  # a name without "org/" is not worth the hub client's retries
    calls.clear()
    with pytest.raises(ValueError, match="unknown model"):
        hf.get_config("someorg/gpt3-ultra")
    assert calls == [True, False]  # the local cache is tried before the network
    with pytest.raises(ValueError, match="unknown model"):
        hf.build("gpt3-ultra")
