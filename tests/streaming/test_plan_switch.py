"""Switching plans between and within steps (StreamingExecutor.set_schedule, LayerUpdater.set_device_layers): the
pending CPU updates keep overlapping, the GPU-deferred ones of layers leaving the GPU-updated set and the kept
gradients the new plan does not budget go to the host, and the weights equal updating every layer on the CPU."""
import copy
import random

import pytest
import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.schedule import LayerPlan, Schedule
from lazytrain_hf.streaming.executor import StreamingExecutor
from tests.conftest import random_batch


def _attached(model, plan, keep_ga):
    from lazytrain_hf.optim import Hybrid8bitOptimizer
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu", plan, host_grad_dtype="param" if not keep_ga else "fp32")
    opt = Hybrid8bitOptimizer(list(model.parameters()), lr=1e-3, weight_decay=0.1, min_8bit_size=256,
                              master_weights="kahan")
    opt.set_grad_source(ex.grad_source)
    opt.set_state_allocator(ex.state_alloc)
    ex.attach_optimizer(opt)
    return ex, opt


def _plan(L, gpu, keep):
    return Schedule("milp", [LayerPlan(checkpoint=True, optimizer_device="gpu" if i in gpu else "cpu")
                             for i in range(L)], keep_grads=keep)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("ga", [1, 2])
def test_random_switches_equal_all_cpu_updates(seed, ga):
    """Random GPU-updated sets switched before micro-batches and between steps, flushes between steps: the weights
    equal the same run with every layer updated on the CPU, bit for bit."""
    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    L = base.config.num_hidden_layers
    rng = random.Random(seed)
    sets = [set(s) for s in ([], [0], [1, 3], [0, 1, 2, 3], [2])]
    steps = 10
    script = []
    for _step in range(steps):
        mbs = []
        for _mb in range(ga):
            mbs.append((rng.choice(range(len(sets))), rng.random() < 0.5))  # (plan, switch before this mb?)
        script.append((mbs, rng.random() < 0.2))  # flush after step
    weights = {}
    for mode in ("cpu", "switch"):
        model = copy.deepcopy(base)
        keep = ga == 1
        plans = [_plan(L, s if mode == "switch" else set(), keep) for s in sets]
        ex, opt = _attached(model, plans[0], ga > 1)
        for step, (mbs, flush) in enumerate(script):
            ex.zero_grad()
            for mb, (pi, sw) in enumerate(mbs):
                if sw:
                    ex.set_schedule(plans[pi])
                ids, mask, labels = random_batch(model.config.vocab_size, seed=100 + 10 * step + mb)
                ex.forward_backward(ids, labels, mask)
            opt.clip_grad_norm(0.5, ex.grad_norm())
            opt.step()
            if rng.random() < 0.3 and mode == "switch":  # a switch between steps (calibration / memory re-plan)
                ex.set_schedule(plans[rng.choice(range(len(sets)))])
            if flush:
                ex.flush_updates()
        ex.flush_updates()
        weights[mode] = {n: p.detach().clone() for n, p in model.named_parameters()}
        ex.close()
        rng = random.Random(seed * 7 + 1)  # same between-step switches are irrelevant for "cpu"
    for n, w in weights["cpu"].items():
        assert torch.equal(weights["switch"][n], w), n


def test_the_old_plans_kept_gradients_and_device_updates_leave_at_the_switch():
    """Plan A: every layer GPU-updated with kept gradients. Switch to plan B (no GPU updates: it budgets no kept
    gradient and no update workspace): A's kept gradients go to the host and its pending GPU-side updates run
    there, before B's forward."""
    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    L = base.config.num_hidden_layers
    a, b = _plan(L, set(range(L)), True), _plan(L, set(), False)
    ex, opt = _attached(copy.deepcopy(base), a, False)
    ids, mask, labels = random_batch(base.config.vocab_size, seed=1)
    ex.zero_grad()
    ex.forward_backward(ids, labels, mask)
    opt.clip_grad_norm(0.5, ex.grad_norm())
    opt.step()
    held = ex.grads.kept_bytes
    ex.set_schedule(b)
    assert held > 0 and ex.grads.kept_bytes == 0 and not ex.updater.device_pending  # on the host, applied there
