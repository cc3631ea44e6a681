"""The lessons as a static HTML book (Jupyter Book 1: Sphinx and myst-nb, pure Python), the course map its front
page: `make site` or `python -m labkit.course site`, HTML in build/site/_build/html/.

A lesson's page shows the outputs of one run. Where build/executed/<lesson>.ipynb exists (`make test-browser`
saves each lesson there once Run All has passed in JupyterLab) and its cells are the lesson's own, the page is
built from it, executed no further. Any other lesson is executed by myst-nb at this machine's profile, through
jupyter-cache (build/site/_build/.jupyter_cache): a rebuild runs only lessons whose code changed. The first cell
after each title says which run the outputs come from. The ipywidgets panels need a kernel: a page says so where
a panel stands (its picture from the browser test where it took one) rather than showing a dead widget.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from pathlib import Path

from labkit.paths import REPO_ROOT

from .lessons import read_lessons
from .map import markdown as course_map

EXECUTED = REPO_ROOT / "build" / "executed"  # tests/browser/test_lessons_in_browser.py writes here
SITE = REPO_ROOT / "build" / "site"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
COLAB_CELL = "# ---- Colab only"  # the install cell every lesson starts with: not shown in the book

CONFIG = """\
title: labkit
author: the labkit authors
only_build_toc_files: true
execute:
  execute_notebooks: cache  # lessons without an executed copy; the copies say "off" in their own metadata
  timeout: -1  # no per-cell limit: at the cpu profile some cells train for minutes
  allow_errors: false
html:
  use_repository_button: false
  use_issues_button: false
  use_edit_page_button: false
launch_buttons:
  notebook_interface: jupyterlab
sphinx:
  config:
    nb_execution_raise_on_error: true  # a lesson that fails here fails the build, not a page with a traceback
    nb_ipywidgets_js: {}  # no widget manager from a CDN: the pages must work offline
    html_js_files: [panels.js]  # says so where a panel of a lesson executed here stands
    html_show_copyright: false
    html_last_updated_fmt: ""
"""

INTRO = """\
# labkit: training large models with limited GPU memory

Each lesson predicts the memory of a technique, builds it, checks it against the production tool, measures it
and lets you explore it in a panel. These pages show every lesson with the outputs of one run; the note under
each title says which run. The panels need a live kernel: run the lessons in JupyterLab (`make lab`) or Colab.

## Course map

{course_map}

## Lessons

