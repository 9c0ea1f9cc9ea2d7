"""Routing through vLLM's KV offload tier on one GPU: a multi-turn workload whose
working set is several times the GPU's KV block pool, with vLLM's
``OffloadingConnector`` (``CPUOffloadingSpec``: KV chunks stored to pinned host memory
and loaded back on a later turn's prefix hit).

Configurations, each engine in its own process: ``off`` (routing off), ``vllm``
(vLLM's own routed-experts path, ``SLOTROUTE_DISABLE=1``) and ``slotroute``; with
``--exact``, also ``reference``: every request alone, no prefix caching, no connector.

``--exact`` runs the tiny random MoE of the tests in float32 once per configuration
and checks: every request's tokens and rows against the reference's; that the rows
slotroute returns for a turn's prefix equal, bit for bit, the rows it returned for the
same tokens on the previous turn (the prefix's KV was computed then, and is served now
from the block pool or the host tier); and counts the tokens each configuration loaded
from the host tier and the prompt tokens it computed.

Without ``--exact``: a Qwen3-30B-A3B-shaped MoE (``gpu_engine.py``'s, ``--layers``
of its 48, random bf16 weights), configurations interleaved over ``--rounds`` in an
order that rotates each round; per configuration the median, min and max over rounds
of generated tok/s, prompt tokens computed and tokens loaded from the host tier.

usage: python benchmarks/gpu_offload.py --exact [--json OUT]
       python benchmarks/gpu_offload.py [--rounds 3] [--layers 8] [--json OUT] [--budget-s S]
(``--exact --smoke`` runs on a CPU build of vLLM 0.31-0.32, with the test suite's
connector that moves KV by plain copies, ``tests/host_offload.py``, in place of vLLM's
CUDA-only offloading worker.)
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
CONFIGS = ("off", "vllm", "slotroute")
# (conversations, turns, first prompt, generated per turn, new tokens per turn, KV block
# pool in tokens, host tier bytes, offloaded chunk in tokens) of each mode.
EXACT = dict(conversations=16, turns=4, prompt=256, gen=32, new=64, pool_tokens=2048, host_bytes=256 << 20, chunk=64)
BENCH = dict(conversations=64, turns=4, prompt=1024, gen=128, new=128, pool_tokens=32768, host_bytes=8 << 30,
             chunk=256)


def conversation_turns(workload: dict, vocab: tuple[int, int]):
    """Each turn's prompts are built from the previous turn's outputs: yields the
    first prompts, then receives outputs and yields the next prompts."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(*vocab, workload["prompt"]).tolist() for _ in range(workload["conversations"])]
    for _ in range(workload["turns"]):
        outputs = yield prompts
        prompts = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) + rng.integers(*vocab, workload["new"]).tolist()
                   for o in outputs]
    yield None


