"""Scheduler side on vLLM 0.31-0.33: slotroute in the place of vLLM's aux-output
connector.

vLLM 0.31 moved routed experts onto an "aux output connector"
(``vllm/distributed/aux_output_connector/``): the scheduler builds per-step metadata
(``build_connector_meta``), asks for the new rows of each request that emits output
(``take_output``, whose result becomes ``EngineCoreOutput.routed_experts``, a chunk the
output processor concatenates when the request finishes) and reports finished or
preempted requests (``request_finished``). The rows themselves live on TP rank 0's
worker, keyed by prefix-cache block hash, in an arena with LRU eviction.

slotroute keeps its own design behind that interface: the worker ships each step's
checked narrow rows with their KV slots in ``ModelRunnerOutput.
aux_output_connector_output``, :func:`_make_update_from_output` stores them in the
scheduler's slot store (the routing core, ``slotroute/vllm/routing.py``) before vLLM
reads any output, and :class:`ConnectorRouting`'s ``take_output`` reads a request's
rows back from the slots of its KV blocks when it finishes. Routing lives exactly as
long as its KV block (NOTE 1 of :class:`~slotroute.vllm.routing.SlotRouting`), so it
needs neither prefix caching nor the V2 runner, and no cache hit is ever refused for
want of routing.
"""

from __future__ import annotations

import numpy as np

from slotroute.spec import MissingRoutingError
from slotroute.vllm import READ_AT_FINISH_ENV, switch
from slotroute.vllm.blocks import BLOCK_POOL_PATCHES
from slotroute.vllm.offload import follow_kv
from slotroute.vllm.patches import Patch
from slotroute.vllm.routing import SlotRouting
from slotroute.vllm.scheduler import refuse_micro_batching, refuse_partial_hits
from slotroute.wire import RoutedExpertsLists, StepFailure, StepMeta

__all__ = ["PD_CONNECTORS", "ConnectorRouting", "connector_patches", "connector_patches_0_33"]

SCHEDULER = "vllm.v1.core.sched.scheduler"

# NOTE 3 of ConnectorRouting: the prompt rows read ahead in one step past its first
# request's (what bounds the host time read-ahead adds to a decode step), the prompt
# rows held ahead over all running requests, and the largest buffer one request reads
# ahead into (its capacity, mostly never touched); past the last two, rows are read at
# finish.
READ_AHEAD_STEP_BYTES = 4 << 20
READ_AHEAD_HELD_BYTES = 512 << 20
READ_AHEAD_REQUEST_BYTES = 256 << 20


def decode_only(scheduler_output) -> bool:
    """Whether a step carried no prompt token: each request its one token and its
    draft tokens. Bounded by a sum over the step's draft-token lists (none without
    speculative decoding)."""
    drafts = scheduler_output.scheduled_spec_decode_tokens
    tokens = len(scheduler_output.num_scheduled_tokens) + (sum(map(len, drafts.values())) if drafts else 0)
    return scheduler_output.total_num_scheduled_tokens <= tokens


def first_row(request) -> int:
    """The first row a request returns when it is scheduled now: its
    ``routed_experts_prompt_start`` (at most the prompt), or, for one that already
    produced tokens (resumed after preemption), the row after the last one emitted."""
    start = min(request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens)
    if request.num_output_tokens:
        start = max(start, request.num_tokens - 1)
    return max(start, 0)


