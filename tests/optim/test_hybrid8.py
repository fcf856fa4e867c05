"""`Hybrid8bitOptimizer` (lazytrain_hf/optim/hybrid8.py): AdamW equivalence, 8-bit tracking, fused clipping,
skipped steps, external gradients, master weights, v floor, checkpoints. CPU, both CPU kernels."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from lazytrain_hf.optim import Hybrid8bitOptimizer
from lazytrain_hf.optim import functional as F

from .test_quant import requires_cpu_kernel

KERNELS = ["torch", "cpp"]


@pytest.fixture(params=KERNELS)
def cpu_kernel(request, monkeypatch):
    """Runs the test once per CPU kernel (LAZYTRAIN_CPU_KERNEL)."""
    if request.param == "cpp":
        requires_cpu_kernel()
    monkeypatch.setenv(F.CPU_KERNEL_ENV, request.param)
    return request.param


def _params(shapes, dtype=torch.float32, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * scale).to(dtype)) for s in shapes]


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _grads(params, seed, scale=1.0):
    """Random gradients in each param's dtype (param.grad must match it)."""
    g = torch.Generator().manual_seed(1000 + seed)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


def _snapshot(opt, params):
    """Every byte of the params and of the optimizer state (plus step counters)."""
    snap = [p.detach().clone() for p in params]
    for p in params:
        for k, v in sorted(opt.state[p].items()):
            snap += [k, v.clone() if isinstance(v, torch.Tensor) else v]
    return snap


def _same_bytes(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(torch.uint8)
                                                      if y.dim() else y)
        else:
            assert x == y


def _max_rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


# ---------------------------------------------------------------------------------------------------- AdamW
def test_fp32_state_mode_equals_torch_adamw(cpu_kernel):
    """state_dtype="fp32", fp32 params, master auto: == torch.optim.AdamW (two groups, weight decay), 5 steps."""
    shapes = [(64, 80), (80,), (4097,), (3, 5)]
    ref, ours = _params(shapes), None
    ours = _clone(ref)
    groups = lambda ps: [{"params": ps[:2], "lr": 3e-3, "weight_decay": 0.1},           # noqa: E731
                         {"params": ps[2:], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)}]
    t_opt = torch.optim.AdamW(groups(ref), lr=1e-3)
    h_opt = Hybrid8bitOptimizer(groups(ours), lr=1e-3, state_dtype="fp32")
    for step in range(5):
        for p, q, g in zip(ref, ours, _grads(ref, step)):
            p.grad, q.grad = g.clone(), g.clone()
        t_opt.step()
        h_opt.step()
    for p, q in zip(ref, ours):
        assert _max_rel(q, p) <= 1e-6
        assert _max_rel(h_opt.state[q]["state2"], t_opt.state[p]["exp_avg_sq"]) <= 1e-6
    assert all(h_opt.state[q]["step"] == 5 for q in ours)


