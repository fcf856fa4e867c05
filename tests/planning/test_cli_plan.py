"""`lazytrain-hf plan` (lazytrain_hf/cli_plan.py) on a tiny registry model: the printed plan and the files; one
clear error per bad input."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from lazytrain_hf import cli_plan
from lazytrain_hf.planning import Schedule


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli_plan.add_arguments(p)
    return p.parse_args(list(argv))


def test_plan_prints_the_table_and_writes_files(tmp_path, capsys):
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB",
                            "--batch-size", "2", "--seq-len", "64", "--max-batch", "64", "--hardware", "defaults",
                            "--out-dir", str(tmp_path)))
    out = capsys.readouterr().out
    assert rc == 0
    for text in ("layer  kind", "predicted step", "tokens/s", "peak GPU", "exposed transfer", "solver: optimal",
                 "largest feasible batch"):
        assert text in out
    assert len([ln for ln in out.splitlines() if ln.strip().startswith(("0 ", "1 ", "2 ", "3 "))]) == 4
    sched = Schedule.from_json(next(tmp_path.glob("*.schedule.json")))
    assert sched.num_layers == 4 and sched.policy == "milp"
    assert json.loads(next(tmp_path.glob("*.cost_model.json")).read_text())["tokens_per_step"] == 128
    assert next(tmp_path.glob("*.timeline.png")).stat().st_size > 1000


def test_plan_fixed_policy(capsys):
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB",
                            "--policy", "fixed", "--checkpoint-every", "2", "--max-batch", "0", "--hardware",
                            "defaults"))
    assert rc == 0 and "policy fixed" in capsys.readouterr().out


def test_infeasible_budget_exits_1_with_the_smallest_budget(capsys):
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1MiB", "--host-memory", "4GiB",
                            "--hardware", "defaults"))
    assert rc == 1 and "smallest feasible GPU budget" in capsys.readouterr().out


def test_fixed_policy_over_budget_exits_1_with_the_smallest_budget(capsys):
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1MiB", "--host-memory", "4GiB",
                            "--policy", "fixed", "--max-batch", "0", "--hardware", "defaults"))
    out = capsys.readouterr().out
    assert rc == 1 and "smallest feasible GPU budget" in out and "layer  kind" not in out


def test_bad_arguments_exit_2_listing_every_problem(capsys, tmp_path):
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "lots", "--batch-size", "0"))
    err = capsys.readouterr().err
    assert rc == 2 and "--gpu-memory" in err and "--batch-size" in err
    # a bare number would be bytes: refused with the unit to add
    assert cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "24", "--hardware", "defaults")) == 2
    assert "e.g. 24GiB" in capsys.readouterr().err
    assert cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory-margin", "0.95", "--hardware", "defaults")) == 2
    assert "--gpu-memory-margin" in capsys.readouterr().err
    # an existing directory without a config.json: a clear error, no download attempt
    assert cli_plan.run(_args("--model", str(tmp_path), "--hardware", "defaults")) == 2
    assert "--model" in capsys.readouterr().err


def test_bad_hardware_profile_is_one_error_naming_the_keys(tmp_path, capsys):
    """Before: a TypeError / AttributeError traceback."""
    for text, match in (('{"gpu_tflops": 1}', "missing keys ['h2d_gbps'"), ("[1, 2]", "JSON object"),
                        ("{", "--hardware")):
        f = tmp_path / "hw.json"
        f.write_text(text)
        assert cli_plan.run(_args("--model", "qwen3-tiny", "--hardware", str(f))) == 2
        err = capsys.readouterr().err
        assert match in err and "--hardware" in err and "Traceback" not in err


def test_fixed_policy_flags_under_milp_get_a_note(capsys):
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB", "--tier", "cpu",
                            "--checkpoint-every", "2", "--max-batch", "0", "--hardware", "defaults"))
    out = capsys.readouterr().out
    assert rc == 0 and "note: --policy milp ignores --checkpoint-every, --tier" in out
    assert cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB",
                              "--max-batch", "0", "--hardware", "defaults")) == 0
    assert "note:" not in capsys.readouterr().out


def test_budgets_above_the_hardware_profile_get_a_note(capsys):
    """A what-if plan above the profile's GPU / RAM is allowed, but the output says it cannot run on that machine
    (before: silently accepted, "peak GPU 422 GiB of 440 GiB" on a 140 GiB GPU)."""
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "500GiB", "--host-memory", "1TiB",
                            "--max-batch", "0", "--hardware", "defaults"))
    out = capsys.readouterr().out
    assert rc == 0 and "note: --gpu-memory 500.00 GiB is more than the hardware profile's GPU" in out
    assert "note: --host-memory 1024.00 GiB is more than the hardware profile's host RAM" in out


def test_plan_variants_write_distinct_files_and_print_them(tmp_path, capsys):
    """--no-gpu-optimizer (or another budget) next to the default plan in one --out-dir: separate files, each
    path printed (before, both wrote <model>-b2-s64-milp.* and the second silently replaced the first)."""
    base = ("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB", "--batch-size", "2",
            "--seq-len", "64", "--max-batch", "0", "--hardware", "defaults", "--out-dir", str(tmp_path))
    written = []
    for extra in ((), ("--no-gpu-optimizer",), ("--gpu-memory", "2GiB")):
        assert cli_plan.run(_args(*base, *extra)) == 0
        out = capsys.readouterr().out
        paths = [line.strip() for line in out.split("wrote:")[1].splitlines() if line.strip()]
        assert len(paths) == 3 and all(Path(p).is_file() for p in paths), out
        written.append(paths)
    schedules = [Path(p[0]) for p in written]
    assert len(set(schedules)) == 3 and len(list(tmp_path.glob("*.schedule.json"))) == 3
    assert "cpu-optimizer" in schedules[1].name and "gpu2GiB" in schedules[2].name
    assert all(lp.optimizer_device == "cpu" for lp in Schedule.from_json(schedules[1]).layers)


def test_fingerprint_identifies_the_plan_and_matches_the_trainers(tmp_path, capsys, caplog):
    """Before: the default plan, --rows-per-pass 4, --no-gpu-optimizer and --policy fixed shared one fingerprint,
    the Trainer hashed str(hardware) (so matching inputs differed), and a loaded schedule_path was never compared."""
    from types import SimpleNamespace

    import torch

    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.hf.plan import cost_model_for_trainer
    from lazytrain_hf.hf.plans import RunPlans
    from lazytrain_hf.models import resolve_config

    base = ("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB", "--batch-size", "2",
            "--seq-len", "64", "--max-batch", "0", "--hardware", "defaults")
    prints = {}
    for name, extra in {"default": (), "rows": ("--rows-per-pass", "1"), "cpu-opt": ("--no-gpu-optimizer",),
                        "fixed": ("--policy", "fixed"), "accum": ("--gradient-accumulation-steps", "2")}.items():
        out = tmp_path / name
        assert cli_plan.run(_args(*base, *extra, "--out-dir", str(out))) == 0
        prints[name] = Schedule.from_json(next(out.glob("*.schedule.json")))
        printed = capsys.readouterr().out
        if name == "default":
            assert "layers updated on the GPU, their gradients kept there" in printed
        if name == "accum":
            assert "their gradients sent to the host (--gradient-accumulation-steps above 1)" in printed
    assert len({s.fingerprint for s in prints.values()}) == 5
    assert prints["default"].keep_grads and not prints["accum"].keep_grads  # accumulation: gradients to the host
    # the Trainer's fingerprint for the same inputs (a CPU device: H200 defaults, no GPU-side updates)
    cfg = LazyTrainConfig(gpu_memory_budget="1GiB", host_memory_budget="4GiB")
    trainer = SimpleNamespace(lazy_config=cfg,
                              args=SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1),
                              model=SimpleNamespace(config=resolve_config("qwen3-tiny")),
                              executor=SimpleNamespace(device=torch.device("cpu"),
                                                       resident=SimpleNamespace(placement="gpu"),
                                                       schedule=SimpleNamespace(rows_per_pass=None)),
                              train_dataset={"input_ids": [[1] * 64]})
    trainer.plans = RunPlans(trainer)
    assert cost_model_for_trainer(trainer, 64)[2] == prints["cpu-opt"].fingerprint
    # default budgets: the CLI takes the profile's memory, the Trainer free / total memory; both fingerprint
    # "defaulted", so `plan` then `train` with the defaults match (they differed before)
    out = tmp_path / "defaults"
    assert cli_plan.run(_args(*base[:2], *base[6:], "--no-gpu-optimizer", "--out-dir", str(out))) == 0
    defaulted = Schedule.from_json(next(out.glob("*.schedule.json")))
    trainer.lazy_config = LazyTrainConfig()
    trainer.plans = RunPlans(trainer)  # the request is built once per run, from its config
    assert cost_model_for_trainer(trainer, 64)[2] == defaulted.fingerprint != prints["cpu-opt"].fingerprint
    trainer.lazy_config = cfg
    trainer.plans = RunPlans(trainer)
    # a loaded schedule planned for other inputs: a warning naming them
    with caplog.at_level("WARNING", logger="lazytrain_hf.hf.plans"):
        trainer.plans.check_fingerprint(prints["cpu-opt"], "same.json")
        # (other libraries may log on first import, e.g. bitsandbytes' CPU backend)
        assert not [r for r in caplog.records if r.name == "lazytrain_hf.hf.plans"]
        trainer.plans.check_fingerprint(prints["rows"], "rows.json")
    assert "rows.json" in caplog.text and "gpu_optimizer, rows_per_pass" in caplog.text


def test_config_file_path_stem_and_small_parameter_counts(tmp_path, capsys):
    """A config.json path names its directory (was "no model directory is at ..."); a fixed NVMe-tier plan's file
    name says "nvme" once (was "...every4-nvme-prefetch1-nvme..."); small models print M params (was 0.00 B)."""
    (tmp_path / "config.json").write_text("{}")
    assert cli_plan.run(_args("--model", str(tmp_path / "config.json"), "--hardware", "defaults")) == 2
    err = capsys.readouterr().err
    assert "is a config.json file: pass the directory that holds it" in err and f"'{tmp_path}'" in err
    args = _args("--model", "m", "--policy", "fixed", "--tier", "nvme", "--checkpoint-every", "4",
                 "--prefetch-depth", "1", "--nvme-dir", str(tmp_path))
    assert cli_plan.output_stem(args, "fixed").count("nvme") == 1
    assert cli_plan._count(3_410_000) == "3.41 M" and cli_plan._count(7_620_000_000) == "7.62 B"


def test_no_plan_names_the_flags_to_pass_and_each_named_fix_plans(capsys):
    """The CLI words the planning error in its own flags, from the error's numbers: the --gpu-memory that fits, and
    a --batch-size with the --gradient-accumulation-steps that keep the rows per optimizer step; each one plans."""
    import re

    base = ("--model", "qwen3-tiny", "--host-memory", "4GiB", "--hardware", "defaults", "--seq-len", "4096",
            "--max-batch", "0")
    assert cli_plan.run(_args(*base, "--gpu-memory", "700MiB", "--batch-size", "64")) == 1
    out = capsys.readouterr().out
    fix = out[out.index("Fix: pass "):]
    assert "lazytrain_config" not in fix and "per_device_train_batch_size" not in fix, fix
    gpu = re.search(r"--gpu-memory ([0-9.]+GiB)", fix).group(1)
    batch, steps = re.search(r"--batch-size (\d+) --gradient-accumulation-steps (\d+)", fix).groups()
    assert int(batch) * int(steps) == 64 and int(batch) < 64
    assert cli_plan.run(_args(*base, "--gpu-memory", gpu, "--batch-size", "64")) == 0
    assert cli_plan.run(_args(*base, "--gpu-memory", "700MiB", "--batch-size", batch,
                              "--gradient-accumulation-steps", steps)) == 0


def _fix(out: str) -> str:
    return out[out.index("Fix: pass "):]


def test_a_host_bound_plan_names_host_side_fixes_and_each_plans(capsys):
    """Only the host budget is short (below the weights + gradients + states): the fix names the --host-memory and,
    from fp32 masters, the leaner --master-weights kahan, not a --gpu-memory (the 24 GiB given is enough) and not a
    shorter --seq-len or fewer rows per pass (neither lowers the host's fixed part); --master-weights none (updates
    lost below bf16's resolution) is never named. Before: "--host-memory 25.93GiB --gpu-memory ..GiB, or a shorter
    --seq-len"."""
    import re

    base = ("--model", "qwen2.5-3b", "--gpu-memory", "24GiB", "--batch-size", "4", "--seq-len", "512",
            "--resident", "gpu", "--max-batch", "0", "--hardware", "defaults")
    fp32 = (*base, "--master-weights", "fp32")
    assert cli_plan.run(_args(*fp32, "--host-memory", "20GiB")) == 1
    fix = _fix(capsys.readouterr().out)
    assert "--gpu-memory" not in fix and "--seq-len" not in fix and "--rows-per-pass" not in fix, fix
    host = re.search(r"--host-memory ([0-9.]+GiB)", fix).group(1)
    assert "--master-weights kahan (a compensated bf16 copy, 2 bytes per parameter: host fixed part" in fix, fix
    assert "--master-weights none" not in fix, fix
    assert cli_plan.run(_args(*fp32, "--host-memory", host)) == 0
    capsys.readouterr()
    # with 24 GiB kahan is enough: the leaner mode named fits the host budget, and it plans
    assert cli_plan.run(_args(*fp32, "--host-memory", "24GiB")) == 1
    fix = _fix(capsys.readouterr().out)
    assert "--master-weights kahan" in fix and "fits the host budget" in fix, fix
    assert cli_plan.run(_args(*base, "--host-memory", "24GiB")) == 0  # the default, kahan
    capsys.readouterr()
    # the default short of host memory: only the --host-memory that plans is named
    assert cli_plan.run(_args(*base, "--host-memory", "20GiB")) == 1
    fix = _fix(capsys.readouterr().out)
    assert "--master-weights" not in fix and re.search(r"--host-memory ([0-9.]+GiB)", fix), fix


def test_a_shorter_sequence_is_named_for_the_host_only_where_it_lowers_the_host_bytes(capsys):
    """A host-placed embedding's staging buffer follows the tokens: there a shorter --seq-len (and a smaller batch)
    is a host-side fix, and the one named plans."""
    import re

    base = ("--model", "qwen3-tiny", "--gpu-memory", "24GiB", "--batch-size", "64", "--resident", "host",
            "--max-batch", "0", "--hardware", "defaults", "--host-memory", "20MiB")
    assert cli_plan.run(_args(*base, "--seq-len", "4096")) == 1
    fix = _fix(capsys.readouterr().out)
    assert "--gpu-memory" not in fix, fix
    seq = re.search(r"--seq-len (\d+) \(now 4096: the host-placed embedding's staging buffer", fix).group(1)
    batch, steps = re.search(r"--batch-size (\d+) --gradient-accumulation-steps (\d+)", fix).groups()
    assert cli_plan.run(_args(*base, "--seq-len", seq)) == 0
    assert cli_plan.run(_args(*base, "--seq-len", "4096", "--batch-size", batch,
                              "--gradient-accumulation-steps", steps)) == 0


def test_more_host_memory_for_boundaries_is_named_when_it_fits_the_gpu_budget(capsys):
    """The host holds the fixed part but no CPU-tier boundaries, and with room for them the given GPU budget fits:
    the fix names that --host-memory (next to the GPU-side fixes), and it plans."""
    import re

    base = ("--model", "qwen2.5-3b", "--gpu-memory", "15GiB", "--batch-size", "64", "--seq-len", "2048",
            "--rows-per-pass", "1", "--resident", "gpu", "--max-batch", "0", "--hardware", "defaults",
            "--master-weights", "fp32")  # the host figures below are fp32 masters'
    assert cli_plan.run(_args(*base, "--host-memory", "25.93GiB")) == 1
    fix = _fix(capsys.readouterr().out)
    host = re.search(r"--host-memory ([0-9.]+GiB) \(room for CPU-tier boundaries", fix).group(1)
    assert cli_plan.run(_args(*base, "--host-memory", host)) == 0


def test_a_lora_plan_keeps_the_frozen_base_at_2_bytes_per_parameter(tmp_path, capsys):
    """--lora-r plans as a recipe's peft section trains: the decoder layers' host part is their bf16 weights alone
    (2 bytes per parameter, no gradients or optimizer states), the adapters on the GPU; --load-in-4bit packs them."""
    import re

    import pytest

    pytest.importorskip("peft")
    from lazytrain_hf.models import resolve_config
    from lazytrain_hf.profiling import model_shape

    base = ("--model", "qwen2.5-3b", "--gpu-memory", "24GiB", "--host-memory", "100GiB", "--batch-size", "4",
            "--seq-len", "512", "--resident", "gpu", "--max-batch", "0", "--hardware", "defaults")
    printed, fixed = {}, {}
    for name, extra in {"full": (), "lora": ("--lora-r", "16", "--lora-target-modules", "all-linear"),
                        "qlora": ("--lora-r", "16", "--lora-target-modules", "all-linear", "--load-in-4bit")}.items():
        assert cli_plan.run(_args(*base, *extra, "--out-dir", str(tmp_path / name))) == 0
        out = capsys.readouterr().out
        printed[name] = (float(re.search(r"\(fixed part ([0-9.]+) GiB with", out).group(1)),
                         float(re.search(r"; host ([0-9.]+) GiB of", out).group(1)))
        fixed[name] = json.loads(next((tmp_path / name).glob("*.cost_model.json")).read_text())["host_fixed_bytes"]
        if name != "full":
            assert "LoRA r 16 on all-linear: " in out and "adapter params on the GPU" in out, out
            assert "lora16-all-linear" in next((tmp_path / name).glob("*.schedule.json")).name
    layers = sum(model_shape(resolve_config("qwen2.5-3b")).layer_params)
    assert fixed["lora"] == 2 * layers  # the frozen base: 2 bytes per parameter, nothing else on the host
    assert fixed["full"] > 6 * layers and fixed["qlora"] < 0.6 * layers
    assert printed["full"][0] > printed["lora"][0] > printed["qlora"][0], printed  # the printed fixed part
    assert printed["full"][1] > printed["lora"][1] > printed["qlora"][1], printed  # the printed host peak


def test_lora_flag_mistakes_exit_2(capsys):
    import pytest

    pytest.importorskip("peft")
    assert cli_plan.run(_args("--model", "qwen3-tiny", "--load-in-4bit", "--hardware", "defaults")) == 2
    assert "add --lora-r N" in capsys.readouterr().err
    assert cli_plan.run(_args("--model", "qwen3-tiny", "--lora-r", "0", "--hardware", "defaults")) == 2
    assert "--lora-r must be >= 1" in capsys.readouterr().err
    assert cli_plan.run(_args("--model", "qwen3-tiny", "--lora-r", "4", "--lora-target-modules", "no_such_proj",
                              "--hardware", "defaults")) == 2
    assert "--lora-target-modules no_such_proj: PEFT cannot wrap 'qwen3-tiny'" in capsys.readouterr().err
    # PEFT has no default target modules for Qwen3.5: named with the fix
    assert cli_plan.run(_args("--model", "qwen3.5-tiny", "--lora-r", "4", "--hardware", "defaults")) == 2
    assert "PEFT's default target modules" in (err := capsys.readouterr().err) and "Fix: pass --lora-target" in err


def test_fixed_policy_takes_fewer_rows_per_pass_as_the_trainer_does(capsys):
    """The fixed policy's rows per pass: the batch, then halves, the first that fits (hf/plan.py
    fixed_plan_for_trainer). Before, `plan --policy fixed` planned the whole batch only: no plan here, and a largest
    feasible batch far below the one the Trainer runs (12 against >= 64 measured for the 16-layer qwen3.6-27b
    proxy under 24 GiB: benchmarks/results/hybrid-20261202.json)."""
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "0.63GiB", "--host-memory", "4GiB",
                            "--batch-size", "16", "--seq-len", "1024", "--policy", "fixed", "--max-batch", "256",
                            "--hardware", "defaults"))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "rows per pass: 8\nplacements planned: gpu: 16 rows per pass: no plan; 8 rows per pass:" in out, out
    largest = int(re.search(r"largest feasible batch \(fixed, seq 1024\): (\d+)", out).group(1))
    assert largest > 16, out


