"""labkit.peft.qlora against bitsandbytes' Linear4bit and peft; labkit.peft.lisa's memory against the Ledger."""

import copy

import bitsandbytes as bnb
import pytest
import torch
import torch.nn as nn

from labkit.memory import Category, Ledger
from labkit.models.gpt import GPT, GPTConfig
from labkit.peft import (LISA, LISANaive, LoRAConfig, LoRALinear, NF4Base, NF4Config, apply_qlora, base_bytes,
                         find_layers, lisa_memory_trace, qlora_optimizer, to_nf4, trainable_parameters)
from labkit.quant.nf4 import NF4Linear, dequantize_nf4, nbytes_nf4, quantize_nf4

C, T = 32, 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _bnb_nf4(lin: nn.Linear, compute_dtype, double_quant=True):
    q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None, compute_dtype=compute_dtype,
                          compress_statistics=double_quant, quant_type="nf4")
    q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                 compress_statistics=double_quant)
    if lin.bias is not None:
        q.bias = nn.Parameter(lin.bias.data.clone(), requires_grad=False)
    return q.to("cpu")  # quantizes


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(128, 64), nn.Linear(64, 128)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parity
def test_frozen_base_matches_bitsandbytes_linear4bit(dtype, double_quant):
    torch.manual_seed(0)
    lin = nn.Linear(128, 64)
    ref, mine = _bnb_nf4(lin, dtype, double_quant), to_nf4(lin, NF4Config(dtype, double_quant))
    assert torch.equal(ref.weight.data.view(-1), mine.weight_packed.view(-1))  # the same 4-bit codes
    x = torch.randn(4, 7, 128)
    assert torch.equal(ref(x), mine(x))  # measured difference: exactly 0 (tolerance 0)


@pytest.mark.parity
@pytest.mark.parametrize("shape", [(48, 64), (96, 128), (64, 192)])
def test_reference_linear4bit_computes_in_its_dtype_in_eval_too(shape):
    """labkit.peft.reference.bnb_linear4bit in eval mode under no_grad: on an AVX512-BF16 CPU bitsandbytes
    would repack the weight for its bf16 inference kernel (which fails for 48 outputs: it needs
    out_features % 32 == 0); with that shortcut off it computes exactly what it computes in training
    mode (dequantize, fp32 matmul), on every CPU."""
    from labkit.peft.reference import bnb_linear4bit

    torch.manual_seed(0)
    d_out, d_in = shape
    ref = bnb_linear4bit(nn.Linear(d_in, d_out), torch.float32)
    x = torch.randn(4, 7, d_in)
    with torch.no_grad():
        y_train = ref.train()(x)
        y_eval = ref.eval()(x)
    assert not getattr(ref.weight.quant_state, "packing_format_for_cpu", False)  # not repacked
    assert y_eval.dtype == torch.float32 and torch.equal(y_eval, y_train)


@pytest.mark.parity
def test_reference_linear4bit_refuses_what_bitsandbytes_cpu_dequantizes_wrongly():
    """bitsandbytes' CPU dequantize_4bit before 0.50.2 took a value's block from its row and column, right
    only when in_features is a multiple of 64: a 32-input layer came back with block 0's scale in every row.
    The reference refuses such a layer exactly where the installed version is wrong, and builds it where not."""
    from labkit.peft.reference import bnb_linear4bit, cpu_dequantize_is_right

    torch.manual_seed(0)
    w = torch.randn(32, 32) * 0.1
    codes, state = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    mine, mine_state = quantize_nf4(w, 64, double_quant=False)
    assert torch.equal(codes.view(-1), mine.view(-1))  # the same codes and absmax ...
    assert torch.equal(state.absmax, mine_state.absmax)
    right = torch.allclose(bnb.functional.dequantize_4bit(codes, state), dequantize_nf4(mine, mine_state))
    assert cpu_dequantize_is_right() == right  # ... and the probe sees what this direct check sees
    lin = nn.Linear(32, 64)
    if right:  # the layer is built, and computes what the fp32 layer with NF4 weights computes
        q = bnb_linear4bit(lin, torch.float32)
        x = torch.randn(3, 32)
        ref = x @ bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).T + lin.bias
        assert torch.allclose(q(x), ref, atol=1e-5)
    else:
        with pytest.raises(ValueError, match="in_features divisible by 64") as e:
            bnb_linear4bit(lin, torch.float32)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parity
