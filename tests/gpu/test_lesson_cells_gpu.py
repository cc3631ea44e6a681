"""The lessons' CUDA-only cells, as tests: each runs only where a lesson's `if KIND == "cuda"` branch runs, so a
CPU CI never executes that code. One test per cell that no other test in tests/gpu covers (lesson, cell named in
each docstring); what each asserts is what the cell asserts or prints as its claim. No time is asserted: cells that
time things (offload on a side stream) are tested for their results only."""

import copy

import pytest
import torch

from labkit.models.gpt import GPT, GPTConfig
from labkit.estimate import Recipe
from labkit.run import measure_step

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SMALL = GPTConfig(n_layer=4, n_head=4, n_embd=256, block_size=256)


def _gpt_and_batch(seq: int):
    """SMALL on CUDA from seed 0 and one batch of 4 random token rows (inputs, targets)."""
    torch.manual_seed(0)
    model = GPT(SMALL).cuda()
    x, y = (torch.randint(0, SMALL.vocab_size, (4, seq), device="cuda") for _ in range(2))
    return model, x, y


def test_lesson01_allocator_view():
    """Lesson 01 section 9: max_memory_allocated within 10 % of the ledger's peak, reserved >= allocated, and the
    device's used memory >= reserved (the rest is the CUDA context and other processes)."""
    torch.cuda.empty_cache()
    gpu = measure_step(Recipe(SMALL, 8, 256, "fp32", "adamw", device="cuda"), steps=2)
    alloc = gpu.allocator
    free, total = torch.cuda.mem_get_info()
    assert abs(alloc["max_allocated"] / gpu.peak.total - 1) <= 0.10, (alloc, gpu.peak.total)
    assert alloc["max_reserved"] >= alloc["max_allocated"]
    assert total - free >= torch.cuda.memory_reserved()


def test_lesson01_allocator_recording_is_measured_in_a_fresh_process():
    """Lesson 01's allocator cell on CUDA (and make gpu-check's allocator step): the recording checks out, every
    block is at least its 512-byte rounding, reserved never falls below allocated under churn."""
    from labkit.memory import allocator

    rec = allocator.record_in_fresh_process()
    assert rec["device"]["name"] == torch.cuda.get_device_name(0) and rec["context_bytes"] > 0
    assert all(r["block"] >= allocator.block_bytes(r["request"]) for r in rec["rounding"])
    for run in rec["churn"].values():
        assert all(res >= a for a, res in zip(run["allocated"], run["reserved"]))
    assert rec["churn"]["expandable_segments"]["conf"] == "expandable_segments:True"


def test_lesson03_offload_on_a_side_stream_keeps_the_gradients():
    """Lesson 03's CUDA cell: activations offloaded to pinned host memory on a side stream give the gradients of
    the plain forward + backward (it times the three; only the results are tested)."""
    from labkit.recompute import offload_activations

    model, x, y = _gpt_and_batch(128)

    def grads(hooks):
        m = copy.deepcopy(model)
        if hooks is None:
            m(x, y).backward()
        else:
            with hooks:
                m(x, y).backward()
        torch.cuda.synchronize()
        return [p.grad for p in m.parameters()]

    ref = grads(None)
    off = offload_activations(pin_memory=True, use_stream=True)
    got = grads(off)
    assert off.stats.offloaded > 0
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(ref, got))


def test_lesson04_accumulation_under_a_real_budget():
    """Lesson 04's budget cell on CUDA (a real limit): under a budget between the predicted peaks of half the
    batch and the whole batch, the whole batch fails, two micro-batches of half fit, and so does the whole batch
    with every block checkpointed."""
    from labkit.estimate import estimate
    from labkit.memory import run_within_budget

    b, s, half = 8, 256, 4

    def peak(policy, m):
        return estimate(SMALL, b, s, "fp32", "adamw", device="cuda", checkpoint=policy, micro_batch=m).peak.total

    roomy = (peak("none", half) + peak("none", b)) // 2

    def run(policy, m):
        torch.cuda.empty_cache()  # a real limit bites only when the allocator asks for new memory
        r = Recipe(SMALL, b, s, "fp32", "adamw", device="cuda", checkpoint=policy, micro_batch=m)
        return run_within_budget(lambda: measure_step(r, steps=2, budget=roomy), roomy)

    whole, halves, whole_ckpt = run("none", b), run("none", half), run("full", b)
    assert not whole.fits and halves.fits and whole_ckpt.fits, (whole.message, halves.message, whole_ckpt.message)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "lion", "adafactor"])
