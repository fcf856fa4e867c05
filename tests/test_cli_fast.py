"""`lazytrain-hf` checks its arguments, the recipe and the overrides before importing torch / transformers (~13 s):
a mistake fails in well under a second. `import lazytrain_hf` still registers the optimizer, as soon as transformers
is imported. Each check runs in a fresh interpreter (this test process has torch loaded already)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "cpu_default.yaml"


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_bad_arguments_fail_before_torch_or_transformers_import(tmp_path):
    """Every bad input below exits 2 with one error naming the fix, in a process that never imports torch,
    transformers or datasets (before: each paid ~13 s of imports first)."""
    missing_data = tmp_path / "no-such-data"
    data = tmp_path / "gsm8k.jsonl"  # a valid local source, so the model check is the only problem
    data.write_text(json.dumps({"question": "1+1?", "answer": "2 #### 2"}) + "\n")
    cases = {
        "missing recipe": (["train", "--config", "nope.yaml"], "no recipe at 'nope.yaml'"),
        "--set without =": (["train", "--config", str(RECIPE), "--set", "training.max_steps"], "section.key=value"),
        "bad --set value": (["train", "--config", str(RECIPE), "--set", "data.max_length=abc"],
                            r"data.max_length must be int"),
        "unknown training key": (["train", "--config", str(RECIPE), "--set", "training.learning_rat=1e-3"],
                                 "training.learning_rat"),
        "unknown model key": (["train", "--config", str(RECIPE), "--set", "model.nam=x"], "model.nam"),
        "training value of the wrong type": (["train", "--config", str(RECIPE), "--set", "training.max_steps=abc"],
                                             "training.max_steps must be a positive integer"),
        "zero accumulation steps": (["train", "--config", str(RECIPE), "--set",
                                     "training.gradient_accumulation_steps=0"],
                                    "training.gradient_accumulation_steps must be a positive integer"),
        "negative learning rate": (["train", "--config", str(RECIPE), "--set", "training.learning_rate=-1"],
                                   "training.learning_rate must be a positive number"),
        "zero max_length": (["train", "--config", str(RECIPE), "--set", "data.max_length=0"],
                            "data.max_length must be >= 1"),
        "bad lazytrain value": (["train", "--config", str(RECIPE), "--set", "lazytrain.policy=fastest"],
                                "policy must be one of"),
        "missing data": (["train", "--config", str(RECIPE), "--set", f"data.source={missing_data}"],
                         "math data set not found"),
        "missing tokenizer dir": (["train", "--config", str(RECIPE), "--set", "tokenizer.name_or_path=./no-tok"],
                                  "tokenizer path"),
        "missing model dir": (["train", "--config", str(RECIPE), "--set", "model.name_or_path=./no-model",
                               "--set", f"data.source={data}"], "Known config names"),
        "resume last, nothing to resume": (["train", "--config", str(RECIPE), "--resume", "last", "--set",
                                            f"training.output_dir={tmp_path / 'fresh'}"], "no checkpoint-N/"),
        "plan: bad size unit": (["plan", "--model", "qwen2.5-7b", "--gpu-memory", "24XB"], "24GiB"),
        "plan: missing model dir": (["plan", "--model", "./no-model"], "Known config names"),
        "plan: zero time limit": (["plan", "--model", "qwen2.5-7b", "--time-limit", "0"], "--time-limit must be > 0"),
        "plan: gap of 2": (["plan", "--model", "qwen2.5-7b", "--mip-gap", "2"], "--mip-gap must be in [0, 1)"),
        "plan: zero GPU memory": (["plan", "--model", "qwen2.5-7b", "--gpu-memory", "0GiB"],
                                  "--gpu-memory must be > 0"),
        "plan: zero host memory": (["plan", "--model", "qwen2.5-7b", "--host-memory", "0GiB"],
                                   "--host-memory must be > 0"),
        "plan: negative max batch": (["plan", "--model", "qwen2.5-7b", "--max-batch", "-3"], "--max-batch must be"),
        "plan: NVMe budget without dir": (["plan", "--model", "qwen2.5-7b", "--nvme-budget", "10GiB"],
                                          "--nvme-budget needs --nvme-dir"),
        "plan: --nvme-dir is a file": (["plan", "--model", "qwen2.5-7b", "--nvme-dir", str(data)],
                                       "--nvme-dir " + str(data) + ": exists and is not a directory"),
        "plan: --out-dir is a file": (["plan", "--model", "qwen2.5-7b", "--out-dir", str(data)],
                                      "--out-dir " + str(data) + ": exists and is not a directory"),
        "plan: --nvme-dir cannot be made": (["plan", "--model", "qwen2.5-7b", "--nvme-dir", str(data / "sub")],
                                            "--nvme-dir " + str(data / "sub") + ": cannot create the directory"),
    }
    code = f"""
        import contextlib, io, json, sys
        from lazytrain_hf import cli
        out = {{}}
        for name, (argv, _) in {json.dumps(cases)}.items():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = cli.main(argv)
            out[name] = [rc, err.getvalue()]
        heavy = sorted(m for m in ("torch", "transformers", "datasets") if m in sys.modules)
        print(json.dumps({{"results": out, "heavy": heavy}}))
    """
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (_, match) in cases.items():
        rc, err = doc["results"][name]
        assert rc == 2, (name, err)
        assert err.count("error") == 1 or err.startswith("lazytrain-hf plan: invalid arguments"), (name, err)
        assert match in err, (name, err)
    assert doc["heavy"] == [], f"imported before the arguments were checked: {doc['heavy']}"


def test_package_import_is_light_and_still_registers_the_optimizer():
    """`import lazytrain_hf` loads neither torch nor transformers, and a stock script that imports transformers
    afterwards still gets optim="lazytrain_hybrid8" (enum, handler table, fused clipping)."""
    proc = _python("""
        import sys
        import lazytrain_hf
        assert "torch" not in sys.modules and "transformers" not in sys.modules, "heavy import at package import"
        from transformers import TrainingArguments
        args = TrainingArguments(output_dir="unused", optim="lazytrain_hybrid8", report_to=[], use_cpu=True)
        from transformers import Trainer
        from lazytrain_hf.hf.register import is_registered
        assert is_registered() and Trainer._clip_grad_norm._lazytrain_fused
        assert Trainer.get_optimizer_cls_and_kwargs(args)[0] is lazytrain_hf.Hybrid8bitOptimizer
        from lazytrain_hf.hf.register import _PostImportHook
        assert not any(isinstance(f, _PostImportHook) for f in sys.meta_path), "the hook stays installed"
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


