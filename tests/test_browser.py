"""What a reader sees: every page of the built book, opened by headless Chromium from file:// with the network
blocked. Each page must load nothing but local files, log no console error, render its formulas (MathJax
output, no raw TeX left), load every image, keep the text column within its width at 1280 px, and render
its widgets; chapter 5's explorer must also answer its slider. A screenshot of each page is saved.

Run after the book build, which `make test` does (`make browser-test` on an existing build):
    QMTP_BOOK_HTML=_build/html QMTP_SCREENSHOTS=_build/screenshots pytest tests/test_browser.py
Without QMTP_BOOK_HTML (the plain `pytest` run before the book exists) the page tests skip themselves;
given it, a missing build, Playwright or Chromium fails them.
"""

from __future__ import annotations

import os
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest

BOOK_HTML = os.environ.get("QMTP_BOOK_HTML")
SCREENSHOTS = os.environ.get("QMTP_SCREENSHOTS")
CHROMIUM = os.environ.get("QMTP_CHROMIUM", "/usr/bin/chromium")
# Debian's chromium as root in a container: no sandbox, no GPU, and none of its own background traffic
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
WIDTH, HEIGHT = 1280, 900
EXPLORER_PAGE = "notebooks/05_mtp_decoding.html"
# generated folders of the build, not pages
NOT_PAGES = {"_static", "_sources", "_images", "_sphinx_design_static"}
WIDGET_VIEW = 'script[type="application/vnd.jupyter.widget-view+json"]'

pytestmark = pytest.mark.skipif(
    not BOOK_HTML, reason="set QMTP_BOOK_HTML=_build/html to read the built book (make browser-test does)"
)


def book_root() -> Path:
    return Path(BOOK_HTML).resolve()


def page_names() -> list[str]:
    if not BOOK_HTML or not Path(BOOK_HTML, "index.html").is_file():
        return []
    root = book_root()
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*.html") if p.relative_to(root).parts[0] not in NOT_PAGES
    )


def test_the_book_is_built():
    assert Path(BOOK_HTML, "index.html").is_file(), f"{BOOK_HTML}/index.html is missing: run `make book` first"
    assert EXPLORER_PAGE in page_names(), f"{EXPLORER_PAGE} is missing from {BOOK_HTML}"


