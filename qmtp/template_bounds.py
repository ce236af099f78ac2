"""Bounds on running a chat template: a template is data that comes with a downloaded checkpoint, so compiling and
rendering it must end, in bounded time and memory, with either text or one error.

A Jinja template runs as Python code, in two kinds of steps: Python bytecode (a loop, a macro call), which a
watchdog thread stops at a deadline by raising an exception in the rendering thread (this works in any thread,
unlike `signal.alarm`, and costs nothing while the render runs), and whose calls are counted against a nesting
depth; and single C calls (`2 ** 2 ** 40`, `'a' * 10 ** 10`, `'x'.center(10 ** 10)`),
which nothing can stop once started, so their size is predicted from their operands and refused before they run.
That covers every operator (`+ - * / // % **` and `~`), every call of a built-in method, every filter, and the
constant folding Jinja does while compiling (switched off: the compiler evaluates no expression of the template).
What a render writes is counted as it streams. Any exception from inside the template ends as one `TemplateError`.

The bounds are a setting (`TemplateLimits`, module default `LIMITS`): tests shrink them to stay fast.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import string
import threading
import time
import types

from .errors import TemplateError, TemplateTimeoutError

__all__ = ["LIMITS", "TemplateLimits", "bounded", "bounded_filters", "check_output", "environment_class", "refuse"]



@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """`seconds`: wall time of one compile or render; `chars`: the most characters a render may write, and the
    largest string or list any one step may build; `depth`: the most template frames (macro calls, recursive
    loops, blocks) active at once; `int_bits`: the largest integer arithmetic may make (4096 bits, about 1,233
    digits: Python refuses to print integers past 4,300 digits anyway)."""

    seconds: float = 10.0
    chars: int = 16 * 1024 * 1024
    depth: int = 100
    int_bits: int = 4096

    def __post_init__(self):
        for name in ("seconds", "chars", "depth", "int_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
                raise TemplateError(f"TemplateLimits.{name}={value!r} must be a positive number")


LIMITS = TemplateLimits()


class LimitExceeded(BaseException):
    """Raised inside a render to stop it; a BaseException so that no `except Exception` in Jinja's runtime or in a
    filter swallows it. `bounded` turns it into a TemplateError."""


_state = threading.local()  # .limits: the bounds of the render running in this thread


def current_limits() -> TemplateLimits:
    return getattr(_state, "limits", None) or LIMITS


class DeadlinePassed(LimitExceeded):
    """Raised asynchronously in a rendering thread by the watchdog when its time is up."""


class _Watch:
    """One watched render: its deadline, its thread, and whether the watchdog has claimed it (and fired)."""

    __slots__ = ("deadline", "thread", "fired")

    def __init__(self):
        self.deadline, self.thread, self.fired = float("inf"), None, False


class _Watchdog:
    """One daemon thread that raises DeadlinePassed in a thread still rendering at its deadline
    (`PyThreadState_SetAsyncExc`: Python delivers it at the thread's next bytecode, so a loop that emits nothing
    stops too, in any thread, and a render that ends in time costs only a registration).

    An exception that arrives while its thread holds a lock leaks the lock when it lands between the acquire and
    the `with` body (it did: the watchdog's own lock, and every later render in the process hung). So a rendering
    thread takes the lock only in `watch`, before the watchdog can fire at it; `finish` takes none: the watchdog
    and `finish` race to pop the watch from the dict (one atomic step), and a watch the watchdog won is waited
    out until it has fired, then withdrawn."""

    def __init__(self):
        self._lock = threading.Condition()
        self._watched: dict[_Watch, None] = {}
        self._thread: threading.Thread | None = None
        self._wakes_at = float("inf")  # when the watchdog looks next: a later deadline needs no waking it

    def watch(self, token: _Watch, seconds: float) -> None:
        """Watch this thread under `token` (the caller's, so that `finish` finds it even when the deadline
        strikes before this returns)."""
        token.deadline, token.thread = time.monotonic() + seconds, threading.get_ident()
        with self._lock:  # the watchdog looks again only once this is released: nothing can fire in here
            self._watched[token] = None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="qmtp-template-watchdog", daemon=True)
                self._thread.start()
            if token.deadline < self._wakes_at:
                self._wakes_at = token.deadline
                self._lock.notify()

    def finish(self, token: _Watch) -> None:
        """Stop watching; an exception fired but not yet delivered is withdrawn, so it cannot strike later. A
        DeadlinePassed may still arrive in here: the caller calls this again until it returns."""
        if self._watched.pop(token, False) is None or token.thread is None:
            return  # disarmed in time (or never armed): nothing was fired
        while not token.fired:  # the watchdog claimed it and fires next
            time.sleep(0)
        _set_async_exception(token.thread, None)

    def _run(self):
        with self._lock:
            while True:
                now = time.monotonic()
                for token in list(self._watched):
                    if token.deadline <= now and self._watched.pop(token, False) is None:  # claimed here
                        _set_async_exception(token.thread, DeadlinePassed)
                        token.fired = True
                self._wakes_at = min((token.deadline for token in list(self._watched)), default=float("inf"))
                self._lock.wait(self._wakes_at - now if self._wakes_at < float("inf") else None)


def _set_async_exception(thread_id: int, exception) -> None:
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exception) if exception is not None else None)


_WATCHDOG = _Watchdog()


def bounded(limits: TemplateLimits, what: str, work):
    """`work()` run in this thread under `limits`: stopped at its deadline by the watchdog, its calls counted
    against the depth bound; what it raises, or its running out of a bound, is one TemplateError saying `what`
    failed."""
    outer = getattr(_state, "limits", None), getattr(_state, "sizes", None), getattr(_state, "depth", 0)
    _state.limits, _state.sizes, _state.depth = limits, {}, 0
    token = _Watch()
    try:
        try:
            _WATCHDOG.watch(token, limits.seconds)
            return work()
        except DeadlinePassed:
            raise TemplateTimeoutError(f"{what}: ran past its time limit of {limits.seconds:g} s") from None
        except LimitExceeded as err:
            raise TemplateError(f"{what}: {err}") from None
        except RecursionError:
            raise TemplateError(f"{what}: nests too deeply for Python (a recursive macro, or thousands of nested "
                                f"blocks)") from None
        except MemoryError:
            raise TemplateError(f"{what}: ran out of memory") from None
    except DeadlinePassed:  # the deadline struck while another error was being reported
        raise TemplateTimeoutError(f"{what}: ran past its time limit of {limits.seconds:g} s") from None
    finally:
        while True:  # the deadline may strike as this begins (it fires once a token: the retry is safe)
            try:
                _WATCHDOG.finish(token)
                break
            except DeadlinePassed:
                continue
        _state.limits, _state.sizes, _state.depth = outer


def enter_call() -> None:
    """A template's call begins (a macro, a recursive loop, a method): past the depth bound, it stops."""
    _state.depth = depth = getattr(_state, "depth", 0) + 1
    if depth > current_limits().depth:
        _state.depth -= 1
        refuse(f"nests calls deeper than {current_limits().depth} (a macro or loop that recurses?)")


def leave_call() -> None:
    _state.depth -= 1


# ---- sizes predicted before a C call runs ----------------------------------------------------------------------
def refuse(message: str):
    """Stop the render in progress with `message` (what the template did)."""
    raise LimitExceeded(message)


def _expanded_size(value) -> int:
    """How many characters and items `value` spells out when printed or compared: a list that holds another list
    twice counts it twice (`[l, l]` doubled sixty times is small in memory, but printing it would never end).
    Sizes are remembered per object for the render (objects kept alive so that their ids stay theirs), so each
    new list costs its own items only."""
    if isinstance(value, (str, bytes)):
        return len(value) + 1
    if not isinstance(value, (list, tuple, dict)):
        return 1
    sizes = getattr(_state, "sizes", None)
    if sizes is None:
        sizes = _state.sizes = {}
    known = sizes.get(id(value))
    if known is not None and known[0] is value:
        return known[1]
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    size = 1 + sum(_expanded_size(item) for item in items)
    sizes[id(value)] = (value, size)
    return size


def _check_size(value):
    """`value` itself, refused when it is a string longer, a list or dict larger (spelled out), or an integer
    wider, than the bounds."""
    kind = type(value)
    if kind is bool or kind is float or kind is int and -1 << 64 < value < 1 << 64 or value is None:
        return value  # the common case, at once
    limits = current_limits()
    if kind is str and len(value) <= limits.chars:
        return value
    if isinstance(value, (str, bytes)) and len(value) > limits.chars:
        refuse(f"builds a {type(value).__name__} of {len(value):,} characters, more than its limit of "
                f"{limits.chars:,}")
    if isinstance(value, (list, tuple, dict)) and _expanded_size(value) > limits.chars:
        refuse(f"builds a {type(value).__name__} that spells out more than its limit of {limits.chars:,} items "
                f"and characters")
    if type(value) is int and value.bit_length() > limits.int_bits:
        refuse(f"builds an integer of {value.bit_length():,} bits, more than its limit of {limits.int_bits:,}")
    return value


def _check_length(length: int, what: str) -> None:
    limits = current_limits()
    if length > limits.chars:
        refuse(f"{what} would build {length:,} items, more than its limit of {limits.chars:,}")


def _check_int_arguments(name: str, args, kwargs) -> None:
    """A number argument of a built-in call is a width, a count or a length: past the size bound it would
    build (or spin over) more than a render may."""
    limit = current_limits().chars
    for value in (*args, *kwargs.values()):
        if type(value) is int and abs(value) > limit:
            refuse(f"calls {name} with {value if value.bit_length() < 64 else 'a huge number'}, past its size "
                    f"limit of {limit:,}")


def _sized(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_binop(operator: str, left, right) -> None:
    limits = current_limits()
    if operator == "**" and type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
        if right * left.bit_length() > limits.int_bits * 2:  # |left| ** right has at least (bits - 1) * right bits
            refuse(f"computes an integer of about {right * (left.bit_length() - 1):,} bits, more than its limit of "
                    f"{limits.int_bits:,}")
    elif operator == "*":
        if type(left) is int and type(right) is int:
            if left.bit_length() + right.bit_length() > limits.int_bits + 1:
                refuse(f"computes an integer of about {left.bit_length() + right.bit_length():,} bits, more than "
                        f"its limit of {limits.int_bits:,}")
        elif isinstance(right, int) and _sized(left) or isinstance(left, int) and _sized(right):
            count, sequence = (right, left) if isinstance(right, int) else (left, right)
            _check_length(len(sequence) * max(count, 0), "repeating a sequence")
    elif operator == "+" and _sized(left) and _sized(right):
        _check_length(len(left) + len(right), "joining two sequences")
    elif operator == "%" and isinstance(left, str):
        _check_printf(left, right if isinstance(right, tuple) else (right,))


_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")


def _check_printf(template: str, args) -> None:
    """`template % args`: a field's width or precision (`%099999999d`) pads to that many characters."""
    widths = [int(n) for m in _PRINTF_FIELD.finditer(template) for n in m.groups() if n]
    _check_int_arguments("a %-format", widths, {})
    _check_int_arguments("a %-format", args if isinstance(args, tuple) else (), {})


_FORMAT_NUMBER = re.compile(r"\d+")


def _check_format_spec(template: str) -> None:
    """str.format's fields: a width or precision in a spec (`{:>999999999}`) pads to that many characters."""
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError:
        return  # str.format raises it itself
    specs = [spec for _, _, spec, _ in fields if spec]
    if any("{" in spec for spec in specs):  # `{:>{}}`: a width taken from an argument, unseen until it runs
        refuse("formats with a width or precision taken from an argument ({:{}})")
    _check_int_arguments("a format string", [int(n) for spec in specs for n in _FORMAT_NUMBER.findall(spec)], {})


def _check_str_method(method, args, kwargs) -> None:
    """The str methods whose result is a product of their inputs' sizes."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, str):
        return
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        old, new = args[0], args[1]
        found = len(owner) + 1 if not old else owner.count(old)
        _check_length(len(owner) + found * max(len(new) - len(old), 0), "str.replace")
    elif name == "join" and args and hasattr(args[0], "__len__"):
        parts = args[0]
        sized = sum(_sized(p) for p in parts) if isinstance(parts, (list, tuple)) else len(parts)
        _check_length(sized + len(owner) * max(len(parts) - 1, 0), "str.join")
    elif name == "translate" and args and isinstance(args[0], dict):
        widest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        _check_length(len(owner) * max(widest, 1), "str.translate")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if type(tab) is int:
            _check_length(len(owner) * max(tab, 1), "str.expandtabs")
    elif name in ("format", "format_map"):
        _check_format_spec(owner)


# ---- filters -----------------------------------------------------------------------------------------------------
def _bounded_filter(name: str, function):
    """`function` (a filter) with its number arguments bounded, its product-sized cases predicted, and its result
    checked."""

    @functools.wraps(function)
    def checked(*args, **kwargs):
        values = [a for a in args if isinstance(a, (str, list, tuple, int, float, dict))]
        _check_int_arguments(f"the filter {name}", values[1:], kwargs)
        if values and isinstance(values[0], str):
            subject = values[0]
            if name == "replace" and len(values) >= 3:
                _check_str_method(subject.replace, values[1:3], {})
            elif name == "indent":
                width = values[1] if len(values) > 1 else kwargs.get("width", 4)
                pad = width if type(width) is int else _sized(width)
                _check_length(len(subject) + (subject.count("\n") + 1) * pad, "the filter indent")
            elif name == "format":
                _check_printf(subject, tuple(values[1:]))
        elif name == "round" and len(values) > 1 and type(values[1]) is int:
            if abs(values[1]) > current_limits().int_bits:  # an int rounds through 10 ** -precision
                refuse(f"rounds to {values[1]} digits, past its limit of {current_limits().int_bits}")
        if name == "join" and values and isinstance(values[0], (list, tuple, str)):
            sep = values[1] if len(values) > 1 and isinstance(values[1], str) else kwargs.get("d", "")
            _check_str_method(str(sep).join, (values[0],), {})
        elif name == "sum" and values and isinstance(values[0], (list, tuple)):
            if not all(isinstance(v, (int, float)) for v in values[0]):  # summing lists copies quadratically
                refuse("sums items that are not numbers")
        return _check_size(function(*args, **kwargs))

    return checked


def bounded_filters(filters: dict) -> dict:
    return {name: _bounded_filter(name, f) for name, f in filters.items()}


# ---- the environment ---------------------------------------------------------------------------------------------
@functools.cache
def environment_class():
    """An ImmutableSandboxedEnvironment whose operators, calls and string formatting are bounded, and whose
    compiler evaluates nothing of the template (no constant folding: `{{ 2 ** 2 ** 40 }}` would hang compiling)."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def _output_child_to_const(self, node, frame, finalize):
            if not isinstance(node, nodes.TemplateData):  # the rest is evaluated when rendering, under bounds
                raise nodes.Impossible()
            return super()._output_child_to_const(node, frame, finalize)

        def visit_List(self, node, frame):  # a literal list, tuple or dict: its size spelled out is bounded
            self._checked(super().visit_List, node, frame)

        def visit_Tuple(self, node, frame):
            if node.ctx != "load":  # `{% for a, b in ... %}`: a target, not a value
                return super().visit_Tuple(node, frame)
            self._checked(super().visit_Tuple, node, frame)

        def visit_Dict(self, node, frame):
            self._checked(super().visit_Dict, node, frame)

        def _checked(self, visit, node, frame):
            self.write("environment.checked(")
            visit(node, frame)
            self.write(")")

        def visit_Concat(self, node, frame):  # `a ~ b`, bounded like `+`
            self.write("environment.concat((")
            for part in node.nodes:
                self.visit(part, frame)
                self.write(", ")
            self.write("))")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return _check_size(super().call_binop(context, operator, left, right))

        def checked(self, value):
            return _check_size(value)

        def concat(self, parts):
            texts = [str(_check_size(p)) for p in parts]
            _check_length(sum(len(t) for t in texts), "joining strings with ~")
            return "".join(texts)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's convention: no name clash)
            if isinstance(__obj, (types.BuiltinFunctionType, types.BuiltinMethodType)) or getattr(
                    __obj, "__name__", "") in ("format", "format_map"):
                _check_int_arguments(getattr(__obj, "__name__", "a function"), args, kwargs)
                _check_str_method(__obj, args, kwargs)
            enter_call()
            try:
                return _check_size(super().call(__context, __obj, *args, **kwargs))
            finally:
                leave_call()

        def getattr(self, obj, attribute):
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_format_spec(obj)
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            if isinstance(obj, str) and argument in ("format", "format_map"):
                _check_format_spec(obj)
            return super().getitem(obj, argument)

    return BoundedEnvironment


def check_output(value):
    """The environment's `finalize`: what a `{{ ... }}` prints is bounded before it is turned into text (a large
    integer from the messages prints as Python allows, up to 4,300 digits)."""
    return value if type(value) is int else _check_size(value)
