"""The front end's rows of a request, host only: vLLM's list of arrays joined with
``np.concatenate`` when the request finishes, against slotroute's ``RequestRows``
(``slotroute/vllm/outputs.py``), which fills one array as the arrays come, on the same
arrays in the same rounds.

Each request's arrays are what vLLM 0.28-0.30's scheduler hands the front end: its
prompt's rows when its prefill completes (a fresh array, as a read makes it), then one
row a decode step (a view of the step's array of rows). Two workloads, each request's
rows 48 layers x top 8 of uint8 (384 B, the qwen3-30b-a3b shape): the rollout, 256
requests of 1,024 prompt tokens decoding 256 steps together; multi-turn, 64
conversations of 4 turns, each turn's prompt the conversation so far (1,024 tokens,
then 256 more a turn) decoding 128 steps. Timed: the prompts' appends, the appends
over every decode step, and the finishing step's joins (the step no forward hides, on
a GPU); a turn's outputs are held while the next runs, as a caller holds them.

With ``--connector``, the arrays are what slotroute's connector hands the front end on
vLLM 0.31+: each request's rows, prompt and generated, in one array when it finishes
(a fresh read); slotroute's ``RequestRows`` keeps it as it came (NOTE 2 of
``outputs.py``) where vLLM's join copies it. Timed: the finishing step, the arrays'
appends and the joins.

Rounds interleave the two ways, the order alternating; the report gives each one's
median (min-max) over rounds and the same-round ratios.

    python benchmarks/frontend_rows.py [--rounds 7] [--connector] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from gpu_engine import _spread as spread

from slotroute.vllm.outputs import RequestRows

LAYERS, TOP_K = 48, 8
WORKLOADS = {"rollout": dict(requests=256, prompts=[1024], steps=256),
             "multi-turn": dict(requests=64, prompts=[1024 + 128 * 2 * t for t in range(4)], steps=128)}


class VllmRows(list):
    """vLLM's accumulator: a list, joined at finish."""

    def joined(self) -> np.ndarray:
        return np.concatenate(self, axis=0)


WAYS = {"vllm": lambda room: VllmRows(), "slotroute": RequestRows}
CONNECTOR_WAYS = {**WAYS, "slotroute": lambda room: RequestRows(room, keep_first=True)}
FIGURES = ("prompts_ms", "appends_ms", "finishing_ms", "total_ms")  # what ``run`` times


def prompt_rows(tokens: int, seed: int) -> np.ndarray:
    rows = np.empty((tokens, LAYERS, TOP_K), dtype=np.uint8)
    rows.fill(seed % 251)
    return rows


def run(way: str, workload: dict) -> dict:
    """One workload's turns: seconds of appends and of the finishing steps' joins."""
    make, requests, steps = WAYS[way], workload["requests"], workload["steps"]
    prompts = appends = finishing = 0.0
    held = []
    for turn, tokens in enumerate(workload["prompts"]):
        states = [make(steps) for _ in range(requests)]
        reads = [prompt_rows(tokens, turn * requests + i) for i in range(requests)]
        began = time.perf_counter()
        for state, read in zip(states, reads):
            state.append(read)
        prompts += time.perf_counter() - began
        del reads
        for step in range(steps):
            data = np.full((requests, LAYERS, TOP_K), step % 251, dtype=np.uint8)  # the step's rows
            began = time.perf_counter()
            for i, state in enumerate(states):
                state.append(data[i:i + 1])
            appends += time.perf_counter() - began
        began = time.perf_counter()
        outputs = [state.joined() for state in states]
        finishing += time.perf_counter() - began
        held = outputs  # a turn's outputs held while the next turn runs
        del states
    assert all(out.shape == (workload["prompts"][-1] + steps, LAYERS, TOP_K) for out in held)
    return dict(prompts_ms=1e3 * prompts, appends_ms=1e3 * appends, finishing_ms=1e3 * finishing,
                total_ms=1e3 * (prompts + appends + finishing))


def run_connector(way: str, workload: dict) -> dict:
    """One workload's turns as vLLM 0.31+ sends them: each request's rows in one array
    at its finish, appended and joined in the finishing step."""
    make, requests, steps = CONNECTOR_WAYS[way], workload["requests"], workload["steps"]
    finishing = 0.0
    held = []
    for turn, tokens in enumerate(workload["prompts"]):
        states = [make(steps) for _ in range(requests)]
        reads = [prompt_rows(tokens + steps, turn * requests + i) for i in range(requests)]
        began = time.perf_counter()
        for state, read in zip(states, reads):
            state.append(read)
        outputs = [state.joined() for state in states]
        finishing += time.perf_counter() - began
        held = outputs
        del states, reads
    assert all(out.shape == (workload["prompts"][-1] + steps, LAYERS, TOP_K) for out in held)
    return dict(prompts_ms=0.0, appends_ms=0.0, finishing_ms=1e3 * finishing, total_ms=1e3 * finishing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--connector", action="store_true",
                        help="vLLM 0.31+'s arrays: each request's rows in one array at finish")
    parser.add_argument("--json", help="write every round and the summary here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds takes a count of 1 or more, got {args.rounds}")
    timed = run_connector if args.connector else run
    rounds = []
    for r in range(args.rounds):
        order = list(WAYS) if r % 2 == 0 else list(WAYS)[::-1]
        rounds.append({name: {way: timed(way, workload) for way in order} for name, workload in WORKLOADS.items()})
    arrays = "vLLM 0.31+'s arrays, one a request at finish" if args.connector else "vLLM 0.28-0.30's arrays"
    print(f"{args.rounds} rounds, the two ways interleaved, {arrays}; ms, median (min-max) over rounds")
    print("| workload | way | prompts' appends | appends over the decode steps | finishing steps' joins | all |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for name in WORKLOADS:
        for way in WAYS:
            cells = {key: spread([r[name][way][key] for r in rounds]) for key in FIGURES}
            summary[f"{name} {way}"] = cells
            print(f"| {name} | {way} | " + " | ".join(f"{c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f})"
                                                    for c in cells.values()) + " |")
    print("| workload | slotroute / vllm, finishing (same-round) | slotroute / vllm, all (same-round) |")
    print("|---|---|---|")
    for name in WORKLOADS:
        ratios = summary[f"{name} ratios"] = {
            key: spread([r[name]["slotroute"][key] / r[name]["vllm"][key] for r in rounds])
            for key in ("finishing_ms", "total_ms")}
        print(f"| {name} | " + " | ".join(f"{c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f})"
                                          for c in ratios.values()) + " |")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(dict(rounds=rounds, summary=summary), out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
