"""``slotroute bench``: store_batch, get and the wire format on model presets.

Every figure is measured in the same run as its references: a memcpy of the same
bytes under the same cache conditions, and a baseline doing what vLLM 0.29-0.30's
``RoutedExpertsManager`` does (numpy fancy-index assignment of int32 ids into the
narrow slot buffer; a gather through a per-token slot mapping).

Workloads (block_size 16):

- store: an engine step of 8192 tokens, 512 decode tokens (one per running request,
  each in the block its request wrote last step) followed by three prefill runs of
  whole blocks over contiguous slots. Successive calls rotate through steps whose
  prefill blocks are fresh, ROTATION_BYTES or more apart in total, so the destination is
  not cache-resident, as in a serving engine; the memcpy reference writes the same
  rotation of destinations.
- get: a 32,768-token request whose blocks are a shuffled sample of the pool;
  calls rotate over requests covering the whole pool (>= ROTATION_BYTES: 64 MiB, or
  twice the last-level cache where that is larger).
- one-token store: a decode step of a single request.
- encode + decode of an 8192-token step in the storage dtype.
- scheduler reads: the scheduler's reads on vLLM 0.31+ for 256 running requests (4 to
  32 blocks each, shuffled over the pool), as ``ConnectorRouting`` makes them (NOTE 2
  there): one decode step's (a status check per request, the read deferred) against
  one store read of each request's new row and one numpy fancy index of the same rows;
  and every request's whole rows read when it finishes, against a fancy index of the
  same rows.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from slotroute.spec import RoutingSpec
from slotroute.store import RoutedExpertsManager, largest_unsigned, last_level_cache_bytes, stream_results_from
from slotroute.wire import RoutedExpertsLists

__all__ = [
    "PRESETS",
    "GetWorkload",
    "StoreWorkload",
    "VllmBaseline",
    "add_arguments",
    "make_get_workload",
    "make_scheduler_read_workload",
    "scheduler_finish_cases",
    "scheduler_read_cases",
    "make_store_workload",
    "run",
    "warm_up",
]

PRESETS = {
    "qwen3-30b-a3b": RoutingSpec(num_layers=48, top_k=8, num_experts=128),
    "deepseek-v3": RoutingSpec(num_layers=61, top_k=8, num_experts=256),
    "kimi-k2": RoutingSpec(num_layers=61, top_k=8, num_experts=384),
    "gpt-oss-120b": RoutingSpec(num_layers=36, top_k=4, num_experts=128),
}
BLOCK_SIZE = 16
STEP_TOKENS = 8192
REQUEST_TOKENS = 32768
# Footprint the rotations cover: at least twice the last-level cache (64 MiB or more),
# so that every call reads and writes memory, not cache.
ROTATION_BYTES = max(64 << 20, 2 * (last_level_cache_bytes() or 0))
MAX_ROTATION = 4096
PLOT_STEP_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
PLOT_REQUEST_TOKENS = (16, 64, 256, 1024, 4096, 16384, 65536, 131072)


class VllmBaseline:
    """What vLLM 0.29-0.30's scheduler-side manager does, reimplemented for
    comparison: ``buffer[slot_mapping] = data`` with int32 ids, and a read through a
    per-token slot mapping built from the block ids. No validation, no padding or
    written-state handling."""

    def __init__(self, spec: RoutingSpec, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.buffer = np.zeros((num_blocks * block_size, *spec.token_shape), dtype=spec.storage_dtype)

    def store_batch(self, data: np.ndarray, slot_mapping: np.ndarray) -> None:
        self.buffer[slot_mapping] = data

    def get(self, block_ids, num_tokens: int, token_start: int = 0) -> np.ndarray:
        blocks = np.array(block_ids, dtype=np.int32)
        slots = (blocks.reshape(-1, 1) * self.block_size + np.arange(self.block_size)).flatten()
        return self.buffer[slots[:num_tokens][token_start:]]


@dataclass
class StoreWorkload:
    """A rotation of engine steps of the same size over one pool."""

    spec: RoutingSpec
    num_blocks: int
    block_size: int
    steps: list[np.ndarray]  # slot mappings, int64
    data: np.ndarray  # (tokens, L, K) in the storage dtype
    data_int32: np.ndarray

    @property
    def nbytes(self) -> int:
        """Routing bytes of one step, in the storage dtype."""
        return self.data.nbytes


@dataclass
class GetWorkload:
    """Requests of the same length over a pool filled with routing."""

    spec: RoutingSpec
    num_blocks: int
    block_size: int
    requests: list[np.ndarray]  # block ids, int64
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return self.num_tokens * self.spec.bytes_per_token


def _routing(spec: RoutingSpec, num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, spec.num_experts, (num_tokens, *spec.token_shape), dtype=spec.storage_dtype)


def _rotation(nbytes: int) -> int:
    return int(min(MAX_ROTATION, max(2, -(-ROTATION_BYTES // max(nbytes, 1)))))


def make_store_workload(
    spec: RoutingSpec, num_tokens: int = STEP_TOKENS, block_size: int = BLOCK_SIZE, seed: int = 0
) -> StoreWorkload:
    """Steps of ``num_tokens``: up to 64 tokens all decodes, else ``num_tokens // 16``
    decodes (one per request, in that request's current block, advancing by one
    slot per step) followed by three prefill runs of whole blocks over contiguous
    slots, each step's prefill in fresh blocks."""
    rng = np.random.default_rng(seed)
    decodes = num_tokens if num_tokens <= 64 else num_tokens // 16
    prefill_blocks = (num_tokens - decodes) // block_size
    decodes = num_tokens - prefill_blocks * block_size
    runs = np.array_split(np.arange(prefill_blocks), 3) if prefill_blocks else []
    runs = [r for r in runs if r.size]
    region = prefill_blocks + len(runs)  # one free block between runs
    rotation = _rotation(num_tokens * spec.bytes_per_token)
    num_blocks = decodes + rotation * region
    decode_blocks = rng.permutation(decodes)  # requests' current blocks, shuffled
    steps = []
    for k in range(rotation):
        decode_slots = decode_blocks * block_size + (k % block_size)
        base = decodes + k * region
        prefill = [(base + run + i) * block_size for i, run in enumerate(runs)]
        prefill_slots = [(b[:, None] + np.arange(block_size)).ravel() for b in prefill]
        steps.append(np.concatenate([decode_slots, *prefill_slots]).astype(np.int64))
    data = _routing(spec, num_tokens, rng)
    return StoreWorkload(spec, num_blocks, block_size, steps, data, data.astype(np.int32))


