"""Every lesson in JupyterLab, in a real browser (Chromium driven by Playwright), as a learner runs it.

`make test-browser` runs this file: it starts JupyterLab on a copy of notebooks/ in smoke mode, opens each
lesson, runs all its cells, and asserts what a learner would see: no error output, no "Error displaying
widget", every panel rendered, no control's words cut short in a 1280-pixel window (a label, a button, a
drop-down's choice, a slider's readout); changing a panel's control redraws its prediction; its measure button
shows a measurement. Screenshots of each panel go to tests/browser/screenshots/ (ignored by git). Each lesson,
once Run All has passed and before a control is touched, is saved with its outputs to build/executed/ (what
`make site` builds its pages from, so CI runs no lesson a third time). `make test-browser` runs two lessons at a
time on pytest-xdist workers: the `lab` fixture is per module, so each worker starts its own server and browser.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="make test-browser installs playwright")

ROOT = Path(__file__).resolve().parents[2]
LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SHOTS = Path(__file__).parent / "screenshots"
EXECUTED = ROOT / "build" / "executed"  # <lesson>.ipynb as Run All left it (labkit/course/site.py reads them)
RUN_TIMEOUT_S = 900  # one lesson, all cells, in smoke mode (the slowest takes about a minute and a half)
WINDOW = {"width": 1280, "height": 1000}  # a laptop's window: every control's text must fit in it

pytestmark = pytest.mark.browser


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("no Chromium found: install Debian's `chromium` (make test-browser does) or set CHROMIUM=/path")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab server on a copy of notebooks/ (running lessons writes files), smoke mode, no token."""
    root = tmp_path_factory.mktemp("lab") / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "memory_viz"))
    port = _free_port()
    env = dict(os.environ, LABKIT_SMOKE="1", PYTHONPATH=str(ROOT))
    env.pop("MPLBACKEND", None)  # the kernel draws inline, as a learner's does
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ServerApp.token=",
           "--ServerApp.password=", "--LabApp.expose_app_in_browser=True", f"--ServerApp.root_dir={root}",
           "--ServerApp.disable_check_xsrf=True", f"--LabApp.workspaces_dir={root.parent / 'workspaces'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # Jupyter refuses root without it (containers, CI)
    log = open(tmp_path_factory.mktemp("log") / "lab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if server.poll() is not None:
                pytest.fail(f"jupyter lab exited with {server.returncode}; see {log.name}")
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"jupyter lab did not answer within 120 s; see {log.name}")
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=_chromium(), headless=True,
                                        args=["--no-sandbox"])  # root cannot use Chromium's sandbox
            yield browser, url, root
            browser.close()
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


# JavaScript run in the page; `window.jupyterapp` exists because of expose_app_in_browser.
KERNEL_IDLE = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle'; }"""
CELLS = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter(c => c.model.type === 'code')
  .map(c => ({n: c.model.executionCount,
              outputs: Array.from({length: c.model.outputs.length}, (_, i) => c.model.outputs.get(i).toJSON())}))"""
DONE = """() => { const w = window.jupyterapp.shell.currentWidget;
  const cells = w.content.widgets.filter(c => c.model.type === 'code');
  const outs = c => Array.from({length: c.model.outputs.length}, (_, i) => c.model.outputs.get(i).type);
  if (cells.some(c => outs(c).includes('error'))) return true;
  return cells.every(c => c.model.executionCount !== null) && w.sessionContext.session.kernel.status === 'idle'; }"""


# true once `views` widget views have rendered, or one has failed to (the asserts that follow say which)
VIEWS_SETTLED = """views => document.querySelectorAll('.jp-OutputArea-output .jupyter-widgets').length >= views
  || document.body.innerText.includes('Error displaying widget')"""


def _wait_for_widget_views(page, views: int) -> None:
    """Wait (at most 30 s) for the lesson's widget views to render, instead of sleeping a fixed time."""
    try:
        page.wait_for_function(VIEWS_SETTLED, arg=views, timeout=30_000, polling=100)
    except sync_api.TimeoutError:
        pass  # the asserts below report what did not render


