"""Replicas behind one front end (``llama-serve --data_parallel N``): the API process's engine
is a :class:`Router` over N :class:`~llama.serve.engine_process.EngineClient` s, one per engine
replica, with the same serving interface (:class:`~llama.serve.protocols.ServedEngine`), so the
endpoints do not change.

Routing (as SGLang's router, approximately): each request goes to the replica that already
caches the longest prefix of its prompt, else to the least loaded.  The router does not ask the
engines what they cache: it remembers what it sent where, as chained hashes of each prompt's
full KV-cache blocks (``block_size`` tokens, keyed by the request's prefix-cache scope as the
engine keys its blocks), which is what a replica's prefix cache can hold of it.  A match counts
only when it covers at least one block; between replicas whose matches are equally long the
least loaded wins (requests in flight, then the replica's index).  The table is bounded
(:data:`KEPT_BLOCKS` per replica, least recently used first out), as an engine's cache is.
``policy="round_robin"`` ignores prefixes (the comparison the benchmark makes).

A replica whose process dies fails its own requests (its client's :class:`EngineDied`); the
router logs it and routes new requests to the others: the server keeps serving while one
replica lives, and exits (status 1, as with one engine) when none is left.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

from llama.serve.engine_process import EngineClient, EngineDied

logger = logging.getLogger(__name__)

KEPT_BLOCKS = 200_000  # block hashes remembered per replica (a few MB)
POLICIES = ("prefix", "round_robin")


def block_hashes(prompt: Sequence[int], scope: Hashable, block_size: int) -> list[bytes]:
    """The chained hashes of ``prompt``'s full blocks: hash k stands for tokens
    ``0 .. (k + 1) * block_size`` in ``scope`` (two prompts share hash k exactly when they share
    those tokens and scope)."""
    out: list[bytes] = []
    previous = hashlib.blake2b(repr(scope).encode(), digest_size=16).digest()
    for end in range(block_size, len(prompt) + 1, block_size):
        block = ",".join(map(str, prompt[end - block_size : end])).encode()
        previous = hashlib.blake2b(previous + block, digest_size=16).digest()
        out.append(previous)
    return out


class _Replica:
    def __init__(self, index: int, client: EngineClient) -> None:
        self.index = index
        self.client = client
        self.alive = True
        self.blocks: OrderedDict[bytes, None] = OrderedDict()  # what it was sent, most recent last

    def in_flight(self) -> int:
        return self.client.in_flight()

    def matched(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > KEPT_BLOCKS:
            self.blocks.popitem(last=False)


class Router:
    """N engine replicas as one engine (see the module's docstring).  ``block_size``: the
    engines' KV-cache block size; ``policy``: ``"prefix"`` or ``"round_robin"``."""

    def __init__(self, clients: Sequence[EngineClient], *, block_size: int = 16, policy: str = "prefix") -> None:
        if not clients:
            raise ValueError("a router needs at least one replica")
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.replicas = [_Replica(k, c) for k, c in enumerate(clients)]
        self.block_size = block_size
        self.policy = policy
        self.max_batch_size = sum(c.max_batch_size for c in clients)
        self.max_seq_len = min(c.max_seq_len for c in clients)
        self.lora = clients[0].lora
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._submitting = threading.Lock()
        self.routed = [0] * len(clients)  # requests sent to each replica
        self.routed_by_prefix = 0  # ... of which for a cached prefix

    # -- the ServedEngine interface --

    def submit(self, prompt_tokens: Sequence[int], settings: Any, on_event: Optional[Callable] = None, *,
               images: Sequence[Any] = ()) -> Any:
        from llama.engine import EngineStopped

        with self._submitting:  # routed and counted in flight together: the next request sees this one's load
            while True:
                replica = self.route(prompt_tokens, getattr(settings, "prefix_scope", None), remember=not images)
                try:
                    return replica.client.submit(prompt_tokens, settings, on_event, images=images)
                except EngineStopped:
                    if not replica.client.failed:
                        raise
                    # its engine died after it was routed to (its reader thread has not marked it yet):
                    # another replica takes the request (route() passes over it from now on)

    def stats(self) -> dict:
        """The replicas' stats summed (numbers), with each one's under ``"replicas"`` (a dead one: ``{}``)."""
        per = [r.client.stats() if r.alive else {} for r in self.replicas]
        total: dict = {"queued": 0, "running": 0, "slots_in_use": 0}  # (every replica dead: still these)
        for stats in per:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        total["replicas"] = per
        return total

    @contextlib.contextmanager
    def arriving(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:  # (which replica it goes to is known once it is tokenised)
            for replica in self.replicas:
                if replica.alive:
                    stack.enter_context(replica.client.arriving())
            yield

    def run_forever(self, should_stop: threading.Event) -> None:
        """Each replica's client reads on a thread of its own; returns once ``should_stop`` is set and
        every replica stopped; raises :class:`EngineDied` once every replica has died."""
        every_replica_died = threading.Event()

        def read(replica: _Replica) -> None:
            try:
                replica.client.run_forever(should_stop)
            except EngineDied as e:
                replica.alive = False
                left = sum(r.alive for r in self.replicas)
                logger.error("replica %d stopped on an error (%s): its requests failed; %d replica(s) left",
                             replica.index, e, left)
                if not left:
                    every_replica_died.set()

        threads = [threading.Thread(target=read, args=(r,), name=f"replica-{r.index}", daemon=True)
                   for r in self.replicas]
        for t in threads:
            t.start()
        while not should_stop.is_set() and not every_replica_died.is_set():
            should_stop.wait(0.1)
        for t in threads:
            t.join()
        if every_replica_died.is_set() and not should_stop.is_set():
            raise EngineDied("every engine replica died")

    # -- routing --

    def route(self, prompt: Sequence[int], scope: Hashable = None, *, remember: bool = True) -> _Replica:
        """The replica for ``prompt`` (and records that it holds its blocks); EngineStopped when none is alive."""
        with self._lock:
            # a replica whose engine died is passed over as soon as its client knows, before the
            # reader thread that marks it (run_forever) has run
            alive = [r for r in self.replicas if r.alive and not r.client.failed]
            if not alive:
                from llama.engine import EngineStopped

                raise EngineStopped("every engine replica has stopped")
            hashes = block_hashes(prompt, scope, self.block_size) if self.policy == "prefix" else []
            if self.policy == "round_robin":
                chosen = alive[next(self._turn) % len(alive)]
            else:
                matches = {r.index: r.matched(hashes) for r in alive}
                chosen = min(alive, key=lambda r: (-matches[r.index], r.in_flight(), r.index))
                if matches[chosen.index]:
                    self.routed_by_prefix += 1
                if remember:
                    chosen.remember(hashes)
            self.routed[chosen.index] += 1
            return chosen
