"""Data parallel LazyTrainer (2 processes, gloo on CPU) equals single-process training at the same global batch,
with replicated and with sharded optimizer updates (lazytrain_config.dp_updates), and with sharded updates over one
host copy of the weights for both ranks (lazytrain_config.dp_host_weights, streaming/shared_host.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ddp_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], tmp: Path) -> None:
    # the checkout under test first: an editable install elsewhere (another worktree) must not be what runs
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ddp")
    _run([sys.executable, str(WORKER), "--out", str(tmp / "one"), "--per-device-batch", "4", "--ga", "1,2,2n"], tmp)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
          "--out", str(tmp / "two"), "--per-device-batch", "2"], tmp)
    return tmp


def _load(runs: Path, which: str, rank: int, ga: int | str) -> dict:
    return torch.load(runs / which / f"rank{rank}_ga{ga}.pt")


@pytest.mark.parametrize("ga, tol", [
    (1, 1e-6),
    # With accumulation the resident gradients (embedding, norm, lm_head) are summed per rank over the window and
    # then across ranks (DDP's no_sync order), not micro-batch by micro-batch: fp32 rounding differs at ~1e-7 and
    # Adam's per-element normalization lifts that to ~2e-6 of a weight after 3 steps at lr 1e-3.
    (2, 5e-6),
])
def test_two_ranks_equal_one_process(runs: Path, ga: int | str, tol: float) -> None:
    one, two, two_b = _load(runs, "one", 0, ga), _load(runs, "two", 0, ga), _load(runs, "two", 1, ga)
    assert one["world"] == 1 and two["world"] == 2
    for name, ref in one["params"].items():
        got = two["params"][name]
        assert torch.equal(got, two_b["params"][name]), f"{name}: the two ranks' replicas differ"
        rel = ((got - ref).norm() / ref.norm()).item()
        assert rel <= tol, f"{name}: 2-process vs 1-process relative difference {rel:.2e} > {tol}"
        assert (got - ref).abs().max().item() <= 10 * tol, name
    # something was trained, clipping was active, and the logged loss / grad_norm are the global ones
    assert len(one["logs"]) == len(two["logs"]) == 3
    assert any(h["grad_norm"] > 0.5 for h in one["logs"])
    for a, b in zip(one["logs"], two["logs"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    moved = max((one["params"][k] - _initial()[k]).abs().max().item() for k in one["params"])
    assert moved > 1e-4


def test_per_rank_token_average_equals_stock_ddp(runs: Path) -> None:
    """average_tokens_across_devices=False: each rank's loss is its own token mean and DDP averages the ranks (not
    the 1-process result when ranks hold different token counts); LazyTrainer equals the stock Trainer's DDP."""
    lazy, stock = _load(runs, "two", 0, "2n"), _load(runs, "two", 0, "2ns")
    assert lazy["world"] == stock["world"] == 2
    for name, ref in stock["params"].items():
        assert ((lazy["params"][name] - ref).norm() / ref.norm()).item() <= 1e-5, name
    for a, b in zip(stock["logs"], lazy["logs"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    one = _load(runs, "one", 0, "2n")  # and it does differ from one process here: the check can fail
    assert any(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(one["logs"], lazy["logs"]))


# ---- sharded optimizer updates (dp_updates="sharded", streaming/shard.py) ---------------------------------------
SHARDED_HYBRID = ["--ga", "2", "--arch", "qwen3.5-tiny", "--gpu-updates", "--save-resume"]


@pytest.fixture(scope="module")
def sharded(runs: Path) -> Path:
    """Next to `runs`: 2 ranks sharded (qwen3-tiny, accumulation 1 and 2), each with its own host copy of the weights
    ("sh") and with one copy for both (the default, "shs"); the hybrid Qwen3.5 text model with accumulation 2,
    layers 1-2 updated GPU-side (the same code path on the CPU) and a checkpoint at step 2 resumed by a second trainer,
    in one process and in 2 sharded ranks sharing one host copy."""
    tmp = runs
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER)]
    _run(torchrun + ["--out", str(tmp / "sh"), "--per-device-batch", "2", "--ga", "1,2", "--dp-updates", "sharded",
                     "--host-weights", "per_rank"], tmp)
    _run(torchrun + ["--out", str(tmp / "shs"), "--per-device-batch", "2", "--ga", "1,2", "--dp-updates", "sharded"],
         tmp)
    _run([sys.executable, str(WORKER), "--out", str(tmp / "one35"), "--per-device-batch", "4", *SHARDED_HYBRID], tmp)
    _run(torchrun + ["--out", str(tmp / "sh35"), "--per-device-batch", "2", "--dp-updates", "sharded",
                     *SHARDED_HYBRID], tmp)
    return tmp


