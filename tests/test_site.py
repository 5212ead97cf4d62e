"""The course site: it builds with `mkdocs build --strict`, and chapter 01 reads correctly in a real browser.

The site is built into a temporary folder, served from 127.0.0.1 by Python's http.server, and opened in headless
Chromium (Debian's `chromium` package) driven by Playwright. Every request that leaves 127.0.0.1 is refused and
recorded, so the result is the same with or without a network, and a page that reaches out (a font service, a
math script from a CDN) is caught: the math is MathML rendered at build time (docs/hooks.py), drawn natively.

Without Chromium the browser tests skip, with the install command as the reason; under CI=true a missing
Chromium or Playwright is a failure.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import unquote, urljoin, urlsplit

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
CHAPTER_01 = ROOT / "chapters" / "01_naive_attention" / "01_naive_attention.ipynb"
CHAPTER_01_PAGE = "chapters/01_naive_attention/01_naive_attention.html"  # use_directory_urls: false
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 15_000
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def _missing_tool(reason: str) -> NoReturn:
    """Skip on a learner's machine; fail in CI, where every tool must be installed."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: a missing tool fails the run instead of skipping)")
    pytest.skip(reason)


def _find_chromium() -> str | None:
    for candidate in CHROMIUM_CANDIDATES:
        path = shutil.which(candidate)
        if path:
            return path
    return None


# ---------------------------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    site_dir = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, not a build warning
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--clean", "--site-dir", str(site_dir)],
        cwd=ROOT,
        check=False,  # the exit status is the test's to judge
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, site_dir


@pytest.fixture(scope="module")
def site(build: tuple[subprocess.CompletedProcess[str], Path]) -> Path:
    proc, site_dir = build
    if proc.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {proc.returncode}); see test_site_builds_strict")
    return site_dir


