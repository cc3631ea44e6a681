"""labkit.paths.data_dir: $LABKIT_DATA_DIR, else the clone's data/, else a per-user cache folder; disk offload writes there."""

from pathlib import Path

import pytest
import torch

from labkit import paths
from labkit.estimate import Recipe
from labkit.run import measure_step
from labkit.models.gpt import GPTConfig
from labkit.optim import offload

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(paths.ENV, raising=False)


def test_environment_variable_wins_and_subfolders_are_made(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.ENV, str(tmp_path / "mine"))
    assert paths.data_dir(create=False) == tmp_path / "mine" and not (tmp_path / "mine").exists()
    d = paths.data_dir("a", "b")
    assert d == tmp_path / "mine" / "a" / "b" and d.is_dir()


def test_a_clone_uses_its_data_folder(no_env):
    assert (REPO / "data" / "README.md").is_file()
    assert paths.repo_data_dir() == REPO / "data"
    assert paths.data_dir(create=False) == REPO / "data"


def test_without_the_repository_a_user_cache_folder(no_env, monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "site-packages")  # labkit installed by pip: no data/README.md
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("USERPROFILE", str(tmp_path / "home"))
    assert paths.repo_data_dir() is None
    assert paths.user_cache_dir("linux") == tmp_path / "cache" / "labkit"
    assert paths.user_cache_dir("win32") == tmp_path / "local" / "labkit"
    assert paths.user_cache_dir("darwin") == tmp_path / "home" / "Library" / "Caches" / "labkit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.user_cache_dir("linux") == tmp_path / "home" / ".cache" / "labkit"
    d = paths.data_dir("x")
    assert d == paths.user_cache_dir() / "x" and d.is_dir()


def test_measure_step_disk_offload_writes_under_data_dir_and_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.ENV, str(tmp_path))
    made = []
    mkdtemp = offload.tempfile.mkdtemp

    def spy(*args, **kw):
        made.append(Path(mkdtemp(*args, **kw)))
        return str(made[-1])

    monkeypatch.setattr(offload.tempfile, "mkdtemp", spy)
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64)
    measure_step(Recipe(cfg, 2, 8, optimizer="adamw", optimizer_offload="disk"), steps=1)
    memmaps = [d for d in made if d.name.startswith("labkit-offload-")]
    assert len(memmaps) == 1 and tmp_path in memmaps[0].parents  # the memmaps' folder was under data_dir()
    assert not memmaps[0].exists() and list(tmp_path.iterdir()) == []  # and nothing is left
