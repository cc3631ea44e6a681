"""labkit.peft.lora against peft's LoRA, and its bytes against the Ledger."""

import copy
import math

import pytest
import torch
import torch.nn as nn
from peft import LoraConfig, get_peft_model

from labkit.memory import Category, Ledger
from labkit.models.gpt import GPT, GPTConfig
from labkit.peft import (LoRALinear, LoRALinearNaive, adapter_numel, apply_lora, count_parameters, find_targets,
                         lora_scaling, lora_state_dict, merge_lora, trainable_parameters)

C, T = 32, 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _gpt(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=C, block_size=T, dropout=dropout))


def _xy(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, T), generator=g), torch.randint(0, 256, (2, T), generator=g)


def _pair(targets, r=4, alpha=16, rslora=False, dropout=0.0):
    """peft's model and ours on the same weights, with peft's A and a random (non-zero) B copied into ours."""
    m = _gpt()
    ref = get_peft_model(copy.deepcopy(m), LoraConfig(target_modules=targets, r=r, lora_alpha=alpha,
                                                      use_rslora=rslora, lora_dropout=dropout))
    mine = apply_lora(copy.deepcopy(m), targets, r=r, alpha=alpha, rslora=rslora, dropout=dropout)
    theirs = dict(ref.named_modules())
    pairs = [(theirs["base_model.model." + n], mod) for n, mod in mine.named_modules() if isinstance(mod, LoRALinear)]
    torch.manual_seed(2)
    with torch.no_grad():
        for p, q in pairs:
            p.lora_B["default"].weight.normal_()
            q.lora_A.copy_(p.lora_A["default"].weight)
            q.lora_B.copy_(p.lora_B["default"].weight)
    return ref, mine, pairs


@pytest.mark.parametrize("rslora", [False, True])
@pytest.mark.parity
def test_outputs_and_gradients_match_peft(rslora):
    ref, mine, pairs = _pair(["c_attn", "c_fc"], rslora=rslora)
    assert len(pairs) == 4
    x, y = _xy()
    a, b = ref(x, y), mine(x, y)
    assert (a - b).abs().item() <= 1e-6
    a.backward()
    b.backward()
    for p, q in pairs:
        assert q.scaling == p.scaling["default"] == (16 / math.sqrt(4) if rslora else 16 / 4)
        assert torch.allclose(p.lora_A["default"].weight.grad, q.lora_A.grad, atol=1e-6, rtol=0)
        assert torch.allclose(p.lora_B["default"].weight.grad, q.lora_B.grad, atol=1e-6, rtol=0)
    assert count_parameters(mine) == (sum(p.numel() for p in ref.parameters() if p.requires_grad),
                                      sum(p.numel() for p in ref.parameters()))


@pytest.mark.parity
def test_dropout_matches_peft_with_the_same_seed():
    ref, mine, pairs = _pair(["c_fc"], dropout=0.3)
    x, y = _xy()
    torch.manual_seed(5)
    a = ref(x, y)
    torch.manual_seed(5)
    b = mine(x, y)
    assert (a - b).abs().item() <= 1e-6
    torch.manual_seed(6)
    assert (mine(x, y) - b).abs().item() > 0  # dropout is really on


def test_init_is_peft_default_and_starts_at_the_base_output():
    m = _gpt()
    x, _ = _xy()
    before = m(x)
    apply_lora(m, ["c_attn"], r=8)
    lora = m.blocks[0].attn.c_attn
    assert torch.equal(lora.lora_B, torch.zeros_like(lora.lora_B))
    assert lora.lora_A.abs().max() <= 1 / math.sqrt(C) and lora.lora_A.std() > 0.2 / math.sqrt(C)  # kaiming a=sqrt(5)
    assert torch.equal(m(x), before)
    assert lora_scaling(8, 8) == 1.0 and lora_scaling(16, 8, rslora=True) == 2.0


def test_apply_lora_freezes_the_rest_and_counts():
    m = apply_lora(_gpt(), "all-linear", r=2)
    names = [n for n, p in m.named_parameters() if p.requires_grad]
    assert names and all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in names)
    assert "lm_head" not in find_targets(_gpt(), "all-linear")
    per_block = 2 * ((C + 3 * C) + (C + C) + (C + 4 * C) + (4 * C + C))  # r (d_in + d_out) for each of 4 Linears
    assert count_parameters(m).trainable == 2 * per_block
    assert set(lora_state_dict(m)) == set(names)
    m2 = apply_lora(_gpt(), ["c_fc"], train_also=["ln_f"])
    assert m2.ln_f.weight.requires_grad and not m2.wte.weight.requires_grad
    assert len(trainable_parameters(m2)) == 2 * 2 + 2


def test_merge_and_unmerge():
    m = _gpt()
    apply_lora(m, ["c_attn", "mlp.c_proj"], r=4, alpha=8)
    with torch.no_grad():
        for p in trainable_parameters(m):
            p.normal_(0, 0.1)
    w0 = m.blocks[0].attn.c_attn.base.weight.clone()
    x, _ = _xy()
    y = m(x)
    merge_lora(m)
    assert m.blocks[0].attn.c_attn.merged and torch.allclose(m(x), y, atol=1e-5)
    merge_lora(m, merge=False)
    assert torch.allclose(m.blocks[0].attn.c_attn.base.weight, w0, atol=1e-6)
    assert torch.allclose(m(x), y, atol=1e-6)


