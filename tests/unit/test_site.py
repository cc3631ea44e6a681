"""labkit.course.site.prepare: the book's sources (tests/site opens the built book in Chromium)."""

import base64
import copy
import json

import pytest

from labkit.course import site
from labkit.course.map import markdown as course_map
from labkit.paths import REPO_ROOT

LESSON = "00_start_here.ipynb"
OTHER = "04_gradient_accumulation.ipynb"
VIEW = {"model_id": "abc123", "version_major": 2, "version_minor": 0}
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")


def _lesson(name: str) -> dict:
    return json.loads((REPO_ROOT / "notebooks" / name).read_text())


def _executed(name: str) -> dict:
    """The lesson as the browser test saves it: outputs (a widget view among them) and who ran it."""
    nb = copy.deepcopy(_lesson(name))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    code[-1]["outputs"] = [{"output_type": "display_data", "metadata": {},
                            "data": {"text/plain": "VBox(...)", site.WIDGET_VIEW: VIEW}},
                           {"output_type": "stream", "name": "stdout", "text": "done\n"}]
    nb["metadata"]["labkit"] = {"profile": "smoke", "executed_by": "make test-browser (JupyterLab in Chromium)"}
    return nb


@pytest.fixture
def executed(tmp_path):
    folder = tmp_path / "executed"
    folder.mkdir()
    (folder / LESSON).write_text(json.dumps(_executed(LESSON)))
    stale = _executed(OTHER)
    stale["cells"][2]["source"] = "an older version of this cell"
    (folder / OTHER).write_text(json.dumps(stale))
    (folder / LESSON.removesuffix(".ipynb")).mkdir()
    (folder / LESSON.removesuffix(".ipynb") / "abc123.png").write_bytes(PNG)
    return folder


def test_an_executed_copy_is_used_as_it_is_and_a_stale_one_is_not(tmp_path, executed):
    how = site.prepare(tmp_path / "src", REPO_ROOT, executed, lessons=["00", "04"])
    assert how == {LESSON: "executed copy", OTHER: "to execute"}
    used = json.loads((tmp_path / "src" / LESSON).read_text())
    assert used["metadata"]["mystnb"] == {"execution_mode": "off"}
    assert "**smoke** profile by make test-browser" in used["cells"][1]["source"]
    last = [c for c in used["cells"] if c["cell_type"] == "code"][-1]["outputs"]
    assert [list(o.get("data", {"stream": 0})) for o in last] == [["text/markdown"], ["image/png"], ["stream"]]
    assert "interactive panel" in last[0]["data"]["text/markdown"]
    assert base64.b64decode(last[1]["data"]["image/png"]) == PNG  # the browser test's picture of that panel
    fresh = json.loads((tmp_path / "src" / OTHER).read_text())
    assert "mystnb" not in fresh["metadata"]  # executed by myst-nb (cache mode)
    assert f"**{site._profile()}** profile by `make site`" in fresh["cells"][1]["source"]
    assert all(not c.get("outputs") for c in fresh["cells"] if c["cell_type"] == "code")
    for nb in (used, fresh):  # the pages keep every cell of the lesson, in order, and add the note
        source = _lesson(LESSON if nb is used else OTHER)
        assert [c["source"] for c in nb["cells"][:1] + nb["cells"][2:]] == [c["source"] for c in source["cells"]]
        colab = [c for c in nb["cells"] if "".join(c["source"]).startswith(site.COLAB_CELL)]
        assert len(colab) == 1 and colab[0]["metadata"]["tags"] == ["remove-cell"]


def test_a_panel_without_a_picture_says_it_needs_a_kernel(tmp_path, executed):
    (executed / LESSON.removesuffix(".ipynb") / "abc123.png").unlink()
    site.prepare(tmp_path / "src", REPO_ROOT, executed, lessons=["00"])
    used = json.loads((tmp_path / "src" / LESSON).read_text())
    last = [c for c in used["cells"] if c["cell_type"] == "code"][-1]["outputs"]
    assert [list(o.get("data", {"stream": 0})) for o in last] == [["text/markdown"], ["stream"]]


def test_front_page_is_the_course_map_and_the_toc_lists_the_lessons(tmp_path, executed):
    site.prepare(tmp_path / "src", REPO_ROOT, executed, lessons=["00", "04"])
    intro = (tmp_path / "src" / "intro.md").read_text()
    assert course_map(REPO_ROOT) in intro
    assert f"]({LESSON})" in intro and f"]({OTHER})" in intro
    toc = (tmp_path / "src" / "_toc.yml").read_text()
    assert toc.splitlines()[:3] == ["format: jb-book", "root: intro", "chapters:"]
    assert toc.splitlines()[3:] == ["- file: 00_start_here", "- file: 04_gradient_accumulation"]
    assert "panels.js" in (tmp_path / "src" / "_config.yml").read_text()  # the sentence where a panel stands
    assert site.PANEL_NOTE in (tmp_path / "src" / "_static" / "panels.js").read_text()
    site.prepare(tmp_path / "src", REPO_ROOT, executed, lessons=["00"])  # a smaller book drops the other page
    assert sorted(p.name for p in (tmp_path / "src").glob("*.ipynb")) == [LESSON]


def test_unknown_lesson_is_a_clear_error(tmp_path, executed):
    with pytest.raises(ValueError, match="no lesson numbered 99"):
        site.prepare(tmp_path / "src", REPO_ROOT, executed, lessons=["99"])
