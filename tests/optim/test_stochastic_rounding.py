"""Stochastic rounding of bf16 parameters without master copy (master_weights="stochastic":
functional.stochastic_round_bf16, random_bits16, update_seed; Hybrid8bitOptimizer)."""

from __future__ import annotations

import pytest
import torch

from lazytrain_hf.optim import Hybrid8bitOptimizer
from lazytrain_hf.optim import functional as F


def test_random_bits_are_a_function_of_seed_and_index():
    """Any slice of a tensor draws the bits its elements draw in the whole; other seeds draw other bits; the bits
    are 16 wide and about uniform."""
    whole = F.random_bits16(seed=7, offset=0, n=100_000)
    assert torch.equal(F.random_bits16(7, 4321, 50), whole[4321:4371])
    assert int(whole.min()) >= 0 and int(whole.max()) < 1 << 16
    assert abs(float(whole.float().mean()) / 32767.5 - 1) < 0.01
    assert float((F.random_bits16(8, 0, 100_000) == whole).float().mean()) < 0.001
    assert F.update_seed(0, 1) != F.update_seed(0, 2) != F.update_seed(1, 1)


def test_stochastic_rounding_is_unbiased_and_keeps_representable_values():
    """A value a quarter of a bf16 ulp above a bf16 number rounds up about a quarter of the time, so the mean is
    the value (round to nearest would drop it every time); the same for negative values; bf16 numbers and
    non-finite values stay as they are."""
    base = torch.tensor(1.0 + 2**-7)                    # a bf16 number; its ulp is 2^-7
    n = 200_000
    for sign in (1.0, -1.0):
        x = torch.full((n,), sign * (float(base) + 2**-9))  # + 1/4 ulp
        r = F.stochastic_round_bf16(x, seed=3).float()
        up = (r.abs() > float(base)).float().mean()
        assert abs(float(up) - 0.25) < 0.01
        assert set(r.abs().unique().tolist()) == {float(base), float(base) + 2**-7}
        assert abs(float(r.mean()) - float(x[0])) < 2**-7 * 0.01
        assert torch.equal(x.to(torch.bfloat16).float().abs().unique(), base.reshape(1))  # nearest drops it
    exact = torch.tensor([0.0, -0.0, 1.5, -3.0, float("inf"), float("-inf")])
    assert torch.equal(F.stochastic_round_bf16(exact, seed=1).float(), exact)
    assert torch.isnan(F.stochastic_round_bf16(torch.tensor([float("nan")]), seed=1)).all()


def _train(master: str, steps: int, param: torch.Tensor, grad: torch.Tensor, **kw) -> torch.Tensor:
    p = torch.nn.Parameter(param.clone())
    opt = Hybrid8bitOptimizer([p], lr=1e-5, state_dtype="fp32", master_weights=master, **kw)
    for _ in range(steps):
        p.grad = grad.clone()
        opt.step()
    return p.detach()


def test_updates_far_below_the_bf16_resolution_accumulate_in_expectation():
    """lr 1e-5 on weights of 0.02 (updates ~1/16 of a bf16 ulp): rounded to nearest every update vanishes; with
    stochastic rounding the mean movement over the tensor follows the fp32 update's, as Kahan's does."""
    gen = torch.Generator().manual_seed(0)
    w = (0.02 + 0.001 * torch.rand(50_000, generator=gen)).to(torch.bfloat16)
    g = torch.ones(50_000, dtype=torch.bfloat16)        # Adam: every element moves by ~lr a step
    ref = _train("none", 100, w.float(), g.float())     # fp32 weights: the exact movement
    moved = float((ref - w.float()).mean())
    assert moved == pytest.approx(-100 * 1e-5, rel=0.01)
    assert float((_train("none", 100, w, g).float() - w.float()).abs().max()) == 0.0  # all lost
    for master in ("stochastic", "kahan"):
        got = float((_train(master, 100, w, g).float() - w.float()).mean())
        assert got == pytest.approx(moved, rel=0.03), master


