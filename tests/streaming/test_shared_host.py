"""One host copy of the streamed weights for the ranks of a host (streaming/shared_host.py): two gloo processes
train a widened tiny Qwen3 (bf16, 100 MB of layer weights) with sharded updates, once sharing the copy and once each
with its own; the results are bit for bit the same, and each process's memory falls by the weights as the planner
counts it. The /dev/shm check, the layout and the CUDA registration path (a stand-in cudart) run here too; the
Trainer-level exactness against one process is in tests/hf/test_ddp.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lazytrain_hf.profiling.limits import ResourceLimitError
from lazytrain_hf.streaming import shared_host
from lazytrain_hf.streaming.nvme import ALIGN

from ..conftest import random_batch

#: qwen3-tiny widened so the layers' weights (51 M parameters, 100 MB in bf16) stand far above the noise of a
#: process's memory (python, torch, transformers: hundreds of MB; its heap moved by up to 10 MB between runs)
WIDE = dict(hidden_size=256, intermediate_size=8192, num_hidden_layers=8)


def _smaps() -> dict[str, dict[str, int]]:
    """This process's memory in bytes: "process" (smaps_rollup) and "segment" (the shared copy's mapping, summed
    over its entries; empty when there is none), each {Rss, Pss, Private}."""
    def fields(lines: list[str]) -> dict[str, int]:
        out = {"Rss": 0, "Pss": 0, "Private": 0}
        for line in lines:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key] += int(rest.split()[0]) * 1024
            elif key in ("Private_Clean", "Private_Dirty"):
                out["Private"] += int(rest.split()[0]) * 1024
        return out

    with open("/proc/self/smaps_rollup") as f:
        process = fields(f.read().splitlines())
    segment_lines, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not line[0].isupper():  # a mapping's header line
                inside = "lazytrain-weights-" in line
            elif inside:
                segment_lines.append(line)
    return {"process": process, "segment": fields(segment_lines)}


class _FakeCudart:
    """cudaHostRegister / cudaHostUnregister stand-ins that record (pointer, bytes) and succeed."""

    def __init__(self, log: list) -> None:
        self.log = log

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the CUDA runtime's name
        self.log.append(("register", ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.log.append(("unregister", ptr))
        return 0


def _train(rank: int, init: str, out: str, mode: str, world: int = 2, hosts: int = 1, wide: dict = WIDE) -> None:
    """Two optimizer steps of `world` ranks; `hosts` > 1: the ranks pretend to run on that many hosts (one shared
    copy per pretended host, each a file of its own in this machine's /dev/shm)."""
    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.models import load_model
    from lazytrain_hf.optim import Hybrid8bitOptimizer
    from lazytrain_hf.streaming.executor import StreamingExecutor

    torch.set_num_threads(1)
    if hosts > 1:
        shared_host._host_key = lambda: f"host{rank * hosts // world}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = load_model("qwen3-tiny", "bfloat16", seed=rank, **wide)  # rank 0's weights must win
        cfg = LazyTrainConfig(device="cpu", dp_host_weights=mode, state_dtype="fp32", master_weights="none",
                              checkpoint_every=2)
        ex = StreamingExecutor(model, cfg, "cpu", host_grad_dtype="param")
        opt = Hybrid8bitOptimizer(model.parameters(), lr=1e-3, weight_decay=0.1, state_dtype="fp32",
                                  master_weights="none")
        opt.set_grad_source(ex.grad_source)
        opt.set_state_allocator(ex.state_alloc)
        ex.attach_optimizer(opt)
        norms = []
        for step in range(2):
            ids, mask, labels = random_batch(model.config.vocab_size, B=2, T=16, seed=10 * step + rank)
            tokens = (labels[:, 1:] != -100).sum().double()
            dist.all_reduce(tokens)  # the global batch's token count: gradients are summed over the ranks
            ex.zero_grad()
            ex.forward_backward(ids, labels, mask, denominator=float(tokens))
            norms.append(float(opt.clip_grad_norm(0.5, ex.grad_norm())))
            opt.step()
        ex.flush_updates()  # every owner's update landed, in every rank's weights
        layers = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("model.layers.")}
        mem = _smaps()
        torch.save({"params": layers, "norms": norms, "memory": mem, "weight_ranks": ex.store.weight_ranks,
                    "one_host": ex.host_share.host.one_host if ex.host_share is not None else None,
                    "weight_bytes": ex.store.param_bytes, "store": ex.pinned_bytes["store"],
                    "segment_bytes": ex.host_share.nbytes if ex.host_share is not None else 0,
                    "config": model.config.to_dict()}, f"{out}.{mode}.{rank}")
        ex.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shared_host")
    out = str(tmp / "res")
    for i, mode in enumerate(("per_rank", "shared")):
        mp.spawn(_train, args=(f"file://{tmp / f'init{i}'}", out, mode), nprocs=2, join=True)
    return {mode: [torch.load(f"{out}.{mode}.{r}") for r in (0, 1)] for mode in ("per_rank", "shared")}


