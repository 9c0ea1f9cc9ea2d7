"""RoutedExpertsCapturer across real processes: torch.distributed (gloo) on CPU.

One spawn of four ranks runs every scenario; each rank saves its capture buffer and its
snapshot, and the tests below compare them with a reference built here. Ranks are laid
out DP-major: DP rank ``r // 2``, TP rank ``r % 2`` where DP=2 x TP=2.
"""

import datetime
import socket
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slotroute.capture import NOT_CAPTURED, BatchLayout, RoutedExpertsCapturer
from slotroute.spec import RoutingSpec

SPEC = RoutingSpec(num_layers=3, top_k=2, num_experts=16)
MAX_TOKENS = 24
WORLD = 4
# Tokens per DP rank in each scenario (one entry: a single DP rank over all four ranks).
COUNTS = {"tp4_sp": (13,), "tp2_sp": (7, 10), "dp2_naive": (6, 9), "dp2_gathered": (5, 8)}


def reference(scenario):
    """Routing of every DP rank's tokens, ``[(t, L, K) int64 per DP rank]``; identical
    in every process."""
    rng = np.random.default_rng(sum(map(ord, scenario)))
    return [rng.integers(0, SPEC.num_experts, size=(t, *SPEC.token_shape)) for t in COUNTS[scenario]]


def sp_shard(tokens, tp_rank, tp_size):
    """This TP rank's sequence-parallel shard: ``ceil(t / tp)`` rows, the last padded
    with out-of-range ids that must never reach the buffer."""
    rows = -(-len(tokens) // tp_size)
    padded = np.full((rows * tp_size, *SPEC.token_shape), SPEC.num_experts + 7)
    padded[: len(tokens)] = tokens
    return padded[tp_rank * rows : (tp_rank + 1) * rows]


def gather_varlen(local, group, group_size):
    """All-gather rows of differing counts (gloo gathers equal sizes: pad, then trim)."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(group_size)]
    dist.all_gather(sizes, torch.tensor([len(local)]), group=group)
    most = max(int(s) for s in sizes)
    padded = torch.zeros((most, *local.shape[1:]), dtype=local.dtype)
    padded[: len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(group_size)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)]), [int(s) for s in sizes]


def run_scenario(scenario, rank, groups):
    """``(topk_ids rows this rank's router sees, layout, tp_group)`` for one scenario."""
    tokens = reference(scenario)
    dp_rank, tp_rank = divmod(rank, 2)
    counts = COUNTS[scenario]
    if scenario == "tp4_sp":  # one DP rank, TP=4 over every rank
        rows = sp_shard(tokens[0], rank, WORLD)
        return torch.from_numpy(rows), BatchLayout(counts, 0, WORLD), groups["world"]
    if scenario == "tp2_sp":  # DP=2 x TP=2, each TP rank sees its shard
        rows = sp_shard(tokens[dp_rank], tp_rank, 2)
        return torch.from_numpy(rows), BatchLayout(counts, dp_rank, 2), groups["tp"]
    if scenario == "dp2_naive":  # every DP rank's tokens gathered before routing
        rows, _ = gather_varlen(torch.from_numpy(tokens[dp_rank]), groups["dp"], 2)
        return rows, BatchLayout(counts, dp_rank, 2), groups["tp"]
    if scenario == "dp2_gathered":  # SP shards of every DP and TP rank gathered (DP+EP)
        rows, local_sizes = gather_varlen(torch.from_numpy(sp_shard(tokens[dp_rank], tp_rank, 2)), None, WORLD)
        return rows, BatchLayout(counts, dp_rank, 2, local_sizes), groups["tp"]
    raise AssertionError(scenario)


def worker(rank, port, outdir):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {"world": dist.group.WORLD, "tp": tp_groups[rank // 2], "dp": dp_groups[rank % 2]}
    for scenario in COUNTS:
        rows, layout, tp_group = run_scenario(scenario, rank, groups)
        cap = RoutedExpertsCapturer(SPEC, MAX_TOKENS, "cpu", tp_group=tp_group)
        for layer in range(SPEC.num_layers):
            cap.capture(layer, rows[:, layer].contiguous().to(torch.int32 if layer % 2 else torch.int64), layout)
        mine = layout.num_tokens_across_dp[layout.dp_rank]
        lists = cap.snapshot(mine, np.arange(mine) + 100 * rank).result()
        np.save(f"{outdir}/{scenario}-{rank}-buffer.npy", cap.get_device_buffer().numpy())
        if lists is not None:
            np.save(f"{outdir}/{scenario}-{rank}-data.npy", lists.routing_data)
            np.save(f"{outdir}/{scenario}-{rank}-slots.npy", lists.slot_mapping)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outdir(tmp_path_factory):
    out = tmp_path_factory.mktemp("capture_dist")
    context = mp.start_processes(worker, args=(free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("distributed capture ranks did not finish within 240 s")
    return out


def rank_tokens(scenario, rank):
    tokens = reference(scenario)
    return tokens[0] if len(tokens) == 1 else tokens[rank // 2]


def assert_rank_rebuilt_its_tokens(outdir, scenario, rank):
    buffer = np.load(outdir / f"{scenario}-{rank}-buffer.npy")
    expected = rank_tokens(scenario, rank)
    np.testing.assert_array_equal(buffer[: len(expected)], expected)
    assert (buffer[len(expected) :] == NOT_CAPTURED).all()


@pytest.mark.parametrize("rank", range(WORLD))
def test_tp4_sequence_parallel_all_gather_rebuilds_every_token_on_every_rank(outdir, rank):
    assert_rank_rebuilt_its_tokens(outdir, "tp4_sp", rank)


@pytest.mark.parametrize("rank", range(WORLD))
def test_tp2_sequence_parallel_all_gather_rebuilds_each_dp_ranks_tokens_on_both_tp_ranks(outdir, rank):
    assert_rank_rebuilt_its_tokens(outdir, "tp2_sp", rank)


@pytest.mark.parametrize("rank", range(WORLD))
def test_dp2_naive_dispatch_leaves_each_rank_its_dp_ranks_tokens(outdir, rank):
    assert_rank_rebuilt_its_tokens(outdir, "dp2_naive", rank)


@pytest.mark.parametrize("rank", range(WORLD))
def test_dp2_gathered_shards_leave_each_rank_its_dp_ranks_tokens_without_padding(outdir, rank):
    assert_rank_rebuilt_its_tokens(outdir, "dp2_gathered", rank)


@pytest.mark.parametrize("scenario", list(COUNTS))
def test_only_tp_rank_0_ships_a_snapshot(outdir, scenario):
    shipping = {r for r in range(WORLD) if (outdir / f"{scenario}-{r}-data.npy").exists()}
    assert shipping == ({0} if scenario == "tp4_sp" else {0, 2})
    for rank in shipping:
        expected = rank_tokens(scenario, rank)
        data = np.load(outdir / f"{scenario}-{rank}-data.npy")
        assert data.dtype == SPEC.storage_dtype
        np.testing.assert_array_equal(data, expected)
        np.testing.assert_array_equal(np.load(outdir / f"{scenario}-{rank}-slots.npy"), np.arange(len(expected)) + 100 * rank)
