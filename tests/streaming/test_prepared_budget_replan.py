"""Prepared moments (`LazyTrainConfig.prepared_states_budget`): the buffers held stay within the budget when a
re-plan or another bucket's plan moves layers between CPU and GPU updates (found by a fresh-user review)."""
from __future__ import annotations

import copy

import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.schedule import LayerPlan, Schedule
from lazytrain_hf.streaming.executor import StreamingExecutor

from ..conftest import random_batch


def test_prepared_buffers_stay_within_budget_when_the_plan_moves_layers():
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    L = base.config.num_hidden_layers
    layer_bytes = 8 * sum(p.numel() for p in base.model.layers[1].parameters())
    plans = [Schedule("milp", [LayerPlan(checkpoint=True, optimizer_device="gpu" if i < k else "cpu")
                               for i in range(L)], keep_grads=False) for k in (0, 1, 2, 0)]
    weights = {}
    for budget in (0, layer_bytes):
        model = copy.deepcopy(base)
        ex = StreamingExecutor(model, LazyTrainConfig(prepared_states_budget=budget), "cpu", plans[0],
                               host_grad_dtype="param")
        opt = Hybrid8bitOptimizer(list(model.parameters()), lr=1e-3, weight_decay=0.1, min_8bit_size=256,
                                  master_weights="kahan")
        opt.set_grad_source(ex.grad_source)
        opt.set_state_allocator(ex.state_alloc)
        ex.attach_optimizer(opt)
        for step in range(8):
            ex.set_schedule(plans[step // 2])  # a re-plan / another bucket's plan every 2 steps
            ids, mask, labels = random_batch(model.config.vocab_size, seed=30 + step)
            ex.zero_grad()
            ex.forward_backward(ids, labels, mask)
            opt.clip_grad_norm(0.5, ex.grad_norm())
            opt.step()
            if ex.updater._thread is not None:  # the worker's updates and preparation done (not stopped)
                ex.updater._thread.join()
            assert opt.prepared_bytes() <= budget, (step, opt.prepared_bytes(), budget)
        ex.flush_updates()
        weights[budget] = {n: p.detach().clone() for n, p in model.named_parameters()}
        ex.close()
    ref, got = weights.values()
    for name, w in ref.items():
        assert torch.equal(got[name], w), name