def test_shared_copy_trains_bit_for_bit_like_own_copies(runs):
    own, shared = runs["per_rank"], runs["shared"]
    assert [r["weight_ranks"] for r in own] == [1, 1] and [r["weight_ranks"] for r in shared] == [2, 2]
    for res in (*own, *shared):
        assert res["norms"] == own[0]["norms"] and res["norms"][0] > 0.5  # the same global norm; clipped
        for name, want in own[0]["params"].items():
            assert torch.equal(res["params"][name], want), name
    from lazytrain_hf.models import load_model

    start = dict(load_model("qwen3-tiny", "bfloat16", seed=0, **WIDE).named_parameters())
    assert all(not torch.equal(start[n], p) for n, p in own[0]["params"].items() if p.dim() > 1)  # trained


def test_each_rank_holds_half_the_weights_as_planned(runs):
    """The store's accounting gives each rank half of the weights; the process's private memory falls by the
    weights; the shared mapping is resident in both processes with no private page, and its proportional share (Pss)
    is half of it in each (the copy counted once over the host; the process's whole Pss also counts shared libraries,
    which moves with the other processes on the machine); the planner's host bytes per rank fall by the same half of
    the weights."""
    from transformers import AutoConfig

    from lazytrain_hf.profiling.analytic import analytic_cost_model

    own, shared = runs["per_rank"], runs["shared"]
    weights = own[0]["weight_bytes"]
    assert weights > 96 << 20 and all(r["weight_bytes"] == weights for r in (*own, *shared))
    for a, b in zip(own, shared):
        assert a["store"] - b["store"] == weights // 2
        seg = b["memory"]["segment"]
        assert seg["Rss"] == b["segment_bytes"] >= weights and seg["Private"] == 0
        assert abs(seg["Pss"] - b["segment_bytes"] / 2) <= 2 * ALIGN * len(a["params"])
        assert a["memory"]["segment"]["Rss"] == 0  # no shared copy there
        assert a["memory"]["process"]["Private"] - b["memory"]["process"]["Private"] >= 0.75 * weights  # ~1
    config = AutoConfig.for_model(**own[0]["config"])
    host = {r: analytic_cost_model(config, 2, 16, gpu_bytes=1 << 40, host_bytes=1 << 40,
                                   host_weight_ranks=r).host_fixed_bytes for r in (1, 2)}
    assert host[1] - host[2] == weights // 2  # bf16 weights, as the cost model prices them


def test_one_copy_per_host_over_several_hosts_trains_like_own_copies(tmp_path):
    """Four ranks pretending to be two hosts of two: each host's writer receives rank 0's weights into its host's
    copy (the writers' group), flushes broadcast between the hosts' copies; bit for bit as four own copies."""
    out = str(tmp_path / "res")
    for i, (mode, hosts) in enumerate((("per_rank", 1), ("shared", 2))):
        mp.spawn(_train, args=(f"file://{tmp_path / f'init{i}'}", out, mode, 4, hosts, {}), nprocs=4, join=True)
    own = [torch.load(f"{out}.per_rank.{r}") for r in range(4)]
    shared = [torch.load(f"{out}.shared.{r}") for r in range(4)]
    assert [r["weight_ranks"] for r in shared] == [2] * 4 and [r["one_host"] for r in shared] == [False] * 4
    for res in (*own, *shared):
        assert res["norms"] == own[0]["norms"]
        for name, want in own[0]["params"].items():
            assert torch.equal(res["params"][name], want), name


