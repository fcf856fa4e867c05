"""LazyTrainConfig by concern: grouped and flat keys in Python, dicts, JSON, YAML and --set; flat attribute aliases;
one error for every problem; old flat artifacts still load; docs/configuration.md is generated from the help."""

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

import lazytrain_hf.config as config_module
from lazytrain_hf import envvars
from lazytrain_hf.config import (
    FLAT_KEYS,
    GROUPS,
    LazyTrainConfig,
    MemoryConfig,
    PlanningConfig,
    config_fields,
    render_markdown,
)
from lazytrain_hf.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
RECIPE = ROOT / "recipes" / "cpu_default.yaml"
# a value other than the default for each flat key
CHANGED = {"policy": "milp", "device": "cpu", "checkpoint_every": 2, "activation_tier": "cpu", "prefetch_depth": 2,
           "gpu_memory_budget": 3 << 30, "cap_gpu_memory": True, "gpu_memory_margin": 0.2,
           "host_memory_budget": 5 << 30, "nvme_dir": "/tmp/nvme", "nvme_budget": 7 << 30, "pin_memory": False,
           "max_rows_per_pass": 8, "overlap_optimizer": True, "gpu_layer_updates": False, "keep_gpu_grads": False,
           "prepared_states_budget": 1 << 30, "dp_updates": "sharded", "loss_chunk_tokens": 512,
           "schedule_path": None, "plan_buckets": 2, "solver_time_limit_s": 3.0, "profile_layers": False,
           "calibrate_steps": 0, "solver_mip_rel_gap": 0.05, "state_dtype": "fp32", "master_weights": "kahan",
           "block_size": 128, "min_8bit_size": 16, "fp32_state_modules": ["q_proj"], "resident_placement": "host",
           "compile_linear_attention": True, "interrupt_grace_period": 90.0, "dp_host_weights": "per_rank",
           "resident_state_dtype": "8bit", "expandable_segments": False}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in envvars.table():
        monkeypatch.delenv(name, raising=False)


