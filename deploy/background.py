"""Background tasks that belong to a client or a replica, not to the request whose call happened to
start them."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any


def background(work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """A task of its own (the client's, a cell replica's), in a fresh context: not in the context of
    whichever caller's request started it (in a Serve replica that context carries the request's id,
    and Serve's router tells concurrent calls apart by it)."""
    return asyncio.get_running_loop().create_task(work, context=contextvars.Context())
