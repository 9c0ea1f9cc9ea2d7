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
import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from slotroute.spec import MissingRoutingError, RoutingSpec
from slotroute.store import RoutedExpertsManager
from slotroute.vllm import LAZY_STORE_ENV, LOGGER_NAME, switch
from slotroute.vllm.blocks import watch

__all__ = ["SlotRouting", "attention_gid", "routing_spec"]

logger = logging.getLogger(LOGGER_NAME)

# The attribute slotroute sets on a SchedulerOutput (vLLM's object, not ours).
_STEP_ATTR = "_slotroute_step"


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
    """

    def __init__(self, store: RoutedExpertsManager, attn_gid: int) -> None:
        self.store = store
        self.attn_gid = attn_gid
        self._step = 0
        # Block ids handed out since the last schedule() returned.
        self._allocated: list[int] = []
        # (step, block ids to invalidate, or (slots, rows) to write) to apply when that
        # step's output arrives, in the order they were queued.
        self._pending: deque[tuple[int, list[int] | tuple[np.ndarray, np.ndarray]]] = deque()
        # The step of the last output that arrived (before_output).
        self._arrived = 0
        # (marker returned by read, the error) for reads that failed in this output.
        self._missing: list[tuple[np.ndarray, MissingRoutingError]] = []
        # Ids of the requests of a step whose routing failed its check, in this output.
        self._failed: set[str] = set()
        # The block pool's BlockPool.evict_blocks, once connect() is called.
        self._evict_cached = None

    @classmethod
    def for_vllm(cls, vllm_config, kv_cache_config) -> SlotRouting:
        """Built as vLLM builds its own manager: the full-attention group's block size,
        the whole block pool, the spec of :func:`routing_spec`; the store committed at
        start unless ``SLOTROUTE_LAZY_STORE=1``."""
        attn_gid = attention_gid(kv_cache_config)
        block_size = kv_cache_config.kv_cache_groups[attn_gid].kv_cache_spec.block_size
        store = RoutedExpertsManager(
            routing_spec(vllm_config), num_blocks=kv_cache_config.num_blocks, block_size=block_size
        )
        routing = cls(store, attn_gid)
        if switch(LAZY_STORE_ENV) == "1":
            logger.info("slotroute: scheduler keeps routing in %r, paged in as steps write it (%s=1)",
                        store, LAZY_STORE_ENV)
            return routing
        # The store's NOTE 4: page faults at start, not in the steps that first write each page.
        started = time.perf_counter()
        committed = store.populate()
        logger.info("slotroute: scheduler keeps routing in %r, %.1f MiB committed in %.0f ms (%s=1 pages it "
                    "in as steps write it)", store, committed / 2**20, 1e3 * (time.perf_counter() - started),
                    LAZY_STORE_ENV)
        return routing

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
        step = self._arrived = getattr(scheduler_output, _STEP_ATTR, self._step)
        if not self._pending:
            return
        while self._pending and self._pending[0][0] <= step:
            change = self._pending.popleft()[1]
            if type(change) is tuple:
                self.store.store_batch(change[1], change[0])
            else:
                self.store.invalidate_blocks(change)

    def blocks_in_flux(self) -> set[int] | None:
        """Between steps, before ``schedule()``: the blocks whose stored routing may
        change before the output of the step scheduled last is stored (handed out in
        that step or since, or with rows queued to be written), or ``None`` while an
        output of an earlier step is still due (rows of its tokens not stored yet).

        The rows of any other block's slots, read now, are what a read of the same
        slots returns when that output arrives: until then only its invalidations and
        rows are stored (NOTE 1), and its rows go to slots of tokens it computed.
        Bounded by the blocks handed out in one step."""
        if self._arrived != self._step - 1:
            return None
        blocks = set(self._allocated)
        for _, change in self._pending:
            if type(change) is tuple:
                blocks.update((np.asarray(change[0]) // self.store.block_size).tolist())
            else:
                blocks.update(change)
        return blocks

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
        blocks ``block_ids``, in an array of its own.

        If some of them has no stored routing, returns an empty marker array instead
        and records the error; :meth:`finish_missing` then fails the request.

        Each result is a fresh array that vLLM frees when it drops it, as its own
        manager's are, not memory written through at start and reused: that took the
        prompt reads' first-touch page faults before any step, but it never freed a
        mapped chunk, so glibc never raised its mmap threshold, and every allocation
        above 128 KiB in the process, vLLM's included, stayed a fresh mapping that
        faults on each page; an engine ran slower with it (docs/vllm.md, the
        scheduler's reads). Nor one array for all the prompts that complete in a step,
        each read a view of it: on an H200 its prompt steps were no faster and the
        front end's joins at finish faulted more (docs/benchmarks.md, prompt reads on
        vLLM 0.28-0.30).

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.get`` for malformed arguments (a vLLM bug).
        """
        try:
            return self.store.get(block_ids, num_tokens, token_start)
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