def test_8bit_tracks_fp32_adamw_on_regression(cpu_kernel):
    """Least squares with a [128, 64] weight (8-bit states, 32 blocks): same loss curve as fp32 AdamW."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 64, generator=g)
    w_true = torch.randn(128, 64, generator=g)
    y = x @ w_true.T + 0.01 * torch.randn(512, 128, generator=g)

    def train(make_opt):
        w = torch.nn.Parameter(torch.zeros(128, 64))
        opt = make_opt([w])
        losses = []
        for _ in range(150):
            r = x @ w.detach().T - y                       # [512, 128] residual
            w.grad = (2.0 / r.numel()) * r.T @ x           # d mean(r^2) / dw, [128, 64]
            opt.step()
            losses.append(r.pow(2).mean().item())
        return w.detach(), losses

    w32, l32 = train(lambda ps: torch.optim.AdamW(ps, lr=3e-2, weight_decay=0.0))
    w8, l8 = train(lambda ps: Hybrid8bitOptimizer(ps, lr=3e-2))
    assert l8[-1] < 0.02 * l8[0] and l32[-1] < 0.02 * l32[0]
    assert abs(l8[-1] - l32[-1]) <= 0.15 * l32[-1] + 1e-3
    assert (w8 - w32).norm() / w32.norm() < 0.05


# ---------------------------------------------------------------------------------------------------- clipping
def test_clip_grad_norm_matches_torch_and_folds_into_update(cpu_kernel):
    shapes = [(64, 80), (4097,), (7,)]
    base = _params(shapes)
    grads = _grads(base, 0, scale=3.0)
    # reference: torch's clip (what the HF Trainer calls) then AdamW on the clipped gradients
    ref = _clone(base)
    for p, g in zip(ref, grads):
        p.grad = g.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1).step()
    ours = _clone(base)
    for p, g in zip(ours, grads):
        p.grad = g.clone()
    opt = Hybrid8bitOptimizer(ours, lr=1e-2, weight_decay=0.1, state_dtype="fp32")
    norm = opt.clip_grad_norm(1.0)
    assert abs(norm.item() - ref_norm.item()) <= 1e-4 * ref_norm.item()
    assert norm.item() > 1.0, "the test must clip"
    assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads)), "clip_grad_norm must not touch the grads"
    opt.step()
    assert not opt.last_step_skipped
    for p, q in zip(ref, ours):
        assert _max_rel(q, p) <= 1e-6
    assert all(torch.equal(p.grad, g) for p, g in zip(ours, grads)), "step must not touch the grads"


def test_clip_in_8bit_mode_equals_update_from_clipped_grads(cpu_kernel):
    """bf16 params with fp32 host gradients: folding the coefficient into the kernel == clipping first."""
    shapes = [(64, 80), (4097,), (7,)]
    base = _params(shapes, dtype=torch.bfloat16)
    grads = [g.float() for g in _grads(_params(shapes), 1, scale=5.0)]
    a, b = _clone(base), _clone(base)
    opt_a = Hybrid8bitOptimizer(a, lr=1e-2, weight_decay=0.05)
    src_a = dict(zip(map(id, a), grads))
    opt_a.set_grad_source(lambda p: src_a[id(p)])
    norm = opt_a.clip_grad_norm(0.5)
    opt_a.step()
    holders = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for h, g in zip(holders, grads):
        h.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(holders, 0.5)   # fp32 coefficient, multiplied in fp32, as ours
    opt_b = Hybrid8bitOptimizer(b, lr=1e-2, weight_decay=0.05)
    src_b = dict(zip(map(id, b), [h.grad for h in holders]))
    opt_b.set_grad_source(lambda p: src_b[id(p)])
    opt_b.step()
    assert norm.item() > 0.5
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert set(opt_a.state[p]) == {"step", "state1", "state2", "absmax1", "absmax2", "kahan"} or p.numel() < 4096
        for key in ("state1", "state2", "kahan"):
            assert torch.equal(opt_a.state[p][key], opt_b.state[q][key])


def test_clip_coefficient_applies_to_every_step_params_call(cpu_kernel):
    shapes = [(64, 80), (4097,), (5000,), (9,)]
    base = _params(shapes)
    grads = _grads(base, 2, scale=4.0)
    a, b = _clone(base), _clone(base)
    for ps in (a, b):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
    opt_a, opt_b = Hybrid8bitOptimizer(a, lr=1e-2), Hybrid8bitOptimizer(b, lr=1e-2)
    opt_a.clip_grad_norm(1.0)
    opt_a.step()
    # the executor: norm accumulated elsewhere, updates layer by layer
    opt_b.clip_grad_norm(1.0, norm=torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    opt_b.step_params(b[:2])
    opt_b.step_params(b[2:])
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # after step() the clip request is consumed: the next step() applies no clipping
    assert opt_a._pending is None and opt_b._pending is not None


def test_no_clipping_below_max_norm_or_with_inf():
    base = _params([(100,)])
    grads = _grads(base, 3, scale=1e-3)
    a, b = _clone(base), _clone(base)
    for ps in (a, b):
        ps[0].grad = grads[0].clone()
    opt_a, opt_b = Hybrid8bitOptimizer(a), Hybrid8bitOptimizer(b)
    opt_a.clip_grad_norm(10.0)
    opt_b.clip_grad_norm(float("inf"))   # the HF integration's "check only" call
    opt_a.step()
    opt_b.step()
    ref = _clone(base)
    ref[0].grad = grads[0].clone()
    torch.optim.AdamW(ref, weight_decay=0.0).step()
    torch.testing.assert_close(a[0], ref[0], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(b[0], ref[0], rtol=1e-6, atol=1e-8)
    with pytest.raises(ValueError, match="max_norm"):
        opt_a.clip_grad_norm(0.0)
    with pytest.raises(ValueError, match="max_norm"):
        opt_a.clip_grad_norm(float("nan"))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_norm_skips_step_and_changes_no_byte(cpu_kernel, bad, caplog):
    params = _params([(64, 80), (4097,), (7,)], dtype=torch.bfloat16)
    opt = Hybrid8bitOptimizer([{"params": params[:2]}, {"params": params[2:], "master_weights": "kahan"}],
                              lr=1e-2)
    for step in range(2):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.clip_grad_norm(1.0)
        opt.step()
    before = _snapshot(opt, params)
    grads = _grads(params, 5)
    grads[1][123] = bad
    for p, g in zip(params, grads):
        p.grad = g
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.optim.hybrid8"):
        norm = opt.clip_grad_norm(1.0)
        assert not torch.isfinite(norm)
        opt.step()
    assert opt.last_step_skipped
    _same_bytes(before, _snapshot(opt, params))
    assert any("skipping this optimizer step" in r.getMessage() for r in caplog.records)
    # the executor's path: a non-finite norm it accumulated skips every step_params call
    opt.clip_grad_norm(1.0, norm=torch.tensor(bad))
    opt.step_params(params[:1])
    opt.step_params(params[1:])
    assert opt.last_step_skipped
    _same_bytes(before, _snapshot(opt, params))
    # a finite norm afterwards updates again
    for p, g in zip(params, _grads(params, 6)):
        p.grad = g
    opt.clip_grad_norm(1.0)
    opt.step()
    assert not opt.last_step_skipped
    assert all(opt.state[p]["step"] == 3 for p in params)


def test_grad_norm_mixes_dtypes_and_sources():
    params = _params([(300,), (40, 5)], dtype=torch.bfloat16)
    ext = {id(params[0]): torch.randn(300) * 2}
    params[1].grad = torch.randn(40, 5).to(torch.bfloat16)
    opt = Hybrid8bitOptimizer(params)
    opt.set_grad_source(lambda p: ext.get(id(p), p.grad))
    expected = torch.cat([ext[id(params[0])], params[1].grad.float().flatten()]).norm()
    norm = opt.grad_norm()
    assert norm.dtype == torch.float32 and norm.dim() == 0
    assert abs(norm.item() - expected.item()) <= 1e-5 * expected.item()
    assert Hybrid8bitOptimizer(_params([(3,)])).grad_norm().item() == 0.0


# ---------------------------------------------------------------------------------------------------- external grads
def test_grad_source_with_bf16_params_and_fp32_host_grads(cpu_kernel):
    """The executor's setup: bf16 params, fp32 gradients in host buffers, param.grad unused."""
    base = _params([(64, 80), (4097,), (33,)], dtype=torch.bfloat16, scale=0.05)
    ours = _clone(base)
    ref = [torch.nn.Parameter(p.detach().float()) for p in base]
    opt = Hybrid8bitOptimizer(ours, lr=1e-3, weight_decay=0.01, state_dtype="fp32", master_weights="fp32")
    t_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.01)
    host_grads: dict[int, torch.Tensor] = {}
    opt.set_grad_source(lambda p: host_grads.get(id(p)))
    for step in range(4):
        grads = _grads(ref, step)   # fp32
        for p, q, g in zip(ours, ref, grads):
            host_grads[id(p)] = g.flatten()   # any shape with the right numel
            q.grad = g.clone()
        opt.step()
        t_opt.step()
    for p, q in zip(ours, ref):
        assert p.grad is None and p.dtype == torch.bfloat16
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32
        assert _max_rel(master, q) <= 1e-6
        assert torch.equal(p.detach(), master.to(torch.bfloat16))
    opt.set_grad_source(None)   # back to param.grad (None here): nothing moves
    before = [p.detach().clone() for p in ours]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(ours, before))