def _check_equal(ref: dict, r0: dict, r1: dict, tol: float) -> None:
    """Both ranks hold identical weights within `tol` (relative, 10 x tol absolute) of `ref`; the logged loss and
    (pre-clip) grad_norm equal ref's within 1e-5 relative, with clipping active."""
    for name, want in ref["params"].items():
        got = r0["params"][name]
        assert torch.equal(got, r1["params"][name]), f"{name}: the two ranks' weights differ"
        rel = ((got - want).norm() / want.norm()).item()
        assert rel <= tol, f"{name}: relative difference {rel:.2e} > {tol}"
        assert (got - want).abs().max().item() <= 10 * tol, name
    assert len(ref["logs"]) == len(r0["logs"]) == 3
    assert any(h["grad_norm"] > 0.5 for h in ref["logs"])  # max_grad_norm 0.5: clipped
    for a, b in zip(ref["logs"], r0["logs"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("ga, tol", [(1, 1e-6), (2, 5e-6)])  # ga 2: see test_two_ranks_equal_one_process
def test_sharded_equals_one_process_and_replicated(sharded: Path, ga: int, tol: float) -> None:
    r0, r1 = _load(sharded, "sh", 0, ga), _load(sharded, "sh", 1, ga)
    assert r0["world"] == 2 and r0["broadcasts"] > 0
    _check_equal(_load(sharded, "one", 0, ga), r0, r1, tol)
    # the same reductions of the same two numbers as the replicated mode: equal to fp32 rounding
    _check_equal(_load(sharded, "two", 0, ga), r0, r1, 1e-6)


@pytest.mark.parametrize("ga", [1, 2])
def test_sharded_rank_skips_non_owned_work(sharded: Path, ga: int) -> None:
    """Each rank keeps optimizer states for, and copies D2H the gradients of, its own half of the layers only (the
    tiny model's layers are equal in size; its resident parts stay on the device, outside both counts)."""
    replicated = _load(sharded, "two", 0, ga)
    for rank in (0, 1):
        got = _load(sharded, "sh", rank, ga)
        assert got["state_bytes"] == replicated["state_bytes"] // 2 > 0
        assert got["d2h_grad_bytes"] == replicated["d2h_grad_bytes"] // 2 > 0
    if ga == 1:  # the last step's forward received the other rank's layers instead of loading them
        assert _load(sharded, "sh", 0, 1)["h2d_weight_bytes"] < replicated["h2d_weight_bytes"]


@pytest.mark.parametrize("ga", [1, 2])
def test_shared_host_copy_equals_own_copies_bit_for_bit(sharded: Path, ga: int) -> None:
    """One host copy of the weights for both ranks (the default on a host with two ranks) trains exactly as each rank
    with its own copy: bit for bit the same weights, losses and norms; and so within fp32 rounding of one process
    (gradient clipping active). Each rank then holds half of the weights' bytes (the store's accounting: the copy
    counted once for the host), and the plan's host bytes per rank fall by half the (bf16, as planned) weights."""
    own = [_load(sharded, "sh", r, ga) for r in (0, 1)]
    shared = [_load(sharded, "shs", r, ga) for r in (0, 1)]
    assert [r["weight_ranks"] for r in own] == [1, 1] and [r["weight_ranks"] for r in shared] == [2, 2]
    for a, b in zip(own, shared):
        for name, want in a["params"].items():
            assert torch.equal(b["params"][name], want), name
        assert [(h["loss"], h["grad_norm"]) for h in a["logs"]] == [(h["loss"], h["grad_norm"]) for h in b["logs"]]
    _check_equal(_load(sharded, "one", 0, ga), shared[0], shared[1], 1e-6 if ga == 1 else 5e-6)
    weights = own[0]["weight_bytes"]
    layers = sum(p.numel() for n, p in _initial().items() if n.startswith("model.layers."))
    assert weights == 4 * layers  # fp32 weights
    for a, b in zip(own, shared):
        assert b["weight_bytes"] == weights and a["store_bytes"] - b["store_bytes"] == weights // 2
        assert a["planned_host_bytes"] - b["planned_host_bytes"] == 2 * layers // 2  # bf16 in the cost model


def test_sharded_hybrid_gpu_updates_accumulation_save_resume(sharded: Path) -> None:
    """Qwen3.5 (linear- and full-attention layers), GPU-side layer updates, accumulation 2, save at step 2 + resume,
    over one host copy of the weights for both ranks: equal to one process; the checkpoint's optimizer.pt holds every layer's states (gathered from the owners) and
    equals the one-process file; after the resume each rank holds exactly the states it had at the save (its own
    layers and the resident parts) and ends where the uninterrupted run ended."""
    one, r0, r1 = _load(sharded, "one35", 0, 2), _load(sharded, "sh35", 0, 2), _load(sharded, "sh35", 1, 2)
    assert r0["weight_ranks"] == r1["weight_ranks"] == 2  # over the one shared host copy (the default)
    _check_equal(one, r0, r1, 5e-6)
    ref = torch.load(sharded / "one35" / "run2" / "checkpoint-2" / "optimizer.pt")
    got = torch.load(sharded / "sh35" / "run2" / "checkpoint-2" / "optimizer.pt")
    assert got["param_groups"] == ref["param_groups"] and got["state"].keys() == ref["state"].keys()
    for idx, st in ref["state"].items():
        for key, want in st.items():
            have = got["state"][idx][key]
            if torch.is_tensor(want):
                assert (have - want).abs().max().item() <= 1e-6, (idx, key)
            else:
                assert have == want, (idx, key)
    layers = {}
    for rank, res in ((0, r0), (1, r1)):
        saved, loaded = res["state_at_save"], res["state_after_load"]
        assert saved.keys() == loaded.keys()
        for name, st in saved.items():
            for key, v in st.items():
                assert torch.equal(v, loaded[name][key]) if torch.is_tensor(v) else v == loaded[name][key], name
        layers[rank] = {int(n.split(".")[2]) for n in saved if n.startswith("model.layers.")}
        assert layers[rank] == {i for i in range(4) if i % 2 == rank}
        assert res["resumed_state_bytes"] == res["state_bytes"]
        for name, want in res["params"].items():
            assert torch.equal(res["resumed"][name], want), name


def test_dp_updates_config() -> None:
    from lazytrain_hf.config import LazyTrainConfig

    assert LazyTrainConfig().dp_updates == "auto" and LazyTrainConfig().resolved_dp_updates() == "sharded"
    assert LazyTrainConfig(overlap_optimizer=False).resolved_dp_updates() == "replicated"
    assert LazyTrainConfig(dp_updates="replicated").resolved_dp_updates() == "replicated"
    assert LazyTrainConfig(dp_updates="Sharded").dp_updates == "sharded"
    with pytest.raises(ValueError, match=r"dp_updates must be one of \['auto', 'replicated', 'sharded'\]"):
        LazyTrainConfig(dp_updates="zero")
    with pytest.raises(ValueError, match="needs overlap_optimizer=True"):
        LazyTrainConfig(dp_updates="sharded", overlap_optimizer=False)


def _initial() -> dict[str, torch.Tensor]:
    from lazytrain_hf.models import load_model

    return dict(load_model("qwen3-tiny", "float32", seed=3).named_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_equal_one_gpu(tmp_path: Path) -> None:
    """The NCCL path: per-layer async all-reduce on the communication stream, D2H after it (fp32, TF32 off)."""
    _run([sys.executable, str(WORKER), "--out", str(tmp_path / "one"), "--per-device-batch", "4", "--device", "cuda",
          "--ga", "1"], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
          "--out", str(tmp_path / "two"), "--per-device-batch", "2", "--device", "cuda", "--ga", "1"], tmp_path)
    one, two, two_b = (_load(tmp_path, "one", 0, 1), _load(tmp_path, "two", 0, 1), _load(tmp_path, "two", 1, 1))
    for name, ref in one["params"].items():
        assert torch.equal(two["params"][name], two_b["params"][name]), name
        assert ((two["params"][name] - ref).norm() / ref.norm()).item() <= 1e-5, name
    for a, b in zip(one["logs"], two["logs"]):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_nccl_sharded_equal_one_gpu(tmp_path: Path) -> None:
    """The sharded NCCL path (async reduce to the owner on the communication stream, load-time broadcasts on the H2D
    stream with the D2H copy-back, GPU-side updates of layers 1-2, save gathered through the device, resume), fp32.
    Run with NCCL_NVLS_ENABLE=0 (benchmarks/gpu_session.sh ddptests)."""
    extra = ["--device", "cuda", "--ga", "1,2", "--gpu-updates", "--save-resume"]
    _run([sys.executable, str(WORKER), "--out", str(tmp_path / "one"), "--per-device-batch", "4", *extra], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
          "--out", str(tmp_path / "two"), "--per-device-batch", "2", "--dp-updates", "sharded", *extra], tmp_path)
    for ga in (1, 2):
        one, r0, r1 = (_load(tmp_path, "one", 0, ga), _load(tmp_path, "two", 0, ga), _load(tmp_path, "two", 1, ga))
        _check_equal(one, r0, r1, 1e-5)
        for res in (r0, r1):
            assert res["state_bytes"] == one["state_bytes"] // 2
            for name, want in res["params"].items():
                assert torch.equal(res["resumed"][name], want), name
        ref = torch.load(tmp_path / "one" / f"run{ga}" / "checkpoint-2" / "optimizer.pt")
        got = torch.load(tmp_path / "two" / f"run{ga}" / "checkpoint-2" / "optimizer.pt")
        assert got["state"].keys() == ref["state"].keys()


def test_one_process_uses_one_gpu(tmp_path: Path, caplog) -> None:
    """With several GPUs visible to one process the stock Trainer runs DataParallel (n_gpu > 1: the batch is
    multiplied and the token count becomes a per-GPU vector); the executor drives one GPU per process."""
    from transformers import TrainingArguments

    from lazytrain_hf import LazyTrainingArguments

    args = LazyTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, use_cpu=True, report_to=[])
    args._n_gpu = 2  # what _setup_devices sets on a 2-GPU machine without a launcher
    with caplog.at_level("WARNING"):
        assert args.n_gpu == 1 and args.train_batch_size == 3
    assert "torchrun --nproc_per_node 2" in caplog.text
    stock = LazyTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, use_cpu=True,
                                  report_to=[], lazytrain_config={"policy": "none"})
    stock._n_gpu = 2
    assert stock.n_gpu == 2 == TrainingArguments.n_gpu.fget(stock)


