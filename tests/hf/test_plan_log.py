"""Plan logs a person reads: one short line per bucket plan, and one line when the run is optimizer-bound that
names the accumulation / sequences per optimizer step that would hide the CPU update."""

from __future__ import annotations

import dataclasses
import logging
import re

import torch

from lazytrain_hf.hf import LazyTrainer, LazyTrainingArguments, plan
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.fixed import fixed_schedule

from .test_trainer import EXACT, _collate, _common, _dataset

GIB = 1024**3


def _predicted(step: float, opt: float, transfer: float = 0.0) -> dict:
    return {"step_ms": step, "exposed_optimizer_ms": opt, "exposed_transfer_ms": transfer, "tokens_per_s": 4321.0,
            "peak_gpu_bytes": int(21.3 * GIB), "pinned_host_bytes": int(80.5 * GIB)}


def _share(p: dict, k: int) -> float:
    """The exposed update's share of an optimizer step of k micro-batches (it is exposed once per step)."""
    e = p["exposed_optimizer_ms"]
    return e / (k * (p["step_ms"] - e) + e)


def test_the_accumulation_named_is_the_smallest_that_hides_the_update():
    for step, opt, ga in [(2000.0, 1270.0, 1), (2697.0, 303.0, 1), (400.0, 390.0, 3), (1000.0, 150.0, 1)]:
        p = _predicted(step, opt)
        share, k = plan.optimizer_bound(p, ga)
        assert share == _share(p, ga) > plan.EXPOSED_SHARE
        assert _share(p, k) < plan.EXPOSED_SHARE <= _share(p, k - 1), (step, opt, k)
        assert k > ga


def test_no_line_when_the_update_hides():
    assert plan.optimizer_bound(_predicted(2000.0, 150.0), 1) is None  # 7.5% of the step
    p = _predicted(2000.0, 1270.0)
    _, k = plan.optimizer_bound(p, 1)
    assert plan.optimizer_bound(p, k) is None and plan.optimizer_bound_line(p, 16, k) is None
    assert plan.optimizer_bound(_predicted(2000.0, 0.0), 1) is None


def test_the_optimizer_bound_line_says_what_to_change():
    p = _predicted(2000.0, 1270.0)
    share, k = plan.optimizer_bound(p, 2)
    line = plan.optimizer_bound_line(p, 16, 2)
    step = 2 * (2000.0 - 1270.0) + 1270.0
    assert line.startswith("LazyTrain: optimizer-bound: ") and "\n" not in line and len(line) < 300, line
    assert f"stall 1270 ms of each {step:.0f} ms optimizer step ({100 * share:.0f}%)" in line, line
    assert f"gradient_accumulation_steps={k} (now 2)" in line, line
    assert f">= {16 * k} sequences per optimizer step (now 32)" in line and "under 10%" in line, line


def test_one_short_plan_line_names_what_bounds_the_step():
    sched = fixed_schedule(4, 2, "gpu", 1)
    sched.predicted = _predicted(2012.3, 1270.0, 40.0)
    line = plan.plan_line(sched, 16, 512)
    assert line == ("LazyTrain plan seq 512 x batch 16: step 2012.3 ms, 4,321 tokens/s, peak GPU 21.30 GiB, "
                    "host 80.50 GiB, bound by CPU update (1270 ms exposed)")
    sched.predicted = _predicted(1000.0, 20.0, 300.0)
    assert plan.plan_line(sched, 16, 512).endswith("bound by transfer (300 ms exposed)")
    sched.predicted = _predicted(1000.0, 60.0, 90.0)  # both under 10% of the step
    assert plan.plan_line(sched, 16, 512).endswith("bound by compute")
    sched.predicted = p = _predicted(2000.0, 1270.0)
    _, k = plan.optimizer_bound(p, 1)  # the update is exposed once per optimizer step: enough accumulation hides it
    assert plan.plan_line(sched, 16, 512, k - 1).endswith("bound by CPU update (1270 ms exposed)")
    assert plan.plan_line(sched, 16, 512, k).endswith("bound by compute")


def test_the_trainer_logs_one_line_per_bucket_and_the_optimizer_bound_fix(tmp_path, monkeypatch, caplog):
    """A CPU optimizer far slower than the compute: the plans are optimizer-bound and the run says so once, with the
    accumulation that the plan's own figures say hides the update; every INFO line of the planner is short. (On the
    CPU device the figures are a GPU's, so the hint needs a run whose times are its own: emulated here.)"""
    from lazytrain_hf.hf import plans

    slow = dataclasses.replace(plan.H200_DEFAULTS, cpu_optim_params_per_s=2e6)
    monkeypatch.setattr(plan, "H200_DEFAULTS", slow)
    monkeypatch.setattr(plans, "times_are_this_runs", lambda ex: True)
    model = load_model("qwen3-tiny", "float32", seed=3)
    args = LazyTrainingArguments(**_common(tmp_path, "slow", max_steps=1, per_device_train_batch_size=4,
                                           gradient_accumulation_steps=1),
                                 lazytrain_config={**EXACT, "policy": "milp"})
    t = LazyTrainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    with caplog.at_level(logging.INFO, logger="lazytrain_hf"):
        t.train()
    records = [r for r in caplog.records if r.name.startswith("lazytrain_hf.hf.plan")]
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    buckets = t.plans.bucket_plans.buckets
    lines = [m for m in info if m.startswith("LazyTrain plan seq ")]
    assert [int(re.match(r"LazyTrain plan seq (\d+) x batch 4:", m).group(1)) for m in lines] == buckets, info
    assert all("bound by CPU update" in m for m in lines), lines
    assert all(len(m) < 200 and "{" not in m for m in info), info
    bound = [r.getMessage() for r in records if "optimizer-bound" in r.getMessage()]
    assert len(bound) == 1 and all(r.levelno == logging.WARNING for r in records if "optimizer-bound" in r.getMessage())
    _, k = plan.optimizer_bound(t.plans.current.predicted, 1)
    assert f"gradient_accumulation_steps={k} (now 1)" in bound[0], bound


