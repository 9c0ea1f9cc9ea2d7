"""Scheduler side: vLLM's scheduler keeps routing in slotroute's store.

vLLM 0.28-0.30 already call a routed-experts manager from the scheduler
(``vllm/v1/core/sched/scheduler.py``): ``store_batch`` once per step in
``update_from_output``, then ``get`` of the whole prompt when a request's prefill
completes. slotroute puts :class:`SchedulerRouting`, an adapter over the routing core
(``slotroute/vllm/routing.py``), in that place and adds what vLLM lacks: KV blocks
handed out for new data are invalidated, so a read of routing that was not stored for
the reader's tokens raises instead of returning zeros, and a request hit by such a
read finishes with an error.
"""

from __future__ import annotations

import numpy as np

from slotroute.spec import MissingRoutingError
from slotroute.vllm import READ_AHEAD_ENV, switch
from slotroute.vllm.blocks import BLOCK_POOL_PATCHES
from slotroute.vllm.patches import Patch
from slotroute.vllm.routing import SlotRouting

__all__ = ["SchedulerRouting", "is_failed_step", "scheduler_patches"]

SCHEDULER = "vllm.v1.core.sched.scheduler"


def is_failed_step(data: np.ndarray, slot_mapping: np.ndarray) -> bool:
    """Whether a step shipped in vLLM 0.28-0.30's ``RoutedExpertsLists`` is a worker's
    report of a step that failed its check: no rows for the slots it wrote."""
    return data.shape[0] == 0 and slot_mapping.shape[0] > 0


