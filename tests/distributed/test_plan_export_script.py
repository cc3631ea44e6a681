"""The torchrun + FSDP2 script labkit.plan.export writes runs a plan on 2 CPU ranks (gloo) and exits 0.

One launch (torchrun's start-up costs seconds): ZeRO-3 over 2 ranks, per-block checkpointing and 2
micro-batches per rank; the first step's loss of each rank must equal one process's loss of the same model
on that rank's rows (before any update every rank holds the seed's weights), so a script that built another
model, took other rows or averaged its micro-batches wrongly fails here.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from labkit.estimate import Recipe
from labkit.models.gpt import GPT, GPTConfig
from labkit.plan.export import export_plan

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
ROOT = Path(__file__).resolve().parents[2]


def test_exported_script_trains_on_two_cpu_ranks(tmp_path):
    recipe = Recipe(TINY, batch=8, seq=8, checkpoint="full", micro_batch=2, dp=2, zero=3)
    paths = export_plan(recipe, tmp_path / "plan", devices=2)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(paths["train_fsdp2"]), "--steps", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["world"] == 2 and result["steps"] == 2
    losses = result["losses"]
    assert all(len(r) == 2 and all(torch.isfinite(torch.tensor(r))) for r in losses)
    # the first step, in one process: the same seed's model on each rank's 4 rows of the global batch
    torch.manual_seed(0)
    model = GPT(TINY)
    t = torch.randint(0, TINY.vocab_size, (8, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rank in range(2):
            rows = t[rank * 4:(rank + 1) * 4]
            torch.testing.assert_close(torch.tensor(losses[rank][0]), model(rows[:, :-1], rows[:, 1:]))
    assert losses[0][1] != losses[0][0]  # the step changed the weights


def test_exported_script_steps_in_backward(tmp_path):
    """One rank, step_in_backward (per-parameter AdamW stepped by a post-accumulate-grad hook), sqrt
    checkpointing (labkit.recompute) and activation offload: the two steps' losses equal plain AdamW's in
    one process on the same batches (stepping each parameter in backward changes when, not what)."""
    recipe = Recipe(TINY, batch=4, seq=8, checkpoint="sqrt", offload_activations=True, step_in_backward=True)
    paths = export_plan(recipe, tmp_path / "plan", devices=1)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(paths["train_fsdp2"]), "--steps", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = json.loads(out.stdout.strip().splitlines()[-1])["losses"][0]
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    ref = []
    for _ in range(2):
        t = torch.randint(0, TINY.vocab_size, (4, 9), generator=gen)
        loss = model(t[:, :-1], t[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