def _save_executed(page, root: Path, lesson: str) -> None:
    """JupyterLab saves the notebook (outputs and all) in the server's copy; that goes to build/executed/, its
    metadata naming the profile (the server runs with LABKIT_SMOKE=1) and who ran it."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")  # resolves once written
    nb = json.loads((root / lesson).read_text())
    assert any(o for c in nb["cells"] for o in c.get("outputs", ())), f"{lesson}: saved without outputs"
    nb["metadata"]["labkit"] = {"profile": "smoke", "executed_by": "make test-browser (JupyterLab in Chromium)"}
    EXECUTED.mkdir(parents=True, exist_ok=True)
    (EXECUTED / lesson).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")


# tags each widget view's output in the page with its model id (data-labkit-view) and returns the ids
TAG_VIEWS = """() => window.jupyterapp.shell.currentWidget.content.widgets.filter(c => c.model.type === 'code')
  .flatMap(c => Array.from({length: c.model.outputs.length}, (_, i) => [c, i]))
  .map(([c, i]) => { const v = (c.model.outputs.get(i).toJSON().data || {})['application/vnd.jupyter.widget-view+json'];
    const out = c.outputArea.widgets[i];
    if (!v || !out) return null;
    out.node.setAttribute('data-labkit-view', v.model_id); return v.model_id; })
  .filter(id => id !== null)"""


def _picture_views(page, folder: Path) -> None:
    """A picture of each widget view as Run All left it, folder/<model_id>.png: what the book shows where a panel
    stands (a static page has no kernel to draw it). A view that takes no room (an empty output) has none."""
    folder.mkdir(parents=True, exist_ok=True)
    for model_id in page.evaluate(TAG_VIEWS):
        view = page.locator(f'[data-labkit-view="{model_id}"] .jp-OutputArea-output').first
        if not view.count() or not view.is_visible():  # hidden (display: none): nothing to picture
            continue
        view.scroll_into_view_if_needed()
        box = view.bounding_box()
        if box and box["width"] >= 2 and box["height"] >= 2:
            view.screenshot(path=str(folder / f"{model_id}.png"))


# the controls of one widget output whose words a learner cannot read whole: a label cut short ("sequenc"), a
# button's words, a drop-down's chosen option, a slider's readout squeezed to nothing, or a control cut off by a
# box too narrow to hold it (a squeezed row of controls hides their right part). Labels, buttons and readouts
# clip their own text (overflow hidden): their scrollWidth exceeds their clientWidth. A <select> draws its option
# itself: its text is measured with its font against its width less its padding (where the arrow is drawn).
# A box that clips (overflow other than visible) cuts what reaches past its edges.
CLIPPED = """out => {
  const ctx = document.createElement('canvas').getContext('2d');
  const what = '.widget-label, .widget-label-basic, .widget-readout, button, select';
  const cutBy = el => {  // the left and right edges of the boxes between el and the output that clip it
    let lo = -Infinity, hi = Infinity;
    for (let a = el.parentElement; a && a !== out.parentElement; a = a.parentElement) {
      if (getComputedStyle(a).overflowX === 'visible') continue;
      const r = a.getBoundingClientRect();
      lo = Math.max(lo, r.left); hi = Math.min(hi, r.right);
    }
    return [lo, hi];
  };
  return Array.from(out.querySelectorAll(what)).filter(el => el.offsetParent !== null).flatMap(el => {
    let need = el.scrollWidth, text = (el.innerText || '').trim();
    if (el.tagName === 'SELECT') {
      const cs = getComputedStyle(el), opt = el.options[el.selectedIndex];
      ctx.font = `${cs.fontStyle} ${cs.fontWeight} ${cs.fontSize} ${cs.fontFamily}`;
      text = opt ? opt.text.trim() : '';
      need = Math.ceil(ctx.measureText(text).width + parseFloat(cs.paddingLeft) + parseFloat(cs.paddingRight));
    }
    if (!text) return [];
    const name = `${el.tagName.toLowerCase()} "${text}"`, box = el.getBoundingClientRect(), [lo, hi] = cutBy(el);
    if (box.left < lo - 1 || box.right > hi + 1) return [`${name}: cut off by a box too narrow for it`];
    return need > el.clientWidth + 1 ? [`${name}: needs ${need} px, has ${el.clientWidth}`] : [];
  }); }"""


def _clipped_controls(page) -> list[str]:
    """Every widget output, scrolled into view (JupyterLab lays out off-screen cells lazily), checked with CLIPPED."""
    outputs = page.locator(".jp-OutputArea-output:has(.jupyter-widgets)")
    found = []
    for i in range(outputs.count()):
        out = outputs.nth(i)
        if not out.is_visible():
            continue
        out.scroll_into_view_if_needed()
        page.wait_for_timeout(200)
        found += out.evaluate(CLIPPED)
    return found


def _errors(cells: list[dict]) -> list[str]:
    return [f"cell [{c['n']}]: {o.get('ename')}: {o.get('evalue')}" for c in cells for o in c["outputs"]
            if o["output_type"] == "error"]


def _panels(page):
    """Top-level widget boxes that hold a measure button: the lesson's panels."""
    boxes = page.locator(".jp-OutputArea-output > .widget-vbox")
    return [boxes.nth(i) for i in range(boxes.count())
            if boxes.nth(i).locator(".widget-button", has_text="Measure").count()]


