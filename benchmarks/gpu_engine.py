"""A real vLLM on one GPU, a Qwen3-30B-A3B-shaped MoE, three configurations
interleaved over rounds: routing off, vLLM's own routed-experts path
(``SLOTROUTE_DISABLE=1``) and slotroute.

The model has Qwen3-30B-A3B's shape (48 MoE layers, 128 experts, top-8, hidden 2048,
MoE intermediate 768, 32 query and 4 KV heads of 128; about 61 GB of bf16 weights),
with random weights drawn by vLLM itself (``load_format="dummy"``): only its
``config.json`` is written, so no 61 GB file is written or read. Routing of random
weights is as costly to capture, ship and store as a trained model's.

Three workloads per engine process, after a short warm-up:
``rollout``: 256 requests of 1024 random prompt tokens and 256 generated tokens,
submitted at once; ``multi-turn``: 64 conversations of 4 turns, each turn's prompt the
previous prompt, its completion and 128 new tokens, 128 generated per turn (prefix
cache hits on every turn after the first); ``multi-turn-start``: the same with
``routed_experts_prompt_start`` at the previous turn's length, as a trainer that holds
the earlier turns' rows asks (routing off runs it without).

Each configuration runs in its own process (vLLM caches its environment per
process). A first child of each configuration, discarded, fills its compile caches
(``--warm-up compile``: it only starts the engine and serves a few requests, sparing
the workloads' time, with no per-call breakdown; ``--warm-up profile``: the same, then
decode steps of 64 and of 256 requests, the prefill of 64 rollout prompts and a
multi-turn turn's first step (128 tokens more on each of 64 cached prompts) under
torch.profiler, reported as each kernel's and copy's device time per step where the
configurations differ, beside each call's wall time);
then every configuration runs once per round, in an order that rotates between rounds
(``--rounds``, default 3). Printed per configuration and workload: the median, min and
max over rounds of generated tok/s and requests/min, host time per engine step in the
worker's routing calls and in vLLM's whole scheduler (``schedule`` and
``update_from_output``, timed alike in every configuration, routing off included), and
bytes shipped per step; the host time each routing path adds (its worker calls plus
the scheduler's time beyond routing off's in the same round); and for each comparison
the ratio of medians with the range of the same-round ratios, flagged where that range
is wider than the difference claimed; and where each workload's time went: the engine's
step period, and at each ``generate`` call's start and end the time before its first
step, its last step's ``update_from_output`` and the time after it (``timeline``).
Counted children wrap nothing that runs once per request, so their tok/s pays no
timing; the warm-up children time every routing call, for a per-call breakdown. Every
child's figures go to ``--json``; with ``--budget-s`` the run stops before a child
that would not finish in time, and the same command line continues it from the JSON
(with a larger ``--rounds``, it adds rounds to those found; a JSON of another setup
stops the run and is kept). Each counted child records its machine (host name and boot
id) and GPU, so a run may go on on another machine, in a later session: there the
configurations still to run warm up first, a round begun elsewhere runs again whole
(the earlier figures kept in the JSON as ``superseded``), and every round's ratios
come from one machine; the report names the machines and their rounds.

``--narrow`` cuts the model's widths (hidden 128, MoE intermediate 64, 4 query and 1 KV
head of 32) and keeps its layers, experts and top-k: each token's rows are the GPU
run's size (384 bytes at 48 layers) where a CPU runs the workloads in minutes.

The model runner is vLLM's default (V2 on 0.29-0.32); ``--runner v1`` sets
``VLLM_USE_V2_MODEL_RUNNER=0`` (on 0.31+ vLLM's own path needs V2: ``--configs
off,slotroute`` there). ``--configs`` may also name ``slotroute-lazy``: slotroute with
its scheduler store paged in as steps write it (``SLOTROUTE_LAZY_STORE=1``) instead of
committed at start, and ``slotroute-at-finish``: on vLLM 0.31+, each request's rows all
read when it finishes, none of its prompt's read ahead while it decodes
(``SLOTROUTE_READ_AT_FINISH=1``), ``slotroute-per-layer``: the worker's capture
copying each MoE layer's routing as its router runs (``SLOTROUTE_CAPTURE_COPY_ONCE=0``)
instead of once after the last MoE layer, ``slotroute-whole-reads``: on vLLM 0.28-0.30,
each prompt read whole at its last prefill step's output, none of its rows read while
that step runs (``SLOTROUTE_READ_AHEAD=0``), ``slotroute-ahead``: those reads ahead
set explicitly (``SLOTROUTE_READ_AHEAD=1``, slotroute's default since they were measured;
the configuration of the run that measured them), and ``slotroute-joins``: the front
end joining each request's rows when it finishes, as vLLM does, instead of filling one
array as they come (on 0.31+, instead of handing out the connector's array as it came;
``SLOTROUTE_JOIN_AT_FINISH=1``); each compared with slotroute in the same rounds.
``--workloads`` runs some of the three workloads only (each child then takes less device
time: more rounds fit a session). ``--passes N`` has each counted child run each of its
workloads N times in its engine, each pass on an empty prefix cache: a child's figures
are its middle pass's by wall time (every pass's wall time, tok/s and requests/min kept
beside them), so that a pass the host slowed once moves no round's ratio, and each pass
costs a workload's time rather than an engine's start (about 11 s against 45 s for the
rollout on an H200). The report also compares the children's first passes alone: the
engine's first time through a workload, which is where memory first touched shows.

usage: python benchmarks/gpu_engine.py [--runner v2|v1] [--rounds 3] [--passes 1] [--warm-up full|compile|profile] [--json OUT] [--budget-s S]
(``--layers 2 --requests 8 --prompt-len 128 --gen-len 16 --kv-cache-gb 1 --eager --rounds 1``
is a smoke run that fits a CPU build of vLLM.)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import operator
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

LOADED = time.perf_counter()  # a child's clock from here: its imports, start, workloads, exit

CONFIGS = ("off", "vllm", "slotroute")
# Run only when named in --configs: slotroute with its store paged in as steps write it
# (``SLOTROUTE_LAZY_STORE=1``), against which the same run measures the store committed
# at start; and slotroute reading each request's rows only when it finishes
# (``SLOTROUTE_READ_AT_FINISH=1``), against which it measures the prompt's read-ahead;
# and slotroute copying each MoE layer's routing as its router runs
# (``SLOTROUTE_CAPTURE_COPY_ONCE=0``), against which it measures its one copy a step;
# and slotroute reading vLLM 0.28-0.30's prompts whole at their last prefill step's output
# (``SLOTROUTE_READ_AHEAD=0``), against which it measures reading them ahead of it, which
# ``slotroute-ahead`` sets explicitly (``SLOTROUTE_READ_AHEAD=1``, the default); and the
# front end joining each request's rows at finish, as vLLM does
# (``SLOTROUTE_JOIN_AT_FINISH=1``), against which it measures filling one array (on
# 0.31+, handing out the connector's array as it came).
EXTRA_CONFIGS = ("slotroute-lazy", "slotroute-at-finish", "slotroute-per-layer", "slotroute-ahead",
                 "slotroute-whole-reads", "slotroute-joins")
KNOWN_CONFIGS = CONFIGS + EXTRA_CONFIGS
SLOTROUTE_CONFIGS = ("slotroute",) + EXTRA_CONFIGS
# Each configuration's environment variables; the others' are removed from its child.
CONFIG_ENV = {"vllm": {"SLOTROUTE_DISABLE": "1"}, "slotroute-lazy": {"SLOTROUTE_LAZY_STORE": "1"},
              "slotroute-at-finish": {"SLOTROUTE_READ_AT_FINISH": "1"},
              "slotroute-per-layer": {"SLOTROUTE_CAPTURE_COPY_ONCE": "0"},
              "slotroute-ahead": {"SLOTROUTE_READ_AHEAD": "1"},
              "slotroute-whole-reads": {"SLOTROUTE_READ_AHEAD": "0"},
              "slotroute-joins": {"SLOTROUTE_JOIN_AT_FINISH": "1"}}
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
    hidden_act="silu", tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=151643,
    eos_token_id=151645, attention_bias=False, attention_dropout=0.0, initializer_range=0.02,
    output_router_logits=False, router_aux_loss_coef=0.001, use_sliding_window=False, sliding_window=None,
    max_window_layers=48, rope_scaling=None, use_cache=True,
)


# ``--narrow``: the layers, experts and top-k kept (so each token's rows are the GPU
# run's 384 bytes at 48 layers), every width cut to what a CPU runs in minutes
NARROW = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32)


def write_config(path: Path, layers: int, narrow: bool = False) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = dict(QWEN3_30B_A3B, num_hidden_layers=layers, max_window_layers=layers, **(NARROW if narrow else {}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# The adding of a request (vLLM's ``LLMEngine.add_request``): the LLMEngine attribute
# and its method called once per request.
ADDING = (("input_processor", "process_inputs"), ("output_processor", "add_request"), ("engine_core", "add_request"))


def thread_faults() -> int:
    """The calling thread's minor page faults so far (0 where the system does not count
    them by thread)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt if hasattr(resource, "RUSAGE_THREAD") else 0


