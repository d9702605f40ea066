"""The cell router's choices without Serve: prefix affinity, its load guard, and what it forgets."""

import asyncio
from types import SimpleNamespace
from typing import NamedTuple

from ray.serve._private.request_router.common import ReplicaQueueLengthCache
from ray.serve.request_router import PendingRequest

from deploy.serving.cell_router import CellRouter
from scheduler.request import Request


def router(imbalance=4):
    r = object.__new__(CellRouter)  # Serve builds routers with a deployment's wiring; the policy needs none
    r._replica_queue_len_cache = ReplicaQueueLengthCache()
    r.initialize_state(imbalance=imbalance)
    return r


class Rid(NamedTuple):  # a ReplicaID's part the router reads
    unique_id: str


def cells(*names):
    return [SimpleNamespace(replica_id=Rid(name)) for name in names]


def pending(prompt, avoid=()):
    """A `Cell.run` call's pending request (made inside a running event loop, as its future needs one)."""
    return PendingRequest(args=[Request("x", prompt, 4)], kwargs={"avoid": avoid}, metadata=None)


async def choose(r, candidates, prompt, avoid=()):
    return await r.choose_replicas(candidates, pending(prompt, avoid))


def test_a_prompt_goes_where_its_longest_known_prefix_went():
    asyncio.run(_prefix_affinity())


async def _prefix_affinity():
    r, (a, b, c) = router(), cells("a", "b", "c")
    system = list(range(100, 148))  # three full blocks shared by every conversation
    r.on_request_routed(pending(system + [1] * 40), Rid("a"), None)
    r.on_request_routed(pending(system + [2] * 40), Rid("b"), None)
    assert await choose(r, [a, b, c], system + [2] * 40 + [9] * 20) == [[b]]  # the deeper match wins
    assert await choose(r, [a, b, c], system + [3] * 20) == [[b]]  # only the shared part known: its latest cell
    picked = await choose(r, [a, b, c], [7] * 64)  # nothing known: two random cells, Serve takes the less loaded
    assert len(picked) == 1 and len(picked[0]) == 2 and set(map(id, picked[0])) <= {id(a), id(b), id(c)}


def test_a_busier_cell_loses_its_affinity_and_a_dead_one_is_avoided_then_forgotten():
    asyncio.run(_load_guard())


async def _load_guard():
    r, (a, b) = router(imbalance=4), cells("a", "b")
    prompt = list(range(64))
    r.on_request_routed(pending(prompt), Rid("a"), None)
    r._replica_queue_len_cache.update(Rid("a"), 9)
    r._replica_queue_len_cache.update(Rid("b"), 5)
    assert await choose(r, [a, b], prompt) == [[a]]  # 4 more open requests: still within the guard
    r._replica_queue_len_cache.update(Rid("b"), 4)
    assert len((await choose(r, [a, b], prompt))[0]) == 2  # 5 more: balanced instead
    assert await choose(r, [b], prompt) == [[b]]  # a is no candidate (gone or draining): never chosen
    r._replica_queue_len_cache.update(Rid("b"), 9)
    assert await choose(r, [a, b], prompt, avoid=("a",)) == [[b]]  # the ingress saw a die: Serve may not yet
    assert await choose(r, [a], prompt, avoid=("a",)) == []  # then nothing, until Serve has a live cell
    r._forget(Rid("a"))  # what on_replica_actor_died does after Serve's own bookkeeping
    assert not r.owners