def _state(panel) -> tuple:
    """What a learner sees of a panel's prediction: its images and its words."""
    imgs = panel.locator("img")
    return tuple(imgs.nth(i).get_attribute("src") for i in range(imgs.count())), panel.inner_text()


def _change_a_control(page, panel) -> str:
    """Change one control of the panel (a drop-down's value, else a checkbox, else a slider, else a toggle
    button) so that the prediction redraws; return what was changed."""
    before = _state(panel)

    def redrew() -> bool:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if _state(panel) != before:
                return True
            page.wait_for_timeout(250)
        return False

    tried = []
    selects = panel.locator("select")
    if selects.count():
        select = selects.first
        current = select.input_value()
        for option in select.locator("option").all():
            value = option.get_attribute("value")
            if value == current:
                continue
            select.select_option(value=value)
            tried.append(option.inner_text())
            if redrew():
                return tried[-1]
    boxes = panel.locator("input[type=checkbox]")
    if boxes.count():
        boxes.first.click()
        tried.append("checkbox")
        if redrew():
            return "checkbox"
    handles = panel.locator(".noUi-handle")  # ipywidgets' sliders: the handle moves one step per arrow key
    if handles.count():
        handles.first.focus()
        handles.first.press("ArrowRight")
        tried.append("slider")
        if redrew():
            return "slider"
        handles.first.press("ArrowLeft")
        handles.first.press("ArrowLeft")
        if redrew():
            return "slider"
    toggles = panel.locator(".widget-toggle-button:not(.mod-active)")
    if toggles.count():
        label = toggles.first.inner_text()
        toggles.first.click()
        tried.append(label)
        if redrew():
            return label
    raise AssertionError(f"no control change redrew the panel (tried {tried or 'nothing: no control found'})")


def _final_10(page) -> None:
    """Lesson 10's layout panel (it predicts only: no measure button, and it says why) ends on its defaults, 2
    stages x 4 micro-batches, one bar per rank, not on the 16-rank layout its assert cell visits last."""
    boxes = page.locator(".jp-OutputArea-output > .widget-vbox", has_text="stages p")
    assert boxes.count() == 1, f"lesson 10 has one layout panel, found {boxes.count()}"
    boxes.first.scroll_into_view_if_needed()  # JupyterLab renders off-screen cells lazily: no text until seen
    page.wait_for_timeout(1000)
    text = boxes.first.inner_text()
    assert "no measure button" in text and "largest rank" in text, text
    assert "= 1/5 =" in text, f"not on the default p=2, m=4: {text}"
    assert boxes.first.locator("img").count() == 2, "the per-rank bars and the pipeline chart"


def _final_13(page) -> None:
    """Lesson 13 ends on a plan that fits and can be verified here (not on the 7B "no plan" its asserts visit),
    and its waterfall panel (section 8) answers a knob: unticking checkpointing redraws the bars."""
    panels = _panels(page)
    assert len(panels) == 1, f"lesson 13 has one planner panel, found {len(panels)}"
    # section 8 follows it, so Run All leaves it off-screen, where JupyterLab renders nothing: bring it back
    panels[0].evaluate("el => el.scrollIntoView({block: 'center'})")
    page.wait_for_timeout(1500)
    text = panels[0].text_content() or ""
    assert "best:" in text and "no plan" not in text and "verify is off" not in text, text
    assert panels[0].locator(".widget-button", has_text="Measure").first.is_enabled(), text
    falls = page.locator(".jp-OutputArea-output > .widget-vbox", has_text="activation checkpointing")
    assert falls.count() == 1, f"lesson 13 has one waterfall panel, found {falls.count()}"
    panel = falls.first
    panel.evaluate("el => el.scrollIntoView({block: 'center'})")  # JupyterLab renders off-screen cells lazily
    page.wait_for_timeout(1500)
    assert "fits" in (panel.text_content() or "") and panel.locator("img").count() == 1, panel.text_content()
    before = panel.locator("img").first.get_attribute("src")
    panel.locator(".widget-checkbox", has_text="activation checkpointing").locator("input").click()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and panel.locator("img").first.get_attribute("src") == before:
        page.wait_for_timeout(250)
    assert panel.locator("img").first.get_attribute("src") != before, "unticking a knob did not redraw the bars"
    assert "knobs taken out: activation checkpointing" in (panel.text_content() or ""), panel.text_content()