class Timer:
    """Host seconds and calls of wrapped methods, by label (``worker``, ``scheduler``,
    ...) and by ``label:method`` (the breakdown; a ``detail`` label times calls nested
    in others, kept out of the totals). With ``count_faults``, also the minor page
    faults of the calling thread during each call, by ``label:method`` (a first touch
    of memory the allocator mapped fresh; two ``getrusage`` calls a call, so only the
    warm-up children count them, but for a method wrapped with ``count_faults=True``),
    and every call's faults (``fault_samples``). A method wrapped with ``mark`` also
    leaves each call's start and end in ``marks``, as ``(mark, started, ended)``: which
    of a turn's calls ran before its first step ended (``start_parts``)."""

    def __init__(self, count_faults: bool = False) -> None:
        self.marks: list[tuple[str, float, float]] = []
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.samples: dict[str, list[float]] = {}  # every call's seconds, by label:method
        self.faults: dict[str, int] = {}  # minor page faults, by label:method, where counted
        self.fault_samples: dict[str, list[int]] = {}  # every counted call's, by label:method
        self._count_faults = count_faults and hasattr(resource, "RUSAGE_THREAD")
        self.gc_seconds: dict[int, float] = {}  # the garbage collector's, by generation
        self.gc_runs: dict[int, int] = {}
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            generation = info["generation"]
            self.gc_seconds[generation] = self.gc_seconds.get(generation, 0.0) + time.perf_counter() - self._gc_started
            self.gc_runs[generation] = self.gc_runs.get(generation, 0) + 1

    def wrap(self, owner, name: str, label: str, on_call=None, count_faults: bool | None = None,
             mark: str | None = None) -> None:
        inner = getattr(owner, name)
        keys = (label, f"{label}:{name}")
        seconds, calls, samples, faults, fault_samples, marks = (self.seconds, self.calls, self.samples, self.faults,
                                                                 self.fault_samples, self.marks)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            took = time.perf_counter() - started
            for key in keys:
                seconds[key] = seconds.get(key, 0.0) + took
                calls[key] = calls.get(key, 0) + 1
            samples.setdefault(keys[1], []).append(took)
            if mark is not None:
                marks.append((mark, started, started + took))
            if on_call is not None:
                on_call(args, result)
            return result

        def counted(*args, **kwargs):
            before = thread_faults()
            result = timed(*args, **kwargs)
            took = thread_faults() - before
            faults[keys[1]] = faults.get(keys[1], 0) + took
            fault_samples.setdefault(keys[1], []).append(took)
            return result

        counting = self._count_faults if count_faults is None else count_faults and hasattr(resource, "RUSAGE_THREAD")
        setattr(owner, name, counted if counting else timed)

    def reset(self) -> None:
        for kept in (self.marks, self.seconds, self.calls, self.samples, self.faults, self.fault_samples,
                     self.gc_seconds, self.gc_runs):
            kept.clear()


def time_adding(timer: Timer, engine) -> None:
    """Time the adding of the requests in its three parts (``ADDING``), once per
    request in every configuration alike (about a microsecond a call, 256 calls a
    multi-turn pass): the input processor's request, the front end's request state, and
    the engine core's request and scheduler entry (in this process: no
    multiprocessing). Each part's seconds are ``timer.seconds["adding_" + attribute]``."""
    for owner, method in ADDING:
        timer.wrap(getattr(engine, owner), method, f"adding_{owner}")


# The host's calls a turn's start is split into (start_parts), each wrapped with its
# mark: vLLM's schedule, the runner's execute_model and sample_tokens, the wait for a
# step's output (its async output's get_output), vLLM's update_from_output and the
# front end's process_outputs.
START_PARTS = ("schedule", "execute", "sample", "wait", "update", "output")


def time_runner(timer: Timer, runner) -> None:
    """Time the model runner's calls of a step in every configuration alike (three
    wrapped calls a step, about a microsecond each): ``execute_model`` and
    ``sample_tokens`` on ``runner``, and the ``get_output`` of the async outputs that
    ``sample_tokens`` returns (where a step's output waits for the device), wrapped on
    their class the first time one comes: a wrapper on each output would hold it in a
    reference cycle, its memory kept until a garbage collection."""
    waited: set[type] = set()

    def time_wait(args, result) -> None:
        kind = type(result)
        if kind not in waited and hasattr(kind, "get_output"):
            waited.add(kind)
            timer.wrap(kind, "get_output", "runner", mark="wait")

    timer.wrap(runner, "execute_model", "runner", mark="execute")
    timer.wrap(runner, "sample_tokens", "runner", mark="sample", on_call=time_wait)


def start_parts(called: float, ends: list[float], marks: list[tuple[str, float, float]]) -> dict | None:
    """The host ms, by ``START_PARTS`` mark, of the marked calls (``Timer.marks``) that
    ran between a ``generate`` call's start (``called``) and its first step's end
    (``ends[0]``): where a turn's start went beside the adding of its requests. None
    for a call that ran no step."""
    if not ends:
        return None
    parts = dict.fromkeys(START_PARTS, 0.0)
    for part, began, ended in marks:
        if part in parts and called <= began and ended <= ends[0]:
            parts[part] += 1e3 * (ended - began)
    return parts


def is_connector_generation() -> bool:
    """Whether the installed vLLM is 0.31+, whose routing path is the aux-output connector."""
    import vllm

    return tuple(int(part) for part in vllm.__version__.split(".")[:2]) >= (0, 31)


def count_host_pool(pool: dict) -> None:
    """Count, in ``pool``, the pinned host memory slotroute's capturer reserves at start
    (``reserved``) and the chunks its host pool adds (``added``, ``added_bytes``): a
    chunk added inside a step page-locks its memory there."""
    from slotroute import capture

    reserve, add = capture.RoutedExpertsCapturer.reserve_host, capture._HostPool._add_chunk

    def reserve_host(self, nbytes):
        pool["reserved"] = reserve(self, nbytes)
        return pool["reserved"]

    def _add_chunk(self, nbytes):
        chunk = add(self, nbytes)
        pool["added"] += 1
        pool["added_bytes"] += chunk[0].numel()
        return chunk

    capture.RoutedExpertsCapturer.reserve_host, capture._HostPool._add_chunk = reserve_host, _add_chunk


def instrument(config: str, timer: Timer, shipped: list[int], detail: bool = False) -> None:
    """Wrap the routing calls of ``config``'s path (classes, before the engine starts;
    nothing slotroute verifies, so its patches still go in).

    A counted child (``detail`` false) wraps only what runs once per step: the worker's
    calls and the call whose arguments count the bytes shipped. A wrapper costs about
    a microsecond a call in the engine, and the scheduler's routing calls run once per
    request (``take_output``, ``get``): timing them would slow the configurations whose
    tok/s is compared with routing off. Their time is in the scheduler's own, which
    every child times alike (``child``). The warm-up children (``detail``) wrap every
    routing call, for the per-call breakdown only."""
    if config == "off":
        return
    if not detail:
        real_wrap = timer.wrap

        def wrap(owner, name, label, on_call=None):
            if label == "worker":
                real_wrap(owner, name, label, on_call)
            elif on_call is not None:
                real_wrap(owner, name, "bytes", on_call)

        timer = SimpleNamespace(wrap=wrap)

    def count_bytes(args, result):
        data, slots = args[-2], args[-1]
        shipped.append(int(data.nbytes) + int(slots.nbytes))

    connector_generation = is_connector_generation()
    if config == "vllm" and connector_generation:
        from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
        from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

        def count_rows(args, result):  # what one step's worker output carries
            shipped.append(sum(out.rows.nbytes + 8 for out in (result or {}).values()))

        from vllm.distributed.aux_output_connector.worker import PendingAuxOutput

        for name in ("build_connector_meta", "take_output", "request_finished"):
            timer.wrap(AuxOutputSchedulerConnector, name, "scheduler")
        for name in ("begin_step", "prepare_output"):
            timer.wrap(AuxOutputWorkerConnector, name, "worker")
        timer.wrap(PendingAuxOutput, "enqueue_cpu_copy", "worker")
        timer.wrap(AuxOutputWorkerConnector, "process_output", "worker", count_rows)
    elif config == "vllm":
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            RoutedExpertsManager,
        )
        from vllm.v1.outputs import RoutedExpertsTensors
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

        timer.wrap(RoutedExpertsManager, "store_batch", "scheduler", count_bytes)
        timer.wrap(RoutedExpertsManager, "get", "scheduler")
        # The step's device copies: the capturer's on V2, the runner's own method on V1.
        timer.wrap(RoutedExpertsCapturer, "get_routed_experts", "worker")
        if hasattr(V1Runner, "get_routed_experts"):
            timer.wrap(V1Runner, "get_routed_experts", "worker")
        # The copy to the host, which both runners' async outputs start, and the lists
        # the scheduler reads.
        if hasattr(RoutedExpertsTensors, "to_cpu_nonblocking"):
            timer.wrap(RoutedExpertsTensors, "to_cpu_nonblocking", "worker")
        timer.wrap(RoutedExpertsTensors, "tolists", "worker")
    elif connector_generation:
        from slotroute.vllm import runner_v1, runner_v2_connector
        from slotroute.store import RoutedExpertsManager
        from slotroute.vllm.connector import ConnectorRouting
        from slotroute.vllm.routing import SlotRouting
        from slotroute.vllm.worker import WorkerRouting

        # Not ``get`` nor ``store_batch``'s time: ``take_output`` and ``take_step`` call them.
        timer.wrap(RoutedExpertsManager, "store_batch", "bytes", count_bytes)
        for name in ("build_connector_meta", "take_output", "request_finished", "take_step", "after_output"):
            timer.wrap(ConnectorRouting, name, "scheduler")
        timer.wrap(SlotRouting, "on_new_blocks", "scheduler")
        timer.wrap(ConnectorRouting, "_read_next", "detail")
        timer.wrap(WorkerRouting, "begin_step", "worker")
        timer.wrap(WorkerRouting, "snapshot_step", "worker")
        timer.wrap(runner_v2_connector.PendingStep, "enqueue_cpu_copy", "worker")
        timer.wrap(runner_v2_connector.PendingStep, "process_output", "worker")
        timer.wrap(runner_v1, "_ship_aux_output", "worker")
    else:
        from slotroute.vllm import runner_v1, runner_v2
        from slotroute.vllm.routing import SlotRouting
        from slotroute.vllm.scheduler import SchedulerRouting
        from slotroute.vllm.worker import WorkerRouting

        timer.wrap(SchedulerRouting, "store_batch", "scheduler", count_bytes)
        timer.wrap(SchedulerRouting, "get", "scheduler")
        timer.wrap(SchedulerRouting, "after_output", "scheduler")
        for name in ("on_new_blocks", "seal_step", "before_output"):
            timer.wrap(SlotRouting, name, "scheduler")
        timer.wrap(WorkerRouting, "begin_step", "worker")
        timer.wrap(WorkerRouting, "snapshot_step", "worker")
        timer.wrap(runner_v2.StepRouting, "to_cpu_nonblocking", "worker")
        timer.wrap(runner_v2.StepRouting, "tolists", "worker")
        timer.wrap(runner_v1, "as_vllm_lists", "worker")
    if config in SLOTROUTE_CONFIGS and detail:  # where the worker's calls spend it
        import torch

        from slotroute import capture

        for name in ("_snapshot_async", "_acquire_slot"):
            timer.wrap(capture.RoutedExpertsCapturer, name, "detail")
        for name in ("_resolve", "enqueue_copy"):
            timer.wrap(capture.PendingSnapshot, name, "detail")
        timer.wrap(capture._HostPool, "take", "detail")
        timer.wrap(capture._HostPool, "_next_chunk", "detail")  # a chunk reused or allocated
        timer.wrap(capture._RingSlot, "__init__", "detail")  # slots made after start: one-off or added
        kernel = capture._fused_kernel() if torch.cuda.is_available() else None
        if kernel is not None:
            timer.wrap(kernel.PackLauncher, "launch", "detail")


