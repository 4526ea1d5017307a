"""output="torch": tensors over the slot memory, ragged fields as lists,
in-place ops, a Lightning-style loop, and rank/world from torch.distributed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import SUBPROCESS_TIMEOUT_S, _clean_env  # noqa: E402
from lmdb_data import key, noise, png_of, write_env  # noqa: E402

BATCH = 8


def inside(t: Any, start: int, length: int) -> bool:
    ptr = t.data_ptr()
    return start <= ptr and ptr + t.numel() * t.element_size() <= start + length


def test_torch_output_shares_the_slot_memory_without_warnings(start_daemon, stoker, data) -> None:
    d = start_daemon()
    loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=4, socket=d.socket,
                           output="torch")
    twin = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=True, seed=4, socket=d.socket)
    start, length = loader._mapping_range()
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch, ref in zip(loader, twin):
            assert set(batch) == set(data.fields)
            for name, t in batch.items():
                assert isinstance(t, torch.Tensor) and t.device.type == "cpu"
                assert inside(t, start, length), f"{name} was copied out of the slot"
                assert np.array_equal(t.numpy(), ref[name])
            idx = batch["label"].long()
            assert torch.equal(batch["x"], torch.from_numpy(data.ref["x"][idx.numpy()]))
            seen += idx.tolist()
    assert not caught, [str(w.message) for w in caught]
    assert sorted(seen) == list(range(data.n))


def test_torch_tensors_share_memory_with_the_numpy_view(start_daemon, stoker, data) -> None:
    """`tensor.data_ptr()` is exactly the address numpy would give (no copy)."""
    d = start_daemon()
    np_loader = stoker.Loader(data.spec(stoker), batch_size=BATCH, shuffle=False, socket=d.socket)
    batch = next(iter(np_loader))
    arrays = {k: v for k, v in batch.items()}
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    for k in arrays:
        assert tensors[k].data_ptr() == arrays[k].__array_interface__["data"][0]


def test_in_place_ops_change_only_this_batch(start_daemon, stoker, data) -> None:
    """`x.sub_(mean).div_(std)` and friends on a batch: no crash, the values
    change here, and neither a later pass nor another client sees it."""
    d = start_daemon(depth=4)
    kw = dict(batch_size=BATCH, shuffle=False, socket=d.socket)
    loader = stoker.Loader(data.spec(stoker), output="torch", **kw)
    other = stoker.Loader(data.spec(stoker), **kw)
    for step, batch in enumerate(loader):
        x, y, label = batch["x"], batch["y"], batch["label"]
        before = x.clone()
        x.sub_(0.5).div_(2.0).clamp_(-1, 1)
        y.mul_(3)
        label.add_(1000)
        assert torch.allclose(x, ((before - 0.5) / 2.0).clamp(-1, 1))
        lo = step * BATCH
        assert label.tolist() == [i + 1000 for i in range(lo, min(lo + BATCH, data.n))]
    # Other clients and later passes read the daemon's values.
    assert [int(i) for b in other for i in b["label"]] == list(range(data.n))
    labels, xs = [], []
    for b in loader:
        labels += b["label"].tolist()
        xs.append(b["x"].clone())
    assert labels == list(range(data.n))
    assert np.array_equal(torch.cat(xs).numpy(), data.ref["x"])


def test_ragged_fields_are_lists_of_tensors(start_daemon, stoker, tmp_path) -> None:
    n = 10
    images = {i: noise(6 + i % 3, 8 + i % 4, 3, seed=i) for i in range(n)}
    env = write_env(tmp_path / "img", {key(i): png_of(images[i]) for i in range(n)})
    d = start_daemon()
    loader = stoker.Loader(stoker.lmdb(env, fields={"img": "png"}), batch_size=4, shuffle=False,
                           socket=d.socket, output="torch")
    start, length = loader._mapping_range()
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in loader:
            assert isinstance(batch["img"], list)
            for t in batch["img"]:
                assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8
                assert inside(t, start, length)
                got.append(t.clone())
    assert not caught, [str(w.message) for w in caught]
    assert len(got) == n
    for i, t in enumerate(got):
        assert np.array_equal(t.numpy(), images[i])


class DataModule:
    """The shape of a LightningDataModule whose train_dataloader returns a stoker loader."""

    def __init__(self, stoker: Any, spec: Any, socket: str) -> None:
        self.stoker, self.spec, self.socket = stoker, spec, socket

    def train_dataloader(self) -> Any:
        return self.stoker.Loader(self.spec, batch_size=BATCH, shuffle=True, seed=7, socket=self.socket,
                                  output="torch")


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """What Lightning's fit loop does each epoch (lightning.fabric.utilities.data._set_sampler_epoch):
    call set_epoch on dataloader.sampler and dataloader.batch_sampler.sampler, where present."""
    objects = {}
    if (sampler := getattr(dataloader, "sampler", None)) is not None:
        objects[id(sampler)] = sampler
    if (bs := getattr(dataloader, "batch_sampler", None)) is not None and (s := getattr(bs, "sampler", None)):
        objects[id(s)] = s
    for obj in objects.values():
        if callable(getattr(obj, "set_epoch", None)):
            obj.set_epoch(epoch)


def test_lightning_style_fit_loop(start_daemon, stoker, data) -> None:
    d = start_daemon()
    dm = DataModule(stoker, data.spec(stoker), d.socket)
    dl = dm.train_dataloader()
    assert dl.sampler.num_replicas == 1 and dl.sampler.shuffle
    model = torch.nn.Linear(12, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mean, std = torch.tensor(0.1), torch.tensor(1.3)
    orders = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            set_sampler_epoch(dl, epoch)
            assert dl.sampler.epoch == epoch
            n_batches = len(dl)
            seen = []
            for step, batch in enumerate(dl):  # noqa: B007 - the count is checked after the loop
                x = batch["x"].to(device="cpu", non_blocking=True)
                x.sub_(mean).div_(std)
                y = batch["y"].to(device="cpu", non_blocking=True).float()
                loss = torch.nn.functional.mse_loss(model(x.flatten(1)).squeeze(1), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                seen += batch["label"].tolist()
            assert step + 1 == n_batches
            assert sorted(seen) == list(range(data.n))
            orders.append(seen)
    assert not caught, [str(w.message) for w in caught]
    assert orders[0] != orders[1] != orders[2], "set_epoch through the sampler must change the order"
    # Lightning checkpoints the loader's state like a StatefulDataLoader's.
    state = dl.state_dict()
    assert state["epoch"] == 2 and state["_num_yielded"] == len(dl)


DIST_SRC = r"""
import json, os, sys
import torch.distributed as dist
import stoker
a = json.loads(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + a["store"], rank=a["rank"], world_size=2)
# RANK/WORLD_SIZE in the environment disagree on purpose: the process group wins.
loader = stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=4, shuffle=False,
                       socket=a["socket"])
