"""Long runs on real machines: the memory limit the process really has (emulated cgroups), the disk space of
checkpoints, atomic checkpoints (a save failing at each file write leaves the previous one to resume from, exactly),
damaged checkpoint files, a graceful stop at a step boundary on SIGTERM (one process and 2 gloo ranks), the
interrupt grace period's fallback to the last periodic checkpoint, and the documented checkpoint sizes."""

from __future__ import annotations

import builtins
import copy
import errno
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from transformers import Trainer, TrainerCallback

import lazytrain_hf  # noqa: F401
from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.config import GIB
from lazytrain_hf.hf import checkpoint as ckpt_mod
from lazytrain_hf.hf import preflight
from lazytrain_hf.models import load_model
from lazytrain_hf.profiling.limits import Limit, ResourceLimitError, cgroup_limits, host_memory_limit

from .test_trainer import EXACT, _collate, _common
from .tiny_data import tiny_dataset


def _cgroup(tmp_path: Path, files: dict[str, str], proc: str = "0::/\n") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "proc_cgroup").write_text(proc)
    return root, tmp_path / "proc_cgroup"


# ---- host-memory limits -----------------------------------------------------------------------------------------
def test_cgroup_v2_limit_less_what_other_processes_use(tmp_path):
    root, proc = _cgroup(tmp_path, {"memory.max": "max\n", "job/memory.max": str(8 * GIB),
                                    "job/memory.current": str(5 * GIB),
                                    "job/memory.stat": f"anon 1\nfile {1 * GIB}\n"}, proc="0::/job\n")
    (lim,) = cgroup_limits(root, proc, own_rss=2 * GIB)  # the top's "max" is no limit
    assert lim.bytes == 8 * GIB - (5 - 1 - 2) * GIB  # others: usage less page cache less this process
    assert lim.source == f"cgroup v2 memory.max at {root / 'job' / 'memory.max'}"


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    root, proc = _cgroup(tmp_path, {"memory/a/memory.limit_in_bytes": str(3 * GIB),
                                    "memory/memory.limit_in_bytes": "9223372036854771712"},
                         proc="4:memory:/a\n0::/\n")
    (lim,) = cgroup_limits(root, proc)
    assert lim.bytes == 3 * GIB and "cgroup v1 memory.limit_in_bytes" in lim.source


def test_the_host_limit_is_the_smallest_and_read_from_the_configured_root(tmp_path, monkeypatch):
    root, _ = _cgroup(tmp_path, {"memory.max": str(GIB)})
    monkeypatch.setenv("LAZYTRAIN_CGROUP_ROOT", str(root))
    assert host_memory_limit().bytes == GIB
    monkeypatch.setenv("LAZYTRAIN_CGROUP_ROOT", str(tmp_path / "none"))
    assert host_memory_limit().source.startswith("memory available now")


def _trainer(tmp_path, name="run", model=None, lazy=None, **kw):
    model = model if model is not None else load_model("qwen3-tiny", "float32", seed=7)
    ds = tiny_dataset(model.config.vocab_size, n=24, seed=2)
    return LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, name, **kw),
                                                               lazytrain_config=dict(lazy or EXACT)),
                       train_dataset=ds, data_collator=_collate)


