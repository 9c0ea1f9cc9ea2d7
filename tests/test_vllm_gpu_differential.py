"""slotroute against vLLM's own routed-experts path, on a CUDA GPU, vLLM 0.31+ (V2
runner, where vLLM's own path runs): the same prompts through vLLM's own path
(``SLOTROUTE_DISABLE=1``) and through slotroute, each engine alone in its process,
prefix caching on and a second round of the same prompts that hits the cache, in
float32 and in bfloat16; and with vLLM's model-free ``ngram`` speculative decoding,
where both paths drop each request's rejected draft tokens by the count the sampler
gives (slotroute before the scheduler stores their rows). Both engines run
the same kernels on the same batches, so every token and every row (as a set of
experts) must be equal. Skipped without CUDA; run on the device machine (results in
docs/vllm.md, "GPU runs").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import MOE_LAYERS, connector_generation, prompt_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)"),
    pytest.mark.skipif(not connector_generation(), reason="vLLM's own path to compare with is 0.31+'s connector"),
    pytest.mark.skipif(
        os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip() in ("0", "false", "False"),
        reason="vLLM's own path needs the V2 runner",
    ),
]

SHARED = prompt_tokens(20, 300)
PROMPTS = [SHARED + prompt_tokens(21 + i, 20 + 17 * i) for i in range(6)] + [prompt_tokens(30 + i, 90) for i in range(4)]
GENERATED = 24

# Prompts that repeat short sequences, so that the ngram proposer finds matches.
PATTERN = prompt_tokens(40, 8)
SPEC_PROMPTS = PROMPTS[:3] + [PATTERN * 6, prompt_tokens(41, 10) + PATTERN * 4, prompt_tokens(42, 5) * 6]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

# One engine, alone in its process: argv = model, dtype, prompts (json), output (npz),
# extra LLM arguments (json). Two rounds of the same prompts: the second hits the
# prefix cache the first filled. vLLM's spec-decode counters (drafted, accepted) are
# kept where the engine keeps stats.
CHILD = """
import json, os, sys
import numpy as np
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
model, dtype, prompts, out = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])), sys.argv[4]
extra = json.loads(sys.argv[5])
llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, distributed_executor_backend="uni",
          enable_return_routed_experts=True, enable_prefix_caching=True, block_size=16, seed=0,
          gpu_memory_utilization=0.25, max_model_len=1024, max_num_batched_tokens=512, **extra)
import slotroute.vllm as plugin
found = {"outcome": np.array(plugin.register())}
params = SamplingParams(max_tokens=%d, temperature=0.0, ignore_eos=True)
for turn in (0, 1):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, o in enumerate(outputs):
        found[f"tokens{turn}_{i}"] = np.array(o.outputs[0].token_ids)
        found[f"routed{turn}_{i}"] = o.outputs[0].routed_experts
        found[f"cached{turn}_{i}"] = np.array(o.num_cached_tokens)
