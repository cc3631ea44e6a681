"""What TensorFlow's "memory growth" means in PyTorch: the CUDA caching allocator, measured on a CNN whose
input resolution grows (progressive resizing), with and without `expandable_segments`.

TensorFlow maps (almost) all GPU memory up front unless `set_memory_growth(True)`; PyTorch always grows:
its caching allocator asks cudaMalloc for segments as tensors need them and keeps freed blocks cached
for reuse (`memory_reserved` >= `memory_allocated`). When tensor sizes change between steps, cached
blocks of the old sizes may not fit the new ones: reserved climbs above what is ever allocated
(fragmentation). `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` lets a segment grow in place
(virtual memory mapping) instead, which keeps reserved close to the peak allocated. The setting is
read when CUDA initialises, so each run is a fresh process: `python -m labkit.models.cnn_allocator`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run(resolutions: list[int], batch: int, phi: float = 2.0) -> dict:
    """In this process: train one step per resolution on CUDA and read the allocator after each."""
    import torch

    from labkit.models.cnn import CNNConfig, CompoundCNN, make_batch

    config = CNNConfig().at(phi)
    model = CompoundCNN(config).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rows = []
    for r in resolutions:
        torch.cuda.reset_peak_memory_stats()
        x, y = make_batch(config, batch, r, device="cuda")
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y
        s = torch.cuda.memory_stats()
        rows.append({"resolution": r, "max_allocated": s["allocated_bytes.all.peak"],
                     "reserved": s["reserved_bytes.all.current"], "allocated": s["allocated_bytes.all.current"],
                     "inactive_split": s["inactive_split_bytes.all.current"], "segments": s["segment.all.current"]})
    return {"rows": rows, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def allocator_growth(resolutions: list[int], batch: int, phi: float = 2.0, expandable: bool = False,
                     timeout: float = 300) -> dict:
    """`run` in a fresh Python process (so the allocator setting applies), expandable segments on or off."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"expandable_segments:{'True' if expandable else 'False'}")
    args = [sys.executable, "-m", "labkit.models.cnn_allocator", json.dumps([resolutions, batch, phi])]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"the allocator run failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import torch

    if not torch.cuda.is_available():
        sys.exit("labkit.models.cnn_allocator needs CUDA")
    resolutions, batch, phi = json.loads(sys.argv[1])
    print(json.dumps(run(resolutions, batch, phi)))
