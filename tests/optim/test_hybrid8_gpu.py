"""GPU: bitsandbytes' CUDA kernels behind `Hybrid8bitOptimizer` agree with the pure-torch reference.

Run on the GPU machine: ``pytest -m gpu tests/optim``. bitsandbytes rounds differently from the reference
(``1 - beta2`` in fp32, ``__fdividef``, its own code search, the sign fix of m), so 8-bit states are compared
within one code step, never bitwise.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain_hf.optim import Hybrid8bitOptimizer
from lazytrain_hf.optim import functional as F
from lazytrain_hf.optim import kernel_select as K

from ..conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


@pytest.fixture
def bnb_cuda():
    pytest.importorskip("bitsandbytes")
    ok, reason = K.bitsandbytes_cuda_status(0)
    if not ok:
        pytest.skip(f"bitsandbytes CUDA kernels unavailable: {reason}")


@pytest.mark.parametrize("pdtype,master,state_dtype", [
    (torch.float32, "auto", "8bit"),
    (torch.bfloat16, "fp32", "8bit"),
    (torch.bfloat16, "kahan", "8bit"),
    (torch.bfloat16, "none", "8bit"),
    (torch.float32, "auto", "fp32"),
    (torch.bfloat16, "fp32", "fp32"),
])
def test_bnb_kernel_matches_torch_reference(bnb_cuda, pdtype, master, state_dtype):
    n = 70_001   # partial last block
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    p = torch.nn.Parameter((torch.randn(n, device=dev, generator=gen) * 0.05).to(pdtype))
    grads = [torch.randn(n, device=dev, generator=gen) for _ in range(3)]
    opt = Hybrid8bitOptimizer([p], lr=1e-3, weight_decay=0.1, state_dtype=state_dtype, master_weights=master)
    books = opt._books_for(dev)
    opt._init_state(p, opt.param_groups[0])
    st = opt.state[p]
    for g in grads[:2]:   # a non-trivial starting state, from the reference
        st["step"] += 1
        F.adamw_step(p, g, st, F.AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, st["step"]), books, block_size=256,
                     kernel="torch")
    out = {}
    for kernel in ("torch", "bnb"):
        q, s = p.detach().clone(), copy.deepcopy(st)
        s["step"] += 1
        g = grads[2].clone()
        F.adamw_step(q, g, s, F.AdamWHyper(2e-3, 0.9, 0.999, 1e-8, 0.1, s["step"], clip_coef=0.37), books,
                     block_size=256, kernel=kernel)
        assert torch.equal(g, grads[2]), "the gradient must not be modified"
        out[kernel] = (q, s)
    (q_t, s_t), (q_b, s_b) = out["torch"], out["bnb"]
    if pdtype == torch.float32:
        torch.testing.assert_close(q_b, q_t, rtol=1e-5, atol=1e-7)
    else:
        # the fp32 values agree to rtol 1e-5 / atol 1e-7 (bitsandbytes' 1 - beta2 in fp32 shifts v by 1.3e-5
        # relative); rounding those to bf16 adds at most one bf16 ulp
        bound = q_t.float().abs() * (2.0**-7 + 1e-5) + 1e-7
        excess = (q_b.float() - q_t.float()).abs() - bound
        assert float(excess.max()) <= 0, f"bf16 params differ beyond tolerance by {float(excess.max()):.3g}"
    if "master" in s_t:
        torch.testing.assert_close(s_b["master"], s_t["master"], rtol=1e-5, atol=1e-7)
    if state_dtype == "8bit":
        for key in ("absmax1", "absmax2"):
            torch.testing.assert_close(s_b[key], s_t[key], rtol=1e-4, atol=0)
        for key in ("state1", "state2"):
            diff = (s_b[key].int() - s_t[key].int()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.02, key
        assert int(s_b["state2"].min()) >= 1   # Note [v floor]
    else:
        torch.testing.assert_close(s_b["state2"], s_t["state2"], rtol=1e-4, atol=1e-12)


def test_cuda_fp32_mode_equals_torch_adamw(bnb_cuda):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.1) for s in [(256, 320), (4097,), (7,)]]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    t_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    h_opt = Hybrid8bitOptimizer(ours, lr=1e-2, weight_decay=0.1, state_dtype="fp32")
    for _ in range(5):
        for p, q in zip(ref, ours):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        h_opt.clip_grad_norm(1.0)
        t_opt.step()
        h_opt.step()
    for p, q in zip(ref, ours):
        assert ((q - p).abs().max() / p.abs().max()).item() <= 1e-5


def test_cuda_nonfinite_skip_and_checkpoint_to_host(bnb_cuda):
    dev = torch.device("cuda")
    params = [torch.nn.Parameter((torch.randn(s, device=dev) * 0.1).bfloat16()) for s in [(64, 80), (4097,)]]
    opt = Hybrid8bitOptimizer(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.clip_grad_norm(1.0)
    opt.step()
    before = [p.detach().clone() for p in params] + [v.clone() for p in params for v in opt.state[p].values()
                                                         if isinstance(v, torch.Tensor)]
    params[0].grad[0, 0] = float("nan")
    opt.clip_grad_norm(1.0)
    opt.step()
    assert opt.last_step_skipped
    after = [p.detach() for p in params] + [v for p in params for v in opt.state[p].values()
                                            if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    # restore a CUDA-made state next to pinned host copies of the params: states land on the host, pageable (the
    # CPU updates them; pinning would round each to a power of two)
    host = [torch.nn.Parameter(p.detach().cpu().pin_memory()) for p in params]
    h_opt = Hybrid8bitOptimizer(host)
    h_opt.load_state_dict(opt.state_dict())
    for p in host:
        for v in h_opt.state[p].values():
            if isinstance(v, torch.Tensor):
                assert v.device.type == "cpu" and not v.is_pinned()
    assert h_opt.state_bytes().keys() == {"cpu"}


def test_cuda_block_size_other_than_256_uses_torch_path(bnb_cuda, monkeypatch):
    """bitsandbytes' kernel is compiled for 256-element blocks: with it chosen (LAZYTRAIN_GPU_KERNEL=bnb; "auto"
    takes the Triton kernel, which handles any power-of-two block), other block sizes take the torch update."""
    monkeypatch.setenv(F.GPU_KERNEL_ENV, "bnb")
    p = torch.nn.Parameter(torch.randn(8192, device="cuda"))
    st = {"state1": torch.zeros(8192, dtype=torch.uint8, device="cuda"),
          "state2": torch.zeros(8192, dtype=torch.uint8, device="cuda")}
    assert K.select_kernel(p, p, st, 512) == "torch"
    assert K.select_kernel(p, p, st, 256) == "bnb"
    opt = Hybrid8bitOptimizer([p], block_size=512)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["absmax1"].numel() == 16


def test_bnb_update_under_a_side_stream_waits_for_its_inputs(bnb_cuda):
    """bitsandbytes launches its optimizer kernel on the legacy default stream whatever the current stream is.
    Under a side stream whose producer of the gradient is still running (a long sleep queued first), the update
    must still see the finished gradient and finish before the side stream reads the result: the same values as
    on the default stream. Without `functional._on_default_stream` the kernel read the stale gradient (non-finite
    norms on an H200, 2026-11-29)."""
    n = 1 << 20
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    p = torch.nn.Parameter((torch.randn(n, device=dev, generator=gen) * 0.05).to(torch.bfloat16))
    opt = Hybrid8bitOptimizer([p], lr=1e-3, weight_decay=0.1, master_weights="kahan")
    books = opt._books_for(dev)
    opt._init_state(p, opt.param_groups[0])
    grad = torch.randn(n, device=dev, generator=gen)
    hyper = F.AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, 1)
    ref_p, ref_s = p.detach().clone(), copy.deepcopy(opt.state[p])
    F.adamw_step(ref_p, grad, ref_s, hyper, books, block_size=256, kernel="bnb")
    torch.cuda.synchronize()
    q, s = p.detach().clone(), copy.deepcopy(opt.state[p])
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        g = torch.zeros(n, device=dev)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the gradient exists on this stream
        g.copy_(grad)
        F.adamw_step(q, g, s, hyper, books, block_size=256, kernel="bnb")
        out = q.float().clone()  # read on the side stream, right after the update
    torch.cuda.synchronize()
    assert torch.equal(out, ref_p.float())
    for key in ("state1", "state2", "absmax1", "absmax2", "kahan"):
        assert torch.equal(s[key], ref_s[key]), key
