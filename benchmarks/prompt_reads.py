"""vLLM 0.28-0.30's whole-prompt reads (a prefill completes: its prompt's rows read from
the scheduler's store) into a fresh array each, as the store's ``get`` hands them out,
against ``SlotRouting.read``, whose results land in reused chunks written through at
start (``routing.py``, ``_ResultPool``, as vLLM 0.28-0.30's scheduler reserves them),
under glibc's default allocation and with its mmap threshold fixed at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``).

Each round runs one child process per allocator, in an order that alternates between
rounds; a child stores 8192-token steps into random blocks of a committed store and
after each makes the step's reads both ways (their order alternating between steps),
keeping every result to the end by default, as a rollout's front end keeps each
prompt's rows until its request finishes (``--keep-steps`` keeps only the last few
steps'), checks that both ways read the same rows and that the kept results still hold
them, and reports each way's median step and its page faults a read. The report gives,
per allocator, the median (min-max) over rounds and the same-round ratio fresh / pooled.

    python benchmarks/prompt_reads.py --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ALLOCATORS = {"glibc default": {}, "mmap threshold fixed at 128 KiB": {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}}


def child(args: argparse.Namespace) -> None:
    from slotroute.store import RoutedExpertsManager
    from slotroute.tools.bench import BLOCK_SIZE, PRESETS, STEP_TOKENS, minor_faults
    from slotroute.vllm import routing as routing_module

    spec = PRESETS[args.preset]
    store = RoutedExpertsManager(spec, args.num_blocks, BLOCK_SIZE)
    store.populate()
    if args.chunk_bytes:
        routing_module.CHUNK_BYTES = args.chunk_bytes
    routing = routing_module.SlotRouting(store, attn_gid=0)
    routing.reserve_reads()  # as SchedulerRouting.for_vllm has it done
    rng = np.random.default_rng(0)
    data = rng.integers(0, spec.num_experts, (STEP_TOKENS, *spec.token_shape)).astype(spec.storage_dtype)
    per_read = args.prompt_tokens // BLOCK_SIZE
    reads = STEP_TOKENS // args.prompt_tokens
    kept = collections.deque(maxlen=args.keep_steps or None)  # each step's results, as vLLM keeps them
    took = {"fresh": [], "pooled": []}
    faults = {"fresh": 0, "pooled": 0}
    for step in range(args.steps):
        blocks = rng.permutation(args.num_blocks)[: STEP_TOKENS // BLOCK_SIZE]
        store.store_batch(data, (blocks[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(-1))
        requests = [blocks[r * per_read:(r + 1) * per_read].tolist() for r in range(reads)]
        results = {}
        for way in ("fresh", "pooled") if step % 2 else ("pooled", "fresh"):
            read = store.get if way == "fresh" else routing.read
            before, started = minor_faults(), time.perf_counter()
            results[way] = [read(ids, args.prompt_tokens) for ids in requests]
            took[way].append(time.perf_counter() - started)
            faults[way] += minor_faults() - before
        if not all(np.array_equal(a, b) for a, b in zip(results["fresh"], results["pooled"])):
            raise RuntimeError(f"step {step}: a pooled read differs from the store's")
        kept.append(results)
    if not all(np.array_equal(a, b) for results in kept for a, b in zip(results["fresh"], results["pooled"])):
        raise RuntimeError("a kept pooled result changed after later reads")
    warm = args.steps // 5
    print(json.dumps({**{way: 1e3 * statistics.median(t[warm:]) for way, t in took.items()},
                      **{f"{way} faults": n / (args.steps * reads) for way, n in faults.items()}}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32,
                        help="steps a child times (the first fifth left out); 32: a rollout of 256 prompts")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--num-blocks", type=int, default=40000, help="the store's blocks of 16 slots")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="each read's rows; 8192 / this reads a step")
    parser.add_argument("--keep-steps", type=int, default=0, help="steps whose results stay alive (0: all)")
    parser.add_argument("--chunk-bytes", type=int, default=0, help="the pool's chunk size (default: routing.py's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    forwarded = [f"--{name.replace('_', '-')}={getattr(args, name)}"
                 for name in ("steps", "preset", "num_blocks", "prompt_tokens", "keep_steps", "chunk_bytes")]
    runs: dict[str, list[dict]] = {name: [] for name in ALLOCATORS}
    for r in range(args.rounds):
        for name in list(ALLOCATORS)[:: 1 if r % 2 == 0 else -1]:
            env = {**os.environ, **ALLOCATORS[name]}
            out = subprocess.run([sys.executable, __file__, "--child", *forwarded], env=env, capture_output=True,
                                 text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))

    def spread(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    kept = f"for {args.keep_steps} steps" if args.keep_steps else "to the end"
    print(f"{args.rounds} rounds; a step: {8192 // args.prompt_tokens} reads of {args.prompt_tokens} rows "
          f"({args.preset}), each step's results kept {kept}")
    print("| allocator | fresh arrays, ms a step | faults a read | pooled (SlotRouting.read), ms a step | faults a read "
          "| fresh / pooled, same round |")
    print("|---|---|---|---|---|---|")
    for name, results in runs.items():
        fresh, pooled = [x["fresh"] for x in results], [x["pooled"] for x in results]
        ratios = [f / p for f, p in zip(fresh, pooled)]
        print(f"| {name} | {spread(fresh, 3)} | {spread([x['fresh faults'] for x in results], 1)} | "
              f"{spread(pooled, 3)} | {spread([x['pooled faults'] for x in results], 1)} | {spread(ratios, 2)} |")


if __name__ == "__main__":
    main()
