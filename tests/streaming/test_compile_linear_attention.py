"""lazytrain_config compile_linear_attention: the executor compiles its weight slots' Gated DeltaNet modules once
(torch.compile, default inductor, on the CPU here) and still equals plain HF autograd; off, nothing is compiled.
The planner's layer profiling measures the compiled layer, its compile in the untimed warm-up.

Precision: the decay-gate parameters' gradients (A_log, dt_bias, in_proj_a) come out of heavy cancellation, and
transformers' reference gated delta rule computes in float32 whatever the model's dtype. In float32 the compiled
layer's different operation order moves those gradients by up to 3e-3 relative on this model, where eager float32
is itself 2.5e-4 from a float64 computation and the compiled one 2.8e-4 (one layer, random inputs): rounding, not a
different function. So float32 checks every other gradient at 1e-5, and a float64 run (the rule lifted to float64
too: `float64_rule`; marked slow) checks all of them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

from lazytrain_hf import kernels
from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import load_model, resolve_config
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.planning.schedule import LayerPlan, Schedule
from lazytrain_hf.profiling import layer_costs
from lazytrain_hf.streaming.executor import StreamingExecutor

from ..conftest import random_batch, rel_err


def _graphs() -> int:
    """Graphs torch.compile has produced in this process."""
    return counters["stats"]["unique_graphs"]


@pytest.fixture
def compile_calls(monkeypatch):
    """The modules `nn.Module.compile` was called on, in order."""
    calls: list[torch.nn.Module] = []
    compile_ = torch.nn.Module.compile

    def counted(self, *args, **kwargs):
        calls.append(self)
        return compile_(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", counted)
    return calls


#: gradients from cancellation (see the module docstring): checked in float64
GATE = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")


@pytest.fixture
def float64_rule(monkeypatch):
    """The Qwen3.5 modeling module's `torch.float32` reads float64: its reference gated delta rule (which casts its
    inputs to float32) computes a float64 model in float64, eager and compiled alike."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as mod

    class Float64Torch:
        def __getattr__(self, name):
            return torch.float64 if name == "float32" else getattr(torch, name)

    monkeypatch.setattr(mod, "torch", Float64Torch())


def _reference(model, ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _linear_slots(ex: StreamingExecutor) -> list[torch.nn.Module]:
    return [m for s in ex.streamer.slots for m in kernels.linear_attention_layers(s.module)]


def _schedule() -> Schedule:
    """Every layer path: checkpoints on the CPU and NVMe tiers, a recomputed layer, a retained one; prefetch 2."""
    P = LayerPlan
    return Schedule("milp", [P(True, "cpu"), P(False), P(True, "nvme"), P(False, retain=True)], prefetch_depth=2)


def _compiled_executor(model, tmp_path) -> StreamingExecutor:
    torch._dynamo.reset()  # the test's graphs are its own (dynamo's recompile limit counts per process)
    cfg = LazyTrainConfig(compile_linear_attention=True, loss_chunk_tokens=2048, nvme_dir=str(tmp_path))
    return StreamingExecutor(model, cfg, "cpu", _schedule())


def test_compiled_layers_equal_hf_autograd_and_compile_once(compile_calls, tmp_path):
    """Three steps of padded batches (float32): each step's loss and gradients equal HF autograd (eager) within
    1e-5 (the decay-gate gradients: the float64 test); the slots' three GatedDeltaNet modules are compiled when the
    executor is built, and the later steps compile no graph. A new prefetch depth compiles the new slots' modules,
    which reuse the compiled graphs."""
    model = load_model("qwen3.5-tiny", "float32", seed=1)
    ex = _compiled_executor(model, tmp_path)

    assert ex.linear_attention_kernel == "torch_compile"
    linear = _linear_slots(ex)
    assert len(linear) == 3 and compile_calls == linear  # 3 linear-attention layers share depth + 1 = 3 slots
    impls = [m._compiled_call_impl for m in linear]
    assert all(impl is not None for impl in impls)
    assert all(kernels.linear_attention_kernel(s.module) in ("torch_compile", None) for s in ex.streamer.slots)
    assert kernels.linear_attention_kernel(model) == "torch"  # the host layers are not what runs: not compiled

    graphs = []
    for step in range(3):
        ids, mask, labels = random_batch(model.config.vocab_size, seed=20 + step)
        ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
        ex.zero_grad()
        loss = ex.forward_backward(ids, labels, mask)
        graphs.append(_graphs())
        assert rel_err(loss, ref_loss) < 1e-5, step
        for name, p in model.named_parameters():
            if not name.endswith(GATE):
                assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, (step, name)
    assert graphs[0] > 0 and graphs[1] == graphs[0] == graphs[2]  # compiled in step 1 only
    assert compile_calls == linear and [m._compiled_call_impl for m in linear] == impls

    ex.set_schedule(fixed_schedule(4, 2, "gpu", 1))  # depth 1: new slots, compiled as they are built
    assert len(compile_calls) == 3 + 2 and compile_calls[3:] == _linear_slots(ex)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=30)
    ref_loss, _ = _reference(copy.deepcopy(model), ids, mask, labels)
    ex.zero_grad()
    assert rel_err(ex.forward_backward(ids, labels, mask), ref_loss) < 1e-5
    assert _graphs() == graphs[0]  # same shapes and grad modes: the compiled graphs serve the new modules
    ex.close()