# ---------------------------------------------------------------------------------------------------- master weights
def test_master_and_kahan_keep_tiny_updates_in_bf16(cpu_kernel):
    """lr = 1e-5 on bf16 weights of size ~0.02: plain bf16 rounding loses almost every update."""
    n, steps = 8192, 50
    init = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]
    ref = torch.nn.Parameter(init.float())
    t_opt = torch.optim.AdamW([ref], lr=1e-5, weight_decay=0.0)
    for g in grads:
        ref.grad = g.clone()
        t_opt.step()
    err, changed = {}, {}
    for mode in ("fp32", "kahan", "none"):
        p = torch.nn.Parameter(init.clone())
        opt = Hybrid8bitOptimizer([p], lr=1e-5, master_weights=mode)
        for g in grads:
            p.grad = g.to(torch.bfloat16)
            opt.step()
        value = opt.state[p]["master"] if mode == "fp32" else p.detach().float()
        if mode == "kahan":
            value = value + opt.state[p]["kahan"].float()
        err[mode] = (value - ref.detach()).norm().item() / (ref.detach() - init.float()).norm().item()
        changed[mode] = (p.detach() != init).float().mean().item()
    assert changed["none"] < 0.3, changed          # most plain-bf16 updates vanish (measured: 16% change)
    assert changed["fp32"] > 0.5 and changed["kahan"] > 0.5, changed
    assert err["fp32"] < 0.1 and err["kahan"] < 0.1, err   # 8-bit states: close, not equal, to fp32 AdamW
    assert err["fp32"] < 0.2 * err["none"] and err["kahan"] < 0.2 * err["none"], err


