"""wrapt's part of queue_by_key: the classes of a decorated function, and of one bound.

Imported at the first decoration, not with ``import inturn``: wrapt's own
import pulls ``importlib.metadata`` (and with it ``email``, ``zipfile``,
``csv``...), which cost more than the rest of ``import inturn`` together.
"""

from __future__ import annotations

import copy
import pickle
import sys
from typing import Any, SupportsIndex

import wrapt

from ._describe import describe, function_name
from ._keyspec import KeyFunction


class BoundQueued(wrapt.BoundFunctionWrapper):  # type: ignore[type-arg]
    """A decorated method, bound to its instance or class."""

    def _full(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The call's arguments as the function receives them: self or cls first."""
        kind = self._self_parent._self_kind
        if kind is staticmethod:
            return args
        if kind is classmethod:
            return (self.__wrapped__.__self__, *args)  # type: ignore[attr-defined]
        instance = self._self_instance  # None when called through the class
        return args if instance is None else (instance, *args)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_parent(*self._full(args), **kwargs)

    @property
    def queue(self) -> Any:  # (its KeyedQueue)
        return self._self_parent._self_queue

    def key_of(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_parent._self_key_of(self._full(args), kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by reference, as a bound method: what it is got from, and its name."""
        parent = self._self_parent
        # its self or cls; none for a staticmethod or a method got from its class,
        # which are got from the class that defines them
        bound = self._full(())
        return getattr, ((*bound, parent.__name__) if bound else defined_in(parent))

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return self.__reduce__()

    def __copy__(self) -> Any:
        get, (owner, name) = self.__reduce__()
        return get(owner, name)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        get, (owner, name) = self.__reduce__()
        return get(copy.deepcopy(owner, memo), name)


class Queued(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """A decorated function or method, before binding; wrapt gives it identity and binding.

    Each decorated function gets a subclass whose ``__call__`` goes straight
    to the queue: wrapt's call path costs several times a plain call.
    """

    __bound_function_wrapper__ = BoundQueued

    def __init__(self, wrapped: Any, kind: type[Any], queue: Any, key_of: KeyFunction) -> None:
        def through(
            wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            # wrapt's own call path, for any binding the overrides do not take
            full = args if instance is None else (instance, *args)
            return self(*full, **kwargs)

        super().__init__(wrapped, through)
        self._self_kind = kind  # FunctionType, classmethod or staticmethod
        self._self_queue = queue
        self._self_key_of = key_of

    @property
    def queue(self) -> Any:  # (its KeyedQueue)
        return self._self_queue

    def key_of(self, *args: Any, **kwargs: Any) -> Any:
        return self._self_key_of(args, kwargs)

    # NOTE: wrapt's proxies refuse to be pickled or copied. A decorated function
    # pickles by reference, as a plain function (a child process finds its own);
    # copying gives the function itself.

    def __reduce__(self) -> str:
        return self.__qualname__

    def __reduce_ex__(self, protocol: SupportsIndex) -> str:
        return self.__reduce__()

    def __copy__(self) -> Queued:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Queued:
        return self


def defined_in(function: Queued) -> tuple[Any, str]:
    """Find function by name as pickle finds a plain function: (class or module, name)."""
    module, qualname = function.__module__, function.__qualname__
    path, _, name = qualname.rpartition(".")
    try:
        owner: Any = sys.modules[module]
        for part in path.split(".") if path else ():
            owner = getattr(owner, part)
        found = getattr(owner, name)
    except (KeyError, AttributeError):
        found = None
    if found is not function and getattr(found, "_self_parent", None) is not function:
        raise pickle.PicklingError(
            f"inturn: cannot pickle {function_name(function)}: a queue_by_key function "
            "pickles by reference (module and qualified name), as a plain function does, "
            f"and {describe(f'{module}.{qualname}')} does not lead to it; decorate a function "
            "or method defined at module level"
        )
    return owner, name