def make_get_workload(
    spec: RoutingSpec, num_tokens: int = REQUEST_TOKENS, block_size: int = BLOCK_SIZE, seed: int = 0
) -> GetWorkload:
    """Requests of ``num_tokens`` over shuffled blocks; together they cover a pool of
    at least ROTATION_BYTES (or two requests)."""
    rng = np.random.default_rng(seed)
    request_blocks = -(-num_tokens // block_size)
    rotation = _rotation(num_tokens * spec.bytes_per_token)
    blocks = rng.permutation(rotation * request_blocks)
    requests = [blocks[i * request_blocks : (i + 1) * request_blocks] for i in range(rotation)]
    return GetWorkload(spec, rotation * request_blocks, block_size, requests, num_tokens)


def filled(store, workload: GetWorkload, seed: int = 0):
    """``store`` (a manager or the baseline) with every slot of the pool written."""
    step = 1 << 14
    data = _routing(workload.spec, step, np.random.default_rng(seed))
    slots = workload.num_blocks * workload.block_size
    for start in range(0, slots, step):
        n = min(step, slots - start)
        store.store_batch(data[:n], np.arange(start, start + n, dtype=np.int64))
    return store


class _Request:
    """The part of vLLM's ``Request`` the scheduler connector reads."""

    __slots__ = ("request_id", "num_tokens", "finished")

    def __init__(self, request_id: str, num_tokens: int, finished: bool) -> None:
        self.request_id, self.num_tokens, self.finished = request_id, num_tokens, finished

    def is_finished(self) -> bool:
        return self.finished


@dataclass
class SchedulerReadWorkload:
    """``requests`` running requests in a connector's store, every row up to each
    one's token of this step stored: each request's id, the slots of its tokens in
    order, and the position of its token in this step."""

    spec: RoutingSpec
    routing: object  # slotroute.vllm.connector.ConnectorRouting
    req_ids: list[str]
    slots: list[np.ndarray]
    positions: list[int]

    @property
    def nbytes(self) -> int:
        """Bytes of the rows a decode step emits: one per request."""
        return len(self.req_ids) * self.spec.bytes_per_token

    @property
    def finish_nbytes(self) -> int:
        """Bytes of every request's rows, as they are read when it finishes."""
        return sum(self.positions) * self.spec.bytes_per_token


def make_scheduler_read_workload(
    spec: RoutingSpec, requests: int = 256, block_size: int = BLOCK_SIZE, seed: int = 0
) -> SchedulerReadWorkload:
    """A ``ConnectorRouting`` over a store whose requests each hold 4 to 32 shuffled
    blocks, the rows of all their tokens stored. vLLM's KV blocks and its coordinator
    enter as plain objects with the attributes the connector reads (``block_id``,
    ``req_to_blocks``)."""
    from types import SimpleNamespace

    from slotroute.vllm.connector import ConnectorRouting
    from slotroute.vllm.routing import SlotRouting

    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, 33, requests)
    blocks = np.split(rng.permutation(int(lengths.sum())), np.cumsum(lengths)[:-1])
    req_ids = [f"{i}-{rng.integers(1 << 30):08x}" for i in range(requests)]
    positions = [int(n * block_size - 1 - rng.integers(block_size)) for n in lengths]
    req_to_blocks = {r: [SimpleNamespace(block_id=int(b)) for b in bl] for r, bl in zip(req_ids, blocks)}
    coordinator = SimpleNamespace(single_type_managers=[SimpleNamespace(req_to_blocks=req_to_blocks)])
    store = RoutedExpertsManager(spec, int(lengths.sum()), block_size)
    routing = ConnectorRouting(SlotRouting(store, 0), coordinator)
    offsets = np.arange(block_size)
    slots = [(bl[:, None] * block_size + offsets).reshape(-1)[: p + 1] for bl, p in zip(blocks, positions)]
    every = np.concatenate(slots)
    store.store_batch(_routing(spec, len(every), rng), every)
    return SchedulerReadWorkload(spec, routing, req_ids, slots, positions)


