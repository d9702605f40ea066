"""Short garbage-collection pauses in long-running processes: what startup built leaves the
collector's view.

A full (generation 2) collection walks every object the collector tracks. A process that has
imported torch, transformers and Ray, and loaded a model or a tokenizer, holds hundreds of thousands
of them: full collections in the bench driver, the scheduler and the workers took 50–370 ms each
(measured with `gc.callbacks` while they started). Python runs one only when the long-lived objects
have grown by a quarter, so while serving they are rare, but each is one long gap in every stream
the process serves. `gc.freeze()` after startup moves those objects into a permanent generation that
collections skip, as vLLM and SGLang do; what is made while serving is collected as before. Frozen
objects that later become cyclic garbage are never freed, so only processes that live as long as
what they serve freeze for good: the actors and the ingress. A benchmark's timed run unfreezes when
it ends (`startup_frozen`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_objects() -> None:
    """Collect what startup left behind, then freeze the rest out of later collections."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def startup_frozen() -> Iterator[None]:
    """For a stretch of serving inside a process that lives on (a benchmark's timed run, in a CLI or
    a test process): frozen while it lasts, collectable again after."""
    freeze_startup_objects()
    try:
        yield
    finally:
        gc.unfreeze()
