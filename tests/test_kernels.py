"""Choosing the Gated DeltaNet kernels (lazytrain_hf/kernels.py) on tiny Qwen3.5 models, on the CPU.

flash-linear-attention is absent here; "fla bound" is reproduced the way transformers binds it: a fake `fla`
package in sys.modules and transformers' own `use_kernel_func_from_hub_with_fallback` re-applied to the modeling
module's functions. The fake kernels raise, as fla's gated backward does on Hopper with Triton < 3.7.1, so a model
that still ran them would fail.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types

import pytest
import torch

from lazytrain_hf import kernels
from lazytrain_hf.models import load_model

FLA_ERROR = "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results"
UNUSABLE = (False, "flash-linear-attention 0.6.0 needs Triton >= 3.7.1 or tilelang for its gated-delta-rule "
                   "backward on Hopper; this machine has Triton 3.6.0 and tilelang is not installed")


def _qwen35_module():
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    return mod


@pytest.fixture(autouse=True)
def _restore(monkeypatch):
    """Selection rebinds the modeling module's kernel names and remembers its log lines: undo both per test. Where
    fla or causal-conv1d is installed, the tests start from the binding transformers makes without them."""
    mod = _qwen35_module()
    for name in kernels._RULE_GLOBALS + kernels._CONV_GLOBALS:
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, fn if kernels._kind(fn, mod.__name__) == "torch" else kernels._torch_function(fn))
    monkeypatch.setattr(kernels, "_LOGGED", set())


def _fake_kernel(name: str, module: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"{name}: {FLA_ERROR}")

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__module__ = module
    return kernel


def _bind_fake_fla(monkeypatch) -> None:
    """What transformers' import does when `fla` imports: wrap the reference functions around fla's kernels."""
    from transformers.integrations import hub_kernels
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    # transformers >= 5.25 sends inputs on devices fla does not support (the CPU) to the reference: let the fake
    # run on the CPU, as fla does on a GPU
    devices = getattr(hub_kernels, "_PACKAGE_SUPPORTED_DEVICES", None)
    if devices is not None and "fla" in devices:
        monkeypatch.setitem(devices, "fla", (*devices["fla"], "cpu"))

    fla = types.ModuleType("fla")
    ops = types.ModuleType("fla.ops")
    gdr = types.ModuleType("fla.ops.gated_delta_rule")
    gdr.chunk_gated_delta_rule = _fake_kernel("chunk_gated_delta_rule", "fla.ops.gated_delta_rule.chunk")
    gdr.fused_recurrent_gated_delta_rule = _fake_kernel("fused_recurrent_gated_delta_rule",
                                                        "fla.ops.gated_delta_rule.fused_recurrent")
    fla.ops, ops.gated_delta_rule = ops, gdr
    for m in (fla, ops, gdr):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    mod = _qwen35_module()
    for glob, func in zip(kernels._RULE_GLOBALS, ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")):
        reference = kernels._torch_function(getattr(mod, glob))
        monkeypatch.setattr(mod, glob, use_kernel_func_from_hub_with_fallback(func, "fla")(reference))


def _logits(model, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits  # 70 tokens: two chunks of the chunked rule, the second one padded


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lazytrain_hf.kernels"]


def test_cpu_selects_reference_and_keeps_outputs(caplog):
    model = load_model("qwen3.5-tiny", "float32")
    before = _logits(model)
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.kernels"):
        assert kernels.select_linear_attention(model, "cpu") == "torch"
    assert kernels.linear_attention_kernel(model) == "torch"
    mod = _qwen35_module()
    for name in kernels._RULE_GLOBALS:
        impl = kernels._implementation(getattr(mod, name))
        assert impl.__module__ == mod.__name__ and impl.__name__ == name
    assert torch.equal(_logits(model), before)
    (line,) = _lines(caplog)
    assert line.startswith("Gated DeltaNet layers: transformers' reference PyTorch kernels (the layers run on cpu")


def test_bound_but_unusable_fla_is_switched_to_reference(monkeypatch, caplog):
    reference_model = load_model("qwen3.5-tiny", "float32")
    expected = _logits(reference_model)
    _bind_fake_fla(monkeypatch)
    model = load_model("qwen3.5-tiny", "float32")
    assert kernels.linear_attention_kernel(model) == "fla"
    with pytest.raises(RuntimeError, match="incorrect results"):
        _logits(model)
    monkeypatch.setattr(kernels, "fla_usable", lambda device: UNUSABLE)
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.kernels"):
        assert kernels.select_linear_attention(model, "cuda") == "torch"
        bound = {n: getattr(_qwen35_module(), n) for n in kernels._RULE_GLOBALS}
        assert kernels.select_linear_attention(model, "cuda") == "torch"  # idempotent: nothing rebound again
    assert {n: getattr(_qwen35_module(), n) for n in kernels._RULE_GLOBALS} == bound
    assert kernels.linear_attention_kernel(model) == "torch"
    assert torch.equal(_logits(model), expected)  # the layers really run the reference functions
    assert _lines(caplog) == [f"Gated DeltaNet layers: transformers' reference PyTorch kernels ({UNUSABLE[1]})"]
    assert caplog.records[-1].levelno == logging.WARNING  # a CUDA run on the slow path is worth a warning


def test_bound_fla_on_cpu_is_switched_by_the_real_predicate(monkeypatch):
    _bind_fake_fla(monkeypatch)
    model = load_model("qwen3.5-tiny", "float32")
    assert kernels.select_linear_attention(model, "cpu") == "torch"
    assert kernels.linear_attention_kernel(model) == "torch"
    _logits(model)


def test_usable_fla_is_kept(monkeypatch, caplog):
    _bind_fake_fla(monkeypatch)
    model = load_model("qwen3.5-tiny", "float32")
    bound = _qwen35_module().torch_chunk_gated_delta_rule
    monkeypatch.setattr(kernels, "fla_usable", lambda device: (True, "flash-linear-attention 0.6.0, Triton 3.7.1"))
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.kernels"):
        assert kernels.select_linear_attention(model, "cuda") == "fla"
    assert _qwen35_module().torch_chunk_gated_delta_rule is bound
    assert _lines(caplog) == ["Gated DeltaNet layers: flash-linear-attention kernels "
                              "(flash-linear-attention 0.6.0, Triton 3.7.1)"]


def test_compile_is_reported_where_the_reference_runs_only(monkeypatch, caplog):
    """select_linear_attention(compile=True): "torch_compile" and its own log line where the reference runs; fla
    kept, and logged as without the option, where it works. It compiles nothing itself."""
    _bind_fake_fla(monkeypatch)
    model = load_model("qwen3.5-tiny", "float32")
    monkeypatch.setattr(kernels, "fla_usable", lambda device: (True, "flash-linear-attention 0.6.0, Triton 3.7.1"))
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.kernels"):
        assert kernels.select_linear_attention(model, "cuda", compile=True) == "fla"
        monkeypatch.setattr(kernels, "fla_usable", lambda device: UNUSABLE)
        assert kernels.select_linear_attention(model, "cuda", compile=True) == "torch_compile"
        assert kernels.select_linear_attention(model, "cuda") == "torch"
    assert _lines(caplog) == [
        "Gated DeltaNet layers: flash-linear-attention kernels (flash-linear-attention 0.6.0, Triton 3.7.1)",
        f"Gated DeltaNet layers: transformers' reference PyTorch kernels, compiled with torch.compile ({UNUSABLE[1]})",
        f"Gated DeltaNet layers: transformers' reference PyTorch kernels ({UNUSABLE[1]})"]
    assert kernels.linear_attention_kernel(model) == "torch"
    assert all(m._compiled_call_impl is None for m in model.modules())


def test_compile_linear_attention_compiles_each_gated_deltanet_once():
    model = load_model("qwen3.5-tiny", "float32")
    kernels.select_linear_attention(model, "cpu")
    layers = kernels.linear_attention_layers(model)
    assert kernels.compile_linear_attention(model.model.layers[0]) == 1
    assert kernels.linear_attention_kernel(model) == "mixed"
    assert kernels.compile_linear_attention(model) == len(layers) - 1
    assert kernels.compile_linear_attention(model) == 0
    assert kernels.linear_attention_kernel(model) == "torch_compile"
    compiled = [m for m in model.modules() if m._compiled_call_impl is not None]
    assert compiled == layers  # the GatedDeltaNet modules only (nothing runs here: compiling is lazy)
    # selection reads the binding under the compile: the reference stays selected, nothing is rebound
    assert kernels.select_linear_attention(model, "cpu", compile=True) == "torch_compile"


def test_reference_refuses_packed_sequences(monkeypatch):
    _bind_fake_fla(monkeypatch)
    model = load_model("qwen3.5-tiny", "float32")
    kernels.select_linear_attention(model, "cpu")
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="packed sequences"):
        _qwen35_module().torch_chunk_gated_delta_rule(q, q, q, g=torch.zeros(1, 8, 2), beta=torch.ones(1, 8, 2),
                                                      cu_seqlens=torch.tensor([0, 4, 8]))


def test_dense_model_has_no_linear_attention(caplog):
    model = load_model("qwen3-tiny", "float32")
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.kernels"):
        assert kernels.select_linear_attention(model, "cpu") is None
    assert kernels.linear_attention_kernel(model) is None
    assert _lines(caplog) == []


def test_linear_attention_kernel_reports_the_bound_path(monkeypatch):
    model = load_model("qwen3.5-tiny", "float32")
    assert kernels.linear_attention_kernel(model) == "torch"  # fla absent: transformers bound its reference
    assert len(kernels.linear_attention_layers(model)) == sum(
        t == "linear_attention" for t in model.config.layer_types)
    _bind_fake_fla(monkeypatch)
    assert kernels.linear_attention_kernel(model) == "fla"  # read from what the layers call, not cached



HUB_ERROR = "fake Hub kernel ran"


def _fake_hub_layer(check: type) -> type:
    """A stateless layer class as a Hub kernel repository provides, with the forward signature of `check`."""

    class FakeHubLayer(torch.nn.Module):
        def forward(self, *args, **kwargs):
            raise RuntimeError(HUB_ERROR)

    FakeHubLayer.forward.__signature__ = inspect.signature(check.forward)
    return FakeHubLayer


class _FakeHubRepo:
    """A `kernels` layer repository that loads a class from memory (no download)."""

    _repo_id = "kernels-community/fake"

    def __init__(self, layer: type):
        self.layer = layer

    def load(self) -> type:
        return self.layer


@pytest.mark.parametrize("whole_layer", [False, True])
def test_kernelized_hub_kernel_is_reported_and_reference_restores(caplog, whole_layer):
    """Where `kernels` is installed (transformers >= 5.25 requires it) the kernel functions are `kernels` Func
    modules; `kernelize` (use_kernels=True) points a layer's own Func copies, or the layer's whole forward, at a
    Hub kernel. Selection reports it and leaves it; use_reference_kernels restores the reference."""
    hub = pytest.importorskip("kernels")
    mod = _qwen35_module()
    if kernels._func_target(mod.torch_chunk_gated_delta_rule) is None:
        pytest.skip("transformers binds plain functions here (the `kernels` package is not used)")
    model = load_model("qwen3.5-tiny", "float32")
    expected = _logits(model)
    layer = kernels.linear_attention_layers(model)[0]
    name, check = ((layer.kernel_layer_name, type(layer)) if whole_layer else
                   ("chunk_gated_delta_rule", type(mod.torch_chunk_gated_delta_rule)))
    mapping = {name: {"cpu": {hub.Mode.INFERENCE: _FakeHubRepo(_fake_hub_layer(check))}}}
    with hub.use_kernel_mapping(mapping, inherit_mapping=False):
        hub.kernelize(model, mode=hub.Mode.INFERENCE, device="cpu")
    assert kernels.linear_attention_kernel(model) == "hub:kernels-community/fake"
    with pytest.raises(RuntimeError, match=HUB_ERROR):
        _logits(model)
    with caplog.at_level(logging.INFO, logger="lazytrain_hf.kernels"):
        assert kernels.select_linear_attention(model, "cpu") == "hub:kernels-community/fake"
    assert _lines(caplog) == ["Gated DeltaNet layers: Hub kernel kernels-community/fake (bound by kernels.kernelize "
                              "(use_kernels); left as is)"]
    switched = kernels.use_reference_kernels(model)
    assert switched == ([f"{type(layer).__name__}.forward"] * len(kernels.linear_attention_layers(model))
                        if whole_layer else [f"{mod.__name__}.torch_chunk_gated_delta_rule"])
    assert kernels.linear_attention_kernel(model) == "torch"
    assert torch.equal(_logits(model), expected)


# Older transformers store the kernels on the layer and use fla's FusedRMSNormGated; a fake modeling module.
def _attribute_design_module(monkeypatch):
    mod = types.ModuleType("fake_modeling_gdn")

    def torch_chunk_gated_delta_rule(*args, **kwargs):
        return "torch-chunk"

    def torch_recurrent_gated_delta_rule(*args, **kwargs):
        return "torch-recurrent"

    def torch_causal_conv1d_update(*args, **kwargs):
        return "torch-conv-update"

    class FakeRMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

    class FusedRMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-5):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.full((hidden_size,), 2.0))
            self.eps = eps

    FusedRMSNormGated.__module__ = "fla.modules.fused_norm_gate"

    class FakeGatedDeltaNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = FusedRMSNormGated(8, eps=1e-5)
            self.causal_conv1d_fn = _fake_kernel("causal_conv1d_fn", "causal_conv1d.causal_conv1d_interface")
            self.causal_conv1d_update = _fake_kernel("causal_conv1d_update", "causal_conv1d.causal_conv1d_interface")
            self.chunk_gated_delta_rule = _fake_kernel("chunk_gated_delta_rule", "fla.ops.gated_delta_rule.chunk")
            self.recurrent_gated_delta_rule = _fake_kernel("fused_recurrent_gated_delta_rule",
                                                           "fla.ops.gated_delta_rule.fused_recurrent")

    for obj in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule, torch_causal_conv1d_update,
                FakeRMSNormGated, FakeGatedDeltaNet):
        obj.__module__ = mod.__name__
        setattr(mod, obj.__name__, obj)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


@pytest.mark.parametrize("device, conv_switched", [("cuda", False), ("cpu", True)])
def test_attribute_design_layers_are_switched(monkeypatch, device, conv_switched):
    mod = _attribute_design_module(monkeypatch)
    model = torch.nn.Sequential(mod.FakeGatedDeltaNet(), mod.FakeGatedDeltaNet())
    weights = [layer.norm.weight for layer in model]
    monkeypatch.setattr(kernels, "fla_usable", lambda d: UNUSABLE)
    assert kernels.linear_attention_kernel(model) == "fla"
    assert kernels.select_linear_attention(model, device) == "torch"
    assert kernels.linear_attention_kernel(model) == "torch"
    for layer, w in zip(model, weights):
        assert layer.chunk_gated_delta_rule is mod.torch_chunk_gated_delta_rule
        assert layer.recurrent_gated_delta_rule is mod.torch_recurrent_gated_delta_rule
        assert type(layer.norm) is mod.FakeRMSNormGated and layer.norm.weight is w
        assert layer.norm.variance_epsilon == 1e-5
        assert (layer.causal_conv1d_fn is None) is conv_switched
        assert (layer.causal_conv1d_update is mod.torch_causal_conv1d_update) is conv_switched
    model[0].chunk_gated_delta_rule = _fake_kernel("chunk_gated_delta_rule", "fla.ops.gated_delta_rule.chunk")
    assert kernels.linear_attention_kernel(model) == "mixed"


# --------------------------------------------------------------------------------------------- fla_usable


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA machine as fla_usable sees it: set .capability, .triton, .hip, .tilelang, .fla_installed."""
    env = types.SimpleNamespace(capability=(9, 0), triton="3.6.0", hip=None, tilelang=(False, "tilelang is not "
                                "installed"), fla_installed=True)
    monkeypatch.setattr(kernels, "_installed", lambda name: name != "fla" or env.fla_installed)
    monkeypatch.setattr(kernels, "_fla_version", lambda: "0.6.0")
    monkeypatch.setattr(kernels, "_triton_version", lambda: env.triton)
    monkeypatch.setattr(kernels, "_tilelang_backend", lambda: env.tilelang)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: env.capability)
    env.apply = lambda: monkeypatch.setattr(torch.version, "hip", env.hip, raising=False)
    return env