if not extra.get("disable_log_stats", True):
    names = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
    totals = dict.fromkeys(names, 0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    found["drafts"] = np.array([totals[name] for name in names])
from conftest import runner_of, worker_routing  # the tests' directory is on this child's path
found["rows_rejected"] = np.array(getattr(getattr(runner_of(llm), "aux_output_connector", None), "rows_rejected", -1))
routing = worker_routing(llm)
found["copy_once"] = np.array(-1 if routing is None else int(routing.capturer._copy_once))  # 1: one copy a step
np.savez(out, **found)
print("CHILD DONE")
""" % GENERATED


def run_engine(tiny_model: str, dtype: str, own_path: bool, work, prompts=PROMPTS, **extra) -> dict:
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    out = work / f"{dtype}-{'vllm' if own_path else 'slotroute'}.npz"
    tests = os.path.dirname(os.path.abspath(__file__))  # for the child's import of conftest
    env = {**os.environ, "SLOTROUTE_DISABLE": "1" if own_path else "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, tiny_model, dtype, str(prompts_file), str(out), json.dumps(extra)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(np.load(out))


def assert_equal_runs(ours: dict, own: dict, prompts: list) -> int:
    """Every token and every row (as a set of experts) equal in both rounds; returns
    how many requests hit the prefix cache."""
    assert str(own["outcome"]) == "disabled" and str(ours["outcome"]) == "slotroute"
    hits = 0
    for turn in (0, 1):
        for i, prompt in enumerate(prompts):
            key = f"{turn}_{i}"
            np.testing.assert_array_equal(ours[f"tokens{key}"], own[f"tokens{key}"], err_msg=f"tokens, round {turn}, prompt {i}")
            got, want = ours[f"routed{key}"], own[f"routed{key}"]
            assert got.shape[0] == want.shape[0] == len(prompt) + GENERATED - 1, (key, got.shape, want.shape)
            np.testing.assert_array_equal(moe_rows(got), moe_rows(want), err_msg=f"rows, round {turn}, prompt {i}")
            hits += int(ours[f"cached{key}"]) > 0
    return hits


def capture_mode(ours: dict) -> str:
    """How slotroute's worker copied the routing in its run (SLOTROUTE_CAPTURE_COPY_ONCE)."""
    return {1: "one copy a step", 0: "a copy per MoE layer"}.get(int(ours["copy_once"]), "worker routing not found")


def moe_rows(routed: np.ndarray) -> np.ndarray:
    """The MoE layers' rows as sets of experts (sorted ids, int64), whichever way a
    path numbers the layers: slotroute keeps every decoder layer (dense ones zero),
    a path with one row per MoE layer keeps those."""
    if routed.shape[1] != len(MOE_LAYERS):
        routed = routed[:, list(MOE_LAYERS)]
    return np.sort(routed.astype(np.int64), axis=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slotroute_returns_vllms_own_rows_and_tokens_with_and_without_cache_hits(tiny_model, tmp_path, dtype):
    own = run_engine(tiny_model, dtype, own_path=True, work=tmp_path)
    ours = run_engine(tiny_model, dtype, own_path=False, work=tmp_path)
    hits = assert_equal_runs(ours, own, PROMPTS)
    # The second round hits the prefix cache for every prompt; the first, for the
    # prompts after the first that share its prefix.
    assert hits >= len(PROMPTS) + 1
    print(f"RESULT {dtype}: {2 * len(PROMPTS)} requests, {hits} with prefix-cache hits, every token and row equal; "
          f"capture: {capture_mode(ours)}")


def test_ngram_speculation_returns_vllms_own_rows_only_for_accepted_tokens(tiny_model, tmp_path):
    """Both paths with the same ngram drafts: vLLM's own trims each request's rejected
    drafts from its rows; slotroute drops their rows before the scheduler stores them
    (as many as vLLM's counters say were rejected) and returns rows up to the
    request's last accepted token."""
    extra = dict(speculative_config=NGRAM, disable_log_stats=False)
    own = run_engine(tiny_model, "float32", own_path=True, work=tmp_path, prompts=SPEC_PROMPTS, **extra)
    ours = run_engine(tiny_model, "float32", own_path=False, work=tmp_path, prompts=SPEC_PROMPTS, **extra)
    drafted, accepted = (int(n) for n in ours["drafts"])
    assert 0 < accepted < drafted, f"{drafted} draft tokens, {accepted} accepted: need some of each"
    # Every rejected draft's row was dropped before the scheduler stored it.
    assert int(ours["rows_rejected"]) == drafted - accepted, (int(ours["rows_rejected"]), drafted, accepted)
    hits = assert_equal_runs(ours, own, SPEC_PROMPTS)
    assert hits >= len(SPEC_PROMPTS)
    print(f"RESULT ngram float32: {2 * len(SPEC_PROMPTS)} requests, {hits} with prefix-cache hits, "
          f"{drafted} draft tokens, {accepted} accepted, every token and row equal; capture: {capture_mode(ours)}")

