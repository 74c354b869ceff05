"""mkdocs hook: pages take the README's sections and the changelog, so there is one copy.

A line ``<!-- README: ## Heading -->`` alone in a page is replaced by the body of
the README section with that heading (exactly as written there, hashes
included): everything after the heading up to the next heading of the same or
a higher level, ``#`` lines inside fenced code blocks not counting as
headings. The page writes its own heading; sub-headings of the section move up
so that the section's own level becomes the page's (``### X`` under ``## S``
becomes ``## X``). A heading the README no longer has, or a link to one of
its anchors that the site does not map to a page, fails the build: the README
is edited freely, and a section renamed is caught here rather than shown empty.
A README link to a page's source (``docs/usage.md``, ``CHANGELOG.md``) becomes
a link to that page, so the README's links work on GitHub and on the site.

A line ``<!-- CHANGELOG.md -->`` is replaced by the whole changelog, its
indented lines indented twice as far: it nests lists by 2 spaces, as GitHub
reads them, and Python-Markdown needs 4 (else sub-items show as items).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

README = Path(__file__).resolve().parents[2] / "README.md"
CHANGELOG = README.with_name("CHANGELOG.md")
MARKER = re.compile(r"^<!-- README: (#+ .+?) -->$", re.MULTILINE)
HEADING = re.compile(r"^(#+) ")
FENCE = re.compile(r"^(```|~~~)")
#: README anchors (its own links, ``(#development)``) and the site's page for each.
ANCHORS = {
    "#across-processes-and-hosts": "getting-started.md#across-processes-and-hosts",
    "#development": "getting-started.md#development",
}
#: README links to the repository's files that the site has as pages: ``docs/x.md``
#: is the site's ``x.md``, and the changelog its own page.
PAGES = re.compile(r"\]\((?:docs/([^)#]+\.md)|(CHANGELOG\.md))(#[^)]*)?\)")


def _lines_outside_fences(lines: list[str]) -> list[bool]:
    """For each line, whether it is outside a fenced code block."""
    outside, fence = [], ""
    for line in lines:
        match = FENCE.match(line)
        if fence:
            outside.append(False)
            if match and line.startswith(fence):
                fence = ""
        elif match:
            fence = match.group(1)
            outside.append(False)
        else:
            outside.append(True)
    return outside


def section(text: str, heading: str) -> str:
    """The body of the section of ``text`` whose heading line is ``heading``."""
    lines = text.splitlines()
    outside = _lines_outside_fences(lines)
    starts = [i for i, line in enumerate(lines) if outside[i] and line.rstrip() == heading]
    if len(starts) != 1:
        found = "no" if not starts else f"{len(starts)}"
        raise PluginError(f"README.md has {found} heading {heading!r}: update the docs' marker")
    level = len(heading.split(" ", 1)[0])
    body = []
    for i in range(starts[0] + 1, len(lines)):
        match = HEADING.match(lines[i]) if outside[i] else None
        if match and len(match.group(1)) <= level:
            break
        if match:  # a sub-heading: the section's level becomes the page's (1)
            lines[i] = lines[i][level - 1 :]
        body.append(lines[i])
    return "\n".join(body).strip("\n")


def _relink(body: str, heading: str) -> str:
    def replace(match: re.Match[str]) -> str:
        anchor = match.group(1)
        if anchor not in ANCHORS:
            raise PluginError(
                f"README section {heading!r} links to {anchor}: add it to ANCHORS in {__file__}"
            )
        return f"]({ANCHORS[anchor]})"

    def page(match: re.Match[str]) -> str:
        return f"]({match.group(1) or 'changelog.md'}{match.group(3) or ''})"

    return PAGES.sub(page, re.sub(r"\]\((#[^)]*)\)", replace, body))


def changelog(text: str) -> str:
    """The changelog with its 2-space list nesting made 4 (fenced code left alone)."""
    lines = text.splitlines()
    outside = _lines_outside_fences(lines)
    return "\n".join(
        " " * (len(line) - len(line.lstrip(" "))) + line if outside[i] else line
        for i, line in enumerate(lines)
    )


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "<!-- CHANGELOG.md -->" in markdown:
        text = changelog(CHANGELOG.read_text(encoding="utf-8"))
        markdown = markdown.replace("<!-- CHANGELOG.md -->", text)
    if "<!-- README:" not in markdown:
        return markdown
    if "/" in page.file.src_uri:
        raise PluginError(f"{page.file.src_uri}: README sections go in top-level pages only")
    text = README.read_text(encoding="utf-8")
    result = MARKER.sub(lambda m: _relink(section(text, m.group(1)), m.group(1)), markdown)
    if "<!-- README:" in result:
        raise PluginError(f"{page.file.src_uri}: a README marker is not alone on its line")
    return result