class ConnectorRouting:
    """vLLM 0.31-0.33's scheduler connector interface over slotroute's routing core
    (:class:`~slotroute.vllm.routing.SlotRouting`).

    Invariant: each request's rows are returned once, in order, from
    ``first_row(request)`` to the token before its last sampled one; a row whose
    routing is not stored for the request's token fails the request
    (:meth:`~slotroute.vllm.routing.SlotRouting.finish_missing`), never returns other
    data.

    NOTE 1: a request preempted with a step in flight (async scheduling) has no blocks
    when that step's output arrives, and may even finish in it. Its rows are still in
    the slots of the blocks it held: those are invalidated only when the output of the
    step that hands them out again arrives, which is later. So preemption parks the
    request's block ids and keeps its cursor, and such an output reads the parked
    blocks; the request's next schedule drops them.

    NOTE 2: one read per request, when it finishes, not one per step. vLLM asks for a
    request's new rows at every step it emits a token (``take_output``), but its
    output processor keeps them only to concatenate them when the request finishes
    (``RequestState.routed_experts_chunks``): no output before the last carries
    routing. A request's rows stay in the store as long as its KV blocks, which it
    holds until it is freed, after its last ``take_output``; so ``take_output``
    returns nothing until the request is finished and then all its rows in one store
    read over its blocks. The per-step work is one status check per emitting request
    and the step's one ``store_batch``. Only preemption frees a running request's
    blocks: it reads the rows emitted so far then (``_saved``), while they are
    stored, and the next rows the request returns follow them.

    NOTE 3: the prompt's rows are read ahead, while the request decodes. A read at
    finish lands in the step that finishes the request, and where many requests finish
    together (the turn of a multi-turn rollout, each request's prompt the whole
    conversation so far) that step's host time is exposed: no forward runs beside it,
    and ``generate`` returns only after it. So in a step that carried no prompt token
    (:func:`decode_only`; the GPU runs of docs/benchmarks.md show a decode step's host
    time hidden under the forward, and a prefill step's not), a request past its first
    emitting step has its rows from its cursor to the end of its prompt, stored since
    its prefill completed, read into a buffer sized for every row it can return (prompt
    and ``max_tokens``; the pages past the rows written are never touched). At finish
    only the generated rows are read, into the same buffer, and the request gets a view
    of it: no row is copied twice. Nothing is returned before the request finishes, so
    a request that fails still returns no rows. Bounded per step by
    ``READ_AHEAD_STEP_BYTES`` past its first read, in all by ``READ_AHEAD_HELD_BYTES``;
    past those, or where the host refuses the buffer, the rows are read at finish.
    ``SLOTROUTE_READ_AT_FINISH=1`` turns it off.

    Parameters
    ----------
    core
        The routing core, sized to the KV block pool.
    coordinator
        The scheduler's ``KVCacheCoordinator``: where a request's blocks are read.
    """

    def __init__(self, core: SlotRouting, coordinator) -> None:
        self.core = core
        self.store = core.store
        self.attn_gid = core.attn_gid
        self._coordinator = coordinator
        # Request id -> its KV blocks of the full-attention group: what
        # ``KVCacheCoordinator.get_blocks`` reads, without building a tuple per call.
        self._req_blocks = coordinator.single_type_managers[core.attn_gid].req_to_blocks
        self._block_size = core.store.block_size
        # Request id -> its first row not yet read.
        self._cursors: dict[str, int] = {}
        # Request id -> the block ids it held when it was preempted (NOTE 1).
        self._parked: dict[str, list[int]] = {}
        # Request id -> rows read but not yet returned (NOTE 2), or the error of a
        # read that missed.
        self._saved: dict[str, list[np.ndarray] | MissingRoutingError] = {}
        # Requests whose prompt rows are still to be read ahead (NOTE 3), and for those
        # read, (buffer, the row its first holds): filled up to the request's cursor.
        self._prompt_due: set[str] = set()
        self._ahead: dict[str, tuple[np.ndarray, int]] = {}
        self._ahead_held = 0  # bytes of the rows read ahead, over all of ``_ahead``
        self._ahead_budget = READ_AHEAD_STEP_BYTES  # bytes left to read ahead in this step
        self._row_bytes = core.store.routed_experts_by_slot[0].nbytes
        self._reads_ahead = switch(READ_AT_FINISH_ENV) != "1"
        # What serves the hits of the scheduler's KV transfer connector, if it has one
        # (slotroute/vllm/offload.py).
        self.external_hits = None

    @classmethod
    def for_scheduler(cls, scheduler) -> ConnectorRouting:
        """Built over the scheduler's KV block pool (:meth:`SlotRouting.for_vllm`)."""
        core = SlotRouting.for_vllm(scheduler.vllm_config, scheduler.kv_cache_config)
        return cls(core, scheduler.kv_cache_manager.coordinator)

    # -- vLLM's AuxOutputSchedulerConnector interface -----------------------------

    def build_connector_meta(self, scheduler_output, requests) -> StepMeta:
        """Seal the step just scheduled (NOTE 1 of ``SlotRouting``) and note where
        each newly scheduled request's rows start. Bounded by the step's new requests
        and one C-level set difference."""
        self.core.seal_step(scheduler_output)
        cursors = self._cursors
        for req_id in scheduler_output.num_scheduled_tokens.keys() - cursors.keys():
            request = requests[req_id]
            cursors[req_id] = start = first_row(request)
            if start < request.num_prompt_tokens and self._reads_ahead:
                self._prompt_due.add(req_id)  # NOTE 3
        if self._parked:
            for req_id in scheduler_output.num_scheduled_tokens.keys() & self._parked.keys():
                del self._parked[req_id]
        return StepMeta(scheduler_output.total_num_scheduled_tokens)

    def take_output(self, request, output) -> np.ndarray | None:
        """``None`` while the request runs (NOTE 2; the empty marker of ``missing`` if
        the read ahead of its prompt missed, NOTE 3); once it is finished, or when the
        output of a step in flight at its preemption arrives (NOTE 1), its rows not
        yet returned, up to the token before its last sampled one (``output``, vLLM's
        worker output, was stored before vLLM's ``update_from_output`` ran): a copy,
        one store read over the blocks that hold them (after NOTE 3's read ahead, of
        the generated rows into its buffer, whose view it is). Bounded, while the request
        runs, by Python call overhead: a status check and a dict lookup, and once a
        set lookup and the read of its prompt rows ahead (NOTE 3)."""
        if not request.is_finished() and request.request_id not in self._parked:
            if self._prompt_due and request.request_id in self._prompt_due:
                return self._read_ahead(request)
            return None
        return self._take(request)

    def _read_ahead(self, request) -> np.ndarray | None:
        """Read a running request's prompt rows ahead (NOTE 3) where this step's and the
        held budgets allow. ``None``, or the empty marker of a read that missed: the
        request fails now, as it would have at finish."""
        if request.num_output_tokens < 2 or self._ahead_budget <= 0 or self._ahead_held >= READ_AHEAD_HELD_BYTES:
            return None  # its prefill just completed, the step carried prompt tokens, or a budget is spent
        req_id = request.request_id
        self._prompt_due.discard(req_id)
        start, end = self._cursors[req_id], request.num_prompt_tokens
        capacity = request.num_prompt_tokens + request.max_tokens - 1 - start
        if end <= start or capacity * self._row_bytes > READ_AHEAD_REQUEST_BYTES:
            return None  # resumed past its prompt, or too large a buffer: read at finish
        pool = self.store.routed_experts_by_slot
        try:
            buffer = np.empty((capacity, *pool.shape[1:]), pool.dtype)
        except MemoryError:  # a host that commits address space strictly: read at finish
            return None
        try:
            self._read_into(req_id, start, end, buffer[: end - start])
        except MissingRoutingError as error:
            return self.core.missing(error)
        self._cursors[req_id] = end
        self._ahead[req_id] = (buffer, start)
        nbytes = (end - start) * self._row_bytes
        self._ahead_budget -= nbytes
        self._ahead_held += nbytes
        return None

    def _pop_ahead(self, req_id: str) -> tuple[np.ndarray, int] | None:
        """Forget the request's read-ahead buffer: ``(buffer, its first row)``, filled
        up to the request's cursor, or ``None``."""
        ahead = self._ahead.pop(req_id, None)
        if ahead is not None:
            self._ahead_held -= (self._cursors[req_id] - ahead[1]) * self._row_bytes
        return ahead

    def _take(self, request) -> np.ndarray | None:
        """The request's rows from its cursor to the token before its last sampled
        one, after those read at its preemption; the empty marker of ``missing`` if
        some is not stored; ``None`` if there are none."""
        req_id = request.request_id
        saved = self._saved.pop(req_id, None)
        ahead = self._pop_ahead(req_id)  # none where rows were saved: preemption folds it in there
        if isinstance(saved, MissingRoutingError):
            return self.core.missing(saved)  # the request fails: its other rows are not read
        if ahead is not None:
            return self._finish_ahead(request, *ahead)
        rows = self._read_next(request)
        if isinstance(rows, MissingRoutingError):
            return self.core.missing(rows)
        if saved and rows is not None:
            return np.concatenate([*saved, rows])
        return np.concatenate(saved) if saved else rows

    def _read_next(self, request) -> np.ndarray | MissingRoutingError | None:
        """Rows from the request's cursor to the token before its last sampled one,
        read from the store; the cursor moves past them. The error where some is not
        stored; ``None`` if there are none."""
        req_id = request.request_id
        start = self._cursors.get(req_id)
        if start is None:
            start = first_row(request)
        end = request.num_tokens - 1
        if end <= start:
            return None
        self._cursors[req_id] = end
        try:
            return self._read_into(req_id, start, end)
        except MissingRoutingError as error:
            return error

    def _finish_ahead(self, request, buffer: np.ndarray, first: int) -> np.ndarray:
        """A finished request's rows whose prompt was read ahead (NOTE 3): the rest read
        into the same buffer, a view of its rows ``first ..``; the empty marker of
        ``missing`` if some is not stored. More rows than the buffer holds (a streaming
        session given more tokens) are read and joined to it instead."""
        req_id = request.request_id
        start, end = self._cursors[req_id], request.num_tokens - 1
        if end - first > len(buffer):
            rows = self._read_next(request)
            if isinstance(rows, MissingRoutingError):
                return self.core.missing(rows)
            return np.concatenate([buffer[: start - first], rows])
        if end > start:
            self._cursors[req_id] = end
            try:
                self._read_into(req_id, start, end, buffer[start - first : end - first])
            except MissingRoutingError as error:
                return self.core.missing(error)
        return buffer[: max(start, end) - first]

    def _block_ids(self, req_id: str, first: int, stop: int) -> list[int]:
        """Ids of the request's blocks ``first .. stop - 1`` (current or parked)."""
        blocks = self._req_blocks.get(req_id)
        if blocks:
            return [block.block_id for block in blocks[first:stop]]
        return self._parked.get(req_id, [])[first:stop]  # preempted with this step in flight (NOTE 1)

    def _read_into(self, req_id: str, start: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``start .. end - 1`` of the request from the store (a copy, or ``out``
        where given), over the blocks that hold them.

        Raises
        ------
        MissingRoutingError
            Some row is not stored for the request's token, or its blocks are gone.
        """
        size = self._block_size
        first, stop = start // size, -(-end // size)
        block_ids = self._block_ids(req_id, first, stop)
        if len(block_ids) * size < end - first * size:
            raise MissingRoutingError(f"request {req_id}: the blocks of its tokens {start}-{end - 1} are gone")
        return self.store.get(block_ids, end - first * size, start - first * size, out)

    def request_finished(self, request) -> None:
        """Forget a finished request. A preempted one's rows emitted so far are read
        now, before its blocks are freed (NOTE 2), and its blocks parked (NOTE 1)."""
        req_id = request.request_id
        if request.is_finished():
            self._prompt_due.discard(req_id)
            self._pop_ahead(req_id)
            self._cursors.pop(req_id, None)
            self._parked.pop(req_id, None)
            self._saved.pop(req_id, None)
            if self.external_hits is not None:
                self.external_hits.forget(req_id)
            return
        if request.num_output_tokens and not isinstance(self._saved.get(req_id), MissingRoutingError):
            # Every token before the last sampled one was forwarded by a step whose
            # output arrived: its row is stored. A request still in its prompt has
            # emitted nothing; its rows are read after it resumes.
            self._prompt_due.discard(req_id)
            ahead = self._pop_ahead(req_id)
            if ahead is not None:  # its prompt rows, read ahead, come first
                buffer, first = ahead
                self._saved[req_id] = [*self._saved.get(req_id, ()), buffer[: self._cursors[req_id] - first]]
            rows = self._read_next(request)
            if rows is not None:
                self._saved[req_id] = rows if isinstance(rows, MissingRoutingError) else [*self._saved.get(req_id, ()), rows]
        blocks = self._coordinator.get_blocks(req_id)[self.attn_gid]
        self._parked[req_id] = [block.block_id for block in blocks]

    def reset(self) -> None:
        """After a prefix-cache reset: nothing to drop. Cached blocks return to the free
        pool and are invalidated when they are handed out again."""

    # -- vLLM 0.33's cache-hit calls ------------------------------------------------

    def max_cache_hit(self, request) -> None:
        """No bound on a local prefix-cache hit (vLLM 0.33 asks before its lookup):
        a cached block's routing lives exactly as long as its KV, so every hit the
        block pool finds is served. ``None`` is the scheduler's "no bound"."""
        return None

    def cap_external_hit(self, request, num_local: int, num_external: int) -> int:
        """Tokens of a KV connector's hit to load (vLLM 0.33 asks; on 0.31-0.32 the
        connector's own lookup is capped with it): those whose routing is held, by
        vLLM's offloading connector's host tier (``slotroute/vllm/offload.py``);
        none for any other connector. The rest is recomputed and its routing
        captured fresh."""
        if self.external_hits is None:
            return 0
        return self.external_hits.cap(request, num_local, num_external)

    def request_loading(self, request, num_tokens: int) -> None:
        """An async KV load starts for the request (vLLM 0.33): nothing to do, as its
        rows were queued when the connector placed the load
        (:meth:`~slotroute.vllm.offload.OffloadRouting.loading`)."""

    # -- steps ----------------------------------------------------------------------

    def take_step(self, scheduler_output, step) -> None:
        """Store one step's worker output before vLLM reads any request's rows: the
        step's invalidations first (NOTE 1 of ``SlotRouting``), then its rows; a
        :class:`StepFailure` invalidates the blocks the step wrote instead, so each
        request in it fails alone; the read-ahead budget is renewed for a step that
        carried no prompt token, and spent for any other (NOTE 3). Bounded by the
        store's ``store_batch``.

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.store_batch``: the worker sent a malformed step.
        """
        self._ahead_budget = READ_AHEAD_STEP_BYTES if decode_only(scheduler_output) else 0
        external = self.external_hits
        if external is not None:
            external.capture(scheduler_output, finished=True)
        self.core.before_output(scheduler_output)
        if type(step) is RoutedExpertsLists:
            self.store.store_batch(step.routing_data, step.slot_mapping)
        elif isinstance(step, StepFailure):
            self.core.fail_step(scheduler_output, step.slot_mapping, step.error)
        if external is not None:
            external.capture(scheduler_output, finished=False)

    def after_output(self, scheduler, outputs: dict) -> None:
        """Fail the requests whose read missed in this output; forget parked blocks
        and saved rows of requests the scheduler no longer holds (aborted while
        preempted)."""
        self.core.finish_missing(scheduler, outputs)
        if self._parked and not self._parked.keys() <= scheduler.requests.keys():
            for req_id in self._parked.keys() - scheduler.requests.keys():
                del self._parked[req_id]
        if self._saved and not self._saved.keys() <= scheduler.requests.keys():
            for req_id in self._saved.keys() - scheduler.requests.keys():
                del self._saved[req_id]


# -- patches ------------------------------------------------------------------------


def _make_scheduler_init(original, caps_external_hits: bool):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.__init__``: puts
    :class:`ConnectorRouting` where vLLM built its ``AuxOutputSchedulerConnector``,
    connects it to the block pool and to the KV transfer connector, if any
    (:func:`~slotroute.vllm.offload.follow_kv`; ``caps_external_hits``: the
    scheduler asks ``cap_external_hit`` itself); refuses prefix-cache hits inside a
    block (:func:`~slotroute.vllm.scheduler.refuse_partial_hits`)."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.aux_output_connector is not None:
            refuse_partial_hits(self)
            routing = ConnectorRouting.for_scheduler(self)
            self.aux_output_connector = routing
            routing.core.connect(self.kv_cache_manager.block_pool)
            routing.external_hits = follow_kv(self, routing, caps_external_hits)

    return __init__


def _make_update_from_output(original):
    """Wraps ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.update_from_output``:
    stores the step's routing before vLLM's ``take_output`` calls read it, and fails
    the requests whose read missed."""

    def update_from_output(self, scheduler_output, model_runner_output):
        routing = self.aux_output_connector
        if not isinstance(routing, ConnectorRouting):
            return original(self, scheduler_output, model_runner_output)
        routing.take_step(scheduler_output, model_runner_output.aux_output_connector_output)
        outputs = original(self, scheduler_output, model_runner_output)
        routing.after_output(self, outputs)
        return outputs

    return update_from_output


# vLLM's P/D connectors, which vLLM refuses with routed experts too: their KV arrives
# from another engine, whose routing no hook brings along.
PD_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector", "MoRIIOConnector", "MooncakeConnector")


def _make_verify_config(original):
    """Replaces ``vllm/config/vllm.py`` ``VllmConfig._verify_aux_output_compatibility``:
    vLLM's checks in vLLM's words, less the two its own connector needs and slotroute
    does not (the V2 model runner, prefix caching), and micro-batching (DBO) refused,
    which vLLM serves; a speculative draft model's own configuration (the ``draft``
    runner, which vLLM refuses) passes, as its target's was checked. vLLM's P/D
    connectors are refused as vLLM refuses them: their
    KV arrives from another engine, whose routing no hook brings along. Any other KV
    transfer connector (offloading, LMCache) is served, its hits capped to the routing
    slotroute holds (:meth:`ConnectorRouting.cap_external_hit`)."""

    def _verify_aux_output_compatibility(self) -> None:
        if not self.aux_output_config.enabled:
            return
        flag = "--enable-return-routed-experts is incompatible with"
        if self.model_config.runner_type == "draft":
            return  # a speculative draft model's own config: its target's was checked
        if self.model_config.runner_type != "generate":
            raise ValueError("AuxOutput Connector only supports generate runners.")
        if not self.model_config.is_moe:
            raise ValueError("AuxOutput Connector only supports MoE models.")
        if self.speculative_config is not None and self.speculative_config.enable_adaptive_verification:
            raise ValueError(f"{flag} adaptive speculative verification.")
        if self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(f"{flag} pipeline parallelism (PP > 1).")
        if self.parallel_config.decode_context_parallel_size > 1 or self.parallel_config.prefill_context_parallel_size > 1:
            raise ValueError(f"{flag} context parallelism (DCP/PCP > 1).")
        refuse_micro_batching(self.parallel_config)
        kv_transfer_config = self.kv_transfer_config
        if kv_transfer_config is None:
            return
        for name in PD_CONNECTORS:
            if kv_transfer_config.has_connector(name):
                raise ValueError(f"{flag} {name}; PD auxiliary output is not supported.")

    return _verify_aux_output_compatibility


def connector_patches() -> list[Patch]:
    """The scheduler-side patches of vLLM 0.31-0.32, each verified against the
    installed vLLM."""
    return _connector_patches(
        "AuxOutputSchedulerConnector()", ("self.aux_output_connector.build_connector_meta(",), caps_external_hits=False
    )


def connector_patches_0_33() -> list[Patch]:
    """The scheduler-side patches of vLLM 0.33, each verified against the installed
    vLLM: those of 0.31-0.32, where vLLM now builds its connector over the KV cache
    manager and asks it to bound cache hits (answered by ``ConnectorRouting``'s
    ``max_cache_hit``, ``cap_external_hit`` and ``request_loading``)."""
    return _connector_patches(
        "AuxOutputSchedulerConnector(self.kv_cache_manager, self.connector)",
        (
            "self.aux_output_connector.build_connector_meta(",
            "self.aux_output_connector.max_cache_hit(request)",
            "self.aux_output_connector.cap_external_hit(",
            "self.aux_output_connector.request_loading(",
            "load_kv_async &= num_external_computed_tokens > 0",
        ),
        caps_external_hits=True,
    )


def _connector_patches(built_as: str, schedule_calls: tuple[str, ...], caps_external_hits: bool) -> list[Patch]:
    return [
        Patch("vllm.config.vllm", "VllmConfig._verify_aux_output_compatibility", ("self",),
              ("AuxOutput Connector requires Model Runner V2", "AuxOutput Connector requires prefix caching",
               "pipeline_parallel_size > 1", "prefill_context_parallel_size > 1", "MooncakeConnector",
               "kv_transfer_config.has_connector(connector_name)"),
              _make_verify_config),
        *BLOCK_POOL_PATCHES,
        Patch("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator.get_blocks", ("self", "request_id"),
              ("manager.req_to_blocks.get(request_id)", "for manager in self.single_type_managers"), None),
        Patch(SCHEDULER, "Scheduler.__init__", None,
              (built_as, "self.kv_cache_manager = KVCacheManager(", "self.connector = KVConnectorFactory.create_connector("),
              lambda original: _make_scheduler_init(original, caps_external_hits)),
        Patch(SCHEDULER, "Scheduler.schedule", None,
              (*schedule_calls, "self.connector.get_num_new_matched_tokens(", "self.connector.update_state_after_alloc("),
              None),
        # NOTE 2 of ConnectorRouting: take_output after the stop check and before the
        # request's blocks are freed; a preempted request reported before its blocks are.
        Patch(SCHEDULER, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
              (("self._update_request_with_output(", "self.aux_output_connector.take_output(",
                "self._free_request(request)"),
               "model_runner_output.aux_output_connector_output"),
              _make_update_from_output),
        Patch(SCHEDULER, "Scheduler._free_request", None, ("self.aux_output_connector.request_finished(request)",), None),
        Patch(SCHEDULER, "Scheduler._preempt_request", None,
              (("self.aux_output_connector.request_finished(request)", "self._free_request_blocks(request)"),), None),
    ]
