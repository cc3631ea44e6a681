"""Where lessons and the library write files: the repository's data/ folder (see data/README.md).

`data_dir()` is, in order:
1. $LABKIT_DATA_DIR, when set (tests and shared machines point it elsewhere);
2. the repository's `data/` folder, when labkit runs from a clone (the folder beside `labkit/`,
   recognised by its README.md and the repository's pyproject.toml);
3. a per-user cache folder when labkit is installed without the repository (e.g. pip on Colab):
   $XDG_CACHE_HOME/labkit or ~/.cache/labkit on Linux, ~/Library/Caches/labkit on macOS,
   %LOCALAPPDATA%\\labkit on Windows.

Standard library only: importing it loads nothing else of labkit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "LABKIT_DATA_DIR"
REPO_ROOT = Path(__file__).resolve().parent.parent  # the clone's root when labkit runs from one


def repo_data_dir() -> Path | None:
    """The repository's data/ folder, or None when labkit is not running from a clone."""
    data = REPO_ROOT / "data"
    if (data / "README.md").is_file() and (REPO_ROOT / "pyproject.toml").is_file():
        return data
    return None


def user_cache_dir(platform: str | None = None) -> Path:
    """labkit's folder in the per-user cache of `platform` (default: this one, sys.platform)."""
    platform = sys.platform if platform is None else platform
    home = Path.home()
    if platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local")
    elif platform == "darwin":
        base = home / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache")
    return base / "labkit"


def data_dir(*parts: str, create: bool = True) -> Path:
    """The folder lessons write to (see the module docstring), joined with `parts`; made if missing."""
    env = os.environ.get(ENV)
    base = Path(env).expanduser() if env else (repo_data_dir() or user_cache_dir())
    path = base.joinpath(*parts)
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path