def test_lesson05_ledger_and_allocator_agree_per_optimizer(optimizer):
    """Lesson 05's CUDA cell prints the ledger's peak beside max_memory_allocated for each optimizer; lesson 01's
    tolerance (10 %) between the two holds for every one."""
    torch.cuda.empty_cache()
    m = measure_step(Recipe(SMALL, 8, 256, "fp32", optimizer, device="cuda"), steps=2)
    assert abs(m.allocator["max_allocated"] / m.peak.total - 1) <= 0.10, (m.allocator, m.peak.total)


def test_lesson05_offload_adamw_on_cuda_matches_adamw():
    """Lesson 05 section 8 on CUDA: OffloadAdamW (state on the host or on disk) follows torch's AdamW to 1e-6."""
    from labkit.optim import OffloadAdamW

    base, x, y = _gpt_and_batch(64)

    def train(make):
        m = copy.deepcopy(base)
        opt = make(m.parameters())
        for _ in range(3):
            m(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if hasattr(opt, "close"):
            opt.close()
        return [p.detach().clone() for p in m.parameters()]

    ref = train(lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False))
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for kw in (dict(offload="cpu"), dict(offload="disk", folder=folder)):
            got = train(lambda ps: OffloadAdamW(ps, lr=1e-3, **kw))
            assert all(torch.allclose(p, q, rtol=0, atol=1e-6) for p, q in zip(got, ref)), kw


def test_lesson07_bitsandbytes_linear4bit_on_cuda():
    """Lesson 07's CUDA cell: a 4096 x 4096 NF4 Linear4bit holds under 0.3 x its bf16 bytes, output error < 0.15."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    lin = torch.nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    layer = bnb.nn.Linear4bit(4096, 4096, bias=False, quant_type="nf4", compute_dtype=torch.bfloat16)
    layer.load_state_dict(lin.state_dict())
    layer = layer.to("cuda")
    held = torch.cuda.memory_allocated() - before
    x = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    y, y_ref = layer(x), lin.cuda()(x)
    rel = ((y - y_ref).float().norm() / y_ref.float().norm()).item()
    assert held < 0.3 * 4096 * 4096 * 2 and rel < 0.15, (held, rel)


def test_lesson08_bitsandbytes_paging_under_a_cap():
    """Lesson 08's CUDA cell: torch sees less of PagedAdamW8bit's step than of AdamW8bit's (its state is paged
    outside torch's pool), and under a cap between the two only the paged one fits."""
    bnb = pytest.importorskip("bitsandbytes")
    from labkit.memory import run_within_budget
    from labkit.memory.budget import cuda_limit

    config = GPTConfig(n_layer=4, n_head=8, n_embd=1024, block_size=256)

    def spike(name, cap=None):
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        with cuda_limit(cap):
            model = GPT(config).cuda()
            opt = getattr(bnb.optim, name)(model.parameters(), lr=1e-3)
            for b, s in ((1, 32), (8, 256)):  # a short step makes the state, then the long one spikes
                x = torch.randint(0, config.vocab_size, (b, s), device="cuda")
                model(x, x).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    a8, ap = spike("AdamW8bit"), spike("PagedAdamW8bit")
    cap = (a8 + ap) // 2
    r8 = run_within_budget(lambda: spike("AdamW8bit", cap), cap)
    rp = run_within_budget(lambda: spike("PagedAdamW8bit", cap), cap)
    assert ap < a8 and not r8.fits and rp.fits, (a8, ap, r8.message, rp.message)


def _collectives_over_nccl(world):
    from labkit.distributed import comm_ranks
    from labkit.distributed.launch import launch

    out = launch(comm_ranks.collectives_check, world_size=world, args=(1024,), backend="nccl", timeout_s=60)
    assert len(out) == world
    for r in out:
        assert r["backend"] == "nccl" and r["device"].startswith("cuda") and all(r["ok"].values()), r


def test_nccl_collectives_world_size_1():
    """The NCCL path on one GPU (make gpu-check's nccl step): labkit.distributed.comms' collectives at world 1."""
    _collectives_over_nccl(1)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason="one GPU: NCCL over several GPUs needs two or more (world size 1 ran)")
def test_nccl_collectives_over_every_gpu():
    _collectives_over_nccl(torch.cuda.device_count())
