"""The capture's per-layer copy against ways of taking it out of a decode step's CUDA graph.

On the GPU engine benchmark's vLLM 0.32 runs, a decode step's device time beyond routing
off's is mostly one copy kernel per MoE layer (66-74 us a step at 48 layers, on slotroute's
path and vLLM's own alike: docs/benchmarks.md). This measures, on a synthetic forward of
the engine benchmark's shape (48 MoE layers, top-8 of 128 experts, hidden 2048, bfloat16;
per layer a router matmul, softmax, top-k into int32 ids as vLLM's ``fused_topk`` makes
them, and an expert-sized matmul pair weighted by the top-k weights), recorded in a CUDA
graph per step size and replayed, the device time per step of each way of capturing:

- ``none``: no capture (routing off);
- ``per-layer``: each layer's ids copied into a token-major buffer ``(tokens, layers,
  top_k)`` when its router runs, as ``RoutedExpertsCapturer.capture`` does today;
- ``foreach``: each layer's ids held until the last layer, then one
  ``torch._foreach_copy_`` into a layer-major buffer ``(layers, tokens, top_k)``;
- ``cat``: held, then one ``torch.cat`` into the step's rows, layer-major and packed
  for the step's token count;
- ``stack``: held, then one ``torch.stack`` along the layer dimension straight into the
  token-major buffer (the capturer's layout unchanged);
- ``forked``: the per-layer copy on a side stream forked from the forward's stream
  when the router ran and joined after the last layer, off the forward's critical path.

The held ids stay allocated until the one copy is recorded, so the graph's pool cannot
hand their memory to a later layer in between. Every path's rows are checked against the
per-layer path's. Each round records every path's graph afresh, so that where a
recording's buffers fall varies between rounds instead of staying with one path; rounds
interleave the paths, the order rotating, and each figure is the median (min-max) over
rounds of each round's median of ``--repeat`` timed replays.

    python benchmarks/gpu_capture_paths.py --out paths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from gpu_capture import event_median_us
from slotroute.tools import cuda_graph

LAYERS, TOP_K, EXPERTS, HIDDEN, EXPERT_WIDTH = 48, 8, 128, 2048, 8 * 768
SIZES = (16, 64, 256, 512)
PATHS = ("none", "per-layer", "foreach", "cat", "stack", "forked")


class Step:
    """One decode step of ``n`` tokens through the synthetic forward, capturing by ``path``
    into buffers of its own."""

    def __init__(self, path: str, n: int, weights: dict, x: torch.Tensor):
        self.path, self.n, self.w, self.x = path, n, weights, x
        dev = x.device
        self.token_major = torch.full((n, LAYERS, TOP_K), -1, dtype=torch.int32, device=dev)
        self.layer_major = torch.full((LAYERS, n, TOP_K), -1, dtype=torch.int32, device=dev)
        self.held: list[torch.Tensor] = []
        self.side = torch.cuda.Stream(dev) if path == "forked" else None

    def capture(self, layer: int, ids: torch.Tensor) -> None:
        if self.path == "per-layer":
            self.token_major[:, layer].copy_(ids)
        elif self.path in ("foreach", "cat", "stack"):
            self.held.append(ids)
        elif self.path == "forked":
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                self.token_major[:, layer].copy_(ids)
            self.held.append(ids)  # kept until the join: the side stream reads it

    def finish(self) -> None:
        if self.path == "foreach":
            torch._foreach_copy_([self.layer_major[layer] for layer in range(LAYERS)], self.held)
        elif self.path == "cat":
            torch.cat(self.held, dim=0, out=self.layer_major.view(LAYERS * self.n, TOP_K))
        elif self.path == "stack":
            torch.stack(self.held, dim=1, out=self.token_major)
        elif self.path == "forked":
            torch.cuda.current_stream().wait_stream(self.side)
        self.held = []

    def __call__(self) -> None:
        h = self.x
        for layer in range(LAYERS):
            probs = torch.softmax((h @ self.w["gate"][layer]).float(), dim=-1)
            top, ids = torch.topk(probs, TOP_K, dim=-1)
            self.capture(layer, ids.to(torch.int32))
            h = h + ((h @ self.w["up"][layer]) @ self.w["down"][layer]) * top.sum(-1, keepdim=True).to(h.dtype)
        self.finish()

    def rows(self) -> torch.Tensor:
        """The step's rows, token-major, whichever buffer the path wrote."""
        if self.path in ("foreach", "cat"):
            return self.layer_major.permute(1, 0, 2)
        return self.token_major


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def record_paths(n: int, weights: dict, x: torch.Tensor, errors: dict, equal: dict) -> dict:
    """Each path's step of ``n`` tokens recorded in a CUDA graph of its own and replayed
    once into buffers reset to -1; ``equal[path]`` turns False where that replay's rows
    differ from the per-layer path's, and a path the device or torch refuses goes to
    ``errors`` (not fatal)."""
    steps, graphs = {}, {}
    for path in PATHS:
        if path in errors:
            continue
        try:
            steps[path] = Step(path, n, weights, x)
            graphs[path] = cuda_graph.record(steps[path])
            steps[path].token_major.fill_(-1)  # what the recording's own run wrote: the replay must write it again
            steps[path].layer_major.fill_(-1)
            graphs[path].replay()
        except Exception as exc:
            errors[path] = f"{type(exc).__name__}: {exc}"
            graphs.pop(path, None)
    torch.cuda.synchronize()
    reference = steps["per-layer"].rows()
    assert (reference >= 0).all() and (reference < EXPERTS).all(), "the per-layer path left rows unwritten"
    for path in graphs:
        if path != "none":
            equal[path] = equal[path] and bool(torch.equal(steps[path].rows(), reference))
    return graphs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--repeat", type=int, default=50, help="timed replays per path in a round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    weights = {"gate": torch.randn(LAYERS, HIDDEN, EXPERTS, **bf16) / HIDDEN**0.5,
               "up": torch.randn(LAYERS, HIDDEN, EXPERT_WIDTH, **bf16) / HIDDEN**0.5,
               "down": torch.randn(LAYERS, EXPERT_WIDTH, HIDDEN, **bf16) / EXPERT_WIDTH**0.5 / LAYERS}
    device = torch.cuda.get_device_name(0)
    print(f"{device}, torch {torch.__version__}; {LAYERS} layers, top-{TOP_K} of {EXPERTS}, "
          f"{args.rounds} rounds x {args.repeat} replays", flush=True)
    results = []
    for n in SIZES:
        x = torch.randn(n, HIDDEN, **bf16)
        errors: dict[str, str] = {}
        equal = {path: True for path in PATHS if path != "none"}
        by_round: dict[str, list[float]] = {path: [] for path in PATHS}
        for r in range(args.rounds):
            graphs = record_paths(n, weights, x, errors, equal)
            order = list(graphs)
            for path in order[r % len(order):] + order[:r % len(order)]:
                by_round[path].append(event_median_us(graphs[path].replay, args.repeat))
            del graphs
        by_round = {path: v for path, v in by_round.items() if v}
        equal = {path: ok for path, ok in equal.items() if path in by_round}
        row = {"n": n, "us_per_step": {p: spread(v) for p, v in by_round.items()}, "rows_equal_per_layer": equal,
               "errors": errors}
        base = row["us_per_step"]["none"]["median"]
        row["added_us_per_step"] = {p: row["us_per_step"][p]["median"] - base for p in by_round if p != "none"}
        results.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{device}: device us per step, median (min-max) over rounds; added = beyond no capture")
    print(f"{'n':>5} " + " ".join(f"{p:>26}" for p in PATHS))
    for row in results:
        cells = []
        for p in PATHS:
            if p not in row["us_per_step"]:
                cells.append(f"{'error':>26}")
                continue
            m = row["us_per_step"][p]
            added = "" if p == "none" else f" +{row['added_us_per_step'][p]:.1f}"
            cells.append(f"{m['median']:>8.1f} ({m['min']:.0f}-{m['max']:.0f}){added:>8}")
        print(f"{row['n']:>5} " + " ".join(cells))
    for row in results:
        wrong = [p for p, ok in row["rows_equal_per_layer"].items() if not ok]
        print(f"n={row['n']}: rows equal to the per-layer path's: {'all' if not wrong else 'not ' + ', '.join(wrong)}"
              + "".join(f"; {p} failed: {e}" for p, e in row["errors"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "rows": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