def scheduler_read_cases(workload: SchedulerReadWorkload) -> dict[str, Callable[[], object]]:
    """One decode step's reads on vLLM 0.31+ for every request, as vLLM's
    ``update_from_output`` asks for them (one ``take_output`` per request, none
    finished: NOTE 2 of ``ConnectorRouting`` defers its read), against one store read
    of each request's new row (the per-request path) and one fancy index of the same
    rows of the slot buffer (the rows in another order)."""
    w = workload
    routing = w.routing
    running = [_Request(r, p + 2, False) for r, p in zip(w.req_ids, w.positions)]
    last = np.array([s[-1] for s in w.slots])[np.random.default_rng(1).permutation(len(w.req_ids))]
    pool = routing.store.routed_experts_by_slot

    def per_request():
        return [routing._read_into(req_id, p, p + 1) for req_id, p in zip(w.req_ids, w.positions)]

    return {
        "memcpy": lambda: pool[last],
        "baseline": per_request,
        "ours": lambda: [routing.take_output(request, None) for request in running],
    }


def scheduler_finish_cases(workload: SchedulerReadWorkload) -> dict[str, Callable[[], object]]:
    """Every request finishing: its ``take_output`` reads all its rows, one store read
    over its blocks (NOTE 2 of ``ConnectorRouting``), against one fancy index of the
    same rows of the slot buffer, request by request."""
    w = workload
    routing = w.routing
    finished = [_Request(r, p + 2, True) for r, p in zip(w.req_ids, w.positions)]
    starts = dict.fromkeys(w.req_ids, 0)
    pool = routing.store.routed_experts_by_slot

    def ours():
        routing._cursors.update(starts)
        return [routing.take_output(request, None) for request in finished]

    return {
        "memcpy": lambda: [pool[slots] for slots in w.slots],
        "ours": ours,
    }