# ---------------------------------------------------------------------------------------------------- v floor
def test_v_floor_bounds_update_under_heavy_tails(cpu_kernel, monkeypatch):
    """Note [v floor] (quant.py): tiny gradients next to a huge one in each block, then a zero gradient.

    Without the floor v decodes to 0 and the update is m / eps (thousands of lr); with it the update stays of
    the order of lr, as in fp32 AdamW.
    """
    n, lr = 8192, 1e-3
    g1 = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 1e-4
    g1[::256] = 100.0
    g2 = torch.zeros(n)
    g2[::256] = 100.0

    def second_update(**kw):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = Hybrid8bitOptimizer([p], lr=lr, **kw)
        p.grad = g1
        opt.step()
        before = p.detach().clone()
        p.grad = g2
        opt.step()
        return (p.detach() - before).abs().max().item() / lr

    fp32_ratio = second_update(state_dtype="fp32")
    ratio = second_update()
    assert fp32_ratio < 1.5
    assert ratio < 3.0, f"8-bit update is {ratio:.0f} x lr"
    if cpu_kernel == "torch":
        # the same with the floor switched off: proves the test exercises the collapse
        real = F.quantize_blockwise
        monkeypatch.setattr(F, "quantize_blockwise", lambda *a, **k: real(*a, **{**k, "nonzero_floor": False}))
        assert second_update() > 100.0