@pytest.mark.parametrize("capability, triton, hip, tilelang, usable, words", [
    ((9, 0), "3.6.0", None, False, False, ["Triton >= 3.7.1", "Triton 3.6.0", "tilelang is not installed"]),
    ((9, 0), "3.4.0", None, False, False, ["Triton 3.4.0"]),
    ((9, 0), "3.7.1", None, False, True, ["Triton 3.7.1", "sm_90"]),
    ((9, 0), "3.3.1", None, False, True, ["Triton 3.3.1"]),
    ((9, 0), "3.6.0", None, True, True, ["tilelang backend"]),
    ((8, 0), "3.6.0", None, False, True, ["sm_80"]),
    ((10, 0), "3.6.0", None, False, True, ["sm_100"]),
    ((9, 4), "3.6.0", "6.4", False, True, ["sm_94"]),  # ROCm MI300 reports 9.x: not Hopper
])
def test_fla_usable_table(gpu, capability, triton, hip, tilelang, usable, words):
    gpu.capability, gpu.triton, gpu.hip = capability, triton, hip
    gpu.tilelang = (True, "tilelang backend") if tilelang else (False, "tilelang is not installed")
    gpu.apply()
    ok, reason = kernels.fla_usable("cuda")
    assert ok is usable
    assert "flash-linear-attention 0.6.0" in reason
    for w in words:
        assert w in reason