def test_schedule_json_concurrent_writers(tmp_path: Path) -> None:
    """Two ranks writing the same checkpoint file: unique temp files, so no writer fails and the file is whole."""
    import threading

    from lazytrain_hf.planning.fixed import fixed_schedule
    from lazytrain_hf.planning.schedule import Schedule

    path, errors = tmp_path / "lazytrain_schedule.json", []
    sched = fixed_schedule(8, 2)

    def write() -> None:
        try:
            for _ in range(200):
                sched.to_json(path)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and Schedule.from_json(path).num_layers == 8
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


def test_plan_host_budget_is_shared_by_local_ranks(monkeypatch) -> None:
    from types import SimpleNamespace

    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.hf import plan
    from lazytrain_hf.hf.plan import machine_budgets
    from lazytrain_hf.planning.request import resolve_budgets
    from lazytrain_hf.profiling.limits import Limit

    trainer = SimpleNamespace(lazy_config=LazyTrainConfig(device="cpu"),
                              executor=SimpleNamespace(device=torch.device("cpu")))
    # a fixed limit: the live one (available memory) moves between two reads on a busy host
    monkeypatch.setattr(plan, "host_memory_limit", lambda: Limit(24 << 30, "test"))

    def host_bytes() -> int:
        return resolve_budgets(None, None, None, nvme=False, margin=0.0, **machine_budgets(trainer)[1]).host_bytes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = host_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_bytes() in (one // 2, one // 2 - 1, one // 2 + 1)
