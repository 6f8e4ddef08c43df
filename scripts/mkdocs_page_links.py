"""A mkdocs hook: on the API page, "see the docs' Sharp edges page" becomes a link.

Docstrings name the docs' pages in words, so that ``help()`` reads as plain text
(tests/test_architecture.py holds them to it). On the API page, each such mention links
the page it names, and the section it quotes where it quotes one: ``"Several shapes" in
the docs' Sharp edges page`` and ``the sharp edges page, "Static addresses"`` link to that
section. A page name that is in no nav entry fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from markdown.extensions.toc import slugify
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

PAGES = ("api.md",)
# `the docs' Sharp edges page`, `see the docs' Several GPUs page`, with the section it quotes
# before (`"Several shapes" in the docs' ...`) or after (`the sharp edges page, "Static
# addresses"`); a docstring's line breaks fall anywhere.
MENTION = re.compile(
    r'(?:"(?P<before>[^"<]+)"\s+in\s+)?(?P<the>the\s+docs\'\s+|the\s+)'
    r"(?P<title>[A-Za-z][A-Za-z ]*?(?:\s+[A-Za-z]+)*?)\s+page"
    r'(?:,\s+"(?P<after>[^"<]+)")?'
)


def _titles(nav: Any) -> dict[str, str]:
    """The nav's page titles, in lower case, and their files."""
    found: dict[str, str] = {}
    for entry in nav if isinstance(nav, list) else [nav]:
        if isinstance(entry, dict):
            for title, value in entry.items():
                if isinstance(value, str):
                    found[" ".join(title.lower().split())] = value
                else:
                    found.update(_titles(value))
    return found


def _section(docs: Path, src: str, quoted: str) -> str:
    """The anchor of the heading of ``src`` that starts with ``quoted``."""
    wanted = str(slugify(quoted, "-"))
    for heading in re.findall(r"^#{2,6} (.+)$", (docs / src).read_text(), re.M):
        anchor = str(slugify(heading, "-"))
        if anchor.startswith(wanted):
            return anchor
    raise PluginError(f"{src} has no section {quoted!r}")


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri not in PAGES:
        return html
    titles = _titles(config["nav"])
    docs = Path(config["docs_dir"])

    def link(match: re.Match[str]) -> str:
        title = " ".join(match["title"].split())
        src = titles.get(title.lower())
        if src is None:
            if match["the"].startswith("the docs"):
                raise PluginError(f"{page.file.src_uri}: no page {title!r} in the nav")
            return match[0]  # "the ... page" of something else
        target = files.get_file_from_path(src)
        assert target is not None
        url = target.url_relative_to(page.file)
        quoted = match["before"] or match["after"]
        named = f'<a href="{url}">{title}</a>'
        if quoted is None:
            return f"{match['the']}{named} page"
        section = f'<a href="{url}#{_section(docs, src, quoted)}">"{quoted}"</a>'
        if match["before"]:
            return f"{section} in {match['the']}{named} page"
        return f"{match['the']}{named} page, {section}"

    # Text only: the mentions sit in paragraphs, never inside a tag or a code span.
    parts = re.split(r"(<code>.*?</code>|<[^>]+>)", html, flags=re.S)
    return "".join(p if p.startswith("<") else MENTION.sub(link, p) for p in parts)
