"""Scheduler side on vLLM 0.31-0.32: slotroute in the place of vLLM's aux-output
connector.

vLLM 0.31 moved routed experts onto an "aux output connector"
(``vllm/distributed/aux_output_connector/``): the scheduler builds per-step metadata
(``build_connector_meta``), hands each request that emits output its new rows
(``take_output``, whose result becomes ``EngineCoreOutput.routed_experts``, a chunk the
output processor concatenates) and reports finished or preempted requests
(``request_finished``). The rows themselves live on TP rank 0's worker, keyed by
prefix-cache block hash, in an arena with LRU eviction.

slotroute keeps its own design behind that interface: the worker ships each step's
checked narrow rows with their KV slots in ``ModelRunnerOutput.
aux_output_connector_output``, :func:`_make_update_from_output` stores them in the
scheduler's slot store before vLLM reads any output, and :class:`ConnectorRouting`'s
``take_output`` reads a request's new rows back from the slots of its KV blocks.
Routing lives exactly as long as its KV block (NOTE 1 of
:class:`~slotroute.vllm.scheduler.SchedulerRouting`), so it needs neither prefix
caching nor the V2 runner, and no cache hit is ever refused for want of routing.
"""

from __future__ import annotations

import logging
from itertools import compress, repeat

import numpy as np

from slotroute.spec import MissingRoutingError
from slotroute.vllm import LOGGER_NAME
from slotroute.vllm.patches import Patch
from slotroute.vllm.blocks import BLOCK_POOL_PATCHES
from slotroute.vllm.offload import follow_kv
from slotroute.vllm.scheduler import SchedulerRouting, refuse_micro_batching, refuse_partial_hits
from slotroute.wire import RoutedExpertsLists, StepFailure, StepMeta

try:
    from slotroute import _native
except ImportError:  # no C compiler at install: token_slots' Python loop
    _native = None

__all__ = ["PD_CONNECTORS", "ConnectorRouting", "connector_patches", "connector_patches_0_33", "token_slots"]

logger = logging.getLogger(LOGGER_NAME)

SCHEDULER = "vllm.v1.core.sched.scheduler"


def first_row(request) -> int:
    """The first row a request returns when it is scheduled now: its
    ``routed_experts_prompt_start`` (at most the prompt), or, for one that already
    produced tokens (resumed after preemption), the row after the last one emitted."""
    start = min(request.sampling_params.routed_experts_prompt_start, request.num_prompt_tokens)
    if request.num_output_tokens:
        start = max(start, request.num_tokens - 1)
    return max(start, 0)


def token_slots(req_ids: list, positions: np.ndarray, req_blocks: dict, block_size: int) -> np.ndarray:
    """The KV slot of one token per request (a new int64 array): that of request
    ``req_ids[i]``'s token at ``positions[i]`` in its blocks (``req_blocks``: request
    id -> list of vLLM ``KVCacheBlock``), -1 where it has no block there. In C where
    slotroute's extension is built; this loop is the reference it is tested against."""
    out = np.empty(len(req_ids), np.int64)
    if _native is not None:
        _native.token_slots(out, req_ids, np.ascontiguousarray(positions, np.int64), req_blocks, block_size)
        return out
    for i, (req_id, position) in enumerate(zip(req_ids, positions.tolist())):
        blocks = req_blocks.get(req_id) or ()
        index = position // block_size
        found = 0 <= position and index < len(blocks)
        out[i] = blocks[index].block_id * block_size + position % block_size if found else -1
    return out


class _StepRows:
    """The step just stored, indexed for :meth:`ConnectorRouting.take_output` (NOTE 2):
    its rows and slots as the worker shipped them; the row of each request that
    forwarded one token at its cursor, checked and copied (``ready``: request id ->
    rows), which ``take_output`` pops; per other request (``where``) its first row in the
    payload, the position of its first token in this step and its token count; and the
    rows gathered from the store for requests whose output begins before this step's
    tokens (``caught_up``: request id -> (first row, buffer))."""

    __slots__ = ("data", "slots", "ready", "where", "caught_up")

    def __init__(self, data, slots, ready, where, caught_up) -> None:
        self.data, self.slots, self.ready, self.where, self.caught_up = data, slots, ready, where, caught_up


