"""The documentation's sources: every code block runs or is a marked fragment, and
every snippet include resolves, unmangled.

Code blocks (issue 31). Every fenced block of README.md, CHANGELOG.md and
docs/**/*.md, at any indentation (in a list too), is one of:

- a ``python`` block, unmarked: ``test_a_python_block_runs_as_pasted`` runs
  it as a script of its own, in a directory of its own, and it must exit 0
  and write nothing to stderr. Lines ``<!-- prints: TEXT -->`` above its
  fence say what it prints, one line of its output each, and the test
  compares;
- a block marked with the line ``<!-- fragment -->`` above its fence: one the
  tests cannot run as pasted, or must not: a piece of a larger program (it
  uses the reader's ``db`` or app, or awaits outside a function), a program
  that makes a directory in ``/var/run``, or commands for a shell;
- data or another system's statements, shown only: a language of ``SHOWN``.

"Above its fence" means among the HTML comment lines directly above it (no
blank line between), at the fence's indentation; GitHub, PyPI and the site
show nothing of them. ``test_every_block_runs_or_is_marked`` fails on a
block that is none of these, and on a marker that marks no block.

Includes. The site (``mkdocs build --strict``) includes code from the tree with
pymdownx.snippets: a line ``--8<-- "examples/x.py:section"``. ``ruff format``
(0.16 and newer) formats Python blocks in Markdown too, and an include line
parses as Python: it was rewritten with spaces around ``<`` and the site
showed it as text (issue 31). These tests catch that without building the site.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: What the site is built from: its pages, and the README and changelog they take.
SOURCES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]
#: An include line as pymdownx.snippets reads it (its base_path is the tree's root).
INCLUDE = re.compile(r'^--8<-- "(?P<path>[^":]+)(?::(?P<section>[^"]+))?"$')
#: The marker in any spacing, starting a line: an include, or what a formatter left of one.
MARKER = re.compile(r"^-+\s*8\s*<\s*-+")
FENCE = re.compile(r"^(`{3,}|~{3,})")


def _includes() -> list[tuple[Path, int, str]]:
    """Each line of the sources that starts with the marker: (file, line number, line)."""
    return [
        (source, number, line.strip())
        for source in SOURCES
        for number, line in enumerate(source.read_text().splitlines(), 1)
        if MARKER.match(line.strip())
    ]


def _opening_fences(lines: list[str]) -> list[int | None]:
    """For each line, the index of the fence line that opens its block, or None."""
    opening: list[int | None] = []
    start: int | None = None
    fence = ""  # the open block's fence characters
    for i, line in enumerate(lines):
        match = FENCE.match(line.strip())
        if start is not None:
            opening.append(start)
            if match and line.strip() == match.group(1) and match.group(1).startswith(fence):
                start = None
        elif match:
            start, fence = i, match.group(1)
            opening.append(start)
        else:
            opening.append(None)
    return opening


def _id(value: object) -> str:
    return f"{value.parent.name}/{value.name}" if isinstance(value, Path) else str(value)


INCLUDES = pytest.mark.parametrize(("source", "number", "line"), _includes(), ids=_id)


def test_the_prometheus_recipe_is_an_include() -> None:
    # else the tests below may check nothing
    assert any(source.name == "operations.md" for source, _, _ in _includes())


@INCLUDES
def test_an_include_is_written_as_pymdownx_snippets_reads_it(
    source: Path, number: int, line: str
) -> None:
    assert INCLUDE.match(line), (
        f"{source.name}:{number}: {line!r} is not an include: "
        'write --8<-- "path" or --8<-- "path:section"'
    )


@INCLUDES
def test_an_include_names_a_file_and_a_section_it_has(source: Path, number: int, line: str) -> None:
    match = INCLUDE.match(line)
    if match is None:
        pytest.skip("not an include (the test above fails)")
    path = ROOT / match["path"]
    assert path.is_file(), f"{source.name}:{number}: no file {match['path']}"
    section = match["section"]
    if section is None or re.fullmatch(r"[0-9:,-]+", section):  # the whole file, or lines
        return
    lines = [ln.rstrip() for ln in path.read_text().splitlines()]
    for end in ("start", "end"):
        marker = f"--8<-- [{end}:{section}]"
        found = sum(ln.endswith(marker) for ln in lines)
        assert found == 1, f"{source.name}:{number}: {match['path']} has {found} {marker}"


@INCLUDES
def test_ruff_format_leaves_an_include_alone(source: Path, number: int, line: str) -> None:
    # ruff format skips a block between <!-- fmt:off --> and <!-- fmt:on -->
    lines = source.read_text().splitlines()
    start = _opening_fences(lines)[number - 1]
    if start is None:
        return  # outside any fenced block: ruff formats none of it
    before = [ln.strip() for ln in lines[:start] if ln.strip()]
    after = [ln.strip() for ln in lines[number:] if ln.strip()]
    closing = next(i for i, ln in enumerate(after) if FENCE.fullmatch(ln))
    fix = "put <!-- fmt:off --> before its block and <!-- fmt:on --> after it"
    assert before[-1:] == ["<!-- fmt:off -->"], f"{source.name}:{number}: {fix}"
    assert after[closing + 1 : closing + 2] == ["<!-- fmt:on -->"], f"{source.name}:{number}: {fix}"


#: The longest code a table header may hold (a few names): the site keeps a
#: header's code on one line (docs/stylesheets/extra.css), so a longer one, a
#: signature, widens its table past the page.
LONGEST_HEADER_CODE = 32


def test_table_headers_hold_no_long_code() -> None:
    long = []
    for source in SOURCES:
        lines = source.read_text().splitlines()
        opening = _opening_fences(lines)
        for i, line in enumerate(lines[:-1]):
            separator = re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip())
            if opening[i] is None and line.lstrip().startswith("|") and separator:
                long += [
                    f"{source.name}:{i + 1}: `{code}`"
                    for code in re.findall(r"`([^`]+)`", line)
                    if len(code) > LONGEST_HEADER_CODE
                ]
    assert not long, "put it in a row of the table instead:\n" + "\n".join(long)


#: Languages of blocks shown, never run: data, and other systems' statements.
SHOWN = frozenset({"json", "sql", "text"})
FRAGMENT = "<!-- fragment -->"
PRINTS = re.compile(r"<!-- prints: (.+) -->")
#: A line that means to be a marker, as written or mistyped.
MARKER_LIKE = re.compile(r"<!--\s*(fragment|prints)\b", re.IGNORECASE)
#: An HTML comment alone on its line (once the line's indentation is taken off).
COMMENT = re.compile(r"<!--.*-->")


@dataclass(frozen=True)
class Block:
    """A fenced code block of a documentation source."""

    source: str  #: its path from the tree's root
    line: int  #: the number of its opening fence's line
    language: str  #: the first word after the fence, or ""
    code: str  #: its lines, less the fence's indentation
    notes: tuple[str, ...]  #: the HTML comments directly above its fence, one a line

    def __str__(self) -> str:
        return f"{self.source}:{self.line}"

    @property
    def fragment(self) -> bool:
        return FRAGMENT in self.notes

    @property
    def runs(self) -> bool:
        """Whether test_a_python_block_runs_as_pasted runs it."""
        return self.language == "python" and not self.fragment

    @property
    def prints(self) -> list[str]:
        """What it says it prints, line by line (if it says nothing, that is not checked)."""
        return [match[1] for note in self.notes if (match := PRINTS.fullmatch(note))]


def _blocks(source: str, text: str) -> list[Block]:
    """The fenced code blocks of text (the file source), at any indentation."""
    lines = text.splitlines()
    opening = _opening_fences(lines)
    blocks = []
    for start, fence in enumerate(lines):
        if opening[start] != start:
            continue
        end = start + 1  # past its last line
        while end < len(lines) and opening[end] == start:
            end += 1
        if end - 1 > start and FENCE.fullmatch(lines[end - 1].strip()):
            end -= 1  # at its closing fence
        indent = fence[: len(fence) - len(fence.lstrip())]
        first = start  # its first note's line
        while first and lines[first - 1].startswith(indent):
            if not COMMENT.fullmatch(lines[first - 1][len(indent) :]):
                break
            first -= 1
        info = fence.strip().lstrip(fence.strip()[0]).split()
        blocks.append(
            Block(
                source=source,
                line=start + 1,
                language=info[0] if info else "",
                code="".join(f"{ln.removeprefix(indent)}\n" for ln in lines[start + 1 : end]),
                notes=tuple(ln.strip() for ln in lines[first:start]),
            )
        )
    return blocks


def _problems(source: str, text: str) -> list[str]:
    """Where text (the file source) breaks the code blocks' convention, if anywhere."""
    blocks = _blocks(source, text)
    noted = {
        number for block in blocks for number in range(block.line - len(block.notes), block.line)
    }
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        note = line.strip()
        if not MARKER_LIKE.match(note):
            continue
        if note != FRAGMENT and not PRINTS.fullmatch(note):
            problems.append(f"{source}:{number}: {note!r}: write {FRAGMENT} or <!-- prints: X -->")
        elif number not in noted:
            problems.append(
                f"{source}:{number}: {note} marks no block: put it on the line above a fence "
                "(or above the comments there), at the fence's indentation"
            )
    for block in blocks:
        if block.prints and not block.runs:
            problems.append(f"{block}: says what it prints, but the tests do not run it")
        elif not (block.runs or block.fragment or block.language in SHOWN):
            kind = f"a {block.language!r} block" if block.language else "a block with no language"
            problems.append(
                f"{block}: {kind} the tests cannot run: put {FRAGMENT} on the line above its "
                f"fence, or name its language if it is data ({', '.join(sorted(SHOWN))})"
            )
    return problems