def _final_09(page) -> None:
    """Lesson 09 ends on its default: ZeRO-3 fits the demo budget, no run shown yet (no assert cell leaves a
    red verdict or a stale measurement behind)."""
    panels = _panels(page)
    assert len(panels) == 1, f"lesson 09 has one ZeRO panel, found {len(panels)}"
    text = panels[0].inner_text()
    assert "fits in" in text and "does not fit" not in text and "measured" not in text, text
    assert panels[0].locator(".widget-button", has_text="Measure").first.is_enabled(), text


def _measured_09(panel) -> None:
    """After a run: a verdict of "does not fit" comes with the ledger's out-of-memory, or with the sentence that
    says why the run fit anyway; never beside a plain green measurement."""
    text = panel.inner_text()
    if "does not fit" in text:
        assert "out of memory" in text or "although the prediction is over it" in text, text
    assert "measured" in text or "out of memory" in text, text


# what a lesson's panels show after Run All, before a control is touched: lesson stem -> check(page)
FINAL_STATE = {"09_data_parallel_zero": _final_09, "10_pipeline_tensor_parallel": _final_10, "13_planner": _final_13}
# what a lesson's panel shows after its measure button has run: lesson stem -> check(panel)
MEASURED_STATE = {"09_data_parallel_zero": _measured_09}


@pytest.mark.parametrize("lesson", LESSONS)
def test_lesson_runs_and_its_panels_respond(lab, lesson):
    browser, url, root = lab
    page = browser.new_page(viewport=WINDOW)
    try:
        stem = lesson.removesuffix(".ipynb")
        (EXECUTED / lesson).unlink(missing_ok=True)  # no stale copy survives a run that fails
        shutil.rmtree(EXECUTED / stem, ignore_errors=True)
        page.goto(f"{url}/lab/workspaces/{stem}/tree/{lesson}?reset")  # a fresh workspace: this lesson alone
        page.wait_for_function(f"""() => {{ const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
          return !!w && !!w.context && w.context.path === {lesson!r}; }}""", timeout=120_000, polling=500)
        page.wait_for_function(KERNEL_IDLE, timeout=180_000, polling=500)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_function(DONE, timeout=RUN_TIMEOUT_S * 1000, polling=1000)
        cells = page.evaluate(CELLS)
        assert not _errors(cells), _errors(cells)
        assert all(c["n"] is not None for c in cells), "some cells did not run"
        views = sum(1 for c in cells for o in c["outputs"]
                    if "application/vnd.jupyter.widget-view+json" in o.get("data", {}))
        _wait_for_widget_views(page, views)
        assert page.get_by_text("Error displaying widget").count() == 0
        assert page.locator(".jp-OutputArea-output .jupyter-widgets").count() >= views  # each view rendered
        if stem in FINAL_STATE:
            FINAL_STATE[stem](page)
        clipped = _clipped_controls(page)
        assert not clipped, f"{lesson}: controls whose text does not fit a {WINDOW['width']}-pixel window: {clipped}"
        _save_executed(page, root, lesson)
        _picture_views(page, EXECUTED / stem)
        SHOTS.mkdir(exist_ok=True)
        for i, panel in enumerate(_panels(page)):
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=str(SHOTS / f"{stem}_panel{i}_before.png"))
            changed = _change_a_control(page, panel)
            panel.screenshot(path=str(SHOTS / f"{stem}_panel{i}_after_{changed[:20].replace(' ', '_')}.png"))
            button = panel.locator(".widget-button", has_text="Measure").first
            if button.is_disabled():  # e.g. too big to measure here: the panel must say so
                assert "measure" in panel.inner_text().lower()
                continue
            imgs_before, text_before = panel.locator("img").count(), panel.inner_text()
            button.click()
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                text = panel.inner_text()
                said = text[len(text_before):] if text.startswith(text_before) else text
                if panel.locator("img").count() > imgs_before or (
                        text != text_before and any(w in said for w in ("fit", "out of memory", "failed", "Error"))
                        and not button.is_disabled()):
                    break
                page.wait_for_timeout(500)
            else:
                raise AssertionError(f"{lesson} panel {i}: the measure button showed nothing within 300 s")
            assert not any(w in panel.inner_text() for w in ("failed", "Error", "Traceback")), panel.inner_text()
            if stem in MEASURED_STATE:
                MEASURED_STATE[stem](panel)
            panel.screenshot(path=str(SHOTS / f"{stem}_panel{i}_measured.png"))
    finally:
        page.close()
        _shut_down_kernels(url)


def _shut_down_kernels(url: str) -> None:
    """One lesson's kernel at a time: shut down every kernel the server runs (its REST API)."""
    with urllib.request.urlopen(f"{url}/api/kernels", timeout=10) as r:
        kernels = json.load(r)
    for k in kernels:
        req = urllib.request.Request(f"{url}/api/kernels/{k['id']}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()
