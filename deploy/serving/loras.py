"""The LoRA adapters a server answers to by name: those of --lora-modules and those loaded at run
time (`POST /v1/load_lora_adapter`), kept where every ingress replica of the app reads them."""

from __future__ import annotations

import json
import logging
from typing import Any

from scheduler.request import LoraRef
from workers.lora import LoraError, check_adapter

log = logging.getLogger(__name__)


class LoraNames:
    """Adapter names → LoraRef. With a `store` name (the Serve app's), the names live in Ray's
    internal key-value store under it, so a load or an unload on one ingress replica holds for
    all of them (and for a replica started later); without one (the batch job), in this object.
    `base_config` (the served model's Hugging Face config) and `max_rank` check an adapter before
    its name is taken; None (tests of the HTTP layer alone): not checked."""

    def __init__(
        self,
        configured: dict[str, LoraRef] | None = None,
        store: str | None = None,
        base_config: Any = None,
        max_rank: int = 16,
        enabled: bool = False,
    ) -> None:
        self.store = store
        self.base_config = base_config
        self.max_rank = max_rank
        self.enabled = enabled or bool(configured)
        self.local: dict[str, LoraRef] = {}
        for ref in (configured or {}).values():
            self.check(ref)
            self._put(ref, overwrite=True)

    def check(self, ref: LoraRef) -> None:
        """LoraError with the reason if the adapter cannot be served on this model."""
        if self.base_config is not None:
            check_adapter(ref, self.base_config, self.max_rank)

    def get(self, name: str) -> LoraRef | None:
        if self.store is None:
            return self.local.get(name)
        from ray.experimental import internal_kv

        value = internal_kv._internal_kv_get(self._key(name))
        return None if value is None else LoraRef(name, json.loads(value)["path"])

    def all(self) -> dict[str, LoraRef]:
        if self.store is None:
            return dict(self.local)
        from ray.experimental import internal_kv

        prefix = self._key("")
        keys = internal_kv._internal_kv_list(prefix)
        names = sorted(key.decode()[len(prefix.decode()) :] for key in keys)
        return {name: ref for name in names if (ref := self.get(name)) is not None}

    def load(self, name: str, path: str) -> LoraRef:
        """Take a new adapter's name; LoraError (with the reason) if it cannot be served or the
        name is taken."""
        if not self.enabled:
            raise LoraError("LoRA adapters are not served here: start with --enable-lora")
        if self.get(name) is not None:
            raise LoraError(f"The LoRA adapter {name!r} has already been loaded.")
        ref = LoraRef(name, path)
        self.check(ref)
        if not self._put(ref, overwrite=False):
            raise LoraError(f"The LoRA adapter {name!r} has already been loaded.")
        log.info("LoRA adapter %s loaded from %s", name, path)
        return ref

    def unload(self, name: str) -> bool:
        """Give up a name: new requests for it are refused, running ones finish. False if no
        adapter has it."""
        if self.get(name) is None:
            return False
        if self.store is None:
            del self.local[name]
        else:
            from ray.experimental import internal_kv

            internal_kv._internal_kv_del(self._key(name))
        log.info("LoRA adapter %s unloaded", name)
        return True

    def _put(self, ref: LoraRef, overwrite: bool) -> bool:
        if self.store is None:
            if not overwrite and ref.name in self.local:
                return False
            self.local[ref.name] = ref
            return True
        from ray.experimental import internal_kv

        value = json.dumps({"path": ref.path})
        existed = internal_kv._internal_kv_put(self._key(ref.name), value, overwrite=overwrite)
        return overwrite or not existed

    def _key(self, name: str) -> bytes:
        return f"pdserve:{self.store}:lora:{name}".encode()
