"""The scheduler's routing core, the same on every vLLM generation: slotroute's slot
store sized to vLLM's KV block pool, kept in the order of the data.

vLLM 0.28-0.30 call a routed-experts manager from the scheduler
(``slotroute/vllm/scheduler.py`` adapts to it), vLLM 0.31+ an aux-output connector
(``slotroute/vllm/connector.py``); both adapters are thin layers over one
:class:`SlotRouting`, which holds what they share: the store, the block
invalidations and queued writes of each step applied when that step's output arrives
(NOTE 1), a failed step's blocks dropped, and reads that miss failing their request
alone. ``docs/vllm.md`` gives the full argument, including async scheduling and
prefix-cache hits.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from slotroute.spec import MissingRoutingError, RoutingSpec
from slotroute.store import RoutedExpertsManager
from slotroute.vllm import LAZY_STORE_ENV, LOGGER_NAME, READ_POOL_ENV
from slotroute.vllm.blocks import watch

__all__ = ["SlotRouting", "attention_gid", "routing_spec"]

logger = logging.getLogger(LOGGER_NAME)

# The attribute slotroute sets on a SchedulerOutput (vLLM's object, not ours).
_STEP_ATTR = "_slotroute_step"

# The size of _ResultPool's chunks, but a read larger than this gets a chunk of its size:
# small, so that one result kept long holds back little memory from reuse.
CHUNK_BYTES = 1 << 20
# How much of _ResultPool's memory vLLM 0.28-0.30's scheduler writes through at start
# (never more than the store holds): a rollout of 256 prompts of 1,024 tokens at 384
# bytes a token keeps 96 MiB of prompt rows alive at once.
RESERVE_BYTES = 256 << 20


def routing_spec(vllm_config) -> RoutingSpec:
    """The spec vLLM's own capturer uses (``_get_routed_experts_shape`` in
    ``routed_experts_capturer.py``): ``num_layers`` counts every decoder layer, as
    vLLM 0.28-0.30 number them (dense layers included).

    Raises
    ------
    ValueError
        If the model config gives no valid spec (not a MoE model).
    """
    model = vllm_config.model_config
    return RoutingSpec(
        num_layers=model.get_total_num_hidden_layers(),
        top_k=model.get_num_experts_per_tok(),
        num_experts=model.get_num_experts(),
    )


def attention_gid(kv_cache_config) -> int:
    """The KV cache group whose slots key routing: the first full-attention group, as
    vLLM 0.28-0.30's ``get_routed_experts_attn_gid`` picks it (0.31 dropped that
    function; ``is_full_attention_spec`` is in ``vllm/v1/kv_cache_interface.py`` from
    0.29 on, 0.28 tests the class).

    Raises
    ------
    ValueError
        If no group is full attention.
    """
    try:
        from vllm.v1.kv_cache_interface import is_full_attention_spec
    except ImportError:  # vLLM 0.28
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        def is_full_attention_spec(spec) -> bool:
            return isinstance(spec, FullAttentionSpec)

    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if is_full_attention_spec(group.kv_cache_spec):
            return gid
    raise ValueError("slotroute keys routing by the slots of a full-attention KV cache group; this model has none")


class _ResultPool:
    """Memory for the reads :meth:`SlotRouting.read` hands to vLLM: chunks whose pages
    are written once, when the chunk is made, each handed out front to back in spans,
    one per read.

    Invariant: a chunk is handed out from its start again only when no view of it is
    alive. A read's result is a view of its span (numpy collapses every view's
    ``base`` to the chunk, so each holds one reference to it), and anything that keeps
    the rows keeps that view: vLLM's front end until the request finishes (0.28-0.30
    concatenate a request's rows when it finishes), a separate engine core's output
    thread until the message is sent (its zero-copy frames hold the array's buffer).

    NOTE 1: vLLM 0.28-0.30 read the whole prompt of each request whose prefill
    completes (1,024 rows of 384 bytes is 384 KiB), each into a new array, and keep it
    until the request finishes. Memory the process has not written before takes a page
    fault per 4 KiB on its first write, several times the copy itself, and a rollout's
    prompts are all alive at once, so under any allocator their results are new memory:
    100 faults a read on an H200's host. :meth:`reserve` writes chunks through at start,
    so those faults are taken once, before any step; a chunk whose results were all
    dropped is reused. Chunks are kept, at most ``limit`` bytes of them (past it a read
    gets an array of its own), as the store keeps its buffer.
    """

    __slots__ = ("_row_shape", "_dtype", "_row_bytes", "_chunks", "_array", "_offset", "_next", "_chunk_bytes",
                 "_limit", "_idle_refs", "nbytes", "past")

    def __init__(self, spec: RoutingSpec, chunk_bytes: int, limit: int) -> None:
        self._row_shape, self._dtype, self._row_bytes = spec.token_shape, spec.storage_dtype, spec.bytes_per_token
        self._chunks: list[np.ndarray] = []  # uint8, each at least chunk_bytes long
        self._array: np.ndarray | None = None  # the chunk spans come from now
        self._offset = 0
        self._next = 0  # where the search for a free chunk starts: after the last one handed out
        self._chunk_bytes, self._limit = chunk_bytes, limit
        self._idle_refs = 0  # sys.getrefcount of a chunk no view of which is alive, measured on the first
        self.nbytes = 0  # bytes the pool holds
        self.past = 0  # takes that found no span: every chunk that would fit in use, the pool at its limit

    def take(self, rows: int) -> np.ndarray | None:
        """A C-contiguous ``(rows, num_layers, top_k)`` array of the storage dtype on a
        span of a chunk (its values are whatever the span held), or ``None`` where
        ``rows`` is not positive, or every chunk that would fit it is in use and the
        pool is at its limit."""
        nbytes = rows * self._row_bytes
        if rows <= 0:
            return None
        start = self._offset
        if self._array is None or start + nbytes > len(self._array):
            self._array = self._free_chunk(nbytes)
            if self._array is None:
                self.past += 1
                return None
            start = 0
        self._offset = start + -(-nbytes // 64) * 64  # each span on whole cache lines
        return self._array[start:start + nbytes].view(self._dtype).reshape(rows, *self._row_shape)

    def _refs(self, chunk: np.ndarray) -> int:
        """References to ``chunk`` but the current chunk's: called alike wherever it
        is compared with ``_idle_refs``, each view adds one."""
        return sys.getrefcount(chunk) - (chunk is self._array)

    def reserve(self, nbytes: int) -> None:
        """Make chunks, each written through (NOTE 1), until the pool holds at least
        ``nbytes`` or its limit allows no more."""
        while self.nbytes < nbytes and self._add_chunk(self._chunk_bytes) is not None:
            pass

    def _free_chunk(self, nbytes: int) -> np.ndarray | None:
        """A chunk of at least ``nbytes`` no view of which is alive, searched from the
        one after the last handed out (results are mostly dropped in the order they
        were read), a new one where none is and the limit allows, else ``None``."""
        count = len(self._chunks)
        for i in range(count):
            index = (self._next + i) % count
            chunk = self._chunks[index]
            if len(chunk) >= nbytes and self._refs(chunk) <= self._idle_refs:
                self._next = index + 1
                return chunk
        chunk = self._add_chunk(max(nbytes, self._chunk_bytes))
        self._next = len(self._chunks)
        return chunk

    def _add_chunk(self, size: int) -> np.ndarray | None:
        if size <= 0 or self.nbytes + size > self._limit:
            return None
        chunk = np.empty(size, dtype=np.uint8)
        chunk.fill(0)  # NOTE 1: its page faults now, once
        self._chunks.append(chunk)
        self.nbytes += size
        if len(self._chunks) == 1:
            self._idle_refs = self._refs(chunk)
        return chunk


class SlotRouting:
    """The scheduler's routing: a slotroute
    :class:`~slotroute.store.RoutedExpertsManager` sized to the whole KV block pool,
    written and invalidated in the order of the data.

    Invariant: when the output of step ``s`` is read, a slot holds the routing of the
    token whose KV the slot held when step ``s`` ran, or its read raises
    :class:`MissingRoutingError`. A read never raises into vLLM: a miss is recorded
    and its request finished with an error by :meth:`finish_missing`.

    NOTE 1: a block handed out by ``BlockPool.get_new_blocks`` during ``schedule()``
    of step ``s`` is invalidated when the output of step ``s`` arrives, just before
    that step's routing is stored. Earlier outputs (async scheduling keeps one step in
    flight) still belong to the block's previous owner and are stored and read as
    such; the new owner's tokens are written by step ``s`` or later.

    Parameters
    ----------
    store
        The slot store, sized to the KV block pool of the full-attention group.
    attn_gid
        Index of that group among the KV cache groups.
    read_pool
        Whether :meth:`read`'s results land in reused memory (``_ResultPool``); if not,
        each gets an array of its own.
    """

    def __init__(self, store: RoutedExpertsManager, attn_gid: int, read_pool: bool = True) -> None:
        self.store = store
        self.attn_gid = attn_gid
        self._step = 0
        # Block ids handed out since the last schedule() returned.
        self._allocated: list[int] = []
        # (step, block ids to invalidate, or (slots, rows) to write) to apply when that
        # step's output arrives, in the order they were queued.
        self._pending: deque[tuple[int, list[int] | tuple[np.ndarray, np.ndarray]]] = deque()
        # (marker returned by read, the error) for reads that failed in this output.
        self._missing: list[tuple[np.ndarray, MissingRoutingError]] = []
        # Ids of the requests of a step whose routing failed its check, in this output.
        self._failed: set[str] = set()
        # The block pool's BlockPool.evict_blocks, once connect() is called.
        self._evict_cached = None
        # Where read() puts its results: never more than the store holds, which bounds
        # the prompt rows of the requests in flight.
        limit = store.num_slots * store.spec.bytes_per_token if read_pool else 0
        self._results = _ResultPool(store.spec, min(CHUNK_BYTES, limit), limit)

    @classmethod
    def for_vllm(cls, vllm_config, kv_cache_config, prompt_reads: bool = False) -> SlotRouting:
        """Built as vLLM builds its own manager: the full-attention group's block size,
        the whole block pool, the spec of :func:`routing_spec`. With ``prompt_reads``
        (vLLM 0.28-0.30's scheduler, whose whole-prompt reads :meth:`read` serves), the
        memory those reads land in is written through at start as well, at most
        ``RESERVE_BYTES`` (``_ResultPool``'s NOTE 1), unless the store is paged in lazily;
        with ``SLOTROUTE_READ_POOL=0`` each read gets an array of its own instead."""
        attn_gid = attention_gid(kv_cache_config)
        block_size = kv_cache_config.kv_cache_groups[attn_gid].kv_cache_spec.block_size
        store = RoutedExpertsManager(
            routing_spec(vllm_config), num_blocks=kv_cache_config.num_blocks, block_size=block_size
        )
        pooled = os.environ.get(READ_POOL_ENV) != "0"
        reserve = prompt_reads and pooled
        if prompt_reads and not pooled:
            logger.info("slotroute: each prompt read gets an array of its own (%s=0)", READ_POOL_ENV)
        routing = cls(store, attn_gid, read_pool=pooled)
        if os.environ.get(LAZY_STORE_ENV) == "1":
            logger.info("slotroute: scheduler keeps routing in %r, paged in as steps write it (%s=1)",
                        store, LAZY_STORE_ENV)
            return routing
        # The store's NOTE 4: page faults at start, not in the steps that first write each page.
        started = time.perf_counter()
        committed = store.populate()
        reserved = routing.reserve_reads() if reserve else 0
        logger.info("slotroute: scheduler keeps routing in %r, %.1f MiB committed in %.0f ms%s (%s=1 pages it "
                    "in as steps write it)", store, (committed + reserved) / 2**20,
                    1e3 * (time.perf_counter() - started),
                    f", {reserved / 2**20:.1f} MiB of it for prompt reads" if reserve else "", LAZY_STORE_ENV)
        return routing

    def reserve_reads(self) -> int:
        """Write through the memory :meth:`read`'s results land in, up to
        ``RESERVE_BYTES`` and never more than the store holds (``_ResultPool``'s NOTE 1);
        the bytes it holds."""
        self._results.reserve(RESERVE_BYTES)
        return self._results.nbytes

    def read_pool(self) -> tuple[int, int]:
        """The bytes of memory :meth:`read`'s results land in, and how many reads found
        none of it free (each got an array of its own, as before the pool)."""
        return self._results.nbytes, self._results.past

    def connect(self, block_pool) -> None:
        """Watch vLLM's block pool: blocks it hands out for new data are invalidated
        in step order (NOTE 1), and blocks a failed step wrote leave its prefix cache
        (:meth:`fail_step`)."""
        self._evict_cached = watch(block_pool, self.on_new_blocks)

    # -- step ordering (NOTE 1) ---------------------------------------------------

    def on_new_blocks(self, blocks: Iterable) -> None:
        """Record blocks ``BlockPool.get_new_blocks`` hands out for new data."""
        self._allocated += [block.block_id for block in blocks]

    def seal_step(self, scheduler_output) -> None:
        """Tag a step scheduled just now and queue its block invalidations."""
        self._step += 1
        setattr(scheduler_output, _STEP_ATTR, self._step)
        if self._allocated:
            self._pending.append((self._step, self._allocated))
            self._allocated = []

    def write_after_allocation(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """Queue ``rows`` to be stored at ``slots`` (blocks handed out in the step
        being scheduled, whose KV is loaded from outside the block pool) when that
        step's output arrives, after the invalidation of the blocks handed out so far
        and before that of any block handed out later (NOTE 1).

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.store_batch``, checked now; nothing is queued.
        """
        self.store.check_batch(rows, slots)
        if self._allocated:
            self._pending.append((self._step + 1, self._allocated))
            self._allocated = []
        self._pending.append((self._step + 1, (slots, rows)))

    def before_output(self, scheduler_output) -> None:
        """Apply the invalidations and queued writes of every step up to this
        output's, in the order they were queued; most steps queue none (one
        emptiness check).

        An output with no tag (not seen by ``seal_step``) applies all of them: early
        invalidation can only turn a read into an error, never into stale data.
        """
        if not self._pending:
            return
        step = getattr(scheduler_output, _STEP_ATTR, self._step)
        while self._pending and self._pending[0][0] <= step:
            change = self._pending.popleft()[1]
            if type(change) is tuple:
                self.store.store_batch(change[1], change[0])
            else:
                self.store.invalidate_blocks(change)

    def fail_step(self, scheduler_output, slot_mapping, error: str = "") -> None:
        """A step whose routing failed the worker's check: drop the blocks it wrote (a
        later read of them raises) and fail every request of the step in this output
        (:meth:`finish_missing`), so that each fails alone and the engine serves on.
        The blocks also leave vLLM's prefix cache (``BlockPool.evict_blocks``, as vLLM
        does for a failed KV load): a later request with the same prefix recomputes
        them instead of hitting blocks whose routing is gone. A request that hit them
        before this output arrived fails alone at its read."""
        blocks = np.unique(np.asarray(slot_mapping, dtype=np.int64) // self.store.block_size)
        logger.error(
            "slotroute: a step's routing failed its check; its %d requests' routing is dropped%s",
            len(scheduler_output.num_scheduled_tokens), f": {error}" if error else " (the worker logged why)",
        )
        blocks = blocks[(blocks >= 0) & (blocks < self.store.num_blocks)]
        self.store.invalidate_blocks(blocks)
        if self._evict_cached is not None:
            self._evict_cached(set(blocks.tolist()))
        self._failed.update(scheduler_output.num_scheduled_tokens)

    # -- reads ----------------------------------------------------------------------

    def read(self, block_ids, num_tokens: int, token_start: int = 0) -> np.ndarray:
        """Routing of a request's tokens ``token_start .. num_tokens - 1`` over its
        blocks ``block_ids`` (a copy).

        If some of them has no stored routing, returns an empty marker array instead
        and records the error; :meth:`finish_missing` then fails the request.

        The rows land in a chunk of memory that is reused once every earlier result
        on it has been dropped (:class:`_ResultPool`): a view, of memory nothing else
        writes while the result is alive; an array of its own where the pool is full.

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.get`` for malformed arguments (a vLLM bug).
        """
        try:
            return self.store.get(block_ids, num_tokens, token_start, self._results.take(num_tokens - token_start))
        except MissingRoutingError as error:
            return self.missing(error)

    def missing(self, error) -> np.ndarray:
        """Record ``error`` (a :class:`MissingRoutingError` or its message) for a read
        that failed; the empty marker returned stands for the read's rows."""
        if not isinstance(error, MissingRoutingError):
            error = MissingRoutingError(str(error))
        marker = np.empty((0, *self.store.spec.token_shape), dtype=self.store.spec.storage_dtype)
        self._missing.append((marker, error))
        return marker

    def finish_missing(self, scheduler, outputs: dict) -> None:
        """Fail every request whose read missed in this output, and every request of
        a failed step (:meth:`fail_step`) that has an output in it; two emptiness
        checks when there is none.

        Its output loses the marker and gets ``finish_reason=ERROR`` (the OpenAI server
        answers 500); a request still running is finished with ``FINISHED_ERROR``.
        """
        if not self._missing and not self._failed:
            return
        from vllm.v1.engine import FinishReason
        from vllm.v1.request import RequestStatus

        errors = {id(marker): error for marker, error in self._missing}
        failed, self._failed = self._failed, set()
        self._missing = []
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                error = errors.get(id(output.routed_experts))
                if error is None and output.request_id in failed:
                    error = MissingRoutingError("the routing of a step it ran failed the worker's check")
                if error is None:
                    continue
                logger.error("slotroute: request %s failed: %s", output.request_id, error)
                output.routed_experts = None
                output.finish_reason = FinishReason.ERROR
                scheduler.finish_requests(output.request_id, RequestStatus.FINISHED_ERROR)


