"""A decorator's key spec compiled at decoration: templates, constants and key functions.

What the signature decides is decided once; what runs per call is a small closure.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping
from string import Formatter
from types import MappingProxyType
from typing import Any, Final, NoReturn, TypeAlias, final

from ._describe import cut, describe, function_name

#: What ``key=`` accepts: ``None`` (the function's qualified name), a constant
#: or template ``str``, another hashable constant, or a callable given the
#: call's arguments by parameter name.
KeySpec: TypeAlias = "str | Callable[[Mapping[str, Any]], Hashable] | Hashable | None"
#: What ``keys=`` accepts: constants and templates, or a callable returning keys.
KeysSpec: TypeAlias = "Iterable[str | Hashable] | Callable[[Mapping[str, Any]], Iterable[Hashable]]"
#: A compiled key spec: ``(args, kwargs) -> key``, where ``args`` includes the
#: bound instance or class for methods.
KeyFunction: TypeAlias = Callable[[tuple[Any, ...], dict[str, Any]], Any]

_MISSING: Final = inspect.Parameter.empty
_POSITIONAL: Final = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC: Final = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_FIELD_ROOT: Final = re.compile(r"[^.\[]*")


class _Signature:
    """A function's parameters, compiled for fast lookup of call arguments by name."""

    __slots__ = ("defaults", "function", "kinds", "positions", "signature")

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.signature = inspect.signature(function)
        params = list(self.signature.parameters.values())
        self.positions = {p.name: i for i, p in enumerate(params) if p.kind in _POSITIONAL}
        self.kinds = {p.name: p.kind for p in params}
        self.defaults = {p.name: p.default for p in params}

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map each parameter to its value in this call, with defaults (or Python's TypeError)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{function_name(self.function)} {error}") from None
        bound.apply_defaults()
        return bound.arguments

    def getter(self, name: str) -> KeyFunction:
        """Compile ``(args, kwargs) -> value of parameter name`` in this call."""
        index = self.positions.get(name)
        default = self.defaults[name]
        kind = self.kinds[name]
        keyword = kind is not inspect.Parameter.POSITIONAL_ONLY
        bind = self.bind
        if kind in _VARIADIC:
            # the *args tuple or **kwargs dict itself: rare, bind the whole call
            return lambda args, kwargs: bind(args, kwargs)[name]

        def get(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if index is not None and len(args) > index:
                return args[index]
            if keyword and name in kwargs:
                return kwargs[name]
            if default is not _MISSING:
                return default
            return bind(args, kwargs)[name]  # raises the TypeError of the missing argument

        return get

    def mapping(self) -> Callable[[tuple[Any, ...], dict[str, Any]], Mapping[str, Any]]:
        """Compile ``(args, kwargs) -> read-only mapping of every argument by name``."""
        if any(kind in _VARIADIC for kind in self.kinds.values()):  # *args or **kwargs
            bind = self.bind
            return lambda args, kwargs: MappingProxyType(bind(args, kwargs))
        getters = [(name, self.getter(name)) for name in self.kinds]
        return lambda args, kwargs: MappingProxyType(
            {name: get(args, kwargs) for name, get in getters}
        )


@final
class _Probe:
    """Stands for every argument while a template is checked at decoration."""

    __slots__ = ()

    def __getattr__(self, name: str) -> _Probe:
        return self

    def __getitem__(self, key: object) -> _Probe:
        return self

    def __format__(self, spec: str) -> str:
        return ""


def _root(field: str, where: str) -> str:
    """Return the parameter a template's field starts from; refuse a positional field."""
    root = _FIELD_ROOT.match(field).group()  # type: ignore[union-attr]  # always matches
    if not root or root.isdigit():
        raise ValueError(
            f"inturn: {where} has a positional field {{{field}}}; "
            "name the parameter instead, as in 'user-{user_id}'"
        )
    return root


@final
class _Field:
    """One replacement field of a template, for naming it when a call cannot format it."""

    __slots__ = ("root", "source")

    def __init__(self, root: str, field: str, conversion: str | None, spec: str) -> None:
        #: the parameter the field starts from
        self.root = root
        #: the field as written, alone: formats exactly what it did in the template
        self.source = (
            f"{{{field}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
        )


def _parse(template: str, where: str) -> list[tuple[str, str | None, str, str | None]]:
    """Return Formatter().parse(template) as a list, raising ValueError naming where."""
    try:
        return [
            (text, field, spec or "", conv)
            for text, field, spec, conv in Formatter().parse(template)
        ]
    except ValueError as error:
        raise ValueError(f"inturn: {where} is not a valid format string: {error}") from None


def _fields(template: str, where: str) -> tuple[list[str], list[_Field], list[str]]:
    """Parse template into its literal texts, its fields and every parameter they name.

    :raises ValueError: str.format() refuses it whatever the arguments, or a field is positional.
    """
    texts = [""]  # the literal text before, between and after the fields
    fields: list[_Field] = []
    names: list[str] = []  # the fields' roots, then those of fields nested in their specs
    for text, field, spec, conversion in _parse(template, where):
        texts[-1] += text
        if field is not None:
            texts.append("")
            fields.append(_Field(_root(field, where), field, conversion, spec))
            names.append(fields[-1].root)
            names.extend(
                _root(inner, where) for _, inner, _, _ in _parse(spec, where) if inner is not None
            )
    try:
        # What str.format() refuses whatever the arguments: a bad conversion, a
        # malformed field name, a spec no str takes after !r, nesting too deep.
        template.format_map(dict.fromkeys(names, _Probe()))
    except ValueError as error:
        raise ValueError(f"inturn: {where} is not a valid format string: {error}") from None
    except Exception:  # depends on the arguments: their calls will tell
        pass
    return texts, fields, list(dict.fromkeys(names))


def _fail(
    error: Exception, where: str, field: _Field | None, values: Mapping[str, Any]
) -> NoReturn:
    """Raise for a call whose arguments a template could not format, as QueuedFunction says."""
    if field is None:
        what = "could not be formatted"
    else:
        kind = type(values[field.root]).__qualname__
        what = f"could not format {field.source} from parameter {field.root!r} ({kind})"
    about = f"inturn: {where} {what}"
    if type(error).__module__ == "builtins":
        try:
            text = str(error)
        except Exception:  # a message must not fail
            text = "(its message failed)"
        if len(text) > 300:
            text = f"{text[:297]}..."
        try:
            clearer = type(error)(f"{about}: {type(error).__name__}: {text}; the call did not run")
        except Exception:  # takes more than a message: keep the original
            pass
        else:
            if isinstance(error, AttributeError):
                clearer.name, clearer.obj = error.name, error.obj  # type: ignore[attr-defined]
            raise clearer from error
    note = f"{about}; the call did not run"
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:  # where the exceptiongroup backport prints notes
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]
    raise error


def _culprit(fields: list[_Field], values: Mapping[str, Any]) -> _Field | None:
    """Find the first field that fails to format alone, as str.format() met them."""
    for field in fields:
        try:
            field.source.format_map(values)
        except Exception:
            return field
    return None  # formats now: the failure did not repeat


def _template(sig: _Signature, template: str) -> KeyFunction | str:
    """Compile a key template; return the key itself when it has no fields."""
    where = f"key template {describe(template)} of {function_name(sig.function)}"
    texts, fields, names = _fields(template, where)
    if not fields:
        return template.format()  # a constant, with any {{ }} escapes undone
    for name in names:
        if name not in sig.kinds:
            have = ", ".join(sig.kinds) or "none"
            raise ValueError(
                f"inturn: key template {describe(template)} names {name!r}, but "
                f"{function_name(sig.function)} has no parameter of that name "
                f"(its parameters: {have})"
            )
    getters = [(name, sig.getter(name)) for name in names]

    def failed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> NoReturn:
        # Called in an except clause, for its exception: not an argument, so the
        # hot closures carry one cell more and no local more.
        error = sys.exc_info()[1]
        assert isinstance(error, Exception)
        try:
            values = {name: get(args, kwargs) for name, get in getters}
        except TypeError as unfit:  # the call does not fit the signature: that was the error
            raise unfit from None
        field = fields[0] if len(fields) == 1 else _culprit(fields, values)
        _fail(error, where, field, values)

    if len(fields) == 1 and fields[0].source == f"{{{names[0]}}}":
        # The common 'prefix-{param}suffix' shape: no str.format machinery per call.
        ((root, get),) = getters
        prefix, suffix = texts
        # passed by position, as most calls pass it: no second call (never, for a
        # parameter that cannot be: its index is past any call's arguments)
        index = sig.positions.get(root, sys.maxsize)

        def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
            try:
                return f"{prefix}{args[index] if len(args) > index else get(args, kwargs)}{suffix}"
            except Exception:  # re-raised, clearer
                failed(args, kwargs)

        return key

    def format_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        values = {name: get(args, kwargs) for name, get in getters}
        try:
            return template.format_map(values)
        except Exception:  # re-raised, clearer
            failed(args, kwargs)

    return format_key


def _check_key_function(sig: _Signature, spec: Callable[..., Any], option: str) -> None:
    """Refuse, at decoration, a key function that cannot take the one argument it is given.

    :raises TypeError: naming the key function, its parameters, the decorated
        function and the mapping a key function gets instead.
    """
    try:
        signature = inspect.signature(spec)
    except (TypeError, ValueError):  # a callable of C with no signature: its calls will tell
        return
    try:
        signature.bind(None)
    except TypeError:
        pass
    else:
        return
    decorated = function_name(sig.function)
    parameters = ", ".join(sig.kinds)
    first = next(iter(sig.kinds), "name")
    raise TypeError(
        f"inturn: the key function {function_name(spec)} in {option} of {decorated} "
        f"takes {cut(str(signature))}, but is called with one argument: a read-only "
        f"mapping of {decorated}'s arguments by name ({parameters or 'it has none'}); "
        f"write it as lambda args: ... args[{first!r}] ..."
    )


def _one(sig: _Signature, spec: KeySpec, option: str = "key=") -> KeyFunction | Hashable:
    """Compile one key spec; return the key itself when it is a constant."""
    if isinstance(spec, str):
        return _template(sig, spec) if "{" in spec or "}" in spec else spec
    if callable(spec):
        _check_key_function(sig, spec, option)
        mapping = sig.mapping()
        return lambda args, kwargs: spec(mapping(args, kwargs))
    try:
        hash(spec)
    except TypeError:
        raise TypeError(
            "inturn: key= takes None, a str, a hashable constant or a callable; "
            f"got {describe(spec)}"
        ) from None
    return spec


def compile_key(
    function: Callable[..., Any], key: KeySpec, keys: KeysSpec | None
) -> tuple[KeyFunction, bool]:
    """Compile a decorator's key spec into ``(extract, several)``; bad specs raise here.

    ``extract(args, kwargs)`` returns the call's key, or a tuple of its keys
    when ``several`` (``keys=``). It raises Python's ``TypeError`` for a call
    that does not fit the signature, whatever a key function raises, and for
    arguments a template cannot format, an error of the original's kind (see
    :func:`_fail`), so that an ``except`` that caught it still does.
    """
    sig = _Signature(function)
    if keys is not None:
        if key is not None:
            raise TypeError("inturn: pass key= or keys=, not both")
        if isinstance(keys, str | bytes):
            raise TypeError(
                f"inturn: keys= takes a list of keys or templates, not a single "
                f"{type(keys).__name__} ({describe(keys)}); use key= for one key"
            )
        if callable(keys):
            _check_key_function(sig, keys, "keys=")
            mapping = sig.mapping()
            return (lambda args, kwargs: tuple(keys(mapping(args, kwargs)))), True
        if not isinstance(keys, Iterable):
            raise TypeError(
                "inturn: keys= takes a list of keys or templates, or a callable; "
                f"got {describe(keys)}"
            )
        parts = [_one(sig, spec, "keys=") for spec in keys]
        if not parts:
            raise ValueError("inturn: keys= needs at least one key")
        compiled = [(part, callable(part)) for part in parts]
        if not any(dynamic for _, dynamic in compiled):
            constant = tuple(parts)
            return (lambda args, kwargs: constant), True
        return (
            lambda args, kwargs: tuple(
                part(args, kwargs) if dynamic else part  # type: ignore[operator]
                for part, dynamic in compiled
            )
        ), True
    part = f"{function.__module__}.{function.__qualname__}" if key is None else _one(sig, key)
    if callable(part):
        return part, False
    return (lambda args, kwargs: part), False
