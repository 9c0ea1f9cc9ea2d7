"""A real vLLM on one GPU, a Qwen3-30B-A3B-shaped MoE, three configurations in one run:
routing off, vLLM's own routed-experts path (``SLOTROUTE_DISABLE=1``) and slotroute.

The model has Qwen3-30B-A3B's shape (48 MoE layers, 128 experts, top-8, hidden 2048,
MoE intermediate 768, 32 query and 4 KV heads of 128; about 61 GB of bf16 weights),
with random weights drawn by vLLM itself (``load_format="dummy"``): only its
``config.json`` is written, so no 61 GB file is written or read. Routing of random
weights is as costly to capture, ship and store as a trained model's.

Two fixed workloads per configuration, after a short warm-up:
``rollout``: 256 requests of 1024 random prompt tokens and 256 generated tokens,
submitted at once; ``multi-turn``: 64 conversations of 3 turns, each turn's prompt the
previous prompt, its completion and 128 new tokens, 128 generated per turn (prefix
cache hits on every turn after the first).

Each configuration runs in its own process (vLLM caches its environment per
process). Printed per configuration and workload: generated tok/s and requests/min
with their ratio to "off", bytes shipped per engine step, and the host time per step
spent in the routing calls of the worker and the scheduler. The model runner is
vLLM's default (V2 on 0.29-0.32); ``--runner v1`` sets ``VLLM_USE_V2_MODEL_RUNNER=0``
(on 0.31+ vLLM's own path needs V2: ``--configs off,slotroute`` there).

usage: python benchmarks/gpu_engine.py [--runner v2|v1] [--layers 48] [--json OUT]
(``--layers 2 --requests 8 --prompt-len 128 --gen-len 16 --kv-cache-gb 1 --eager`` is a
smoke run that fits a CPU build of vLLM.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = ("off", "vllm", "slotroute")
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


def write_config(path: Path, layers: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = dict(QWEN3_30B_A3B, num_hidden_layers=layers, max_window_layers=layers)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


class Timer:
    """Host seconds and calls of wrapped methods, by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner, name: str, label: str, on_call=None) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = inner(*args, **kwargs)
            self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - started
            self.calls[label] = self.calls.get(label, 0) + 1
            if on_call is not None:
                on_call(args, result)
            return result

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(config: str, timer: Timer, shipped: list[int]) -> None:
    """Wrap the routing calls of ``config``'s path (classes, before the engine starts;
    nothing slotroute verifies, so its patches still go in)."""
    if config == "off":
        return

    def count_bytes(args, result):
        data, slots = args[-2], args[-1]
        shipped.append(int(data.nbytes) + int(slots.nbytes))

    import vllm

    connector_generation = tuple(int(part) for part in vllm.__version__.split(".")[:2]) >= (0, 31)
    if config == "vllm" and connector_generation:
        from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
        from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector

        def count_rows(args, result):  # what one step's worker output carries
            shipped.append(sum(out.rows.nbytes + 8 for out in (result or {}).values()))

        for name in ("build_connector_meta", "take_output", "request_finished"):
            timer.wrap(AuxOutputSchedulerConnector, name, "scheduler")
        for name in ("begin_step", "prepare_output"):
            timer.wrap(AuxOutputWorkerConnector, name, "worker")
        timer.wrap(AuxOutputWorkerConnector, "process_output", "worker", count_rows)
    elif config == "vllm":
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
            RoutedExpertsCapturer,
            RoutedExpertsManager,
        )
        from vllm.v1.outputs import RoutedExpertsTensors

        timer.wrap(RoutedExpertsManager, "store_batch", "scheduler", count_bytes)
        timer.wrap(RoutedExpertsManager, "get", "scheduler")
        timer.wrap(RoutedExpertsCapturer, "get_routed_experts", "worker")
        timer.wrap(RoutedExpertsTensors, "tolists", "worker")
    elif connector_generation:
        from slotroute.vllm import runner_v1, runner_v2_connector
        from slotroute.vllm.connector import ConnectorRouting
        from slotroute.vllm.worker import WorkerRouting

        # Not ``get`` nor ``store_batch``'s time: ``take_output`` and ``take_step`` call them.
        timer.wrap(ConnectorRouting, "store_batch", "bytes", count_bytes)
        for name in ("on_new_blocks", "build_connector_meta", "take_output", "request_finished", "take_step",
                     "after_output"):
            timer.wrap(ConnectorRouting, name, "scheduler")
        timer.wrap(WorkerRouting, "begin_step", "worker")
        timer.wrap(WorkerRouting, "snapshot_step", "worker")
        timer.wrap(runner_v2_connector.PendingStep, "process_output", "worker")
        timer.wrap(runner_v1, "_ship_aux_output", "worker")
    else:
        from slotroute.vllm import runner_v1, runner_v2
        from slotroute.vllm.scheduler import SchedulerRouting
        from slotroute.vllm.worker import WorkerRouting

        timer.wrap(SchedulerRouting, "store_batch", "scheduler", count_bytes)
        timer.wrap(SchedulerRouting, "get", "scheduler")
        for name in ("on_new_blocks", "seal_step", "before_output", "after_output"):
            timer.wrap(SchedulerRouting, name, "scheduler")
        timer.wrap(WorkerRouting, "begin_step", "worker")
        timer.wrap(WorkerRouting, "snapshot_step", "worker")
        timer.wrap(runner_v2.StepRouting, "tolists", "worker")
        timer.wrap(runner_v1, "as_vllm_lists", "worker")