def _grouped(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        g, key = FLAT_KEYS[k].split(".")
        out.setdefault(g, {})[key] = v
    return out


def test_every_field_has_help_and_one_flat_key():
    names = [f.name for _, f in config_fields()]
    assert len(names) == len(set(names)) == len(FLAT_KEYS) == len(CHANGED)
    assert set(CHANGED) == set(FLAT_KEYS)
    for g, f in config_fields():
        assert FLAT_KEYS[f.name] == f"{g}.{f.name}" and f.metadata["help"].strip()
    assert set(GROUPS) == {f.name for f in dataclasses.fields(LazyTrainConfig)}


def test_grouped_flat_and_mixed_keys_build_the_same_config():
    flat = LazyTrainConfig(**CHANGED)
    grouped = LazyTrainConfig(**_grouped(CHANGED))
    assert flat == grouped == LazyTrainConfig.from_any(_grouped(CHANGED)) == LazyTrainConfig.from_any(json.dumps(
        _grouped(CHANGED)))
    assert flat.to_dict() == CHANGED and flat.to_dict(grouped=True) == _grouped(CHANGED)
    half = dict(list(CHANGED.items())[:15])
    mixed = {**_grouped(half), **{k: v for k, v in CHANGED.items() if k not in half}}
    assert LazyTrainConfig.from_any(mixed) == flat
    for k, v in CHANGED.items():  # each flat key lands in its group, the rest keep their defaults
        g, key = FLAT_KEYS[k].split(".")
        one = LazyTrainConfig(**{k: v}) if k not in ("dp_updates", "prepared_states_budget") else \
            LazyTrainConfig(**{k: v, "overlap_optimizer": True})
        assert getattr(getattr(one, g), key) == v == getattr(one, k)
    assert LazyTrainConfig(planning=PlanningConfig(policy="milp"), memory=MemoryConfig(gpu_memory_budget="1GiB")) \
        == LazyTrainConfig(policy="milp", gpu_memory_budget=1 << 30)


def test_the_same_field_both_ways():
    assert LazyTrainConfig.from_any({"policy": "milp", "planning": {"policy": "milp"}}).policy == "milp"
    with pytest.raises(ValueError) as e:
        LazyTrainConfig.from_any({"policy": "fixed", "planning": {"policy": "milp"}, "block_size": 100})
    msg = str(e.value)
    assert "lazytrain_config.policy='fixed' and lazytrain_config.planning.policy='milp' set the same field" in msg
    assert "lazytrain_config.block_size must be a power of two" in msg  # the other problems in the same error
    # a flat key next to a group dataclass edits a copy of it, as dataclasses.replace does
    base = PlanningConfig(policy="milp", checkpoint_every=2)
    cfg = LazyTrainConfig(planning=base, checkpoint_every=3)
    assert (cfg.policy, cfg.checkpoint_every, base.checkpoint_every) == ("milp", 3, 2)


def test_flat_attributes_read_write_and_class_defaults(monkeypatch):
    cfg = LazyTrainConfig(policy="milp")
    cfg.checkpoint_every = 6
    assert cfg.planning.checkpoint_every == 6
    cfg.planning.policy = "fixed"
    assert cfg.policy == "fixed"
    assert LazyTrainConfig.gpu_memory_margin == 0.12 and LazyTrainConfig.block_size == 256
    assert LazyTrainConfig.fp32_state_modules == [] and LazyTrainConfig.loss_chunk_tokens == 2048
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVERY", "3")
    copy = dataclasses.replace(cfg, policy="milp", block_size=64)
    assert (copy.policy, copy.checkpoint_every, copy.block_size, cfg.policy) == ("milp", 6, 64, "fixed")
    copy.prefetch_depth = 3  # the copy's groups are its own
    assert cfg.prefetch_depth == 1


def test_every_problem_in_one_error_named_as_written():
    with pytest.raises(ValueError) as e:
        LazyTrainConfig.from_any({"planing": {}, "checkpoint_evry": 3, "planning": {"polcy": "milp", "prefetch_depth": 9,
                                  "gpu_memory_budget": "1GiB"}, "optimizer": 3, "block_size": 100,
                                  "memory": {"nvme_budget": "lots"}})
    msg = str(e.value)
    assert msg.startswith("Invalid LazyTrain configuration:\n  - Unknown lazytrain_config key(s) ['checkpoint_evry', "
                          "'planing']")
    assert "did you mean lazytrain_config.planning, lazytrain_config.checkpoint_every?" in msg
    assert "Unknown lazytrain_config key(s) ['planning.polcy']" in msg
    assert "did you mean lazytrain_config.planning.policy?" in msg
    assert ("lazytrain_config.planning.gpu_memory_budget: gpu_memory_budget is a key of memory; write "
            "lazytrain_config.memory.gpu_memory_budget") in msg
    assert "lazytrain_config.optimizer must be a mapping of its keys" in msg
    assert "lazytrain_config.planning.prefetch_depth must be an integer in [1, 3], but got 9" in msg
    assert "lazytrain_config.block_size must be a power of two" in msg  # flat, as written
    assert "lazytrain_config.memory.nvme_budget: expected a size" in msg
    with pytest.raises(ValueError, match=r"lazytrain_config.planning.policy must be one of"):
        PlanningConfig(policy="greedy")  # a group built alone checks itself
    with pytest.raises(ValueError, match=r"lazytrain_config.activation_tier='nvme' needs lazytrain_config.memory."
                                         r"nvme_dir"):
        LazyTrainConfig(activation_tier="nvme")
    with pytest.raises(TypeError):
        LazyTrainConfig(*range(40))


def test_recipes_and_set_take_both_spellings(tmp_path):
    grouped = load_recipe(RECIPE, ["lazytrain.planning.policy=milp", "lazytrain.experimental.pin_memory=off",
                                   "lazytrain.memory.gpu_memory_budget=2GiB"])
    flat = load_recipe(RECIPE, ["lazytrain.policy=milp", "lazytrain.pin_memory=off",
                                "lazytrain.gpu_memory_budget=2GiB"])
    a, b = LazyTrainConfig.from_any(grouped.lazytrain), LazyTrainConfig.from_any(flat.lazytrain)
    assert a == b and (a.policy, a.pin_memory, a.gpu_memory_budget) == ("milp", False, 2 << 30)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.read_text() + "\nlazytrain:\n  policy: fixed\n  planning:\n    checkpoint_every: 2\n")
    over = load_recipe(recipe, ["lazytrain.planning.policy=milp", "lazytrain.checkpoint_every=3"])
    cfg = LazyTrainConfig.from_any(over.lazytrain)  # an override replaces the field in either spelling
    assert (cfg.policy, cfg.checkpoint_every) == ("milp", 3)
    with pytest.raises(ValueError) as e:
        load_recipe(recipe, ["lazytrain.planning.polcy=milp", "lazytrain.memory.gpu_memory_budget=24",
                             "lazytrain.planning.prefetch_depth=9"])
    msg = str(e.value)
    assert "Unknown lazytrain key(s) ['planning.polcy']" in msg and "did you mean lazytrain.planning.policy?" in msg
    assert "lazytrain.memory.gpu_memory_budget: 24 has no unit" in msg
    assert "lazytrain.planning.prefetch_depth must be an integer in [1, 3]" in msg and "lazytrain_config" not in msg