def test_the_table_labels_rebuilt_layers_by_their_own_input(capsys):
    """Checkpoint every 2 layers: layers 0 and 2 re-run from their own boundary, 1 and 3 from the one before
    (their inputs rebuilt). The labels were one layer off (layer 0 "rebuilt")."""
    rc = cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB",
                            "--policy", "fixed", "--checkpoint-every", "2", "--max-batch", "0", "--hardware",
                            "defaults"))
    out = capsys.readouterr().out
    assert rc == 0
    labels = [ln.split()[3] for ln in out.splitlines() if re.match(r"\s+[0-3]\s+full_attention", ln)]
    assert labels == ["re-forward", "rebuilt", "re-forward", "rebuilt"], out
    assert "2 re-forwarded, 2 rebuilt" in out, out


def test_no_plan_never_advises_a_placement_needing_more_gpu_memory(capsys):
    """The fixed rule put the embedding and LM head in host memory already (the leanest): the fix named
    --resident host_embedding, which needs more GPU memory."""
    rc = cli_plan.run(_args("--model", "qwen2.5-7b", "--gpu-memory", "24GiB", "--policy", "fixed",
                            "--batch-size", "200", "--max-batch", "0", "--hardware", "defaults"))
    out = capsys.readouterr().out
    assert rc == 1 and "No plan (host:" in out, out
    assert "--resident host_embedding" not in out and "--resident gpu" not in out, out


