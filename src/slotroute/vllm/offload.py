"""Routing follows KV out of the block pool and back, on vLLM 0.31-0.33.

A KV transfer connector serves a prefix hit with KV from outside the block pool:
vLLM's ``OffloadingConnector`` (``vllm/distributed/kv_transfer/kv_connector/v1/
offloading/scheduler.py``) copies chunks of a request's KV blocks to a host tier,
keyed by block hash, and loads them into newly allocated blocks on a later hit;
LMCache and the like bring KV from their own stores. Routing, kept by KV slot
(:class:`~slotroute.vllm.connector.ConnectorRouting`), would have nothing for those
tokens.

:class:`ExternalHits` caps such a hit to the tokens whose routing slotroute holds, so
the rest is recomputed and its routing captured fresh: never zeros, never stale rows.
With no offloading connector that holds nothing, and every external hit is
recomputed. :class:`OffloadRouting` holds the routing of the offloaded chunks in a
:class:`~slotroute.tier.RoutingTier` keyed as the offload tier keys their KV, and
writes it into the slots of the blocks a hit loads into: those tokens are served from
the host tier with exact routing.

The scheduler asks for the cap itself on vLLM 0.33 (``cap_external_hit`` of its
aux-output connector); on 0.31-0.32, :func:`follow_kv` caps the connector's own
``get_num_new_matched_tokens``.
"""

from __future__ import annotations

import functools
import logging
from collections import deque

import numpy as np

from slotroute.spec import MissingRoutingError
from slotroute.tier import RoutingTier
from slotroute.vllm import LOGGER_NAME

__all__ = ["ExternalHits", "OffloadRouting", "follow_kv"]

logger = logging.getLogger(LOGGER_NAME)


