"""labkit.colab: `make colab URL=...` rewrites the install cell's URL and nothing else."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import colab

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
URL = "https://github.com/some-course/labkit"


@pytest.fixture
def copies(tmp_path):
    """A copy of the lesson notebooks (and solutions/) in a temporary folder."""
    dst = tmp_path / "notebooks"
    shutil.copytree(NOTEBOOKS, dst)
    return dst


def url_lines(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [line for c in nb["cells"] if c["cell_type"] == "code"
            for line in "".join(c["source"]).splitlines() if line.startswith("LABKIT_GIT_URL")]


def test_every_lesson_has_one_install_line():
    lessons = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert lessons
    for p in lessons:
        assert len(url_lines(p)) == 1, p.name


def test_sets_the_url_in_every_notebook_and_changes_nothing_else(copies):
    before = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in copies.glob("*.ipynb")}
    done = colab.set_url_everywhere(URL + "/", copies)  # a trailing slash is dropped
    assert sorted(p.name for p in done) == sorted(before)
    for p in done:
        assert url_lines(p) == [f'LABKIT_GIT_URL = "{URL}"  {colab.COMMENT}']
        after = json.loads(p.read_text(encoding="utf-8"))
        old = before[p.name]
        assert after["metadata"] == old["metadata"] and len(after["cells"]) == len(old["cells"])
        changed = [i for i, (a, b) in enumerate(zip(after["cells"], old["cells"])) if a != b]
        assert len(changed) == 1, p.name  # the install cell only
        cell, was = after["cells"][changed[0]], old["cells"][changed[0]]
        assert cell["outputs"] == [] and cell["execution_count"] is None
        new_lines, old_lines = "".join(cell["source"]).splitlines(), "".join(was["source"]).splitlines()
        assert [a != b for a, b in zip(new_lines, old_lines)].count(True) == 1 and len(new_lines) == len(old_lines)
        assert p.read_text(encoding="utf-8") == json.dumps(after, indent=1, ensure_ascii=False) + "\n"


def test_second_run_changes_the_url_again_and_same_url_leaves_files_untouched(copies):
    colab.set_url_everywhere(URL, copies)
    first = {p: p.read_bytes() for p in copies.glob("*.ipynb")}
    colab.set_url_everywhere(URL, copies)
    assert {p: p.read_bytes() for p in copies.glob("*.ipynb")} == first
    colab.set_url_everywhere("https://gitlab.example.org/other/labkit.git", copies)
    for p in first:
        assert url_lines(p) == [f'LABKIT_GIT_URL = "https://gitlab.example.org/other/labkit.git"  {colab.COMMENT}']


@pytest.mark.parametrize("bad", ["", "github.com/ORG/labkit", "https://", 'https://x/"; rm', "https://a b"])
def test_bad_urls_are_refused_and_nothing_is_written(copies, bad):
    before = {p: p.read_bytes() for p in copies.glob("*.ipynb")}
    with pytest.raises(ValueError, match="URL"):
        colab.set_url_everywhere(bad, copies)
    assert {p: p.read_bytes() for p in copies.glob("*.ipynb")} == before


def test_folder_without_install_cells_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no notebook"):
        colab.set_url_everywhere(URL, tmp_path)
    with pytest.raises(ValueError, match="no such folder"):
        colab.set_url_everywhere(URL, tmp_path / "missing")


def test_command_line(copies):
    root = Path(__file__).resolve().parents[2]
    ok = subprocess.run([sys.executable, "-m", "labkit.colab", URL, str(copies)], cwd=root,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert f"{len(list(copies.glob('*.ipynb')))} notebooks" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "labkit.colab", "not-a-url", str(copies)], cwd=root,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("labkit.colab: expected a repository URL")
    usage = subprocess.run([sys.executable, "-m", "labkit.colab"], cwd=root, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