def test_a_host_short_of_every_placement_names_the_least_host_that_fits_the_gpu_budget(capsys):
    """--resident auto, host below every placement's fixed part: the --host-memory named is the least of the
    placements that then fit the given GPU budget (the embedding in host memory here), and it plans; the largest
    (the head's fp32 states on the host too) had been named, 77.3 GiB where 69.2 fits."""
    import re

    base = ("--model", "qwen2.5-7b", "--gpu-memory", "24GiB", "--batch-size", "16", "--seq-len", "1024",
            "--max-batch", "0", "--hardware", "defaults", "--master-weights", "fp32")  # its figures: fp32 masters
    assert cli_plan.run(_args(*base, "--host-memory", "60GiB")) == 1
    fix = _fix(capsys.readouterr().out)
    assert "--gpu-memory" not in fix, fix
    host = float(re.search(r"--host-memory ([0-9.]+)GiB", fix).group(1))
    assert cli_plan.run(_args(*base, "--host-memory", f"{host}GiB")) == 0
    capsys.readouterr()
    assert cli_plan.run(_args(*base, "--host-memory", f"{host - 0.5:.2f}GiB")) == 1


def test_a_fixed_policy_plan_matches_a_fixed_run_whatever_token_ids_the_config_carries(tmp_path, capsys, caplog):
    """A `plan --policy fixed` schedule loaded by a run with the same fixed-policy knobs, where the Trainer copied
    the tokenizer's special token ids into the model config: no warning (the schedule's own policy is compared).
    Before, every such run warned 'these inputs differ: fixed, model, policy'."""
    from types import SimpleNamespace

    import torch

    from lazytrain_hf.config import LazyTrainConfig
    from lazytrain_hf.hf.plans import RunPlans
    from lazytrain_hf.models import resolve_config

    out = tmp_path / "fixed"
    assert cli_plan.run(_args("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB",
                              "--batch-size", "2", "--seq-len", "64", "--max-batch", "0", "--hardware", "defaults",
                              "--policy", "fixed", "--checkpoint-every", "2", "--no-gpu-optimizer",
                              "--out-dir", str(out))) == 0
    capsys.readouterr()
    fixed = Schedule.from_json(next(out.glob("*.schedule.json")))
    config = resolve_config("qwen3-tiny")
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 7, 8, 9

    def trainer(policy: str) -> SimpleNamespace:
        t = SimpleNamespace(
            lazy_config=LazyTrainConfig(gpu_memory_budget="1GiB", host_memory_budget="4GiB", policy=policy,
                                        checkpoint_every=2),
            args=SimpleNamespace(per_device_train_batch_size=2, gradient_accumulation_steps=1),
            model=SimpleNamespace(config=config),
            executor=SimpleNamespace(device=torch.device("cpu"), resident=SimpleNamespace(placement="gpu"),
                                     schedule=SimpleNamespace(rows_per_pass=None)),
            train_dataset={"input_ids": [[1] * 64]})
        t.plans = RunPlans(t)
        return t

    with caplog.at_level("WARNING", logger="lazytrain_hf.hf.plans"):
        trainer("fixed").plans.check_fingerprint(fixed, "fixed.json")
        assert not [r for r in caplog.records if r.name == "lazytrain_hf.hf.plans"], caplog.text
        trainer("milp").plans.check_fingerprint(fixed, "fixed.json")  # the schedule's policy is what is compared
        assert not [r for r in caplog.records if r.name == "lazytrain_hf.hf.plans"], caplog.text
        other = trainer("fixed")
        other.lazy_config.checkpoint_every = 3
        other.plans = RunPlans(other)
        other.plans.check_fingerprint(fixed, "fixed.json")  # other knobs than the plan's
    assert "fixed.json" in caplog.text and "these inputs differ: fixed" in caplog.text, caplog.text


