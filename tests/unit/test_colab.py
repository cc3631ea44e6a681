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


def link_lines(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return [m for c in nb["cells"] if c["cell_type"] == "markdown"
            for m in colab.LINK_LINE.findall("".join(c["source"]))]


def test_every_lesson_has_one_install_line():
    lessons = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert lessons
    for p in lessons:
        assert len(url_lines(p)) == 1, p.name


def test_every_lesson_has_the_generated_install_block_and_a_link_place_under_its_title():
    for p in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = json.loads(p.read_text(encoding="utf-8"))
        first = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
        url = colab.URL_LINE.search(first)[1]
        ref = colab.REF_LINE.search(first)[1]
        assert colab.BLOCK.search(first)[0] == colab.install_block(url, ref), p.name  # make colab owns it
        assert first.startswith(colab.install_block(url, ref)), p.name
        title = "".join(nb["cells"][0]["source"]).splitlines()
        assert title[0].startswith("# ") and colab.LINK_LINE.fullmatch(title[2]), p.name
        assert link_lines(p) == [colab.NO_LINK], p.name  # stored with the placeholder


def test_sets_the_url_in_every_notebook_and_changes_nothing_else(copies):
    before = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in copies.glob("*.ipynb")}
    done = colab.set_url_everywhere(URL + "/", copies)  # a trailing slash is dropped
    assert sorted(p.name for p in done) == sorted(before)
    for p in done:
        assert url_lines(p) == [f'LABKIT_GIT_URL = "{URL}"  {colab.COMMENT}']
        target = f"https://colab.research.google.com/github/some-course/labkit/blob/main/notebooks/{p.name}"
        badge = f"[![Open In Colab]({colab.BADGE})]({target})"
        assert link_lines(p) == [badge]
        after = json.loads(p.read_text(encoding="utf-8"))
        old = before[p.name]
        assert after["metadata"] == old["metadata"] and len(after["cells"]) == len(old["cells"])
        changed = [i for i, (a, b) in enumerate(zip(after["cells"], old["cells"])) if a != b]
        assert changed == [0, 1], p.name  # the title cell (its link) and the install cell only
        for i in changed:
            cell, was = after["cells"][i], old["cells"][i]
            assert type(cell["source"]) is type(was["source"])  # a string stays a string
            new_lines, old_lines = "".join(cell["source"]).splitlines(), "".join(was["source"]).splitlines()
            assert [a != b for a, b in zip(new_lines, old_lines)].count(True) == 1 and len(new_lines) == len(old_lines)
        assert after["cells"][1]["outputs"] == [] and after["cells"][1]["execution_count"] is None
        assert p.read_text(encoding="utf-8") == json.dumps(after, indent=1, ensure_ascii=False) + "\n"


def test_a_ref_goes_into_the_block_and_the_link_and_bad_refs_are_refused(copies):
    colab.set_url_everywhere(URL, copies, ref="spring-2027")
    for p in copies.glob("*.ipynb"):
        first = "".join(json.loads(p.read_text(encoding="utf-8"))["cells"][1]["source"])
        assert colab.REF_LINE.search(first)[1] == "spring-2027"
        assert link_lines(p)[0].endswith(f"/blob/spring-2027/notebooks/{p.name})")
    for bad in ("", "-x", "a b", "a..b", 'x"y', "/abs"):
        with pytest.raises(ValueError, match="branch or tag"):
            colab.set_url_everywhere(URL, copies, ref=bad)


