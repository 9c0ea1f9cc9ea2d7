"""Worker-side capture on a CUDA device, DeepSeek-V3 shape (61 MoE layers, top-8, 256 experts).

For each step size n it measures, as medians of CUDA-event-timed runs:

- capture: the 61 ``capture()`` calls of one step recorded in a CUDA graph and replayed
  (per layer), and the wall time of the same calls run eagerly (launch-bound, for reference);
- snapshot: range check + cast to uint8 + the bytes into pinned memory, from the event
  before ``snapshot()`` on the compute stream to the event after the kernel there (the
  kernel writing the pinned memory itself, the default) or after the copy on the copy
  stream (staged on the device: ``host_writes=False``, and the torch fallback);
- baselines: D2H of the int32 rows (what vLLM ships), ``.to(uint8)`` + D2H (the cast
  without the check), and a D2H of the narrow bytes alone (the memcpy floor);
- the clear: at the GPU engine benchmark's shape (48 layers, top-8, 8192 tokens), the
  device time of ``snapshot_leading`` as the V2 runner calls it, its clear refilling the
  rows written since the last clear, the whole buffer, or nothing;
- host side: the ``snapshot()`` call itself (and ``snapshot_leading(defer_copy=True)``,
  as the V2 runner calls it), of both the default and the staged capturer, the kernel's
  launch alone (arguments made beforehand: through Triton's JIT launch, the compiled
  kernel's launcher called directly, and ``CompiledKernel[grid]``), and ``result()`` after the copy finished: lent (a view of the ring slot,
  for a caller that drops results once read) and in a pinned buffer of its own (for one
  that keeps them; its ``snapshot()`` call, which allocates that buffer, is timed too).

It also checks that ``snapshot()`` never synchronises with the device: under
``torch.cuda.set_sync_debug_mode("error")``, and by queueing it behind a long kernel.

    python benchmarks/gpu_capture.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from slotroute import capture
from slotroute.capture import RoutedExpertsCapturer
from slotroute.spec import RoutingSpec
from slotroute.tools import cuda_graph

SPEC = RoutingSpec(num_layers=61, top_k=8, num_experts=256)
SIZES = (64, 256, 2048, 8192)


# Queued before each timed region so that the host has enqueued all of the region's
# work before its start event fires: the timings are device time, not launch latency.
BUSY_CYCLES = 2_000_000


def event_median_us(fn, repeat: int, warmup: int = 5, end_stream: torch.cuda.Stream | None = None, after=None) -> float:
    """Median over ``repeat`` runs of the device time between an event recorded before
    ``fn()`` on the current stream and one after it on ``end_stream`` (default: current).
    ``after(value of fn())`` runs untimed once the end event completed."""
    times = []
    for i in range(warmup + repeat):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(BUSY_CYCLES)
        start.record()
        value = fn()
        end.record(end_stream or torch.cuda.current_stream())
        end.synchronize()
        if after is not None:
            after(value)
        if i >= warmup:
            times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def host_median_us(fn, repeat: int, after=None, before=None) -> float:
    """Median host wall time of ``fn()`` with the device idle; ``before()`` and
    ``after(value of fn())`` run untimed."""
    times = []
    for _ in range(repeat):
        arg = before() if before is not None else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        value = fn() if before is None else fn(arg)
        times.append((time.perf_counter() - t0) * 1e6)
        if after is not None:
            after(value)
    return statistics.median(times)


def capture_costs(cap: RoutedExpertsCapturer, topk: list[torch.Tensor], repeat: int) -> dict:
    def step():
        for layer, ids in enumerate(topk):
            cap.capture(layer, ids)

    graph = cuda_graph.record(step)
    replay = event_median_us(graph.replay, repeat)
    eager = host_median_us(lambda: (step(), torch.cuda.synchronize()), max(repeat // 4, 10))
    return {"graph_all_layers_us": replay, "graph_per_layer_us": replay / SPEC.num_layers, "eager_all_layers_wall_us": eager}


def snapshot_costs(cap: RoutedExpertsCapturer, n: int, slots: torch.Tensor, ids: torch.Tensor, repeat: int) -> dict:
    def snap():
        return cap.snapshot(n, slots)

    def resolve(pending):
        pending.result()

    row = torch.cat([slots, slots])  # a runner's slot-mapping row, longer than the step

    def refill():  # snapshot_leading clears the buffer, as the runners' snapshots do
        cap.get_device_buffer()[:n].copy_(ids)

    def snap_deferred(_):  # as vLLM's V2 runner takes it: the copy left to its output stream
        return cap.snapshot_leading(n, row, defer_copy=True)

    def copy_and_resolve(pending):
        pending.enqueue_copy()
        torch.cuda.current_stream().synchronize()
        pending.result()

    # Written in place by the kernel, the bytes are on the host when the compute
    # stream passes its end event; staged, when the copy stream passes it.
    end_stream = None if cap._direct and cap._launch is not capture.pack_snapshot else cap.copy_stream
    costs = {
        "device_us": event_median_us(snap, repeat, end_stream=end_stream, after=resolve),
        "host_call_us": host_median_us(snap, repeat, after=resolve),
    }
    # The result lent (a view of its ring slot: a caller that drops results once read)
    # and in a span of the capturer's pinned host pool (one that keeps them), each mode set for the
    # whole measurement: the timing loops above keep some results alive past the ring's turn.
    for key, lend in (("result_host_us", True), ("result_own_buffer_host_us", False)):
        cap._lend = lend
        costs[key] = host_median_us(resolve, repeat, before=snap)
    cap._lend = False
    costs["host_call_own_buffer_us"] = host_median_us(snap, repeat, after=resolve)
    cap._lend = True
    costs["host_call_deferred_us"] = host_median_us(snap_deferred, repeat, after=copy_and_resolve, before=refill)
    refill()
    return costs


# The GPU engine benchmark's model and step (benchmarks/gpu_engine.py): Qwen3-30B-A3B's
# routing, 8192 tokens a step at most.
ENGINE_SPEC, ENGINE_TOKENS = RoutingSpec(num_layers=48, top_k=8, num_experts=128), 8192


def clear_costs(n: int, repeat: int) -> dict:
    """Device time of one step's snapshot as the V2 runner takes it (``snapshot_leading``,
    the copy deferred), at the GPU engine benchmark's shape, after every layer captured
    ``n`` rows: its clear refilling the rows written since the last clear (NOTE 4 of
    ``RoutedExpertsCapturer.__init__``), the whole buffer (a capturer whose buffer was
    handed out), and the same snapshot with no clear."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    ids = torch.randint(0, ENGINE_SPEC.num_experts, (n, *ENGINE_SPEC.token_shape), generator=gen, device="cuda",
                        dtype=torch.int32)
    topk = [ids[:, layer].contiguous() for layer in range(ENGINE_SPEC.num_layers)]
    row = torch.randperm(4 * n, device="cuda")
    costs = {}
    for name, expose in (("bounded", False), ("whole", True)):
        cap = RoutedExpertsCapturer(ENGINE_SPEC, max_num_tokens=ENGINE_TOKENS, device="cuda")
        if expose:
            cap.get_device_buffer()

        def captured(pending=None, cap=cap):  # untimed: the result read, the next step's rows captured
            if pending is not None:
                pending.enqueue_copy()
                torch.cuda.current_stream().synchronize()
                pending.result()
            for layer, layer_ids in enumerate(topk):
                cap.capture(layer, layer_ids)

        captured()
        costs[f"snapshot_clear_{name}_device_us"] = event_median_us(
            lambda cap=cap: cap.snapshot_leading(n, row, defer_copy=True), repeat, after=captured)
        if not expose:
            costs["snapshot_no_clear_device_us"] = event_median_us(
                lambda cap=cap: cap.snapshot(n, row[:n], defer_copy=True), repeat, after=captured)
            result = cap.snapshot_leading(n, row, defer_copy=True)
            result.enqueue_copy()
            torch.cuda.current_stream().synchronize()
            assert np.array_equal(result.result().routing_data, ids.cpu().numpy().astype(np.uint8))
            fill = torch.full(ENGINE_SPEC.token_shape, capture.NOT_CAPTURED, dtype=torch.int32, device="cuda")
            assert bool((cap._buffer == fill).all()), "a bounded clear left a written row"
    return costs


