"""Long runs on real machines: the memory limit the process really has (emulated cgroups), the disk space of
checkpoints, atomic checkpoints (a save failing at each file write leaves the previous one to resume from, exactly),
damaged checkpoint files, and a graceful stop at a step boundary on SIGTERM."""

from __future__ import annotations

import builtins
import copy
import errno
import os
import signal
from pathlib import Path

import pytest
import torch
import transformers.modeling_utils
from transformers import TrainerCallback

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