def test_loss_chunk_tokens_is_planned_and_fingerprinted_as_the_trainers(tmp_path, capsys):
    """--loss-chunk-tokens enters the request: a recipe's loss_chunk_tokens (cpu_default.yaml: 1024) can be
    planned for, and the plan's fingerprint names it (the Trainer's `plan_inputs` do)."""
    from lazytrain_hf.planning.schedule import plan_inputs

    base = ("--model", "qwen3-tiny", "--gpu-memory", "1GiB", "--host-memory", "4GiB", "--batch-size", "2",
            "--seq-len", "64", "--max-batch", "0", "--hardware", "defaults")
    prints = {}
    for n in (None, 1024):
        out = tmp_path / str(n)
        extra = () if n is None else ("--loss-chunk-tokens", str(n))
        assert cli_plan.run(_args(*base, *extra, "--out-dir", str(out))) == 0
        prints[n] = Schedule.from_json(next(out.glob("*.schedule.json")))
    assert prints[None].fingerprint != prints[1024].fingerprint
    assert prints[1024].solver["fingerprint_inputs"]["loss_chunk_tokens"] != \
        prints[None].solver["fingerprint_inputs"]["loss_chunk_tokens"]
    assert "loss_chunk_tokens" in plan_inputs({}, 1, 1, None, None, None, {})
    assert cli_plan.run(_args(*base, "--loss-chunk-tokens", "0")) == 2
    assert "--loss-chunk-tokens must be >= 1, but got 0" in capsys.readouterr().err
