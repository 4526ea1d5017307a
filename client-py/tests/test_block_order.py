"""``shuffle="block"``: the locality order, through the real daemon.

Blocks of ``block_size`` consecutive samples are permuted, then samples within
windows of ``block_window`` blocks. The order must still be a permutation of
each epoch split across ranks exactly as DistributedSampler splits it, with
every value equal to h5py's (the worker processes of ``run_ranks`` compare
each field byte for byte), and the arguments are checked before anything is
sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from conftest import assert_names
from test_sharding import BATCH, WORLD, check_epoch_cover, flat, rank_args

BLOCK = 8
WINDOW = 2


def window_blocks(order: list[int], block: int, window: int) -> int:
    """How many runs of at most `window` distinct blocks the order cuts into, greedily."""
    runs, current = 0, set()
    for i in order:
        b = i // block
        if b not in current and len(current) == window:
            current = set()
        if not current:
            runs += 1
        current.add(b)
    return runs


def global_order(results: list[dict[str, Any]], epoch: int, n: int) -> list[int]:
    """The epoch's first `n` positions, put back from the ranks' shards."""
    world = len(results)
    order: list[int] = [-1] * (world * len(flat(results[0]["epochs"][str(epoch)])))
    for r, res in enumerate(results):
        for k, i in enumerate(flat(res["epochs"][str(epoch)])):
            order[r + world * k] = i
    return order[:n]


@pytest.mark.parametrize("dataset", ["adhoc", "named"])
def test_block_order_covers_every_index_once_per_epoch_across_ranks(start_daemon, data, run_ranks, dataset) -> None:
    d = start_daemon(datasets={"train": data})
    ds = data if dataset == "adhoc" else "train"
    kwargs = dict(batch_size=BATCH, shuffle="block", block_size=BLOCK, block_window=WINDOW, seed=7)
    results = run_ranks(data, ds, rank_args(d.socket), epochs=[0, 1], **kwargs)
    orders = []
    for epoch in (0, 1):
        check_epoch_cover(results, epoch, data.n, drop_last=False)
        order = global_order(results, epoch, data.n)
        assert sorted(order) == list(range(data.n))
        # Locality: the order reads one window of blocks at a time (100 rows
        # are 13 blocks, so 7 windows of 2).
        blocks = -(-data.n // BLOCK)
        assert window_blocks(order, BLOCK, WINDOW) == -(-blocks // WINDOW), order
        orders.append(order)
    # Shuffled, and differently each epoch: blocks move, rows move within windows.
    assert orders[0] != orders[1]
    assert orders[0] != list(range(data.n))
    first_blocks = [sorted({i // BLOCK for i in o[: BLOCK * WINDOW]}) for o in orders]
    assert first_blocks[0] != first_blocks[1], first_blocks
    for r, res in enumerate(results):
        assert res["epochs"]["0"] != res["epochs"]["1"], f"rank {r}: same order in epochs 0 and 1"
        assert res["state"]["shuffle"] == "block"
        assert (res["state"]["block_size"], res["state"]["block_window"]) == (BLOCK, WINDOW)

    # Deterministic in (seed, epoch): an independent second run agrees; the
    # exact shuffle with the same seed is another order.
    again = run_ranks(data, ds, rank_args(d.socket), epochs=[0, 1], **kwargs)
    for r in range(WORLD):
        assert again[r]["epochs"] == results[r]["epochs"], f"rank {r}: order differs between runs"
    exact = run_ranks(data, ds, rank_args(d.socket)[:1], epochs=[0], batch_size=BATCH, shuffle=True, seed=7)
    assert exact[0]["epochs"]["0"] != results[0]["epochs"]["0"]


def test_block_order_with_drop_last_and_a_window_wider_than_the_data(start_daemon, data, run_ranks) -> None:
    d = start_daemon()
    results = run_ranks(
        data, data, rank_args(d.socket), epochs=[3],
        batch_size=BATCH, shuffle="block", block_size=1000, block_window=1000, seed=1, drop_last=True,
    )
    check_epoch_cover(results, 3, data.n, drop_last=True)


def test_block_order_resumes_mid_epoch_from_state_dict(start_daemon, stoker, data) -> None:
    d = start_daemon(datasets={"train": data})
    kw: dict[str, Any] = dict(
        batch_size=BATCH, shuffle="block", block_size=BLOCK, block_window=3, seed=5, socket=d.socket,
    )
    reference = stoker.Loader("train", **kw)
    reference.set_epoch(2)
    whole = [np.asarray(b["label"]).astype(np.int64).tolist() for b in reference]
    reference.close()

    first = stoker.Loader("train", **kw)
    first.set_epoch(2)
    seen = []
    for i, b in enumerate(first):
        seen.append(np.asarray(b["label"]).astype(np.int64).tolist())
        if i == 4:
            break
    state = first.state_dict()
    first.close()
    assert state["step"] == 5 and state["shuffle"] == "block"

    resumed = stoker.Loader("train", **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)
    for b in resumed:
        data.check_batch(b)
        seen.append(np.asarray(b["label"]).astype(np.int64).tolist())
    assert seen == whole

    # A state from another order is refused: resuming would repeat or skip samples.
    for other in (dict(shuffle=True, block_size=None, block_window=None), dict(block_size=BLOCK + 1)):
        loader = stoker.Loader("train", **{**kw, **other})
        with pytest.raises(ValueError) as e:
            loader.load_state_dict(state)
        assert_names(str(e.value), ("shuffle", "block_size"))
        loader.close()
    resumed.close()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(shuffle="blocks", block_size=8), "shuffle"),
        (dict(shuffle="block"), "block_size"),
        (dict(shuffle="block", block_size=0), "block_size"),
        (dict(shuffle="block", block_size=-3), "block_size"),
        (dict(shuffle="block", block_size=2.5), "block_size"),
        (dict(shuffle="block", block_size=True), "block_size"),
        (dict(shuffle="block", block_size=(1 << 32) + 1), "block_size"),
        (dict(shuffle="block", block_size=8, block_window=0), "block_window"),
        (dict(shuffle="block", block_size=8, block_window=(1 << 32) + 1), "block_window"),
        (dict(shuffle=True, block_size=8), "shuffle='block'"),
        (dict(shuffle=False, block_window=2), "shuffle='block'"),
    ],
)
def test_bad_block_arguments_raise_value_error(stoker, data, kwargs, needle) -> None:
    # No daemon: the arguments are refused before anything is sent.
    with pytest.raises(ValueError) as e:
        stoker.Loader(data.spec(stoker), batch_size=4, socket="/nonexistent/stoker.sock", **kwargs)
    assert needle in str(e.value), str(e.value)


def test_daemon_checks_block_arguments_again(start_daemon, stoker, data) -> None:
    """A client that skips the Python checks (the native layer directly) is refused by the daemon."""
    from stoker._native import NativeStream

    d = start_daemon(datasets={"train": data})
    wire = ("name", "train")
    for shuffle, block, needle in [
        (True, (0, 2), "block_size 0"),
        (True, (8, 0), "block_window 0"),
        (True, ((1 << 32) + 1, 2), "block_size"),
        (False, (8, 2), "needs shuffle"),
    ]:
        with pytest.raises(stoker.StokerError) as e:
            NativeStream(d.socket, wire, 4, shuffle, 0, False, 0, 1, 0, 0, None, block)
        assert needle in str(e.value), str(e.value)
    # The daemon still serves.
    ok = NativeStream(d.socket, wire, 4, True, 0, False, 0, 1, 0, 0, None, (8, 2))
    assert ok.info()["batches_per_epoch"] == 25
    ok.close()