# ---------------------------------------------------------------------------------------------------- checkpoints
def _mixed_setup(params):
    return [{"params": params[:3]}, {"params": params[3:], "master_weights": "kahan", "lr": 5e-3}]


def test_state_dict_round_trip_continues_identically(cpu_kernel):
    base = _params([(64, 80), (4097,), (17,), (5000,), (40, 110)], dtype=torch.bfloat16)
    a = _clone(base)
    opt_a = Hybrid8bitOptimizer(_mixed_setup(a), lr=1e-3, weight_decay=0.01, fp32_state_params=[a[4]])
    for step in range(3):
        for p, g in zip(a, _grads(a, step)):
            p.grad = g
        opt_a.clip_grad_norm(1.0)
        opt_a.step()
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    saved_params = [p.detach().clone() for p in a]
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)   # what the HF Trainer does on resume
    b = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt_b = Hybrid8bitOptimizer(_mixed_setup(b), lr=1.0, weight_decay=0.0)   # hyperparameters come from the file
    opt_b.load_state_dict(loaded)
    assert opt_b.param_groups[1]["lr"] == 5e-3 and opt_b.param_groups[0]["weight_decay"] == 0.01
    st = opt_b.state[b[0]]
    assert st["state1"].dtype == torch.uint8 and st["kahan"].dtype == torch.bfloat16 and st["step"] == 3
    assert opt_b.state[b[3]]["kahan"].dtype == torch.bfloat16
    assert opt_b.state[b[4]]["state1"].dtype == torch.float32     # fp32_state_params survive as saved
    assert opt_b.state[b[2]]["state1"].dtype == torch.float32     # below min_8bit_size
    assert opt_b.state_bytes() == opt_a.state_bytes()
    for step in range(3, 6):
        grads = _grads(a, step)
        for ps in (a, b):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        for opt in (opt_a, opt_b):
            opt.clip_grad_norm(1.0)
            opt.step()
    _same_bytes(_snapshot(opt_a, a), _snapshot(opt_b, b))


def test_resume_with_other_fp32_state_modules_warns_and_keeps_saved_states(caplog):
    """fp32_state_params (what fp32_state_modules selects) is not a group option, so the layout-option warning missed
    it: a resume naming other modules silently kept the saved states. Now: one warning with counts, saved states kept;
    none when the choice is unchanged."""
    params = _params([(64, 80), (40, 110)])
    opt = Hybrid8bitOptimizer(params, fp32_state_params=[params[1]])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()

    def resume(fp32: list[int]) -> tuple[Hybrid8bitOptimizer, list[str]]:
        caplog.clear()
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        o = Hybrid8bitOptimizer(ps, fp32_state_params=[ps[i] for i in fp32])
        with caplog.at_level(logging.WARNING, logger="lazytrain_hf.optim.hybrid8"):
            o.load_state_dict(sd)
        return o, [r.getMessage() for r in caplog.records]

    _, msgs = resume([1])
    assert msgs == []
    o, msgs = resume([0])
    (msg,) = msgs
    assert "keeps 1 parameters' 8-bit states" in msg and "and 1 parameters' fp32 states" in msg, msg
    _, msgs = resume([0, 1])   # only saved 8-bit states asked fp32: the other half is not mentioned as "0 ..."
    assert len(msgs) == 1 and "keeps 1 parameters' 8-bit states" in msgs[0] and "fp32 states that" not in msgs[0]
    assert [o.state[p]["state1"].dtype for p in o.param_groups[0]["params"]] == [torch.uint8, torch.float32]