def test_qlora_matches_peft_on_bitsandbytes(dtype):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    m = TwoLinears()
    ref = copy.deepcopy(m)
    ref.a, ref.b = _bnb_nf4(m.a, dtype), _bnb_nf4(m.b, dtype)
    ref = get_peft_model(ref, LoraConfig(target_modules=["a", "b"], r=4, lora_alpha=8))
    mine = apply_qlora(copy.deepcopy(m), LoRAConfig(["a", "b"], r=4, alpha=8), NF4Config(dtype))
    theirs = dict(ref.named_modules())
    pairs = [(theirs["base_model.model." + n], q) for n, q in mine.named_modules() if isinstance(q, LoRALinear)]
    with torch.no_grad():
        for p, q in pairs:
            p.lora_B["default"].weight.normal_()
            q.lora_A.copy_(p.lora_A["default"].weight)
            q.lora_B.copy_(p.lora_B["default"].weight)
    x = torch.randn(8, 128, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y1, y2 = ref(x), mine(x2)
    assert torch.allclose(y1, y2, atol=1e-6, rtol=0)
    y1.square().sum().backward()
    y2.square().sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-6, rtol=0)
    for p, q in pairs:
        assert isinstance(q.base, NF4Base)
        assert torch.allclose(p.lora_A["default"].weight.grad, q.lora_A.grad, atol=1e-6, rtol=1e-6)
        assert torch.allclose(p.lora_B["default"].weight.grad, q.lora_B.grad, atol=1e-6, rtol=1e-6)


def _acts(model, x):
    with Ledger(model) as led:
        model(x).sum().backward()
    return max(b[Category.ACT] for b in led.measurement().phases.values())


def test_real_base_keeps_no_dequantized_weight_for_backward():
    torch.manual_seed(0)
    lin = nn.Linear(256, 512, bias=False)
    x = torch.randn(4, 256, requires_grad=True)
    teaching, real = to_nf4(lin, NF4Config(torch.float32, keep_dequantized=True)), to_nf4(lin, NF4Config(torch.float32))
    assert NF4Base is NF4Linear and teaching.keep_dequantized and not real.keep_dequantized  # one implementation
    assert _acts(teaching, x) >= 512 * 256 * 4  # the (d_out, d_in) fp32 weight, saved by F.linear
    assert _acts(real, x) < 512 * 256 * 4 // 64
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    teaching(x1).square().sum().backward()
    real(x2).square().sum().backward()
    assert torch.equal(x1.grad, x2.grad)


def test_qlora_bytes_per_parameter():
    """Measured: packed codes 0.5 byte + uint8 absmax 1/64 + fp32 second-level scale and offset per weight;
    adapters 4 + grad 4 + AdamW 8 bytes each."""
    d_in, d_out, r = 256, 512, 8
    m = apply_qlora(nn.Sequential(nn.Linear(d_in, d_out, bias=False)), LoRAConfig(["0"], r=r), NF4Config(torch.float32))
    opt = torch.optim.AdamW(trainable_parameters(m), lr=1e-3)
    with Ledger(m, opt) as led:
        for _ in range(2):
            m(torch.randn(4, d_in)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        live = led.live()
    n, n_adapter = d_in * d_out, r * (d_in + d_out)
    blocks = n // 64
    nf4 = n // 2 + blocks + 4 * -(-blocks // 256) + 4
    assert nf4 == nbytes_nf4(m[0].base.weight_packed, m[0].base.state)
    assert live[Category.BUFFER] == nf4 and abs(nf4 / n - 0.5159) < 1e-3
    assert base_bytes(m) == {"nf4": nf4, "adapters": 4 * n_adapter, "other": 0}
    assert live[Category.PARAM] == 4 * n_adapter
    assert live[Category.GRAD] == 4 * n_adapter
    assert live[Category.OPT] == 8 * n_adapter + 2 * 4


def _gpt(n_layer=4, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=C, block_size=T))


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (2, T), generator=g), torch.randint(0, 256, (2, T), generator=g)) for _ in range(n)]


def test_qlora_with_checkpointing_and_8bit_adam():
    x, y = _batches(1)[0]
    plain = apply_qlora(_gpt(2), LoRAConfig(r=4), NF4Config(torch.float32))
    ckpt = apply_qlora(_gpt(2), LoRAConfig(r=4), NF4Config(torch.float32), checkpoint="full")
    ckpt.load_state_dict(plain.state_dict())
    plain(x, y).backward()
    ckpt(x, y).backward()
    for p, q in zip(trainable_parameters(plain), trainable_parameters(ckpt)):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    ckpt.qlora_checkpoint.remove()
    with pytest.raises(TypeError, match="dequantize"):
        ckpt.blocks[0].mlp.c_fc.merge()
    with pytest.raises(ValueError, match="matches no Linear"):
        apply_qlora(ckpt, LoRAConfig(["c_fc"]))  # already adapted: its base is not offered again
    opt = qlora_optimizer(plain, "adamw8bit", lr=1e-2)
    before = [p.detach().clone() for p in trainable_parameters(plain)]
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable_parameters(plain)))
    with pytest.raises(ValueError, match="adamw"):
        qlora_optimizer(plain, "sgd")



