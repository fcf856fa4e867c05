"""DataParallel over gloo on the CPU: the error without torch.distributed, a one-rank group, and one two-process
run of each collective against values computed by hand (the full training runs are in tests/hf/test_ddp.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lazytrain_hf.streaming.comm import DataParallel

CPU = torch.device("cpu")


@pytest.fixture
def one_rank(tmp_path):
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_needs_torch_distributed():
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialized in this process")
    with pytest.raises(RuntimeError, match="torchrun"):
        DataParallel(CPU)
    assert DataParallel.from_env(CPU) is None


def test_one_rank_group(one_rank):
    assert DataParallel.from_env(CPU) is None  # a single process trains without data parallelism
    dp = DataParallel(CPU)
    assert (dp.rank, dp.world, dp.backend, dp.async_device) == (0, 1, "gloo", False)
    a, b = torch.randn(5), torch.randn(2, 3, dtype=torch.bfloat16)
    want = [a.clone(), b.clone()]
    dp.all_reduce_([a, b])
    dp.reduce_([a, b], 0)
    dp.broadcast_([a, b], 0)
    dp.broadcast_device_([a, b], 0)
    assert torch.equal(a, want[0]) and torch.equal(b, want[1])
    objs = [{"k": 1}]
    dp.broadcast_object_(objs, 0)
    assert objs == [{"k": 1}]


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        dp = DataParallel.from_env(CPU)
        res = {"rank": dp.rank, "world": dp.world}
        x = torch.arange(4, dtype=torch.float32) * (rank + 1)
        dp.all_reduce_([x])
        res["all_reduce"] = x
        y = torch.full((3,), float(rank + 2))
        dp.reduce_([y], 1)
        res["reduce"] = y
        z = torch.full((2,), float(rank))
        dp.broadcast_([z], 1)
        res["broadcast"] = z
        w = torch.full((2,), float(rank + 5), dtype=torch.bfloat16)
        dp.broadcast_device_([w], 0)
        res["broadcast_device"] = w
        objs = [None if rank == 0 else {"from": rank}]
        dp.broadcast_object_(objs, 1)
        res["object"] = objs[0]
        torch.save(res, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_ranks(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(f"file://{tmp_path / 'init'}", out), nprocs=2, join=True)
    res = [torch.load(f"{out}.{r}") for r in range(2)]
    base = torch.arange(4, dtype=torch.float32)
    for r, got in enumerate(res):
        assert (got["rank"], got["world"]) == (r, 2)
        assert torch.equal(got["all_reduce"], base * 1 + base * 2)
        assert torch.equal(got["broadcast"], torch.full((2,), 1.0))
        assert torch.equal(got["broadcast_device"], torch.full((2,), 5.0, dtype=torch.bfloat16))
        assert got["object"] == {"from": 1}
    assert torch.equal(res[1]["reduce"], torch.full((3,), 2.0 + 3.0))  # the destination holds the sum