def test_a_pickled_flat_config_loads(monkeypatch):
    """An instance pickled when LazyTrainConfig was one flat dataclass (its fields: today's flat keys)."""
    @dataclasses.dataclass
    class LazyTrainConfig:  # noqa: F811  (the old class, under the old name)
        pass

    LazyTrainConfig.__module__, LazyTrainConfig.__qualname__ = config_module.__name__, "LazyTrainConfig"
    old = LazyTrainConfig()
    old.__dict__.update({k: v for k, v in CHANGED.items()})
    monkeypatch.setattr(config_module, "LazyTrainConfig", LazyTrainConfig)
    data = pickle.dumps(old)
    monkeypatch.undo()
    loaded = pickle.loads(data)
    assert type(loaded) is config_module.LazyTrainConfig and loaded == config_module.LazyTrainConfig(**CHANGED)
    assert pickle.loads(pickle.dumps(loaded)) == loaded


def test_training_args_with_a_flat_config_load_and_keep_grouped_keys(tmp_path):
    from transformers import HfArgumentParser

    from lazytrain_hf.hf.args import LazyTrainingArguments

    args = LazyTrainingArguments(output_dir=str(tmp_path), report_to=[])
    args.lazytrain_config = {k: v for k, v in CHANGED.items()}  # as a training_args.bin of the flat config holds it
    path = tmp_path / "training_args.bin"
    torch.save(args, path)
    assert torch.load(path, weights_only=False).lazy_config == LazyTrainConfig(**CHANGED)
    grouped = LazyTrainingArguments(output_dir=str(tmp_path), report_to=[],
                                    lazytrain_config={"planning": {"policy": "none"}})
    assert grouped.lazytrain_config["policy"] == "none" and grouped.lazy_config.policy == "none"
    (parsed,) = HfArgumentParser(LazyTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--report_to", "none",
         "--lazytrain_config", '{"planning": {"checkpoint_every": 2}, "block_size": 128}'])
    assert (parsed.lazy_config.checkpoint_every, parsed.lazy_config.block_size) == (2, 128)


