"""Look at every page of the built docs as a reader does, in headless Chromium.

Each page is loaded at 1280 px (a laptop) and at 390 px (a phone), and once more at 390 px
after a resize from 1280 px (the code-wrapping script must follow a resize, not only a
load). A page fails where:

- the page itself scrolls sideways;
- a table, code block, signature, image or paragraph sticks out of the text column, or is
  clipped without a scroll bar of its own;
- at 1280 px, a table, an API signature, or a block of an error message, a command or
  its output needs a scroll bar of its own (at 390 px they may scroll inside themselves;
  a Python example may at both widths);
- an identifier in the text breaks mid-word (it may wrap at a joint: ".", "_", "/", ...);
- an image does not load;
- a link to another page of the site, or an anchor on one, leads nowhere.

A message or command whose source lines are wider than the column at 1280 px, and wrap
raggedly there, is printed as a NOTE (rewrap it to 80 columns), not a failure.

Screenshots of the nav's pages at both widths go to ``--shots`` (docs-shots/ by default,
ignored by git) for a person to look at.

Usage::

    python scripts/docs_browser_check.py               # builds the site first (mkdocs)
    python scripts/docs_browser_check.py --site SITE   # a site already built

It needs Debian's ``chromium`` and ``chromium-driver`` (``apt-get install chromium
chromium-driver``) and selenium (the ``docs`` extra). Exit status 1 lists every failure.
"""

from __future__ import annotations

import argparse
import base64
import functools
import html.parser
import http.server
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

HEIGHT = 900
# From this width on, tables, signatures, messages and commands fit their column.
DESKTOP = 1000

