"""Which cell a request goes to: the ingress chooses (prefix affinity, else the less loaded of two)
among running cells.

The ingress places requests on cells itself, straight to each cell's scheduler actor (`ServeCells`),
so a burst costs a submission per cell, not a Serve call per request. `CellChooser` is the policy:
each ingress replica remembers which cell it last sent each prompt block to (the block names of the
prefix cache: equal names, equal prefixes), so a conversation's next turn and prompts sharing a
system prompt meet the cell whose workers hold their KV. When that cell has `imbalance` more open
requests than the least loaded one, or no prefix is known, it takes the less loaded of two random
cells (power of two choices). A cell's load is the requests this ingress replica has open there.

Which cells run, Serve says: the `Cell` deployment's request router (deploy/serving/cell_router.py),
which lives in each ingress replica, records them here (`set_live`), for `live_cells`.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from scheduler.block_pool import block_names
from scheduler.request import Request

# app name -> the running Cell replicas' ids, as Serve last said
_LIVE: dict[str, tuple[str, ...]] = {}


def set_live(app_name: str, cells: Iterable[str]) -> None:
    _LIVE[app_name] = tuple(sorted(cells))


def live_cells(app_name: str) -> tuple[str, ...] | None:
    """The running cells of an app (replica ids), or None before Serve has said (no call went
    through yet)."""
    return _LIVE.get(app_name)


class CellChooser:
    def __init__(self, imbalance: int = 8, max_blocks: int = 1 << 16) -> None:
        self.imbalance = imbalance
        self.max_blocks = max_blocks
        # block name -> cell it was sent to, LRU
        self.owners: OrderedDict[bytes, str] = OrderedDict()

    def choose(self, request: Request, cells: list[str], load: Mapping[str, int]) -> str:
        """The cell for a request among `cells` (not empty), given each one's open requests."""
        live = set(cells)
        owner = next(
            (
                self.owners[n]
                for n in reversed(block_names(request))
                if n in self.owners and self.owners[n] in live
            ),
            None,
        )
        if (
            owner is not None
            and load.get(owner, 0) - min(load.get(c, 0) for c in cells) <= self.imbalance
        ):
            return owner
        return min(random.sample(cells, min(2, len(cells))), key=lambda c: load.get(c, 0))

    def placed(self, request: Request, cell: str) -> None:
        for name in block_names(request):
            self.owners[name] = cell
            self.owners.move_to_end(name)
        while len(self.owners) > self.max_blocks:
            self.owners.popitem(last=False)

    def forget(self, cell: str) -> None:
        for name in [n for n, owner in self.owners.items() if owner == cell]:
            del self.owners[name]