def test_a_cgroup_below_the_runs_host_bytes_stops_before_anything_is_pinned(tmp_path, monkeypatch):
    probe = _trainer(tmp_path, "probe")
    need = preflight.fixed_host_bytes(probe)
    root, _ = _cgroup(tmp_path, {"memory.max": str(need // 2)})
    monkeypatch.setenv("LAZYTRAIN_CGROUP_ROOT", str(root))

    def pinned(*a, **k):
        raise AssertionError("the executor was built")

    monkeypatch.setattr("lazytrain_hf.hf.trainer.StreamingExecutor", pinned)
    with pytest.raises(ResourceLimitError) as e:
        _trainer(tmp_path, "small")
    text = str(e.value)
    assert f"cgroup v2 memory.max at {root / 'memory.max'}" in text and "master_weights='kahan'" not in text
    assert e.value.need_bytes == need and e.value.limit.bytes == need // 2
    with pytest.raises(ResourceLimitError, match="master_weights='kahan'"):
        _trainer(tmp_path, "small", lazy={**EXACT, "master_weights": "fp32"})


def test_a_dev_shm_too_small_for_the_shared_weights_stops_before_anything_is_allocated(tmp_path, monkeypatch):
    """Two ranks on this host (LOCAL_WORLD_SIZE) with sharded updates share one host copy of the weights in /dev/shm
    (streaming/shared_host.py): a /dev/shm smaller than that copy is one error naming the need, the limit and the fix,
    raised before the executor allocates anything; with dp_host_weights='per_rank' nothing of it is checked."""
    from types import SimpleNamespace

    from lazytrain_hf.streaming import shared_host

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(shared_host.shutil, "disk_usage",
                        lambda path: SimpleNamespace(total=64 << 20, used=64 << 20, free=100 << 10))

    def built(*a, **k):
        raise AssertionError("the executor was built")

    monkeypatch.setattr("lazytrain_hf.hf.trainer.StreamingExecutor", built)
    model = load_model("qwen3-tiny", "float32", seed=7)
    need = preflight.shared_copy_bytes(model)
    assert need >= 4 * sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers."))
    with pytest.raises(ResourceLimitError) as e:
        _trainer(tmp_path, "shm", model=model)
    text = str(e.value)
    for part in ("the one host copy of the decoder layers' weights that the 2 ranks on this host share (/dev/shm)",
                 "free space of /dev/shm", "docker run --shm-size=1g", "dp_host_weights='per_rank'"):
        assert part in text, text
    assert e.value.need_bytes == need and e.value.limit.bytes == 100 << 10
    with pytest.raises(AssertionError, match="the executor was built"):  # each rank its own copy: no /dev/shm
        _trainer(tmp_path, "own", lazy={**EXACT, "dp_host_weights": "per_rank"})
    with pytest.raises(AssertionError, match="the executor was built"):  # replicated updates share nothing
        _trainer(tmp_path, "replicated", lazy={**EXACT, "dp_updates": "replicated"})


def test_the_host_bytes_per_rank_count_the_shared_weights_once_per_host(tmp_path, monkeypatch):
    """The preflight's fixed host bytes per rank (the analytic cost model's) fall by half of the layers' bf16 weights
    when the 2 ranks of this host share one copy, and not at all in one process."""
    model = load_model("qwen3-tiny", "float32", seed=7)
    layers = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.layers."))
    tr = _trainer(tmp_path, model=model)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = preflight.fixed_host_bytes(tr)
    assert preflight.shared_weight_ranks(tr.lazy_config) == 2
    tr.lazy_config.dp_host_weights = "per_rank"
    assert preflight.shared_weight_ranks(tr.lazy_config) == 1
    assert preflight.fixed_host_bytes(tr) - shared == 2 * layers // 2
    tr.lazy_config.dp_host_weights = "auto"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert preflight.fixed_host_bytes(tr) - shared == 2 * layers // 2


def test_the_default_host_budget_is_90_percent_of_the_limit(tmp_path, monkeypatch):
    root, _ = _cgroup(tmp_path, {"memory.max": str(4 * GIB)})
    monkeypatch.setenv("LAZYTRAIN_CGROUP_ROOT", str(root))
    tr = _trainer(tmp_path)
    assert tr.plans.request.budgets.host_bytes == int(0.9 * 4 * GIB)
    with pytest.raises(ResourceLimitError, match="host_memory_budget"):
        _trainer(tmp_path, lazy={**EXACT, "host_memory_budget": "5GiB"})


def test_too_little_disk_for_a_checkpoint_fails_at_train_begin(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    need = preflight.checkpoint_bytes(tr)
    monkeypatch.setattr(preflight, "disk_free", lambda d: Limit(need - 1, f"free space on the disk of {d!r}"))
    steps = []
    tr.add_callback(type("C", (TrainerCallback,), {"on_step_end": lambda s, a, st, c, **k: steps.append(1)})())
    with pytest.raises(ResourceLimitError, match="a checkpoint in") as e:
        tr.train()
    assert e.value.need_bytes == need and not steps


# ---- atomic checkpoints -----------------------------------------------------------------------------------------
class Killed(BaseException):
    """The process ending in the middle of a write (no handler runs)."""


class Writes:
    """Counts the file writes of the save of checkpoint-`step` (torch.save, safetensors, open for writing) and
    fails the `fail_at`-th after writing a few bytes of it: `Killed`, or ENOSPC (`disk_full`)."""

    def __init__(self, monkeypatch, step: int, fail_at: int | None = None, disk_full: bool = False) -> None:
        self.step, self.fail_at, self.disk_full, self.names = step, fail_at, disk_full, []
        orig_save, orig_st, self.orig_open = torch.save, transformers.modeling_utils.safe_save_file, builtins.open

        def tsave(obj, f, *a, **k):
            self.hit(f)
            return orig_save(obj, f, *a, **k)

        def ssave(tensors, f, *a, **k):
            self.hit(f)
            return orig_st(tensors, f, *a, **k)

        def opn(f, mode="r", *a, **k):
            if any(c in mode for c in "wax"):
                self.hit(f)
            return self.orig_open(f, mode, *a, **k)

        monkeypatch.setattr(torch, "save", tsave)
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", ssave)
        monkeypatch.setattr(builtins, "open", opn)

    def hit(self, f) -> None:
        if not isinstance(f, (str, os.PathLike)) or f".tmp-checkpoint-{self.step}" not in str(f):
            return
        if len(self.names) == self.fail_at:
            with self.orig_open(f, "wb") as out:
                out.write(b"partial")
            self.names.append(os.path.basename(f))
            if self.disk_full:
                raise OSError(errno.ENOSPC, "No space left on device", str(f))
            raise Killed(str(f))
        self.names.append(os.path.basename(f))


def _losses(tr, after=0):
    """Logged loss by step (a resumed run's history starts with the checkpoint's: `after` drops it)."""
    return {h["step"]: h["loss"] for h in tr.state.log_history if "loss" in h and h["step"] > after}


SAVE = dict(max_steps=4, save_strategy="steps", save_steps=2)


def test_a_save_failing_at_each_file_write_leaves_the_previous_checkpoint_to_resume(tmp_path, monkeypatch, caplog):
    model = load_model("qwen3-tiny", "float32", seed=7)
    with monkeypatch.context() as m:
        count = Writes(m, step=4)
        ref = _trainer(tmp_path, "ref", copy.deepcopy(model), **SAVE)
        ref.train()
    names = count.names
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
            ckpt_mod.MANIFEST_NAME} <= set(names), names
    assert not ckpt_mod.checkpoint_problems(str(tmp_path / "ref" / "checkpoint-4"))
    want = _losses(ref)
    for k, name in enumerate(names):
        out = tmp_path / f"kill{k}"
        with monkeypatch.context() as m:
            Writes(m, step=4, fail_at=k)
            with pytest.raises(Killed):
                _trainer(tmp_path, out.name, copy.deepcopy(model), **SAVE).train()
        assert not (out / "checkpoint-4").exists(), name
        assert (out / ".tmp-checkpoint-4").is_dir(), name  # a killed save leaves its staging directory only
        caplog.clear()
        resumed = _trainer(tmp_path, out.name, copy.deepcopy(model), **SAVE)
        resumed.train(resume_from_checkpoint=True)
        assert "skipping" in caplog.text and ".tmp-checkpoint-4" in caplog.text, name
        got = _losses(resumed, after=2)
        assert sorted(got) == [3, 4], name
        assert [got[s] for s in (3, 4)] == pytest.approx([want[s] for s in (3, 4)], rel=1e-6), name
        assert not ckpt_mod.checkpoint_problems(str(out / "checkpoint-4"))
        assert not (out / ".tmp-checkpoint-4").exists()  # the resumed run's save replaced it


def test_a_full_disk_during_a_save_is_one_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        Writes(m, step=4, fail_at=2, disk_full=True)
        tr = _trainer(tmp_path, "full", **SAVE)
        with pytest.raises(ckpt_mod.CheckpointSaveError) as e:
            tr.train()
    text = str(e.value)
    need = preflight.checkpoint_bytes(tr)
    assert e.value.errno == errno.ENOSPC and f"needs about {need / GIB:.2f} GiB" in text and "were free" in text
    assert str(tmp_path / "full" / "checkpoint-2") in text
    out = tmp_path / "full"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]  # nothing partial left
    assert ckpt_mod.last_complete_checkpoint(str(out)) == str(out / "checkpoint-2")


def test_a_truncated_optimizer_file_is_one_error_naming_it(tmp_path, caplog):
    tr = _trainer(tmp_path, "t", **SAVE)
    tr.train()
    opt = tmp_path / "t" / "checkpoint-4" / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[: opt.stat().st_size // 2])
    with pytest.raises(ckpt_mod.CheckpointError, match=f"{opt} has .* bytes"):
        _trainer(tmp_path, "t", **SAVE).train(resume_from_checkpoint=str(opt.parent))
    # True skips it (with a warning) for the newest complete one
    assert ckpt_mod.last_complete_checkpoint(str(tmp_path / "t")) == str(tmp_path / "t" / "checkpoint-2")
    assert "skipping the incomplete checkpoint" in caplog.text and "optimizer.pt" in caplog.text
    # a checkpoint without a manifest (the stock Trainer's): the load error names the file
    (opt.parent / ckpt_mod.MANIFEST_NAME).unlink()
    with pytest.raises(ckpt_mod.CheckpointError, match=f"cannot read {opt}"):
        _trainer(tmp_path, "t", **SAVE).train(resume_from_checkpoint=str(opt.parent))


# ---- graceful interruption --------------------------------------------------------------------------------------
class SigtermAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step - 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint_and_resume_is_exact(tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=7)
    ref = _trainer(tmp_path, "ref", copy.deepcopy(model), max_steps=6)
    ref.train()
    want = _losses(ref)
    before = signal.getsignal(signal.SIGTERM)
    tr = _trainer(tmp_path, "int", copy.deepcopy(model), max_steps=6)
    tr.add_callback(SigtermAt(3))
    tr.train()
    assert tr.interrupted == signal.SIGTERM and tr.state.global_step == 3
    assert signal.getsignal(signal.SIGTERM) is before  # the previous handler is back
    ck = tmp_path / "int" / "checkpoint-3"
    assert not ckpt_mod.checkpoint_problems(str(ck)) and (ck / ckpt_mod.MANIFEST_NAME).is_file()
    resumed = _trainer(tmp_path, "int", copy.deepcopy(model), max_steps=6)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.interrupted is None and resumed.state.global_step == 6
    got = _losses(resumed, after=3)
    assert sorted(got) == [4, 5, 6]
    assert [got[s] for s in (4, 5, 6)] == pytest.approx([want[s] for s in (4, 5, 6)], rel=1e-6)


# ---- the grace period -------------------------------------------------------------------------------------------
class Clock:
    """The clock of the grace period and of save timing (`LongRunCallback.clock`), advanced by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _slow_saves(monkeypatch, clock: Clock, seconds: float) -> None:
    """Every checkpoint save takes `seconds` on `clock` (the stock save under the atomic one)."""
    orig = Trainer._save_checkpoint

    def slow(self, model, trial):
        orig(self, model, trial)
        clock.t += seconds

    monkeypatch.setattr(Trainer, "_save_checkpoint", slow)


class SigtermAndWait(SigtermAt):
    """SIGTERM during step `step`, then `wait_s` on `clock` before the step ends (a long step)."""

    def __init__(self, step: int, clock: Clock, wait_s: float = 0.0) -> None:
        super().__init__(step)
        self.clock, self.wait_s = clock, wait_s

    def on_step_begin(self, args, state, control, **kwargs):
        super().on_step_begin(args, state, control, **kwargs)
        if state.global_step == self.step - 1:
            self.clock.t += self.wait_s


def _grace_trainer(tmp_path, name, model, clock, grace, **kw):
    tr = _trainer(tmp_path, name, copy.deepcopy(model), lazy={**EXACT, "interrupt_grace_period": grace},
                  **{**GRACE, **kw})
    tr.longrun.clock = clock
    return tr


GRACE = dict(max_steps=6, save_strategy="steps", save_steps=2)


def test_a_save_that_cannot_finish_in_the_grace_period_falls_back_to_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                          caplog):
    """Saves take 50 s, the grace period is 30 s: SIGTERM in step 3 stops after step 3 without starting a checkpoint,
    the line names checkpoint-2, and resuming from it gives the uninterrupted run's losses. The resumed run, started
    afresh, takes the 50 s from checkpoint-2's manifest and falls back the same way."""
    model = load_model("qwen3-tiny", "float32", seed=7)
    ref = _trainer(tmp_path, "ref", copy.deepcopy(model), **GRACE)
    ref.train()
    want = _losses(ref)
    out = tmp_path / "int"
    clock = Clock()
    with monkeypatch.context() as m:
        _slow_saves(m, clock, 50.0)
        tr = _grace_trainer(tmp_path, "int", model, clock, "30s")
        tr.add_callback(SigtermAndWait(3, clock))
        caplog.clear()
        tr.train()
    assert tr.interrupted == signal.SIGTERM and tr.state.global_step == 3
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]  # no checkpoint-3, nothing staged
    assert tr.interrupt_checkpoint == str(out / "checkpoint-2")
    lines = [r.getMessage() for r in caplog.records if "without a new checkpoint" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "takes about 50 s" in lines[0] and "30 s of the 30 s grace period" in lines[0]
    assert f"continues from {out / 'checkpoint-2'} (step 3 runs again)" in lines[0] and "--resume last" in lines[0]
    assert ckpt_mod.recorded_save_seconds(str(out / "checkpoint-2")) == 50.0

    again = _grace_trainer(tmp_path, "int", model, Clock(), "30s")  # no slow saves now: the manifest's 50 s
    again.add_callback(SigtermAt(3))
    again.train(resume_from_checkpoint=True)
    assert again.interrupted == signal.SIGTERM and again.interrupt_checkpoint == str(out / "checkpoint-2")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2"]

    resumed = _grace_trainer(tmp_path, "int", model, Clock(), "30s")
    resumed.train(resume_from_checkpoint=True)
    assert resumed.interrupted is None and resumed.state.global_step == 6
    got = _losses(resumed, after=2)
    assert sorted(got) == [3, 4, 5, 6]
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=1e-6)


@pytest.mark.parametrize("grace, wait_s, keep_earlier, saved", [
    ("1000s", 0.0, True, True),    # ample: saved as without a grace period
    ("1000s", 980.0, True, False),  # a long step after the signal ate the grace period: 20 s left, 50 s needed
    ("30s", 0.0, False, True),     # too short, but no earlier checkpoint to fall back to: saved anyway
])
def test_the_grace_period_counts_from_the_signal(tmp_path, monkeypatch, caplog, grace, wait_s, keep_earlier, saved):
    model = load_model("qwen3-tiny", "float32", seed=7)
    out = tmp_path / "g"
    clock = Clock()

    class DropCheckpoints(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2 and not keep_earlier:
                import shutil

                shutil.rmtree(out / "checkpoint-2")

    with monkeypatch.context() as m:
        _slow_saves(m, clock, 50.0)
        tr = _grace_trainer(tmp_path, "g", model, clock, grace, max_steps=4)
        tr.add_callback(DropCheckpoints())
        tr.add_callback(SigtermAndWait(3, clock, wait_s))
        tr.train()
    assert tr.interrupted == signal.SIGTERM and tr.state.global_step == 3
    assert (out / "checkpoint-3").is_dir() == saved
    if saved:
        assert not ckpt_mod.checkpoint_problems(str(out / "checkpoint-3"))
        assert tr.interrupt_checkpoint == str(out / "checkpoint-3")
        assert ("no earlier checkpoint to fall back to" in caplog.text) == (not keep_earlier)
    else:
        assert tr.interrupt_checkpoint == str(out / "checkpoint-2")
        assert "20 s of the 1000 s grace period" in caplog.text


def test_a_checkpoints_size_counts_the_optimizer_states_after_they_exist(tmp_path):
    """`checkpoint_bytes` (the free-space check before each save, the grace-period estimate) after steps have run:
    the states held count (they were left out once the first step had allocated them)."""
    tr = _trainer(tmp_path, "s", max_steps=2, save_strategy="steps", save_steps=2)
    tr.train()
    ck = tmp_path / "s" / "checkpoint-2"
    saved = (ck / "model.safetensors").stat().st_size + (ck / "optimizer.pt").stat().st_size
    got = preflight.checkpoint_bytes(tr) - preflight.CHECKPOINT_OVERHEAD_BYTES
    assert 0.95 * saved <= got <= saved


# ---- data parallel: 2 gloo ranks (tests/hf/interrupt_worker.py) -------------------------------------------------
INTERRUPT_WORKER = Path(__file__).with_name("interrupt_worker.py")


def _torchrun(tmp: Path, launcher: tuple[str, ...] = (), worker: tuple[str, ...] = (),
              check: bool = True) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[2]  # the checkout under test first (as tests/hf/test_ddp.py)
    path = os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        *launcher, str(INTERRUPT_WORKER), "--out", str(tmp), *worker], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def interrupted_2_ranks(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dp_interrupt")
    _torchrun(tmp)
    return tmp


def _same_as_ref(ref: dict, got: dict, steps: list[int]) -> None:
    assert sorted(got["logs"]) == steps
    assert [got["logs"][s] for s in steps] == pytest.approx([ref["logs"][s] for s in steps], rel=1e-6)
    for name, want in ref["params"].items():
        torch.testing.assert_close(got["params"][name], want, rtol=1e-6, atol=1e-7, msg=name)


def test_sigterm_on_one_rank_stops_both_at_one_step_with_one_checkpoint(interrupted_2_ranks):
    """SIGTERM reaches rank 1 only, in step 3: both ranks stop after step 3, checkpoint-3 is whole (the sharded
    states gathered from both), and the resumed 2-rank run ends where the uninterrupted one did."""
    tmp = interrupted_2_ranks
    r0, r1 = (torch.load(tmp / f"rank{r}.pt") for r in (0, 1))
    for res in (r0, r1):
        run = res["term"]
        assert run["interrupted"] == signal.SIGTERM and run["stopped_at"] == 3
        assert run["files"] == ["checkpoint-2", "checkpoint-3"]
        assert run["interrupt_checkpoint"] == str(tmp / "term" / "checkpoint-3")
        assert run["resumed_interrupted"] is None
        _same_as_ref(res["ref"], run, [4, 5, 6])
    assert not ckpt_mod.checkpoint_problems(str(tmp / "term" / "checkpoint-3"))


def test_ranks_agree_to_fall_back_when_one_ranks_save_would_not_fit_the_grace_period(interrupted_2_ranks):
    """Grace period 30 s; rank 1's saves take 50 s (on the worker's clock), rank 0's none; SIGTERM reaches rank 0
    only: both ranks stop after step 3 without a checkpoint (rank 0 alone would have started one, and the save's
    collectives would wait for rank 1), and resuming from checkpoint-2 ends where the uninterrupted run did."""
    tmp = interrupted_2_ranks
    for rank in (0, 1):
        res = torch.load(tmp / f"rank{rank}.pt")
        run = res["grace"]
        assert run["interrupted"] == signal.SIGTERM and run["stopped_at"] == 3
        assert run["files"] == ["checkpoint-2"]
        assert run["interrupt_checkpoint"] == str(tmp / "grace" / "checkpoint-2")
        _same_as_ref(res["ref"], run, [3, 4, 5, 6])


@pytest.mark.parametrize("run", ["full0", "full1"])
def test_a_full_disk_on_one_rank_during_a_periodic_save_lets_both_ranks_train_on(interrupted_2_ranks, run):
    """The disk fills during checkpoint-2's save on rank 0 (its model file: full0) or rank 1 (its RNG file: full1),
    with sharded states: neither rank waits in a collective, checkpoint-2 is left out whole, both ranks train to step
    6 with the uninterrupted run's losses and parameters, and checkpoint-4 and checkpoint-6 are saved."""
    tmp = interrupted_2_ranks
    for rank in (0, 1):
        res = torch.load(tmp / f"rank{rank}.pt")
        got = res[run]
        assert got["stopped_at"] == 6 and got["interrupted"] is None
        assert got["files"] == ["checkpoint-4", "checkpoint-6"]
        _same_as_ref(res["ref"], got, [1, 2, 3, 4, 5, 6])
    assert ckpt_mod.last_complete_checkpoint(str(tmp / run)) == str(tmp / run / "checkpoint-6")


def test_sigterm_to_the_torchrun_launcher_reaches_both_ranks_and_leaves_one_checkpoint(interrupted_2_ranks):
    """The launcher passes SIGTERM to every rank (killing them after --shutdown-timeout): both stop after the same
    step S (3, or later when the signal arrives after step 3 ended), with checkpoint-S whole and holding the
    uninterrupted run's losses up to S."""
    tmp = interrupted_2_ranks / "launch"
    tmp.mkdir()
    r = _torchrun(tmp, ("--shutdown-timeout", "300"), ("--launcher-term",), check=False)  # the launcher: an error
    assert all((tmp / f"launcher{rank}.pt").is_file() for rank in (0, 1)), r.stdout[-3000:] + r.stderr[-3000:]
    rows = [torch.load(tmp / f"launcher{rank}.pt") for rank in (0, 1)]
    step = rows[0]["stopped_at"]
    assert step >= 3 and all(r["stopped_at"] == step and r["interrupted"] == signal.SIGTERM for r in rows)
    ck = tmp / "launcher" / f"checkpoint-{step}"
    assert rows[0]["files"] == rows[1]["files"] == ["checkpoint-2", ck.name]
    assert not ckpt_mod.checkpoint_problems(str(ck))
    logged = {h["step"]: h["loss"] for h in json.loads((ck / "trainer_state.json").read_text())["log_history"]
              if "loss" in h}
    ref = torch.load(interrupted_2_ranks / "rank0.pt")["ref"]["logs"]
    assert sorted(logged) == list(range(1, step + 1))
    assert [logged[s] for s in logged] == pytest.approx([ref[s] for s in logged], rel=1e-6)


def test_the_documented_checkpoint_sizes_are_what_the_optimizer_layout_gives():
    """docs/trainer.md's table (GiB): bf16 weights of the registry's configs on the meta device, the Hybrid 8-bit
    states its `state_specs` lists (embedding and LM head fp32), plus the preflight's allowance."""
    import transformers

    from lazytrain_hf.models import resolve_config
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    doc = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    rows = {cells[1].strip(): [c.strip() for c in cells[2:-1]] for line in doc.splitlines()
            if (cells := line.split("|")) and len(cells) == 8 and cells[1].strip().startswith("qwen")}
    assert sorted(rows) == ["qwen2.5-3b", "qwen2.5-7b", "qwen3-14b", "qwen3.6-27b"]
    for name, cells in rows.items():
        with torch.device("meta"):
            m = transformers.AutoModelForCausalLM.from_config(resolve_config(name), dtype=torch.bfloat16)
        params = list({id(p): p for p in m.parameters()}.values())
        weights = sum(p.numel() * p.element_size() for p in params)
        fp32 = [m.get_input_embeddings().weight, m.get_output_embeddings().weight]
        got = [f"{sum(p.numel() for p in params) / 1e9:.2f} B", f"{weights / GIB:.1f}"]
        for master in ("fp32", "kahan"):
            opt = Hybrid8bitOptimizer(params, lr=1e-5, master_weights=master, fp32_state_params=fp32)
            states = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size()
                         for _, s, d in opt.state_specs())
            total = f"{(weights + states + preflight.CHECKPOINT_OVERHEAD_BYTES) / GIB:.1f}"
            got += [f"{states / GIB:.1f}", total] if master == "fp32" else [total]
        assert cells == got, name


def test_the_final_model_save_checks_its_space_and_a_full_disk_is_one_error(tmp_path, monkeypatch):
    """save_model outside a checkpoint (a run's final model): too little free space stops it before a byte is
    written; a disk that fills during the write is one error with the bytes needed and free and the last complete
    checkpoint to resume from (the run's checkpoints untouched)."""
    tr = _trainer(tmp_path, "fin", **SAVE)
    tr.train()
    final = tmp_path / "final"
    need = preflight.saved_model_bytes(tr.model) + preflight.CHECKPOINT_OVERHEAD_BYTES
    with monkeypatch.context() as m:
        m.setattr(ckpt_mod, "disk_free", lambda d: Limit(need - 1, f"free space on the disk of {d!r}"))
        with pytest.raises(ResourceLimitError, match="saving the model to") as e:
            tr.save_model(str(final))
    assert e.value.need_bytes == need and not any(final.iterdir())

    orig = transformers.modeling_utils.safe_save_file

    def full(tensors, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    with monkeypatch.context() as m:
        m.setattr(transformers.modeling_utils, "safe_save_file", full)
        with pytest.raises(ckpt_mod.CheckpointSaveError) as e:
            tr.save_model(str(final))
    text = str(e.value)
    assert e.value.errno == errno.ENOSPC and "were free when the save began" in text
    assert str(tmp_path / "fin" / "checkpoint-4") in text  # where to resume from
    assert ckpt_mod.last_complete_checkpoint(str(tmp_path / "fin")) == str(tmp_path / "fin" / "checkpoint-4")
    assert orig is transformers.modeling_utils.safe_save_file
    tr.save_model(str(final))  # with room again it saves
    assert (final / "model.safetensors").exists()


def test_the_plans_host_and_nvme_bytes_are_checked_at_train_begin(tmp_path, monkeypatch):
    """preflight.check_plan at train begin: a plan whose predicted host bytes exceed this rank's limit stops the run
    before a step, naming the plan; its NVMe bytes are checked against nvme_dir's free space."""
    from types import SimpleNamespace

    probe = _trainer(tmp_path, "probe", lazy={**EXACT, "policy": "milp"}, max_steps=1)
    probe.train()
    host = int(probe.executor.schedule.predicted["pinned_host_bytes"])
    assert host > 0
    tr = _trainer(tmp_path, "run", lazy={**EXACT, "policy": "milp"}, max_steps=1)
    steps = []
    tr.add_callback(type("C", (TrainerCallback,), {"on_step_end": lambda s, a, st, c, **k: steps.append(1)})())
    monkeypatch.setattr(preflight, "host_limit_per_rank", lambda ranks=None: Limit(host - 1, "a test limit"))
    with pytest.raises(ResourceLimitError, match=r"the plan \(milp\) on the host needs") as e:
        tr.train()
    assert e.value.need_bytes == host and not steps
    monkeypatch.undo()

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    fake = SimpleNamespace(lazy_config=SimpleNamespace(nvme_dir=str(nvme), host_memory_budget=None))
    plan = SimpleNamespace(policy="milp", predicted={"pinned_host_bytes": 0, "nvme_bytes": 10 << 30})
    monkeypatch.setattr(preflight, "disk_free", lambda d: Limit((10 << 30) - 1, f"free space on the disk of {d!r}"))
    with pytest.raises(ResourceLimitError, match="the plan's NVMe tier in"):
        preflight.check_plan(fake, plan)
    monkeypatch.setattr(preflight, "disk_free", lambda d: Limit(10 << 30, f"free space on the disk of {d!r}"))
    preflight.check_plan(fake, plan)  # exactly enough


def test_a_periodic_save_on_a_full_disk_is_one_error_line_and_training_continues(tmp_path, monkeypatch, caplog):
    """One process: a save before the last step that finds the disk full leaves nothing partial, logs one error
    and training goes on (the next save tries again), with the losses of a run whose saves all succeeded."""
    model = load_model("qwen3-tiny", "float32", seed=7)
    six = dict(max_steps=6, save_strategy="steps", save_steps=2)
    ref = _trainer(tmp_path, "ref", copy.deepcopy(model), **six)
    ref.train()
    with monkeypatch.context() as m, caplog.at_level(logging.ERROR, logger="lazytrain_hf"):
        Writes(m, step=2, fail_at=1, disk_full=True)
        tr = _trainer(tmp_path, "full", copy.deepcopy(model), **six)
        tr.train()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "saving checkpoint-2 failed for lack of disk space" in errors[0]
    assert "training continues" in errors[0]
    out = tmp_path / "full"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert _losses(tr) == pytest.approx(_losses(ref), rel=1e-6)
    assert ckpt_mod.last_complete_checkpoint(str(out)) == str(out / "checkpoint-6")