# Run in the page: every layout problem, as a list of strings.
CHECK_JS = r"""
const desktop = arguments[0];
const problems = [];
const describe = (el) => {
  let name = el.tagName.toLowerCase();
  if (el.id) name += "#" + el.id;
  else if (el.classList.length) name += "." + [...el.classList].slice(0, 2).join(".");
  let heading = null;
  for (let node = el; node && !heading; node = node.previousElementSibling || node.parentElement) {
    if (/^H[1-6]$/.test(node.tagName)) heading = node;
  }
  const text = (el.innerText || el.getAttribute("src") || "").trim().replace(/\s+/g, " ");
  const under = heading ? ` under "${heading.innerText.replace(/\s*¶$/, "").trim()}"` : "";
  return `${name}${under} ("${text.slice(0, 60)}")`;
};
const root = document.documentElement;
if (root.scrollWidth > root.clientWidth + 1) {
  problems.push(`the page scrolls sideways: ${root.scrollWidth} px wide in ${root.clientWidth} px`);
}
const column = document.querySelector(".md-content");
const right = column.getBoundingClientRect().right;
const scrolls = (style) => ["auto", "scroll"].includes(style.overflowX);
const clips = (style) => ["hidden", "clip"].includes(style.overflowX);
// At 1280 px a Python example may scroll inside itself (its lines are code, wrapped as code);
// a table, a signature, an error message or a command must fit.
const mayScroll = (el) => {
  const block = el.closest(".highlight");
  return block !== null && !block.classList.contains("doc-signature") &&
    /\blanguage-(python|py|pycon)\b/.test(block.className);
};
const selector = [
  "table", "pre", "pre > code", ".md-typeset__scrollwrap", ".highlight", "img", "p", "li",
  "h1", "h2", "h3", "h4", ".admonition", ".doc-signature", "blockquote", "dl",
].map((s) => `.md-content ${s}`).join(", ");
for (const el of document.querySelectorAll(selector)) {
  const style = getComputedStyle(el);
  if (style.display === "none" || el.getClientRects().length === 0) continue;
  const over = el.scrollWidth - el.clientWidth;
  if (over > 1 && clips(style)) {
    problems.push(`clipped without a scroll bar by ${over} px: ${describe(el)}`);
  } else if (over > 1 && scrolls(style) && desktop && !mayScroll(el)) {
    problems.push(
      `scrolls sideways (${el.scrollWidth} px in ${el.clientWidth} px): ${describe(el)}`);
  }
  // Whatever sits inside something that scrolls or clips is that container's business.
  let inside = false;
  for (let p = el.parentElement; p && p !== column; p = p.parentElement) {
    const s = getComputedStyle(p);
    if (scrolls(s) || clips(s)) { inside = true; break; }
  }
  const sticks = el.getBoundingClientRect().right - right;
  if (!inside && sticks > 1) {
    problems.push(`sticks out of the column by ${Math.round(sticks)} px: ${describe(el)}`);
  }
}
// An identifier that wraps must wrap at a joint (after ".", "_", "/", ",", "-", or before
// an opening bracket), never mid-word: `wait_strea` on one line and `m` on the next. A word
// wider than the whole line (a commit hash on a phone) has to break somewhere.
const joint = /[\s._/([,-]/;
for (const code of document.querySelectorAll(".md-content :not(pre) > code")) {
  if (code.getClientRects().length < 2) continue;
  const chars = [];  // [character, top, bottom, width]
  const walker = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
  for (let node; (node = walker.nextNode()); ) {
    for (let i = 0; i < node.data.length; i++) {
      const range = document.createRange();
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      const rect = range.getBoundingClientRect();
      chars.push([node.data[i], rect.top, rect.bottom, rect.width]);
    }
  }
  const style = getComputedStyle(code);
  const padding = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight);
  const line = code.parentElement.clientWidth - padding;
  chars.forEach(([character, top, , width], i) => {
    if (/\s/.test(character) || width === 0) return;
    let before = i - 1;  // the last character with a place on a line
    while (before >= 0 && chars[before][3] === 0 && !/\s/.test(chars[before][0])) before--;
    if (before >= 0 && top >= chars[before][2] - 1 && !joint.test(chars[before][0]) &&
        !/[([{]/.test(character)) {
      let start = before, end = i;  // the word around the break, from joint to joint
      while (start > 0 && !joint.test(chars[start - 1][0])) start--;
      while (end < chars.length - 1 && !joint.test(chars[end + 1][0])) end++;
      const wide = chars.slice(start, end + 1).reduce((sum, c) => sum + c[3], 0);
      if (wide <= line) {
        problems.push(
          `an identifier breaks mid-word ("${chars[before][0]}|${character}"): ${describe(code)}`);
      }
    }
  });
}
for (const img of document.querySelectorAll("img")) {
  if (!img.complete || img.naturalWidth === 0) {
    problems.push(`image did not load: ${img.getAttribute("src")}`);
  }
}
// Not a failure, a note: a message or a command whose source lines are longer than the
// column at 1280 px wraps them raggedly (rewrap its source to 80 columns).
if (desktop) {
  for (const code of document.querySelectorAll(
      ".md-content .language-text pre > code, .md-content .language-bash pre > code")) {
    const lines = code.textContent.replace(/\n$/, "").split("\n").length;
    const style = getComputedStyle(code);
    const height = code.clientHeight - parseFloat(style.paddingTop) -
      parseFloat(style.paddingBottom);
    const shown = Math.round(height / parseFloat(style.lineHeight));
    if (shown > lines) {
      problems.push(`NOTE ${lines} source lines shown as ${shown}: ${describe(code)}`);
    }
  }
}
return problems;
"""

LINKS_JS = r"""
return [...document.querySelectorAll("a[href]")].map((a) => a.href);
"""


class _Ids(html.parser.HTMLParser):
    """The ids (and anchor names) of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for key, value in attrs:
            if key == "id" or (tag == "a" and key == "name"):
                self.ids.add(value or "")


@functools.cache
def _page_ids(url: str) -> set[str] | None:
    """The ids of the page at ``url``, or ``None`` when it does not load."""
    try:
        with urllib.request.urlopen(url) as response:
            text = response.read().decode("utf-8", "replace")
    except urllib.error.URLError:
        return None
    parser = _Ids()
    parser.feed(text)
    return parser.ids


def _broken_links(hrefs: list[str], origin: str) -> Iterator[str]:
    for href in sorted(set(hrefs)):
        if not href.startswith(origin):
            continue  # another site: CI cannot reach it
        target, _, fragment = href.partition("#")
        ids = _page_ids(target)
        if ids is None:
            yield f"broken link: {href[len(origin) :]}"
        elif fragment and urllib.parse.unquote(fragment) not in ids:
            yield f"broken anchor: {href[len(origin) :]}"


def _serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _driver() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start. The rest keep
    # it off the network (CI reaches none but the package indexes) and off /dev/shm.
    flags = (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        # Offline, as in CI: the theme's web fonts never load, the same fallback fonts lay
        # out every run.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    )
    for flag in flags:
        options.add_argument(flag)
    options.add_argument(f"--window-size=1280,{HEIGHT}")
    # Debian's driver, named, so that selenium does not try to download one.
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def _set_width(driver: webdriver.Chrome, width: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": width < DESKTOP},
    )


def _settle(driver: webdriver.Chrome) -> None:
    """Wait for the page, its images, fonts and scripts (the theme's, the code wrapping)."""
    deadline = time.monotonic() + 10
    script = (
        "return document.readyState === 'complete' && [...document.images].every((i) => i.complete)"
    )
    while not driver.execute_script(script) and time.monotonic() < deadline:
        time.sleep(0.05)
    driver.execute_async_script("document.fonts.ready.then(() => arguments[0]())")
    # Two frames: the layout after the resize handlers and the theme's own scripts.
    driver.execute_async_script(
        "requestAnimationFrame(() => requestAnimationFrame(() => arguments[0]()))"
    )


def _screenshot(driver: webdriver.Chrome, path: Path, width: int) -> None:
    height = min(int(driver.execute_script("return document.documentElement.scrollHeight")), 8000)
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        },
    )
    path.write_bytes(base64.b64decode(shot["data"]))