# -- timing -------------------------------------------------------------------------


def _cycle(fn: Callable[[int], object], period: int) -> Callable[[], object]:
    state = [0]

    def call():
        state[0] = (state[0] + 1) % period
        return fn(state[0])

    call.period = period
    return call


def warm_up(fn: Callable[[], object]) -> None:
    """Call ``fn`` over its whole rotation: first-touch page faults happen once per
    page in a server's life, not per step."""
    for _ in range(getattr(fn, "period", 1)):
        fn()


def measure(cases: dict[str, Callable[[], object]], rounds: int, target_s: float = 5e-3, progress=None) -> dict[str, float]:
    """Seconds per call of each case: the best of ``rounds`` rounds, each timing
    enough calls to last about ``target_s``. Cases run interleaved, round by round,
    so background load falls on all of them alike; the best round is the one least
    disturbed by it."""
    numbers = {}
    for name, fn in cases.items():
        warm_up(fn)
        start = time.perf_counter()
        fn()
        once = max(time.perf_counter() - start, 1e-7)
        numbers[name] = max(1, min(10_000, int(target_s / once)))
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            number = numbers[name]
            start = time.perf_counter()
            for _ in range(number):
                fn()
            samples[name].append((time.perf_counter() - start) / number)
            if progress is not None:
                progress.update(1)
    return {name: min(values) for name, values in samples.items()}


def store_cases(workload: StoreWorkload, hot: bool = False) -> dict[str, Callable[[], object]]:
    """Timed calls for one step size: ours (narrow and int32 input), the baseline,
    and a memcpy of the same bytes into the same rotation of fresh destinations.
    ``hot`` repeats the first step instead, so that every destination stays in
    cache and the figures show compute, not DRAM."""
    w = workload
    ours = RoutedExpertsManager(w.spec, w.num_blocks, w.block_size)
    base = VllmBaseline(w.spec, w.num_blocks, w.block_size)
    period = 1 if hot else len(w.steps)
    dest = np.zeros((period, *w.data.shape), dtype=w.data.dtype)
    return {
        "memcpy": _cycle(lambda k: np.copyto(dest[k], w.data), period),
        "id check": lambda: largest_unsigned(w.data),  # the store's own pass over the ids
        "baseline": _cycle(lambda k: base.store_batch(w.data_int32, w.steps[k]), period),
        "narrow": _cycle(lambda k: ours.store_batch(w.data, w.steps[k]), period),
        "int32": _cycle(lambda k: ours.store_batch(w.data_int32, w.steps[k]), period),
    }


def get_cases(workload: GetWorkload) -> dict[str, Callable[[], object]]:
    """Timed calls for one request length: ours, the baseline, and a copy of the
    same bytes (a contiguous range of the pool) into a new array, as get returns."""
    w = workload
    ours = filled(RoutedExpertsManager(w.spec, w.num_blocks, w.block_size), w)
    base = filled(VllmBaseline(w.spec, w.num_blocks, w.block_size), w)
    period = len(w.requests)
    pool = ours.routed_experts_by_slot
    n = w.num_tokens
    by_block = pool.reshape(w.num_blocks, w.block_size, *w.spec.token_shape)
    return {
        "memcpy": _cycle(lambda k: pool[k * n : (k + 1) * n].copy(), period),
        "block gather": _cycle(lambda k: np.take(by_block, w.requests[k], axis=0), period),
        "baseline": _cycle(lambda k: base.get(w.requests[k], n), period),
        "ours": _cycle(lambda k: ours.get(w.requests[k], n), period),
    }


def wire_cases(workload: StoreWorkload) -> dict[str, Callable[[], object]]:
    lists = RoutedExpertsLists(workload.data, workload.steps[0])
    return {
        "memcpy": lambda: workload.data.copy(),
        "encode+decode": lambda: RoutedExpertsLists.decode(lists.encode()),
    }


