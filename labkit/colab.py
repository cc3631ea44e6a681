"""Point every notebook's Colab install cell at the course's repository: `make colab URL=...`.

Each lesson's first code cell installs labkit with `pip install "labkit @ git+<URL>"` when it runs
inside Colab; the URL sits on one line, `LABKIT_GIT_URL = "..."`. This module rewrites that line in
every notebook of a folder, and nothing else: the notebook JSON keeps its layout, and the edited
cell is left without outputs or execution count, as every notebook is stored.

    python -m labkit.colab https://github.com/ORG/labkit [notebooks]

Standard library only, so `make colab` runs with any python3, before any environment exists.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

URL_LINE = re.compile(r'^LABKIT_GIT_URL = "[^"\n]*"(?:[ \t]*#[^\n]*)?$', re.MULTILINE)
COMMENT = "# set by: make colab URL=..."
SCHEMES = ("https://", "http://", "ssh://", "file://")  # what pip accepts after "git+"


def check_url(url: str) -> str:
    """The URL without a trailing slash; ValueError for anything pip's `git+URL` cannot fetch."""
    url = url.strip().rstrip("/")
    if not url.startswith(SCHEMES) or len(url) <= len(url.split("://")[0]) + 3:
        raise ValueError(f"expected a repository URL starting with {', '.join(SCHEMES)}, got {url!r}")
    if re.search(r'[\s"\'\\]', url):
        raise ValueError(f"the URL must not contain spaces, quotes or backslashes, got {url!r}")
    return url


def set_url_in_source(source: str, url: str) -> tuple[str, int]:
    """(new source, number of LABKIT_GIT_URL lines rewritten)."""
    return URL_LINE.subn(lambda _: f'LABKIT_GIT_URL = "{url}"  {COMMENT}', source)


def set_url(path: str | Path, url: str) -> bool:
    """Rewrite the install cell of one notebook; True if it has one. The file changes only if the URL does."""
    path = Path(path)
    raw = path.read_text(encoding="utf-8")
    nb = json.loads(raw)
    found = False
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        new, n = set_url_in_source(source, url)
        if n == 0:
            continue
        found = True
        cell["source"] = new.splitlines(keepends=True)
        cell["outputs"], cell["execution_count"] = [], None  # stored clean
    out = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"  # the layout Jupyter writes
    if found and out != raw:
        path.write_text(out, encoding="utf-8")
    return found


def set_url_everywhere(url: str, folder: str | Path = "notebooks") -> list[Path]:
    """Set the URL in every notebook under `folder`; the notebooks that have an install cell."""
    url = check_url(url)
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"no such folder: {str(folder)!r}")
    notebooks = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    done = [p for p in notebooks if set_url(p, url)]
    if not done:
        raise ValueError(f"no notebook under {str(folder)!r} has a LABKIT_GIT_URL line")
    return done


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m labkit.colab URL [NOTEBOOK_FOLDER]   (e.g. https://github.com/ORG/labkit)",
              file=sys.stderr)
        return 2
    try:
        done = set_url_everywhere(args[0], args[1] if len(args) == 2 else "notebooks")
    except ValueError as e:
        print(f"labkit.colab: {e}", file=sys.stderr)
        return 2
    print(f"Colab install cell now installs from {check_url(args[0])} in {len(done)} notebooks:")
    for p in done:
        print(f"  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