def test_site_builds_strict(build: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, site_dir = build
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{log}"
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert not warnings, "mkdocs build printed warnings:\n" + "\n".join(warnings)
    assert (site_dir / "index.html").is_file()
    # Only notebooks and their images are published from chapters/: no test files, no hooks, no caches.
    python_files = sorted(p.relative_to(site_dir).as_posix() for p in site_dir.rglob("*.py"))
    assert not python_files, f"Python files were published with the site: {python_files}"
    assert not list(site_dir.rglob("__pycache__")), "a __pycache__ folder was published with the site"


class _LinkCollector(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"a": "href", "img": "src", "link": "href", "script": "src"}.get(tag)
        for name, value in attrs:
            if name == wanted and value:
                self.targets.append(value)


def test_notebook_pages_have_no_broken_links(site: Path) -> None:
    """`mkdocs build --strict` checks the links of Markdown pages only; a notebook page is HTML from nbconvert.

    A relative link in a notebook (to an image beside it, or to `../../solutions/...`) must point at a file that
    the site publishes.
    """
    pages = sorted(site.glob("chapters/**/*.html"))
    assert pages, "the site has no chapter pages"
    broken = []
    for page_path in pages:
        collector = _LinkCollector()
        collector.feed(page_path.read_text(encoding="utf-8"))
        for target in collector.targets:
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or not parts.path:  # external, data:, or a #fragment on this page
                continue
            if not (page_path.parent / unquote(parts.path)).resolve().exists():
                broken.append(f"{page_path.relative_to(site).as_posix()}: {target}")
    assert not broken, "links to files the site does not publish:\n" + "\n".join(broken)


# ---------------------------------------------------------------------------------------------------------------
# Server and browser
# ---------------------------------------------------------------------------------------------------------------


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # keep the test output readable
        pass


@pytest.fixture(scope="module")
def site_url(site: Path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: any free port
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="site-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing_tool("the playwright package is not installed: pip install -r requirements.txt")
    chromium = _find_chromium()
    if chromium is None:
        _missing_tool("Chromium is not installed (Debian/Ubuntu: sudo apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser: Any, site_url: str) -> Iterator[Any]:
    """A fresh tab that may reach only the test server.

    Uncaught script errors collect in `page.errors`, refused requests (anything not on the test server) in
    `page.blocked`.
    """
    context = browser.new_context()
    blocked: list[str] = []

    def only_local(route: Any) -> None:
        url = route.request.url
        if url.startswith((site_url, "data:")):
            route.continue_()
        else:
            blocked.append(url)
            route.abort()

    context.route("**/*", only_local)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.set_default_navigation_timeout(TIMEOUT_MS)
    page.errors = []
    page.blocked = blocked
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    try:
        yield page
    finally:
        context.close()


@pytest.fixture
def chapter_01_url(site_url: str) -> str:
    if not CHAPTER_01.is_file():
        pytest.fail(f"{CHAPTER_01.relative_to(ROOT)} does not exist: the site tests read chapter 01's page")
    return site_url + CHAPTER_01_PAGE


def _heading_text(locator: Any) -> str:
    return locator.inner_text().replace("¶", "").strip()  # drop the permalink anchor


# The article's text outside code and outside rendered formulas: where leftover TeX would show. Hidden text (a
# closed hint) counts too: opening it must not reveal raw TeX either.
_PROSE_TEXT_JS = """() => {
  const walker = document.createTreeWalker(document.querySelector("article"), NodeFilter.SHOW_TEXT);
  const parts = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.parentElement.closest("pre, code, math, script, style")) parts.push(node.nodeValue);
  }
  return parts.join("");
}"""
_RAW_TEX = re.compile(r"\\[(\[]|\$[^$]+\$|\\(?:frac|sqrt|mathrm|text|begin|cdot)\b")


def _raw_tex(text: str) -> list[str]:
    """Pieces of `text` that are TeX a browser would show as typed: `\\(`, `\\[`, `$...$`, or a TeX command."""
    return sorted({match.group(0)[:80] for match in _RAW_TEX.finditer(text)})


# ---------------------------------------------------------------------------------------------------------------
# Chapter 01
# ---------------------------------------------------------------------------------------------------------------


def test_chapter_01_shows_its_headings(page: Any, chapter_01_url: str) -> None:
    page.goto(chapter_01_url, wait_until="load")
    h1 = page.locator("article h1").first
    h1.wait_for(state="visible")
    title = _heading_text(h1)
    assert title, "chapter 01's h1 is empty"
    assert title in page.title(), f"the browser title {page.title()!r} does not name the chapter {title!r}"

    h2s = page.locator("article h2")
    assert h2s.count() >= 3, f"expected at least 3 sections (h2) on chapter 01's page, found {h2s.count()}"
    for i in range(h2s.count()):
        assert h2s.nth(i).is_visible(), f"h2 {_heading_text(h2s.nth(i))!r} is not visible"
    # The table of contents in the sidebar lists the sections too.
    first_section = _heading_text(h2s.first)
    assert page.locator(".md-sidebar--secondary .md-nav__link", has_text=first_section).count() >= 1
    assert page.errors == [], f"script errors on chapter 01's page: {page.errors}"


def test_chapter_01_code_cells_render(page: Any, chapter_01_url: str) -> None:
    page.goto(chapter_01_url, wait_until="load")
    code = page.locator("article .jp-CodeCell .jp-InputArea pre")
    assert code.count() >= 1, "no code cells on chapter 01's page"
    code.first.wait_for(state="visible")
    source = "\n".join(code.all_inner_texts())
    assert re.search(r"^\s*(import|from|def|class)\s", source, re.MULTILINE), (
        f"the code cells do not look like Python:\n{source[:500]}"
    )
    assert code.first.locator("span").count() > 0, "the code cells are not syntax-highlighted"


def test_chapter_01_plot_is_shown(page: Any, chapter_01_url: str) -> None:
    page.goto(chapter_01_url, wait_until="load")
    images = page.locator("article .jp-OutputArea-output img")
    assert images.count() >= 1, "no image among chapter 01's stored outputs: the notebook must keep its plots"
    page.wait_for_function(
        """() => [...document.querySelectorAll("article .jp-OutputArea-output img")]
                   .some(img => img.complete && img.naturalWidth > 0)""",
        timeout=TIMEOUT_MS,
    )
    visible = [i for i in range(images.count()) if images.nth(i).is_visible()]
    assert visible, "chapter 01's plot images are hidden"


def test_chapter_01_notebook_can_be_downloaded(page: Any, chapter_01_url: str) -> None:
    page.goto(chapter_01_url, wait_until="load")
    button = page.locator('article a[download][href$=".ipynb"]')
    assert button.count() == 1, "chapter 01's page has no download button for its notebook"
    href = button.get_attribute("href")
    response = page.request.get(urljoin(chapter_01_url, href))
    assert response.ok, f"downloading {href} answered {response.status}"
    assert "cells" in response.json(), f"{href} is not a notebook"


def test_chapter_01_math_is_rendered_offline(page: Any, chapter_01_url: str) -> None:
    """The notebook's formulas arrive as MathML, which Chromium lays out itself: no script, no network.

    Every request off 127.0.0.1 is refused, so a formula that needed a CDN would be left as raw TeX here.
    """
    page.goto(chapter_01_url, wait_until="load")
    assert page.blocked == [], f"chapter 01's page asked for files off the site: {page.blocked}"
    assert page.locator('script[type="text/x-mathjax-config"]').count() == 0, "nbconvert's MathJax loader is back"
    assert page.locator('script[src*="mathjax" i], script[src*="katex" i]').count() == 0, "a math script is loaded"

    notebook = json.loads(CHAPTER_01.read_text(encoding="utf-8"))
    source = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    display_in_source = len(re.findall(r"\$\$.+?\$\$", source, re.DOTALL))
    assert display_in_source >= 1 and "$" in source.replace("$$", ""), "chapter 01 has no inline and display math"
    formulas = page.locator("article .jp-RenderedMarkdown math")
    display = page.locator('article .jp-RenderedMarkdown math[display="block"]')
    assert display.count() == display_in_source, (
        f"{display_in_source} display formulas ($$...$$) in chapter 01's Markdown cells, {display.count()} rendered"
    )
    assert formulas.count() > display.count(), "no inline formula ($...$) rendered on chapter 01's page"

    # Laid out as math by the browser, not shown as text: a MathML display box, a fraction taller than a line.
    kinds = page.evaluate("() => [...document.querySelectorAll('article math')].map(m => getComputedStyle(m).display)")
    assert set(kinds) <= {"math", "inline math", "block math"}, f"math elements not laid out as MathML: {set(kinds)}"
    fraction = page.locator('article math[display="block"]:has(mfrac)').first
    fraction.scroll_into_view_if_needed()
    box = fraction.bounding_box()
    line = page.evaluate("() => parseFloat(getComputedStyle(document.querySelector('article p')).lineHeight)")
    assert box and box["height"] > 1.5 * line, f"a display fraction is {box} high, a line of text {line}px"

    leftover = _raw_tex(page.evaluate(_PROSE_TEXT_JS))
    assert not leftover, f"raw TeX in chapter 01's text: {leftover}"
    assert page.errors == [], f"script errors on chapter 01's page: {page.errors}"


def _load_hooks() -> Any:
    spec = importlib.util.spec_from_file_location("site_hooks", ROOT / "docs" / "hooks.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_math_is_rendered_only_where_tex_may_be(caplog: pytest.LogCaptureFixture) -> None:
    """The hook converts TeX in Markdown cells and arithmatex formulas; code, and everything else, stays as it is."""
    render_math = _load_hooks().render_math
    cell = (
        '<div class="jp-RenderedHTMLCommon jp-RenderedMarkdown" data-mime-type="text/markdown">'
        "<p>$a &lt; b$, <code>$x$</code> and</p><div><p>$$\\frac{1}{2}$$</p></div></div>"
        '<div class="jp-OutputArea-output"><pre>$y$</pre>$z$</div>'
        '<p><span class="arithmatex">\\(K\\)</span></p>'
    )
    out = render_math(cell)
    assert "<math><mi>a</mi><mo>&lt;</mo><mi>b</mi></math>" in out, out
    assert '<math display="block"><mfrac>' in out, out
    assert "<code>$x$</code>" in out and "<pre>$y$</pre>$z$" in out, "TeX outside a Markdown cell was converted"
    assert '<span class="arithmatex"><math><mi>K</mi></math></span>' in out, out

    with caplog.at_level(logging.WARNING):
        broken = render_math('<div class="arithmatex">\\[\\frac{1}{\\]</div>', "broken.md")
    assert "\\frac{1}{" in broken, "a formula that does not convert must stay as it was"
    assert any("broken.md" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), (
        "a formula that does not convert must be a warning (so `mkdocs build --strict` fails)"
    )


# ---------------------------------------------------------------------------------------------------------------
# Home page
# ---------------------------------------------------------------------------------------------------------------


def test_home_page_links_to_chapter_01(page: Any, site_url: str, chapter_01_url: str) -> None:
    page.goto(site_url, wait_until="load")
    page.locator("article h1").first.wait_for(state="visible")
    course_map = page.locator("article").inner_text()
    for chapter in (
        "Naive attention",
        "Contiguous KV cache",
        "Block manager",
        "Copy-on-write and prefix sharing",
        "Continuous batching",
        "Triton paged attention",
    ):
        assert chapter in course_map, f"the course map does not list {chapter!r}"
    # The set-up commands (install, test), each with Material's copy button.
    commands = page.locator("article pre:has(code)")
    assert commands.count() >= 2, "the home page does not show the install and test commands"
    copy_buttons = page.locator('article pre button[data-md-type="copy"]')
    copy_buttons.nth(1).wait_for(state="attached")  # Material's script adds them after the page loads
    assert copy_buttons.count() >= 2, "the commands have no copy button"

    # The home page's formulas (pymdownx.arithmatex): rendered, not left as TeX.
    assert page.locator('article .arithmatex math[display="block"]').count() >= 1, "no display formula rendered"
    assert page.locator("article .arithmatex math:not([display])").count() >= 1, "no inline formula rendered"
    leftover = _raw_tex(page.evaluate(_PROSE_TEXT_JS))
    assert not leftover, f"raw TeX in the home page's text: {leftover}"
    assert page.blocked == [], f"the home page asked for files off the site: {page.blocked}"

    link = page.locator(f'article a[href$="{CHAPTER_01_PAGE}"]')
    assert link.count() >= 1, "the home page has no link to chapter 01"
    link.first.click()
    page.wait_for_url(chapter_01_url)
    page.locator("article h1").first.wait_for(state="visible")
    assert page.errors == [], f"script errors: {page.errors}"
