"""LAZYTRAIN_* environment variables: one table and parser (lazytrain_hf.envvars); config overrides fill only the
fields the user did not give."""

import dataclasses
import logging
import pickle
from pathlib import Path

import pytest
import torch

from lazytrain_hf import envvars
from lazytrain_hf.config import LazyTrainConfig, PlanningConfig, config_fields, cpu_threads

DOC = Path(__file__).resolve().parents[1] / "docs" / "environment.md"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in envvars.table():
        monkeypatch.delenv(name, raising=False)


def test_explicit_checkpoint_every_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVERY", "3")
    assert LazyTrainConfig().checkpoint_every == 3  # not given: the environment fills it
    assert LazyTrainConfig(policy="milp").checkpoint_every == 3
    assert LazyTrainConfig(checkpoint_every=4).checkpoint_every == 4  # 4 is the default: given all the same
    assert LazyTrainConfig(checkpoint_every=5).checkpoint_every == 5
    assert LazyTrainConfig("fixed", "auto", 4).checkpoint_every == 4  # positional arguments are given too


def test_explicit_grouped_checkpoint_every_wins_over_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVERY", "3")
    assert LazyTrainConfig(planning={"checkpoint_every": 4}).checkpoint_every == 4
    assert LazyTrainConfig(planning={"policy": "fixed"}).planning.checkpoint_every == 3  # not given: filled
    assert LazyTrainConfig(planning=PlanningConfig(checkpoint_every=4)).checkpoint_every == 4
    assert PlanningConfig().checkpoint_every == 3 and PlanningConfig(checkpoint_every=4).checkpoint_every == 4
    assert LazyTrainConfig(memory={"gpu_memory_budget": "1GiB"}).checkpoint_every == 3  # another group given
    assert LazyTrainConfig.from_any({"planning": {"checkpoint_every": 4}}).checkpoint_every == 4
    assert LazyTrainConfig.from_any('{"planning": {"checkpoint_every": 4}}').checkpoint_every == 4
    assert LazyTrainConfig.from_any({"planning": {"policy": "milp"}}).checkpoint_every == 3
    given = tmp_path / "given.yaml"
    given.write_text("lazytrain:\n  planning:\n    checkpoint_every: 4\n")
    assert LazyTrainConfig.from_any(given).checkpoint_every == 4


