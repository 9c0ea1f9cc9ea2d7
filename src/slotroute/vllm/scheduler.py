"""Scheduler side: vLLM's scheduler keeps routing in slotroute's store.

vLLM 0.28-0.30 already call a routed-experts manager from the scheduler
(``vllm/v1/core/sched/scheduler.py``): ``store_batch`` once per step in
``update_from_output``, then ``get`` of the whole prompt when a request's prefill
completes. slotroute puts :class:`SchedulerRouting` in that place and adds what vLLM
lacks: KV blocks handed out for new data are invalidated, so a read of routing that
was not stored for the reader's tokens raises instead of returning zeros, and a
request hit by such a read finishes with an error.

Invalidation follows the order of the data, not of scheduling (NOTE 1 in
:class:`SchedulerRouting`); ``docs/vllm.md`` gives the full argument, including
async scheduling and prefix-cache hits.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

import numpy as np

from slotroute.spec import MissingRoutingError, RoutingSpec
from slotroute.store import RoutedExpertsManager
from slotroute.vllm import LOGGER_NAME
from slotroute.vllm.blocks import BLOCK_POOL_PATCHES, watch
from slotroute.vllm.patches import Patch

__all__ = ["SchedulerRouting", "is_failed_step", "scheduler_patches"]

logger = logging.getLogger(LOGGER_NAME)

SCHEDULER = "vllm.v1.core.sched.scheduler"
# The attribute slotroute sets on a SchedulerOutput (vLLM's object, not ours).
_STEP_ATTR = "_slotroute_step"


def is_failed_step(data: np.ndarray, slot_mapping: np.ndarray) -> bool:
    """Whether a step shipped in vLLM 0.28-0.30's ``RoutedExpertsLists`` is a worker's
    report of a step that failed its check: no rows for the slots it wrote."""
    return data.shape[0] == 0 and slot_mapping.shape[0] > 0


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


class SchedulerRouting:
    """The scheduler's routed-experts manager: vLLM's interface over a slotroute
    :class:`~slotroute.store.RoutedExpertsManager` sized to the whole KV block pool.

    Invariant: when ``update_from_output`` of step ``s`` reads a slot, the slot holds
    the routing of the token whose KV the slot held when step ``s`` ran, or the read
    raises :class:`MissingRoutingError`. ``get`` never raises into vLLM: a missing read
    is recorded and the request finished with an error by :meth:`finish_missing`.

    NOTE 1: a block handed out by ``BlockPool.get_new_blocks`` during ``schedule()``
    of step ``s`` is invalidated at the start of ``update_from_output`` of step ``s``,
    just before that step's routing is stored. Earlier outputs (async scheduling keeps
    one step in flight) still belong to the block's previous owner and are stored and
    read as such; the new owner's tokens are written by step ``s`` or later.

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
        # (marker returned by get, the error) for reads that failed in this output.
        self._missing: list[tuple[np.ndarray, MissingRoutingError]] = []
        # Ids of the requests of a step whose routing failed its check, in this output.
        self._failed: set[str] = set()
        # The block pool's BlockPool.evict_blocks, once connect() is called.
        self._evict_cached = None

    @classmethod
    def for_vllm(cls, vllm_config, kv_cache_config, **extra) -> SchedulerRouting:
        """Build it as vLLM builds its own manager: the full-attention group's block
        size, the whole block pool, the spec of :func:`routing_spec`; ``extra`` goes to
        the constructor (a subclass's own arguments)."""
        attn_gid = attention_gid(kv_cache_config)
        block_size = kv_cache_config.kv_cache_groups[attn_gid].kv_cache_spec.block_size
        store = RoutedExpertsManager(
            routing_spec(vllm_config), num_blocks=kv_cache_config.num_blocks, block_size=block_size
        )
        logger.info("slotroute: scheduler keeps routing in %r", store)
        return cls(store, attn_gid, **extra)

    @property
    def routed_experts_by_slot(self) -> np.ndarray:
        """The store's slot buffer: a read-only view (vLLM reads only its dtype)."""
        return self.store.routed_experts_by_slot

    # -- vLLM's interface ---------------------------------------------------------

    def store_batch(self, data: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Store one step's routing (see ``RoutedExpertsManager.store_batch``); a failed
        step (:func:`is_failed_step`) stores nothing: :meth:`fail_step` dropped its blocks.

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.store_batch``: the worker sent a malformed step.
        """
        if is_failed_step(data, slot_mapping):
            return
        self.store.store_batch(data, slot_mapping)

    def connect(self, block_pool) -> None:
        """Watch vLLM's block pool: blocks it hands out for new data are invalidated
        in step order (NOTE 1), and blocks a failed step wrote leave its prefix cache
        (:meth:`fail_step`)."""
        self._evict_cached = watch(block_pool, self.on_new_blocks)

    def fail_step(self, scheduler_output, slot_mapping, error: str = "") -> None:
        """A step whose routing failed the worker's check: drop the blocks it wrote (a
        later read of them raises) and fail every request of the step in this output
        (:meth:`after_output`), so that each fails alone and the engine serves on.
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

    def get(self, block_ids, num_tokens: int, token_start: int = 0) -> np.ndarray:
        """Routing of a request's tokens ``token_start .. num_tokens - 1`` (a copy).

        If some of them has no stored routing, returns an empty marker array instead
        and records the error; :meth:`finish_missing` then fails the request.

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
        output's, in the order they were queued.

        An output with no tag (not seen by ``seal_step``) applies all of them: early
        invalidation can only turn a read into an error, never into stale data.
        """
        step = getattr(scheduler_output, _STEP_ATTR, self._step)
        while self._pending and self._pending[0][0] <= step:
            change = self._pending.popleft()[1]
            if type(change) is tuple:
                self.store.store_batch(change[1], change[0])
            else:
                self.store.invalidate_blocks(change)

    def after_output(self, scheduler, outputs: dict) -> None:
        """:meth:`finish_missing`, then :meth:`forget_gone_requests`: what follows
        vLLM's ``update_from_output``. One call per step, bounded by two emptiness
        checks when nothing failed and no request left."""
        if self._missing or self._failed:
            self.finish_missing(scheduler, outputs)
        snapshots = scheduler._re_block_ids
        if not snapshots.keys() <= scheduler.requests.keys():  # a C-level subset test
            self.forget_gone_requests(scheduler)

    def finish_missing(self, scheduler, outputs: dict) -> None:
        """Fail every request whose routing read missed in this output, and every
        request of a failed step (:meth:`fail_step`) that has an output in it.

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

    @staticmethod
    def forget_gone_requests(scheduler) -> None:
        """Drop block-id snapshots of requests the scheduler no longer holds.

        vLLM pops a request's ``_re_block_ids`` entry only when the request emits
        tokens, so one aborted (or finished with a step in flight) keeps its entry
        forever. Bounded by the entries left, about one per running request.
        """
        snapshots = scheduler._re_block_ids
        gone = [req_id for req_id in snapshots if req_id not in scheduler.requests]
        for req_id in gone:
            del snapshots[req_id]


# -- patches ------------------------------------------------------------------------


def refuse_micro_batching(parallel_config) -> None:
    """Refuse routed experts with this parallel config's micro-batching (DBO,
    ``--ubatch-size`` > 1): a micro-batched step has no slot mapping of its own, so its
    rows could not be placed (vLLM's own path writes them at each micro-batch's offset).

    Raises
    ------
    ValueError
        Micro-batching is on, naming its options.
    """
    if getattr(parallel_config, "use_ubatching", False):
        raise ValueError(
            "--enable-return-routed-experts is incompatible with micro-batching with slotroute (--enable-dbo or "
            "--ubatch-size > 1): a micro-batched step's rows have no KV slots to be stored at; turn micro-batching off"
        )


def refuse_partial_hits(scheduler) -> None:
    """Refuse routed experts over prefix-cache hits inside a block, as the engine starts
    (``scheduler``: vLLM's ``Scheduler``, just built). Its coordinator's
    ``enable_partial_hash_hits`` (a hybrid model's aligned Mamba state with a block
    larger than the hash block) makes such a hit copy the KV of the tokens it covers
    into a new block (copy-on-write), and routing, stored by KV slot, does not follow
    that copy, so every request served from such a hit would fail.

    Raises
    ------
    ValueError
        The scheduler's KV cache serves prefix-cache hits inside a block, naming the
        options that turn them off.
    """
    if getattr(scheduler.kv_cache_manager.coordinator, "enable_partial_hash_hits", False):
        raise ValueError(
            "--enable-return-routed-experts is incompatible with prefix-cache hits inside a KV block with slotroute "
            "(partial hash hits: a hybrid model's aligned Mamba state, --mamba-cache-mode align, with a KV block "
            "larger than the hash block): their KV is copied into a new block without its routing; turn prefix "
            "caching off (--no-enable-prefix-caching) or use another --mamba-cache-mode"
        )


def _make_manager(original):
    """Replaces ``RoutedExpertsManager`` as named in ``vllm/v1/core/sched/scheduler.py``
    (``Scheduler.__init__`` builds it from ``(vllm_config, kv_cache_config)``); refuses
    micro-batching there, as the engine starts (these versions have no configuration
    check to patch)."""

    def RoutedExpertsManager(vllm_config, kv_cache_config) -> SchedulerRouting:  # noqa: N802 - vLLM's name
        refuse_micro_batching(vllm_config.parallel_config)
        return SchedulerRouting.for_vllm(vllm_config, kv_cache_config)

    return RoutedExpertsManager


def _make_scheduler_init(original):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.__init__``: refuses
    prefix-cache hits inside a block (:func:`refuse_partial_hits`) and connects the
    routing manager to the scheduler's block pool."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        routing = getattr(self, "routed_experts_mgr", None)
        if self.enable_return_routed_experts and isinstance(routing, SchedulerRouting):
            refuse_partial_hits(self)
            routing.connect(self.kv_cache_manager.block_pool)

    return __init__


def _make_schedule(original):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``: tags each
    step so its block invalidations apply when its output arrives."""

    def schedule(self, *args, **kwargs):
        scheduler_output = original(self, *args, **kwargs)
        routing = getattr(self, "routed_experts_mgr", None)
        if isinstance(routing, SchedulerRouting):
            routing.seal_step(scheduler_output)
        return scheduler_output

    return schedule


def _make_update_from_output(original):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.update_from_output``:
    invalidates before the step's ``store_batch``, drops a failed step's blocks, and
    fails the requests whose read missed or whose step failed."""

    def update_from_output(self, scheduler_output, model_runner_output):
        routing = getattr(self, "routed_experts_mgr", None)
        if not isinstance(routing, SchedulerRouting):
            return original(self, scheduler_output, model_runner_output)
        if routing._pending:  # most steps queue no invalidation: skip the call
            routing.before_output(scheduler_output)
        step = model_runner_output.routed_experts
        if step is not None and is_failed_step(step.routing_data, step.slot_mapping):
            routing.fail_step(scheduler_output, step.slot_mapping)
        outputs = original(self, scheduler_output, model_runner_output)
        routing.after_output(self, outputs)
        return outputs

    return update_from_output


def scheduler_patches() -> list[Patch]:
    """The scheduler-side patches, each verified against the installed vLLM."""
    return [
        Patch(SCHEDULER, "RoutedExpertsManager", ("vllm_config", "kv_cache_config"),
              ("def store_batch", "def get("), _make_manager),
        *BLOCK_POOL_PATCHES,
        Patch(SCHEDULER, "Scheduler.__init__", None,
              ("self.routed_experts_mgr = RoutedExpertsManager(", "self.kv_cache_manager ="),
              _make_scheduler_init),
        Patch(SCHEDULER, "Scheduler.schedule", ("self", "throttle_prefills"), ("return scheduler_output",),
              _make_schedule),
        Patch(SCHEDULER, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
              ("self.routed_experts_mgr.store_batch(re.routing_data, re.slot_mapping)",
               "self.routed_experts_mgr.get(", "_re_block_ids.pop(req_id"),
              _make_update_from_output),
    ]
