"""LazyTrainer with the embedding / LM head in host memory equals the stock Trainer; the MILP chooses the
placement that fits; `lazytrain-hf plan` plans the Qwen3.6-27B shape under 24 GiB with them on the host."""

from __future__ import annotations

import math

import pytest
import torch

from ..conftest import rel_err
from .test_trainer import EXACT, NOISE_ONLY, _logs, _train_pair


def _assert_equal(stock, lazy):
    for key in ("loss", "grad_norm"):
        a, b = _logs(lazy, key), _logs(stock, key)
        assert len(a) == len(b) == 3
        for x, y in zip(a, b, strict=True):
            assert math.isclose(x, y, rel_tol=1e-5), (key, x, y)
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        if not name.endswith(NOISE_ONLY):
            assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name


@pytest.mark.parametrize("arch,placement", [("qwen3.5-tiny", "host"), ("qwen3.5-tiny", "host_embedding"),
                                            ("qwen2-tiny-tied", "host")])
def test_host_placed_resident_parts_train_as_the_stock_trainer(tmp_path, arch, placement):
    stock, lazy = _train_pair(tmp_path, arch, lazy_cfg={**EXACT, "resident_placement": placement})
    assert lazy.executor.resident.placement == placement
    assert lazy.model.model.embed_tokens.weight.device.type == "cpu"
    _assert_equal(stock, lazy)


@pytest.mark.parametrize("arch", ["qwen3.5-tiny", "qwen2-tiny-tied"])
def test_the_sliced_head_trains_as_the_stock_trainer(tmp_path, monkeypatch, arch):
    """"host_sliced" with 37-row vocabulary slices (14 of the 512-token vocabulary): loss, grad_norm and
    parameters of 3 clipped steps equal the stock Trainer's."""
    monkeypatch.setattr("lazytrain_hf.streaming.resident.HEAD_VOCAB_SLICE_ROWS", 37)
    stock, lazy = _train_pair(tmp_path, arch, lazy_cfg={**EXACT, "resident_placement": "host_sliced"})
    assert lazy.executor.resident.placement == "host_sliced" and lazy.executor.resident.vocab_slice_rows == 37
    assert lazy.model.lm_head.weight.device.type == "cpu"
    _assert_equal(stock, lazy)


def test_milp_streams_the_head_in_slices_only_when_no_other_placement_fits(tmp_path):
    """qwen3-tiny-vocab under 0.62 GiB (0.55 after the margin, 0.5 of it the allocator reserve): neither the GPU
    placement (0.63 GiB) nor "host" (0.56 GiB: the head's GPU copy, its gradient and a 16-token chunk's logits over
    the 152k vocabulary) has a plan; "host_sliced" (0.52 GiB) does, with 10 slices of 16384 rows, and trains as the
    stock Trainer."""
    cfg = {**EXACT, "policy": "milp", "gpu_memory_budget": "0.62GiB", "plan_buckets": 1}
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny-vocab", lazy_cfg=cfg)
    assert lazy.executor.schedule.resident == lazy.executor.resident.placement == "host_sliced"
    _assert_equal(stock, lazy)


def test_a_configured_placement_without_a_plan_names_the_leaner_one_that_has_one(tmp_path):
    """resident_placement 'host' under the budget where only 'host_sliced' plans (the test above): the error's fix
    names it first."""
    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.models import load_model
    from lazytrain_hf.planning.milp import InfeasiblePlanError

    from .test_trainer import _collate, _common, _dataset

    model = load_model("qwen3-tiny-vocab", "float32", seed=3)
    cfg = {**EXACT, "policy": "milp", "gpu_memory_budget": "0.62GiB", "plan_buckets": 1, "resident_placement": "host"}
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy"), lazytrain_config=cfg),
                       train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
    with pytest.raises(InfeasiblePlanError, match="Fix: lazytrain_config.resident_placement='host_sliced' "
                                                  r"\(now 'host'; 'auto' finds it too\)"):
        lazy.train()


def test_a_user_loss_refuses_the_sliced_head_before_the_executor_is_built(tmp_path):
    from transformers import Trainer

    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.models import load_model

    from .tiny_data import tiny_dataset

    class Scaled(LazyTrainer):
        def compute_loss(self, model, inputs, **kw):
            return Trainer.compute_loss(self, model, inputs, **kw)

    model = load_model("qwen3-tiny", "float32")
    args = LazyTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1,
                                 lazytrain_config={"resident_placement": "host_sliced", "device": "cpu"})
    with pytest.raises(ValueError, match="resident_placement to 'host'.*or 'auto'"):
        Scaled(model=model, args=args, train_dataset=tiny_dataset(model.config.vocab_size, 4))