def test_fla_usable_needs_cuda_and_fla(gpu):
    gpu.apply()
    ok, reason = kernels.fla_usable("cpu")
    assert not ok and "need a CUDA GPU" in reason
    gpu.fla_installed = False
    ok, reason = kernels.fla_usable(torch.device("cuda", 0))
    assert not ok and "pip install 'lazytrain-hf[fla]'" in reason


@pytest.mark.parametrize("env, words", [({"FLA_TILELANG": "0"}, "FLA_TILELANG=0"),
                                        ({"FLA_DISABLE_BACKEND_DISPATCH": "1"}, "FLA_DISABLE_BACKEND_DISPATCH=1")])
def test_tilelang_backend_switched_off_by_fla_environment(monkeypatch, env, words):
    monkeypatch.setattr(kernels, "_installed", lambda name: True)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ok, reason = kernels._tilelang_backend()
    assert not ok and words in reason


def test_no_fla_import_at_package_import(tmp_path):
    """An importable `fla` that announces its import stays unimported by `import lazytrain_hf.kernels`."""
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("import sys\nsys.stderr.write('fla imported')\n")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(tmp_path)])}
    code = "import sys, lazytrain_hf, lazytrain_hf.kernels; print('fla' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False" and "fla imported" not in r.stderr


def test_use_reference_kernels_forces_the_reference(monkeypatch):
    _bind_fake_fla(monkeypatch)
    model = load_model("qwen3.5-tiny", "float32")
    switched = kernels.use_reference_kernels(model)
    assert sorted(switched) == sorted(f"{_qwen35_module().__name__}.{n}" for n in kernels._RULE_GLOBALS)
    assert kernels.linear_attention_kernel(model) == "torch"
    assert kernels.use_reference_kernels(model) == []