def test_load_state_dict_rejects_mismatches():
    params = _params([(10,), (20,)])
    opt = Hybrid8bitOptimizer(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="parameter groups"):
        Hybrid8bitOptimizer([{"params": params[:1]}, {"params": params[1:]}]).load_state_dict(sd)
    with pytest.raises(ValueError, match="saved parameters"):
        Hybrid8bitOptimizer(params[:1]).load_state_dict({**sd, "param_groups": sd["param_groups"]})
    t_opt = torch.optim.AdamW(params)
    t_opt.step()
    with pytest.raises(ValueError, match="unknown state keys"):
        Hybrid8bitOptimizer(params).load_state_dict(t_opt.state_dict())
    # another optimizer's checkpoint of many tensors: one line naming the fix, not one line per parameter
    many = _params([(10,)] * 40)
    for p in many:
        p.grad = torch.ones_like(p)
    t_many = torch.optim.AdamW(many)
    t_many.step()
    with pytest.raises(ValueError) as e:
        Hybrid8bitOptimizer(many).load_state_dict(t_many.state_dict())
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and "parameters 0, 1, 2, 3, 4 and 35 more (40 in all): unknown state keys" in lines[1], lines
    assert "Resume with the optim that wrote it" in lines[1]
    other = _params([(11,), (20,)])
    with pytest.raises(ValueError, match="elements"):
        Hybrid8bitOptimizer(other).load_state_dict(sd)


# ---------------------------------------------------------------------------------------------------- layout
def test_state_layout_and_bytes():
    params = _params([(4096,), (4095,), (10_000,), (300, 20)], dtype=torch.bfloat16)
    opt = Hybrid8bitOptimizer([{"params": params[:3]}, {"params": params[3:], "master_weights": "none"}],
                              fp32_state_params=[params[2]])
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    s = [opt.state[p] for p in params]
    assert s[0]["state1"].dtype == torch.uint8 and s[0]["absmax1"].shape == (16,)       # 4096 >= min_8bit_size
    assert s[1]["state1"].dtype == torch.float32 and "absmax1" not in s[1]             # 4095 < min_8bit_size
    assert s[2]["state1"].dtype == torch.float32                                       # fp32_state_params
    assert s[3]["state2"].dtype == torch.uint8 and s[3]["absmax2"].shape == (24,) and "master" not in s[3]
    assert all(st["state1"].shape == p.shape for st, p in zip(s, params))
    # auto: a bf16 Kahan buffer (2 bytes) per bf16 parameter
    expected = (4096 * (2 + 2) + 16 * 8) + 4095 * (8 + 2) + 10_000 * (8 + 2) + (6000 * 2 + 24 * 8)
    assert opt.state_bytes() == {"cpu": expected}
    for key in ("state1", "state2", "absmax1", "absmax2", "kahan"):
        assert key in s[0]


def test_fp32_params_get_no_master_and_kahan_is_bf16_only():
    p32, p16 = _params([(5000,)])[0], _params([(5000,)], dtype=torch.bfloat16)[0]
    for mode in ("auto", "fp32", "kahan", "none"):
        a, b = torch.nn.Parameter(p32.detach().clone()), torch.nn.Parameter(p16.detach().clone())
        opt = Hybrid8bitOptimizer([a, b], master_weights=mode)
        a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
        opt.step()
        assert "master" not in opt.state[a] and "kahan" not in opt.state[a]
        assert ("master" in opt.state[b]) == (mode == "fp32")
        assert ("kahan" in opt.state[b]) == (mode in ("auto", "kahan"))  # auto: kahan for bf16
    p_half = torch.nn.Parameter(p16.detach().to(torch.float16))
    opt = Hybrid8bitOptimizer([p_half])
    p_half.grad = torch.ones_like(p_half)
    opt.step()
    assert "master" in opt.state[p_half] and "kahan" not in opt.state[p_half]  # auto: fp32 for fp16