class ConnectorRouting(SchedulerRouting):
    """vLLM 0.31-0.32's scheduler connector interface over slotroute's slot store.

    Invariant: each request's rows are returned once, in order, from
    ``first_row(request)`` to the token before its last sampled one; a row whose
    routing is not stored for the request's token fails the request
    (:meth:`~slotroute.vllm.scheduler.SchedulerRouting.finish_missing`), never
    returns other data.

    NOTE 1: a request preempted with a step in flight (async scheduling) has no blocks
    when that step's output arrives, and may even finish in it. Its rows are still in
    the slots of the blocks it held: those are invalidated only when the output of the
    step that hands them out again arrives, which is later. So preemption parks the
    request's block ids and keeps its cursor, and such an output reads the parked
    blocks; the request's next schedule drops them.

    NOTE 2: one read per step, not one per request. The rows a request emits in a
    step are, but for a catch-up, the rows of the tokens it forwarded in that step,
    which sit in the step's payload just stored: the worker lays tokens out in the
    order of ``ModelRunnerOutput.req_ids`` (the V2 runner sorts its batch; that list
    is its order), each request's ``num_scheduled_tokens`` rows in a run, from the
    position ``num_computed_tokens`` the scheduler output gave the worker. So
    :meth:`take_step` indexes the payload once. A request that forwarded one token
    at its cursor (every request of a decode step) has its row checked there, its
    payload slot against the KV slot of its token (one C loop over the step's
    requests' blocks, :func:`token_slots`), and copied; :meth:`take_output` pops it.
    For any other request :meth:`take_output` copies a slice of the payload after
    the same check of the slice's first slot. A layout that is not what this note
    says never hands out a row, it only sends the request to the store read.
    Catch-up rows (a prefix-cache hit, earlier prefill chunks, a resumed request) are
    gathered from the store in :meth:`take_step`, all of a step's in one pass, into
    the buffer the request's rows are returned in.

    Parameters
    ----------
    store, attn_gid
        As :class:`~slotroute.vllm.scheduler.SchedulerRouting`.
    coordinator
        The scheduler's ``KVCacheCoordinator``: where a request's blocks are read.
    """

    def __init__(self, store, attn_gid: int, coordinator) -> None:
        super().__init__(store, attn_gid)
        self._coordinator = coordinator
        # Request id -> its KV blocks of the full-attention group: what
        # ``KVCacheCoordinator.get_blocks`` reads, without building a tuple per call.
        self._req_blocks = coordinator.single_type_managers[attn_gid].req_to_blocks
        self._block_size = store.block_size
        # Request id -> its first row not yet returned.
        self._cursors: dict[str, int] = {}
        # Request id -> the block ids it held when it was preempted (NOTE 1).
        self._parked: dict[str, list[int]] = {}
        # The step being output, indexed (NOTE 2); None outside update_from_output or
        # where its payload cannot be indexed.
        self._step_rows: _StepRows | None = None
        # What serves the hits of the scheduler's KV transfer connector, if it has one
        # (slotroute/vllm/offload.py).
        self.external_hits = None

    @classmethod
    def for_scheduler(cls, scheduler) -> ConnectorRouting:
        """Built over the scheduler's KV block pool as
        :meth:`SchedulerRouting.for_vllm` builds its store."""
        return cls.for_vllm(
            scheduler.vllm_config, scheduler.kv_cache_config, coordinator=scheduler.kv_cache_manager.coordinator
        )

    # -- vLLM's AuxOutputSchedulerConnector interface -----------------------------

    def build_connector_meta(self, scheduler_output, requests) -> StepMeta:
        """Seal the step just scheduled (NOTE 1 of ``SchedulerRouting``) and note where
        each newly scheduled request's rows start. Bounded by the step's new requests
        and one C-level set difference."""
        self.seal_step(scheduler_output)
        cursors = self._cursors
        for req_id in scheduler_output.num_scheduled_tokens.keys() - cursors.keys():
            cursors[req_id] = first_row(requests[req_id])
        if self._parked:
            for req_id in scheduler_output.num_scheduled_tokens.keys() & self._parked.keys():
                del self._parked[req_id]
        return StepMeta(scheduler_output.total_num_scheduled_tokens)

    def take_output(self, request, output) -> np.ndarray | None:
        """The request's rows not yet returned, up to the token before its last sampled
        one (``output``, vLLM's worker output, was stored before vLLM's
        ``update_from_output`` ran). ``None`` if there are none yet.

        A copy (or a buffer of its own): for a request that forwarded one token in the
        step, the row :meth:`take_step` checked and copied (a dict lookup: bounded by
        Python call overhead); from the step's payload where NOTE 2 finds them there, a
        slice copied; else one store read over the blocks that hold them."""
        req_id = request.request_id
        step = self._step_rows
        cursors = self._cursors
        if step is not None and step.ready:
            rows = step.ready.pop(req_id, None)
            # Ready rows start at the request's cursor (checked by take_step) and are one.
            if rows is not None and cursors[req_id] + 1 == request.num_tokens - 1:
                cursors[req_id] += 1
                return rows
        start = cursors.get(req_id)
        if start is None:
            start = first_row(request)
        end = request.num_tokens - 1
        if end < start:
            return None
        rows = None if step is None else self._rows_of_step(req_id, start, end)
        if rows is None:
            rows = self._read(req_id, start, end)
        cursors[req_id] = end
        return rows

    def _rows_of_step(self, req_id: str, start: int, end: int) -> np.ndarray | None:
        """Rows ``start .. end - 1`` of the request from the step's payload and its
        gathered catch-up (NOTE 2); ``None`` where they are not all there. Bounded by
        Python call overhead: a few dict lookups and one slice copied."""
        step = self._step_rows
        found = step.where.get(req_id)
        if found is None:
            return None
        offset, first, count = found
        lo = start if start > first else first
        if end > first + count or end <= lo:
            return None
        row = offset + lo - first
        size = self._block_size
        blocks = self._req_blocks.get(req_id)
        if blocks and lo < len(blocks) * size:  # _slot_of's common case, inlined: about 5% of this call
            slot = blocks[lo // size].block_id * size + lo % size
        else:
            slot = self._slot_of(req_id, lo)
        if step.slots.item(row) != slot:
            return None
        if lo == start:
            return step.data[row : row + end - start].copy()
        caught = step.caught_up.get(req_id)
        if caught is None or caught[0] != start:
            return None
        rows = caught[1]
        rows[first - start : end - start] = step.data[row : row + end - first]
        return rows[: end - start]

    def _slot_of(self, req_id: str, position: int) -> int:
        """The KV slot of the request's token at ``position`` (its current blocks, or
        those parked at preemption, NOTE 1); -1 where it has no block there."""
        size = self._block_size
        blocks = self._req_blocks.get(req_id)
        index = position // size
        if blocks:
            return blocks[index].block_id * size + position % size if index < len(blocks) else -1
        parked = self._parked.get(req_id)
        return parked[index] * size + position % size if parked and index < len(parked) else -1

    def _block_ids(self, req_id: str, first: int, stop: int) -> list[int]:
        """Ids of the request's blocks ``first .. stop - 1`` (current or parked)."""
        blocks = self._req_blocks.get(req_id)
        if blocks:
            return [block.block_id for block in blocks[first:stop]]
        return self._parked.get(req_id, [])[first:stop]  # preempted with this step in flight (NOTE 1)

    def _read(self, req_id: str, start: int, end: int) -> np.ndarray:
        """Rows ``start .. end - 1`` of the request from the store; the empty marker of
        ``missing`` if some is not stored."""
        try:
            return self._read_into(req_id, start, end)
        except MissingRoutingError as error:
            return self.missing(error)

    def _read_into(self, req_id: str, start: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``start .. end - 1`` of the request from the store (into ``out`` where
        given), over the blocks that hold them.

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
        """Forget a finished request; park a preempted one's blocks (NOTE 1)."""
        req_id = request.request_id
        if request.is_finished():
            self._cursors.pop(req_id, None)
            self._parked.pop(req_id, None)
            if self.external_hits is not None:
                self.external_hits.forget(req_id)
        else:
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

    def take_step(self, scheduler_output, step, req_ids=None, requests=None) -> None:
        """Store one step's worker output before vLLM reads any request's rows: the
        step's invalidations first (NOTE 1 of ``SchedulerRouting``), then its rows,
        indexed by ``req_ids`` (``ModelRunnerOutput.req_ids``, the worker's token
        order) with the catch-up rows of the step's requests (``requests``, the
        scheduler's) gathered (NOTE 2); a :class:`StepFailure` invalidates the blocks
        the step wrote instead, so each request in it fails alone.

        Raises
        ------
        ValueError, IndexError
            As ``RoutedExpertsManager.store_batch``: the worker sent a malformed step.
        """
        self._step_rows = None
        external = self.external_hits
        if external is not None:
            external.capture(scheduler_output, finished=True)
        if self._pending:
            self.before_output(scheduler_output)
        if type(step) is RoutedExpertsLists:
            self.store_batch(step.routing_data, step.slot_mapping)
            if req_ids is not None:
                self._step_rows = self._index_step(scheduler_output, step, req_ids, requests or {})
        elif isinstance(step, StepFailure):
            self.fail_step(scheduler_output, step.slot_mapping, step.error)
        if external is not None:
            external.capture(scheduler_output, finished=False)

    def _index_step(self, scheduler_output, step: RoutedExpertsLists, req_ids, requests) -> _StepRows | None:
        """Where each request's rows sit in the step's payload (NOTE 2), or ``None`` if
        ``req_ids`` does not lay out the payload's rows. The row of each request that
        forwarded one token and whose output continues there is checked against its
        KV slot and copied now (``ready``), in C-level passes over the step's requests
        and one C loop over their blocks; the other requests are indexed for
        :meth:`_rows_of_step`, and a step that schedules more than one token for some
        request gathers its catch-up rows (a pass over its requests)."""
        counts = scheduler_output.num_scheduled_tokens
        req_ids = req_ids if type(req_ids) is list else list(req_ids)
        n = len(req_ids)
        data, slots = step.routing_data, step.slot_mapping
        if n != len(counts) or n == 0:
            return None
        # Every scheduled request forwards at least one token: as many tokens as
        # requests is one each, and their rows lie in req_ids' order.
        decodes_only = scheduler_output.total_num_scheduled_tokens == n == slots.shape[0]
        if decodes_only:
            sizes, starts = np.ones(n, np.int64), np.arange(n + 1, dtype=np.int64)
        else:
            try:
                sizes = np.fromiter(map(counts.__getitem__, req_ids), np.int64, n)
            except KeyError:
                return None
            starts = np.zeros(n + 1, np.int64)
            np.cumsum(sizes, out=starts[1:])
            if starts[-1] != slots.shape[0]:
                return None
        cached = scheduler_output.scheduled_cached_reqs
        new_reqs = scheduler_output.scheduled_new_reqs
        firsts = None
        if not new_reqs and cached.req_ids == req_ids:  # the worker kept the scheduler's order
            positions = np.fromiter(cached.num_computed_tokens, np.int64, n)
        else:
            firsts = self._firsts(scheduler_output)
            try:
                positions = np.fromiter(map(firsts.__getitem__, req_ids), np.int64, n)
            except KeyError:
                return None
        # One token forwarded, the output's next row at it, and the token's slot in the
        # payload that of the request's KV block: its row is ready now.
        cursors = np.fromiter(map(self._cursors.get, req_ids, repeat(-1)), np.int64, n)
        first_slots = slots if decodes_only else slots[starts[:-1]]
        ok = (cursors == positions) & (sizes == 1)
        ok &= token_slots(req_ids, positions, self._req_blocks, self._block_size) == first_slots
        if decodes_only and ok.all():
            return _StepRows(data, slots, dict(zip(req_ids, map(np.ndarray.copy, data[:, None]))), {}, {})
        picked = ok.tolist()
        ready = dict(zip(compress(req_ids, picked), map(np.ndarray.copy, data[starts[:-1][ok], None])))
        rest = [not p for p in picked]
        where = dict(zip(compress(req_ids, rest), compress(zip(starts.tolist(), positions.tolist(), sizes.tolist()), rest)))
        # A step with no new or resumed request that forwards one token per request is
        # all decodes: no request's output starts before its token of this step.
        if decodes_only and not new_reqs and not cached.resumed_req_ids:
            caught_up = {}
        else:
            caught_up = self._catch_up(firsts or self._firsts(scheduler_output), counts, requests)
        return _StepRows(data, slots, ready, where, caught_up)

    @staticmethod
    def _firsts(scheduler_output) -> dict:
        """Request id -> position of its first token in the step (its computed tokens)."""
        cached = scheduler_output.scheduled_cached_reqs
        firsts = dict(zip(cached.req_ids, cached.num_computed_tokens))
        for new in scheduler_output.scheduled_new_reqs:
            firsts[new.req_id] = new.num_computed_tokens
        return firsts

    def _catch_up(self, firsts: dict, counts: dict, requests: dict) -> dict:
        """The rows before this step's tokens of every request whose output starts
        there and whose step samples (its tokens reach the end of its prompt), read
        from the store into one buffer per request sized for its whole output, in one
        pass. A request whose read misses is left out: its take_output reads again,
        and fails alone."""
        caught_up = {}
        spec = self.store.spec
        for req_id, first in firsts.items():
            start = self._cursors.get(req_id)
            request = requests.get(req_id)
            if start is None or start >= first or request is None:
                continue
            stop = first + counts[req_id]
            if stop < request.num_prompt_tokens:  # a prefill chunk that samples nothing
                continue
            rows = np.empty((stop - start, *spec.token_shape), dtype=spec.storage_dtype)
            try:
                self._read_into(req_id, start, first, rows[: first - start])
            except MissingRoutingError:
                continue
            caught_up[req_id] = (start, rows)
        return caught_up

    def after_output(self, scheduler, outputs: dict) -> None:
        """Fail the requests whose read missed in this output; forget parked blocks of
        requests the scheduler no longer holds (aborted while preempted)."""
        self._step_rows = None
        if self._missing or self._failed:
            self.finish_missing(scheduler, outputs)
        if self._parked and not self._parked.keys() <= scheduler.requests.keys():
            for req_id in self._parked.keys() - scheduler.requests.keys():
                del self._parked[req_id]


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
            routing.connect(self.kv_cache_manager.block_pool)
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
        routing.take_step(
            scheduler_output, model_runner_output.aux_output_connector_output, model_runner_output.req_ids,
            self.requests,
        )
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
        Patch(SCHEDULER, "Scheduler.update_from_output", ("self", "scheduler_output", "model_runner_output"),
              ("self.aux_output_connector.take_output(", "model_runner_output.aux_output_connector_output"),
              _make_update_from_output),
        Patch(SCHEDULER, "Scheduler._free_request", None, ("self.aux_output_connector.request_finished(request)",), None),
        Patch(SCHEDULER, "Scheduler._preempt_request", None,
              ("self.aux_output_connector.request_finished(request)",), None),
    ]