@pytest.mark.parametrize("budget_s", [900.0, 0.0])
def test_bench_linear_attention_cpu_smoke(monkeypatch, tmp_path, budget_s):
    """The GPU benchmark on a tiny shape on the CPU, fla bound but failing: one row per path, fla's failure as an
    "error" row with its message, the reference measured; a spent budget leaves "not run" rows. No timing asserted."""
    import json

    from benchmarks.bench_linear_attention import main

    _bind_fake_fla(monkeypatch)
    out = tmp_path / "la.json"
    main(["--model", "qwen3.5-tiny", "--device", "cpu", "--batch-size", "1", "--seq-len", "70", "--iters", "1",
          "--warmup", "0", "--systems", "fla,torch", "--budget-s", str(budget_s), "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["suite"] == "linear_attention" and doc["command"]
    rows = {(r["system"], r["extra"]["kind"]): r for r in doc["rows"]}
    assert set(rows) == {("fla", "linear_attention"), ("torch", "linear_attention"), ("torch", "full_attention")}
    if budget_s == 0:
        assert all(r["status"] == "error" and r["reason"].startswith("not run") for r in rows.values())
        return
    fla = rows["fla", "linear_attention"]
    assert fla["status"] == "error" and FLA_ERROR in fla["reason"] and fla["extra"]["kernel"] == "fla"
    for key in (("torch", "linear_attention"), ("torch", "full_attention")):
        r = rows[key]
        assert r["status"] == "ok", r["reason"]
        assert r["steps_timed"] == 1 and r["extra"]["fwd_ms"] > 0 and r["extra"]["fwd_bwd_ms"] > 0
    assert rows["torch", "linear_attention"]["extra"]["kernel"] == "torch"
