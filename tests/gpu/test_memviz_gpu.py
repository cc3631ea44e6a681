"""On a GPU: the ledger's memory-viewer export and PyTorch's own snapshot of the same step see the same blocks."""

from collections import Counter

import pytest
import torch

from labkit.memory import Ledger
from labkit.models.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rounded(n: int) -> int:
    """The CUDA caching allocator's block size for a request of n bytes: a multiple of 512, at least 512."""
    return max(512, -(-n // 512) * 512)


def test_export_blocks_are_in_pytorchs_snapshot():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=256, attention="manual")).cuda()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randint(0, model.config.vocab_size, (4, 256), device="cuda")
    for _ in range(2):  # warm up: optimizer state, cuBLAS handles and workspaces exist before recording
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        with Ledger(model, opt, label="gpu step") as led:
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        real = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    ours = led.measurement().trace.snapshot(device=torch.cuda.current_device())
    dev = torch.cuda.current_device()
    ours_allocs = Counter(_rounded(e["size"]) for e in ours["device_traces"][dev]
                          if e["action"] == "alloc" and e["size"]
                          and not e["frames"][0]["name"].startswith("(made outside"))  # tracked, not allocated here
    real_allocs = Counter(e["size"] for e in real["device_traces"][dev] if e["action"] == "alloc")
    missing = ours_allocs - real_allocs  # blocks the ledger saw that the allocator did not make
    seen = sum(s * k for s, k in ours_allocs.items())
    assert sum(s * k for s, k in missing.items()) <= 0.01 * seen, missing.most_common(5)