class SchedulerRouting:
    """vLLM 0.28-0.30's routed-experts manager interface (``store_batch``, ``get``,
    ``routed_experts_by_slot``) over slotroute's :class:`~slotroute.vllm.routing.
    SlotRouting`, which keeps the store in step order (its NOTE 1) and fails a request
    whose read misses.

    Invariant: as ``SlotRouting``'s; ``get`` never raises into vLLM for a missing row.

    NOTE 2 (read-ahead, on unless ``SLOTROUTE_READ_AHEAD=0``): with async scheduling vLLM
    schedules step N+1 while step N runs and only then waits for N's output, whose
    ``update_from_output`` reads the whole prompt of each request whose prefill
    completes in N, while the much shorter step N+1 (a decode step, often) runs. At
    the start of ``schedule()`` of N+1, :meth:`read_ahead` reads those prompts' rows of
    the tokens computed before N, stored by then, into the arrays ``get`` returns; at
    N's output ``get`` adds the rows of N's tokens. A read ahead is made only where it
    returns what the whole read at the output would (``SlotRouting.blocks_in_flux``),
    and used only for the read it was made for (the same tokens over the same blocks);
    any other read is made whole, as without it.

    Parameters
    ----------
    core
        The routing core, sized to the KV block pool.
    reads_ahead
        NOTE 2 on; ``None``: on unless ``SLOTROUTE_READ_AHEAD=0``.

    Raises
    ------
    ValueError
        ``SLOTROUTE_READ_AHEAD`` set to anything but 0 or 1 (the engine does not start).
    """

    def __init__(self, core: SlotRouting, reads_ahead: bool | None = None) -> None:
        self.core = core
        self.store = core.store
        # Read by vLLM's scheduler: the KV cache group whose blocks it reads rows over.
        self.attn_gid = core.attn_gid
        if reads_ahead is None:
            reads_ahead = switch(READ_AHEAD_ENV) != "0"
        self.reads_ahead = reads_ahead
        # The output of the step scheduled last, while it may have prompts to read ahead.
        self._scheduled = None
        # NOTE 2's reads made: request id -> (the block ids read over, num_tokens,
        # token_start, tokens read, the array); and, for the output being updated, id
        # of the block-id list vLLM passes to ``get`` -> (that list, the request id).
        self._ahead: dict[str, tuple[list, int, int, int, np.ndarray]] = {}
        self._ahead_by_list: dict[int, tuple[list, str]] = {}
        # NOTE 2's reads made and served since the engine started (what a benchmark reports)
        self.reads_made_ahead = 0
        self.reads_served_ahead = 0

    @classmethod
    def for_vllm(cls, vllm_config, kv_cache_config) -> SchedulerRouting:
        """Built as vLLM builds its own manager (:meth:`SlotRouting.for_vllm`)."""
        return cls(SlotRouting.for_vllm(vllm_config, kv_cache_config))

    @property
    def routed_experts_by_slot(self) -> np.ndarray:
        """The store's slot buffer: a read-only view (vLLM reads only its dtype)."""
        return self.store.routed_experts_by_slot

    def store_batch(self, data: np.ndarray, slot_mapping: np.ndarray) -> None:
        """Store one step's routing (see ``RoutedExpertsManager.store_batch``); a failed
        step (:func:`is_failed_step`) stores nothing: ``fail_step`` dropped its blocks.

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.store_batch``: the worker sent a malformed step.
        """
        if is_failed_step(data, slot_mapping):
            return
        self.store.store_batch(data, slot_mapping)

    def get(self, block_ids, num_tokens: int, token_start: int = 0) -> np.ndarray:
        """Routing of a request's tokens ``token_start .. num_tokens - 1`` (a copy), or
        the empty marker of a missed read (:meth:`SlotRouting.read`).

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.get`` for malformed arguments (a vLLM bug).
        """
        if self._ahead_by_list:
            matched = self._ahead_by_list.pop(id(block_ids), None)
            ahead = self._ahead.pop(matched[1], None) if matched is not None and matched[0] is block_ids else None
            if ahead is not None:
                blocks, tokens, start, read, rows = ahead
                if (num_tokens, token_start) == (tokens, start) and block_ids[:len(blocks)] == blocks:
                    try:
                        self.store.get(block_ids, num_tokens, read, out=rows[read - start:])
                    except MissingRoutingError as error:
                        return self.core.missing(error)
                    self.reads_served_ahead += 1
                    return rows
        return self.core.read(block_ids, num_tokens, token_start)

    def read_ahead(self, scheduler) -> None:
        """At the start of ``schedule()``: NOTE 2's reads for the step scheduled last.
        Off, or with no step waiting, one attribute test; otherwise bounded by the
        requests still prefilling (those with a block-id snapshot,
        :meth:`snapshot_prompt_blocks`), not by the step's requests: a decode step's
        requests cost nothing here."""
        scheduled, self._scheduled = self._scheduled, None
        if scheduled is None or not self.reads_ahead:
            return
        requests, snapshots = scheduler.requests, scheduler._re_block_ids
        counts = scheduled.num_scheduled_tokens
        reads = []
        for req_id, block_ids in snapshots.items():
            num_scheduled, request = counts.get(req_id), requests.get(req_id)
            if num_scheduled is None or request is None or request.num_output_tokens:
                continue
            num_tokens, computed = request.num_prompt_tokens, request.num_computed_tokens
            start = getattr(request.sampling_params, "routed_experts_prompt_start", None) or 0
            read = computed - num_scheduled  # the tokens computed before that step
            if 0 <= start < read < num_tokens <= computed:  # its prefill completes in it
                reads.append((req_id, block_ids, num_tokens, start, read))
        if not reads:
            return
        in_flux = self.core.blocks_in_flux()
        if in_flux is None:
            return
        block_size, spec = self.store.block_size, self.store.spec
        for req_id, block_ids, num_tokens, start, read in reads:
            blocks = list(block_ids[:(read - 1) // block_size + 1])
            if not in_flux.isdisjoint(blocks[start // block_size:]):
                continue
            rows = np.empty((num_tokens - start, *spec.token_shape), dtype=spec.storage_dtype)
            try:
                self.store.get(blocks, read, start, out=rows[:read - start])
            except MissingRoutingError:
                continue  # read whole at the output, where it fails its request
            self._ahead[req_id] = (blocks, num_tokens, start, read, rows)
            self.reads_made_ahead += 1

    def match_reads_ahead(self, scheduler) -> None:
        """Before vLLM's ``update_from_output``: key each read made ahead by the
        block-id list vLLM will pass for it (its request's ``_re_block_ids`` entry)."""
        snapshots = scheduler._re_block_ids
        for req_id in self._ahead:
            block_ids = snapshots.get(req_id)
            if block_ids is not None:
                self._ahead_by_list[id(block_ids)] = (block_ids, req_id)

    def forget_reads_ahead(self) -> None:
        """After vLLM's ``update_from_output``: drop the reads made ahead that it did
        not make (a request aborted or preempted meanwhile)."""
        self._ahead.clear()
        self._ahead_by_list.clear()

    def snapshot_prompt_blocks(self, scheduler, num_scheduled_tokens) -> None:
        """Keep, in vLLM's ``scheduler._re_block_ids``, the block ids of each scheduled
        request that has no output token yet: the only ones vLLM's
        ``update_from_output`` reads (a prefill that completes in the step reads its
        whole prompt over them; every other request's rows come from the step's data).
        vLLM's own snapshot, which :func:`_make_update_after_schedule` skips, copies
        every scheduled request's block ids every step. Bounded by one attribute read
        per scheduled request and one block-id list per prefilling request."""
        requests, snapshots = scheduler.requests, scheduler._re_block_ids
        get_blocks, gid = scheduler.kv_cache_manager.get_blocks, self.attn_gid
        for req_id in num_scheduled_tokens:
            if not requests[req_id].num_output_tokens:
                snapshots[req_id] = get_blocks(req_id).get_block_ids()[gid]

    def after_output(self, scheduler, outputs: dict) -> None:
        """What follows vLLM's ``update_from_output``: fail the requests whose read
        missed or whose step failed (:meth:`SlotRouting.finish_missing`), then
        :meth:`forget_gone_requests`. Bounded by three emptiness checks when nothing
        failed and no request left."""
        self.core.finish_missing(scheduler, outputs)
        snapshots = scheduler._re_block_ids
        if not snapshots.keys() <= scheduler.requests.keys():  # a C-level subset test
            self.forget_gone_requests(scheduler)

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
            routing.core.connect(self.kv_cache_manager.block_pool)

    return __init__


def _make_schedule(original):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``: makes the
    reads ahead of the step scheduled before (:meth:`SchedulerRouting.read_ahead`) and
    tags each step so its block invalidations apply when its output arrives."""

    def schedule(self, *args, **kwargs):
        routing = getattr(self, "routed_experts_mgr", None)
        if not isinstance(routing, SchedulerRouting):
            return original(self, *args, **kwargs)
        routing.read_ahead(self)
        scheduler_output = original(self, *args, **kwargs)
        routing.core.seal_step(scheduler_output)
        if routing.reads_ahead and scheduler_output.num_scheduled_tokens:
            routing._scheduled = scheduler_output
        return scheduler_output

    return schedule


def _make_update_after_schedule(original):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler._update_after_schedule``:
    vLLM's own code there copies the block ids of every scheduled request, every step,
    while routed experts are on (``_re_block_ids``, which survives a preemption before
    the step's output arrives), though ``update_from_output`` reads them only for a
    request whose prefill completes in the step. The wrapper runs vLLM's code with that
    copy off and keeps the block ids of the requests that can complete a prefill
    (:meth:`SchedulerRouting.snapshot_prompt_blocks`): on vLLM 0.29's CPU engine
    (128-token blocks) with 64 requests of about 2,100 tokens decoding, the call took
    229-348 us a step with vLLM's copy and 52-73 without."""

    def _update_after_schedule(self, scheduler_output):
        routing = getattr(self, "routed_experts_mgr", None)
        if not (self.enable_return_routed_experts and isinstance(routing, SchedulerRouting)):
            return original(self, scheduler_output)
        self.enable_return_routed_experts = False  # read there only to take vLLM's copy
        try:
            original(self, scheduler_output)
        finally:
            self.enable_return_routed_experts = True
        routing.snapshot_prompt_blocks(self, scheduler_output.num_scheduled_tokens)

    return _update_after_schedule


def _make_update_from_output(original):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.update_from_output``:
    invalidates before the step's ``store_batch``, drops a failed step's blocks, hands
    vLLM's prompt reads the rows read ahead (NOTE 2 of :class:`SchedulerRouting`), and
    fails the requests whose read missed or whose step failed."""

    def update_from_output(self, scheduler_output, model_runner_output):
        routing = getattr(self, "routed_experts_mgr", None)
        if not isinstance(routing, SchedulerRouting):
            return original(self, scheduler_output, model_runner_output)
        routing.core.before_output(scheduler_output)
        step = model_runner_output.routed_experts
        if step is not None and is_failed_step(step.routing_data, step.slot_mapping):
            routing.core.fail_step(scheduler_output, step.slot_mapping)
        if routing._ahead:
            routing.match_reads_ahead(self)
        try:
            outputs = original(self, scheduler_output, model_runner_output)
        finally:
            if routing._ahead or routing._ahead_by_list:
                routing.forget_reads_ahead()
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
        Patch(SCHEDULER, "Scheduler._update_after_schedule", ("self", "scheduler_output"),
              (("if self.enable_return_routed_experts:", "self._re_block_ids.update(",
                "for rid in num_scheduled_tokens"),),
              _make_update_after_schedule),
        Patch(SCHEDULER, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
              ("self.routed_experts_mgr.store_batch(re.routing_data, re.slot_mapping)",
               ("num_output_tokens_before = len(request._output_token_ids)", "_re_block_ids.pop(req_id",
                "if num_output_tokens_before == 0:", "self.routed_experts_mgr.get(")),
              _make_update_from_output),
    ]