{lessons}
"""


PANEL_NOTE = "An interactive panel (ipywidgets): run this lesson in JupyterLab or Colab to use it."
# Pages myst-nb executed keep each widget view as a <script> a static page cannot draw: a sentence in its place.
PANELS_JS = """document.addEventListener("DOMContentLoaded", () => {
  for (const s of document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')) {
    const p = document.createElement("p"); p.className = "labkit-panel"; p.innerHTML = "<em>%s</em>";
    s.parentNode.insertBefore(p, s);
  }
});
""" % PANEL_NOTE


def _same_cells(a: dict, b: dict) -> bool:
    """The executed copy is this version of the lesson: the same cells, in order, with the same sources."""
    src = lambda nb: [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]  # noqa: E731
    return src(a) == src(b)


def _panel_outputs(cell: dict, shots: Path) -> list[dict]:
    """A cell's outputs with each widget view replaced by what a static page can show: the browser test's
    picture of that panel (shots/<model_id>.png) when there is one, and a sentence saying it needs a kernel."""
    out = []
    for o in cell.get("outputs", []):
        view = o.get("data", {}).get(WIDGET_VIEW) if o.get("output_type") in ("display_data", "execute_result") else None
        if view is None:
            out.append(o)
            continue
        shot = shots / f"{view.get('model_id')}.png"
        data = {"text/markdown": f"*{PANEL_NOTE}" + (" Below, as the browser test saw it after Run All.*"
                                                      if shot.is_file() else "*")}
        out.append({"output_type": "display_data", "metadata": {}, "data": data})
        if shot.is_file():
            png = base64.b64encode(shot.read_bytes()).decode()
            out.append({"output_type": "display_data", "metadata": {}, "data": {"image/png": png}})
    return out


def _note(text: str) -> dict:
    return {"cell_type": "markdown", "id": "labkit-site-run", "metadata": {}, "source": text}


def page(lesson: dict, executed: dict | None, shots: Path, profile: str) -> dict:
    """The notebook a lesson's page is built from: the executed copy when it is this lesson's (execution off),
    else the lesson itself (myst-nb executes it); the Colab cell hidden, a note on the run under the title."""
    if executed is not None and _same_cells(lesson, executed):
        nb = copy.deepcopy(executed)
        run = nb["metadata"].get("labkit", {})
        note = (f"*Outputs from a run at the **{run.get('profile', 'unrecorded')}** profile by "
                f"{run.get('executed_by', 'an unrecorded run')}; not executed again for this page.*")
        nb["metadata"]["mystnb"] = {"execution_mode": "off"}
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"] = _panel_outputs(cell, shots)
    else:
        nb = copy.deepcopy(lesson)
        note = (f"*Outputs from a run at the **{profile}** profile by `make site` (myst-nb through jupyter-cache: "
                f"run again only when the lesson's code changes).*")
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "".join(cell["source"]).startswith(COLAB_CELL):
            cell.setdefault("metadata", {}).setdefault("tags", []).append("remove-cell")
    nb["cells"].insert(1, _note(note))
    return nb


def _write(path: Path, text: str) -> None:
    """Write only what changed, so that Sphinx rereads only the pages that did."""
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


def _profile() -> str:
    """The profile a lesson executed here runs at (LABKIT_SMOKE and the device decide, as in the lesson)."""
    from labkit.device import profile

    return profile().name


def prepare(src: Path, root: Path = REPO_ROOT, executed: Path = EXECUTED, lessons=None) -> dict[str, str]:
    """Write the book's sources into `src` (config, table of contents, front page, one notebook per lesson: all,
    or those whose number is in `lessons`); return {lesson notebook: "executed copy" or "to execute"}."""
    found = read_lessons(root)
    unknown = set(lessons or ()) - {l.number for l in found}
    if unknown:
        raise ValueError(f"no lesson numbered {', '.join(sorted(unknown))} in {root / 'notebooks'}")
    lessons = [l for l in found if lessons is None or l.number in set(lessons)]
    if not lessons:
        raise ValueError(f"no lessons in {root / 'notebooks'}")
    src.mkdir(parents=True, exist_ok=True)
    how, profile = {}, None
    for lesson in lessons:
        nb = json.loads((root / "notebooks" / lesson.notebook).read_text())
        copy_path = executed / lesson.notebook
        done = json.loads(copy_path.read_text()) if copy_path.is_file() else None
        if done is None or not _same_cells(nb, done):
            profile = profile or _profile()
        how[lesson.notebook] = "executed copy" if done is not None and _same_cells(nb, done) else "to execute"
        shots = executed / lesson.notebook.removesuffix(".ipynb")
        _write(src / lesson.notebook, json.dumps(page(nb, done, shots, profile or ""), indent=1,
                                                 ensure_ascii=False) + "\n")
    for stale in set(src.glob("*.ipynb")) - {src / l.notebook for l in lessons}:
        stale.unlink()
    links = "\n".join(f"- [{l.number} {l.title}]({l.notebook})" for l in lessons)
    _write(src / "intro.md", INTRO.format(course_map=course_map(root), lessons=links))
    _write(src / "_config.yml", CONFIG)
    (src / "_static").mkdir(exist_ok=True)
    _write(src / "_static" / "panels.js", PANELS_JS)
    _write(src / "_toc.yml", "format: jb-book\nroot: intro\nchapters:\n"
           + "".join(f"- file: {l.notebook.removesuffix('.ipynb')}\n" for l in lessons))
    return how


def build(out: Path = SITE, root: Path = REPO_ROOT, executed: Path = EXECUTED, lessons=None) -> Path:
    """Prepare the sources in out/src and run Jupyter Book on them; return the front page (index.html)."""
    import subprocess
    import sys

    how = prepare(out / "src", root, executed, lessons)
    todo = [n for n, h in how.items() if h != "executed copy"]
    print(f"labkit.course site: {len(how) - len(todo)} lessons from build/executed/, "
          f"{len(todo)} executed here (cached): {', '.join(todo) or 'none'}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build", str(out / "src"), "--path-output", str(out),
           "--builder", "html", "--keep-going"]
    if subprocess.run(cmd, env=env).returncode:
        raise RuntimeError(f"jupyter-book build failed: {' '.join(cmd)}")
    return out / "_build" / "html" / "index.html"