# -- reports ------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    seconds: float
    nbytes: int
    memcpy: float | None  # seconds of the memcpy reference
    baseline: float | None
    target: str
    met: bool | None  # None: a reference row, no target


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def table(name: str, spec: RoutingSpec, rows: list[Row]) -> str:
    lines = [
        f"### {name}: {spec.num_layers} layers, top-{spec.top_k}, {spec.num_experts} experts, "
        f"{spec.storage_dtype.name} ({spec.bytes_per_token} B/token), block_size {BLOCK_SIZE}",
        "",
        "| case | time | GB/s | vs memcpy | vs baseline | target | met |",
        "|---|---:|---:|---:|---:|---|:-:|",
    ]
    for r in rows:
        rate = f"{r.nbytes / r.seconds / 1e9:.1f}" if r.nbytes else ""
        vs_mem = f"{r.memcpy / r.seconds:.2f}x" if r.memcpy else ""
        vs_base = f"{r.baseline / r.seconds:.2f}x" if r.baseline else ""
        lines.append(
            f"| {r.case} | {_fmt_time(r.seconds)} | {rate} | {vs_mem} | {vs_base} | {r.target} | "
            f"{'' if r.met is None else 'yes' if r.met else 'NO'} |"
        )
    return "\n".join(lines)


def floor_row(case: str, seconds: float, nbytes: int, times: dict[str, float]) -> Row:
    """A reference row: what the work costs with nothing but its unavoidable passes,
    with the same ratios as the row above it (no target)."""
    return Row(f"  {case}", seconds, nbytes, times["memcpy"], times["baseline"], "reference", None)


def bench_preset(spec: RoutingSpec, rounds: int, progress=None) -> list[Row]:
    store = make_store_workload(spec)
    t = measure(store_cases(store), rounds, progress=progress)
    hot = measure(store_cases(store, hot=True), rounds, progress=progress)
    one = make_store_workload(spec, num_tokens=1)
    t1 = measure(store_cases(one), rounds, progress=progress)
    get = make_get_workload(spec)
    tg = measure(get_cases(get), rounds, target_s=10e-3, progress=progress)
    tw = measure(wire_cases(store), rounds, progress=progress)
    reads = make_scheduler_read_workload(spec)
    ts = measure(scheduler_read_cases(reads), rounds, progress=progress)
    tf = measure(scheduler_finish_cases(reads), rounds, progress=progress)
    narrow, wide = t["narrow"], t["int32"]
    return [
        Row(
            f"store_batch {STEP_TOKENS} tok, {spec.storage_dtype.name} in", narrow, store.nbytes,
            t["memcpy"], t["baseline"], ">= 2.0x baseline, >= 0.7x memcpy",
            t["baseline"] / narrow >= 2.0 and t["memcpy"] / narrow >= 0.7,
        ),
        floor_row("memcpy + id check (floor of a validated store)", t["memcpy"] + t["id check"], store.nbytes, t),
        # The store streams long runs past the cache (destinations are cold in an
        # engine); with hot destinations that costs it, so this row has no target.
        Row(
            f"  store_batch {STEP_TOKENS} tok, {spec.storage_dtype.name} in, cache-hot", hot["narrow"],
            store.nbytes, hot["memcpy"], hot["baseline"], "reference", None,
        ),
        Row(
            f"store_batch {STEP_TOKENS} tok, int32 in", wide, store.nbytes, t["memcpy"],
            t["baseline"], ">= 0.5x baseline", t["baseline"] / wide >= 0.5,
        ),
        Row(
            f"get {REQUEST_TOKENS} tok, shuffled blocks", tg["ours"], get.nbytes, tg["memcpy"],
            tg["baseline"], ">= 1.2x baseline, >= 0.8x memcpy",
            tg["baseline"] / tg["ours"] >= 1.2 and tg["memcpy"] / tg["ours"] >= 0.8,
        ),
        floor_row("gather of the same blocks, unchecked (floor of get)", tg["block gather"], get.nbytes, tg),
        Row(
            f"store_batch 1 tok, {spec.storage_dtype.name} in", t1["narrow"], 0, None,
            t1["baseline"], "<= 15 µs", t1["narrow"] <= 15e-6,
        ),
        Row(
            f"encode+decode {STEP_TOKENS} tok", tw["encode+decode"], store.nbytes, tw["memcpy"],
            None, ">= 5 GB/s", store.nbytes / tw["encode+decode"] >= 5e9,
        ),
        # "vs memcpy" here: against one fancy index of the same rows; "vs baseline":
        # against one store read per request.
        Row(
            f"scheduler reads, {len(reads.req_ids)} decoding requests", ts["ours"], reads.nbytes, ts["memcpy"],
            ts["baseline"], ">= 2.0x per-request store reads", ts["baseline"] / ts["ours"] >= 2.0,
        ),
        Row(
            f"scheduler reads, {len(reads.req_ids)} requests finishing", tf["ours"], reads.finish_nbytes,
            tf["memcpy"], None, ">= 0.8x fancy index", tf["memcpy"] / tf["ours"] >= 0.8,
        ),
    ]