def workloads(requests: int, prompt_len: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    rollout = [rng.integers(1000, 150000, prompt_len).tolist() for _ in range(requests)]
    conversations = [rng.integers(1000, 150000, prompt_len).tolist() for _ in range(max(requests // 4, 1))]
    return rollout, conversations, rng


def child(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    timer, shipped = Timer(), []
    from vllm import LLM, SamplingParams

    instrument(args.child, timer, shipped)
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
    timer.wrap(llm.llm_engine.engine_core.engine_core.scheduler, "update_from_output", "steps")
    config = llm.llm_engine.vllm_config
    rollout, conversations, rng = workloads(args.requests, args.prompt_len)
    gen, turn_gen = args.gen_len, max(args.gen_len // 2, 1)

    def params(n):
        return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)

    def run(prompts, n):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params(n), use_tqdm=False)
        for output in outputs:
            routed = output.outputs[0].routed_experts
            expected = len(output.prompt_token_ids) + n - 1
            if args.child != "off" and (routed is None or routed.shape[0] != expected):
                raise AssertionError(f"routed_experts {None if routed is None else routed.shape}, {expected} rows expected")
        return outputs

    run(rollout[:16], 16)  # warm-up (its prompts are cached; the workloads reset the cache)
    results = {}
    for name in ("rollout", "multi-turn"):
        llm.reset_prefix_cache()
        timer.reset()
        shipped.clear()
        began = time.perf_counter()
        generated = requests = 0
        if name == "rollout":
            run(rollout, gen)
            generated, requests = gen * len(rollout), len(rollout)
        else:
            prompts = conversations
            for _ in range(3):
                outputs = run(prompts, turn_gen)
                generated += turn_gen * len(prompts)
                requests += len(prompts)
                prompts = [
                    list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
                    + rng.integers(1000, 150000, turn_gen).tolist()
                    for o in outputs
                ]
        wall = time.perf_counter() - began
        steps = max(timer.calls.get("steps", 0), 1)
        results[name] = dict(
            wall_s=wall, tok_s=generated / wall, req_min=60 * requests / wall, steps=steps,
            bytes_per_step=sum(shipped) / steps,
            worker_us_per_step=1e6 * timer.seconds.get("worker", 0.0) / steps,
            scheduler_us_per_step=1e6 * timer.seconds.get("scheduler", 0.0) / steps,
            worker_calls_per_step=timer.calls.get("worker", 0) / steps,
            scheduler_calls_per_step=timer.calls.get("scheduler", 0) / steps,
        )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    print("CHILD " + json.dumps(dict(
        config=args.child, start_s=start_s, results=results, use_v2=config.use_v2_model_runner,
        runner=f"{type(runner).__module__}.{type(runner).__qualname__}",
        cudagraph_mode=str(config.compilation_config.cudagraph_mode),
        async_scheduling=bool(config.scheduler_config.async_scheduling),
    )), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runner", choices=("v2", "v1"), default="v2")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--requests", type=int, default=256, help="rollout requests (conversations: a quarter)")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=256, help="rollout tokens (multi-turn: half per turn)")
    parser.add_argument("--kv-cache-gb", type=float, help="KV cache size (needed on CPU)")
    parser.add_argument("--eager", action="store_true", help="no compilation or CUDA graphs (needed on CPU)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    import torch

    model = write_config(Path(tempfile.mkdtemp(prefix="qwen3-30b-a3b-shape-")), args.layers)
    env = dict(os.environ)
    if args.runner == "v1":
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    found = {}
    for config in args.configs.split(","):
        child_env = dict(env)
        if config == "vllm":
            child_env["SLOTROUTE_DISABLE"] = "1"
        command = [sys.executable, __file__, "--child", config, "--model", str(model), "--requests",
                   str(args.requests), "--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
        if args.kv_cache_gb is not None:
            command += ["--kv-cache-gb", str(args.kv_cache_gb)]
        if args.eager:
            command.append("--eager")
        result = subprocess.run(command, env=child_env, capture_output=True, text=True)
        lines = [line for line in result.stdout.splitlines() if line.startswith("CHILD ")]
        if result.returncode != 0 or not lines:
            print(f"{config}: failed ({result.returncode})\n{result.stderr[-4000:]}", flush=True)
            continue
        found[config] = json.loads(lines[-1][6:])
        print(f"{config}: {json.dumps(found[config])}", flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"\ndevice {device}, runner {args.runner}, {args.layers} layers, {args.requests} requests of "
          f"{args.prompt_len} + {args.gen_len} tokens")
    print("| workload | config | tok/s | x off | req/min | bytes/step | worker us/step | scheduler us/step "
          "| routing calls/step (worker + scheduler) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in ("rollout", "multi-turn"):
        off = found.get("off", {}).get("results", {}).get(name)
        for config, run in found.items():
            r = run["results"][name]
            ratio = f"{r['tok_s'] / off['tok_s']:.4f}" if off else "-"
            print(f"| {name} | {config} | {r['tok_s']:.0f} | {ratio} | {r['req_min']:.0f} | "
                  f"{r['bytes_per_step']:.0f} | {r['worker_us_per_step']:.1f} | {r['scheduler_us_per_step']:.1f} | "
                  f"{r.get('worker_calls_per_step', 0):.1f} + {r.get('scheduler_calls_per_step', 0):.1f} |")
        if off and "vllm" in found and "slotroute" in found:
            own = 1 - found["vllm"]["results"][name]["tok_s"] / off["tok_s"]
            ours = 1 - found["slotroute"]["results"][name]["tok_s"] / off["tok_s"]
            print(f"{name}: throughput cost against off: vLLM's own {own:+.4f}, slotroute {ours:+.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(runner=args.runner, layers=args.layers, runs=found), indent=1))


if __name__ == "__main__":
    main()