@pytest.mark.slow  # its own float64 graphs: 2 more minutes of inductor compiles on a cold cache (2 CPU cores)
def test_compiled_layers_equal_hf_autograd_in_float64(float64_rule, tmp_path):
    model = load_model("qwen3.5-tiny", "float64", seed=1)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=20)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    ex = _compiled_executor(model, tmp_path)
    assert rel_err(ex.forward_backward(ids, labels, mask), ref_loss) < 1e-6
    for name, p in model.named_parameters():  # the chunked head computes in float32: 1e-7 on model.norm.weight
        assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-6, name
    assert _graphs() > 0
    ex.close()


def test_off_compiles_nothing(compile_calls):
    model = load_model("qwen3.5-tiny", "float32", seed=1)
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=2048), "cpu", fixed_schedule(4, 2, "gpu", 1))
    before = _graphs()
    ids, mask, labels = random_batch(model.config.vocab_size)
    ex.forward_backward(ids, labels, mask)
    assert ex.linear_attention_kernel == "torch" and compile_calls == [] and _graphs() == before
    assert all(m._compiled_call_impl is None for s in ex.streamer.slots for m in s.module.modules())
    ex.close()


def test_profiling_measures_the_compiled_layer_compiling_in_the_warm_up(monkeypatch):
    """measure_layer_costs with compile_linear_attention: the linear-attention layer's GatedDeltaNet is compiled
    and run once untimed even at warmup=0 (the compile), so no timed call compiles; the full-attention layer is not
    compiled and keeps warmup=0."""
    torch._dynamo.reset()
    seen: dict[str, tuple[bool, int]] = {}
    measure_one = layer_costs._measure_one

    def spy(layer, rotary, kind, idx, B, T, H, dev, warmup, *args, **kwargs):
        compiled = [m._compiled_call_impl is not None for m in kernels.linear_attention_layers(layer)]
        seen[kind] = (any(compiled), warmup)
        return measure_one(layer, rotary, kind, idx, B, T, H, dev, warmup, *args, **kwargs)

    timed: list[int] = []  # graphs compiled during each timed call
    time_ms = layer_costs.time_ms

    def timing(fn, cuda):
        before = _graphs()
        ms = time_ms(fn, cuda)
        timed.append(_graphs() - before)
        return ms

    monkeypatch.setattr(layer_costs, "_measure_one", spy)
    monkeypatch.setattr(layer_costs, "time_ms", timing)
    before = _graphs()
    m = layer_costs.measure_layer_costs(resolve_config("qwen3.5-tiny"), 2, 24, "cpu", allow_cpu=True, warmup=0,
                                        iters=1, compile_linear_attention=True)
    assert set(m) == {"linear_attention", "full_attention"} and m["linear_attention"].fwd_ms > 0
    assert seen == {"linear_attention": (True, 1), "full_attention": (False, 0)}
    assert _graphs() > before and timed == [0, 0, 0, 0]  # 2 kinds x (no-grad forward, forward + backward)


@pytest.mark.parametrize("policy", ["fixed", "none"])
def test_trainer_reports_the_compiled_path(policy, compile_calls, tmp_path, caplog):
    """LazyTrainer: the executor's path ("torch_compile", its slots compiled) is the trainer's; with policy "none" (the
    stock Trainer runs the model) the option does nothing and says so."""
    import logging

    from lazytrain_hf import LazyTrainer, LazyTrainingArguments

    from ..hf.test_trainer import _collate, _common, _dataset

    model = load_model("qwen3.5-tiny", "float32", seed=1)
    args = LazyTrainingArguments(**_common(tmp_path, "run"), lazytrain_config={"policy": policy,
                                                                               "compile_linear_attention": True})
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf"):
        t = LazyTrainer(model=model, args=args, train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    if policy == "none":
        assert t.linear_attention_kernel == "torch" and compile_calls == []
        assert any("compile_linear_attention has no effect" in r.getMessage() for r in caplog.records)
        return
    assert t.linear_attention_kernel == t.executor.linear_attention_kernel == "torch_compile"
    assert compile_calls == _linear_slots(t.executor)
    t.executor.close()


def test_benchmark_rows_take_the_trainers_path():
    """benchmarks/worker.py's extra.linear_attention_kernel: the LazyTrainer's record (its executor runs compiled
    copies, the model's own layers stay uncompiled), else read from the model (the stock Trainer)."""
    from types import SimpleNamespace

    from benchmarks.worker import linear_attention_kernel

    model = load_model("qwen3.5-tiny", "float32")
    assert linear_attention_kernel(model, SimpleNamespace(linear_attention_kernel="torch_compile")) == "torch_compile"
    assert linear_attention_kernel(model, SimpleNamespace()) == linear_attention_kernel(model) == "torch"
