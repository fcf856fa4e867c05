"""Out-of-memory recovery (lazytrain_hf/hf/recovery.py): a micro-batch that runs out of GPU memory is dropped, the
plan solved again with less memory and the accumulation window run again; the run equals one that never ran out."""

from __future__ import annotations

import copy
import logging
import math
import threading

import pytest
import torch
from datasets import Dataset

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.hf import recovery
from lazytrain_hf.hf.calibrate import Calibration
from lazytrain_hf.hf.callback import LazyTrainCallback
from lazytrain_hf.models import load_model
from lazytrain_hf.optim import functional as F
from lazytrain_hf.streaming.device_updates import DeviceUpdater
from lazytrain_hf.streaming.executor import StreamingExecutor
from lazytrain_hf.streaming.grads import GradSink

from ..conftest import rel_err
from .test_trainer import EXACT, _collate, _common, _dataset, _logs

MIB = 1 << 20
#: policy "milp" on the CPU plans against a GPU budget: the configured one (less the margin)
MILP = {**EXACT, "policy": "milp", "gpu_memory_budget": "1GiB"}
_models: dict[str, torch.nn.Module] = {}


def _model(arch):
    if arch not in _models:
        _models[arch] = load_model(arch, "float32", seed=3)
    return copy.deepcopy(_models[arch])


