"""The plan request (lazytrain_hf/planning/request.py): budgets and defaults resolved in one place for the CLI and
the Trainer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lazytrain_hf.planning.request import resolve_budgets, resolve_request, same_tokens_batch

GIB = 1024**3


def test_budgets_take_the_asked_values_else_the_machine_shared_by_its_ranks():
    given = resolve_budgets(24 * GIB, 100 * GIB, 200 * GIB, nvme=True, margin=0.1, gpu_available=80 * GIB,
                            host_total=500 * GIB, nvme_available=1000 * GIB, ranks_per_host=4)
    assert (given.gpu_total, given.host_bytes, given.nvme_bytes) == (24 * GIB, 100 * GIB, 200 * GIB)
    assert given.gpu_bytes == int(24 * GIB * 0.9)
    default = resolve_budgets(None, None, None, nvme=True, margin=0.0, gpu_available=80 * GIB, host_total=500 * GIB,
                              nvme_available=1000 * GIB, ranks_per_host=4)
    assert (default.gpu_total, default.host_bytes, default.nvme_bytes) == (80 * GIB, int(0.9 * 500 * GIB) // 4,
                                                                          250 * GIB)
    assert (default.gpu_asked, default.host_asked, default.nvme_asked) == (None, None, None)
    off = resolve_budgets(None, None, 200 * GIB, nvme=False, margin=0.0, gpu_available=1, host_total=1,
                          nvme_available=1)
    assert off.nvme_bytes == 0 and off.nvme_asked == 0


def test_request_defaults_and_a_gpu_reduction_keep_the_fingerprint():
    hw = SimpleNamespace(to_dict=lambda: {"gpu_tflops": 1.0})
    kw = dict(batch_size=8, seq_len=1000, hardware=hw, gpu_memory_budget=None, host_memory_budget=None,
              nvme_budget=None, nvme=False, gpu_memory_margin=0.1, gpu_available=10 * GIB, host_total=64 * GIB,
              nvme_available=0, master_weights="auto", max_buckets=4)
    r = resolve_request({"hidden_size": 8}, None, gradient_accumulation_steps=2, **kw)
    assert r.buckets == (128, 256, 512, 1000) and r.master_weights == "kahan" and not r.kept_grads
    assert r.fixed == {"checkpoint_every": 4, "tier": "gpu", "prefetch_depth": 1}
    assert resolve_request({"hidden_size": 8}, None, **kw).kept_grads  # one micro-batch per step
    less = r.with_gpu_reduction(GIB)
    assert less.budgets.gpu_bytes == r.budgets.gpu_bytes - GIB and r.with_gpu_reduction(0) is r
    assert less.fingerprint() == r.fingerprint()  # a reduction is the run's own correction, not another input
    assert less.cost_model_kwargs(2, "host")["gpu_bytes"] == less.budgets.gpu_bytes


@pytest.mark.parametrize("b,ga,fits,want", [(64, 1, 29, (16, 4)), (4, 1, 3, (2, 2)), (6, 2, 5, (4, 3)),
                                            (7, 1, 6, (1, 7))])
def test_same_tokens_batch_keeps_the_rows_per_step(b, ga, fits, want):
    assert same_tokens_batch(b, ga, fits) == want


def test_shared_host_weights_enter_the_cost_model_and_the_fingerprint_only_when_shared():
    hw = SimpleNamespace(to_dict=lambda: {"gpu_tflops": 1.0})
    kw = dict(batch_size=8, seq_len=1000, hardware=hw, gpu_memory_budget=None, host_memory_budget=None,
              nvme_budget=None, nvme=False, gpu_memory_margin=0.1, gpu_available=10 * GIB, host_total=64 * GIB,
              nvme_available=0, ranks_per_host=2)
    own, shared = (resolve_request({"hidden_size": 8}, None, host_weight_ranks=n, **kw) for n in (1, 2))
    assert own.budgets == shared.budgets  # the host's budget per rank is its share either way
    assert own.cost_model_kwargs(None, "gpu")["host_weight_ranks"] == 1
    assert shared.cost_model_kwargs(None, "gpu")["host_weight_ranks"] == 2
    assert "host_weight_ranks" not in own.inputs() and shared.inputs()["host_weight_ranks"] == 2
    assert own.fingerprint() != shared.fingerprint()
