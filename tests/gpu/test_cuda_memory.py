"""On a real GPU: the ledger's logical bytes equal the CPU's, and the estimate matches the allocator."""

import pytest
import torch

from labkit.memory import run_within_budget
from labkit.estimate import Recipe, estimate
from labkit.run import measure_step
from labkit.models.gpt import GPTConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# manual attention, no dropout, fp32: the same kernels' saved tensors on both devices
SAME = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256, attention="manual")


def test_logical_bytes_equal_on_cpu_and_cuda():
    cpu = measure_step(Recipe(SAME, 4, 256, "fp32", "adamw", device="cpu", foreach=False))
    gpu = measure_step(Recipe(SAME, 4, 256, "fp32", "adamw", device="cuda", foreach=False))
    for phase in ("forward", "optimizer"):
        assert gpu.phases[phase].total == cpu.phases[phase].total
    assert abs(gpu.peak.total - cpu.peak.total) <= 0.01 * cpu.peak.total


def _positions(model) -> dict:
    """llama-tiny has 128 positions: these cases run 512 tokens, so its table is made long enough."""
    return {"max_position_embeddings": 512} if model == "llama-tiny" else {}


@pytest.mark.parametrize("dtype", ["fp32", "mixed-bf16", "bf16"])
@pytest.mark.parametrize("model", [GPTConfig(n_layer=6, n_head=8, n_embd=512, block_size=1024), "gpt2", "llama-tiny"])
def test_estimate_within_5_percent_of_max_memory_allocated(model, dtype):
    torch.cuda.empty_cache()
    ov = _positions(model)
    e = estimate(model, 8, 512, dtype, "adamw", device="cuda", **ov)
    m = measure_step(Recipe.of(model, 8, 512, dtype=dtype, optimizer="adamw", device="cuda", **ov))
    allocated = m.allocator["max_allocated"]
    assert abs(e.peak.total - allocated) <= 0.05 * allocated, (e.peak.total, allocated, m.peak.total)
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total


def test_real_budget_out_of_memory_is_a_result():
    free, _ = torch.cuda.mem_get_info()
    big = Recipe("gpt2", 32, 1024, "fp32", "adamw", device="cuda")
    r = run_within_budget(lambda: measure_step(big, budget=2 * 2**30), 2 * 2**30)
    assert not r.fits and "does not fit" in r.message
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] >= free - 64 * 2**20  # memory came back


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("options", [dict(lora_rank=16), dict(lora_rank=16, quant="nf4"), dict(lora_rank=16, quant="int8"),
                                     dict(lisa_layers=2)], ids=["lora", "qlora-nf4", "lora-int8", "lisa"])
@pytest.mark.parametrize("model", [GPTConfig(n_layer=6, n_head=8, n_embd=512, block_size=1024), "gpt2", "llama-tiny"])
def test_peft_estimate_within_5_percent_of_max_memory_allocated(model, dtype, options):
    torch.cuda.empty_cache()
    ov = _positions(model)
    e = estimate(model, 8, 512, dtype, "adamw", device="cuda", **options, **ov)
    m = measure_step(Recipe.of(model, 8, 512, dtype=dtype, optimizer="adamw", device="cuda", **options, **ov))
    allocated = m.allocator["max_allocated"]
    assert abs(e.peak.total - allocated) <= 0.05 * allocated, (e.peak.total, allocated, m.peak.total)
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total


@pytest.mark.parametrize("options", [dict(checkpoint="full"), dict(checkpoint="selective"), dict(checkpoint="sqrt"),
                                     dict(offload_activations=True), dict(checkpoint="full", lora_rank=16, quant="nf4")],
                         ids=["full", "selective", "sqrt", "offload", "qlora-full"])
@pytest.mark.parametrize("model", ["gpt2", "llama-tiny"])
def test_checkpoint_and_offload_estimate_on_cuda(model, options):
    """The blocks' replayed ops (labkit.estimate.tape) on CUDA's kernels: flash attention, bool dropout masks."""
    torch.cuda.empty_cache()
    e = estimate(model, 8, 128, "mixed-bf16", "adamw", device="cuda", **options)  # llama-tiny: 128 positions
    m = measure_step(Recipe.of(model, 8, 128, dtype="mixed-bf16", optimizer="adamw", device="cuda", **options))
    assert abs(e.peak.total - m.peak.total) <= 0.03 * m.peak.total, (e.peak.total, m.peak.total)
