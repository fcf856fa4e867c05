"""The fused Triton update (`optim/_triton_kernel.py`) gives the C++ CPU kernel's bits.

On the CPU the kernel runs in Triton's interpreter (numpy, no FMA contraction; `tl.fma` is a true fused
multiply-add there), so CI checks the arithmetic itself; the GPU tests (`-m gpu`) check the compiled kernel
against the same C++ reference and time nothing."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain_hf.optim import functional as F
from lazytrain_hf.optim import kernel_select as K
from lazytrain_hf.optim.quant import quantize_blockwise

pytest.importorskip("triton")
pytest.importorskip("numpy")  # Triton's interpreter runs on numpy

from lazytrain_hf.optim._triton_kernel import triton_adamw_step, triton_supports  # noqa: E402

# the interpreter runs 1 / absmax for zero blocks too (tl.where keeps 0 there), and numpy warns about it
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _state(n: int, mode: str, p: torch.Tensor, gen: torch.Generator, block: int, books: F.Codebooks) -> dict:
    m = torch.randn(n, generator=gen) * 1e-4
    v = torch.rand(n, generator=gen) * 1e-7
    if n > 2 * block:  # a block of zeros (absmax 0: inverse scale 0, every code the zero code)
        m[block:2 * block] = 0
        v[block:2 * block] = 0
    st = {"state1": torch.empty(n, dtype=torch.uint8), "state2": torch.empty(n, dtype=torch.uint8),
          "absmax1": torch.empty(-(-n // block)), "absmax2": torch.empty(-(-n // block)), "step": 3}
    quantize_blockwise(m, books.qmap1, block, mids=books.mids1, out=st["state1"], absmax_out=st["absmax1"])
    quantize_blockwise(v, books.qmap2, block, mids=books.mids2, nonzero_floor=True, out=st["state2"],
                       absmax_out=st["absmax2"])
    if mode == "kahan":
        st["kahan"] = (torch.randn(n, generator=gen) * 1e-5).to(torch.bfloat16)
    elif mode == "fp32":
        st["master"] = p.float() + torch.randn(n, generator=gen) * 1e-6
    return st


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(t.dtype, t.dtype))


def _assert_same_bits(p1, st1, p2, st2) -> None:
    assert torch.equal(_bits(p1), _bits(p2)), f"param differs in {(_bits(p1) != _bits(p2)).sum()} elements"
    for k, v in st1.items():
        if torch.is_tensor(v):
            a, b = _bits(v), _bits(st2[k].to(v.device))
            assert torch.equal(a, b), f"{k} differs in {(a != b).sum()} of {a.numel()} elements"


def _clone(st: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}


CASES = [  # (master mode, param dtype)
    ("kahan", torch.bfloat16), ("fp32", torch.bfloat16), ("none", torch.float32), ("none", torch.bfloat16)]


@pytest.mark.parametrize("mode, pdt", CASES)
@pytest.mark.parametrize("gdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, clip, beta1", [(1, 1.0, 0.9), (1100, 0.37, 0.9), (700, 1.0, 0.3)])
def test_interpreted_triton_update_equals_the_cpp_kernel(mode, pdt, gdt, n, clip, beta1):
    """Every mode, both gradient dtypes, a partial last block, a zero block, a clip coefficient below 1, and
    beta1 < 0.5 (the other branch of the m lerp): parameter, compensation / master, codes and absmax bit-equal."""
    books = F.Codebooks.for_device("cpu")
    gen = torch.Generator().manual_seed(n)
    p = (torch.randn(n, generator=gen) * 0.02).to(pdt)
    g = (torch.randn(n, generator=gen) * 1e-3).to(gdt)
    st = _state(n, mode, p, gen, 256, books)
    hyper = F.AdamWHyper(lr=1e-3, beta1=beta1, beta2=0.999, eps=1e-8, weight_decay=0.01, step=4, clip_coef=clip)
    p1, st1 = p.clone(), _clone(st)
    F.adamw_step(p1, g, st1, hyper, books, block_size=256, kernel="cpp")
    p2, st2 = p.clone(), _clone(st)
    assert F.adamw_step(p2, g, st2, hyper, books, block_size=256, kernel="triton") == "triton"
    assert not torch.equal(_bits(p1), _bits(p)) or n == 1  # the update did move the weights
    _assert_same_bits(p1, st1, p2, st2)


def test_interpreted_triton_update_non_finite_gradients_and_block_size():
    """An infinite gradient element (its block's absmax becomes inf: NaN codes path, canonical NaN bf16) and a
    block size other than 256: still the C++ kernel's bits."""
    books = F.Codebooks.for_device("cpu")
    gen = torch.Generator().manual_seed(3)
    n, block = 600, 128
    p = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    g = torch.randn(n, generator=gen) * 1e-3
    g[5] = float("inf")
    g[300] = -float("inf")
    st = _state(n, "kahan", p, gen, block, books)
    hyper = F.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    p1, st1, p2, st2 = p.clone(), _clone(st), p.clone(), _clone(st)
    F.adamw_step(p1, g, st1, hyper, books, block_size=block, kernel="cpp")
    triton_adamw_step(p2, g, st2, hyper, books, block_size=block)
    assert torch.isnan(p2.float()[:block]).any()  # the non-finite block did reach the kernel's NaN paths
    _assert_same_bits(p1, st1, p2, st2)


def test_triton_supports_names_what_it_does_not_handle():
    p = torch.zeros(512, dtype=torch.bfloat16)
    st8 = {"state1": torch.zeros(512, dtype=torch.uint8), "state2": torch.zeros(512, dtype=torch.uint8)}
    assert triton_supports(p, p, st8, 256) is None
    assert "fp32 optimizer states" in triton_supports(p, p, {"state1": torch.zeros(512)}, 256)
    assert "block_size=384" in triton_supports(p, p, st8, 384)
    assert "Kahan" in triton_supports(p.float(), p, {**st8, "kahan": p}, 256)
    assert "float16" in triton_supports(p.half(), p, st8, 256)


def test_gpu_kernel_choice_reads_the_environment(monkeypatch):
    monkeypatch.delenv(F.GPU_KERNEL_ENV, raising=False)
    assert K.gpu_kernel_choice() == "auto"
    monkeypatch.setenv(F.GPU_KERNEL_ENV, " BNB ")
    assert K.gpu_kernel_choice() == "bnb"
    monkeypatch.setenv(F.GPU_KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="LAZYTRAIN_GPU_KERNEL must be one of"):
        K.gpu_kernel_choice()


@pytest.mark.gpu
@pytest.mark.parametrize("mode, pdt", CASES)
def test_cuda_triton_update_equals_the_cpp_kernel(mode, pdt):
    """The compiled kernel on the GPU against the C++ kernel on the CPU: bit-equal over 3 M elements (a real layer's
    order of magnitude; many programs, a partial last block) and three steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    books_c, books_g = F.Codebooks.for_device("cpu"), F.Codebooks.for_device("cuda")
    gen = torch.Generator().manual_seed(7)
    n = 3_000_000 + 77
    p = (torch.randn(n, generator=gen) * 0.02).to(pdt)
    st = _state(n, mode, p, gen, 256, books_c)
    pc, stc = p.clone(), _clone(st)
    pg, stg = p.cuda(), {k: v.cuda() if torch.is_tensor(v) else v for k, v in st.items()}
    for step in range(1, 4):
        g = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
        hyper = F.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=step, clip_coef=0.5)
        F.adamw_step(pc, g, stc, hyper, books_c, block_size=256, kernel="cpp")
        assert F.adamw_step(pg, g.cuda(), stg, hyper, books_g, block_size=256) == "triton"
    torch.cuda.synchronize()
    _assert_same_bits(pc, stc, pg.cpu(), {k: v.cpu() if torch.is_tensor(v) else v for k, v in stg.items()})


@pytest.mark.gpu
def test_cuda_kernel_choice_prefers_triton_and_obeys_the_environment(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    st = {"state1": torch.zeros(4096, dtype=torch.uint8, device="cuda"),
          "state2": torch.zeros(4096, dtype=torch.uint8, device="cuda")}
    monkeypatch.delenv(F.GPU_KERNEL_ENV, raising=False)
    assert K.select_kernel(p, p, st, 256) == "triton"
    assert K.select_kernel(p, p, {"state1": torch.zeros(4096, device="cuda")}, 256) in ("bnb", "torch")
    monkeypatch.setenv(F.GPU_KERNEL_ENV, "bnb")
    assert K.select_kernel(p, p, st, 256) in ("bnb", "torch")
    monkeypatch.setenv(F.GPU_KERNEL_ENV, "torch")
    assert K.select_kernel(p, p, copy.deepcopy(st), 256) == "torch"


def test_self_check_passes_and_reports_failures(monkeypatch):
    """The self-check the CUDA kernel choice runs once per device: passes where the kernel gives the C++ bits (here
    the interpreter), and names what went wrong when the kernel raises or changes a bit (then select_kernel falls
    back to bitsandbytes' kernel, or raises under LAZYTRAIN_GPU_KERNEL=triton)."""
    check = K.triton_self_check.__wrapped__  # uncached
    assert check("cpu") == (True, "ok")
    real = F.triton_adamw_step

    def broken(*a, **k):
        raise RuntimeError("PTX toolchain missing")

    monkeypatch.setattr(F, "triton_adamw_step", broken)
    ok, why = check("cpu")
    assert not ok and "failed to run" in why and "PTX toolchain missing" in why

    def off_by_one_code(param, grad, state, hyper, books, *, block_size):
        real(param, grad, state, hyper, books, block_size=block_size)
        state["state2"][7] ^= 1

    monkeypatch.setattr(F, "triton_adamw_step", off_by_one_code)
    ok, why = check("cpu")
    assert not ok and "state2" in why and "C++ kernel's bits" in why


def test_self_check_runs_now_inside_deferred_launches():
    """Called while the executor queues GPU-side updates (`deferred_launches`), the check still runs its updates
    (the queue would otherwise swallow them and compare untouched tensors), and leaves the queue as it was."""
    with F.deferred_launches() as queue:
        assert K.triton_self_check.__wrapped__("cpu") == (True, "ok")
        assert queue == []
        assert F._deferral.queue is queue


def test_a_bad_kernel_override_fails_when_the_optimizer_is_built(monkeypatch):
    """LAZYTRAIN_GPU_KERNEL / LAZYTRAIN_CPU_KERNEL are read at each update; a typo must fail before training, when
    the optimizer is constructed (both named at once), not at the first GPU-side update after a whole step."""
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    monkeypatch.setenv(F.GPU_KERNEL_ENV, "tritton")
    monkeypatch.setenv(F.CPU_KERNEL_ENV, "c++")
    monkeypatch.setenv("LAZYTRAIN_CPU_THREADS", "banana")
    with pytest.raises(ValueError) as err:
        Hybrid8bitOptimizer([torch.nn.Parameter(torch.zeros(4))])
    assert "LAZYTRAIN_GPU_KERNEL must be one of" in str(err.value) and "'tritton'" in str(err.value)
    assert "LAZYTRAIN_CPU_KERNEL must be one of" in str(err.value)
    assert "LAZYTRAIN_CPU_THREADS must be an integer >= 1" in str(err.value) and "'banana'" in str(err.value)
    for bad in ("0", "-3"):  # were silently taken as 1
        monkeypatch.setenv("LAZYTRAIN_CPU_THREADS", bad)
        with pytest.raises(ValueError, match="LAZYTRAIN_CPU_THREADS"):
            F.cpu_threads()
    monkeypatch.setenv("LAZYTRAIN_CPU_THREADS", " 3 ")
    assert F.cpu_threads() == 3


def test_device_tables_are_built_from_codebooks_without_cpu_tables():
    """CUDA codebooks carry no CPU tables: the kernel builds its own with `CpuTables.build` from the maps. The same
    path on the CPU (codebooks stripped of their tables, a device key the cache has not seen) gives the C++ bits."""
    import dataclasses

    from lazytrain_hf.optim import _triton_kernel

    books = F.Codebooks.for_device("cpu")
    bare = dataclasses.replace(books, cpu=None)
    gen = torch.Generator().manual_seed(5)
    n = 700
    p = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    g = (torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16)
    st = _state(n, "kahan", p, gen, 256, books)
    hyper = F.AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=4, clip_coef=0.5)
    p1, st1, p2, st2 = p.clone(), _clone(st), p.clone(), _clone(st)
    F.adamw_step(p1, g, st1, hyper, books, block_size=256, kernel="cpp")
    _triton_kernel._tables_on.pop(("cpu", None), None)  # build now, from `bare`
    triton_adamw_step(p2, g, st2, hyper, bare, block_size=256)
    _assert_same_bits(p1, st1, p2, st2)
