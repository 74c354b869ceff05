"""queue_by_key: key forms, methods, identity, errors at decoration, coalescing."""

from __future__ import annotations

import asyncio
import copy
import functools
import inspect
import multiprocessing
import operator
import os
import pickle
import re
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

import inturn
from inturn import KeyedQueue

from support import decorated
from support.helpers import PATIENCE, Recorder, checkpoints, settle

# -- key forms -------------------------------------------------------------------------


async def test_no_key_means_one_line_for_the_function(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    order: list[int] = []

    @queue.queue_by_key
    async def work(i: int) -> int:
        order.append(i)
        if i == 0:
            await gate.wait()
        return i

    first = asyncio.create_task(work(0))
    await settle(lambda: order == [0])
    second = asyncio.create_task(work(1))
    await settle(lambda: queue.pending(work.key_of(1)) == 1)
    assert work.key_of(1) == f"{__name__}.{work.__qualname__}"
    gate.set()
    assert await asyncio.gather(first, second) == [0, 1]


async def test_called_without_arguments_is_the_same_as_bare(queue: KeyedQueue) -> None:
    @queue.queue_by_key()
    async def work() -> str:
        return "ok"

    assert work.key_of() == f"{__name__}.{work.__qualname__}"
    assert await work() == "ok"


async def test_constant_key_is_shared_by_functions(queue: KeyedQueue, recorder: Recorder) -> None:
    gate = asyncio.Event()

    @queue.queue_by_key(key="system-log")
    async def append(line: str) -> None:
        await recorder.body("system-log", line, gate=gate if line == "first" else None)()

    @queue.queue_by_key(key="system-log")
    async def rotate() -> None:
        await recorder.body("system-log", "rotate")()

    first = asyncio.create_task(append("first"))
    await settle(lambda: recorder.started == ["first"])
    rotating = asyncio.create_task(rotate())
    second = asyncio.create_task(append("second"))
    await settle(lambda: queue.pending("system-log") == 2)
    gate.set()
    await asyncio.gather(first, rotating, second)
    assert recorder.started == ["first", "rotate", "second"]
    assert recorder.overlaps == []


async def test_template_key_uses_arguments_by_name_with_defaults(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="stock-{product_id}-{warehouse}")
    async def take(product_id: str, n: int = 1, warehouse: str = "main") -> int:
        return n

    assert take.key_of("sku-1") == "stock-sku-1-main"
    assert take.key_of("sku-1", 2, "east") == "stock-sku-1-east"
    assert take.key_of(product_id="sku-2", warehouse="west") == "stock-sku-2-west"
    assert take.key_of("sku-3", warehouse="north", n=5) == "stock-sku-3-north"
    assert await take("sku-1", 3) == 3


async def test_template_key_with_one_field(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="stock-{product_id}")
    async def take(product_id: str | int, n: int = 1) -> int:
        return n

    assert take.key_of("sku-1") == "stock-sku-1"
    assert take.key_of(product_id=7) == "stock-7"
    assert take.key_of(8, n=2) == "stock-8"


async def test_template_fields_may_use_attributes_items_specs_and_conversions(
    queue: KeyedQueue,
) -> None:
    class User:
        id = 42

    @queue.queue_by_key(key="u-{user.id}-{meta[region]}-{n:03d}-{tag!r}")
    async def work(user: User, meta: dict[str, str], n: int, tag: str = "x") -> None:
        pass

    assert work.key_of(User(), {"region": "eu"}, 7) == "u-42-eu-007-'x'"


async def test_escaped_braces_make_a_constant(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="{{literal}}")
    async def work() -> None:
        pass

    assert work.key_of() == "{literal}"


async def test_template_over_args_and_kwargs_parameters(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="{first}/{rest}/{options}")
    async def work(first: str, *rest: str, **options: int) -> None:
        pass

    assert work.key_of("a", "b", "c", x=1) == "a/('b', 'c')/{'x': 1}"


async def test_template_over_keyword_only_and_positional_only(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="{a}-{b}-{c}")
    async def work(a: int, /, b: int = 2, *, c: int = 3) -> None:
        pass

    assert work.key_of(1) == "1-2-3"
    assert work.key_of(1, c=30) == "1-2-30"
    assert work.key_of(1, b=20) == "1-20-3"


async def test_key_callable_gets_a_read_only_mapping_with_defaults(queue: KeyedQueue) -> None:
    seen: list[Mapping[str, Any]] = []

    def key(args: Mapping[str, Any]) -> str:
        seen.append(args)
        return f"user-{args['user_id']}"

    @queue.queue_by_key(key=key)
    async def charge(user_id: int, cents: int = 100) -> int:
        return cents

    assert await charge(5) == 100
    assert dict(seen[0]) == {"user_id": 5, "cents": 100}
    with pytest.raises(TypeError):
        seen[0]["user_id"] = 6  # type: ignore[index]
    assert charge.key_of(user_id=9, cents=1) == "user-9"


async def test_key_callable_over_a_signature_with_var_args(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key=lambda args: (args["a"], args["rest"], args["kw"]))
    async def work(a: int, *rest: int, **kw: int) -> None:
        pass

    assert work.key_of(1, 2, 3, x=4) == (1, (2, 3), {"x": 4})
    assert work.key_of(1) == (1, (), {})


async def test_a_non_str_constant_key(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key=("tenant", 7))
    async def work() -> None:
        assert queue.is_active(("tenant", 7))

    await work()
    assert work.key_of() == ("tenant", 7)


async def test_several_keys_from_templates(queue: KeyedQueue, recorder: Recorder) -> None:
    gate = asyncio.Event()

    @queue.queue_by_key(keys=["acct-{src}", "acct-{dst}", "ledger"])
    async def transfer(src: str, dst: str) -> tuple[str, str]:
        await recorder.body("pair", (src, dst), gate=gate if src == "a" else None)()
        return src, dst

    assert transfer.key_of("a", "b") == ("acct-a", "acct-b", "ledger")
    first = asyncio.create_task(transfer("a", "b"))
    await settle(lambda: recorder.started == [("a", "b")])
    assert queue.active_keys == {"acct-a", "acct-b", "ledger"}
    second = asyncio.create_task(transfer("b", "a"))  # opposite order: no deadlock
    await settle(lambda: sum(map(queue.pending, ("acct-a", "acct-b", "ledger"))) == 1)
    gate.set()
    assert await asyncio.gather(first, second) == [("a", "b"), ("b", "a")]
    assert queue.active_count == 0


async def test_several_keys_from_a_callable(queue: KeyedQueue) -> None:
    @queue.queue_by_key(keys=lambda args: (f"acct-{a}" for a in args["accounts"]))
    async def settle_all(accounts: list[str]) -> int:
        assert queue.active_keys == {f"acct-{a}" for a in accounts}
        return len(accounts)

    assert settle_all.key_of(["x", "y"]) == ("acct-x", "acct-y")
    assert await settle_all(["x", "y", "x"]) == 3


async def test_several_constant_keys(queue: KeyedQueue) -> None:
    @queue.queue_by_key(keys=["a", "b"])
    async def work() -> None:
        assert queue.active_keys == {"a", "b"}

    await work()
    assert work.key_of() == ("a", "b")


# -- methods -----------------------------------------------------------------------------


class Conversation:
    queue = KeyedQueue()

    def __init__(self, conversation_id: str) -> None:
        self.conversation_id = conversation_id
        self.messages: list[str] = []

    @queue.queue_by_key(key="conv-{self.conversation_id}")
    async def post(self, text: str) -> str:
        """Post a message."""
        await checkpoints()
        self.messages.append(text)
        return await self.echo(text)  # same key, same task: runs at once

    @queue.queue_by_key(key="conv-{self.conversation_id}")
    async def echo(self, text: str) -> str:
        return text

    @queue.queue_by_key(key="cls-{cls.__name__}-{n}")
    @classmethod
    async def make(cls, n: int) -> str:
        return f"{cls.__name__}:{n}"

    @classmethod
    @queue.queue_by_key(key="cls2-{cls.__name__}-{n}")
    async def make2(cls, n: int) -> str:
        return f"{cls.__name__}:{n}"

    @queue.queue_by_key(key="static-{n}")
    @staticmethod
    async def static(n: int) -> int:
        return n

    @staticmethod
    @queue.queue_by_key(key="static2-{n}")
    async def static2(n: int) -> int:
        return n


async def test_bound_method_template_over_self() -> None:
    a, b = Conversation("a"), Conversation("b")
    results = await asyncio.gather(a.post("1"), b.post("x"), a.post("2"), a.post("3"))
    assert results == ["1", "x", "2", "3"]
    assert a.messages == ["1", "2", "3"]
    assert a.post.key_of("hi") == "conv-a"
    assert Conversation.post.key_of(b, "hi") == "conv-b"
    assert await Conversation.post(a, "4") == "4"  # called through the class
    assert Conversation.queue.active_count == 0


async def test_classmethods_in_either_decorator_order() -> None:
    conv = Conversation("c")
    assert await Conversation.make(1) == "Conversation:1"
    assert await conv.make(2) == "Conversation:2"
    assert Conversation.make.key_of(3) == "cls-Conversation-3"
    assert conv.make.key_of(3) == "cls-Conversation-3"
    assert await Conversation.make2(1) == "Conversation:1"
    assert await conv.make2(2) == "Conversation:2"


async def test_staticmethods_in_either_decorator_order() -> None:
    conv = Conversation("c")
    assert await Conversation.static(1) == 1
    assert await conv.static(2) == 2
    assert Conversation.static.key_of(3) == "static-3"
    assert conv.static.key_of(3) == "static-3"
    assert await Conversation.static2(4) == 4
    assert await conv.static2(5) == 5


async def test_method_calling_another_with_the_same_key_does_not_deadlock() -> None:
    conv = Conversation("reentrant")
    assert await asyncio.wait_for(conv.post("hello"), timeout=5) == "hello"


# -- identity ------------------------------------------------------------------------------


async def test_decorated_function_keeps_its_identity(queue: KeyedQueue) -> None:
    async def original(product_id: str, n: int = 1) -> int:
        """Take n from stock."""
        return n

    decorated = queue.queue_by_key(key="stock-{product_id}")(original)
    assert decorated.__name__ == "original"
    assert decorated.__qualname__ == original.__qualname__
    assert decorated.__doc__ == "Take n from stock."
    assert decorated.__wrapped__ is original  # type: ignore[attr-defined]
    assert inspect.signature(decorated) == inspect.signature(original)
    assert inspect.iscoroutinefunction(decorated)
    assert decorated.queue is queue


def test_methods_keep_their_identity() -> None:
    conv = Conversation("x")
    assert Conversation.post.__doc__ == "Post a message."
    assert str(inspect.signature(conv.post)) == "(text: 'str') -> 'str'"
    assert inspect.iscoroutinefunction(conv.post)
    assert inspect.iscoroutinefunction(Conversation.make)
    assert inspect.iscoroutinefunction(Conversation.static)
    assert conv.post.queue is Conversation.queue
    assert Conversation.make.queue is Conversation.queue


async def test_submission_happens_when_the_coroutine_starts(
    queue: KeyedQueue, recorder: Recorder
) -> None:
    @queue.queue_by_key(key="k")
    async def work(name: str) -> None:
        await recorder.body("k", name)()

    later = work("made first, started second")
    sooner = work("made second, started first")
    await asyncio.gather(sooner, later)
    assert recorder.started == ["made second, started first", "made first, started second"]


async def test_module_level_decorator_uses_the_default_queue() -> None:
    @inturn.queue_by_key(key="default-{n}")
    async def work(n: int) -> bool:
        return inturn.default_queue.is_active(f"default-{n}")

    assert work.queue is inturn.default_queue
    assert await work(1) is True
    assert inturn.default_queue.active_count == 0


async def test_decorator_timeout(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    ran: list[str] = []

    @queue.queue_by_key(key="k", timeout=0.01)
    async def impatient() -> None:
        ran.append("impatient")

    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    with pytest.raises(TimeoutError):
        await impatient()
    gate.set()
    await holder
    assert ran == []


# -- pickling and copying: by reference, as plain functions ------------------------------


@pytest.mark.parametrize("function", [decorated.settle, decorated.settle_later])
def test_a_decorated_function_pickles_by_reference(function: Any) -> None:
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        assert pickle.loads(pickle.dumps(function, protocol)) is function


def test_a_process_pool_runs_a_decorated_def_in_its_turn_in_the_child() -> None:
    context = multiprocessing.get_context("spawn")  # the child imports support.decorated by name
    with ProcessPoolExecutor(max_workers=2, mp_context=context) as pool:
        first = pool.submit(decorated.settle, 1).result(PATIENCE)
        rest = list(pool.map(decorated.settle, [2, 3], timeout=PATIENCE))
    assert [order_id for order_id, _, _ in [first, *rest]] == [1, 2, 3]
    for _, pid, in_turn in [first, *rest]:
        assert pid != os.getpid()
        assert in_turn  # the child's decorated function, in its own queue's turn


def test_decorated_methods_pickle_as_methods_do() -> None:
    ledger = decorated.Ledger("a")
    Ledger = decorated.Ledger
    for method, args, result in [
        (ledger.post, (5,), "a:5"),  # the instance and the name, as a bound method
        (Ledger.post, (ledger, 6), "a:6"),
        (Ledger.kind, ("b",), "Ledger:b"),  # the class and the name, as a classmethod
        (ledger.kind, ("c",), "Ledger:c"),
        (Ledger.total, (1, 2), 3),
        (ledger.total, (3, 4), 7),
    ]:
        again = pickle.loads(pickle.dumps(method))
        assert again(*args) == result
        assert again.key_of(*args) == method.key_of(*args)
        assert again.queue is decorated.queue


def test_a_local_decorated_function_fails_to_pickle_as_a_local_def_does(
    queue: KeyedQueue,
) -> None:
    @queue.queue_by_key
    def work() -> None: ...

    class Local:
        @queue.queue_by_key
        def method(self) -> None: ...

    # as a plain local def: the error pickle raises for one (its type varies by version)
    with pytest.raises((AttributeError, pickle.PicklingError), match=r"local .*<locals>\.work"):
        pickle.dumps(work)
    with pytest.raises(pickle.PicklingError, match=r"by reference.*<locals>\.Local\.method"):
        pickle.dumps(Local.method)


def test_copying_a_decorated_function_gives_itself_as_for_a_plain_one() -> None:
    assert copy.copy(decorated.settle) is decorated.settle
    assert copy.deepcopy(decorated.settle) is decorated.settle
    ledger = decorated.Ledger("a")
    again = copy.deepcopy(ledger.post)
    assert again(1) == "a:1"
    assert again.key_of(1) == "ledger-a"


# -- bad input --------------------------------------------------------------------------------


def test_a_template_naming_a_missing_parameter_is_refused_at_decoration(
    queue: KeyedQueue,
) -> None:
    with pytest.raises(ValueError, match=r"names 'product'.*take\(\).*product_id, n"):

        @queue.queue_by_key(key="stock-{product}")
        async def take(product_id: str, n: int) -> None:
            pass


def test_a_key_function_that_cannot_take_one_argument_is_refused_at_decoration(
    queue: KeyedQueue,
) -> None:
    # (at the call it failed with "<lambda>() missing 1 required positional argument:
    # 'cents'", which reads as if the call forgot an argument)
    with pytest.raises(TypeError) as raised:

        @queue.queue_by_key(key=lambda user, cents: user)
        async def charge(user: str, cents: int) -> None:
            pass

    message = str(raised.value)
    assert message.startswith("inturn: the key function ")
    assert "<lambda>() in key= of " in message
    assert "charge() takes (user, cents), but is called with one argument" in message
    assert "mapping of " in message
    assert "charge()'s arguments by name (user, cents)" in message
    assert "write it as lambda args: ... args['user'] ..." in message


@pytest.mark.parametrize("option", ["keys=", "keys=[...]"])
def test_a_keys_function_that_cannot_take_one_argument_is_refused_at_decoration(
    queue: KeyedQueue, option: str
) -> None:
    def accounts() -> list[str]:
        return ["a"]

    keys: Any = accounts if option == "keys=" else ["acct-{src}", accounts]
    with pytest.raises(TypeError, match=r"accounts\(\) in keys= of .*move\(\) takes \(\)"):

        @queue.queue_by_key(keys=keys)
        async def move(src: str) -> None:
            pass


def test_a_key_function_of_one_argument_and_defaults_is_taken(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key=lambda args, prefix="user-": f"{prefix}{args['user']}")
    async def charge(user: str) -> None:
        pass

    @queue.queue_by_key(key=operator.itemgetter("user"))  # no signature to check: taken
    async def refund(user: str) -> None:
        pass

    assert charge.key_of("u") == "user-u"
    assert refund.key_of("u") == "u"


def test_a_positional_template_field_is_refused(queue: KeyedQueue) -> None:
    for template in ("k-{}", "k-{0}"):
        with pytest.raises(ValueError, match="positional field"):

            @queue.queue_by_key(key=template)
            async def work(x: int) -> None:
                pass


@pytest.mark.parametrize(
    "template",
    ["k-{n!z}", "k-{n.}", "k-{n[0}", "k-{n[0]x}", "k-{n", "k-n}", "k-{n!r:d}", "k-{n:{n:{n}}}"],
)
def test_a_template_str_format_refuses_is_refused_at_decoration(
    queue: KeyedQueue, template: str
) -> None:
    pattern = rf"key template {re.escape(repr(template))} of .*work\(\) is not a valid format"
    with pytest.raises(ValueError, match=pattern):

        @queue.queue_by_key(key=template)
        async def work(n: int) -> None:
            pass


def test_a_template_may_name_parameters_inside_a_format_spec(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="k-{n:>{width}}")
    async def work(n: int, width: int = 3) -> None:
        pass

    assert work.key_of(7) == "k-  7"
    assert work.key_of(7, 5) == "k-    7"
    with pytest.raises(ValueError, match=r"names 'wide', but .*work\(\) has no parameter"):

        @queue.queue_by_key(key="k-{n:>{wide}}")
        async def work(n: int, width: int = 3) -> None:
            pass

    with pytest.raises(ValueError, match="positional field"):

        @queue.queue_by_key(key="k-{n:>{}}")
        async def work(n: int, width: int = 3) -> None:
            pass


@pytest.mark.parametrize("key", ["stock-{id}", "stock", b"stock", 42, ("a", 1)])
def test_a_key_by_position_is_refused_with_the_fix(queue: KeyedQueue, key: Any) -> None:
    # By position, queue_by_key takes the function to decorate (README): a
    # template there was taken as a key, against the docs and the type hints'
    # intent; refusing it is the one reading that cannot surprise.
    fix = re.escape(f"@queue_by_key(key={key!r})")
    with pytest.raises(TypeError, match=rf"takes the function to decorate by position.*{fix}"):
        queue.queue_by_key(key)
    with pytest.raises(TypeError, match=fix):
        inturn.queue_by_key(key)


def double(n: int) -> int:
    return 2 * n


@pytest.mark.parametrize(
    "callable_",
    [functools.partial(double, 1), operator.itemgetter("id"), functools.cache(double), dict],
)
def test_a_callable_that_is_not_a_def_by_position_is_refused(
    queue: KeyedQueue, callable_: Any
) -> None:
    # It was silently taken for a key function: `@queue_by_key` over a
    # functools.cache'd def returned a decorator instead of a queued function.
    with pytest.raises(TypeError, match=r"a key function goes in key=.*queue_by_key\(\)\(\.\.\.\)"):
        queue.queue_by_key(callable_)


def test_a_callable_that_is_not_a_def_is_decorated_by_the_called_form(queue: KeyedQueue) -> None:
    cached = queue.queue_by_key()(functools.cache(double))
    assert cached(2) == 4
    assert queue.queue_by_key(key="d-{n}")(functools.cache(double)).key_of(3) == "d-3"


def test_key_and_keys_together_are_refused(queue: KeyedQueue) -> None:
    with pytest.raises(TypeError, match="not both"):

        @queue.queue_by_key(key="a", keys=["b"])
        async def work() -> None:
            pass


@pytest.mark.parametrize("keys", ["acct-{a}", b"raw", 42])
def test_keys_of_the_wrong_type_are_refused(queue: KeyedQueue, keys: Any) -> None:
    with pytest.raises(TypeError, match="keys="):

        @queue.queue_by_key(keys=keys)
        async def work(a: int) -> None:
            pass


def test_empty_keys_are_refused(queue: KeyedQueue) -> None:
    with pytest.raises(ValueError, match="at least one key"):

        @queue.queue_by_key(keys=[])
        async def work() -> None:
            pass


def test_an_unhashable_key_spec_is_refused(queue: KeyedQueue) -> None:
    with pytest.raises(TypeError, match="key= takes"):

        @queue.queue_by_key(key=["not", "hashable"])
        async def work() -> None:
            pass


def test_bad_settings_are_refused_at_decoration(queue: KeyedQueue) -> None:
    with pytest.raises(ValueError, match="timeout"):
        queue.queue_by_key(key="k", timeout=-1)
    with pytest.raises(TypeError, match="coalesce"):
        queue.queue_by_key(key="k", coalesce="yes")  # type: ignore[arg-type]


async def test_a_raising_key_callable_propagates_and_queues_nothing(queue: KeyedQueue) -> None:
    called: list[int] = []

    def key(args: Mapping[str, Any]) -> str:
        raise LookupError("no such user")

    @queue.queue_by_key(key=key)
    async def work(n: int) -> None:
        called.append(n)

    with pytest.raises(LookupError, match="no such user"):
        await work(1)
    assert called == []
    assert queue.active_count == 0


async def test_a_call_missing_an_argument_fails_like_python_and_queues_nothing(
    queue: KeyedQueue,
) -> None:
    @queue.queue_by_key(key="stock-{product_id}")
    async def take(product_id: str) -> None:
        pass

    with pytest.raises(TypeError, match="product_id"):
        await take()  # type: ignore[call-arg]
    assert queue.active_count == 0


def test_a_call_that_does_not_fit_the_signature_names_the_function(queue: KeyedQueue) -> None:
    # inspect's bare "missing a required argument: 'product_id'" named no function.
    @queue.queue_by_key(key="stock-{product_id}")
    def take(product_id: str) -> None:
        pass

    @queue.queue_by_key(key="{first}/{rest}")
    async def spread(first: str, *rest: str) -> None:
        pass

    calls: list[tuple[Any, str]] = [
        (lambda: take(), r"take\(\) missing a required argument: 'product_id'"),
        (lambda: take("a", sku="b"), r"take\(\) got an unexpected keyword argument 'sku'"),
        (lambda: spread(), r"spread\(\) missing a required argument: 'first'"),
    ]
    for call, message in calls:
        with pytest.raises(TypeError, match=message):
            call()
    assert queue.active_count == 0


async def test_an_unhashable_computed_key_is_a_clear_type_error(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key=lambda args: args["tags"])
    async def work(tags: list[str]) -> None:
        pass

    with pytest.raises(TypeError, match="unhashable"):
        await work(["a"])
    assert queue.active_count == 0


# -- a call whose arguments the template cannot format ------------------------------------------


class Item:
    """An argument with no ``sku``, and a ``__format__`` that takes no spec."""

    def __format__(self, spec: str) -> str:
        if spec:
            raise ValueError(f"an Item takes no format spec, got {spec!r}")
        return "item"


class Broken:
    """An argument whose ``__format__`` always raises."""

    def __format__(self, spec: str) -> str:
        raise ValueError("a Broken cannot be formatted")


class NotLoaded(Exception):
    """The user's own error, with state of its own."""

    def __init__(self, what: object) -> None:
        super().__init__(f"{what!r} is not loaded")
        self.what = what


class Lazy:
    @property
    def sku(self) -> str:
        raise NotLoaded(self)


class Undecodable:
    def __format__(self, spec: str) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


UNFORMATTABLE = [
    # (template, argument, the original's kind, the field, the original's message)
    ("stock-{item.sku}", Item(), AttributeError, "{item.sku}", "object has no attribute 'sku'"),
    ("order-{item[id]}", {}, KeyError, "{item[id]}", "'id'"),
    ("line-{item[3]}", [0], IndexError, "{item[3]}", "list index out of range"),
    ("row-{item[0]}", 7, TypeError, "{item[0]}", "not subscriptable"),
    ("n-{item:05d}", "x", ValueError, "{item:05d}", "Unknown format code 'd'"),
    ("n-{item:>3}", Item(), ValueError, "{item:>3}", "takes no format spec"),  # __format__ raised
    ("n-{item}", Broken(), ValueError, "{item}", "cannot be formatted"),  # the one-field fast path
]


def check_template_failure(
    error: BaseException | str, template: str, field: str, parameter: str, function: str
) -> None:
    """Check that error's message (or a note) names all that, and says the call did not run."""
    message = error if isinstance(error, str) else error.args[0]  # str(KeyError) is a repr
    assert f"key template {template!r}" in message
    assert f"could not format {field} from parameter {parameter!r}" in message
    assert f"of {function}()" in message
    assert message.endswith("; the call did not run")


@pytest.mark.parametrize(("template", "argument", "kind", "field", "original"), UNFORMATTABLE)
async def test_a_template_the_arguments_cannot_format_fails_the_call_and_names_why(
    queue: KeyedQueue,
    template: str,
    argument: Any,
    kind: type[Exception],
    field: str,
    original: str,
) -> None:
    ran: list[object] = []

    @queue.queue_by_key(key=template)
    async def take(item: Any, n: int = 1) -> None:
        ran.append(item)

    with pytest.raises(kind) as caught:
        take(argument)  # raised by the call itself: no coroutine, no line, no wait
    check_template_failure(caught.value, template, field, "item", take.__qualname__)
    assert type(caught.value) is kind  # an `except AttributeError:` still catches it
    assert type(caught.value.__cause__) is kind
    assert original in str(caught.value.__cause__)
    assert original in str(caught.value)
    assert ran == []
    assert queue.active_count == 0


@pytest.mark.parametrize(("template", "argument", "kind", "field", "original"), UNFORMATTABLE)
def test_a_template_the_arguments_cannot_format_fails_a_plain_def_call(
    queue: KeyedQueue,
    template: str,
    argument: Any,
    kind: type[Exception],
    field: str,
    original: str,
) -> None:
    ran: list[object] = []

    @queue.queue_by_key(key=template)
    def take(item: Any, n: int = 1) -> None:
        ran.append(item)

    with pytest.raises(kind) as caught:
        take(argument)
    check_template_failure(caught.value, template, field, "item", take.__qualname__)
    assert type(caught.value.__cause__) is kind
    assert ran == []
    assert queue.active_count == 0


class Shelf:
    queue = KeyedQueue()

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.name = name

    @queue.queue_by_key(key="{self.name}-{id}")
    async def take(self, id: int) -> int:
        return id

    @queue.queue_by_key(key="{self.name}-{id}")
    def put(self, id: int) -> int:
        return id


async def test_a_method_template_over_a_missing_attribute_of_self_names_self() -> None:
    assert await Shelf("a").take(1) == 1
    for call in (Shelf().take, Shelf().put, Shelf().take.key_of):
        with pytest.raises(
            AttributeError, match="'Shelf' object has no attribute 'name'"
        ) as caught:
            call(2)
        name = "Shelf.put" if call.__name__ == "put" else "Shelf.take"
        check_template_failure(caught.value, "{self.name}-{id}", "{self.name}", "self", name)
    assert Shelf.queue.active_count == 0


def test_a_template_names_the_field_that_failed_among_several(queue: KeyedQueue) -> None:
    class Account:
        id = 1

    @queue.queue_by_key(key="{src.id}-{n}-{dst.id}")
    def move(src: Any, dst: Any, n: int = 0) -> None:
        pass

    assert move.key_of(Account(), Account()) == "1-0-1"
    with pytest.raises(AttributeError) as caught:
        move(Account(), object())
    check_template_failure(
        caught.value, "{src.id}-{n}-{dst.id}", "{dst.id}", "dst", move.__qualname__
    )

    @queue.queue_by_key(keys=["acct-{src.id}", "acct-{dst.id}"])
    def transfer(src: Any, dst: Any) -> None:
        pass

    with pytest.raises(AttributeError) as caught:
        transfer(Account(), object())
    check_template_failure(caught.value, "acct-{dst.id}", "{dst.id}", "dst", transfer.__qualname__)


def test_a_template_over_var_args_that_lack_the_item(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="{rest[0]}/{options[region]}")
    def work(*rest: str, **options: str) -> None:
        pass

    assert work.key_of("a", region="eu") == "a/eu"
    with pytest.raises(IndexError) as caught:
        work(region="eu")
    check_template_failure(
        caught.value, "{rest[0]}/{options[region]}", "{rest[0]}", "rest", work.__qualname__
    )
    with pytest.raises(KeyError) as caught:
        work("a")
    check_template_failure(
        caught.value,
        "{rest[0]}/{options[region]}",
        "{options[region]}",
        "options",
        work.__qualname__,
    )


@pytest.mark.parametrize(
    ("template", "argument", "kind"),
    [
        ("stock-{item.sku}", Lazy(), NotLoaded),  # the user's own error, from a property
        ("stock-{item}", Undecodable(), UnicodeDecodeError),  # a builtin that takes more
    ],
)
async def test_an_error_that_cannot_be_rebuilt_propagates_itself_with_a_note(
    queue: KeyedQueue, template: str, argument: Any, kind: type[Exception]
) -> None:
    ran: list[object] = []

    @queue.queue_by_key(key=template)
    async def take(item: Any) -> None:
        ran.append(item)

    with pytest.raises(kind) as caught:
        take(argument)
    if isinstance(caught.value, NotLoaded):
        assert caught.value.what is argument  # the very error the user's code raised
    assert caught.value.__cause__ is None
    (note,) = caught.value.__notes__
    field = template.removeprefix("stock-")
    check_template_failure(note, template, field, "item", take.__qualname__)
    assert ran == []
    assert queue.active_count == 0


# -- coalescing ---------------------------------------------------------------------------------


async def test_coalesced_calls_share_the_in_flight_result(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    runs: list[str] = []

    @queue.queue_by_key(key="cache-{name}", coalesce=True)
    async def refresh(name: str) -> str:
        runs.append(name)
        await gate.wait()
        return f"{name}@{len(runs)}"

    first = asyncio.create_task(refresh("a"))
    await settle(lambda: runs == ["a"])
    joiners = [asyncio.create_task(refresh("a")) for _ in range(5)]
    other = asyncio.create_task(refresh("b"))  # a different key is not coalesced
    await settle(lambda: runs == ["a", "b"])
    gate.set()
    assert await first == "a@2"
    assert [await j for j in joiners] == ["a@2"] * 5
    assert await other == "b@2"
    assert await refresh("a") == "a@3"  # after it finished, a new call runs again
    assert runs == ["a", "b", "a"]


async def test_coalesced_calls_join_a_call_still_waiting_for_its_turn(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    runs: list[int] = []

    @queue.queue_by_key(key="k", coalesce=True)
    async def refresh(n: int) -> int:
        runs.append(n)
        return n

    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    calls = [asyncio.create_task(refresh(n)) for n in range(3)]
    await settle(lambda: queue.pending("k") == 1)
    gate.set()
    await holder
    assert await asyncio.gather(*calls) == [0, 0, 0]
    assert runs == [0]


async def test_coalesced_calls_raise_the_in_flight_error(queue: KeyedQueue) -> None:
    gate = asyncio.Event()

    @queue.queue_by_key(key="k", coalesce=True)
    async def fail() -> None:
        await gate.wait()
        raise ValueError("shared")

    calls = [asyncio.create_task(fail()) for _ in range(3)]
    await checkpoints(3)
    gate.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, ValueError) for r in results)


async def test_cancelling_a_joiner_affects_nobody_else(queue: KeyedQueue) -> None:
    gate = asyncio.Event()

    @queue.queue_by_key(key="k", coalesce=True)
    async def work() -> str:
        await gate.wait()
        return "done"

    leader = asyncio.create_task(work())
    await checkpoints()
    quitter, stayer = asyncio.create_task(work()), asyncio.create_task(work())
    await checkpoints()
    quitter.cancel()
    await checkpoints()
    gate.set()
    assert await leader == "done"
    assert await stayer == "done"
    assert quitter.cancelled()


async def test_joiners_of_a_cancelled_call_run_it_themselves(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    runs: list[str] = []

    @queue.queue_by_key(key="k", coalesce=True)
    async def work(who: str) -> str:
        runs.append(who)
        await gate.wait()
        return who

    leader = asyncio.create_task(work("leader"))
    await settle(lambda: runs == ["leader"])
    joiners = [asyncio.create_task(work(f"joiner{i}")) for i in range(3)]
    await checkpoints(3)
    leader.cancel()
    await settle(lambda: len(runs) == 2)
    gate.set()
    # The first joiner to resume leads a new run; the others join it.
    assert await asyncio.gather(*joiners) == ["joiner0"] * 3
    assert runs == ["leader", "joiner0"]


async def test_a_coalescing_function_calling_itself_does_not_deadlock(queue: KeyedQueue) -> None:
    @queue.queue_by_key(key="k", coalesce=True)
    async def countdown(n: int) -> int:
        return n if n == 0 else await countdown(n - 1)

    assert await asyncio.wait_for(countdown(3), timeout=5) == 0