def test_training_argument_fields_without_importing_transformers():
    """The unknown-training-key check reads TrainingArguments' fields from source: the same set as the class."""
    proc = _python("""
        import dataclasses, sys
        from lazytrain_hf.recipe import training_argument_fields
        cheap = training_argument_fields()
        assert "transformers" not in sys.modules
        from transformers import TrainingArguments
        assert cheap == {f.name for f in dataclasses.fields(TrainingArguments)}, cheap
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr


def test_memory_sizes_from_the_environment(monkeypatch):
    """LAZYTRAIN_<SIZE> variables take sizes as the fields do ("24GiB", bytes); a negative prepared-states budget
    is refused with the fix."""
    import pytest

    from lazytrain_hf.config import LazyTrainConfig

    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_BUDGET", "24GiB")
    monkeypatch.setenv("LAZYTRAIN_PREPARED_STATES_BUDGET", "0")
    cfg = LazyTrainConfig()
    assert cfg.gpu_memory_budget == 24 * 2**30 and cfg.prepared_states_budget == 0
    with pytest.raises(ValueError, match="prepared_states_budget must be a size >= 0") as e:
        LazyTrainConfig(prepared_states_budget=-1, gpu_memory_budget=-5)
    assert "gpu_memory_budget must be a size >= 0 such as '24GiB', but got -5" in str(e.value)
    with pytest.raises(ValueError, match="prepared_states_budget needs overlap_optimizer=True"):
        LazyTrainConfig(prepared_states_budget="1GiB", overlap_optimizer=False)
    monkeypatch.setenv("LAZYTRAIN_PREPARED_STATES_BUDGET", "20 gigs")  # the error names the variable set
    with pytest.raises(ValueError, match="environment LAZYTRAIN_PREPARED_STATES_BUDGET must be a size .*'20 gigs'"):
        LazyTrainConfig()


def test_recipe_errors_bools_yaml_and_unknown_keys_all_at_once(tmp_path):
    """True/false settings take only booleans ("false" would read as true); an unknown lazytrain key is reported
    with the other lazytrain problems; broken YAML (file or --set value) is one error, not a traceback."""
    import pytest

    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.recipe import load_recipe

    with pytest.raises(ValueError) as e:
        LazyTrainConfig(profile_layers="maybe", overlap_optimizer="false", pin_memory=1)
    for key in ("profile_layers", "overlap_optimizer", "pin_memory"):
        assert f"lazytrain_config.{key} must be true or false" in str(e.value)
    with pytest.raises(ValueError) as e:
        LazyTrainConfig.from_any({"bogus": 1, "dp_updates": "zero", "profile_layers": "maybe"})
    assert "['bogus']" in str(e.value) and "dp_updates must be one of" in str(e.value)
    assert "profile_layers must be true or false" in str(e.value)

    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [qwen3-tiny\ntraining:\n  max_steps: 2\n")
    with pytest.raises(ValueError, match=r"broken.yaml: not valid YAML at line 2"):
        load_recipe(broken)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu_default.yaml"
    with pytest.raises(ValueError, match=r"data.train_limit must be int \| None, but got '\[1'"):
        load_recipe(recipe, ["data.train_limit=[1"])
    # YAML 1.1 words: text for a string / enum field (save_strategy=no), a boolean for a bool field
    r = load_recipe(recipe, ["training.save_strategy=no", "lazytrain.pin_memory=off", "training.disable_tqdm=yes",
                             "training.remove_unused_columns=off"])
    assert r.training["save_strategy"] == "no" and r.lazytrain["pin_memory"] is False
    assert r.training["disable_tqdm"] is True and r.training["remove_unused_columns"] is False
    with pytest.raises(ValueError, match=r"training.disable_tqdm must be true or false, but got 'maybe'"):
        load_recipe(recipe, ["training.disable_tqdm=maybe"])
    with pytest.raises(ValueError) as e:  # a recipe's errors use the recipe's names (lazytrain.<key>)
        load_recipe(recipe, ["lazytrain.bogus=1", "lazytrain.profile_layers=maybe"])
    assert "Unknown lazytrain key(s) ['bogus']" in str(e.value) and "lazytrain.profile_layers must be" in str(e.value)
    assert "lazytrain_config" not in str(e.value)


def test_data_files_with_other_columns_fail_before_the_imports(tmp_path):
    import pytest

    from lazytrain_hf.sources import check_data_columns

    good, bad, broken = tmp_path / "good.jsonl", tmp_path / "bad.jsonl", tmp_path / "broken.jsonl"
    good.write_text('\n{"query": "1+1?", "response": "The answer is: 2"}\n')
    bad.write_text('{"q": "1+1?", "a": "2"}\n')
    broken.write_text("{not json\n")
    check_data_columns(good)
    with pytest.raises(ValueError, match=r"rows have columns \['a', 'q'\].*Fix"):
        check_data_columns(bad)
    with pytest.raises(ValueError, match="is not JSON Lines"):
        check_data_columns(broken)


def test_unknown_recipe_keys_suggest_the_close_one():
    """A typo of a known key names the key it probably meant (difflib); a key far from every known one does not."""
    import pytest

    from lazytrain_hf.recipe import load_recipe

    with pytest.raises(ValueError) as e:
        load_recipe(RECIPE, ["training.max_step=10", "lazytrain.polcy=milp", "data.max_lenght=3", "model.zzz=1"])
    text = str(e.value)
    for hint in ("did you mean training.max_steps?", "did you mean lazytrain.policy?", "did you mean data.max_length?"):
        assert hint in text, text
    assert "model.zzz" in text and "did you mean model." not in text


def test_recipe_sizes_without_a_unit_are_refused_before_the_imports():
    """`--set lazytrain.gpu_memory_budget=24` (or `24` in the YAML) would be 24 bytes, surely not meant: the recipe
    refuses it with the fix, as `lazytrain-hf plan --gpu-memory 24` does; 0 (off) and sizes with a unit pass."""
    import pytest

    from lazytrain_hf.recipe import load_recipe

    with pytest.raises(ValueError) as e:
        load_recipe(RECIPE, ["lazytrain.gpu_memory_budget=24", "lazytrain.host_memory_budget=100.5"])
    text = str(e.value)
    assert "lazytrain.gpu_memory_budget: 24 has no unit" in text and "e.g. 24GiB" in text, text
    assert "lazytrain.host_memory_budget: 100.5 has no unit" in text, text
    r = load_recipe(RECIPE, ["lazytrain.gpu_memory_budget=24GiB", "lazytrain.prepared_states_budget=0"])
    assert r.lazytrain["gpu_memory_budget"] == "24GiB" and r.lazytrain["prepared_states_budget"] == 0


def test_a_model_larger_than_the_host_limit_fails_before_the_data_or_the_model_load(tmp_path):
    """The weights alone above the process's host-memory limit (a 1 GiB cgroup here, a 7B model in fp32): one error
    naming the need, the limit and its source, before the data set is read or any weight allocated (it had built
    the model for minutes until the allocation failed)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "memory.max").write_text(str(1 << 30))
    data = tmp_path / "gsm8k.jsonl"  # a valid local source, so the recipe preflight passes wherever the clone is
    data.write_text(json.dumps({"question": "1+1?", "answer": "2 #### 2"}) + "\n")
    out = _python(f"""
        import os, sys
        os.environ["LAZYTRAIN_CGROUP_ROOT"] = {str(root)!r}
        import lazytrain_hf.data as data, lazytrain_hf.models as models
        def never(*a, **k):
            raise AssertionError("loaded before the check")
        data.load_math_dataset = models.load_model = never
        from lazytrain_hf.cli import main
        print("RC", main(["train", "--config", {str(RECIPE)!r}, "--set", "model.name_or_path=qwen2.5-7b",
                          "--set", "training.output_dir={tmp_path / 'out'}", "--set", "data.source={data}"]))
        """, timeout=300)
    err = out.stderr
    assert "RC 2" in out.stdout and "AssertionError" not in err, out.stdout[-2000:] + err[-3000:]
    assert "error: LazyTrain: building 'qwen2.5-7b' (7.62 B parameters in float32) needs 28.37 GiB" in err, err
    assert f"cgroup v2 memory.max at {root / 'memory.max'}" in err and "Fix: a smaller model" in err, err


def test_a_recipe_with_label_smoothing_and_the_sliced_head_is_refused_before_the_model_loads():
    """Label smoothing makes the loss the Trainer's, which multiplies by the whole LM head: the sliced head cannot
    run it, and the recipe says so when it is read (the Trainer refuses it too, after the model is loaded)."""
    import pytest

    from lazytrain_hf.recipe import load_recipe

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu_default.yaml"
    with pytest.raises(ValueError, match=r"'host_sliced'.*label_smoothing_factor=0.1 makes.*set resident_placement"):
        load_recipe(recipe, ["lazytrain.resident_placement=host_sliced", "training.label_smoothing_factor=0.1"])
    for sets in (["lazytrain.resident_placement=host", "training.label_smoothing_factor=0.1"],
                 ["lazytrain.resident_placement=host_sliced", "training.label_smoothing_factor=0.0"]):
        load_recipe(recipe, sets)