def _name(source: Path) -> str:
    return source.relative_to(ROOT).as_posix()


def test_every_block_runs_or_is_marked() -> None:
    problems = [p for source in SOURCES for p in _problems(_name(source), source.read_text())]
    assert not problems, "\n".join(problems)


def test_the_check_sees_blocks_in_lists_and_stray_markers() -> None:
    page = """\
<!-- fragment -->

```console
python -m inturn demo
```

- In a list:

  <!-- prints: 5 -->
  ```python
  print(5)
  ```

  <!-- fragment -->
  ```
  ACL SETUSER worker on
  ```

<!-- fragment-->
<!-- fmt:off -->
```python
await q.drain()
```
"""
    blocks = _blocks("page.md", page)
    assert [(b.line, b.language, b.runs, b.prints) for b in blocks] == [
        (3, "console", False, []),
        (10, "python", True, ["5"]),
        (15, "", False, []),
        (21, "python", True, []),
    ]
    assert blocks[1].code == "print(5)\n"  # less the list's indentation
    assert [p.split(":")[1] for p in _problems("page.md", page)] == ["1", "19", "3"]


#: The python blocks the tests run, each as its own program.
RUNS = [
    block
    for source in SOURCES
    for block in _blocks(_name(source), source.read_text())
    if block.runs
]


