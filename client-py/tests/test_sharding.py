"""Sharding across ranks: DistributedSampler semantics, exactly once per epoch.

Each rank is a separate Python process (as in a real job); the dataset's
`label` field holds each sample's global index, so the tests can tell which
samples every rank received and check their values against h5py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

WORLD = 3
BATCH = 8


def shard_sizes(n: int, world: int, batch: int, drop_last: bool) -> tuple[int, int, int]:
    """(total_size, per_rank, batches_per_rank) as DistributedSampler + DataLoader give them."""
    if drop_last:
        total = (n // world) * world
    else:
        total = -(-n // world) * world
    per_rank = total // world
    batches = per_rank // batch if drop_last else -(-per_rank // batch)
    return total, per_rank, batches


def unshuffled_rank_order(n: int, world: int, rank: int, drop_last: bool) -> list[int]:
    total, _, _ = shard_sizes(n, world, 1, drop_last)
    return [p % n for p in range(rank, total, world)]


def check_batch_shapes(batches: list[list[int]], per_rank: int, batch: int, drop_last: bool) -> None:
    """Full batches in order; the last one partial only without drop_last."""
    served = sum(len(b) for b in batches)
    if drop_last:
        assert all(len(b) == batch for b in batches)
        assert served == (per_rank // batch) * batch
    else:
        assert served == per_rank
        assert all(len(b) == batch for b in batches[:-1])
        assert 1 <= len(batches[-1]) <= batch


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def rank_args(socket: str, world: int = WORLD) -> list[dict[str, Any]]:
    return [{"rank": r, "world_size": world, "socket": socket} for r in range(world)]


def check_epoch_cover(results: list[dict[str, Any]], epoch: int, n: int, drop_last: bool) -> None:
    """The union over ranks of one epoch is every index exactly once, plus the
    wrap-around padding (or minus the truncated tail with drop_last)."""
    world = len(results)
    total, per_rank, nb = shard_sizes(n, world, BATCH, drop_last)
    counts: Counter[int] = Counter()
    for r, res in enumerate(results):
        batches = res["epochs"][str(epoch)]
        assert res["len"] == nb, f"rank {r}: len(loader) = {res['len']}, expected {nb}"
        assert len(batches) == nb, f"rank {r}: {len(batches)} batches in epoch {epoch}, expected {nb}"
        check_batch_shapes(batches, per_rank, BATCH, drop_last)
        counts.update(flat(batches))
    # Put the ranks' samples back at their positions r + world * k of the
    # global order: the first N positions are a permutation of all indices and
    # the padding repeats the start of that order.
    order: list[int | None] = [None] * (world * per_rank)
    for r, res in enumerate(results):
        for k, i in enumerate(flat(res["epochs"][str(epoch)])):
            order[r + world * k] = i
    if not drop_last:
        assert sorted(order[:n]) == list(range(n)), "first N positions are not a permutation"
        assert order[n:] == order[: total - n], f"padding {order[n:]} does not repeat {order[: total - n]}"
    if drop_last:
        assert max(counts.values()) == 1, f"duplicates with drop_last: {[i for i, c in counts.items() if c > 1]}"
        assert sum(counts.values()) == world * nb * BATCH
        assert set(counts) <= set(range(n))
    else:
        pad = total - n
        assert sum(counts.values()) == total
        assert set(counts) == set(range(n)), f"missing: {sorted(set(range(n)) - set(counts))}"
        assert sorted(Counter(counts.values()).items()) == sorted(
            ({1: n - pad, 2: pad} if pad else {1: n}).items()
        ), f"padding: {sorted(i for i, c in counts.items() if c > 1)} (expected {pad} repeats)"


@pytest.mark.parametrize("dataset", ["adhoc", "named"])
def test_shuffled_exactly_once_across_ranks(start_daemon, data, run_ranks, dataset) -> None:
    d = start_daemon(datasets={"train": data})
    ds = data if dataset == "adhoc" else "train"
    kwargs = dict(batch_size=BATCH, shuffle=True, seed=7, drop_last=False)
    first = run_ranks(data, ds, rank_args(d.socket), epochs=[0, 1], **kwargs)
    for epoch in (0, 1):
        check_epoch_cover(first, epoch, data.n, drop_last=False)

    # A new permutation each epoch, and not the identity.
    for r, res in enumerate(first):
        assert res["epochs"]["0"] != res["epochs"]["1"], f"rank {r}: epoch 0 and 1 in the same order"
        assert flat(res["epochs"]["0"]) != unshuffled_rank_order(data.n, WORLD, r, False)

    # Same seed: the same order in a second, independent run of every rank.
    second = run_ranks(data, ds, rank_args(d.socket), epochs=[0, 1], **kwargs)
    for r in range(WORLD):
        assert second[r]["epochs"] == first[r]["epochs"], f"rank {r}: order differs between runs"

    # Another seed: another order.
    other = run_ranks(data, ds, rank_args(d.socket)[:1], epochs=[0], **{**kwargs, "seed": 8})
    assert other[0]["epochs"]["0"] != first[0]["epochs"]["0"]


@pytest.mark.parametrize("shuffle", [True, False])
def test_drop_last(start_daemon, data, run_ranks, shuffle) -> None:
    d = start_daemon(datasets={"train": data})
    results = run_ranks(
        data, "train", rank_args(d.socket), epochs=[0, 1],
        batch_size=BATCH, shuffle=shuffle, seed=3, drop_last=True,
    )
    for epoch in (0, 1):
        check_epoch_cover(results, epoch, data.n, drop_last=True)
    if not shuffle:
        _, _, nb = shard_sizes(data.n, WORLD, BATCH, True)
        for r, res in enumerate(results):
            expected = unshuffled_rank_order(data.n, WORLD, r, True)[: nb * BATCH]
            assert flat(res["epochs"]["0"]) == expected
            assert flat(res["epochs"]["1"]) == expected


@pytest.mark.parametrize("dataset", ["adhoc", "named"])
def test_unshuffled_exact_order(start_daemon, data, run_ranks, dataset) -> None:
    d = start_daemon(datasets={"train": data})
    ds = data if dataset == "adhoc" else "train"
    results = run_ranks(
        data, ds, rank_args(d.socket), epochs=[0, 1],
        batch_size=BATCH, shuffle=False, seed=5, drop_last=False,
    )
    for r, res in enumerate(results):
        expected = unshuffled_rank_order(data.n, WORLD, r, False)
        for epoch in ("0", "1"):
            batches = res["epochs"][epoch]
            assert flat(batches) == expected, f"rank {r} epoch {epoch}"
            assert batches == [expected[i : i + BATCH] for i in range(0, len(expected), BATCH)]
    for epoch in (0, 1):
        check_epoch_cover(results, epoch, data.n, drop_last=False)


def test_padding_wraps_around_small_dataset(start_daemon, tmp_path, make_h5, run_ranks) -> None:
    """5 samples over 4 ranks: the padding repeats the start of the order and
    every rank gets one partial batch of 2."""
    small = make_h5(tmp_path / "small", lengths=(3, 2))
    d = start_daemon()
    world = 4
    results = run_ranks(
        small, small, rank_args(d.socket, world), epochs=[0],
        batch_size=BATCH, shuffle=False, drop_last=False,
    )
    for r, res in enumerate(results):
        expected = unshuffled_rank_order(small.n, world, r, False)
        assert res["len"] == 1
        assert res["epochs"]["0"] == [expected]


def test_two_daemons_two_nodes(start_daemon, data, run_ranks) -> None:
    """Ranks 0 and 1 on node A, rank 2 on node B: no coordination needed."""
    a = start_daemon(datasets={"train": data})
    b = start_daemon(datasets={"train": data})
    ranks = rank_args(a.socket)
    ranks[2]["socket"] = b.socket
    kwargs = dict(batch_size=BATCH, shuffle=True, seed=11, drop_last=False)
    results = run_ranks(data, "train", ranks, epochs=[0, 1], **kwargs)
    for epoch in (0, 1):
        check_epoch_cover(results, epoch, data.n, drop_last=False)

    # The same ranks on one node get the same shards.
    single = run_ranks(data, "train", rank_args(a.socket), epochs=[0, 1], **kwargs)
    for r in range(WORLD):
        assert single[r]["epochs"] == results[r]["epochs"]

    # Ad hoc on node B, drop_last: still disjoint.
    ranks = rank_args(a.socket)
    ranks[0]["socket"] = b.socket
    results = run_ranks(data, data, ranks, epochs=[0], **{**kwargs, "drop_last": True})
    check_epoch_cover(results, 0, data.n, drop_last=True)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "1", "WORLD_SIZE": "3"},
        {"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_STEP_ID": "0"},  # a task of `srun -n 3`
    ],
    ids=["torchrun", "slurm"],
)
def test_rank_and_socket_from_environment(start_daemon, data, run_ranks, env) -> None:
    d = start_daemon()
    results = run_ranks(
        data, data, [{}], epochs=[0], env=[{**env, "STOKER_SOCKET": d.socket}],
        batch_size=BATCH, shuffle=False,
    )
    assert flat(results[0]["epochs"]["0"]) == unshuffled_rank_order(data.n, 3, 1, False)


def test_defaults_to_single_rank(start_daemon, data, run_ranks) -> None:
    d = start_daemon()
    results = run_ranks(
        data, data, [{}], epochs=[0], env=[{"STOKER_SOCKET": d.socket}],
        batch_size=BATCH, shuffle=False,
    )
    assert flat(results[0]["epochs"]["0"]) == list(range(data.n))


def test_state_dict_resume(start_daemon, data, stoker) -> None:
    """state_dict() mid-epoch, then load_state_dict() in a new loader: the next
    iter() resumes at that step of that epoch."""
    d = start_daemon(datasets={"train": data})
    kwargs = dict(batch_size=BATCH, shuffle=True, seed=21, rank=1, world_size=WORLD, socket=d.socket)

    def labels(batch: dict[str, np.ndarray]) -> list[int]:
        return data.check_batch(batch)

    ref_loader = stoker.Loader("train", **kwargs)
    ref_loader.set_epoch(1)
    reference = [labels(b) for b in ref_loader]
    ref_loader.close()
    assert len(reference) == shard_sizes(data.n, WORLD, BATCH, False)[2]

    first = stoker.Loader("train", **kwargs)
    first.set_epoch(1)
    it = iter(first)
    consumed = [labels(next(it)) for _ in range(2)]
    assert consumed == reference[:2]
    state = first.state_dict()
    del it
    first.close()
    assert state["seed"] == 21
    assert state["epoch"] == 1
    assert state["step"] == 2

    resumed = stoker.Loader("train", **kwargs)
    resumed.load_state_dict(state)
    assert [labels(b) for b in resumed] == reference[2:]
    resumed.close()

    # The state is plain data: it resumes on another daemon too (after a
    # restart of the daemon, or on another node).
    other = start_daemon(datasets={"train": data})
    moved = stoker.Loader("train", **{**kwargs, "socket": other.socket})
    moved.load_state_dict(dict(state))
    assert [labels(b) for b in moved] == reference[2:]
    moved.close()


def test_reiterate_same_loader(start_daemon, data, stoker) -> None:
    """One loader used for several epochs (the loader stays warm); every epoch
    in one process covers each index once (world 1)."""
    d = start_daemon(depth=2)
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=0, socket=d.socket)
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        order = [i for b in loader for i in data.check_batch(b)]
        assert sorted(order) == list(range(data.n))
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 3
    loader.close()