def test_milp_puts_the_resident_parts_on_the_host_when_the_gpu_budget_cannot_hold_them(tmp_path):
    """qwen3-tiny-vocab: a 152k-token tied embedding (9.7 M parameters, 0.11 GiB with its gradient and fp32
    states) under a 0.68 GiB budget (0.60 after the margin): the planner needs 0.63 GiB with it on the GPU and
    0.56 GiB with it on the host, so only the host placement has a plan; it trains as the stock Trainer."""
    cfg = {**EXACT, "policy": "milp", "gpu_memory_budget": "0.68GiB", "plan_buckets": 1}
    stock, lazy = _train_pair(tmp_path, "qwen3-tiny-vocab", lazy_cfg=cfg)
    assert lazy.executor.schedule.resident == lazy.executor.resident.placement == "host"
    _assert_equal(stock, lazy)


def test_plan_cli_finds_a_24gib_plan_for_the_27b_shape(capsys):
    """On a CPU-only machine: the fp32-state embedding and LM head of the 248k vocabulary (2.5 B parameters) leave
    no plan on the GPU under 24 GiB; in host memory they do, and the plan says where they live."""
    import argparse

    from lazytrain_hf import cli_plan

    p = argparse.ArgumentParser()
    cli_plan.add_arguments(p)
    args = p.parse_args(["--model", "qwen3.6-27b", "--gpu-memory", "24GiB", "--host-memory", "320GiB",
                         "--batch-size", "8", "--seq-len", "1024", "--max-batch", "0", "--hardware", "defaults"])
    assert cli_plan.run(args) == 0
    out = capsys.readouterr().out
    assert "resident parts: embedding and LM head in host memory" in out
    assert "gpu: 8 rows per pass: no plan" in out and "predicted step" in out
    assert "placement host_sliced not planned: auto tries it only when no other placement fits" in out


def test_the_plan_prices_the_embedding_states_the_optimizer_keeps(tmp_path):
    """Hybrid8 keeps the embedding / LM head in fp32 states unless lazytrain_config.resident_state_dtype is 8bit
    (the same optimizer as one built with fp32_state_params leaving them out: bit-equal training); the plan reads
    which from the optimizer the Trainer created, so the resident parts' bytes are those that are allocated; a part
    fp32_state_modules names keeps fp32 states."""
    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.hf.plan import cost_model_for_trainer
    from lazytrain_hf.models import load_model

    from .test_trainer import _collate, _common, _dataset

    class EightBitEmbedding(LazyTrainer):  # what the benchmark harness did before the option existed
        @staticmethod
        def get_optimizer_cls_and_kwargs(args, model=None):
            cls, kwargs = LazyTrainer.get_optimizer_cls_and_kwargs(args, model)
            return cls, {**kwargs, "fp32_state_params": []}

    cfg = {"state_dtype": "8bit", "min_8bit_size": 256, "policy": "milp", "plan_buckets": 1}
    runs, params = {}, {}
    for name, cls, extra in (("fp32", LazyTrainer, {}), ("8bit", LazyTrainer, {"resident_state_dtype": "8bit"}),
                             ("subclass", EightBitEmbedding, {}),
                             ("named", LazyTrainer, {"resident_state_dtype": "8bit",
                                                     "fp32_state_modules": ["embed_tokens"]})):
        model = load_model("qwen3-tiny-untied", "float32", seed=3)
        lazy = cls(model=model, args=LazyTrainingArguments(**_common(tmp_path, name, max_steps=1),
                                                           lazytrain_config={**cfg, **extra}),
                   train_dataset=_dataset(model.config.vocab_size), data_collator=_collate)
        lazy.train()
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        eight = {n: lazy.optimizer.state[p]["state1"].dtype == torch.uint8 for n, p in (("emb", emb), ("head", head))}
        assert eight == {"emb": name in ("8bit", "subclass"), "head": name != "fp32"}, (name, eight)
        assert lazy.plans.request.resident_states == ("8bit" if name == "subclass" else
                                                      "fp32" if name == "named" else name)
        runs[name] = cost_model_for_trainer(lazy, 16, resident="gpu")[0]
        params[name] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(p, params["subclass"][n]) for n, p in params["8bit"].items())
    E = runs["fp32"].embed_optim_params + runs["fp32"].head_optim_params - load_model("qwen3-tiny-untied").config.hidden_size
    block = 256  # the plan's block size (LazyTrainConfig default): 8-bit moments are 2 bytes + 2 fp32 absmax per block
    assert runs["fp32"].resident_bytes - runs["8bit"].resident_bytes == pytest.approx(E * (8 - 2 - 8 / block), rel=1e-6)
