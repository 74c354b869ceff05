"""griffe extension: the docstrings' reST (Sphinx roles, ``::`` blocks) read as Markdown.

inturn's docstrings are written for ``help()`` and Sphinx-style tools:
``:meth:`run```, ``:exc:`~inturn.LeaseLost```, ``text::`` before an indented
example. mkdocstrings' Sphinx parser reads their ``:param:`` fields but leaves
the rest as it is, so the site would show ``:meth:`` before every name. This
extension, run on the loaded package before rendering, rewrites each role as
code that links to the object's entry in the API reference when it has one
(an optional cross-reference: a name the reference does not show, a private
helper or ``asyncio.Future``, stays plain code and never fails the build), and
each ``::`` block as a fenced Python block.

It also gives the module-level shortcuts (``inturn.run = default_queue.run``),
which have no docstring of their own, one line that points at the method; and
an attribute documented by ``#:`` comment lines above it (the house style, as
Sphinx reads it; griffe reads only a string after it) those lines as its
docstring: without one, mkdocstrings leaves it out (``Turn.token`` was).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: Modules whose public names (``__all__``) the API reference shows.
PUBLIC = (
    "inturn",
    "inturn.backends",
    "inturn.backends.file",
    "inturn.backends.redis",
    "inturn.backends.postgres",
)
ROLE = re.compile(r":(?P<role>[a-z]+):`(?P<target>[^`]+)`")
CALLABLE_ROLES = {"meth", "func"}


def _public_names(pkg: griffe.Module) -> dict[str, str]:
    """The canonical path of each public object (``inturn._queue.KeyedQueue``) -> its public one."""
    names: dict[str, str] = {}
    for module_path in PUBLIC:
        module = pkg if module_path == pkg.path else pkg[module_path.split(".", 1)[1]]
        for name in module.exports or ():
            if not isinstance(name, str) or name not in module.members:
                continue
            member = module.members[name]
            try:
                canonical = member.final_target.path if member.is_alias else member.path
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                continue
            names.setdefault(canonical, f"{module.path}.{name}")
    return names


def _public(path: str, names: dict[str, str]) -> str | None:
    """The public identifier of ``path`` (or of a member of a public object), if any."""
    head, rest = path, ""
    while head:
        if head in names:
            return names[head] + rest
        head, _, last = head.rpartition(".")
        rest = f".{last}{rest}"
    return None


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The path ``target`` names, seen from ``obj``'s docstring, or None."""
    first, _, rest = target.partition(".")
    scopes = [obj]
    if obj.parent is not None:
        scopes.append(obj.parent)
    for scope in scopes:
        try:
            resolved = scope.resolve(first)
        except (griffe.NameResolutionError, AttributeError, KeyError):
            continue
        return f"{resolved}.{rest}" if rest else resolved
    return target if "." in target else None


def _roles(text: str, obj: griffe.Object, names: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        role, target = match["role"], match["target"]
        if role == "pep":
            return f"[PEP {target}](https://peps.python.org/pep-{int(target):04d}/)"
        short = target.startswith("~")
        target = target.lstrip("~.")
        shown = target.rsplit(".", 1)[-1] if short else target
        if role in CALLABLE_ROLES:
            shown += "()"
        resolved = _resolve(obj, target)
        public = _public(resolved, names) if resolved else None
        if public is None:
            return f"`{shown}`"
        return f'<autoref identifier="{public}" optional><code>{shown}</code></autoref>'

    return ROLE.sub(replace, text)


def _literal_blocks(text: str) -> str:
    """reST's ``text::`` + indented block -> ``text:`` + a fenced Python block."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and i + 1 < len(lines) and not lines[i + 1].strip():
            stripped = line.rstrip()[:-2].rstrip()
            if stripped:
                out.append(stripped + ":")
            block, j = [], i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                block.append(lines[j])
                j += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            indent = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            out += ["", "```python", *(b[indent:] for b in block), "```", ""]
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def _shortcut_docstrings(pkg: griffe.Module) -> None:
    """``inturn.run = default_queue.run``: a line pointing at the method, where none is written."""
    for name, member in pkg.members.items():
        if member.is_alias or not member.is_attribute:
            continue
        value = str(member.value or "")
        if member.docstring is None and value.startswith("default_queue."):
            method = value.split(".", 1)[1]
            member.docstring = griffe.Docstring(
                f"[`KeyedQueue.{method}()`][inturn.KeyedQueue.{method}] of "
                f"[`default_queue`][inturn.default_queue]: `inturn.{name}(...)` is "
                f"`default_queue.{method}(...)`.",
                parent=member,
            )


def _comment_above(lines: list[str], lineno: int) -> list[str]:
    """The ``#:`` lines right above line ``lineno`` (1-based), without their ``#:``."""
    comment: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        comment.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return comment


def _comment_docstrings(cls: griffe.Class) -> None:
    """Give attributes documented by ``#:`` lines above them (as Sphinx reads them) those lines.

    An attribute declared in the class body (``token: int``, under ``#:``
    lines) and set in ``__init__`` is placed by griffe at the assignment: its
    declaration is looked for in the class body too.
    """
    try:
        lines = cls.lines_collection[cls.filepath]  # type: ignore[index]
    except KeyError:
        return
    body = range(cls.lineno or 0, cls.endlineno or 0)
    for name, member in cls.members.items():
        if member.is_alias or not member.is_attribute or member.docstring is not None:
            continue
        declared = re.compile(rf"\s*{re.escape(name)}\s*[:=]")
        places = [member.lineno] if member.lineno else []
        places += [i + 1 for i in body if i < len(lines) and declared.match(lines[i])]
        for lineno in places:
            comment = _comment_above(lines, lineno)
            if comment:
                member.docstring = griffe.Docstring("\n".join(comment), parent=member)
                break


class SphinxRoles(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "inturn":
            return
        _shortcut_docstrings(pkg)
        names = _public_names(pkg)
        seen: set[int] = set()

        def visit(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.is_class:
                _comment_docstrings(obj)
            if obj.docstring is not None:
                value = _literal_blocks(obj.docstring.value)
                obj.docstring.value = _roles(value, obj, names)
            for member in obj.members.values():
                if not member.is_alias:
                    visit(member)

        visit(pkg)

    # griffe before 2.0 named the hook so
    on_package_loaded = on_package