class _AssetRefs(HTMLParser):
    """The URLs a page's markup makes the browser fetch: scripts, stylesheets and fonts, images, frames."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("script", "img", "iframe", "source", "audio", "video", "embed") and a.get("src"):
            self.urls.append(a["src"])
        if tag == "link" and a.get("href") and (a.get("rel") or "") not in ("canonical", "next", "prev"):
            # stylesheets, preloaded fonts and scripts, icons; plain links between pages are <a>, not <link>
            self.urls.append(a["href"])


EXTERNAL = re.compile(r"^\s*(https?:)?//", re.I)
CSS_URL = re.compile(r"""(?:@import\s+(?:url\()?|url\()\s*["']?([^"')\s;]+)""", re.I)
CSS_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def external_asset_urls(root: Path) -> list[str]:
    """Every external URL in a script/img/link of an HTML page or in an @import/url() of a stylesheet."""
    found = []
    for page in sorted(root.rglob("*.html")):
        refs = _AssetRefs()
        refs.feed(page.read_text(errors="replace"))
        found += [f"{page.relative_to(root)}: {u}" for u in refs.urls if EXTERNAL.match(u)]
    for css in sorted(root.rglob("*.css")):
        text = CSS_COMMENT.sub("", css.read_text(errors="replace"))
        found += [f"{css.relative_to(root)}: {u}" for u in CSS_URL.findall(text) if EXTERNAL.match(u)]
    return found


def test_no_page_or_stylesheet_names_an_external_asset():
    external = external_asset_urls(book_root())
    assert not external, f"{len(external)} external asset URLs:\n" + "\n".join(external)


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} is missing: apt-get install -y chromium (make test-deps)"
    with sync_playwright() as playwright:
        # a fresh profile: nothing cached, nothing in localStorage, as for a first-time reader
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=CHROMIUM,
            args=CHROMIUM_FLAGS,
            headless=True,
            viewport={"width": WIDTH, "height": HEIGHT},
            service_workers="block",
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def screenshot_dir():
    folder = Path(SCREENSHOTS) if SCREENSHOTS else book_root().parent / "screenshots"
    shutil.rmtree(folder, ignore_errors=True)  # no screenshot of a page that no longer exists
    folder.mkdir(parents=True)
    return folder


class Reading:
    """One page as the browser loaded it, and everything that went wrong while it did."""

    def __init__(self, context, name: str):
        self.name = name
        self.problems: list[str] = []
        self.page = page = context.new_page()
        page.set_default_timeout(30_000)
        page.route("**/*", self._only_local_files)
        page.on("console", lambda m: m.type == "error" and self.problems.append(f"console error: {m.text}"))
        page.on("pageerror", lambda e: self.problems.append(f"uncaught exception: {e}"))
        page.on("requestfailed", self._failed)
        page.goto((book_root() / name).as_uri(), wait_until="load")

    def _only_local_files(self, route):
        url = route.request.url
        if url.startswith(("file://", "data:", "blob:")):
            route.continue_()
        else:
            self.problems.append(f"external request (blocked): {url}")
            route.abort()

    def _failed(self, request):
        if request.url.startswith("file://"):
            self.problems.append(f"missing local file: {request.url} ({request.failure})")


# page scripts that wait give up after 15 s: a promise that never settles must fail the page, not hang the test
WITHIN = "(p) => Promise.race([p, new Promise(r => setTimeout(r, 15000))])"

IMAGES_JS = """async () => {
  const within = %s;
  const images = [...document.images];
  images.forEach(i => { i.loading = "eager"; });
  await within(Promise.all(images.map(i => i.decode().catch(() => null))));
  return images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.getAttribute("src"));
}""" % WITHIN

MATH_JS = """async () => {
  const within = %s;
  const math = document.querySelectorAll(".math");
  if (!math.length) return {math: 0};
  if (!window.MathJax) return {math: math.length, noMathJax: true};
  await within(MathJax.startup.promise);
  const unrendered = [...math].filter(m => !m.querySelector("mjx-container")).map(m => m.textContent.slice(0, 60));
  const errors = [...document.querySelectorAll("mjx-merror")].map(m => m.textContent.slice(0, 60));
  // TeX delimiters left in prose (code blocks may show them on purpose)
  const article = document.querySelector("article") || document.body;
  const prose = article.cloneNode(true);
  prose.querySelectorAll("pre, code, script, style, mjx-container").forEach(e => e.remove());
  const raw = (prose.textContent.match(/\\\\\\(|\\\\\\[|\\$\\$/g) || []).length;
  return {math: math.length, unrendered, errors, raw};
}""" % WITHIN

OVERFLOW_JS = """() => {
  const column = document.querySelector("article.bd-article") || document.querySelector("main");
  const right = column.getBoundingClientRect().right;
  const clipped = e => {
    for (let a = e.parentElement; a && a !== column; a = a.parentElement) {
      if (["auto", "scroll", "hidden", "clip"].includes(getComputedStyle(a).overflowX)) return true;
    }
    return false;
  };
  const wide = [...column.querySelectorAll("*")]
    .filter(e => e.getBoundingClientRect().right > right + 1 && !clipped(e))
    .slice(0, 5)
    .map(e => `${e.tagName.toLowerCase()}.${[...e.classList].join(".")} (${Math.round(e.getBoundingClientRect().right - right)} px)`);
  return {page: document.documentElement.scrollWidth - window.innerWidth, column: column.scrollWidth - column.clientWidth, wide};
}"""

WIDGETS_JS = """() => {
  const views = document.querySelectorAll('%s');
  const rendered = [...views].filter(s => s.parentElement.querySelector(".jupyter-widgets")).length;
  return {views: views.length, rendered};
}""" % WIDGET_VIEW


def check_page(reading: Reading) -> None:
    page, problems = reading.page, reading.problems
    broken = page.evaluate(IMAGES_JS)
    problems += [f"image not loaded: {src}" for src in broken]

    math = page.evaluate(MATH_JS)
    if math.get("noMathJax"):
        problems.append(f"{math['math']} formulas but no MathJax on the page")
    elif math["math"]:
        problems += [f"formula not rendered: {t!r}" for t in math["unrendered"]]
        problems += [f"TeX error in formula: {t!r}" for t in math["errors"]]
        if math["raw"]:
            problems.append(f"{math['raw']} raw TeX delimiters left in the text")

    widgets = page.evaluate(WIDGETS_JS)
    if widgets["views"]:
        try:
            page.wait_for_function(f"""() => [...document.querySelectorAll('{WIDGET_VIEW}')]
                .every(s => s.parentElement.querySelector(".jupyter-widgets"))""", timeout=15_000)
        except Exception:
            widgets = page.evaluate(WIDGETS_JS)
            problems.append(f"{widgets['views'] - widgets['rendered']} of {widgets['views']} widgets not rendered")

    overflow = page.evaluate(OVERFLOW_JS)
    if overflow["page"] > 0 or overflow["column"] > 1 or overflow["wide"]:
        problems.append(
            f"horizontal overflow at {WIDTH} px: page {overflow['page']} px, text column {overflow['column']} px; "
            f"widest: {', '.join(overflow['wide'])}"
        )


# what the explorer's HTML views show: only the visible ones (a view per step, one shown, is a valid design)
SHOWN_TEXT_JS = """() => [...document.querySelectorAll(".jupyter-widgets .widget-html-content")]
  .filter(e => e.offsetParent !== null).map(e => e.innerHTML).join("")"""


def check_explorer(reading: Reading) -> None:
    """Chapter 5's explorer: a slider over trunk passes; moving it must change the text it shows."""
    page, problems = reading.page, reading.problems
    slider = page.locator(".jupyter-widgets.widget-slider").first
    if not slider.count():
        problems.append("chapter 5's explorer has no slider")
        return
    readout = slider.locator(".widget-readout")
    before_value, before_text = readout.inner_text(), page.evaluate(SHOWN_TEXT_JS)
    handle = slider.locator(".noUi-handle")
    handle.focus()
    handle.press("Home")  # noUiSlider's keyboard handling: to the minimum
    page.wait_for_timeout(300)
    after_value, after_text = readout.inner_text(), page.evaluate(SHOWN_TEXT_JS)
    if after_value == before_value:
        problems.append(f"explorer slider did not move (readout stayed {before_value})")
    elif after_text == before_text:
        problems.append(
            f"explorer did not respond: slider moved {before_value} -> {after_value}, the text it shows stayed the same"
        )
    handle.press("End")
    page.wait_for_timeout(300)


def redirect_target(name: str) -> str | None:
    """Where a page sends the reader at once (Sphinx's index.html is only a meta refresh to the root page)."""
    found = re.search(r'http-equiv="Refresh" content="0; url=([^"]+)"', (book_root() / name).read_text(), re.I)
    return found and found.group(1)


@pytest.mark.parametrize("name", page_names())
def test_page_reads_offline(name, browser_context, screenshot_dir):
    target = redirect_target(name)
    reading = Reading(browser_context, name)
    try:
        if target:
            landing = (book_root() / name).parent.joinpath(target).resolve().as_uri()
            reading.page.wait_for_url(landing, timeout=15_000)
        check_page(reading)
        if name == EXPLORER_PAGE:
            if not reading.page.locator(WIDGET_VIEW).count():
                reading.problems.append("chapter 5 shows no explorer widget")
            else:
                check_explorer(reading)
        reading.page.screenshot(path=str(screenshot_dir / (name.replace("/", "__")[: -len(".html")] + ".png")),
                                full_page=True)
    finally:
        reading.page.close()
    assert not reading.problems, f"{name}:\n  " + "\n  ".join(reading.problems)