labels = [int(i) for b in loader for i in b["label"]]
print(json.dumps({"rank": loader.rank, "world": loader.world_size, "source": loader.rank_source,
                  "labels": labels}))
dist.destroy_process_group()
"""


def test_rank_and_world_from_an_initialised_process_group(start_daemon, data, tmp_path) -> None:
    d = start_daemon()
    store = tmp_path / "store"
    procs = []
    for rank in range(2):
        args = {"glob": data.glob, "fields": data.fields, "socket": d.socket, "rank": rank, "store": str(store)}
        procs.append(subprocess.Popen(
            [sys.executable, "-c", DIST_SRC, json.dumps(args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=_clean_env({"RANK": "0", "WORLD_SIZE": "1"}),
        ))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for rank, o in enumerate(outs):
        assert (o["rank"], o["world"], o["source"]) == (rank, 2, "torch.distributed")
        assert o["labels"] == list(range(data.n))[rank::2]


def test_torch_multiprocessing_spawn_uses_a_pickled_loader(start_daemon, data, tmp_path) -> None:
    d = start_daemon()
    script = tmp_path / "tmp_spawn.py"
    script.write_text(textwrap.dedent(
        r"""
        import json, sys
        import torch.multiprocessing as mp
        import stoker

        def work(i, loader, out):
            loader.set_epoch(1)
            labels = [int(v) for b in loader for v in b["label"]]
            with open(f"{out}.{i}", "w") as f:
                json.dump({"labels": labels, "len": len(loader)}, f)

        if __name__ == "__main__":
            a = json.loads(sys.argv[1])
            loader = stoker.Loader(stoker.hdf5(a["glob"], fields=a["fields"]), batch_size=4, seed=3,
                                   rank=0, world_size=1, socket=a["socket"], output="torch")
            loader.set_epoch(1)
            mine = [int(v) for b in loader for v in b["label"]]
            mp.spawn(work, args=(loader, a["out"]), nprocs=2)
            print(json.dumps(mine))
        """
    ))
    out = tmp_path / "spawned"
    args = {"glob": data.glob, "fields": data.fields, "socket": d.socket, "out": str(out)}
    res = subprocess.run([sys.executable, str(script), json.dumps(args)], capture_output=True, text=True,
                         timeout=SUBPROCESS_TIMEOUT_S, env=_clean_env(None))
    assert res.returncode == 0, res.stderr
    mine = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(mine) == list(range(data.n))
    for i in range(2):
        got = json.loads((tmp_path / f"spawned.{i}").read_text())
        assert got["labels"] == mine and got["len"] == -(-data.n // 4)