def _run(block: Block, tmp_path: Path, code: str | None = None) -> list[str]:
    """What block prints (or code, in its place), run as a script of its own in tmp_path."""
    script = tmp_path / "program.py"
    script.write_text(block.code if code is None else code)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert done.returncode == 0, (
        f"{block} failed, run as pasted (a piece of a larger program? put {FRAGMENT} on "
        f"the line above its fence):\n{done.stderr}"
    )
    assert not done.stderr, f"{block} ran, but wrote to stderr:\n{done.stderr}"
    return done.stdout.splitlines()


@pytest.mark.parametrize("block", RUNS, ids=str)
def test_a_python_block_runs_as_pasted(block: Block, tmp_path: Path) -> None:
    printed = _run(block, tmp_path)
    if block.prints:
        assert printed == block.prints, f"{block}: not what its <!-- prints: --> lines say"


def test_the_readmes_first_example_loses_updates_without_its_decorator(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    after = text.splitlines().index("## A first example") + 1
    example = next(b for b in _blocks("README.md", text) if b.line > after)
    assert example in RUNS
    assert example.prints == ["5"]  # checked with the others
    decorator = '@queue_by_key(key="stock-{product_id}")\n'
    assert decorator in example.code
    assert _run(example, tmp_path, example.code.replace(decorator, "")) == ["9"]  # as the text says


#: Each shared backend as the README's Errors table names it.
BACKENDS = ("Redis", "PostgreSQL", "file backend")


@pytest.mark.parametrize("error", ["BackendUnavailable", "LeaseLost"])
def test_the_errors_table_names_every_backend_that_raises_it(error: str) -> None:
    rows = [
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith(f"| `inturn.{error}` |")
    ]
    assert len(rows) == 1, rows
    assert [backend for backend in BACKENDS if backend not in rows[0]] == []


#: What a reader cannot look up: an issue of the tracker, a commit's hash.
INTERNAL = re.compile(r"\bissues? #?\d+|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


@pytest.mark.parametrize(
    "source", [s for s in SOURCES if s.name != "CHANGELOG.md"], ids=lambda s: _name(s)
)
def test_the_readme_and_the_pages_cite_no_issue_or_commit(source: Path) -> None:
    found = [
        f"{_name(source)}:{number}: {match[0]}"
        for number, line in enumerate(source.read_text().splitlines(), 1)
        for match in INTERNAL.finditer(line)
    ]
    assert found == [], "say what happened instead (bench/RESULTS.md keeps the runs)"


def test_the_readmes_backends_example_makes_no_directory_when_imported(tmp_path: Path) -> None:
    # The queue is made at module level, as the README says to; importing the module
    # must not write under /var/run (as root) or fail (as anyone else).
    text = (ROOT / "README.md").read_text()
    after = text.splitlines().index("## Across processes and hosts") + 1
    example = next(b for b in _blocks("README.md", text) if b.line > after)
    assert 'FileBackend("/var/run/shop/inturn")' in example.code
    directory = tmp_path / "run" / "shop" / "inturn"
    _run(example, tmp_path, example.code.replace('"/var/run/shop/inturn"', repr(str(directory))))
    assert not (tmp_path / "run").exists()