def _pages(site: Path) -> list[str]:
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("index.html"))
    return [p.removesuffix("index.html") for p in pages]


def _nav_pages(site: Path) -> set[str]:
    """The pages the site's first page links from its navigation (the nav's own pages)."""
    parser = _NavLinks()
    parser.feed((site / "index.html").read_text())
    return {urllib.parse.urljoin("/", href).lstrip("/") for href in parser.hrefs}


class _NavLinks(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "a" and "md-nav__link" in (values.get("class") or ""):
            href = values.get("href") or ""
            if "#" not in href and "://" not in href:
                self.hrefs.append(href.removeprefix("./"))


def _look(driver: webdriver.Chrome, width: int) -> list[str]:
    """The layout problems of the page loaded, laid out at ``width``; a note (what a reader
    would rather not see, but may) starts with "NOTE "."""
    _set_width(driver, width)
    _settle(driver)
    return list(driver.execute_script(CHECK_JS, width >= DESKTOP))


def check(site: Path, shots: Path) -> tuple[list[str], list[str]]:
    """Every failure on every page of ``site``, as ``/page @ width: what``, and the notes;
    screenshots of the nav's pages into ``shots``."""
    server, origin = _serve(site)
    driver = _driver()
    found: list[str] = []
    nav = _nav_pages(site)
    try:
        for page in _pages(site):
            name = page.strip("/").replace("/", "-") or "index"
            # Loaded at 1280 px, then narrowed to 390 px (the scripts' resize handlers), then
            # loaded afresh at 390 px.
            _set_width(driver, 1280)
            driver.get(origin + page)
            found += [f"/{page} @ 1280: {p}" for p in _look(driver, 1280)]
            links = driver.execute_script(LINKS_JS)
            found += [f"/{page}: {broken}" for broken in _broken_links(links, origin)]
            if page in nav:
                _screenshot(driver, shots / f"{name}-1280.png", 1280)
            found += [f"/{page} @ 390 after resize: {p}" for p in _look(driver, 390)]
            driver.get(origin + page)
            found += [f"/{page} @ 390: {p}" for p in _look(driver, 390)]
            if page in nav:
                _screenshot(driver, shots / f"{name}-390.png", 390)
            print(f"checked /{page}", flush=True)
    finally:
        driver.quit()
        server.shutdown()
    notes = [f.replace(": NOTE ", ": ", 1) for f in found if ": NOTE " in f]
    return [f for f in found if ": NOTE " not in f], notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, help="a built site (default: build one)")
    parser.add_argument("--shots", type=Path, default=Path("docs-shots"), help="screenshots")
    args = parser.parse_args()
    args.shots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as build:
        site = args.site
        if site is None:
            site = Path(build)
            command = ["mkdocs", "build", "--strict", "--quiet", "--site-dir", build]
            subprocess.run(command, check=True)
        pages = len(_pages(site))
        failures, notes = check(site, args.shots)
    for note in notes:
        print("NOTE", note)
    for failure in failures:
        print("FAIL", failure)
    print(f"{len(failures)} failures; {pages} pages at 1280 and 390 px; shots in {args.shots}/")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