def test_explicit_values_win_through_from_any(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVERY", "3")
    assert LazyTrainConfig.from_any({"checkpoint_every": 4}).checkpoint_every == 4
    assert LazyTrainConfig.from_any('{"checkpoint_every": 4}').checkpoint_every == 4
    assert LazyTrainConfig.from_any({"policy": "fixed"}).checkpoint_every == 3
    assert LazyTrainConfig.from_any(None).checkpoint_every == 3
    given = tmp_path / "given.yaml"
    given.write_text("lazytrain:\n  checkpoint_every: 4\n")
    assert LazyTrainConfig.from_any(given).checkpoint_every == 4
    unset = tmp_path / "unset.yaml"
    unset.write_text("policy: fixed\n")
    assert LazyTrainConfig.from_any(str(unset)).checkpoint_every == 3


def test_every_field_type_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_POLICY", " FIXED ")
    monkeypatch.setenv("LAZYTRAIN_PIN_MEMORY", "off")
    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_BUDGET", "24GiB")
    monkeypatch.setenv("LAZYTRAIN_GPU_MEMORY_MARGIN", "0.2")
    monkeypatch.setenv("LAZYTRAIN_FP32_STATE_MODULES", "q_proj,k_proj")
    monkeypatch.setenv("LAZYTRAIN_CALIBRATE_STEPS", "0")
    monkeypatch.setenv("LAZYTRAIN_NVME_DIR", "")  # empty: unset
    cfg = LazyTrainConfig()
    assert (cfg.policy, cfg.pin_memory, cfg.gpu_memory_budget, cfg.gpu_memory_margin) == ("fixed", False, 24 << 30, 0.2)
    assert cfg.fp32_state_modules == ["q_proj", "k_proj"] and cfg.calibrate_steps == 0 and cfg.nvme_dir is None
    explicit = LazyTrainConfig(policy="milp", pin_memory=True, gpu_memory_budget=None, gpu_memory_margin=0.12,
                               fp32_state_modules=[], calibrate_steps=None)
    assert explicit == _defaults()  # given values equal to the defaults: the variables unread


def _defaults() -> LazyTrainConfig:
    return LazyTrainConfig(**{f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
                              for _, f in config_fields()})


def test_a_bad_override_names_the_variable_value_and_accepted_values(monkeypatch):
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVERY", "four")
    monkeypatch.setenv("LAZYTRAIN_POLICY", "greedy")
    with pytest.raises(ValueError) as err:
        LazyTrainConfig()
    msg = str(err.value)
    assert "environment LAZYTRAIN_CHECKPOINT_EVERY must be an integer, but got 'four'" in msg
    assert "environment LAZYTRAIN_POLICY must be one of ['fixed', 'milp', 'none'], but got 'greedy'" in msg
    assert LazyTrainConfig(checkpoint_every=2, policy="fixed").checkpoint_every == 2  # given: the variables unread


def test_config_equality_asdict_pickle_and_replace(monkeypatch):
    cfg = LazyTrainConfig(policy="milp", checkpoint_every=4)
    assert "_given" not in vars(cfg)
    assert dataclasses.asdict(cfg) == cfg.to_dict(grouped=True)
    assert set(cfg.to_dict()) == {f.name for _, f in config_fields()}  # the flat form: every field's flat key
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVERY", "3")
    assert dataclasses.replace(cfg, policy="fixed").checkpoint_every == 4  # a copy keeps its values
    assert LazyTrainConfig.from_any(cfg.to_dict()) == cfg == LazyTrainConfig.from_any(cfg.to_dict(grouped=True))
    assert LazyTrainConfig(policy="milp") != cfg


def test_training_args_keep_explicit_values_and_pickle(monkeypatch, tmp_path):
    from lazytrain_hf.hf.args import LazyTrainingArguments

    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVERY", "3")
    args = LazyTrainingArguments(output_dir=str(tmp_path), lazytrain_config={"checkpoint_every": 4}, report_to=[])
    assert args.lazy_config.checkpoint_every == 4
    path = tmp_path / "training_args.bin"
    torch.save(args, path)
    loaded = torch.load(path, weights_only=False)
    assert loaded.lazy_config == args.lazy_config
    filled = LazyTrainingArguments(output_dir=str(tmp_path), report_to=[])
    assert filled.lazy_config.checkpoint_every == 3


def test_read_defaults_and_one_error_format(monkeypatch):
    assert envvars.read("LAZYTRAIN_CPU_ISA") == "auto"
    assert envvars.read("LAZYTRAIN_CPU_THREADS") is None
    assert envvars.read("LAZYTRAIN_CPU_THREADS", default=7) == 7
    monkeypatch.setenv("LAZYTRAIN_CPU_THREADS", "  ")
    assert envvars.read("LAZYTRAIN_CPU_THREADS") is None
    monkeypatch.setenv("LAZYTRAIN_GPU_KERNEL", "Triton ")
    assert envvars.read("LAZYTRAIN_GPU_KERNEL") == "triton"
    for name, bad, accepted in (("LAZYTRAIN_CPU_KERNEL", "c++", "one of ['auto', 'torch', 'cpp']"),
                                ("LAZYTRAIN_CPU_LOOKUP", "fast", "one of ['auto', 'gather', 'scalar']"),
                                ("LAZYTRAIN_CPU_THREADS", "0", "an integer >= 1"),
                                ("LAZYTRAIN_PIN_MEMORY", "maybe", "true or false")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError) as err:
            envvars.read(name)
        assert str(err.value).startswith(f"environment {name} must be {accepted}")
        assert f"but got {bad!r}; unset it for the default" in str(err.value)
    with pytest.raises(KeyError):
        envvars.read("LAZYTRAIN_NO_SUCH_SETTING")


def test_table_choices_match_the_modules_that_use_them():
    from lazytrain_hf.optim import _cpu_kernel as K

    table = envvars.table()
    assert table[K.ISA_ENV].accepted == f"one of {['auto', *K.ISA_CODES]}"
    assert table[K.LOOKUP_ENV].accepted == f"one of {['auto', *K.LOOKUP_MODES]}"
    fields = {envvars.field_env_name(f.name) for _, f in config_fields()}
    assert fields <= set(table) and set(envvars.VARIABLES) <= set(table)


def test_committed_docs_equal_the_rendered_table():
    assert DOC.read_text() == envvars.render_markdown(), "regenerate: python -m lazytrain_hf.envvars > " + str(DOC)


def test_migrated_readers_keep_their_behaviour(monkeypatch, tmp_path):
    from lazytrain_hf.optim import kernel_select as K
    from lazytrain_hf.profiling import hardware

    monkeypatch.setenv("LAZYTRAIN_CPU_THREADS", " 3 ")
    assert cpu_threads() == 3
    monkeypatch.delenv("LAZYTRAIN_CPU_THREADS")
    assert cpu_threads() == torch.get_num_threads()
    monkeypatch.setenv("LAZYTRAIN_CPU_KERNEL", "TORCH")
    assert K.cpu_kernel_choice() == "torch"
    monkeypatch.setenv("LAZYTRAIN_CACHE_DIR", str(tmp_path))
    assert hardware.cache_dir() == tmp_path
    monkeypatch.delenv("LAZYTRAIN_CACHE_DIR")
    assert hardware.cache_dir() == Path.home() / ".cache" / "lazytrain_hf"


def test_benchmark_readers(monkeypatch, tmp_path):
    from benchmarks import common

    monkeypatch.setenv("LAZYTRAIN_GIT_COMMIT", "abc123")
    assert common.git_commit() == "abc123"
    (tmp_path / "train.jsonl").write_text("{}\n")
    monkeypatch.setenv("LAZYTRAIN_GSM8K_DIR", str(tmp_path))
    assert common.gsm8k_dir() == tmp_path
    assert common.gsm8k_dir(str(tmp_path)) == tmp_path


def test_a_bad_lookup_fails_when_the_optimizer_is_built_and_is_logged_at_kernel_load(monkeypatch, caplog):
    from lazytrain_hf.optim import Hybrid8bitOptimizer
    from lazytrain_hf.optim import _cpu_kernel as K

    monkeypatch.setenv("LAZYTRAIN_CPU_LOOKUP", "fast")
    with pytest.raises(ValueError, match=r"LAZYTRAIN_CPU_LOOKUP must be one of \['auto', 'gather', 'scalar'\]"):
        Hybrid8bitOptimizer([torch.nn.Parameter(torch.zeros(4))])

    class FakeLib:  # an AVX2 build: the mode is set by the variable, else measured
        mode = None

        def lt_get_lookup(self):
            return 0

        def lt_set_lookup(self, mode):
            self.mode = mode

    monkeypatch.setenv("LAZYTRAIN_CPU_LOOKUP", "Scalar")
    lib = FakeLib()
    assert K._configure_lookup(lib) == "table reads: scalar (LAZYTRAIN_CPU_LOOKUP)" and lib.mode == 1
    monkeypatch.setenv("LAZYTRAIN_CPU_LOOKUP", "fast")
    monkeypatch.setattr(K, "_auto_isa", lambda lib: 1)
    lib.lt_calibrate_lookup = lambda *a: 0
    with caplog.at_level(logging.WARNING, logger=K.__name__):
        assert K._configure_lookup(lib).startswith("table reads: gather (measured")
    assert "LAZYTRAIN_CPU_LOOKUP must be one of" in caplog.text and "measuring both" in caplog.text


def test_unknown_variables_name_the_closest_known_one():
    env = {"LAZYTRAIN_CPU_KERNL": "cpp", "LAZYTRAIN_CPU_KERNEL": "cpp", "LAZYTRAIN_ZZZ": "1", "PATH": "/bin"}
    assert envvars.unknown_variables(env) == {"LAZYTRAIN_CPU_KERNL": "LAZYTRAIN_CPU_KERNEL", "LAZYTRAIN_ZZZ": None}
    assert envvars.unknown_variables({name: "1" for name in envvars.table()}) == {}


def test_a_misspelt_variable_warns_once_naming_the_closest(monkeypatch, recwarn):
    """Before: LAZYTRAIN_CHECKPOINT_EVRY=3 was silently ignored (the default 4 used)."""
    import warnings

    from lazytrain_hf import cli

    monkeypatch.setattr(envvars, "_WARNED", set())
    monkeypatch.setenv("LAZYTRAIN_CHECKPOINT_EVRY", "3")
    with pytest.warns(UserWarning, match="LAZYTRAIN_CHECKPOINT_EVRY is not one lazytrain_hf reads and is ignored; "
                                         "did you mean LAZYTRAIN_CHECKPOINT_EVERY?"):
        assert LazyTrainConfig().checkpoint_every == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        LazyTrainConfig()
    # the command checks at start, whatever it reads later
    monkeypatch.setattr(envvars, "_WARNED", set())
    monkeypatch.setenv("LAZYTRAIN_CPU_TREADS", "2")
    with pytest.warns(UserWarning) as caught:
        assert cli.main(["probe", "--device", "tpu"]) == 2
    assert [str(w.message).split(";")[1] for w in caught if "LAZYTRAIN_" in str(w.message)] == \
        [" did you mean LAZYTRAIN_CHECKPOINT_EVERY? The known ones are listed in docs/environment.md "
         "(python -m lazytrain_hf.envvars).",
         " did you mean LAZYTRAIN_CPU_THREADS? The known ones are listed in docs/environment.md "
         "(python -m lazytrain_hf.envvars)."]
