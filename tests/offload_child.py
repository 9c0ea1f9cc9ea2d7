"""The offloading scenarios of ``test_vllm_offload.py``, run in a process of their own.

An engine with a KV transfer connector sets vLLM's process-wide transfer group, which
every later engine of the process then expects metadata for; so the offloading engine
runs here, and the test process keeps its reference engine. Usage:
``python offload_child.py MODEL OUT.pkl [offload|example]``; writes a dict of scenario
name -> what it saw (completions, counters). ``example`` runs vLLM's
``ExampleConnector`` (KV saved to files and loaded back on a hit: KV that arrives with
no routing) instead of the offloading connector.
"""

from __future__ import annotations

import os
import pickle
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402

from conftest import generate, greedy, make_llm, routing_of, scheduler_of  # noqa: E402
from host_offload import offload_config  # noqa: E402

GPU_BLOCKS = 24  # 768 tokens of KV in the block pool
TOKENS_PER_CHUNK = 64  # two blocks per offloaded chunk
HOST_CHUNKS = 40  # the host tier: 2,560 tokens
CHUNK_BYTES = TOKENS_PER_CHUNK * 4 * 2 * 64 * 4  # KV of a chunk: 4 layers, K and V of 64 float32 a token
MAX_TOKENS = 8
PREEMPTING_TOKENS = 64


def conversations(rng, count: int, first: int) -> list[list[int]]:
    return [rng.integers(5, 500, first).tolist() for _ in range(count)]


def next_turn(rng, prompts, done) -> list[list[int]]:
    return [list(p) + list(c.tokens) + rng.integers(5, 500, 40).tolist() for p, c in zip(prompts, done)]


def main(model: str, out: str) -> None:
    llm = make_llm(
        model, enable_prefix_caching=True, max_num_batched_tokens=128, max_model_len=512,
        num_gpu_blocks_override=GPU_BLOCKS,
        kv_transfer_config=offload_config(HOST_CHUNKS * CHUNK_BYTES, TOKENS_PER_CHUNK),
    )
    scheduler = scheduler_of(llm)
    hits = routing_of(scheduler).external_hits
    preemptions = []
    original_preempt = scheduler._preempt_request

    def preempt(request, *args, **kwargs):
        preemptions.append(request.request_id)
        return original_preempt(request, *args, **kwargs)

    scheduler._preempt_request = preempt
    seen: dict[str, dict] = {"setup": {"hits": type(hits).__name__, "capacity": hits.tier.capacity}}

    def record(name: str, prompts, done, **extra) -> None:
        seen[name] = dict(
            prompts=[list(p) for p in prompts], completions=[vars(c) for c in done], stats=dict(hits.stats),
            tier_keys=len(hits.tier), preemptions=len(preemptions), **extra,
        )

    rng = np.random.default_rng(0)
    # Multi-turn: 6 conversations of 3 turns, together several times the block pool.
    prompts = conversations(rng, 6, 150)
    turns = []
    for turn in range(3):
        done = generate(llm, prompts, greedy(MAX_TOKENS))
        turns.append((prompts, done))
        record(f"turn{turn}", prompts, done)
        prompts = next_turn(rng, prompts, done)

    # A request aborted while its KV loads from the host tier.
    engine = llm.llm_engine
    from vllm import SamplingParams

    last_prompts, last_done = turns[-1]
    target = list(last_prompts[1]) + list(last_done[1].tokens)
    engine.add_request("aborted", {"prompt_token_ids": target}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                             ignore_eos=True))
    engine.step()
    (internal_id,) = [req_id for req_id in scheduler.requests if req_id.startswith("aborted")]
    status = scheduler.requests[internal_id].status.name
    engine.abort_request(["aborted"])
    while engine.has_unfinished_requests():
        engine.step()
    again = [target, list(last_prompts[2]) + list(last_done[2].tokens)]
    done = generate(llm, again, greedy(MAX_TOKENS))
    record("aborted_load", again, done, status_after_one_step=status,
           hit_starts_left=len(hits._hit_starts), cursors_left=len(routing_of(scheduler)._cursors))

    # More requests than the block pool holds, twice: the second round's hits load
    # from the host tier while requests are preempted and resumed around them.
    crowd = conversations(rng, 8, 180)
    first_round = generate(llm, crowd, greedy(PREEMPTING_TOKENS))
    second = [list(p) + list(c.tokens[:16]) for p, c in zip(crowd, first_round)]
    before = len(preemptions)
    done = generate(llm, second, greedy(PREEMPTING_TOKENS))
    record("preempted", second, done, preemptions_before=before)

    # Fill the host tier several times over: the tier evicts with it.
    fill = conversations(rng, 24, 250)
    done = generate(llm, fill, greedy(MAX_TOKENS))
    record("fill", fill, done)
    # The first conversations' chunks are evicted from the host tier: recomputed.
    done = generate(llm, [p for p, _ in turns[:1]][0], greedy(MAX_TOKENS))
    record("after_fill", turns[0][0], done)

    # Hits whose routing is not held: a conversation's chunks go to the host tier and
    # leave the block pool; the routing tier then forgets every chunk while the host
    # tier keeps their KV, and the conversation's next turn recomputes them.
    probe = conversations(rng, 1, 200)
    first = generate(llm, probe, greedy(MAX_TOKENS))
    generate(llm, conversations(rng, 4, 250), greedy(MAX_TOKENS))
    readable = sum(hits.tier.get(key) is not None for key in list(hits.tier._entries))
    hits.tier.clear()
    repeat = [list(probe[0]) + list(first[0].tokens)]
    before = dict(hits.stats)
    done = generate(llm, repeat, greedy(MAX_TOKENS))
    record("not_held", repeat, done, readable_before=readable, stats_before=before)

    with open(out, "wb") as f:
        pickle.dump(seen, f)


def example(model: str, out: str) -> None:
    """The same prompts twice through vLLM's ``ExampleConnector``, the block pool's
    cache reset in between: the connector offers the second round's prompts from its
    files, and every such hit is capped to nothing and recomputed."""
    import tempfile

    llm = make_llm(
        model, enable_prefix_caching=True, max_num_batched_tokens=128, max_model_len=512,
        num_gpu_blocks_override=GPU_BLOCKS,
        kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"shared_storage_path": tempfile.mkdtemp()}},
    )
    routing = routing_of(scheduler_of(llm))
    offered, admitted = [], []
    cap = routing.cap_external_hit

    def cap_external_hit(request, num_local, num_external):
        offered.append(num_external)
        admitted.append(cap(request, num_local, num_external))
        return admitted[-1]

    routing.cap_external_hit = cap_external_hit
    prompts = conversations(np.random.default_rng(1), 3, 200)
    first = generate(llm, prompts, greedy(MAX_TOKENS))
    llm.reset_prefix_cache()
    second = generate(llm, prompts, greedy(MAX_TOKENS))
    seen = {name: dict(prompts=prompts, completions=[vars(c) for c in done]) for name, done in
            (("first", first), ("second", second))}
    seen["setup"] = dict(hits=type(routing.external_hits).__name__, offered=offered, admitted=admitted)
    with open(out, "wb") as f:
        pickle.dump(seen, f)


if __name__ == "__main__":
    (example if sys.argv[3:] == ["example"] else main)(sys.argv[1], sys.argv[2])