def _long_dataset(vocab: int) -> Dataset:
    """Sequences of 200-249 tokens: at 4 rows the activations are large enough for plans to differ (a boundary
    recomputed instead of kept) within a few hundred KiB."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(8):
        ids = torch.randint(0, vocab, (200 + 7 * i,), generator=g).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids})
    return Dataset.from_list(rows)


def _trainer(tmp_path, name, arch="qwen3-tiny", cfg=None, long=False, **kw):
    model = _model(arch)
    if long:
        kw.setdefault("per_device_train_batch_size", 4)
        kw.setdefault("gradient_accumulation_steps", 1)
    ds = (_long_dataset if long else _dataset)(model.config.vocab_size)
    return LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, name, **kw),
                                                               lazytrain_config=dict(cfg or MILP)),
                       train_dataset=ds, data_collator=_collate)


def _run(tmp_path, name, arch="qwen3-tiny", cfg=None, long=False, **kw):
    t = _trainer(tmp_path, name, arch, cfg, long, **kw)
    t.train()
    return t


def _tight(tmp_path) -> dict:
    """policy "milp" on the long data with a GPU budget of exactly the longest bucket's predicted peak (no
    margin): any reduction needs a plan that keeps fewer boundaries."""
    from lazytrain_hf.hf.plan import plan_buckets_for_trainer

    cfg = {**MILP, "gpu_memory_margin": 0.0}
    plans = plan_buckets_for_trainer(_trainer(tmp_path, "probe", cfg=cfg, long=True))
    return {**cfg, "gpu_memory_budget": plans.schedules[plans.buckets[-1]].predicted["peak_gpu_bytes"]}


class _Fault:
    """Raises torch.OutOfMemoryError in micro-batch `at` (1-based count of forward_backward calls; None: every one)
    at `point`: "capture" (the embedding, before any layer ran), "forward" (layer `layer`'s forward), "backward"
    (right after layer `layer`'s gradients were pushed, the later layers' before them) or "staging" (while layer
    `layer`'s GPU-side update is staged, at its second parameter). `times`: how many it raises
    at most."""

    def __init__(self, monkeypatch, point: str, at: int | None, times: int = 1, request: int = 20 * MIB,
                 layer: int = 2) -> None:
        self.calls = self.raised = 0
        self.at, self.times, self.request = at, times, request
        fb, fwd, push = StreamingExecutor.forward_backward, StreamingExecutor._forward, GradSink.push
        capture = StreamingExecutor._capture

        def capturing(ex, *a, **k):
            if point == "capture":
                self._maybe()
            return capture(ex, *a, **k)

        def counting(ex, *a, **k):
            self.calls += 1
            return fb(ex, *a, **k)

        def forward(ex, slot, x, call, *rest):
            if point == "forward" and slot.layer == layer:
                self._maybe()
            return fwd(ex, slot, x, call, *rest)

        fault_layer = layer

        def pushing(sink, slot, layer):
            push(sink, slot, layer)
            if point == "backward" and layer == fault_layer:
                self._maybe()

        stage, step = DeviceUpdater.stage, F.adamw_step
        staging = []  # parameters staged so far in the `DeviceUpdater.stage` running now

        def device_update(updater, slot, layer_index):
            staging.clear()
            staging.append((layer_index, threading.get_ident()))
            try:
                return stage(updater, slot, layer_index)
            finally:
                staging.clear()

        def adamw_step(*a, **k):
            if point == "staging" and staging and staging[0] == (layer, threading.get_ident()):
                staging.append(None)
                if len(staging) == 3:  # the second parameter: the first one's step counter already advanced
                    self._maybe()
            return step(*a, **k)

        if point == "staging":
            monkeypatch.setattr(DeviceUpdater, "stage", device_update)
            monkeypatch.setattr(F, "adamw_step", adamw_step)
        monkeypatch.setattr(StreamingExecutor, "forward_backward", counting)
        monkeypatch.setattr(StreamingExecutor, "_forward", forward)
        monkeypatch.setattr(GradSink, "push", pushing)
        monkeypatch.setattr(StreamingExecutor, "_capture", capturing)

    def _maybe(self) -> None:
        if (self.at is None or self.calls == self.at) and self.raised < self.times:
            self.raised += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {self.request / MIB:.2f} MiB. "
                                         "(injected by the test)")


@pytest.mark.parametrize("placement", ["host", "host_sliced"])
def test_an_oom_after_a_host_heads_staged_gradient_adds_nothing_stale(tmp_path, monkeypatch, placement):
    """The second micro-batch of a window stages its host head's gradient for `finish` to add; an out-of-memory
    error in the layers' backward after that aborts the window, whose retry must not add the abandoned stage."""
    cfg = {**MILP, "resident_placement": placement}
    clean = _run(tmp_path, "clean", "qwen3.5-tiny", cfg, gradient_accumulation_steps=2)
    fault = _Fault(monkeypatch, "backward", 4)
    hit = _run(tmp_path, "hit", "qwen3.5-tiny", cfg, gradient_accumulation_steps=2)
    assert fault.raised == 1 and hit.oom_recoveries == 1
    assert hit.executor.resident.placement == placement
    _assert_equal_runs(hit, clean)


def _assert_equal_runs(a, b):
    for key in ("loss", "grad_norm"):
        la, lb = _logs(a, key), _logs(b, key)
        assert len(la) == len(lb) == 3, (key, la, lb)
        for x, y in zip(la, lb):
            assert math.isclose(x, y, rel_tol=1e-5), (key, x, y)
    pb = dict(b.model.named_parameters())
    for name, p in a.model.named_parameters():
        assert rel_err(p.detach(), pb[name].detach()) < 1e-5, name


@pytest.mark.parametrize("arch,ga,point,at", [
    ("qwen3-tiny", 1, "forward", 2),  # step 2: step 1's deferred updates still pending in its forward
    ("qwen3-tiny", 1, "backward", 2),
    ("qwen3-tiny", 2, "forward", 4),  # step 2's second micro-batch: the first one's gradients already summed
    ("qwen3.5-tiny", 2, "backward", 4),
    ("qwen3-tiny", 2, "backward", 3),  # step 2's first micro-batch
])
def test_an_oom_is_recovered_and_the_run_equals_one_that_never_ran_out(tmp_path, monkeypatch, caplog, arch, ga,
                                                                       point, at):
    clean = _run(tmp_path, "clean", arch, gradient_accumulation_steps=ga)
    assert clean.oom_recoveries == 0 and clean.plans.gpu_reduction_bytes == 0
    assert any(g > 1.0 for g in _logs(clean, "grad_norm")), "the test must exercise clipping"
    fault = _Fault(monkeypatch, point, at)
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.hf.recovery"):
        hit = _run(tmp_path, "hit", arch, gradient_accumulation_steps=ga)
    assert fault.raised == 1
    assert fault.calls == 3 * ga + (at - 1) % ga + 1  # the window so far and the failed micro-batch, once more
    assert hit.oom_recoveries == 1
    _assert_equal_runs(hit, clean)
    lines = [r.getMessage() for r in caplog.records if "CUDA out of memory" in r.getMessage()]
    assert len(lines) == 1 and "in step 2" in lines[0] and "re-planned with 20.00 MiB less" in lines[0], lines
    assert hit.plans.gpu_reduction_bytes == 20 * MIB
    budget = int(1024**3 * (1 - hit.lazy_config.gpu_memory_margin)) - 20 * MIB
    assert all(s.solver["gpu_budget_bytes"] == budget for s in hit.plans.bucket_plans.schedules.values())
    assert [h["oom_recoveries"] for h in hit.state.log_history if "oom_recoveries" in h] == [0.0, 1.0, 1.0]


def test_dropout_draws_the_same_masks_after_a_recovery(tmp_path, monkeypatch):
    """The window runs again from the RNG state of its start: with attention dropout the recovered run still
    equals the one that never ran out of memory (the failed attempt's draws are not kept)."""
    base = _model("qwen3-tiny")
    for layer in base.model.layers:
        layer.self_attn.attention_dropout = 0.2
    _models["qwen3-tiny-dropout"] = base
    clean = _run(tmp_path, "clean", "qwen3-tiny-dropout", gradient_accumulation_steps=2)
    fault = _Fault(monkeypatch, "backward", at=4)
    hit = _run(tmp_path, "hit", "qwen3-tiny-dropout", gradient_accumulation_steps=2)
    assert fault.raised == 1 and hit.oom_recoveries == 1
    _assert_equal_runs(hit, clean)


@pytest.mark.parametrize("ga,point", [(1, "capture"), (1, "forward"), (2, "capture"), (1, "staging")])
def test_gpu_side_updates_pending_at_the_oom_are_applied_once(tmp_path, monkeypatch, ga, point):
    """Layers the plan updates on the compute device (here 0 and 1; a CPU device runs the same path) keep, with one
    micro-batch per step, their gradient there into the next forward, where the previous step's update runs at
    their load. An out-of-memory error in that forward keeps what had not run pending: at "capture" layer 0's
    update is staged (prefetched) and layer 1's still waits with its kept gradient; at layer 0's forward layer 1's
    is staged. Each update is applied exactly once."""
    from lazytrain_hf.hf import plan

    monkeypatch.setattr(plan, "_gpu_optimizer", lambda trainer: True)
    clean = _run(tmp_path, "clean", gradient_accumulation_steps=ga)
    placed = [i for i, lp in enumerate(clean.executor.schedule.layers) if lp.optimizer_device == "gpu"]
    assert placed and clean.executor.device_updates > 0, "the plan must update layers on the device"
    assert placed == [0, 1] and clean.executor.schedule.keep_grads == (ga == 1)
    fault = _Fault(monkeypatch, point, at=ga + 1, layer=0)  # step 2's first micro-batch
    hit = _run(tmp_path, "hit", gradient_accumulation_steps=ga)
    assert fault.raised == 1 and hit.oom_recoveries == 1
    assert hit.executor.device_updates == clean.executor.device_updates
    _assert_equal_runs(hit, clean)


def test_more_ooms_than_the_bound_end_the_run_with_one_clear_error(tmp_path, monkeypatch, caplog):
    fault = _Fault(monkeypatch, "backward", at=None, times=100)
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.hf.recovery"), \
            pytest.raises(RuntimeError, match="CUDA out of memory in step 1") as err:
        _run(tmp_path, "hit", gradient_accumulation_steps=1)
    assert fault.raised == recovery.MAX_OOM_RECOVERIES + 1
    msg = str(err.value)
    assert f"re-planned {recovery.MAX_OOM_RECOVERIES} times" in msg and "GPU budget of" in msg, msg
    assert "gpu_memory_margin" in msg and "per_device_train_batch_size" in msg and "max_rows_per_pass" in msg, msg
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    lines = [r for r in caplog.records if "CUDA out of memory" in r.getMessage()]
    assert len(lines) == recovery.MAX_OOM_RECOVERIES


def test_a_reduced_budget_no_plan_fits_is_the_clear_error(tmp_path, monkeypatch):
    _Fault(monkeypatch, "forward", at=1, request=2 * 1024**3)
    with pytest.raises(RuntimeError, match="no plan fits the GPU budget less the measured overshoot") as err:
        _run(tmp_path, "hit")
    assert "Fix:" in str(err.value)


@pytest.mark.parametrize("how", ["fixed", "schedule_path"])
def test_without_the_planner_an_oom_is_the_clear_error_at_once(tmp_path, monkeypatch, how):
    cfg = dict(EXACT, gpu_memory_budget="1GiB", policy="fixed")
    if how == "schedule_path":
        from lazytrain_hf.planning.fixed import fixed_schedule

        fixed_schedule(4, 2).to_json(str(tmp_path / "s.json"))
        cfg = dict(MILP, schedule_path=str(tmp_path / "s.json"))
    fault = _Fault(monkeypatch, "forward", at=3)  # step 2's first micro-batch (2 per step)
    with pytest.raises(RuntimeError, match=r"CUDA out of memory in step 2 \(micro-batch 1 of the window\)") as err:
        _run(tmp_path, "hit", cfg=cfg)
    assert fault.raised == 1
    assert ("has no planner" if how == "fixed" else "remove schedule_path") in str(err.value)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)


def test_a_checked_step_over_the_budget_replans_before_the_next(tmp_path, monkeypatch, caplog):
    """The first steps' measured peaks (CUDA: max_memory_allocated since the step began; stood in for here) are
    compared with the plan's budget: step 1 over it re-plans with the overshoot taken off, to a plan that keeps
    fewer boundaries; the run still equals one on the first plan."""
    cfg = _tight(tmp_path)
    clean = _run(tmp_path, "clean", cfg=cfg, long=True)
    over, seen = 50_000, []

    def peak(cb):
        seen.append(cb.trainer.state.global_step)
        budget = cb.trainer.executor.schedule.solver["gpu_budget_bytes"]
        return budget + over if len(seen) == 1 else budget

    monkeypatch.setattr(LazyTrainCallback, "_step_peak_bytes", peak)
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.hf.recovery"):
        hit = _run(tmp_path, "hit", cfg=cfg, long=True)
    assert seen == [1, 2, 3]
    assert hit.plans.gpu_reduction_bytes == over  # budget == predicted peak here
    lines = [r.getMessage() for r in caplog.records if "measured peak exceeded" in r.getMessage()]
    assert len(lines) == 1 and "in step 1" in lines[0], lines
    longest = lambda t: t.plans.bucket_plans.schedules[t.plans.bucket_plans.buckets[-1]]  # noqa: E731
    assert sum(lp.checkpoint for lp in longest(hit).layers) < sum(lp.checkpoint for lp in longest(clean).layers)
    assert hit.oom_recoveries == 0 and hit.executor.stats.recomputed_layers > 0
    _assert_equal_runs(hit, clean)


def test_an_oom_replans_to_a_smaller_plan_mid_step(tmp_path, monkeypatch, caplog):
    """The re-plan after an out-of-memory error switches the failing window to a plan that recomputes a layer
    instead of keeping its input; the run equals one on the first plan."""
    cfg = _tight(tmp_path)
    clean = _run(tmp_path, "clean", cfg=cfg, long=True)
    fault = _Fault(monkeypatch, "backward", at=2, request=100_000)
    hit = _run(tmp_path, "hit", cfg=cfg, long=True)
    assert fault.raised == 1 and hit.oom_recoveries == 1
    assert hit.plans.gpu_reduction_bytes == recovery.requested_bytes(f"Tried to allocate {100_000 / MIB:.2f} MiB")
    assert hit.executor.stats.recomputed_layers > 0 and clean.executor.stats.recomputed_layers == 0
    _assert_equal_runs(hit, clean)


def test_a_dropped_step_is_no_calibration_measurement():
    pred = {"step_ms": 1000.0, "compute_ms": 800.0}
    cal = Calibration(steps=1, skip=0)
    cal.add_microbatch(pred)
    cal.drop_step()  # recovered: the micro-batches run again
    cal.add_microbatch(pred)
    assert cal.end_step(5.0) is False and cal.step_ms == []
    cal.add_microbatch(pred)
    assert cal.end_step(1.0) is True and cal.step_ms == [(1000.0, 1000.0, 800.0)]


def test_requested_bytes_reads_the_allocators_message():
    assert recovery.requested_bytes("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has ...") == int(2.5 * 1024**3)
    assert recovery.requested_bytes("Tried to allocate 512.00 KiB") == 512 * 1024
    assert recovery.requested_bytes("out of memory") == 0