def test_a_saved_schedule_loads_through_either_spelling(tmp_path):
    from lazytrain_hf.planning.fixed import fixed_schedule
    from lazytrain_hf.planning.schedule import Schedule

    path = tmp_path / "schedule.json"
    schedule = fixed_schedule(4)
    schedule.to_json(path)
    cfg = LazyTrainConfig(planning={"schedule_path": str(path)})
    assert cfg == LazyTrainConfig(schedule_path=str(path)) and Schedule.from_json(cfg.schedule_path) == schedule
    with pytest.raises(ValueError, match=r"lazytrain_config.planning.schedule_path: no file"):
        LazyTrainConfig(planning={"schedule_path": str(tmp_path / "missing.json")})


def test_committed_docs_equal_the_rendered_tables():
    assert DOC.read_text() == render_markdown(), "regenerate: python -m lazytrain_hf.config > " + str(DOC)



def test_a_size_string_needs_its_unit_in_python_and_the_environment_too(monkeypatch):
    """A number is a byte count (tiny models' budgets are small); a string is what a person typed or an environment
    variable holds, so "24" is refused with the fix instead of planning for 24 bytes."""
    assert LazyTrainConfig(gpu_memory_budget=24 << 30).gpu_memory_budget == 24 << 30
    assert LazyTrainConfig(gpu_memory_budget="24B").gpu_memory_budget == 24
    assert LazyTrainConfig(prepared_states_budget="0").prepared_states_budget == 0  # 0 in any unit
    with pytest.raises(ValueError, match=r"'24' has no unit \(it would be 24 bytes\); give one, e.g. '24GiB'"):
        LazyTrainConfig(gpu_memory_budget="24")
    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_BUDGET", "24")
    with pytest.raises(ValueError, match="LAZYTRAIN_GPU_MEMORY_BUDGET must be a size with its unit"):
        LazyTrainConfig()


def test_a_grace_period_is_a_duration_in_python_yaml_and_the_environment(monkeypatch, tmp_path):
    assert LazyTrainConfig().interrupt_grace_period is None
    assert LazyTrainConfig(interrupt_grace_period="90s").interrupt_grace_period == 90.0
    assert LazyTrainConfig(interruption={"interrupt_grace_period": "1.5min"}).interrupt_grace_period == 90.0
    assert LazyTrainConfig(interrupt_grace_period=30).interrupt_grace_period == 30.0  # a number: seconds
    with pytest.raises(ValueError) as e:
        LazyTrainConfig(interrupt_grace_period="90")
    assert "lazytrain_config.interrupt_grace_period: '90' has no unit; give one, e.g. '90s'" in str(e.value)
    with pytest.raises(ValueError, match=r"interruption.interrupt_grace_period must be a duration > 0"):
        LazyTrainConfig(interruption={"interrupt_grace_period": "0s"})
    with pytest.raises(ValueError, match="expected a duration such as '90s'"):
        LazyTrainConfig(interrupt_grace_period="2 days")
    recipe = load_recipe(RECIPE, ["lazytrain.interrupt_grace_period=2min"])
    assert LazyTrainConfig.from_any(recipe.lazytrain).interrupt_grace_period == 120.0
    monkeypatch.setenv("LAZYTRAIN_INTERRUPT_GRACE_PERIOD", "45s")
    assert LazyTrainConfig().interrupt_grace_period == 45.0
    assert LazyTrainConfig(interrupt_grace_period=None).interrupt_grace_period is None  # given: the variable unread
    monkeypatch.setenv("LAZYTRAIN_INTERRUPT_GRACE_PERIOD", "45")
    with pytest.raises(ValueError, match="LAZYTRAIN_INTERRUPT_GRACE_PERIOD must be a duration with its unit"):
        LazyTrainConfig()


def test_a_config_pickled_before_a_group_existed_gets_its_defaults():
    cfg = LazyTrainConfig(policy="milp", interrupt_grace_period="1min")
    state = dict(cfg.__dict__)
    del state["interruption"]
    old = LazyTrainConfig.__new__(LazyTrainConfig)
    old.__setstate__(state)
    assert old.policy == "milp" and old.interrupt_grace_period is None and old == LazyTrainConfig(policy="milp")