WORKLOADS = ("rollout", "multi-turn", "multi-turn-start")
TURNS = 4


def workloads(requests: int, prompt_len: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rollout = [rng.integers(1000, 150000, prompt_len).tolist() for _ in range(requests)]
    conversations = [rng.integers(1000, 150000, prompt_len).tolist() for _ in range(max(requests // 4, 1))]
    return rollout, conversations, rng


def child(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    timer, shipped = Timer(count_faults=args.detail), []
    import numpy as np
    from vllm import LLM, SamplingParams

    instrument(args.child, timer, shipped, args.detail)
    pool = dict(reserved=0, added=0, added_bytes=0)
    if args.child in SLOTROUTE_CONFIGS:
        count_host_pool(pool)
    started = time.perf_counter()
    llm = LLM(
        model=args.model, dtype="bfloat16", load_format="dummy", skip_tokenizer_init=True, seed=0,
        distributed_executor_backend="uni", enable_prefix_caching=True, gpu_memory_utilization=0.90,
        max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
        enable_return_routed_experts=args.child != "off",
        kv_cache_memory_bytes=None if args.kv_cache_gb is None else int(args.kv_cache_gb * (1 << 30)),
        enforce_eager=args.eager,
    )
    start_s = time.perf_counter() - started
    # vLLM's whole scheduler, timed alike in every configuration: what routing adds to
    # it is the difference from routing off.
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    step_ends: list[float] = []  # when each update_from_output returned: the engine's steps, in time
    timer.wrap(scheduler, "update_from_output", "steps", mark="update",
               on_call=lambda args, result: step_ends.append(time.perf_counter()))
    scheduled: list[int] = []  # each schedule's tokens, in order (the steps that carry prefill are long)
    timer.wrap(scheduler, "schedule", "schedule", mark="schedule",
               on_call=lambda args, result: scheduled.append(result.total_num_scheduled_tokens))
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    time_runner(timer, runner)
    time_adding(timer, llm.llm_engine)
    config = llm.llm_engine.vllm_config
    rollout, conversations, _ = workloads(args.requests, args.prompt_len)
    gen, turn_gen = args.gen_len, max(args.gen_len // 2, 1)
    routing = args.child != "off"

    generate_calls: list[tuple] = []  # (called, steps' ends, returned, the last step's update_from_output seconds)
    call_start_parts: list[dict | None] = []  # per generate call, its start's host ms by part (start_parts)
    call_schedules: list[list[int]] = []  # per generate call, its schedules' tokens (empty ones too)
    call_requests: list[int] = []  # per generate call, its requests
    # per generate call, each step's host us in vLLM's update_from_output and schedule, in the
    # front end's process_outputs (LLMEngine.step's) and in the runner's calls (time_runner), in
    # order: what each kind of step costs the host
    finished: list[int] = []  # each process_outputs call's requests finished (their rows joined there)
    if hasattr(getattr(llm.llm_engine, "output_processor", None), "process_outputs"):
        # its page faults too, in every configuration alike (two getrusage calls a step): a
        # finishing request's rows are joined into a new array there, memory the allocator
        # may hand out fresh
        timer.wrap(llm.llm_engine.output_processor, "process_outputs", "output", count_faults=True, mark="output",
                   on_call=lambda args, result: finished.append(
                       sum(bool(getattr(o, "finished", False)) for o in getattr(result, "request_outputs", ()))))
    host_series = {"update": "steps:update_from_output", "schedule": "schedule:schedule",
                   "output": "output:process_outputs", "execute": "runner:execute_model",
                   "sample": "runner:sample_tokens", "wait": "runner:get_output"}
    call_host_us: dict[str, list[list[int]]] = {name: [] for name in host_series}
    call_output_faults: list[list[int]] = []  # per generate call, each process_outputs call's page faults
    call_finished: list[list[int]] = []  # per generate call, each process_outputs call's requests finished

    def marks() -> tuple[float, int, float]:
        """The time, the thread's minor page faults and the garbage collector's seconds so far."""
        return time.perf_counter(), thread_faults(), sum(timer.gc_seconds.values())

    # the marks when each generate call started running the engine, its requests added
    # (vLLM's LLM._run_engine)
    engine_runs: list[tuple[float, int, float]] = []
    # per generate call, what adding its requests took: seconds, page faults, collector's seconds
    call_added: list[tuple[float, int, float] | None] = []
    if hasattr(llm, "_run_engine"):
        run_engine = llm._run_engine

        def started_engine(*args, **kwargs):
            engine_runs.append(marks())
            return run_engine(*args, **kwargs)

        llm._run_engine = started_engine

    manager = getattr(scheduler, "routed_experts_mgr", None)

    def reads_ahead() -> tuple[int, int]:
        return (getattr(manager, "reads_made_ahead", 0), getattr(manager, "reads_served_ahead", 0))

    def run(prompts, n, starts=None):
        params = [
            SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False,
                **({"routed_experts_prompt_start": start} if routing and start else {}),
            )
            for start in (starts or [0] * len(prompts))
        ]
        called_marks = marks()
        called, first, first_schedule = called_marks[0], len(step_ends), len(scheduled)
        first_run = len(engine_runs)
        first_host = {name: len(timer.samples.get(key, ())) for name, key in host_series.items()}
        first_faults, first_finished = len(timer.fault_samples.get(host_series["output"], ())), len(finished)
        first_mark = len(timer.marks)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        returned, ends = time.perf_counter(), step_ends[first:]
        call_schedules.append(scheduled[first_schedule:])
        call_requests.append(len(prompts))
        for name, key in host_series.items():
            call_host_us[name].append([round(1e6 * t) for t in timer.samples.get(key, [])[first_host[name]:]])
        call_output_faults.append(timer.fault_samples.get(host_series["output"], [])[first_faults:])
        call_finished.append(finished[first_finished:])
        # the last step's update_from_output: where the finished requests' outputs are made
        last_update = timer.samples["steps:update_from_output"][-1] if ends else 0.0
        generate_calls.append((called, ends, returned, last_update))
        call_start_parts.append(start_parts(called, ends, timer.marks[first_mark:]))
        call_added.append(tuple(map(operator.sub, engine_runs[first_run], called_marks))
                          if len(engine_runs) > first_run else None)
        for output, start in zip(outputs, starts or [0] * len(prompts)):
            routed = output.outputs[0].routed_experts
            expected = len(output.prompt_token_ids) + n - 1 - start
            if routing and (routed is None or routed.shape[0] != expected):
                raise AssertionError(f"routed_experts {None if routed is None else routed.shape}, {expected} rows expected")
        return outputs

    warmed = time.perf_counter()
    run(rollout[:16], 16)  # warm-up (its prompts are cached; the workloads reset the cache)
    warm_up_s = time.perf_counter() - warmed
    profiles = {}
    for name, (count, prompt_len, generated, cached_len) in PROFILES.items() if args.profile else ():
        llm.reset_prefix_cache()
        prompts = [p[:prompt_len] for p in rollout[:count]]
        if cached_len != 0:  # the earlier turns, cached off the profile; the turn adds the prompts' tokens
            cached = [p[:cached_len] for p in rollout[:count]]
            run(cached, 1)
            prompts = [c + p for c, p in zip(cached, prompts)]
        profiles[name] = device_profile(lambda: run(prompts, generated), step_ends)

    def run_workload(name: str) -> dict:
        """One pass of workload ``name`` on an empty prefix cache: its figures."""
        llm.reset_prefix_cache()
        timer.reset()
        shipped.clear()
        generate_calls.clear()
        call_start_parts.clear()
        call_schedules.clear()
        call_requests.clear()
        for calls in (*call_host_us.values(), call_output_faults, call_finished):
            calls.clear()
        call_added.clear()
        pool.update(added=0, added_bytes=0)
        made, served = reads_ahead()
        began = time.perf_counter()
        generated = requests = 0
        if name == "rollout":
            run(rollout, gen)
            generated, requests = gen * len(rollout), len(rollout)
        else:
            turn_rng = np.random.default_rng(1 if name == "multi-turn" else 2)  # no hits across workloads
            prompts = [turn_rng.integers(1000, 150000, len(p)).tolist() for p in conversations]
            starts = None
            for _ in range(TURNS):
                outputs = run(prompts, turn_gen, starts)
                generated += turn_gen * len(prompts)
                requests += len(prompts)
                history = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outputs]
                starts = [len(h) for h in history] if name == "multi-turn-start" else None
                prompts = [h + turn_rng.integers(1000, 150000, turn_gen).tolist() for h in history]
        wall = time.perf_counter() - began
        made_after, served_after = reads_ahead()
        steps = max(timer.calls.get("steps", 0), 1)
        # the adding of the requests over the generate calls that ran steps (the turn starts)
        turn_starts = [added for added, (_, ends, _, _) in zip(call_added, generate_calls) if ends]
        adding = None if None in call_added else [sum(parts) for parts in zip((0.0, 0, 0.0), *turn_starts)]
        started = [parts for parts in call_start_parts if parts is not None]
        in_parts = {f"start_{part}_ms": sum(parts[part] for parts in started) for part in START_PARTS}
        timed = timeline(generate_calls, wall)
        return dict(
            wall_s=wall, tok_s=generated / wall, req_min=60 * requests / wall, steps=steps,
            bytes_per_step=sum(shipped) / steps,
            worker_us_per_step=1e6 * timer.seconds.get("worker", 0.0) / steps,
            scheduler_us_per_step=1e6 * (timer.seconds.get("steps", 0.0) + timer.seconds.get("schedule", 0.0)) / steps,
            routing_scheduler_us_per_step=1e6 * timer.seconds.get("scheduler", 0.0) / steps,
            worker_calls_per_step=timer.calls.get("worker", 0) / steps,
            scheduler_calls_per_step=timer.calls.get("scheduler", 0) / steps,
            breakdown_us_per_step={k: 1e6 * v / steps for k, v in timer.seconds.items() if ":" in k},
            breakdown_calls_per_step={k: v / steps for k, v in timer.calls.items() if ":" in k},
            # per call: the median and the largest (a garbage collection or a wait lands in one call)
            breakdown_median_us={k: 1e6 * statistics.median(v) for k, v in timer.samples.items()},
            breakdown_max_us={k: 1e6 * max(v) for k, v in timer.samples.items()},
            breakdown_faults_per_call={k: v / timer.calls[k] for k, v in timer.faults.items() if timer.calls.get(k)},
            gc_ms={str(g): 1e3 * v for g, v in sorted(timer.gc_seconds.items())},
            gc_runs={str(g): v for g, v in sorted(timer.gc_runs.items())},
            host_pool_chunks_added=pool["added"], host_pool_bytes_added=pool["added_bytes"],
            **timed,
            scheduled_tokens=[list(tokens) for tokens in call_schedules], requests_per_call=list(call_requests),
            step_host_us={name: [list(call) for call in calls] for name, calls in call_host_us.items()},
            **finishing(call_host_us["output"], call_output_faults, call_finished),
            # the part of the turn starts spent adding the requests, before the engine's first
            # step, and the minor page faults and the garbage collector's time in it
            turn_add_ms=None if adding is None else 1e3 * adding[0],
            turn_adds_ms=None if adding is None else [round(1e3 * added[0], 3) for added in turn_starts],  # each call's
            turn_add_faults=None if adding is None else adding[1],
            turn_add_gc_ms=None if adding is None else 1e3 * adding[2],
            # the rest of the turn starts: the host's calls in them by part (start_parts),
            # summed over the calls and each call's, and what neither the adding nor they
            # took (the engine's loop, or the host waiting on nothing it timed)
            **in_parts,
            turn_start_parts_ms={part: [round(parts[part], 3) for parts in started] for part in START_PARTS},
            start_rest_ms=None if adding is None else timed["turn_start_ms"] - 1e3 * adding[0] - sum(in_parts.values()),
            # and its parts (time_adding), over the pass
            **{f"add_{owner}_ms": 1e3 * timer.seconds.get(f"adding_{owner}", 0.0) for owner, _ in ADDING},
            # vLLM 0.28-0.30's prompts read ahead of their last prefill step's output, and
            # those reads served (SchedulerRouting's NOTE 2; 0 with SLOTROUTE_READ_AHEAD=0)
            reads_made_ahead=made_after - made, reads_served_ahead=served_after - served,
        )

    results = {}
    for name in () if args.compile_only else args.workloads.split(","):
        results[name] = middle_pass([run_workload(name) for _ in range(args.passes)])
    import vllm

    print("CHILD " + json.dumps(dict(
        config=args.child, start_s=start_s, results=results, use_v2=config.use_v2_model_runner,
        runner=f"{type(runner).__module__}.{type(runner).__qualname__}", vllm=vllm.__version__,
        device=device_name(),
        cudagraph_mode=str(config.compilation_config.cudagraph_mode),
        async_scheduling=bool(config.scheduler_config.async_scheduling),
        host_reserved_bytes=pool["reserved"], **({"profile": profiles} if args.profile else {}),
        # where a child's time outside its engine start and workloads goes: vLLM's import
        # before the start, the short warm-up after it, and (the parent's wall time less
        # elapsed_s) Python's start and the exit after this line
        import_s=started - LOADED, warm_up_s=warm_up_s, elapsed_s=time.perf_counter() - LOADED,
    )), flush=True)


# ``--warm-up profile``: name: (requests, prompt tokens, tokens generated, prompt tokens
# cached first). Decode steps of as many requests as a multi-turn and a rollout step
# carries (short prompts, so that the steps are nearly all decode), prefill steps of the
# rollout's whole prompts (None: the workloads' prompt length; one token generated, so
# every step is a chunk of prompts), and a multi-turn turn's first step: each request's
# first prompt cached by an unprofiled call, then 128 tokens more prefilled on it in one
# step (``turn-64``), where the V1 runner's turn starts ran slower with routing on.
PROFILES = {"decode-64": (64, 128, 64, 0), "decode-256": (256, 128, 64, 0), "prefill-64": (64, None, 1, 0),
            "turn-64": (64, 128, 1, None)}
PROFILE_NAME_CHARS = 160  # a kernel's name kept (templated names run to thousands)
PROFILE_MIN_US = 0.5  # the least difference between configurations a kernel is listed for
PROFILE_ROWS = 30  # kernels the report lists per profile


def device_profile(generate, step_ends: list[float]) -> dict:
    """What ``generate()`` ran on the device, per engine step (``step_ends`` grows by
    one per step): each kernel's and copy's time and launches (torch.profiler; with no
    CUDA device, each CPU op's, so that the path runs on CPU too), and their sum
    (over every stream: copies overlapping kernels count in full). Kernels in CUDA
    graphs are each their own entry. Also the call's wall time and its time to its first
    step's end (the requests added and the first step run), the profiler on: where they
    differ between configurations more than the device time, the host made the
    difference. A profiler that fails is recorded, not raised (a warm-up child serves
    on); ``generate()`` failing is raised."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    first = len(step_ends)
    try:
        prof = profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
        prof.start()
    except Exception as error:  # noqa: BLE001 - the profiler's own failure, whatever it is
        return dict(error=f"{type(error).__name__}: {error}"[:1000])
    failed = None
    called = time.perf_counter()
    try:
        generate()  # its own failure is raised: a routing check must fail the child
    finally:
        returned = time.perf_counter()
        try:
            prof.stop()
            events = prof.key_averages()
        except Exception as error:  # noqa: BLE001
            failed = error
    if failed is not None:
        return dict(error=f"{type(failed).__name__}: {failed}"[:1000])
    steps = max(len(step_ends) - first, 1)
    kernels: dict[str, list[float]] = {}
    for event in events:
        us = getattr(event, "self_device_time_total", 0.0) if cuda else event.self_cpu_time_total
        if us > 0:
            entry = kernels.setdefault(event.key[:PROFILE_NAME_CHARS], [0.0, 0.0])
            entry[0] += us / steps
            entry[1] += event.count / steps
    first_end = step_ends[first] if len(step_ends) > first else None
    return dict(steps=steps, device="cuda" if cuda else "cpu", busy_us_per_step=sum(v[0] for v in kernels.values()),
                kernels=kernels, wall_ms=1e3 * (returned - called),
                first_step_ms=None if first_end is None else 1e3 * (first_end - called))


def timeline(generate_calls: list[tuple], wall_s: float) -> dict:
    """Where a workload's time went, from each ``generate`` call's start, the ends of
    its engine steps (``update_from_output`` returning), its return and its last
    step's ``update_from_output`` seconds: the median interval between consecutive
    steps' ends within a call (the engine's step period while requests run: the
    forward, or the host where it is not hidden behind it) and the time the steps took
    beyond it (prefill chunks, a turn's first steps); summed over calls, each
    call's time to its first step's end (adding the requests and the first step), its
    last step's ``update_from_output`` (the finished requests' outputs made: slotroute
    reads their rows there) and the time from that step's end to its return (the
    outputs handed back: vLLM's own path joins its rows there), all three with no
    forward left to overlap them at a turn's end; and the workload's time outside
    ``generate`` (the benchmark's own checks and next prompts). The intervals at the
    period, the time beyond it, the starts, the ends and the time outside add up to the
    workload's wall time. Every interval too, per call (``step_intervals_ms``), and
    each call's start (``turn_starts_ms``: one slow turn told from every turn slower)."""
    intervals = [[b - a for a, b in zip(ends, ends[1:])] for _, ends, _, _ in generate_calls]
    periods = [interval for call in intervals for interval in call]
    stepped = [call for call in generate_calls if call[1]]
    starts = [ends[0] - called for called, ends, _, _ in stepped]
    period = statistics.median(periods) if periods else None
    return dict(
        step_period_us=None if period is None else 1e6 * period,
        beyond_period_ms=0.0 if period is None else 1e3 * (sum(periods) - len(periods) * period),
        turn_start_ms=1e3 * sum(starts),
        turn_starts_ms=[round(1e3 * start, 3) for start in starts],
        last_update_ms=1e3 * sum(last_update for _, _, _, last_update in stepped),
        turn_end_ms=1e3 * sum(returned - ends[-1] for _, ends, returned, _ in stepped),
        outside_generate_ms=1e3 * (wall_s - sum(returned - called for called, _, returned, _ in generate_calls)),
        # every step, to compare configurations step by step (their schedules are the same)
        step_intervals_ms=[[round(1e3 * interval, 3) for interval in call] for call in intervals],
    )


def finishing(output_us: list[list[int]], output_faults: list[list[int]], finished: list[list[int]]) -> dict:
    """The steps in which requests finished, from each ``generate`` call's
    ``process_outputs`` calls (each one's host us, page faults and requests finished, in
    order): there vLLM's front end joins each finishing request's rows into a new
    array (on 0.28-0.30 its prompt's and one a decode step; 0.31+ send them in one
    piece), so what a routing path's rows cost to join shows there, at a turn's end
    with little or no forward left to hide it. Their ``process_outputs`` ms and page
    faults, summed over the calls (``None`` where the three do not line up: a vLLM
    without the method, or a platform that counts no faults)."""
    lined_up = bool(finished) and len(output_us) == len(output_faults) == len(finished) and all(
        len(us) == len(faults) == len(done) for us, faults, done in zip(output_us, output_faults, finished))
    if not lined_up:
        return dict(finishing_output_ms=None, finishing_faults=None)
    steps = [(us, flt) for call_us, call_faults, call_finished in zip(output_us, output_faults, finished)
             for us, flt, done in zip(call_us, call_faults, call_finished) if done]
    return dict(finishing_output_ms=sum(us for us, _ in steps) / 1e3, finishing_faults=sum(flt for _, flt in steps))


# Counts a child's figures sum over its passes rather than take from the kept one.
PASS_SUMS = ("host_pool_chunks_added", "host_pool_bytes_added")


def middle_pass(passes: list[dict]) -> dict:
    """A child's figures for a workload it ran ``passes`` times in one engine: those of
    its middle pass by wall time (of an even number, the faster of the two middle
    ones), so that one pass slowed by the host (a collection, a neighbour's burst)
    moves nothing, with every pass's wall time, tok/s and requests/min in order
    (``passes``; the first is the engine's first time through the workload, which the
    report compares on its own as well), the kept pass's index (``pass_kept``) and the
    counts of memory added (the capturer's pinned chunks, the reads past the scheduler's
    read memory) summed over all passes. One pass is returned as it is."""
    if len(passes) == 1:
        return passes[0]
    kept = sorted(range(len(passes)), key=lambda i: passes[i]["wall_s"])[(len(passes) - 1) // 2]
    return dict(passes[kept], pass_kept=kept,
                passes=[{k: p[k] for k in ("wall_s", "tok_s", "req_min")} for p in passes],
                **{k: sum(p[k] for p in passes) for k in PASS_SUMS if k in passes[kept]})


def step_kinds(result: dict) -> dict | None:
    """A workload's time between steps' ends (``step_intervals_ms``) split by what the
    step that closes each interval carried: prompt tokens (more tokens than its
    ``generate`` call has requests: a prefill chunk, alone or beside decodes) or
    decodes only; the steps and ms of each. A call's steps are paired with its
    schedules in order, all of them or the non-empty ones, whichever are as many as
    its steps; None where neither is, or where the child recorded no steps.

    Where the child recorded each step's host time (``step_host_us``), the same split
    of the host ms in ``update_from_output`` (``*_update_ms``, one per step's end),
    ``schedule`` (``*_schedule_ms``, paired as the tokens are) and the front end's
    ``process_outputs`` (``*_output_ms``, where a call has one per step): what the
    host spends on each kind of step, which a step whose forward does not hide the
    host adds to its interval."""
    try:
        calls = list(zip(result["step_intervals_ms"], result["scheduled_tokens"], result["requests_per_call"],
                         strict=True))
    except (KeyError, ValueError):
        return None
    host = result.get("step_host_us") or {}
    # a series that pairs with the steps: one schedule per tokens entry, else one per step's end
    series = [name for name in ("update", "schedule", "output")
              if len(host.get(name, ())) == len(calls)
              and all(not intervals or len(us) == (len(tokens) if name == "schedule" else len(intervals) + 1)
                      for us, (intervals, tokens, _) in zip(host[name], calls))]
    split = dict(prompt_steps=0, prompt_ms=0.0, decode_steps=0, decode_ms=0.0)
    split.update({f"{kind}_{name}_ms": 0.0 for name in series for kind in ("prompt", "decode")})
    for index, (intervals, tokens, requests) in enumerate(calls):
        if not intervals:
            continue
        kept = next((mask for mask in ([True] * len(tokens), [n > 0 for n in tokens])
                     if sum(mask) == len(intervals) + 1), None)
        if kept is None:
            return None
        paired = [n for n, keep in zip(tokens, kept) if keep]
        per_step = {name: host[name][index] for name in series}
        if "schedule" in per_step:  # a schedule per tokens entry: kept as the tokens are
            per_step["schedule"] = [us for us, keep in zip(per_step["schedule"], kept) if keep]
        for step, (interval, step_tokens) in enumerate(zip(intervals, paired[1:]), start=1):
            kind = "prompt" if step_tokens > requests else "decode"
            split[f"{kind}_steps"] += 1
            split[f"{kind}_ms"] += interval
            for name, us in per_step.items():
                split[f"{kind}_{name}_ms"] += us[step] / 1e3
    return split


def child_environment(config: str, env: dict) -> dict:
    """The environment of a child of ``config``: ``env`` with that configuration's
    variables set and every other configuration's removed, so an inherited one (a
    ``SLOTROUTE_LAZY_STORE`` exported in the shell) changes no configuration."""
    child_env = {k: v for k, v in env.items() if not any(k in e for e in CONFIG_ENV.values())}
    child_env.update(CONFIG_ENV.get(config, {}))
    return child_env


def allocator_environment(env: dict) -> dict:
    """The variables of ``env`` that set glibc's allocator (``GLIBC_TUNABLES``,
    ``MALLOC_*``): every child inherits them, so a run made under them records them in
    its setup, and a run under other ones is not continued in its JSON (the scheduler's
    reads and the front end's joins fault on memory the allocator hands out fresh)."""
    return {k: v for k, v in sorted(env.items()) if k == "GLIBC_TUNABLES" or k.startswith("MALLOC_")}


def plan(configs: list[str], rounds: int) -> list[dict]:
    """The children to run: a discarded warm-up of each configuration (each compiles a
    graph of its own: routing on or off, slotroute's hooks or vLLM's, and a cold
    compile starts an engine in minutes instead of seconds), then each configuration
    once per round, the order rotated by one configuration each round."""
    children = [dict(round=0, config=c) for c in configs]
    for r in range(rounds):
        k = r % len(configs)
        children += [dict(round=r + 1, config=c) for c in configs[k:] + configs[:k]]
    return children


def record_child(entry: dict, result, seconds: float, time_key: str) -> bool:
    """A finished child process (``result``: its exit status, stdout and stderr) into its
    entry in the run's JSON: the figures of its last ``CHILD`` line, or where it exited
    non-zero or printed none, ``failed`` with the exit status and stderr's end; its
    time under ``time_key`` either way. A child run again after failing in an earlier
    call keeps that failure as ``failed_before`` beside its figures, so that no entry
    holds figures and ``failed`` at once. Returns whether it succeeded."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("CHILD ")]
    if result.returncode != 0 or not lines:
        entry.update(failed=f"exit {result.returncode}: {result.stderr[-3000:]}", **{time_key: seconds})
        return False
    if "failed" in entry:
        entry["failed_before"] = entry.pop("failed")
    entry.update(json.loads(lines[-1][6:]), **{time_key: seconds})
    return True


def device_name() -> str:
    """The GPU this process sees (``torch.cuda.get_device_name``), or ``cpu``."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def this_machine() -> str:
    """The machine this call runs on: its host name and boot id, so that a machine given
    back and another lent under the same name are told apart. Every counted child
    records it; a round's ratios are same-machine ratios only where all its children
    ran on one."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def resume_on(children: list[dict], machine: str) -> tuple[list[int], bool]:
    """Prepares a run found in a JSON to go on on ``machine``. A counted round begun on
    another machine and not finished there (or finished on two) runs again here whole:
    the figures of each of its children that ran move into their entry's ``superseded``
    list, so that the JSON keeps every child and each round's ratios come from one
    machine. A child recorded before machines were recorded counts as run on a machine
    other than any this call can be on. Returns the rounds started again, and whether
    this run goes on from a child that ran on another machine (whose compile caches this
    machine lacks: the configurations still to run warm up first)."""
    by_round: dict[int, list[dict]] = {}
    for c in children:
        if c.get("round", 0) > 0:
            by_round.setdefault(c["round"], []).append(c)
    restarted, split = [], split_rounds(children)
    for r, entries in sorted(by_round.items()):
        done = [c for c in entries if "results" in c]
        unfinished = len(done) < len(entries) or r in split
        if done and unfinished and any(c.get("machine") != machine for c in done):
            restarted.append(r)
            for c in done:
                figures = {k: c.pop(k) for k in list(c) if k not in ("round", "config", "superseded")}
                c.setdefault("superseded", []).append(figures)
    ran = [c for c in children if "results" in c]
    return restarted, bool(ran) and ran[-1].get("machine") != machine


def machines_of(children: list[dict], rounds: list[int]) -> list[dict]:
    """The machines the counted ``rounds`` ran on, in the order they were first used:
    each one's GPU and rounds (children recorded before machines were, one machine)."""
    found: dict[str, dict] = {}
    for c in children:
        if c.get("round", 0) in rounds and "results" in c:
            m = found.setdefault(str(c.get("machine")), dict(machine=c.get("machine"), device=c.get("device"), rounds=[]))
            if c["round"] not in m["rounds"]:
                m["rounds"].append(c["round"])
    return list(found.values())


def write_json(path: Path, state: dict) -> None:
    """``state`` to ``path`` whole or not at all (written beside it, then renamed), so
    that a copy taken at any moment, or a call stopped mid-write, holds a readable run."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(state, indent=1))
    os.replace(part, path)


def continued(path: str | None, setup: dict, children: list[dict]) -> dict:
    """The run to go on with: a new one (``setup`` and its planned ``children``) where
    ``path`` holds none; the run found there where it was started with the same setup;
    where only ``rounds`` grew, the run found with the added rounds' children of the
    new plan appended, so that the rounds it holds are kept and the rotation goes on.

    Raises
    ------
    SystemExit
        If the run found has another setup, or more rounds than ``setup`` asks for:
        naming what differs. The file is left as found: another run never replaces it.
    """
    if not path or not Path(path).exists():
        return dict(setup=setup, children=children)
    found = json.loads(Path(path).read_text())
    had = found.get("setup", {})
    if had == setup:
        print(f"continuing {path}: {sum('results' in c or 'tok_s' in c for c in found['children'])} children done",
              flush=True)
        return found
    differs = sorted(k for k in set(had) | set(setup) if had.get(k) != setup.get(k))
    if differs == ["rounds"] and had["rounds"] < setup["rounds"]:
        found["children"] += [c for c in children if c["round"] > had["rounds"]]
        found["setup"] = setup
        print(f"continuing {path} with rounds {had['rounds'] + 1}-{setup['rounds']} added", flush=True)
        return found
    raise SystemExit(
        f"{path} holds a run of another setup ("
        + ", ".join(f"{k}: {had.get(k)!r} there, {setup.get(k)!r} asked" for k in differs)
        + "); --rounds may only grow. Pass another --json, or move that file away to start a new run"
    )


def expected_child_s(children: list[dict], warm_up: bool, key: str = "wall_s") -> float:
    """How long the next child is expected to take: the longest child of its kind
    (warm-ups compile, counted children load cached graphs) that ran, in this call or
    an earlier one of the same run; before any child of its kind, the longest child
    of any kind, and 60 s before any child at all. ``key`` names each child's whole
    time in its entry."""
    same = [c[key] for c in children if key in c and (c["round"] == 0) == warm_up]
    return max(same or [c[key] for c in children if key in c] or [60.0])


def _spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values), n=len(values))


METRICS = ("tok_s", "req_min", "worker_us_per_step", "scheduler_us_per_step", "bytes_per_step")
# Where the time went (``timeline``), in children from 2026-11-27 on: summarized where
# every round of a configuration has them. The steps' time beyond the period came
# later: a child without it shows "-" there.
TIMELINE = ("step_period_us", "turn_start_ms", "last_update_ms", "turn_end_ms", "outside_generate_ms")
TIMELINE_LATER = ("beyond_period_ms", "turn_add_ms")
# What a routing path adds to the host per step: its worker calls, and the scheduler's
# time beyond routing off's in the same round.
ADDED = ("vllm", "slotroute")
# The rounds a claim needs before every one of them meeting it, with a spread narrower
# than its margin, resolves it (the GPU engine targets of docs/benchmarks.md: medians of at
# least 3 interleaved rounds).
RESOLVING_ROUNDS = 3
# (configuration, against, what is claimed of the ratio of their tok/s)
COMPARISONS = (("slotroute", "off", 0.99), ("slotroute", "vllm", 1.0), ("vllm", "off", None),
               ("slotroute", "slotroute-lazy", None), ("slotroute", "slotroute-at-finish", None),
               ("slotroute", "slotroute-per-layer", None), ("slotroute", "slotroute-ahead", None),
               ("slotroute-ahead", "off", 0.99), ("slotroute-ahead", "vllm", 1.0),
               ("slotroute", "slotroute-whole-reads", None), ("slotroute", "slotroute-joins", None))


def split_rounds(children: list[dict]) -> list[int]:
    """The counted rounds whose children with figures ran on more than one machine."""
    machines: dict[int, set] = {}
    for c in children:
        if c.get("round", 0) > 0 and "results" in c:
            machines.setdefault(c["round"], set()).add(c.get("machine"))
    return sorted(r for r, m in machines.items() if len(m) > 1)


def rounds_of(children: list[dict]) -> tuple[list[int], dict[int, list[str]]]:
    """The counted rounds in which every configuration of the run has a child with
    results, and the others: each round still partial (a run stopped by its budget, a
    child that failed) with the configurations it has results for."""
    configs = dict.fromkeys(c["config"] for c in children if c.get("round", 0) > 0)
    ran: dict[int, set] = {}
    for c in children:
        if c.get("round", 0) > 0:
            ran.setdefault(c["round"], set())
            if "results" in c:
                ran[c["round"]].add(c["config"])
    split = split_rounds(children)  # they compare nothing within one machine
    whole = [r for r in sorted(ran) if ran[r] == set(configs) and r not in split]
    partial = {r: [c for c in configs if c in ran[r]] for r in sorted(ran) if r not in whole}
    return whole, partial


def summarize(children: list[dict]) -> dict:
    """Per workload and configuration, the median, min and max of each metric over the
    whole rounds (the warm-up left out, and a round that lacks some configuration's
    figures, so that every median is over the same rounds); per comparison, the ratio
    of the medians and the range of the same-round ratios, how many of those meet the
    claim, and whether that range is wider than the difference between the ratio and
    the claim (or 1 where nothing is claimed)."""
    whole, partial = rounds_of(children)
    rounds = [c for c in children if c.get("round", 0) in whole and "results" in c]
    summary: dict = {"rounds": whole, "partial_rounds": partial, "split_rounds": split_rounds(children),
                     "machines": machines_of(children, whole),
                     "configs": {}, "comparisons": {}}
    workloads_seen = [w for w in WORKLOADS if any(w in c["results"] for c in rounds)]
    for workload in workloads_seen:
        by_config: dict[str, dict] = {}
        for config in dict.fromkeys(c["config"] for c in rounds):
            ran = sorted((c for c in rounds if c["config"] == config and workload in c["results"]),
                         key=lambda c: c["round"])
            runs = [c["results"][workload] for c in ran]
            by_config[config] = {metric: _spread([r[metric] for r in runs]) for metric in METRICS}
            by_config[config].update({
                metric: _spread([r[metric] for r in runs]) for metric in TIMELINE + TIMELINE_LATER
                if all(r.get(metric) is not None for r in runs)
            })
            kinds = [step_kinds(r) for r in runs]
            if runs and all(k is not None for k in kinds):
                by_config[config]["step_kinds"] = {key: _spread([k[key] for k in kinds]) for key in kinds[0]}
            by_config[config]["per_round"] = _per_round([c["round"] for c in ran], runs, kinds)
            by_config[config]["start_per_round"] = _per_round([c["round"] for c in ran], runs, kinds, START_PER_ROUND)
        summary["configs"][workload] = by_config
        for config, against, claim in COMPARISONS:
            if config not in by_config or against not in by_config:
                continue
            metric = "req_min" if workload == "multi-turn-start" else "tok_s"
            medians, ratios = _ratios(rounds, workload, config, against, lambda r: r[metric])
            if claim is not None and against == "off" and workload == "multi-turn-start":
                claim = 0.995  # requests/min with routed_experts_prompt_start
            target = 1.0 if claim is None else claim
            spread = max(ratios) - min(ratios)
            summary["comparisons"][f"{workload}: {config} / {against} ({metric})"] = dict(
                ratio_of_medians=medians, round_ratios=ratios, claim=claim,
                meets_claim=None if claim is None else medians >= claim,
                rounds_meeting_claim=None if claim is None else sum(r >= claim for r in ratios),
                spread_wider_than_difference=spread > abs(medians - target),
            )
            if any("passes" in c["results"].get(workload, {}) for c in rounds):
                first, first_ratios = _ratios(rounds, workload, config, against,
                                              lambda r: r["passes"][0][metric] if "passes" in r else r[metric])
                summary["comparisons"][f"{workload}: {config} / {against} ({metric})"]["first_passes"] = dict(
                    ratio_of_medians=first, round_ratios=first_ratios)
        summary.setdefault("host", {})[workload] = _host_cost(rounds, workload)
    warm_ups = [(f"{c['config']} {workload}", r) for c in children
                if c.get("round") == 0 and "results" in c and c["config"] != "off"
                for workload, r in c["results"].items()]
    summary["breakdown"] = {name: r.get("breakdown_us_per_step", {}) for name, r in warm_ups}
    summary["breakdown_faults"] = {name: r.get("breakdown_faults_per_call", {}) for name, r in warm_ups}
    summary["routing_calls"] = _routing_calls(children)
    summary["device_profile"] = device_profiles(children)
    return summary


# The per-round table's columns: (heading, where a child's figure comes from: its
# workload's result, or the step kinds of it (step_kinds), and the key there).
PER_ROUND = (("wall s", "result", "wall_s"), ("prompt steps' intervals", "kinds", "prompt_ms"),
             ("prompt steps' update_from_output", "kinds", "prompt_update_ms"),
             ("decode-only steps' intervals", "kinds", "decode_ms"), ("turn starts", "result", "turn_start_ms"),
             ("of them, adding the requests", "result", "turn_add_ms"),
             ("adding's page faults", "result", "turn_add_faults"),
             ("adding's garbage collection", "result", "turn_add_gc_ms"),
             ("adding: input processor", "result", "add_input_processor_ms"),
             ("adding: request state", "result", "add_output_processor_ms"),
             ("adding: engine core", "result", "add_engine_core_ms"),
             ("finishing steps' process_outputs", "result", "finishing_output_ms"),
             ("their page faults", "result", "finishing_faults"))
DECIMALS = {"wall_s": 2, "turn_add_gc_ms": 1}  # a column's decimals where not 0
# The turn starts' table, per round (children from 2026-12-08 on): the adding of the
# requests and the host's calls before each turn's first step ended (START_PARTS).
START_PER_ROUND = (("turn starts", "result", "turn_start_ms"), ("adding the requests", "result", "turn_add_ms"),
                   ("schedule", "result", "start_schedule_ms"), ("execute_model", "result", "start_execute_ms"),
                   ("sample_tokens", "result", "start_sample_ms"),
                   ("waiting for the output", "result", "start_wait_ms"),
                   ("update_from_output", "result", "start_update_ms"),
                   ("process_outputs", "result", "start_output_ms"), ("the rest", "result", "start_rest_ms"))


def _per_round(rounds: list[int], runs: list[dict], kinds: list[dict | None], columns=PER_ROUND) -> dict:
    """One configuration's figures on a workload in each of its counted ``rounds``
    (its ``runs``' results and their ``step_kinds``, in round order), per column of
    ``columns``: a list of one value a round, or None where some run lacks the figure."""
    figures: dict = {"round": rounds}
    for _, source, key in columns:
        values = [(run if source == "result" else kind or {}).get(key) for run, kind in zip(runs, kinds)]
        figures[key] = None if None in values else values
    return figures


def _ratios(rounds: list[dict], workload: str, config: str, against: str, value) -> tuple[float, list[float]]:
    """``config`` against ``against`` on ``workload`` over the counted children
    ``rounds``, by ``value`` (a child's result to a figure): the ratio of the medians
    and the same-round ratios."""
    paired: dict[int, dict[str, float]] = {}
    for c in rounds:
        if workload in c["results"]:
            paired.setdefault(c["round"], {})[c["config"]] = value(c["results"][workload])
    ratios = [p[config] / p[against] for p in paired.values() if config in p and against in p]
    medians = [statistics.median(p[name] for p in paired.values() if name in p) for name in (config, against)]
    return medians[0] / medians[1], ratios


def device_profiles(children: list[dict]) -> dict:
    """Per profiled workload, from the warm-up children (the last of each
    configuration that has a profile): each configuration's device time per step and
    steps (or the profiler's error), and the kernels whose time per step differs
    between configurations by at least ``PROFILE_MIN_US``, each with every
    configuration's us and launches per step (0 where it ran none): first those some
    configuration never ran, then the rest, each group most different first."""
    found: dict[str, dict] = {}
    for c in children:
        if c.get("round") == 0 and "results" in c and c.get("profile"):
            found[c["config"]] = c["profile"]
    profiles: dict[str, dict] = {}
    for config, by_workload in found.items():
        for workload, p in by_workload.items():
            entry = profiles.setdefault(workload, dict(configs={}, kernels={}))
            entry["configs"][config] = (dict(error=p["error"]) if "error" in p else
                                        dict(busy_us_per_step=p["busy_us_per_step"], steps=p["steps"],
                                             **{k: p[k] for k in ("wall_ms", "first_step_ms") if k in p}))
    for workload, entry in profiles.items():
        ran = {config: found[config][workload]["kernels"] for config in entry["configs"]
               if "kernels" in found[config][workload]}
        names = dict.fromkeys(name for kernels in ran.values() for name in kernels)
        rows = {name: {config: kernels.get(name, [0.0, 0.0]) for config, kernels in ran.items()} for name in names}
        spread = {name: max(v[0] for v in row.values()) - min(v[0] for v in row.values()) for name, row in rows.items()}
        everywhere = {name: all(name in kernels for kernels in ran.values()) for name in names}
        # first the kernels some configuration never ran (what a routing path adds), then
        # those all ran (the forward's, apart by the noise between processes)
        entry["kernels"] = {name: rows[name] for name in sorted(rows, key=lambda n: (everywhere[n], -spread[n]))
                            if spread[name] >= PROFILE_MIN_US}
    return profiles


def _routing_calls(children: list[dict]) -> dict:
    """Per workload and routing path, the host us/step of its routing calls as the
    warm-up child timed them all (worker and scheduler, wrappers included; one child
    each, so no spread): the same method for both paths, free of the variation of
    vLLM's whole scheduler between processes; and slotroute's total over vLLM's own."""
    calls: dict[str, dict] = {}
    for c in children:
        if c.get("round") != 0 or "results" not in c or c["config"] not in ADDED:
            continue
        for workload, r in c["results"].items():
            if r.get("routing_scheduler_us_per_step") is None:
                continue
            worker, scheduler = r["worker_us_per_step"], r["routing_scheduler_us_per_step"]
            calls.setdefault(workload, {})[c["config"]] = dict(worker=worker, scheduler=scheduler, total=worker + scheduler)
    for by_config in calls.values():
        if len(by_config) == len(ADDED):
            by_config["slotroute / vllm"] = by_config["slotroute"]["total"] / by_config["vllm"]["total"]
    return calls


def _host_cost(rounds: list[dict], workload: str) -> dict:
    """Per routing path, host us/step it adds (its worker calls plus the scheduler's time
    beyond routing off's in the same round): median, min, max over rounds; and the
    same-round ratios of slotroute's to vLLM's own, with their median."""
    added: dict[str, dict[int, float]] = {}
    off = {c["round"]: c["results"][workload]["scheduler_us_per_step"]
           for c in rounds if c["config"] == "off" and workload in c["results"]}
    for c in rounds:
        if c["config"] in ADDED and workload in c["results"] and c["round"] in off:
            r = c["results"][workload]
            added.setdefault(c["config"], {})[c["round"]] = (
                r["worker_us_per_step"] + r["scheduler_us_per_step"] - off[c["round"]]
            )
    cost = {config: _spread(list(by_round.values())) for config, by_round in added.items()}
    if len(added) == len(ADDED):
        ratios = [added["slotroute"][r] / added["vllm"][r] for r in added["slotroute"] if r in added["vllm"]]
        if ratios:
            cost["slotroute / vllm"] = dict(_spread(ratios), rounds=ratios)
    return cost


def _spread_cell(m: dict) -> str:
    """A figure's median (min-max) over rounds, as the report's tables print it."""
    return f"{m['median']:.1f} ({m['min']:.1f}-{m['max']:.1f})"


def rounds_done(summary: dict, planned: int) -> str:
    """The report's count of whole rounds, naming each partial round left out."""
    text = f"rounds done: {len(summary['rounds'])} of {planned} (round 0, the warm-up, left out"
    for r, configs in summary["partial_rounds"].items():
        if not configs:
            text += f"; round {r} has no figures yet"
        elif r in summary.get("split_rounds", ()):
            text += f"; round {r} left out, its children ran on more than one machine"
        else:
            text += f"; round {r} left out, its figures only from {', '.join(configs)}"
    machines = summary.get("machines", [])
    if len(machines) > 1:
        text += "; each round on one machine, " + " | ".join(
            f"round{'s' * (len(m['rounds']) > 1)} {', '.join(map(str, m['rounds']))} on {m['device'] or 'a GPU'}"
            f" ({m['machine'] or 'unrecorded'})" for m in machines)
    return text + ")"


def _per_round_table(summary: dict, name: str, columns, title: str, needs: str | None = None) -> list[str]:
    """The lines of a per-round table (``name``, made by ``_per_round`` with
    ``columns``) under ``title``; none where no configuration has figures for the
    column ``needs`` (children older than it)."""
    per_round = [(workload, config, m[name]) for workload, by_config in summary["configs"].items()
                 for config, m in by_config.items() if name in m]
    if not per_round or needs is not None and all(figures[needs] is None for _, _, figures in per_round):
        return []
    lines = ["", title, "", "| workload | config | rounds | " + " | ".join(heading for heading, _, _ in columns) + " |",
             "|---" * (3 + len(columns)) + "|"]
    for workload, config, figures in per_round:
        cells = ["-" if figures[key] is None else ", ".join(
            f"{v:.{DECIMALS.get(key, 0)}f}" for v in figures[key]) for _, _, key in columns]
        lines.append(f"| {workload} | {config} | {', '.join(map(str, figures['round']))} | " + " | ".join(cells) + " |")
    return lines


def report(summary: dict, header: str) -> str:
    lines = [header, "",
             "| workload | config | tok/s median (min-max) | req/min median | worker us/step (routing calls) "
             "| scheduler us/step (all of vLLM's) | bytes/step |", "|---|---|---|---|---|---|---|"]
    for workload, by_config in summary["configs"].items():
        for config, m in by_config.items():
            t = m["tok_s"]
            lines.append(
                f"| {workload} | {config} | {t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f}) | "
                f"{m['req_min']['median']:.1f} | {m['worker_us_per_step']['median']:.1f} | "
                f"{m['scheduler_us_per_step']['median']:.1f} | {m['bytes_per_step']['median']:.0f} |"
            )
    timed = [(workload, config, m) for workload, by_config in summary["configs"].items()
             for config, m in by_config.items() if all(k in m for k in TIMELINE)]
    if timed:
        lines += ["", "| workload | config | step period us, median (min-max) | steps beyond the period ms "
                  "| of the turn starts, adding the requests ms | turn starts ms | last steps' update_from_output ms "
                  "| turn ends ms | outside generate ms |", "|---|---|---|---|---|---|---|---|---|"]
        for workload, config, m in timed:
            p = m["step_period_us"]
            lines.append(
                f"| {workload} | {config} | {p['median']:.0f} ({p['min']:.0f}-{p['max']:.0f}) | "
                + " | ".join("-" if k not in m else _spread_cell(m[k]) for k in TIMELINE_LATER + TIMELINE[1:])
                + " |"
            )
    split = [(workload, config, m["step_kinds"]) for workload, by_config in summary["configs"].items()
             for config, m in by_config.items() if "step_kinds" in m]
    if split:
        lines += ["", "| workload | config | steps with prompt tokens | their intervals ms, median (min-max) "
                  "| decode-only steps | their intervals ms, median (min-max) |", "|---|---|---|---|---|---|"]
        for workload, config, k in split:
            lines.append(
                f"| {workload} | {config} | {k['prompt_steps']['median']:.0f} | {_spread_cell(k['prompt_ms'])} | "
                f"{k['decode_steps']['median']:.0f} | {_spread_cell(k['decode_ms'])} |"
            )
        hosted = [(workload, config, k) for workload, config, k in split
                  if any(key.endswith("_update_ms") for key in k)]
        if hosted:
            lines += ["", "Host ms in those steps, median over rounds (min-max): vLLM's update_from_output, its schedule, "
                      "the front end's process_outputs (\"-\" where a call's were not one per step):",
                      "", "| workload | config | prompt steps: update | schedule | process_outputs "
                      "| decode-only steps: update | schedule | process_outputs |", "|---|---|---|---|---|---|---|---|"]
            for workload, config, k in hosted:
                cells = ["-" if f"{kind}_{name}_ms" not in k else _spread_cell(k[f"{kind}_{name}_ms"])
                         for kind in ("prompt", "decode") for name in ("update", "schedule", "output")]
                lines.append(f"| {workload} | {config} | " + " | ".join(cells) + " |")
    lines += _per_round_table(summary, "per_round", PER_ROUND, "Per round, in round order (ms; wall s in seconds):")
    lines += _per_round_table(summary, "start_per_round", START_PER_ROUND,
                              "Turn starts per round, in round order (ms summed over a pass's calls): the adding "
                              "of the requests and the host's calls before each call's first step ended, and the rest:",
                              needs="start_execute_ms")
    lines += ["", "| workload | host us/step added (worker + scheduler beyond off's, same round): slotroute "
              "| vLLM's own | slotroute / vLLM's own, median (same-round range) |", "|---|---|---|---|"]

    def cell(m):
        return "-" if m is None else f"{m['median']:.1f} ({m['min']:.1f} to {m['max']:.1f})"

    for workload, cost in summary.get("host", {}).items():
        ratio = cost.get("slotroute / vllm")
        ratio_cell = "-" if ratio is None else f"{ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})"
        lines.append(f"| {workload} | {cell(cost.get('slotroute'))} | {cell(cost.get('vllm'))} | {ratio_cell} |")
    if summary.get("routing_calls"):
        lines += ["", "| workload | routing calls us/step, every call timed (warm-up children, worker + scheduler): "
                  "slotroute | vLLM's own | slotroute / vLLM's own |", "|---|---|---|---|"]
        def total(m):
            return "-" if m is None else f"{m['total']:.0f} ({m['worker']:.0f} + {m['scheduler']:.0f})"

        for workload, by_config in summary["routing_calls"].items():
            ratio = by_config.get("slotroute / vllm")
            lines.append(f"| {workload} | {total(by_config.get('slotroute'))} | {total(by_config.get('vllm'))} | "
                         f"{'-' if ratio is None else f'{ratio:.3f}'} |")
    if summary.get("breakdown"):
        lines += ["", "Per-call breakdown (us/step), from the warm-up children, which time every routing call:"]
        for name, breakdown in summary["breakdown"].items():
            faults = summary.get("breakdown_faults", {}).get(name, {})
            parts = ", ".join(f"{k.split(':', 1)[1]} {v:.0f}" + (f" ({faults[k]:.0f} page faults a call)"
                                                                  if faults.get(k, 0) >= 1 else "")
                              for k, v in sorted(breakdown.items(), key=lambda kv: -kv[1])
                              if k.split(":", 1)[0] in ("scheduler", "worker", "detail"))
            lines.append(f"- {name}: {parts}")
    for workload, entry in summary.get("device_profile", {}).items():
        configs = list(entry["configs"])
        lines += ["", f"Device time per step, {workload} (warm-up children, torch.profiler; kernels that differ "
                      f"by at least {PROFILE_MIN_US} us/step, us (launches) per step):", "",
                  "| kernel | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
        lines.append("| all, summed over streams | " + " | ".join(
            f"error: {c['error'][:80]}" if "error" in c else f"{c['busy_us_per_step']:.1f} ({c['steps']} steps)"
            for c in entry["configs"].values()) + " |")
        if any("wall_ms" in c for c in entry["configs"].values()):
            lines.append("| the call's wall ms (to its first step's end), profiler on | " + " | ".join(
                "-" if "wall_ms" not in c else f"{c['wall_ms']:.1f} ("
                + ("-" if c.get("first_step_ms") is None else f"{c['first_step_ms']:.1f}") + ")"
                for c in entry["configs"].values()) + " |")
        for name, by_config in list(entry["kernels"].items())[:PROFILE_ROWS]:
            cells = [by_config.get(c) for c in configs]
            lines.append(f"| {name[:100]} | " + " | ".join(
                "-" if v is None else f"{v[0]:.1f} ({v[1]:.2f})" for v in cells) + " |")
    lines += ["", "| comparison | ratio of medians | same-round ratios | claim | verdict |", "|---|---|---|---|---|"]
    for name, c in summary["comparisons"].items():
        rounds = ", ".join(f"{r:.4f}" for r in c["round_ratios"])
        claim = "-" if c["claim"] is None else f">= {c['claim']}"
        lines.append(f"| {name} | {c['ratio_of_medians']:.4f} | {rounds} | {claim} | {verdict_of(c)} |")
    firsts = [(name, c["first_passes"]) for name, c in summary["comparisons"].items() if "first_passes" in c]
    if firsts:
        lines += ["", "Each child's first pass alone (the engine's first time through the workload):", "",
                  "| comparison | ratio of medians | same-round ratios |", "|---|---|---|"]
        for name, f in firsts:
            lines.append(f"| {name} | {f['ratio_of_medians']:.4f} | "
                         + ", ".join(f"{r:.4f}" for r in f["round_ratios"]) + " |")
    return "\n".join(lines)


def verdict_of(comparison: dict) -> str:
    """A comparison's verdict: resolved where every one of ``RESOLVING_ROUNDS`` or more
    rounds meets the claim and the rounds' spread is narrower than the medians' margin
    over it (a claim counts when its spread is smaller than its margin); fewer rounds
    resolve nothing, whatever they show; met in every round with a wider spread is said
    so and not resolved; a miss where no round meets it (a wider spread said beside
    it); where the rounds fall on both sides, which side the medians took, and not
    resolved."""
    c = comparison
    wide = c["spread_wider_than_difference"]
    if c["meets_claim"] is None:
        return "-; the rounds' spread is wider than the difference from 1" if wide else "-"
    n, met = len(c["round_ratios"]), c["rounds_meeting_claim"]
    if n < 2:
        return f"{'met' if met else 'missed'} in the one round: not resolved"
    if met == n:
        if wide:
            return "met in every round, but the rounds' spread is wider than the medians' margin: not resolved"
        if n < RESOLVING_ROUNDS:
            return f"met in every round, spread narrower than the margin, but {n} rounds of the {RESOLVING_ROUNDS} a claim needs: not resolved"
        return "met in every round: resolved"
    if met == 0:
        return "missed in every round" + ("; the rounds' spread is wider than the medians' margin" if wide else "")
    side = "met" if c["meets_claim"] else "missed"
    return f"{side} by the medians, {met} of {n} rounds met: not resolved"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=("v2", "v1"), default="v2")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=1,
                        help="times each counted child runs each workload in its engine; its figures are its middle "
                             "pass's by wall time (the first passes are compared on their own too)")
    parser.add_argument("--requests", type=int, default=256, help="rollout requests (conversations: a quarter)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=256, help="rollout tokens (multi-turn: half per turn)")
    parser.add_argument("--kv-cache-gb", type=float, help="KV cache size (needed on CPU)")
    parser.add_argument("--eager", action="store_true", help="no compilation or CUDA graphs (needed on CPU)")
    parser.add_argument("--narrow", action="store_true",
                        help="the model's widths cut (hidden 128, MoE intermediate 64, 4 query and 1 KV head of 32), "
                             "its layers, experts and top-k kept: rows of the GPU run's size at a CPU's speed")
    parser.add_argument("--json", help="write every child and the summary here; continue a run found there")
    parser.add_argument("--budget-s", type=float, help="start no child that would end after this many seconds")
    parser.add_argument("--rewarm", action="store_true",
                        help="continuing on another machine: warm up each configuration still to run first")
    parser.add_argument("--warm-up", choices=("full", "compile", "profile"), default="full",
                        help="what the discarded warm-up children run: every workload, timing every routing call "
                             "(the per-call breakdown), or only the engine start and a few requests (fills the "
                             "compile caches, sparing the workloads' time), and with profile then decode and "
                             "prefill steps under torch.profiler (each kernel's device time per step)")
    parser.add_argument("--child", choices=KNOWN_CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--detail", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.passes < 1:
        parser.error(f"--passes takes a count of 1 or more, got {args.passes}")
    if args.child:
        child(args)
        return
    began = time.perf_counter()
    configs, workloads = args.configs.split(","), args.workloads.split(",")
    for option, names, known in (("--configs", configs, KNOWN_CONFIGS), ("--workloads", workloads, WORKLOADS)):
        if any(name not in known for name in names) or len(set(names)) != len(names):
            parser.error(f"{option} takes distinct names from {', '.join(known)}, got {','.join(names)!r}")
    missing = [name for name in ("vllm", "slotroute") if importlib.util.find_spec(name) is None]
    if missing:  # every child would fail alike, and the run's JSON would hold only failures
        sys.exit(f"gpu_engine: {' and '.join(missing)} cannot be imported here (on the device machine: "
                 "the kit's parts, then `gpu_device.sh install`); no child started, no JSON written")
    setup = dict(runner=args.runner, layers=args.layers, configs=configs, rounds=args.rounds, requests=args.requests,
                 prompt_len=args.prompt_len, gen_len=args.gen_len, kv_cache_gb=args.kv_cache_gb, eager=args.eager)
    if workloads != list(WORKLOADS):  # a run of every workload keeps the setup of runs before this option
        setup["workloads"] = workloads
    if args.passes != 1:  # as does a run of one pass a child
        setup["passes"] = args.passes
    allocator = allocator_environment(os.environ)
    if allocator:  # as does a run under glibc's default allocation
        setup["allocator"] = allocator
    if args.narrow:  # as does a run of the model's own widths
        setup["narrow"] = True
    state = continued(args.json, setup, plan(configs, args.rounds))
    name = f"qwen3-30b-a3b-shape-{args.layers}" + ("-narrow" if args.narrow else "")
    model = write_config(Path(tempfile.gettempdir()) / name, args.layers, args.narrow)
    env = dict(os.environ)
    if args.runner == "v1":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    for c in state["children"]:  # children from before children named their GPU: the one the run named
        if "results" in c and "device" not in c and "device" in state:
            c["device"] = state["device"]
    machine = this_machine()
    restarted, elsewhere = resume_on(state["children"], machine)
    if restarted:
        print(f"rounds {', '.join(map(str, restarted))} begun on another machine: run again here whole, "
              "their earlier figures kept as superseded", flush=True)
    pending = [c for c in state["children"] if "results" not in c]
    if elsewhere and pending and not args.rewarm:
        print(f"continuing on another machine ({machine}): each configuration still to run warms up first", flush=True)
    if (args.rewarm or elsewhere) and pending:  # the configurations still to run, each warmed up first
        at = state["children"].index(pending[0])
        for config in dict.fromkeys(c["config"] for c in pending):
            state["children"].insert(at, dict(round=0, config=config))
            at += 1
    for entry in state["children"]:
        if "results" in entry:
            continue
        expected = expected_child_s(state["children"], warm_up=entry["round"] == 0)
        if args.budget_s is not None and time.perf_counter() - began + 1.2 * expected > args.budget_s:
            print("budget: stopping before the next child; run the same command again to continue", flush=True)
            break
        child_env = child_environment(entry["config"], env)
        command = [sys.executable, __file__, "--child", entry["config"], "--model", str(model), "--requests",
                   str(args.requests), "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len),
                   "--workloads", args.workloads]
        if args.kv_cache_gb is not None:
            command += ["--kv-cache-gb", str(args.kv_cache_gb)]
        if args.eager:
            command.append("--eager")
        if entry["round"] == 0:
            command += {"full": ["--detail"], "compile": ["--compile-only"],
                        "profile": ["--compile-only", "--profile"]}[args.warm_up]
        else:  # a warm-up is discarded: one pass is enough
            command += ["--passes", str(args.passes)]
        child_began = time.perf_counter()
        result = subprocess.run(command, env=child_env, capture_output=True, text=True)
        entry["machine"] = machine
        if not record_child(entry, result, time.perf_counter() - child_began, "wall_s"):
            print(f"round {entry['round']} {entry['config']}: failed ({result.returncode})\n{result.stderr[-4000:]}",
                  flush=True)
        else:
            results = entry["results"].values()
            pool = "" if entry["config"] not in SLOTROUTE_CONFIGS else (
                f"; host pool {entry['host_reserved_bytes'] / 2**20:.1f} MiB reserved, chunks added "
                + ", ".join(f"{r['host_pool_chunks_added']} ({r['host_pool_bytes_added'] / 2**20:.1f} MiB)" for r in results))
            ahead = "" if not any(r.get("reads_made_ahead") for r in results) else (
                "; prompts read ahead (served) " + ", ".join(f"{r['reads_made_ahead']} ({r['reads_served_ahead']})"
                                                             for r in results))
            exit_s = entry["wall_s"] - entry["elapsed_s"]
            print(f"round {entry['round']} {entry['config']}: import {entry['import_s']:.0f} s, start "
                  f"{entry['start_s']:.0f} s, warm-up {entry['warm_up_s']:.0f} s, Python's start and exit {exit_s:.0f} s, "
                  + ", ".join(f"{w} {r['tok_s']:.0f} tok/s" + ("" if "passes" not in r else
                                                              " (passes " + ", ".join(f"{p['tok_s']:.0f}" for p in r["passes"]) + ")")
                              for w, r in entry["results"].items()) + pool + ahead, flush=True)
        if args.json:
            write_json(Path(args.json), state)
    done = [c for c in state["children"] if "results" in c]
    here = device_name()
    device = " and ".join(dict.fromkeys(c.get("device") or here for c in done)) or here
    version = done[0].get("vllm", "?") if done else "?"
    state["summary"] = summarize(state["children"])
    state["device"] = device
    header = (f"device {device}, vLLM {version}, runner {args.runner}, {args.layers} layers"
              + (" of the narrow widths" if args.narrow else "") + f", rollout {args.requests} x "
              f"({args.prompt_len} + {args.gen_len}), multi-turn {max(args.requests // 4, 1)} x {TURNS} turns; "
              + (f"{args.passes} passes a child, its figures the middle pass's by wall time; " if args.passes > 1 else "")
              + "".join(f"{k}={v}, every child; " for k, v in allocator.items())
              + rounds_done(state["summary"], args.rounds))
    print("\n" + report(state["summary"], header), flush=True)
    if args.json:
        write_json(Path(args.json), state)


if __name__ == "__main__":
    main()