def test_a_non_github_url_gets_no_link():
    assert colab.colab_link("https://gitlab.example.org/o/labkit.git", "main", "notebooks/x.ipynb") is None
    assert colab.colab_link(colab.PLACEHOLDER, "main", "notebooks/x.ipynb") is None
    assert colab.colab_link("https://github.com/o/labkit.git", "v1", "notebooks/x.ipynb").endswith(
        "(https://colab.research.google.com/github/o/labkit/blob/v1/notebooks/x.ipynb)")


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
    other = subprocess.run([sys.executable, "-m", "labkit.colab", "https://gitlab.example.org/o/labkit", str(copies),
                            "--ref", "v2"], cwd=root, capture_output=True, text=True)
    assert other.returncode == 0 and "at v2" in other.stdout and "no 'Open in Colab' link" in other.stdout
    usage = subprocess.run([sys.executable, "-m", "labkit.colab"], cwd=root, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


# ----------------------------------------------------------------------------- the install, inside Colab

COLAB_T4 = colab.Runtime("3.13.0", (("torch", "2.11.0+cu126"), ("ipywidgets", "7.7.1")), cuda=True)
COLAB_CPU = colab.Runtime("3.13.0", (("torch", "2.11.0+cpu"), ("ipywidgets", "7.7.1")), cuda=False)


def test_constraints_pin_what_colab_has_and_bitsandbytes_comes_only_with_cuda():
    assert colab.constraints(COLAB_T4) == ["torch==2.11.0+cu126", "ipywidgets==7.7.1"]
    gpu = colab.install_commands(COLAB_T4, "/content/labkit", "/tmp/keep.txt", python="py")
    cpu = colab.install_commands(COLAB_CPU, "/content/labkit", "/tmp/keep.txt", python="py")
    pip = ["py", "-m", "pip", "install", "--quiet", "--constraint", "/tmp/keep.txt"]
    assert gpu == [pip + ["--editable", "/content/labkit[lessons,cuda]"], pip + ["--no-deps", *colab.NO_DEPS]]
    assert cpu[0] == pip + ["--editable", "/content/labkit[lessons]"] and cpu[1] == gpu[1]


def test_pyproject_extras_and_makefile_agree_with_the_install():
    root = NOTEBOOKS.parent
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    assert '"ipywidgets>=7.7,<9"' in text and 'cuda = ["bitsandbytes>=0.50"]' in text
    deps = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "bitsandbytes" not in deps and "jupyterlab" not in deps  # neither forced onto Colab
    for extra in colab.EXTRAS + (colab.CUDA_EXTRA,):
        assert f"\n{extra} = [" in text
    assert f"--no-deps {' '.join(colab.NO_DEPS)}" in (root / "Makefile").read_text(encoding="utf-8")


def test_install_runs_pip_with_the_pins_once_and_puts_the_clone_on_sys_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'labkit'\n")
    ran = []

    def run(cmd, check):
        assert check
        keep = Path(cmd[cmd.index("--constraint") + 1]).read_text()
        ran.append((cmd, keep))

    monkeypatch.setattr(colab, "read_runtime", lambda: COLAB_CPU)
    monkeypatch.setattr(sys, "path", list(sys.path))
    lines = colab.install(str(tmp_path), run=run)
    assert [c[0][-1] for c in ran] == [f"{tmp_path}[lessons]", colab.NO_DEPS[-1]]
    assert all(keep == "torch==2.11.0+cpu\nipywidgets==7.7.1\n" for _, keep in ran)
    assert sys.path[0] == str(tmp_path)
    assert "kept torch 2.11.0+cpu, ipywidgets 7.7.1" in lines[0] and "bitsandbytes not installed" in lines[0]
    assert capsys.readouterr().out.splitlines() == lines
    assert colab.install(str(tmp_path), run=run)[0].startswith("labkit: already installed") and len(ran) == 2
    with pytest.raises(ValueError, match="not a labkit clone"):
        colab.install(str(tmp_path / "missing"), run=run)


def test_install_names_what_pip_replaced():
    lines = colab._report(COLAB_T4, {"numpy": "1.26.4", "torch": "2.11.0"}, {"numpy": "2.1.0", "torch": "2.11.0"},
                          "/content/labkit")
    assert "bitsandbytes installed" in lines[0]
    assert lines[1].startswith("pip replaced numpy 1.26.4 -> 2.1.0") and "restart the runtime" in lines[1]