def test_invalid_arguments_are_listed_together():
    p = _params([(3,)])
    with pytest.raises(ValueError) as exc:
        Hybrid8bitOptimizer(p, lr=-1.0, betas=(0.9, 1.0), block_size=100, state_dtype="4bit",
                            master_weights="fp64")
    msg = str(exc.value)
    for needle in ("lr", "betas[1]", "block_size", "state_dtype", "master_weights", "but got"):
        assert needle in msg
    opt = Hybrid8bitOptimizer(p)
    with pytest.raises(ValueError, match="param group"):
        opt.add_param_group({"params": _params([(2,)]), "eps": -1.0})
    with pytest.raises(ValueError, match="not a parameter"):
        opt.step_params([torch.zeros(3)])


def test_lr_scheduler_drives_group_lr():
    p = _params([(100,)])
    opt = Hybrid8bitOptimizer(p, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s >= 1 else 1.0)
    p[0].grad = torch.ones(100)
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = p[0].detach().clone()
    opt.step()
    assert torch.equal(p[0].detach(), before)


def test_prepared_moments_give_the_same_bits_and_never_go_stale():
    """`prepare_states` before some steps (the fused kernel then reads the fp32 copies instead of dequantizing):
    every byte of params and states equals a never-prepared run after each step, bf16 + Kahan and fp32 master,
    clipping on. Stale copies are never read: a step without a new preparation, a `load_state_dict` after one,
    and a preparation of params without 8-bit states (skipped: count 0)."""
    requires_cpu_kernel()
    base = _params([(64, 80), (4097,), (17,), (5000,)], dtype=torch.bfloat16)
    runs = {}
    for prep in (False, True):
        ps = _clone(base)
        opt = Hybrid8bitOptimizer([{"params": ps[:2], "master_weights": "kahan"}, {"params": ps[2:]}], lr=1e-3,
                                  weight_decay=0.01)
        snaps = []
        for step in range(5):
            for p, g in zip(ps, _grads(ps, step)):
                p.grad = g
            if prep and step in (1, 2, 4):  # not before step 3: the copies from before step 2 are stale by then
                n = opt.prepare_states(ps)
                assert n == sum(p.numel() for p in ps if p.numel() >= 4096)  # (17,) keeps fp32 states
                assert opt.prepared_bytes() == 8 * n
            if prep and step == 4:  # a load after the preparation: the loaded states win
                opt.load_state_dict(opt.state_dict())
                assert not opt._prep_ready
            opt.clip_grad_norm(0.5)
            opt.step()
            assert not opt._prep_ready  # every update discards its copy
            snaps.append(_snapshot(opt, ps))
        runs[prep] = snaps
    for a, b in zip(runs[False], runs[True]):
        _same_bytes(a, b)
    fresh = Hybrid8bitOptimizer(_params([(4097,)]))
    assert fresh.prepare_states(list(fresh.param_groups[0]["params"])) == 0  # no states yet


def test_prepared_copies_are_what_the_update_reads():
    """The prepared fp32 copies equal the torch dequantization of the states, and the update reads them: zeroing
    the prepared m after `prepare_states` changes the result (so the bit-equality test above is not vacuous)."""
    from lazytrain_hf.optim.quant import dequantize_blockwise

    requires_cpu_kernel()
    base = _params([(64, 80)], dtype=torch.bfloat16)
    out = {}
    for zero_m in (False, True):
        ps = _clone(base)
        opt = Hybrid8bitOptimizer(ps, lr=1e-3, master_weights="kahan")
        for step in range(2):
            ps[0].grad = _grads(ps, step)[0]
            if step == 1:
                assert opt.prepare_states(ps) == ps[0].numel()
                st, books = opt.state[ps[0]], opt._books_for(ps[0].device)
                m, v = opt._prep_bufs[id(ps[0])]
                assert torch.equal(m, dequantize_blockwise(st["state1"], st["absmax1"], books.qmap1, 256).view(-1))
                assert torch.equal(v, dequantize_blockwise(st["state2"], st["absmax2"], books.qmap2, 256).view(-1))
                if zero_m:
                    m.zero_()
            opt.step()
        out[zero_m] = ps[0].detach().clone()
    assert not torch.equal(out[False], out[True])