def test_shm_too_small_is_one_error_naming_need_limit_and_fix(monkeypatch):
    monkeypatch.setattr(shared_host.shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=64 << 20, used=4 << 20, free=60 << 20))
    with pytest.raises(ResourceLimitError) as e:
        shared_host.check_shm_space(1 << 30, 2)
    msg = str(e.value)
    for part in ("needs 1.00 GiB", "0.06 GiB (free space of /dev/shm", "--shm-size=2g", "dp_host_weights='per_rank'"):
        assert part in msg, msg
    assert e.value.need_bytes == 1 << 30 and e.value.limit.bytes == 60 << 20
    shared_host.check_shm_space(50 << 20, 2)  # fits: no error


def test_segment_layout_puts_every_buffer_on_its_own_pages():
    sizes = [{torch.bfloat16: 3, torch.float32: 1025}, {torch.bfloat16: 2048}]
    assert shared_host.segment_bytes(sizes) == ALIGN + 2 * ALIGN + ALIGN


def _map_pinned(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        log: list = []
        torch.cuda.cudart = lambda: _FakeCudart(log)  # this process only
        share = shared_host.SharedHostWeights(shared_host.host_ranks(), pin=True)
        bufs = share.allocate([{torch.float32: 1000}, {torch.bfloat16: 3000}])
        if share.writes_initial:
            bufs[1][torch.bfloat16].fill_(7)
        share.published()
        seen = float(bufs[1][torch.bfloat16].float().sum())
        registered = share.registered_bytes
        share.release()
        torch.save({"log": log, "ptr": bufs[0][torch.float32].data_ptr(), "nbytes": share.nbytes, "seen": seen,
                    "registered": registered, "file_left": os.path.exists(share.path)}, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_each_process_registers_the_whole_mapping_once_and_sees_the_writer(tmp_path):
    """CUDA's path on a CPU machine (cudart stood in): each rank page-locks the whole mapping in place, once, and
    unregisters it at release; a value the writer stores is what the other rank reads after `published`; the file is
    gone from /dev/shm once both mapped it."""
    out = str(tmp_path / "res")
    mp.spawn(_map_pinned, args=(f"file://{tmp_path / 'init'}", out), nprocs=2, join=True)
    for r in (0, 1):
        res = torch.load(f"{out}.{r}")
        assert res["nbytes"] == 4096 + 8192 and res["registered"] == res["nbytes"]
        assert res["log"] == [("register", res["ptr"], res["nbytes"]), ("unregister", res["ptr"])]
        assert res["seen"] == 7 * 3000
        assert not res["file_left"]


def _too_small(rank: int, init: str, out: str) -> None:
    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.models import load_model
    from lazytrain_hf.streaming.executor import StreamingExecutor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        if rank == 0:  # only the writer looks: the others must still raise, not wait for a file that never comes
            shared_host.shutil.disk_usage = lambda path: SimpleNamespace(total=64 << 20, used=64 << 20, free=0)
        model = load_model("qwen3-tiny", "float32", seed=0)
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        try:
            StreamingExecutor(model, LazyTrainConfig(device="cpu"), "cpu")
            res = {"error": None}
        except ResourceLimitError as e:
            res = {"error": str(e), "moved": [n for n, p in model.named_parameters() if p.data_ptr() != before[n]]}
        res["files"] = [f for f in os.listdir(shared_host.SHM_DIR) if f.startswith(f"lazytrain-weights-{os.getpid()}")]
        torch.save(res, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_full_dev_shm_fails_every_rank_with_the_writers_error_before_allocating(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_too_small, args=(f"file://{tmp_path / 'init'}", out), nprocs=2, join=True)
    res = [torch.load(f"{out}.{r}") for r in (0, 1)]
    assert res[0]["error"] is not None and res[1]["error"] == res[0]["error"]
    assert "needs" in res[0]["error"] and "--shm-size" in res[0]["error"]
    assert res[0]["moved"] == res[1]["moved"] == [] and res[0]["files"] == res[1]["files"] == []
