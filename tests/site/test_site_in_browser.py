"""The HTML book (`make site`) in a real browser: headless Chromium opens its front page and three lesson pages
from file:// (no server, no network) and checks what a reader would see: the course map's table on the front
page with one row per lesson; on each lesson page every plot of the run it was built from, loaded and drawn at
a real size (and the browser test's panel pictures loaded), and no error output. `make test-site` builds the book,
then runs this file.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="make test-site installs playwright")

from labkit.course.lessons import read_lessons  # noqa: E402
from labkit.course.map import PROFILES  # noqa: E402
from labkit.course.site import SITE  # noqa: E402

HTML = SITE / "_build" / "html"
SRC = SITE / "src"  # the notebooks the pages were built from (labkit.course.site.prepare)
SHOTS = Path(__file__).parent / "screenshots"
MIN_SIDE_PX = 100  # a plot drawn smaller than this, or not loaded (0 x 0), is not a plot a reader can see

pytestmark = pytest.mark.browser

# each <img> in a cell's output: whether it loaded, its size in the file and on the page
IMAGES = """() => Array.from(document.querySelectorAll('.cell_output img')).map(i => ({
  src: i.getAttribute('src'), complete: i.complete, natural: [i.naturalWidth, i.naturalHeight],
  shown: [i.getBoundingClientRect().width, i.getBoundingClientRect().height]}))"""


def _chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("no Chromium found: install Debian's `chromium` (make test-site does) or set CHROMIUM=/path")
    return path


def _built() -> list[str]:
    """The lesson pages the book has, by notebook stem; fails (not skips) when the book was not built."""
    if not (HTML / "index.html").is_file():
        pytest.fail(f"no book at {HTML}: run `make site` (make test-site does) first")
    return sorted(p.stem for p in SRC.glob("[0-9][0-9]_*.ipynb") if (HTML / f"{p.stem}.html").is_file())


def _images(stem: str) -> tuple[int, int]:
    """(images, plots) among the outputs of the page's notebook: every PNG (the browser test's panel pictures
    too), and matplotlib's figures (a PNG beside the text "<Figure size ...>")."""
    nb = json.loads((SRC / f"{stem}.ipynb").read_text())
    data = [o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    pngs = [d for d in data if "image/png" in d]
    return len(pngs), sum("".join(d.get("text/plain", "")).startswith("<Figure size") for d in pngs)


def _three_pages() -> list[str]:
    """The three lesson pages with the most matplotlib figures, among those built (CI builds every lesson)."""
    pages = _built()
    return sorted(sorted(pages, key=lambda s: (-_images(s)[1], s))[:3])


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=_chromium(), headless=True,
                              args=["--no-sandbox"])  # root cannot use Chromium's sandbox
        yield b
        b.close()


def test_front_page_is_the_course_map(browser):
    pages = _built()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto((HTML / "index.html").as_uri())  # a redirect to intro.html, the book's root
        page.wait_for_url("**/intro.html", timeout=30_000)
        page.wait_for_load_state("load")
        tables = page.locator("article table")
        assert tables.count() >= 1, "no table on the front page"
        table = tables.first
        header = [h.strip() for h in table.locator("thead th").all_inner_texts()]
        assert header == ["lesson", "prerequisites", *PROFILES], header
        lessons = read_lessons()
        rows = table.locator("tbody tr").all_inner_texts()
        assert len(rows) == len(lessons), rows
        for row, lesson in zip(rows, lessons):
            assert row.startswith(f"{lesson.number} {lesson.title}"), (row, lesson)
        for stem in pages:  # each built lesson page is linked from the front page
            assert page.locator(f'article a[href="{stem}.html"]').count() >= 1, stem
        SHOTS.mkdir(exist_ok=True)
        page.screenshot(path=str(SHOTS / "front_page.png"), full_page=True)
    finally:
        page.close()


@pytest.mark.parametrize("rank", range(3))
def test_lesson_page_shows_its_plots(browser, rank):
    stems = _three_pages()
    assert len(stems) == 3, f"the book has {len(stems)} lesson pages, this test opens three: {stems}"
    stem = stems[rank]
    expected, plots = _images(stem)
    assert plots > 0, f"{stem}: its notebook has no matplotlib figure to look for"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto((HTML / f"{stem}.html").as_uri())
        page.wait_for_load_state("load")
        title = json.loads((SRC / f"{stem}.ipynb").read_text())["cells"][0]["source"]
        heading = "".join(title).splitlines()[0].lstrip("# ").strip()
        assert page.locator("article h1").first.inner_text().strip().startswith(heading[:20]), heading
        for img in page.locator(".cell_output img").all():  # lazy images load once scrolled to
            img.scroll_into_view_if_needed()
        page.wait_for_function("() => Array.from(document.images).every(i => i.complete)", timeout=30_000)
        images = page.evaluate(IMAGES)
        assert len(images) == expected, f"{stem}: {expected} images in its notebook, {len(images)} on the page"
        broken = [i for i in images if not i["complete"] or min(i["natural"]) == 0 or min(i["shown"]) == 0]
        assert not broken, f"{stem}: images not loaded or not shown: {broken}"
        drawn = [i for i in images if min(i["natural"]) >= MIN_SIDE_PX and min(i["shown"]) >= MIN_SIDE_PX]
        assert len(drawn) >= plots, (f"{stem}: {plots} matplotlib figures in its notebook, {len(drawn)} images "
                                     f"drawn at least {MIN_SIDE_PX} px a side: {images}")
        assert page.locator(".cell_output .traceback, .cell_output .output.error").count() == 0
        SHOTS.mkdir(exist_ok=True)
        page.locator(".cell_output img").first.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / f"{stem}_first_plot.png"))
    finally:
        page.close()