@pytest.mark.parametrize("make,field", [
    (lambda: NF4Config(torch.int8), "compute_dtype"), (lambda: NF4Config(blocksize=0), "blocksize"),
    (lambda: LoRAConfig(r=0), "rank r"), (lambda: LoRAConfig(alpha=0), "alpha"),
    (lambda: LoRAConfig(dropout=1.0), "dropout"),
])
def test_qlora_configs_refuse_bad_values_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_qlora_configs_build_what_the_layers_build():
    """apply_qlora(model, LoRAConfig, NF4Config) is to_nf4 + LoRALinear on each target, with the configs' values."""
    torch.manual_seed(0)
    m = TwoLinears()
    lora, quant = LoRAConfig(["a"], r=4, alpha=16, rslora=True, train_also=["b"]), NF4Config(torch.float32, False, 128)
    assert lora.targets == ("a",) and lora.train_also == ("b",)  # lists kept as tuples
    mine = apply_qlora(copy.deepcopy(m), lora, quant)
    by_hand = LoRALinear(to_nf4(m.a, quant), r=4, alpha=16, rslora=True)
    assert mine.a.scaling == by_hand.scaling == 16 / 2 and mine.a.base.blocksize == 128
    assert mine.a.base.weight_absmax_scale is None  # no double quantization
    assert torch.equal(mine.a.base.weight_packed, by_hand.base.weight_packed)
    assert all(p.requires_grad for p in mine.b.parameters()) and not mine.a.base.weight_packed.requires_grad


def test_lisa_memory_bounded_while_naive_grows():
    steps = 16
    real = lisa_memory_trace(_gpt(6), _batches(steps), gamma=1, interval=2, naive=False)
    naive = lisa_memory_trace(_gpt(6), _batches(steps), gamma=1, interval=2, naive=True)
    bound = real["bound"]
    assert real["switches"] == naive["switches"] == steps // 2
    for row in real["steps"]:
        assert row["OPT"] <= bound["OPT"] and row["GRAD"] <= bound["GRAD"]
    assert real["peak"]["OPT"] <= bound["OPT"] and real["peak"]["GRAD"] <= bound["GRAD"]
    # the same sampled layers, so the naive variant keeps the state of every layer it has visited
    visited = len({i for row in naive["steps"] for i in row["active"]})
    assert visited >= 3
    assert naive["steps"][-1]["OPT"] > 1.5 * bound["OPT"] and naive["steps"][-1]["GRAD"] > 1.5 * bound["GRAD"]
    assert naive["steps"][0]["OPT"] == real["steps"][0]["OPT"]


def test_lisa_trains_only_active_layers_and_always_the_embeddings():
    m = _gpt(4)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    lisa = LISA(m, opt, gamma=2, interval=3, seed=1)
    before = copy.deepcopy(m.state_dict())
    active = lisa.step()
    x, y = _batches(1)[0]
    m(x, y).backward()
    opt.step()
    for i, block in enumerate(m.blocks):
        changed = not torch.equal(block.attn.c_attn.weight, before[f"blocks.{i}.attn.c_attn.weight"])
        assert changed == (i in active)
    assert not torch.equal(m.wte.weight, before["wte.weight"]) and not torch.equal(m.ln_f.weight, before["ln_f.weight"])
    frozen_again = set(active)
    for _ in range(3):
        active = lisa.step()
    for i in frozen_again - set(active):
        assert all(p.grad is None and p not in opt.state for p in m.blocks[i].parameters())
    assert lisa.switches == 2 and find_layers(m)[0] == "blocks"


def test_lisa_bad_input_says_what_to_do():
    m = _gpt(4)
    opt = torch.optim.AdamW(m.parameters())
    for gamma in (0, 5, 1.5, True):
        with pytest.raises(ValueError, match="gamma") as e:
            LISA(m, opt, gamma=gamma)
        assert "\n" not in str(e.value)
    for k in (0, -1, 2.0):
        with pytest.raises(ValueError, match="interval"):
            LISANaive(m, opt, gamma=1, interval=k)
    with pytest.raises(ValueError, match="model.parameters"):
        LISA(m, torch.optim.AdamW(m.blocks[0].parameters()), gamma=1)
    with pytest.raises(ValueError, match="layers_path"):
        LISA(nn.Sequential(nn.Linear(2, 2)), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1), gamma=1)


def test_find_layers_in_transformers_models_and_wrappers():
    from transformers import GPT2Config, GPT2LMHeadModel

    hf = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=256, n_positions=32))
    assert find_layers(hf)[0] == "transformer.h" and len(find_layers(hf)[1]) == 3
    wrapper = nn.Module()
    wrapper.inner = hf
    assert find_layers(wrapper)[0] == "inner.transformer.h"
    lisa = LISA(hf, torch.optim.AdamW(hf.parameters()), gamma=1, interval=1)
    lisa.step()
    assert sum(any(p.requires_grad for p in b.parameters()) for b in hf.transformer.h) == 1
    assert hf.transformer.wte.weight.requires_grad and hf.transformer.ln_f.weight.requires_grad
    with pytest.raises(ValueError, match="transformer.h"):
        find_layers(hf, "model.layers")