def test_stochastic_rounding_is_reproducible_and_resumes_exactly(monkeypatch):
    """Two runs draw the same bits; a run saved and loaded half way ends where the uninterrupted one does; the
    sliced update (CHUNK_ELEMENTS) writes what the whole tensor's does; no master buffer is allocated."""
    gen = torch.Generator().manual_seed(1)
    w = (0.02 * torch.randn(10_000, generator=gen)).to(torch.bfloat16)
    grads = [(1e-3 * torch.randn(10_000, generator=gen)).to(torch.bfloat16) for _ in range(6)]

    def run(split: int | None = None) -> torch.Tensor:
        p = torch.nn.Parameter(w.clone())
        opt = Hybrid8bitOptimizer([p], lr=1e-4, master_weights="stochastic")
        for i, g in enumerate(grads):
            if i == split:
                saved = opt.state_dict()
                p = torch.nn.Parameter(p.detach().clone())
                opt = Hybrid8bitOptimizer([p], lr=1e-4, master_weights="stochastic")
                opt.load_state_dict(saved)
            p.grad = g.clone()
            opt.step()
        assert set(opt.state[p]) == {"step", "state1", "state2", "absmax1", "absmax2"}
        return p.detach()

    whole = run()
    assert torch.equal(run(), whole) and torch.equal(run(split=3), whole)
    monkeypatch.setattr(F, "CHUNK_ELEMENTS", 1024)
    assert torch.equal(run(), whole)


def test_stochastic_runs_on_the_torch_kernel_and_fp16_keeps_fp32_masters():
    p = torch.zeros(4, dtype=torch.bfloat16)
    st = {"state1": torch.zeros(4), "state2": torch.zeros(4), "step": 0}
    hyper = F.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, sr_seed=5)
    books = F.Codebooks.for_device("cpu")
    assert F.adamw_step(p, torch.ones(4), st, hyper, books, block_size=256) == "torch"
    with pytest.raises(ValueError, match="torch kernel"):
        F.adamw_step(p, torch.ones(4), st, hyper, books, block_size=256, kernel="cpp")
    h = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    opt = Hybrid8bitOptimizer([h], master_weights="stochastic")
    h.grad = torch.ones(8, dtype=torch.float16)
    opt.step()
    assert opt.state[h]["master"].dtype == torch.float32


def test_finite_values_do_not_round_to_infinity():
    """Past the largest bf16 number (below fp32's rounding point to bf16 infinity) round to nearest stays finite:
    so does stochastic rounding, whatever the bits."""
    big = torch.finfo(torch.bfloat16).max
    x = torch.tensor([big * (1 + 2**-9), -big * (1 + 2**-9)]).repeat(5000)
    assert torch.isfinite(x.to(torch.bfloat16)).all()
    r = F.stochastic_round_bf16(x, seed=11)
    assert torch.isfinite(r).all() and set(r.float().abs().unique().tolist()) == {big}


def test_prepared_moments_skip_stochastic_parameters_and_fp16_is_priced_as_its_fp32_masters():
    """prepare_states dequantizes nothing for a stochastic parameter (its torch update reads no prepared moments);
    the plan prices what the optimizer allocates: nothing for bf16 weights, fp32 masters for fp16 ones."""
    from lazytrain_hf.hf.plan import master_weights_priced

    p = torch.nn.Parameter(torch.zeros(1 << 16, dtype=torch.bfloat16))
    opt = Hybrid8bitOptimizer([p], master_weights="stochastic")
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.prepare_states([p]) == 0 and not opt._prep_bufs
    bf16 = torch.nn.Linear(4, 4).to(torch.bfloat16)
    fp16 = torch.nn.Linear(4, 4).to(torch.float16)
    assert master_weights_priced("stochastic", bf16) == "stochastic"
    assert master_weights_priced("stochastic", fp16) == "fp32" == master_weights_priced("auto", fp16)
    assert master_weights_priced("auto", bf16) == "kahan"


def test_stochastic_updates_are_planned_on_the_cpu():
    """Its unfused torch update's temporaries (~49 bytes per element) are not what the plan prices for a GPU-side
    update (the fused kernel's): the planner plans every update of a stochastic run on the CPU."""
    from types import SimpleNamespace

    from lazytrain_hf.hf.plan import _gpu_optimizer

    def trainer(master: str) -> SimpleNamespace:
        cfg = SimpleNamespace(gpu_layer_updates=True, overlap_optimizer=True, master_weights=master)
        return SimpleNamespace(lazy_config=cfg, executor=SimpleNamespace(device=torch.device("cuda")))

    assert _gpu_optimizer(trainer("auto")) and not _gpu_optimizer(trainer("stochastic"))
