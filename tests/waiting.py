"""Waiting for the state a test needs: `wait_for` polls a condition until it holds (and
`wait_for_async` on an event loop), or fails naming what it waited for and the last thing it saw."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.05  # how often a condition is looked at: not a duration any test counts on
SHOWN_CHARS = 2000  # of the last value seen, in a timeout's message


def wait_for(
    condition: Callable[..., Any],
    timeout_s: float = 60.0,
    *,
    value: Callable[[], Any] | None = None,
    what: str | None = None,
    poll_s: float = POLL_S,
    errors: tuple[type[BaseException], ...] = (),
    context: Callable[[], str] | None = None,
) -> Any:
    """Poll until `condition` holds and return what it held on.

    Without `value`: `condition()` is polled, and its first truthy result returned. With `value`:
    `value()` is polled (stats, a reply, a page of metrics) and returned once `condition(it)` is
    true. `errors`: what `value()` or `condition` may raise meaning "not yet" (a server still
    starting). On timeout: AssertionError naming `what` (by default the condition's source), the
    last value or error seen and, if given, `context()` (a server's log)."""
    deadline = time.monotonic() + timeout_s
    while True:
        held, seen = _look(condition, value, errors)
        if held:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(condition, timeout_s, what, seen, context))
        time.sleep(poll_s)


async def wait_for_async(
    condition: Callable[..., Any],
    timeout_s: float = 60.0,
    *,
    value: Callable[[], Any] | None = None,
    what: str | None = None,
    poll_s: float = POLL_S,
    errors: tuple[type[BaseException], ...] = (),
    context: Callable[[], str] | None = None,
) -> Any:
    """`wait_for` on an event loop: the same arguments; `value()` (or `condition()`) may return an
    awaitable (a Ray call, a coroutine), which is awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            seen = condition() if value is None else value()
            if inspect.isawaitable(seen):
                seen = await seen
            held = bool(seen if value is None else condition(seen))
        except errors as error:
            held, seen = False, error
        if held:
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(_timed_out(condition, timeout_s, what, seen, context))
        await asyncio.sleep(poll_s)


async def wait_for_stats(handle: Any, condition: Callable[[dict], Any], timeout_s: float = 60.0):
    """A scheduler actor's stats once `condition(stats)` holds."""
    return await wait_for_async(condition, timeout_s, value=handle.stats.remote)


def _look(
    condition: Callable[..., Any],
    value: Callable[[], Any] | None,
    errors: tuple[type[BaseException], ...],
) -> tuple[bool, Any]:
    """One look: whether the condition holds, and what was seen."""
    try:
        if value is None:
            seen = condition()
            return bool(seen), seen
        seen = value()
        return bool(condition(seen)), seen
    except errors as error:
        return False, error


def _timed_out(
    condition: Callable[..., Any],
    timeout_s: float,
    what: str | None,
    seen: Any,
    context: Callable[[], str] | None,
) -> str:
    shown = repr(seen)
    if len(shown) > SHOWN_CHARS:
        half = SHOWN_CHARS // 2
        shown = f"{shown[:half]} ... {shown[-half:]}"
    message = f"waited {timeout_s} s for {what or _source(condition)}; last saw: {shown}"
    return message + (f"\n{context()}" if context is not None else "")


def _source(condition: Callable[..., Any]) -> str:
    """The condition as its source says it (a lambda: the lines of the call it is written in)."""
    try:
        return " ".join(inspect.getsource(condition).split())[:300]
    except (OSError, TypeError):
        return getattr(condition, "__qualname__", repr(condition))
