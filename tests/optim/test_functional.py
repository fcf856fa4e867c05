"""Kernels behind lazytrain_hf/optim/functional.py: the fused C++ CPU kernel equals the pure-torch reference."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain_hf.optim import functional as F
from lazytrain_hf.optim import kernel_select as K
from lazytrain_hf.optim.hybrid8 import Hybrid8bitOptimizer

from .test_quant import lookup_mode, requires_cpu_kernel

# (name, param dtype, grad dtype, master_weights, state_dtype, numel, block_size)
CASES = [
    ("fp32-8bit", torch.float32, torch.float32, "auto", "8bit", 4097, 256),
    ("fp32-fp32state", torch.float32, torch.float32, "auto", "fp32", 4097, 256),
    ("fp32-bf16grad", torch.float32, torch.bfloat16, "auto", "8bit", 5000, 64),
    ("bf16-master", torch.bfloat16, torch.float32, "fp32", "8bit", 4097, 256),
    ("bf16-master-fp32state", torch.bfloat16, torch.float32, "fp32", "fp32", 300, 256),
    ("bf16-kahan", torch.bfloat16, torch.float32, "kahan", "8bit", 70_000, 256),
    ("bf16-kahan-bf16grad", torch.bfloat16, torch.bfloat16, "kahan", "8bit", 4097, 128),
    ("bf16-none", torch.bfloat16, torch.bfloat16, "none", "8bit", 4097, 256),
    ("fp32-one-element", torch.float32, torch.float32, "auto", "fp32", 1, 256),
    ("bf16-block-not-dividing", torch.bfloat16, torch.float32, "fp32", "8bit", 100_003, 1024),
]


def _prepared_state(pdtype, gdtype, master, state_dtype, n, block_size, seed=0):
    """A parameter, its gradient and a non-trivial state after two reference (torch-kernel) steps."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.05).to(pdtype))
    grads = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) for _ in range(3)]
    opt = Hybrid8bitOptimizer([p], lr=1e-3, weight_decay=0.1, block_size=block_size, min_8bit_size=1,
                              state_dtype=state_dtype, master_weights=master)
    opt._init_state(p, opt.param_groups[0])
    st = opt.state[p]
    for gr in grads[:2]:
        st["step"] += 1
        F.adamw_step(p, gr, st, F.AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.1, st["step"]), opt._books_for(p.device),
                     block_size=block_size, kernel="torch")
    return p, grads[2].to(gdtype), opt


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cpp_kernel_equals_torch_reference(case):
    requires_cpu_kernel()
    _, pdtype, gdtype, master, state_dtype, n, block_size = case
    p, grad, opt = _prepared_state(pdtype, gdtype, master, state_dtype, n, block_size)
    books = opt._books_for(p.device)
    results = {}
    for kernel in ("torch", "cpp"):
        q = p.detach().clone()
        st = copy.deepcopy(opt.state[p])
        st["step"] += 1
        grad_before = grad.clone()
        hyper = F.AdamWHyper(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=st["step"],
                             clip_coef=0.37)
        used = F.adamw_step(q, grad, st, hyper, books, block_size=block_size, kernel=kernel, threads=2)
        assert used == kernel
        assert torch.equal(grad, grad_before), "kernels must not modify the gradient"
        results[kernel] = (q, st)
    (q_t, s_t), (q_c, s_c) = results["torch"], results["cpp"]
    # parameters: fp32 rounding order only (bf16: the same rounding of nearly the same fp32 value)
    if pdtype == torch.float32:
        torch.testing.assert_close(q_c, q_t, rtol=1e-6, atol=1e-7)
    else:
        ulp = (q_t.float().abs() * 2.0**-7).clamp(min=1e-30)
        assert bool(((q_c.float() - q_t.float()).abs() <= ulp).all()), "bf16 params differ by more than one ulp"
    for key in ("master", "kahan"):
        if key in s_t:
            # the represented value (master, or param + kahan) agrees to fp32 rounding
            val_t = s_t[key].float() + (q_t.float() if key == "kahan" else 0)
            val_c = s_c[key].float() + (q_c.float() if key == "kahan" else 0)
            # Kahan: the bf16 residual holds ~8 bits below the param's last bit, so values agree to ~2**-16
            rtol = 1e-6 if key == "master" else 2.0**-15
            torch.testing.assert_close(val_c, val_t, rtol=rtol, atol=1e-7)
    if state_dtype == "8bit":
        for a in ("absmax1", "absmax2"):
            torch.testing.assert_close(s_c[a], s_t[a], rtol=1e-6, atol=0)
        for s in ("state1", "state2"):
            diff = (s_c[s].int() - s_t[s].int()).abs()
            assert int(diff.max()) <= 1, f"{s}: codes differ by {int(diff.max())} steps"
            assert float((diff > 0).float().mean()) < 0.01, f"{s}: too many codes differ"
    else:
        torch.testing.assert_close(s_c["state1"], s_t["state1"], rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(s_c["state2"], s_t["state2"], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("case", [c for c in CASES if c[4] == "8bit"], ids=[c[0] for c in CASES if c[4] == "8bit"])
def test_cpp_lookup_modes_are_bitwise_equal(case):
    """The kernel's two table-read modes (gathers, scalar loads) give the same bits, parameters and states, with
    non-finite and huge gradient elements in the mix."""
    lib = requires_cpu_kernel()
    _, pdtype, gdtype, master, state_dtype, n, block_size = case
    p, grad, opt = _prepared_state(pdtype, gdtype, master, state_dtype, n, block_size)
    grad = grad.clone()
    grad[1::997], grad[2::1999], grad[3::2999] = float("nan"), float("inf"), 1e30
    results = {}
    for mode in ("gather", "scalar"):
        q = p.detach().clone()
        st = copy.deepcopy(opt.state[p])
        st["step"] += 1
        hyper = F.AdamWHyper(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=st["step"],
                             clip_coef=0.37)
        with lookup_mode(lib, mode):
            F.adamw_step(q, grad, st, hyper, opt._books_for(p.device), block_size=block_size, kernel="cpp",
                         threads=2)
        results[mode] = [q] + [v for v in st.values() if isinstance(v, torch.Tensor)]
    for a, b in zip(results["gather"], results["scalar"], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_lookup_env_picks_table_reads(monkeypatch, caplog):
    from lazytrain_hf.optim import _cpu_kernel

    lib = requires_cpu_kernel()
    before = lib.lt_get_lookup()
    try:
        for mode, code in _cpu_kernel.LOOKUP_MODES.items():
            monkeypatch.setenv(_cpu_kernel.LOOKUP_ENV, mode)
            said = _cpu_kernel._configure_lookup(lib)
            assert before < 0 or (lib.lt_get_lookup() == code and mode in said)
        monkeypatch.setenv(_cpu_kernel.LOOKUP_ENV, "fastest")   # bad value: logged, then measured as unset
        said = _cpu_kernel._configure_lookup(lib)
        assert before < 0 or ("measured" in said and "fastest" in caplog.text)
    finally:
        lib.lt_set_lookup(before)


def test_env_forces_cpu_kernel(monkeypatch):
    p = torch.zeros(8)
    st = {"state1": torch.zeros(8), "state2": torch.zeros(8)}
    monkeypatch.setenv(F.CPU_KERNEL_ENV, "torch")
    assert K.select_kernel(p, p, st, 256) == "torch"
    monkeypatch.setenv(F.CPU_KERNEL_ENV, "cpp")
    if F.cpu_kernel_status()[0]:
        assert K.select_kernel(p, p, st, 256) == "cpp"
        # a dtype the fused kernel does not take falls back to torch even when forced
        assert K.select_kernel(p.half(), p.half(), st, 256) == "torch"
    monkeypatch.setenv(F.CPU_KERNEL_ENV, "fast")
    with pytest.raises(ValueError, match="LAZYTRAIN_CPU_KERNEL"):
        K.select_kernel(p, p, st, 256)


def test_forced_cpp_without_build_raises(monkeypatch):
    from lazytrain_hf.optim import _cpu_kernel

    monkeypatch.setattr(_cpu_kernel, "_status", (False, "no compiler (simulated)"))
    monkeypatch.setattr(_cpu_kernel, "_lib", None)
    monkeypatch.setattr(K, "load_cpu_kernel", lambda: None)
    p = torch.zeros(8)
    st = {"state1": torch.zeros(8), "state2": torch.zeros(8)}
    monkeypatch.setenv(F.CPU_KERNEL_ENV, "cpp")
    with pytest.raises(RuntimeError, match="simulated"):
        K.select_kernel(p, p, st, 256)
    monkeypatch.delenv(F.CPU_KERNEL_ENV)
    assert K.select_kernel(p, p, st, 256) == "torch"   # auto: falls back (and logs the reason once)


def test_adamw_step_rejects_mismatched_sizes():
    books = F.Codebooks.for_device("cpu")
    st = {"state1": torch.zeros(8), "state2": torch.zeros(8), "step": 1}
    with pytest.raises(ValueError, match="elements"):
        F.adamw_step(torch.zeros(8), torch.zeros(7), st, F.AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1), books,
                     block_size=256)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_sliced_update_equals_whole(case, device, monkeypatch):
    """Large tensors are updated in CHUNK_ELEMENTS slices (bounded fp32 temporaries); blocks are independent, so
    the result is bitwise the whole-tensor update ("torch" kernel on the CPU, bitsandbytes' on CUDA)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, pdtype, gdtype, master, state_dtype, n, block_size = case
    kernel = "torch" if device == "cpu" else "bnb"
    if kernel == "bnb" and state_dtype == "8bit" and block_size != F.BNB_BLOCK_SIZE:
        pytest.skip("bitsandbytes' 8-bit kernel needs 256-element blocks")
    p, grad, opt = _prepared_state(pdtype, gdtype, master, state_dtype, n, block_size)
    books = opt._books_for(torch.device(device))
    results = []
    for chunk in (1 << 25, 3 * block_size):  # whole; slices of 3 blocks (the last one partial)
        monkeypatch.setattr(F, "CHUNK_ELEMENTS", chunk)
        q = p.detach().clone().to(device)
        st = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in copy.deepcopy(opt.state[p]).items()}
        st["step"] += 1
        hyper = F.AdamWHyper(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=st["step"],
                             clip_coef=0.37)
        F.adamw_step(q, grad.to(device), st, hyper, books, block_size=block_size, kernel=kernel)
        results.append((q, st))
    (q_w, s_w), (q_s, s_s) = results
    assert torch.equal(q_s, q_w)
    for k, v in s_w.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(s_s[k], v), k


def test_cpp_self_check_passes_here_and_catches_a_wrong_kernel(monkeypatch):
    """The fused kernel is checked against the torch reference on the CPU it was built for (`-march=native`) before
    its first use; a kernel that computes wrong or non-finite values is not used (auto) or refused (cpp)."""
    requires_cpu_kernel()
    K.cpp_kernel_self_check.cache_clear()
    assert K.cpp_kernel_self_check(2) == (True, "ok")
    real = F.cpu_adamw_step

    def broken(lib, books, param, *args, **kw):
        real(lib, books, param, *args, **kw)
        param.view(-1)[::1000] = float("nan")

    monkeypatch.setattr(F, "cpu_adamw_step", broken)
    K.cpp_kernel_self_check.cache_clear()
    try:
        ok, reason = K.cpp_kernel_self_check(2)
        assert not ok and "non-finite" in reason
        p, g = torch.zeros(300, dtype=torch.bfloat16), torch.ones(300, dtype=torch.bfloat16)
        st = {"state1": torch.zeros(300, dtype=torch.uint8), "kahan": torch.zeros(300, dtype=torch.bfloat16)}
        monkeypatch.delenv(F.CPU_KERNEL_ENV, raising=False)
        assert K.select_kernel(p, g, st, 256) == "torch"
        monkeypatch.setenv(F.CPU_KERNEL_ENV, "cpp")
        with pytest.raises(RuntimeError, match="self-check"):
            K.select_kernel(p, g, st, 256)
    finally:
        K.cpp_kernel_self_check.cache_clear()


@pytest.mark.parametrize("master", ["kahan", "fp32"])
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float32], ids=["bf16grad", "fp32grad"])
def test_cpp_vector_lanes_equal_scalar_tail_bitwise(master, gdtype):
    """In one block of 15 elements, lanes 0-7 take the AVX2 path and 8-14 the scalar tail (`update_one`); with
    elements 8-14 copies of 0-6 (same block scale), both must give the same bits: parameter, master / compensation,
    codes. Pins the vectorized parameter write (Kahan: pipelined after the divisions, both roundings, the NaN
    fix-up taken only for non-finite lanes) to the scalar reference, non-finite and huge values included."""
    from lazytrain_hf.optim import _cpu_kernel as K
    from lazytrain_hf.optim.quant import dynamic_map

    lib = requires_cpu_kernel()
    tables = K.CpuTables.build(dynamic_map(True), dynamic_map(False))
    g = torch.Generator().manual_seed(7)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3e38, -1e30, 1e-40, 0.0, -0.0])

    def dup(x):  # elements 8..14 = 0..6
        x = x.clone()
        x[8:15] = x[0:7]
        return x

    for trial in range(300):
        p = (torch.randn(15, generator=g) * 0.05).bfloat16()
        grad = torch.randn(15, generator=g) * torch.exp(torch.randn(15, generator=g) * 2) * 1e-3
        comp = (torch.randn(15, generator=g) * 1e-4).bfloat16()
        mst = p.float() + torch.randn(15, generator=g) * 1e-4
        if trial % 3:
            for t in (p, grad, comp, mst):
                k = int(torch.randint(0, 7, (1,), generator=g))
                t[k] = specials[int(torch.randint(0, len(specials), (1,), generator=g))].to(t.dtype)
        p, grad, comp, mst = dup(p), dup(grad).to(gdtype), dup(comp), dup(mst)
        s1 = dup(torch.randint(0, 256, (15,), dtype=torch.uint8, generator=g))
        s2 = dup(torch.randint(0, 256, (15,), dtype=torch.uint8, generator=g))
        a1, a2 = torch.rand(1, generator=g) * 1e-2, torch.rand(1, generator=g) * 1e-4
        K.cpu_adamw_step(lib, tables, p, grad, s1, s2, a1, a2, mst if master == "fp32" else None,
                         comp if master == "kahan" else None, block_size=16, clip_coef=0.37, beta1=0.9, beta2=0.999,
                         eps=1e-8, decay=1 - 2e-4, step_size=2e-3, bc2_sqrt=0.05, threads=1)
        outs = [p, s1, s2] + ([comp] if master == "kahan" else [])
        for t in outs:
            assert torch.equal(t[0:7].view(torch.uint8), t[8:15].view(torch.uint8)), (trial, t)
        if master == "fp32":   # the master keeps NaN payloads: only where at most one operand was NaN
            finite = torch.isfinite(mst[0:7]) | torch.isfinite(mst[8:15])
            assert torch.equal(mst[0:7][finite].view(torch.int32), mst[8:15][finite].view(torch.int32)), trial
            assert torch.equal(torch.isnan(mst[0:7]), torch.isnan(mst[8:15])), trial


def test_cpp_thread_count_does_not_change_bits():
    """The 8-bit loop hands out dynamic chunks of 64 blocks (robust to a core shared with the launching thread):
    which thread runs a block must not change a bit. 200k elements: 13 chunks over 1 and 3 threads."""
    requires_cpu_kernel()
    p, grad, opt = _prepared_state(torch.bfloat16, torch.bfloat16, "kahan", "8bit", 200_000, 256)
    out = []
    for threads in (1, 3):
        q, st = p.detach().clone(), copy.deepcopy(opt.state[p])
        st["step"] += 1
        hyper = F.AdamWHyper(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=st["step"],
                             clip_coef=0.5)
        F.adamw_step(q, grad, st, hyper, opt._books_for(p.device), block_size=256, kernel="cpp", threads=threads)
        out.append([q] + [v for v in st.values() if isinstance(v, torch.Tensor)])
    for a, b in zip(*out, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