def test_no_optimizer_bound_hint_from_a_gpus_figures_on_the_cpu_device(tmp_path, caplog):
    """On the CPU device the plan is made with H200 figures: the hint would be about another machine."""
    slow = dataclasses.replace(plan.H200_DEFAULTS, cpu_optim_params_per_s=2e6)
    model = load_model("qwen3-tiny", "float32", seed=3)
    args = LazyTrainingArguments(**_common(tmp_path, "cpu", max_steps=1, per_device_train_batch_size=4),
                                 lazytrain_config={**EXACT, "policy": "milp"})
    t = LazyTrainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    import unittest.mock

    with unittest.mock.patch.object(plan, "H200_DEFAULTS", slow), caplog.at_level(logging.INFO, logger="lazytrain_hf"):
        t.train()
    assert plan.optimizer_bound(t.plans.current.predicted, 1) is not None  # the figures are optimizer-bound
    assert not [r for r in caplog.records if "optimizer-bound" in r.getMessage()]


def test_only_the_main_process_logs_the_plan_lines(tmp_path, monkeypatch, caplog):
    """Data parallel: every rank plans the same run; rank 1 logged rank 0's plan lines again (now at DEBUG)."""
    from lazytrain_hf.hf import plans

    slow = dataclasses.replace(plan.H200_DEFAULTS, cpu_optim_params_per_s=2e6)  # optimizer-bound: the warning too
    monkeypatch.setattr(plan, "H200_DEFAULTS", slow)
    monkeypatch.setattr(plans, "times_are_this_runs", lambda ex: True)
    model = load_model("qwen3-tiny", "float32", seed=3)
    args = LazyTrainingArguments(**_common(tmp_path, "rank1", max_steps=1, per_device_train_batch_size=4),
                                 lazytrain_config={**EXACT, "policy": "milp"})
    t = LazyTrainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    monkeypatch.setattr(t, "is_world_process_zero", lambda: False)
    with caplog.at_level(logging.DEBUG, logger="lazytrain_hf"):
        t.train()
    records = [r for r in caplog.records if r.name.startswith("lazytrain_hf.hf.plan")]
    plan_lines = [r for r in records if r.getMessage().startswith(("LazyTrain plan seq ", "LazyTrain schedule:",
                                                                  "LazyTrain: optimizer-bound"))]
    assert len(plan_lines) >= 3 and all(r.levelno == logging.DEBUG for r in plan_lines), plan_lines
    assert not [r.getMessage() for r in records if r.levelno >= logging.INFO]
    assert plan.plan_log_level(t) == logging.DEBUG and plan.plan_log_level(object()) == logging.INFO


def test_a_plain_list_of_rows_is_planned_at_its_longest_row(tmp_path, caplog):
    rows = [{"input_ids": [1] * n, "attention_mask": [1] * n, "labels": [1] * n} for n in (5, 17, 9)]
    args = LazyTrainingArguments(**_common(tmp_path, "rows", per_device_train_batch_size=2),
                                 lazytrain_config={**EXACT, "device": "cpu"})
    tr = LazyTrainer(model=load_model("qwen3-tiny", "float32", seed=0), args=args, train_dataset=rows,
                     data_collator=_collate)
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf"):
        assert plan.run_shape(tr) == (2, 24)
    assert "cannot read input_ids lengths" not in caplog.text


def test_unreadable_lengths_warn_once(tmp_path, caplog):
    class Rows(torch.utils.data.Dataset):
        rows = [{"input_ids": [1] * 8, "attention_mask": [1] * 8, "labels": [1] * 8}] * 4

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]  # rows by index only: ds["input_ids"] is a TypeError

    args = LazyTrainingArguments(**_common(tmp_path, "ds", per_device_train_batch_size=2),
                                 lazytrain_config={**EXACT, "device": "cpu"})
    tr = LazyTrainer(model=load_model("qwen3-tiny", "float32", seed=0), args=args, train_dataset=Rows(),
                     data_collator=_collate)
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf"):
        assert plan.run_shape(tr) == (2, 1024) and plan.run_shape(tr) == (2, 1024)
    assert caplog.text.count("cannot read input_ids lengths from the training data (Rows)") == 1, caplog.text


def test_fixed_policy_knobs_under_the_default_milp_policy_are_named_unused(tmp_path, caplog):
    """The default policy is the MILP: checkpoint_every / activation_tier changed from their defaults (the fixed
    policy's schedule) are said to be unused, once; the defaults say nothing."""
    model = load_model("qwen3-tiny", "float32", seed=3)

    def build(name, cfg):
        args = LazyTrainingArguments(**_common(tmp_path, name, max_steps=1), lazytrain_config=cfg)
        return LazyTrainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size),
                           data_collator=_collate)

    with caplog.at_level(logging.WARNING, logger="lazytrain_hf"):
        build("knobs", {"checkpoint_every": 2, "activation_tier": "cpu"}).train()
    unused = [r.getMessage() for r in caplog.records if "fixed policy's schedule" in r.getMessage()]
    assert len(unused) == 1 and "checkpoint_every=2 and activation_tier='cpu'" in unused[0], unused
    assert "Set policy: fixed" in unused[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf"):
        build("defaults", {}).train()
        build("fixed", {"policy": "fixed", "checkpoint_every": 2}).train()
    assert not [r for r in caplog.records if "fixed policy's schedule" in r.getMessage()]