def kernel_launch_host_us(cap: RoutedExpertsCapturer, n: int, repeat: int) -> dict:
    """Host time of the snapshot kernel's launch alone, its arguments made beforehand:
    what of ``snapshot()``'s host call is the launch, through Triton's JIT launch and
    through the capturer's launcher (the compiled kernel launched directly)."""
    kernel = capture._fused_kernel()
    slot = cap._ring[0]
    rows_end = n * SPEC.num_layers * SPEC.top_k
    counts = torch.empty(-(-rows_end // capture.PACK_BLOCK), dtype=torch.int32, device=cap.device_buffer.device)
    args = (cap.get_device_buffer().view(-1), cap._fill, slot.device[:rows_end], counts, None, None, SPEC.num_experts)
    launcher = kernel.PackLauncher(cap.device.index)
    # The compiled kernel through Triton's CompiledKernel[grid] (what a hooked launch
    # takes, NOTE 2 of PackLauncher): a launcher that sees a hook set.
    through_triton = kernel.PackLauncher(cap.device.index)
    through_triton._unhooked = lambda: False
    return {
        "kernel_launch_host_us": host_median_us(lambda: kernel.pack_snapshot(*args, False, capture.PACK_BLOCK), repeat),
        "kernel_launch_direct_host_us": host_median_us(lambda: launcher(*args, False, capture.PACK_BLOCK), repeat),
        "kernel_launch_compiled_getitem_host_us": host_median_us(lambda: through_triton(*args, False, capture.PACK_BLOCK), repeat),
    }


def pinned_allocation_us(sizes=(128 << 10, 4 << 20, 16 << 20, 64 << 20), count: int = 5) -> dict:
    """Host time of a pinned allocation that torch's caching host allocator cannot serve
    from its cache (every buffer kept, so each is new): the cost a step pays when the
    caller keeps its rows, and a host pool's chunk pays once. Median of ``count``."""
    costs = {}
    for size in sizes:
        kept, took = [], []
        for _ in range(count):
            started = time.perf_counter()
            kept.append(torch.empty(size, dtype=torch.uint8, pin_memory=True))
            took.append(time.perf_counter() - started)
        costs[str(size)] = 1e6 * statistics.median(took)
    return costs


def baselines(buffer: torch.Tensor, n: int, repeat: int) -> dict:
    rows = buffer[:n]
    host32 = torch.empty(rows.shape, dtype=torch.int32, pin_memory=True)
    host8 = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    dev8 = rows.to(torch.uint8)
    return {
        "int32_d2h_us": event_median_us(lambda: host32.copy_(rows, non_blocking=True), repeat),
        "cast_then_d2h_us": event_median_us(lambda: host8.copy_(rows.to(torch.uint8), non_blocking=True), repeat),
        "narrow_memcpy_us": event_median_us(lambda: host8.copy_(dev8, non_blocking=True), repeat),
    }


def no_host_sync(cap: RoutedExpertsCapturer, n: int, slots: torch.Tensor) -> dict:
    """``snapshot()`` must neither trip torch's sync detector nor wait for queued work."""
    cap.snapshot(n, slots).result()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = cap.snapshot(n, slots)
        detector = "passed"
    except RuntimeError as exc:
        pending, detector = None, f"FAILED: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if pending is not None:
        pending.result()
    busy_start, busy_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    busy_start.record()
    torch.cuda._sleep(100_000_000)
    busy_end.record()
    t0 = time.perf_counter()
    pending = cap.snapshot(n, slots)
    call_us = (time.perf_counter() - t0) * 1e6
    pending_while_busy = not pending.done()
    pending.result()
    return {
        "sync_debug_mode_error": detector,
        "snapshot_call_behind_busy_stream_us": call_us,
        "busy_kernel_us": busy_start.elapsed_time(busy_end) * 1000.0,
        "pending_while_stream_busy": pending_while_busy,
    }


def print_host_profile(cap: RoutedExpertsCapturer, n: int, slots: torch.Tensor, repeat: int) -> None:
    """The functions (torch and numpy calls included) that take the host time of
    ``repeat`` snapshots of ``n`` tokens and their results, by own time. cProfile
    inflates every call alike: the shares, not the sums, are the reading."""
    import cProfile
    import io
    import pstats

    row = torch.cat([slots, slots])
    ids = cap.get_device_buffer()[:n].clone()

    def steps():  # as the V2 runner takes them: a slot-mapping row, the copy deferred to its stream
        for _ in range(repeat):
            pending = cap.snapshot_leading(n, row, defer_copy=True)
            pending.enqueue_copy()
            torch.cuda.synchronize()
            pending.result()
            cap.get_device_buffer()[:n].copy_(ids)

    steps()
    profiler = cProfile.Profile()
    profiler.runcall(steps)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
    print(f"host profile of {repeat} snapshots and results of {n} tokens:")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the full results as JSON here")
    parser.add_argument("--repeat", type=int, default=200, help="timed runs per median")
    parser.add_argument("--profile", action="store_true",
                        help="also print where the host time of snapshot() and result() goes (cProfile)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    meta = {
        "device": props.name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": getattr(getattr(capture._fused_kernel(), "triton", None), "__version__", None),
        "spec": {"num_layers": SPEC.num_layers, "top_k": SPEC.top_k, "num_experts": SPEC.num_experts},
    }
    print(f"{meta['device']}, torch {meta['torch']}, CUDA {meta['cuda']}, triton {meta['triton']}", flush=True)
    rows = []
    cap = RoutedExpertsCapturer(SPEC, max_num_tokens=max(SIZES), device="cuda")
    # The same snapshots staged on the device and copied (host_writes=False), against
    # the kernel writing pinned host memory itself (the default, NOTE 3 of capture.py).
    staged = RoutedExpertsCapturer(SPEC, max_num_tokens=max(SIZES), device="cuda", host_writes=False)
    for n in SIZES:
        gen = torch.Generator(device="cuda").manual_seed(n)
        ids = torch.randint(0, SPEC.num_experts, (n, *SPEC.token_shape), generator=gen, device="cuda", dtype=torch.int32)
        topk = [ids[:, layer].contiguous() for layer in range(SPEC.num_layers)]
        slots = torch.randperm(16 * n, device="cuda")[:n]
        row = {"n": n, **capture_costs(cap, topk, args.repeat)}
        assert torch.equal(cap.get_device_buffer()[:n], ids)
        row.update(baselines(cap.get_device_buffer(), n, args.repeat))
        fused = snapshot_costs(cap, n, slots, ids, args.repeat)
        row.update({f"snapshot_{k}": v for k, v in fused.items()})
        staged.get_device_buffer()[:n].copy_(ids)
        row.update({f"snapshot_staged_{k}": v for k, v in snapshot_costs(staged, n, slots, ids, args.repeat).items()})
        row["snapshot_direct_vs_staged_device"] = row["snapshot_device_us"] / row["snapshot_staged_device_us"]
        row.update(kernel_launch_host_us(cap, n, args.repeat))
        row.update(clear_costs(n, args.repeat))
        fused_kernel, launch = capture._fused_kernel, cap._launch
        capture._fused_kernel, cap._launch = (lambda: None), None
        try:
            fallback = snapshot_costs(cap, n, slots, ids, args.repeat // 2)
            row["snapshot_torch_fallback_device_us"] = fallback["device_us"]
            row["snapshot_torch_fallback_host_call_us"] = fallback["host_call_us"]
        finally:
            capture._fused_kernel, cap._launch = fused_kernel, launch
        lists = cap.snapshot(n, slots).result()
        assert np.array_equal(lists.routing_data, ids.cpu().numpy().astype(np.uint8))
        assert np.array_equal(lists.slot_mapping, slots.cpu().numpy())
        del lists  # a result kept past the ring's turn would end the lending (NOTE 1 of capture.py)
        row["snapshot_vs_int32_d2h"] = row["snapshot_device_us"] / row["int32_d2h_us"]
        row["snapshot_vs_narrow_memcpy"] = row["snapshot_device_us"] / row["narrow_memcpy_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    sync = no_host_sync(cap, max(SIZES), slots)
    meta["pinned_allocation_us_by_bytes"] = pinned_allocation_us()
    print(json.dumps({"pinned_allocation_us_by_bytes": meta["pinned_allocation_us_by_bytes"]}), flush=True)
    if args.profile:
        print_host_profile(cap, max(SIZES), slots, args.repeat)
    print(json.dumps(sync), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "no_host_sync": sync}, f, indent=2)

    print(f"\n{meta['device']}: DeepSeek-V3 shape, medians of {args.repeat} CUDA-event-timed runs (us)")
    header = (
        f"{'n':>5} {'cap/layer':>9} {'eager wall':>9} {'snapshot':>9} {'torch 2op':>9} {'int32 D2H':>9} "
        f"{'cast+D2H':>9} {'u8 memcpy':>9} {'vs int32':>8} {'vs memcpy':>9} {'snap host':>9} {'launch':>7} {'direct':>7} "
        f"{'result':>8} {'own buf':>8} {'own snap':>8} {'staged':>8} {'st host':>8} {'getitem':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['n']:>5} {r['graph_per_layer_us']:>9.2f} {r['eager_all_layers_wall_us']:>9.1f} "
            f"{r['snapshot_device_us']:>9.1f} {r['snapshot_torch_fallback_device_us']:>9.1f} {r['int32_d2h_us']:>9.1f} "
            f"{r['cast_then_d2h_us']:>9.1f} {r['narrow_memcpy_us']:>9.1f} {r['snapshot_vs_int32_d2h']:>8.2f} "
            f"{r['snapshot_vs_narrow_memcpy']:>9.2f} {r['snapshot_host_call_us']:>9.1f} {r['kernel_launch_host_us']:>7.1f} {r['kernel_launch_direct_host_us']:>7.1f} "
            f"{r['snapshot_result_host_us']:>8.1f} {r['snapshot_result_own_buffer_host_us']:>8.1f} "
            f"{r['snapshot_host_call_own_buffer_us']:>8.1f} {r['snapshot_staged_device_us']:>8.1f} "
            f"{r['snapshot_staged_host_call_us']:>8.1f} {r['kernel_launch_compiled_getitem_host_us']:>8.1f}"
        )
    print(f"\nsnapshot_leading at the GPU engine's shape (48 layers, top-8, 8192 tokens), device us: clear of the "
          "rows written since the last clear | of the whole buffer | no clear")
    for r in rows:
        print(f"{r['n']:>5} {r['snapshot_clear_bounded_device_us']:>9.1f} {r['snapshot_clear_whole_device_us']:>9.1f} "
              f"{r['snapshot_no_clear_device_us']:>9.1f}")
    big = rows[-1]
    print(
        f"targets at n={big['n']}: snapshot/int32 D2H = {big['snapshot_vs_int32_d2h']:.2f} (<= 0.40), "
        f"capture = {max(r['graph_per_layer_us'] for r in rows):.2f} us/layer at worst (<= 2.00); "
        f"no host sync: detector {sync['sync_debug_mode_error']}, "
        f"snapshot() returned in {sync['snapshot_call_behind_busy_stream_us']:.0f} us behind a "
        f"{sync['busy_kernel_us'] / 1000:.0f} ms kernel, pending meanwhile: {sync['pending_while_stream_busy']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
