"""The run's plans in one object (lazytrain_hf/hf/plans.py `RunPlans`) and the Trainer's wording of a planning error
(lazytrain_hf/hf/plan.py `trainer_fix`): lazytrain_config keys and TrainingArguments, never the CLI's flags."""

from __future__ import annotations

import re

import pytest

from lazytrain_hf.hf import LazyTrainer, LazyTrainingArguments, plan
from lazytrain_hf.hf.plans import RunPlans
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.milp import InfeasiblePlanError

from .test_trainer import EXACT, _collate, _common, _dataset

GIB = 1024**3


def _trainer(tmp_path, name, **cfg):
    model = load_model("qwen3-tiny", "float32", seed=3)
    args = LazyTrainingArguments(**_common(tmp_path, name, per_device_train_batch_size=4, gradient_accumulation_steps=1),
                                 lazytrain_config={**EXACT, "policy": "milp", **cfg})
    return LazyTrainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)


def test_the_trainer_holds_one_plans_object(tmp_path):
    t = _trainer(tmp_path, "one", gpu_memory_budget="1GiB")
    t.train()
    assert isinstance(t.plans, RunPlans) and t.plans.bucket_plans is not None and t.calibration is t.plans.calibration
    stray = {"bucket_plans", "step_peak_reset", "step_predicted_peak"}
    assert not [k for k in vars(t) if k in stray or k.startswith("plan_")], vars(t).keys()
    # the request was resolved once: the configured budget less the margin
    assert t.plans.request.budgets.gpu_bytes == int(GIB * (1 - t.lazy_config.gpu_memory_margin))
    assert t.plans.current is t.executor.schedule


def test_no_plan_names_the_config_keys_to_change_and_the_budget_named_fits(tmp_path):
    t = _trainer(tmp_path, "tight", gpu_memory_budget="1MiB")
    with pytest.raises(InfeasiblePlanError) as info:
        t.train()
    e, msg = info.value, str(info.value)
    assert (e.batch_size, e.seq_len) == (4, t.plans.request.seq_len) and e.gpu_budget_bytes is not None
    assert e.gpu_budget_bytes == t.plans.request.budgets.gpu_bytes and e.needed_gpu_bytes > 1 << 20
    assert "lazytrain_config.gpu_memory_budget='" in msg and "Fix:" in msg, msg
    assert "--gpu-memory" not in msg and "--batch-size" not in msg and "--rows-per-pass" not in msg, msg
    need = re.search(r"gpu_memory_budget='([0-9.]+)GiB'", msg).group(1)
    assert float(need) * GIB >= e.needed_gpu_bytes - GIB / 200
    # the budget the message names has a plan
    plans = plan.plan_buckets_for_trainer(_trainer(tmp_path, "named", gpu_memory_budget=f"{need}GiB"))
    assert plans.buckets[-1] == e.seq_len


def test_the_trainer_names_a_batch_with_the_same_rows_per_step(tmp_path, monkeypatch):
    t = _trainer(tmp_path, "batch", gpu_memory_budget="1MiB", max_rows_per_pass=2)
    monkeypatch.setattr(plan, "fitting_batch", lambda trainer, resident=None: 3)
    with pytest.raises(InfeasiblePlanError) as info:
        plan.plan_buckets_for_trainer(t)
    msg = str(info.value)
    assert "per_device_train_batch_size=2 with gradient_accumulation_steps=2 (now 4 and 1" in msg, msg
    assert "lazytrain_config.max_rows_per_pass=1 (now 2)" in msg, msg


def test_a_second_train_with_another_batch_size_plans_for_it(tmp_path):
    t = _trainer(tmp_path, "again", gpu_memory_budget="1GiB")
    t.train()
    budgets = t.plans.request.budgets
    t.args.per_device_train_batch_size = 2
    t._train_batch_size = 2
    t.train()
    fresh = _trainer(tmp_path, "fresh", gpu_memory_budget="1GiB")
    fresh.args.per_device_train_batch_size = 2
    fresh.train()
    assert t.plans.request.batch_size == 2 and t.plans.request.budgets == budgets
    assert t.executor.schedule.fingerprint == fresh.executor.schedule.fingerprint


def test_the_fixed_policy_with_no_fitting_row_count_runs_at_one_row_per_pass(tmp_path, caplog):
    """A baseline runs in its leanest setting when its cost model says nothing fits, so that its largest batch is
    where it runs out of memory (benchmarks/results/hybrid-20261202.json: feasible at 81 where the model stops at 73);
    before, it ran the whole micro-batch per pass."""
    t = _trainer(tmp_path, "fixed", gpu_memory_budget="1MiB", policy="fixed")
    with caplog.at_level("WARNING"):
        s = plan.fixed_plan_for_trainer(t)
    assert s.policy == "fixed" and s.rows_per_pass == 1
    assert "Running it at 1 rows per pass (its fewest): expect an out-of-memory error" in caplog.text
    roomy = plan.fixed_plan_for_trainer(_trainer(tmp_path, "roomy", gpu_memory_budget="1GiB", policy="fixed"))
    assert roomy.rows_per_pass == 4  # the whole micro-batch fits
