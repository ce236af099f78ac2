"""What a reader sees: every page of the built book, opened by headless Chromium from file:// with the network
blocked. Each page must load nothing but local files, log no console error, render its formulas (MathJax
output, no raw TeX left), load every image, keep the text column within its width at 1280 px, and render
its widgets; chapter 5's explorer must also answer its slider. A screenshot of each page is saved.

And each page must read as a book's page does (book/_ext/book_pages.py and its stylesheet):

- nothing in the text column wider than the column: no code block, output, table, figure or image that runs
  past its right edge, nor one that hides part of itself behind a scroll bar or `overflow: hidden`;
- a line of 88 characters, the width the package's functions and the chapters' code are formatted to, fits
  every code block without wrapping;
- every image a figure with a caption (numbered by Sphinx), and alt text that says what it shows: not empty,
  not a file name;
- no character that a browser draws from a colour-emoji font (Debian's chromium has none by default and
  shows an empty box);
- glued values in the weight of the sentence around them (a glued verdict must not turn a sentence bold).

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

# Things in the text column that can be wider than it. An element is too wide when its right edge passes the
# column's content box, or when it is narrower than its own content (part of it behind a scroll bar or cut
# off by overflow: hidden).
TOO_WIDE_JS = """() => {
  const column = document.querySelector("article.bd-article") || document.querySelector("main");
  const style = getComputedStyle(column);
  const right = column.getBoundingClientRect().right - parseFloat(style.paddingRight);
  const label = e => `${e.tagName.toLowerCase()}.${[...e.classList].slice(0, 3).join(".")} ` +
    JSON.stringify((e.textContent || e.getAttribute("src") || "").trim().slice(0, 40));
  const found = [];
  for (const e of column.querySelectorAll(
      "pre, table, img, svg, figure, div.highlight, div.cell_output, div.output, .pst-scrollable-table-container, " +
      ".table-wrapper, .jupyter-widgets, mjx-container[display=true]")) {
    if (e.closest("mjx-container") && e.tagName.toLowerCase() !== "mjx-container") continue;
    const box = e.getBoundingClientRect();
    if (!box.width) continue;  // not shown (a widget view not selected, a collapsed cell)
    if (box.right > right + 1) found.push(`${label(e)} ends ${Math.round(box.right - right)} px past the column`);
    else if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== "visible")
      found.push(`${label(e)} hides ${e.scrollWidth - e.clientWidth} px of its content`);
  }
  return found;
}"""

# The package's functions and the chapters' code are formatted to 88 columns: a line that long must fit
# every code block without wrapping.
CODE_COLUMNS = 88
CODE_FITS_JS = """(columns) => [...document.querySelectorAll("article div.highlight pre")].filter(pre => {
  const probe = document.createElement("span");
  probe.textContent = "x".repeat(columns);
  pre.appendChild(probe);
  const s = getComputedStyle(pre);
  const room = pre.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight);
  const wide = probe.getBoundingClientRect().width > room + 0.5;
  probe.remove();
  return wide && pre.getBoundingClientRect().width;
}).slice(0, 3).map(pre => JSON.stringify(pre.textContent.trim().slice(0, 40)))"""

FIGURES_JS = r"""() => {
  const column = document.querySelector("article.bd-article") || document.querySelector("main");
  const problems = [];
  for (const img of column.querySelectorAll("img")) {
    const src = img.getAttribute("src") || "";
    const file = src.split("/").pop();
    const alt = (img.getAttribute("alt") || "").trim();
    const figure = img.closest("figure");
    const caption = figure && figure.querySelector("figcaption");
    if (!caption || !caption.textContent.trim()) problems.push(`image ${file} has no caption`);
    else if (!caption.querySelector(".caption-number")) problems.push(`figure of ${file} is not numbered`);
    if (!alt) problems.push(`image ${file} has no alt text`);
    else if (alt === src || alt.includes(file) || /\.(png|jpe?g|svg|gif)$/i.test(alt) || alt.split(/\s+/).length < 4)
      problems.push(`image ${file} has alt text that does not describe it: ${JSON.stringify(alt.slice(0, 60))}`);
  }
  return problems;
}"""

# Characters with emoji presentation by default (Unicode's Emoji_Presentation, and the variation selector that
# asks for it): a browser draws them from a colour-emoji font, which Debian's chromium lacks.
EMOJI = re.compile(
    "[\u231a\u231b\u23e9-\u23ec\u23f0\u23f3\u25fd\u25fe\u2614\u2615\u2648-\u2653\u267f\u2693\u26a1"
    "\u26aa\u26ab\u26bd\u26be\u26c4\u26c5\u26ce\u26d4\u26ea\u26f2\u26f3\u26f5\u26fa\u26fd\u2705"
    "\u270a\u270b\u2728\u274c\u274e\u2753-\u2755\u2757\u2795-\u2797\u27b0\u27bf\u2b1b\u2b1c\u2b50"
    "\u2b55\ufe0f\U0001f000-\U0001faff]"
)

TEXT_JS = """() => document.body.innerText + " " + [...document.querySelectorAll("[alt], [title]")]
  .map(e => (e.getAttribute("alt") || "") + " " + (e.getAttribute("title") || "")).join(" ")"""

# glued values (myst-nb's span.pasted-text) heavier than the text around them
BOLD_GLUE_JS = """() => [...document.querySelectorAll("span.pasted-text")]
  .filter(e => parseInt(getComputedStyle(e).fontWeight) > parseInt(getComputedStyle(e.parentElement).fontWeight))
  .slice(0, 5).map(e => e.textContent.slice(0, 60))"""

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

    problems += [f"wider than the text column at {WIDTH} px: {w}" for w in page.evaluate(TOO_WIDE_JS)]
    problems += [f"a line of {CODE_COLUMNS} characters wraps in the code block {t}"
                 for t in page.evaluate(CODE_FITS_JS, CODE_COLUMNS)]
    problems += page.evaluate(FIGURES_JS)
    emoji = sorted(set(EMOJI.findall(page.evaluate(TEXT_JS))))
    if emoji:
        problems.append("characters that need a colour-emoji font (an empty box here): "
                        + ", ".join(f"U+{ord(c):04X}" for c in emoji))
    problems += [f"glued value in bold inside plain text: {t!r}" for t in page.evaluate(BOLD_GLUE_JS)]

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