def _never_raises(fallback=None):
    """A hook vLLM's scheduler calls never stops the engine: an error is logged and
    ``fallback`` returned. Each hook's fallback is safe: a hit capped to nothing is
    recomputed; rows not captured make their chunk's hits recomputed; rows not queued
    for a load make the loading request fail alone at its read."""

    def decorate(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                logger.exception("slotroute: the offload tier's %s failed; the hits it concerns are recomputed "
                                 "or fail alone", method.__name__)
                return fallback

        return guarded

    return decorate


class ExternalHits:
    """Caps a KV connector's prefix hit to the tokens whose routing is held: none.

    Parameters
    ----------
    routing
        The scheduler's :class:`~slotroute.vllm.connector.ConnectorRouting`.
    """

    def __init__(self, routing) -> None:
        self.routing = routing

    def cap(self, request, num_local: int, num_external: int) -> int:
        """Tokens of a hit of ``num_external`` tokens after the request's
        ``num_local`` cached ones to load: none."""
        return 0

    def capture(self, scheduler_output, finished: bool) -> None:
        """Nothing is captured."""

    def loading(self, request, num_external: int) -> None:
        """Nothing is loaded."""

    def forget(self, req_id: str) -> None:
        """Nothing is kept per request."""


class OffloadRouting(ExternalHits):
    """The routing of the chunks vLLM's offloading connector holds in its host tier,
    in a :class:`~slotroute.tier.RoutingTier` under the same keys.

    Invariant: a chunk's rows are readable in the tier only while the offload tier
    holds the chunk's KV from the store they were captured for; a hit loads only
    tokens whose rows are readable (:meth:`cap`), and their rows are written into the
    slots of the blocks the KV is loaded into before any step reads those slots.

    NOTE 1 (capture): the offloading scheduler builds a chunk's store job in the
    ``build_connector_meta`` of step ``s`` (``manager.prepare_store``, wrapped here),
    for tokens computed up to and including step ``s``; the worker copies the KV at the
    start of step ``s + 1``, and the store completes (``manager.complete_store``) at
    that step's output or later. So the rows are read from the slot store at the
    output of step ``s``: for a running request after the step's rows are stored, as
    step ``s`` wrote some; for a finished one (its blocks freed, and maybe handed out
    again in step ``s``) before that step's invalidations, as every row was stored by
    an earlier output. A chunk whose read misses is not held: a hit on it is
    recomputed.

    NOTE 2 (load): a hit loads the KV of tokens ``num_local .. num_local +
    num_external - 1`` into blocks handed out in the step being scheduled
    (``update_state_after_alloc``, wrapped here). Their rows are queued to be written
    when that step's output arrives, after the invalidation of those new blocks
    (:meth:`~slotroute.vllm.routing.SlotRouting.write_after_allocation`); the
    request's first read of them is at an output after its load finished, later.

    Parameters
    ----------
    routing
        The scheduler's :class:`~slotroute.vllm.connector.ConnectorRouting`.
    connector_scheduler
        The offloading connector's scheduler side (``OffloadingConnectorScheduler``).
    group
        Its ``GroupOffloadConfig`` of the KV cache group routing is keyed by.
    make_key
        vLLM's ``make_offload_key`` (block hash, group index -> key).
    capacity
        The offload tier's capacity in chunks, or ``None``.
    """

    def __init__(self, routing, connector_scheduler, group, make_key, capacity: int | None) -> None:
        super().__init__(routing)
        self.tier = RoutingTier(routing.store.spec, capacity)
        self._scheduler = connector_scheduler
        self._group_idx = group.group_idx
        self._group_pos = [g.group_idx for g in connector_scheduler.config.kv_group_configs].index(group.group_idx)
        self._tokens_per_chunk = group.tokens_per_chunk
        self._hashes_per_chunk = group.hashes_per_chunk
        self._blocks_per_chunk = group.tokens_per_chunk // group.tokens_per_block
        self._make_key = make_key
        # (scheduler output, [(key, first token, block ids, request finished)]) whose
        # rows are read at that output (NOTE 1), in step order.
        self._captures: deque[tuple[object, list]] = deque()
        self._building = None
        # Request id -> the local hit its capped external hit starts at (NOTE 2).
        self._hit_starts: dict[str, int] = {}
        self.stats = {"tokens_loaded": 0, "tokens_capped": 0, "chunks_captured": 0, "chunks_missed": 0}

    # -- the hit -------------------------------------------------------------------

    def chunk_key(self, request, chunk: int):
        """The offload key of the request's chunk ``chunk`` (its last hash block's
        hash in routing's group), or ``None`` if the request has no hash there yet."""
        index = (chunk + 1) * self._hashes_per_chunk - 1
        hashes = request.block_hashes
        return self._make_key(hashes[index], self._group_idx) if index < len(hashes) else None

    @_never_raises(fallback=0)
    def cap(self, request, num_local: int, num_external: int) -> int:
        """Tokens of the hit to load: from ``num_local`` on, up to the first chunk whose
        rows the tier cannot return, at most ``num_external``. Bounded by a dict
        lookup per chunk of the hit."""
        if num_external <= 0:
            return 0
        end = num_local + num_external
        size = self._tokens_per_chunk
        position = num_local
        while position < end:
            chunk = position // size
            key = self.chunk_key(request, chunk)
            if key is None or key not in self.tier:
                break
            position = (chunk + 1) * size
        held = min(position, end) - num_local
        if held < num_external:
            self.stats["tokens_capped"] += num_external - held
            status = self._scheduler._req_status.get(request.request_id)
            if getattr(status, "partial_tail_boundary", None) is not None:  # the hit's partial tail is not loaded
                status.partial_tail_boundary = None
        if held:
            self._hit_starts[request.request_id] = num_local
        return held

    @_never_raises()
    def loading(self, request, num_external: int) -> None:
        """The connector loads ``num_external`` tokens of the request's hit into its
        blocks (NOTE 2): queue their rows for those blocks' slots."""
        start = self._hit_starts.pop(request.request_id, None)
        if not num_external or start is None:
            return
        routing = self.routing
        block_size = routing.store.block_size
        blocks = routing._req_blocks.get(request.request_id) or ()
        size = self._tokens_per_chunk
        end = start + num_external
        slots, rows = [], []
        position = start
        while position < end:
            chunk = position // size
            key = self.chunk_key(request, chunk)
            entry = None if key is None else self.tier.get(key)
            stop = min((chunk + 1) * size, end)
            if entry is None or stop > len(blocks) * block_size:
                # Not held after all: these tokens stay unwritten, and a read of them
                # fails the request alone.
                logger.error("slotroute: request %s loads KV whose routing is not held", request.request_id)
                break
            first, held = entry
            positions = np.arange(position, stop)
            first_block = position // block_size
            ids = np.fromiter((block.block_id for block in blocks[first_block : (stop - 1) // block_size + 1]), np.int64)
            slots.append(ids[positions // block_size - first_block] * block_size + positions % block_size)
            rows.append(held[position - first : stop - first])
            position = stop
        if slots:
            routing.core.write_after_allocation(np.concatenate(slots), np.concatenate(rows))
            self.stats["tokens_loaded"] += position - start

    def forget(self, req_id: str) -> None:
        """A request left before its hit was loaded."""
        self._hit_starts.pop(req_id, None)

    # -- the store ---------------------------------------------------------------------

    def building(self, scheduler_output) -> None:
        """The connector builds the store jobs of this step (NOTE 1)."""
        self._building = scheduler_output

    @_never_raises()
    def storing(self, keys, req_context) -> None:
        """The offload tier accepted a store of these keys' KV for a request: each
        awaits its rows, to be read at the output of the step being built."""
        keys = [key for key in keys if self._is_routing_key(key)]
        if not keys:
            return
        self.tier.expect(keys)
        status = self._scheduler._req_status.get(req_context.req_id)
        if status is None or self._building is None:
            return
        group = status.group_states[self._group_pos]
        wanted = set(keys)
        found = []
        per = self._blocks_per_chunk
        for chunk in range(len(group.offload_keys) - 1, -1, -1):
            key = group.offload_keys[chunk]
            if key not in wanted:
                continue
            wanted.discard(key)
            block_ids = group.block_ids[chunk * per : (chunk + 1) * per]
            if len(block_ids) == per and 0 not in block_ids:
                found.append((key, chunk * self._tokens_per_chunk, list(block_ids), status.req.is_finished()))
            if not wanted:
                break
        if not found:
            return
        if self._captures and self._captures[-1][0] is self._building:
            self._captures[-1][1].extend(found)
        else:
            self._captures.append((self._building, found))

    def _is_routing_key(self, key) -> bool:
        """Whether an offload key (a block hash, then the group index in 4 bytes,
        ``vllm/v1/kv_offload/base.py``) is of routing's KV cache group."""
        return int.from_bytes(key[-4:], "big") == self._group_idx

    @_never_raises()
    def capture(self, scheduler_output, finished: bool) -> None:
        """Read into the tier the rows of the chunks whose store jobs were built with
        this step (NOTE 1), and any left from earlier steps: first (``finished``,
        before the step's invalidations) those of finished requests, then the rest
        (after the step's rows are stored)."""
        captures = self._captures
        if not any(output is scheduler_output for output, _ in captures):
            return
        if finished:
            for output, chunks in captures:
                for chunk in chunks:
                    if chunk[3]:
                        self._capture_one(*chunk[:3])
                chunks[:] = [chunk for chunk in chunks if not chunk[3]]
                if output is scheduler_output:
                    return
        while captures:
            output, chunks = captures.popleft()
            for chunk in chunks:
                self._capture_one(*chunk[:3])
            if output is scheduler_output:
                return

    def _capture_one(self, key, first: int, block_ids: list[int]) -> None:
        try:
            rows = self.routing.store.get(block_ids, self._tokens_per_chunk)
        except MissingRoutingError:
            self.stats["chunks_missed"] += 1
            return
        if self.tier.put(key, first, rows):
            self.stats["chunks_captured"] += 1

# -- wiring ------------------------------------------------------------------------


def follow_kv(scheduler, routing, caps_in_scheduler: bool) -> ExternalHits | None:
    """Connect routing to the scheduler's KV transfer connector, if it has one: an
    :class:`OffloadRouting` over vLLM's offloading connector, else an
    :class:`ExternalHits` that recomputes every external hit. ``caps_in_scheduler``:
    vLLM asks ``routing.cap_external_hit`` itself (0.33); otherwise the connector's
    ``get_num_new_matched_tokens`` is capped here."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return None
    hits = _offload_routing(connector, routing) or ExternalHits(routing)
    if not caps_in_scheduler:
        _cap_matches(connector, routing)
    logger.info("slotroute: KV connector %s: %s", type(connector).__name__,
                "routing follows its host tier" if isinstance(hits, OffloadRouting) else "its hits are recomputed")
    return hits


def _offload_routing(connector, routing) -> OffloadRouting | None:
    """An :class:`OffloadRouting` wired into ``connector`` if it is vLLM's offloading
    connector with the parts NOTE 1 and 2 of :class:`OffloadRouting` read."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
        from vllm.v1.kv_offload.base import make_offload_key
    except ImportError:
        return None
    if not isinstance(connector, OffloadingConnector) or connector.connector_scheduler is None:
        return None
    scheduler = connector.connector_scheduler
    groups = [g for g in scheduler.config.kv_group_configs if g.group_idx == routing.attn_gid]
    manager = scheduler.manager
    if not groups or not hasattr(scheduler, "_req_status") or groups[0].tokens_per_block != routing.store.block_size:
        logger.warning("slotroute: this offloading connector's layout is not the one slotroute reads; "
                       "its hits are recomputed")
        return None
    capacity = getattr(manager, "_num_chunks", None)  # CPUOffloadingManager's pool, in chunks
    hits = OffloadRouting(routing, scheduler, groups[0], make_offload_key, capacity if isinstance(capacity, int) else None)
    _wrap(scheduler, "build_connector_meta", lambda original: _building(original, hits))
    _wrap(scheduler, "update_state_after_alloc", lambda original: _loading(original, hits))
    _wrap(manager, "prepare_store", lambda original: _prepare_store(original, hits))
    _wrap(manager, "complete_store", lambda original: _complete_store(original, hits))
    _wrap(manager, "reset_cache", lambda original: _reset_cache(original, hits))
    return hits


def _wrap(obj, name: str, make) -> None:
    """Replace ``obj.name`` (a bound method) on this instance only."""
    setattr(obj, name, make(getattr(obj, name)))


def _building(original, hits: OffloadRouting):
    def build_connector_meta(scheduler_output):
        hits.building(scheduler_output)
        try:
            return original(scheduler_output)
        finally:
            hits.building(None)

    return build_connector_meta


def _loading(original, hits: OffloadRouting):
    def update_state_after_alloc(request, blocks, num_external_tokens):
        result = original(request, blocks, num_external_tokens)
        hits.loading(request, num_external_tokens)
        return result

    return update_state_after_alloc


def _prepare_store(original, hits: OffloadRouting):
    def prepare_store(keys, req_context):
        output = original(keys, req_context)
        if output is not None:
            hits.tier.drop(output.evicted_keys)
            hits.storing(output.keys_to_store, req_context)
        return output

    return prepare_store


def _complete_store(original, hits: OffloadRouting):
    def complete_store(keys, req_context, success: bool = True):
        result = original(keys, req_context, success)
        (hits.tier.complete if success else hits.tier.fail)(keys)
        return result

    return complete_store


def _reset_cache(original, hits: OffloadRouting):
    def reset_cache():
        result = original()
        hits.tier.clear()
        hits._captures.clear()
        return result

    return reset_cache


def _cap_matches(connector, routing) -> None:
    """vLLM 0.31-0.32: cap the hit ``connector.get_num_new_matched_tokens`` reports to
    what ``routing.cap_external_hit`` admits (vLLM 0.33 asks the latter itself)."""
    original = connector.get_num_new_matched_tokens

    def get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs):
        num_external, load_async = original(request, num_computed_tokens, *args, **kwargs)
        if not num_external:
            return num_external, load_async
        num_external = routing.cap_external_hit(request, num_computed_tokens, num_external)
        return num_external, load_async and num_external > 0

    connector.get_num_new_matched_tokens = get_num_new_matched_tokens