def child(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    workload = EXACT if args.exact else BENCH
    reference = args.child == "reference"
    block = 32 if args.exact else 16
    kv_transfer = None if reference else dict(
        kv_connector="OffloadingConnector", kv_role="kv_both",
        kv_connector_extra_config={"cpu_bytes_to_use": workload["host_bytes"], "block_size": workload["chunk"]},
    )
    smoke = {}
    if args.smoke:
        sys.path.insert(0, str(HERE.parent / "tests"))
        if kv_transfer:
            kv_transfer.update(kv_connector="HostCopyOffloadingConnector", kv_connector_module_path="host_offload")
        smoke = dict(enforce_eager=True, kv_cache_memory_bytes=256 << 20)
    llm = LLM(
        model=args.model, dtype="float32" if args.exact else "bfloat16", load_format="auto" if args.exact else "dummy",
        skip_tokenizer_init=True, seed=0, distributed_executor_backend="uni", block_size=block,
        enable_prefix_caching=not reference, gpu_memory_utilization=0.5,
        max_num_seqs=1 if reference else 256, max_num_batched_tokens=8192,
        max_model_len=1024 if args.exact else 2048,
        num_gpu_blocks_override=None if reference else workload["pool_tokens"] // block,
        enable_return_routed_experts=args.child != "off", kv_transfer_config=kv_transfer,
        **smoke,
    )
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    loaded = [0]
    if scheduler.connector is not None:  # tokens each load brings from the host tier
        original = scheduler.connector.update_state_after_alloc

        def update_state_after_alloc(request, blocks, num_external_tokens):
            loaded[0] += num_external_tokens
            return original(request, blocks, num_external_tokens)

        scheduler.connector.update_state_after_alloc = update_state_after_alloc
    params = SamplingParams(max_tokens=workload["gen"], temperature=0.0, ignore_eos=True, detokenize=False)
    turns = conversation_turns(workload, (5, 500) if args.exact else (1000, 150000))
    prompts = next(turns)
    if not args.exact:  # warm-up on prompts of their own: no hits on the workload's
        llm.generate([{"prompt_token_ids": list(range(1000, 1000 + workload["prompt"]))}], params, use_tqdm=False)
        llm.reset_prefix_cache()
        loaded[0] = 0
    kept, generated, computed, wall = [], 0, 0, 0.0
    while prompts is not None:
        began = time.perf_counter()
        if reference:
            outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        else:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall += time.perf_counter() - began
        generated += sum(len(o.outputs[0].token_ids) for o in outputs)
        computed += sum(len(o.prompt_token_ids) - (o.num_cached_tokens or 0) for o in outputs)
        if args.exact:
            kept.append([(list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.outputs[0].routed_experts,
                          o.num_cached_tokens or 0, str(o.outputs[0].finish_reason)) for o in outputs])
        prompts = turns.send(outputs)
    routing = getattr(scheduler, "aux_output_connector", None)
    hits = getattr(routing, "external_hits", None)
    import vllm

    found = dict(
        config=args.child, vllm=vllm.__version__, tok_s=generated / wall, wall_s=wall, prompt_tokens_computed=computed,
        tokens_loaded=loaded[0], slotroute_stats=dict(getattr(hits, "stats", {})),
        host_tier=type(hits).__name__ if hits is not None else None,
    )
    if args.exact:
        with open(args.out, "wb") as f:
            pickle.dump(kept, f)
    print("CHILD " + json.dumps(found), flush=True)


# Router probability gap under which batch-shape noise may flip a choice (tests/test_vllm_gpu.py).
NEAR_TIE = 2e-3


def compare_exact(paths: dict, model: str) -> dict:
    """Per configuration, against the reference: requests with the same tokens and
    the same rows, and the (token, layer) pairs whose experts differ, with the largest
    router probability gap among them from transformers' own model (a difference
    away from a near-tie, ``NEAR_TIE``, would be an error). For routing on, the rows
    of each turn's prefix against the previous turn's rows of the same tokens: those
    served from a cache (the block pool or the host tier: the turn's
    ``num_cached_tokens``) must be equal bit for bit; those recomputed may differ at
    near-ties."""
    import numpy as np

    sys.path.insert(0, str(HERE.parent / "tests"))
    from hf_oracle import router_topk

    runs = {}
    for config, path in paths.items():
        with open(path, "rb") as f:
            runs[config] = pickle.load(f)
    want = runs["reference"]
    found = {}
    for config, turns in runs.items():
        if config == "reference":
            continue
        mine = found[config] = dict(requests=0, same_tokens=0, same_rows_as_reference=0, pairs_differing=0,
                                    largest_gap_of_a_differing_pair=0.0, pairs_differing_away_from_a_near_tie=0,
                                    finish_reasons=sorted({r[4] for turn in turns for r in turn}))
        for turn, ref_turn in zip(turns, want):
            for got, ref in zip(turn, ref_turn):
                mine["requests"] += 1
                same = got[0] == ref[0] and got[1] == ref[1]
                mine["same_tokens"] += same
                if got[2] is None or not same:
                    continue
                differ = np.argwhere((np.sort(got[2], axis=2) != np.sort(ref[2], axis=2)).any(axis=2))
                mine["same_rows_as_reference"] += not len(differ)
                if len(differ):
                    choice = router_topk(model, got[0] + got[1][:-1])
                    gaps = choice.margin[differ[:, 0], differ[:, 1]]
                    mine["pairs_differing"] += len(differ)
                    mine["largest_gap_of_a_differing_pair"] = max(mine["largest_gap_of_a_differing_pair"], float(gaps.max()))
                    mine["pairs_differing_away_from_a_near_tie"] += int((gaps >= NEAR_TIE).sum())
        if turns[0][0][2] is None:
            continue
        served = served_same = recomputed = recomputed_same = 0
        for before, after in zip(turns, turns[1:]):
            for old, new in zip(before, after):
                n = old[2].shape[0]
                cached = min(new[3], n)
                equal = (new[2][:n] == old[2]).all(axis=(1, 2))
                served += cached
                served_same += int(equal[:cached].sum())
                recomputed += n - cached
                recomputed_same += int(equal[cached:].sum())
        mine.update(prefix_rows_served_from_a_cache=served, of_them_equal_to_the_previous_turn=served_same,
                    prefix_rows_recomputed=recomputed, of_them_equal_to_the_previous_turn_too=recomputed_same)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", help="write every child and the summary here; continue a run found there")
    parser.add_argument("--budget-s", type=float, help="start no child that would end after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="a CPU build of vLLM (see usage)")
    parser.add_argument("--compare", metavar="DIR",
                        help="compare the exact run's children kept in DIR (CONFIG_1.pkl) and stop")
    parser.add_argument("--child", choices=(*CONFIGS, "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    began = time.perf_counter()
    sys.path.insert(0, str(HERE))
    from gpu_engine import (continued, device_name, expected_child_s, plan as rotated, record_child, write_config,
                            write_json)

    work = Path(tempfile.gettempdir()) / "gpu_offload"
    work.mkdir(exist_ok=True)
    configs = args.configs.split(",")
    if args.compare or args.exact:
        sys.path.insert(0, str(HERE.parent / "src"))
        from slotroute.tools.tiny_model import write_tiny_moe

        model = str(write_tiny_moe(work / "tiny", num_layers=4, num_experts=16, top_k=4, dense_layers=(1,), seed=0))
        plan = [dict(round=1, config=c) for c in (*configs, "reference")]
        setup = dict(mode="exact", workload=EXACT, configs=configs)
        if args.compare:
            kept = {c: Path(args.compare) / f"{c}_1.pkl" for c in (*configs, "reference")}
            print("EXACT " + json.dumps(compare_exact({c: p for c, p in kept.items() if p.exists()}, model), indent=1))
            return
    else:
        model = str(write_config(work / f"qwen3-30b-a3b-shape-{args.layers}", args.layers))
        plan = [c for c in rotated(configs, args.rounds) if c["round"]]  # no warm-up child: tok/s excludes the start
        setup = dict(mode="bench", workload=BENCH, configs=configs, layers=args.layers, rounds=args.rounds)
    state = continued(args.json, setup, plan)
    for entry in state["children"]:
        if "tok_s" in entry:
            continue
        expected = expected_child_s(state["children"], warm_up=False, key="child_s")
        if args.budget_s is not None and time.perf_counter() - began + 1.2 * expected > args.budget_s:
            print("budget: stopping before the next child; run the same command again to continue", flush=True)
            break
        env = dict(os.environ)
        if entry["config"] == "vllm":
            env["SLOTROUTE_DISABLE"] = "1"
        out = work / f"{entry['config']}_{entry['round']}.pkl"
        command = [sys.executable, __file__, "--child", entry["config"], "--model", model, "--out", str(out)]
        command += ["--exact"] * args.exact + ["--smoke"] * args.smoke
        child_began = time.perf_counter()
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        if not record_child(entry, result, time.perf_counter() - child_began, "child_s"):
            print(f"{entry['config']} round {entry['round']}: failed\n{result.stderr[-5000:]}", flush=True)
        else:
            entry["pickle"] = str(out)
            print(f"{entry['config']} round {entry['round']}: {entry['tok_s']:.0f} tok/s, "
                  f"{entry['prompt_tokens_computed']} prompt tokens computed, {entry['tokens_loaded']} loaded, "
                  f"{entry['child_s']:.0f} s", flush=True)
        if args.json:
            write_json(Path(args.json), state)
    done = [c for c in state["children"] if "tok_s" in c]
    state["device"] = device_name()
    if args.exact and {c["config"] for c in done} >= {"slotroute", "reference"}:
        state["exact"] = compare_exact({c["config"]: c["pickle"] for c in done}, model)
        print("EXACT " + json.dumps(state["exact"]), flush=True)
    summary = {}
    for config in configs:
        mine = [c for c in done if c["config"] == config]
        if mine:
            summary[config] = {key: dict(median=statistics.median(c[key] for c in mine), min=min(c[key] for c in mine),
                                         max=max(c[key] for c in mine), n=len(mine))
                               for key in ("tok_s", "prompt_tokens_computed", "tokens_loaded")}
    state["summary"] = summary
    print(f"device {state['device']}, vLLM {done[0]['vllm'] if done else '?'}, {setup}", flush=True)
    for config, figures in summary.items():
        print(f"  {config:9s} " + ", ".join(f"{k} {v['median']:.0f} [{v['min']:.0f}, {v['max']:.0f}] n={v['n']}"
                                          for k, v in figures.items()), flush=True)
    if args.json:
        write_json(Path(args.json), state)


if __name__ == "__main__":
    main()