def test_naive_version_same_result_but_keeps_a_full_weight():
    torch.manual_seed(0)
    base = nn.Linear(64, 128)
    naive = LoRALinearNaive(copy.deepcopy(base), r=4, alpha=8)
    real = LoRALinear(copy.deepcopy(base), r=4, alpha=8)
    with torch.no_grad():
        naive.lora_B.normal_()
        real.lora_A.copy_(naive.lora_A)
        real.lora_B.copy_(naive.lora_B)
    x = torch.randn(8, 64, requires_grad=True)
    assert torch.allclose(naive(x), real(x), atol=1e-5)
    acts = {}
    for name, mod in (("naive", naive), ("real", real)):
        with Ledger(mod) as led:
            mod(x).sum().backward()
        acts[name] = max(b[Category.ACT] for b in led.measurement().phases.values())
    assert acts["naive"] >= 128 * 64 * 4  # the merged (d_out, d_in) fp32 weight, kept for backward
    assert acts["real"] <= 8 * 4 * 4 + 8  # only the (N, r) intermediate (and the scalar loss)


def test_bytes_per_parameter_of_an_adapted_linear():
    """fp32 + AdamW: 4 per frozen base weight, 4 + 4 + 8 per adapter parameter (+ 4 per step counter)."""
    torch.manual_seed(0)
    d_in, d_out, r = 256, 512, 8
    m = apply_lora(nn.Sequential(nn.Linear(d_in, d_out, bias=False)), ["0"], r=r)
    opt = torch.optim.AdamW(trainable_parameters(m), lr=1e-3)
    x = torch.randn(4, d_in)
    with Ledger(m, opt) as led:
        for _ in range(2):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        live = led.live()
    n_adapter = adapter_numel(d_in, d_out, r)
    assert n_adapter == r * (d_in + d_out) == m[0].lora_A.numel() + m[0].lora_B.numel()
    assert live[Category.PARAM] == 4 * d_in * d_out + 4 * n_adapter
    assert live[Category.GRAD] == 4 * n_adapter
    assert live[Category.OPT] == 8 * n_adapter + 2 * 4


def test_bad_input_says_what_to_do():
    for r in (0, -3, 2.5):
        with pytest.raises(ValueError, match="positive integer"):
            apply_lora(_gpt(), ["c_attn"], r=r)
    with pytest.raises(ValueError, match="c_attn") as e:
        apply_lora(_gpt(), ["q_proj"])
    assert "\n" not in str(e.value) and "q_proj" in str(e.value) and "blocks.0.mlp.c_fc" in str(e.value)
    with pytest.raises(ValueError, match="positive"):
        apply_lora(_gpt(), ["c_attn"], alpha=0)
    with pytest.raises(ValueError, match="train_also"):
        apply_lora(_gpt(), ["c_attn"], train_also=["classifier"])
    with pytest.raises(ValueError, match="dropout"):
        LoRALinear(nn.Linear(4, 4), dropout=1.0)
    for bad in ((0, 4, 2), (4, 4, 2.5), (4, True, 2)):
        with pytest.raises(ValueError, match="positive integer"):
            adapter_numel(*bad)


@pytest.mark.parity
def test_gpt2_conv1d_layers_are_adapted_and_match_peft():
    """GPT-2 (transformers) uses Conv1D, not nn.Linear: all-linear must find them (it once found none and
    froze the whole model), and the result must equal peft's, which adapts Conv1D with fan_in_fan_out."""
    from labkit.run import build_model

    torch.manual_seed(0)
    m = build_model("gpt2-tiny").eval()  # no dropout: outputs comparable
    n_layer = m.config.n_layer
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, m.config.vocab_size, (2, 16), generator=g)
    base_out = m(ids).logits
    ref = get_peft_model(copy.deepcopy(m), LoraConfig(target_modules=["c_attn", "c_proj", "c_fc"], r=4, lora_alpha=8,
                                                      fan_in_fan_out=True))
    mine = apply_lora(copy.deepcopy(m), "all-linear", r=4, alpha=8)
    adapted = [n for n, mod in mine.named_modules() if isinstance(mod, LoRALinear)]
    assert len(adapted) == 4 * n_layer  # attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj in every block
    assert torch.allclose(mine(ids).logits, base_out, atol=1e-5)  # B = 0: the pretrained model's output
    theirs = dict(ref.named_modules())
    torch.manual_seed(2)
    with torch.no_grad():
        for n in adapted:
            p, q = theirs["base_model.model." + n], mine.get_submodule(n)
            p.lora_B["default"].weight.normal_()
            q.lora_A.copy_(p.lora_A["default"].weight)
            q.lora_B.copy_(p.lora_B["default"].weight)
    a, b = ref(ids).logits, mine(ids).logits
    assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()
    a.square().mean().backward()
    b.square().mean().backward()
    for n in adapted:
        p, q = theirs["base_model.model." + n], mine.get_submodule(n)
        assert torch.allclose(p.lora_B["default"].weight.grad, q.lora_B.grad, atol=1e-5, rtol=1e-4)
    assert count_parameters(mine).trainable == sum(p.numel() for p in ref.parameters() if p.requires_grad)