def minor_faults() -> int:
    """Minor page faults of the calling thread so far (of the process where the
    platform counts none per thread)."""
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def demand_paging_report(spec: RoutingSpec, num_slots: int = 1 << 20) -> str:
    """Build a large store, write one step, and report RSS and store stats."""
    step = make_store_workload(spec, seed=1)
    rss0 = _rss_bytes()
    mgr = RoutedExpertsManager(spec, num_slots // BLOCK_SIZE, BLOCK_SIZE)
    rss1 = _rss_bytes()
    mgr.store_batch(step.data, step.steps[0])
    rss2 = _rss_bytes()
    stats = mgr.stats()
    mib = 1 << 20
    lines = [
        f"demand paging ({num_slots} slots, {spec.bytes_per_token} B/token): capacity "
        f"{stats.capacity_bytes / mib:.0f} MiB; after storing {STEP_TOKENS} tokens "
        f"({step.nbytes / mib:.1f} MiB) resident {stats.resident_bytes / mib:.1f} MiB"
    ]
    if rss0 is not None:
        lines.append(
            f"process RSS: +{(rss1 - rss0) / mib:.1f} MiB after construction, "
            f"+{(rss2 - rss1) / mib:.1f} MiB after the store"
        )
    return "; ".join(lines)


def first_write_report(spec: RoutingSpec, rounds: int, num_slots: int = 1 << 18, steps: int = 8) -> str:
    """What the first writes into a store's pages cost (``store.py``, NOTE 4): per
    round, a lazy store and a populated one, in alternating order, each taking
    ``steps`` 8192-token steps into consecutive blocks no step wrote before, as a fresh
    engine's prefills; the median (min-max) over rounds of each store's median step,
    their ratio, and what ``populate`` took."""
    data = _routing(spec, STEP_TOKENS, np.random.default_rng(2))
    lazy_us, populated_us, populate_ms = [], [], []
    for r in range(rounds):
        for populated in (r % 2 == 0, r % 2 == 1):
            mgr = RoutedExpertsManager(spec, num_slots // BLOCK_SIZE, BLOCK_SIZE)
            if populated:
                started = time.perf_counter()
                mgr.populate()
                populate_ms.append(1e3 * (time.perf_counter() - started))
            took = []
            for k in range(steps):
                slots = np.arange(k * STEP_TOKENS, (k + 1) * STEP_TOKENS, dtype=np.int64)
                started = time.perf_counter()
                mgr.store_batch(data, slots)
                took.append(time.perf_counter() - started)
            (populated_us if populated else lazy_us).append(1e6 * statistics.median(took))
            del mgr

    def spread(values: list[float], unit: str) -> str:
        return f"{statistics.median(values):.0f} {unit} ({min(values):.0f}-{max(values):.0f})"

    mib = num_slots * (spec.bytes_per_token + 8) / (1 << 20)
    return (
        f"first writes ({rounds} rounds, {STEP_TOKENS}-token steps into blocks no step wrote): a lazy store "
        f"{spread(lazy_us, 'us')}, a populated one {spread(populated_us, 'us')}, "
        f"{statistics.median(lazy_us) / statistics.median(populated_us):.1f}x; populate() of "
        f"{mib:.0f} MiB {spread(populate_ms, 'ms')}"
    )


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    llc = last_level_cache_bytes()
    cache = f"{llc >> 20} MiB last-level cache" if llc else "last-level cache unknown"
    return (
        f"{model}, {os.cpu_count()} CPUs, {cache}, numpy {np.__version__}, Python {sys.version.split()[0]}; "
        f"rotations over {ROTATION_BYTES >> 20} MiB, results from {stream_results_from() >> 20} MiB streamed"
    )


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "slotroute bench --plot needs matplotlib: pip install 'slotroute[bench]'"
        ) from None
    return plt


def plot(path: str, spec: RoutingSpec, rounds: int, progress=None) -> None:
    """Write GB/s against tokens per step (store) and request length (get) as a PNG."""
    plt = _pyplot()
    store_rates: dict[str, list[float]] = {}
    for n in PLOT_STEP_TOKENS:
        w = make_store_workload(spec, num_tokens=n)
        for name, s in measure(store_cases(w), rounds, progress=progress).items():
            store_rates.setdefault(name, []).append(w.nbytes / s / 1e9)
    get_rates: dict[str, list[float]] = {}
    for n in PLOT_REQUEST_TOKENS:
        w = make_get_workload(spec, num_tokens=n)
        for name, s in measure(get_cases(w), rounds, progress=progress).items():
            get_rates.setdefault(name, []).append(w.nbytes / s / 1e9)
    labels = {
        "narrow": f"store_batch, {spec.storage_dtype.name} in",
        "int32": "store_batch, int32 in",
        "ours": "get",
        "baseline": "vLLM 0.29 baseline",
        "memcpy": "memcpy",
        "id check": "id check alone",
        "block gather": "block gather, unchecked",
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, xs, rates, xlabel in (
        (axes[0], PLOT_STEP_TOKENS, store_rates, "tokens per step"),
        (axes[1], PLOT_REQUEST_TOKENS, get_rates, "request length (tokens)"),
    ):
        for name, ys in rates.items():
            ax.plot(xs, ys, marker="o", label=labels[name], linestyle="--" if name == "memcpy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("GB/s of routing")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0].set_title("store_batch")
    axes[1].set_title("get (shuffled blocks)")
    fig.suptitle(f"{spec.num_layers} layers, top-{spec.top_k}, {spec.num_experts} experts; {machine()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _progress(total: int):
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="round", leave=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", action="append", choices=sorted(PRESETS), metavar="NAME",
        help=f"model preset to run (repeatable; default: all of {', '.join(PRESETS)})",
    )
    parser.add_argument("--quick", action="store_true", help="fewer timing rounds (noisier)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds per case (default 7, quick 3)")
    parser.add_argument(
        "--plot", metavar="PATH", help="also write scaling curves for the first preset as a PNG"
    )
    parser.add_argument("--check", action="store_true", help="exit with status 1 if a target is missed")


def run(args: argparse.Namespace) -> int:
    names = args.preset or list(PRESETS)
    rounds = args.rounds or (3 if args.quick else 7)
    if rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if args.plot:
        _pyplot()  # fail before the measurements, not after
    print(f"machine: {machine()}")
    # 5 + 5 + 5 + 4 + 2 + 3 cases per preset; the plot has 5 per step size and 4 per length.
    total = rounds * (24 * len(names) + (5 * len(PLOT_STEP_TOKENS) + 4 * len(PLOT_REQUEST_TOKENS) if args.plot else 0))
    progress = _progress(total)
    all_met = True
    try:
        for name in names:
            spec = PRESETS[name]
            rows = bench_preset(spec, rounds, progress)
            all_met &= all(r.met for r in rows if r.met is not None)
            _print(progress, "\n" + table(name, spec, rows))
        _print(progress, "\n" + demand_paging_report(PRESETS[names[0]]))
        _print(progress, first_write_report(PRESETS[names[0]], rounds))
        if args.plot:
            plot(args.plot, PRESETS[names[0]], rounds, progress)
            _print(progress, f"\nwrote {args.plot}")
    finally:
        if progress is not None:
            progress.close()
    print("\nall targets met" if all_met else "\nsome targets NOT met (see the 'met' column)")
    return 1 if args.check and not all_met else 0


def _print(progress, text: str) -> None:
    if progress is not None:
        progress.write(text)
    else:
        print(text, flush=True)
