"""The fused CPU kernel's ISA paths (generic, AVX2, AVX-512) give the same bits; LAZYTRAIN_CPU_ISA picks one.

The AVX-512 tests need a CPU with AVX-512 F/BW/VL/DQ (CI's has none: they skip there and run on the GPU host):

    python -m pytest tests/optim/test_cpu_isa.py -v -rs

Where SIMDe's headers are installed (Debian: libsimde-dev), the AVX-512 path also runs here through SIMDe's
emulation of the intrinsics (`test_avx512_path_under_simde_emulation`): its index logic and lane order are then
checked on any x86 CPU; only the hardware's own instruction semantics are left to the AVX-512 host.
"""

from __future__ import annotations

import copy
import pathlib
import platform
import shutil
import subprocess

import pytest
import torch

from lazytrain_hf.optim import _cpu_kernel as K
from lazytrain_hf.optim import functional as F
from lazytrain_hf.optim import kernel_select as KS
from lazytrain_hf.optim.hybrid8 import Hybrid8bitOptimizer

from .test_functional import _prepared_state
from .test_quant import requires_cpu_kernel

AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_has_avx512() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and set(AVX512_FLAGS) <= _cpu_flags()


def requires_isa(lib, isa: str) -> None:
    """Skip when the CPU cannot run `isa`; fail when it can but the native build lacks the path (a compiler without
    AVX-512 support, or the build's #if no longer matching)."""
    if isa == "avx512" and not cpu_has_avx512():
        missing = sorted(set(AVX512_FLAGS) - _cpu_flags())
        pytest.skip(f"this CPU has no AVX-512 (missing flags: {', '.join(missing)}); run on an AVX-512 F/BW/VL/DQ "
                    f"host, e.g. the GPU machine's")
    if isa == "avx2" and not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("this CPU has no AVX2 + FMA")
    assert isa in K.isa_paths(lib), f"the CPU can run {isa} but the native build has only {K.isa_paths(lib)}"


def test_isa_env_is_validated(monkeypatch):
    monkeypatch.setenv(K.ISA_ENV, " AVX2 ")
    assert K.cpu_isa_choice() == "avx2"
    monkeypatch.setenv(K.ISA_ENV, "")
    assert K.cpu_isa_choice() == "auto"
    monkeypatch.setenv(K.ISA_ENV, "sse4")
    with pytest.raises(ValueError, match=r"LAZYTRAIN_CPU_ISA must be one of \['auto', 'avx512', 'avx2', 'generic'\]"):
        K.cpu_isa_choice()
    with pytest.raises(ValueError) as err:  # when the optimizer is built, with the other problems
        Hybrid8bitOptimizer([torch.nn.Parameter(torch.zeros(4))])
    assert "LAZYTRAIN_CPU_ISA must be one of" in str(err.value) and "'sse4'" in str(err.value)


def test_forced_isa_is_used_or_refused(monkeypatch):
    lib = requires_cpu_kernel()
    p = torch.zeros(300)
    st = {"state1": torch.zeros(300, dtype=torch.uint8), "state2": torch.zeros(300, dtype=torch.uint8)}
    for isa in K.ISA_CODES:
        monkeypatch.setenv(K.ISA_ENV, isa)
        if isa in K.isa_paths(lib):
            assert K.resolve_isa(lib) == isa
            assert K.cpu_kernel_status()[1].startswith(f"ISA path {isa};")
        else:
            with pytest.raises(RuntimeError, match=f"LAZYTRAIN_CPU_ISA={isa} but"):
                K.resolve_isa(lib)
            with pytest.raises(RuntimeError, match=f"LAZYTRAIN_CPU_ISA={isa} but"):
                KS.select_kernel(p, p, st, 256)
            with pytest.raises(ValueError, match=f"LAZYTRAIN_CPU_ISA={isa} but .*unset LAZYTRAIN_CPU_ISA"):
                Hybrid8bitOptimizer([torch.nn.Parameter(torch.zeros(4))])  # when built, before any update
            assert f"ISA path unusable: LAZYTRAIN_CPU_ISA={isa}" in K.cpu_kernel_status()[1]
    monkeypatch.delenv(K.ISA_ENV)
    assert K.resolve_isa(lib) == ("avx2" if "avx2" in K.isa_paths(lib) else "generic")  # auto: AVX2 where built
    assert K.resolve_isa(lib, "generic") == "generic"   # an explicit argument beats the environment
    with pytest.raises(ValueError, match="ISA path must be"):
        K.resolve_isa(lib, "neon")


def test_native_build_has_avx512_where_the_cpu_has_it_and_runs_avx2_by_default():
    """AVX-512 is built and passes the load-time bit check where the CPU has it, but "auto" runs AVX2 (measured
    faster at 16 threads on the H200 host: benchmarks/results/hybrid8-cpu-isa-20261130.json);
    LAZYTRAIN_CPU_ISA=avx512 runs it."""
    lib = requires_cpu_kernel()
    requires_isa(lib, "avx512")
    status = K.cpu_kernel_status()[1]
    assert "refused" not in status and "avx512 opt-in" in status, status   # the bit check against AVX2 passed
    assert K.resolve_isa(lib, "auto") == "avx2" and K.resolve_isa(lib, "avx512") == "avx512"


# (isa, reference): every pair, so that a wrong AVX2 path cannot hide behind a matching AVX-512 one
PAIRS = [("avx512", "avx2"), ("avx512", "generic"), ("avx2", "generic")]
# (elements, steps, seed): partial blocks of every length class around 8 / 16 lanes, one element, several blocks
RUNS = [(1, 1, 0), (7, 2, 1), (8, 1, 2), (15, 1, 3), (16, 2, 4), (17, 1, 5), (31, 1, 6), (255, 3, 7), (256, 1, 8),
        (257, 2, 9), (3 * 256 + 77, 3, 10), (4097, 2, 11), (70_001, 1, 12)]


@pytest.mark.parametrize("isa,ref", PAIRS, ids=[f"{a}-vs-{b}" for a, b in PAIRS])
def test_isa_paths_give_the_same_bits(isa, ref):
    """Every master mode x fp32 / bf16 params x fp32 / bf16 grads x both table-read modes, with a zero block and
    inf / NaN / huge gradients, 1-3 steps; then the quantizer (`_cpu_kernel.isa_bit_check`)."""
    lib = requires_cpu_kernel()
    requires_isa(lib, isa)
    requires_isa(lib, ref)
    for n, steps, seed in RUNS:
        why = K.isa_bit_check(lib, isa, ref, n=n, seed=seed, steps=steps)
        assert why is None, f"{isa} vs {ref}, {n} elements, {steps} step(s): {why}"


@pytest.mark.parametrize("isa", list(K.ISA_CODES))
def test_env_forced_isa_gives_the_same_bits_through_the_optimizer(isa, monkeypatch):
    """The route training takes (`adamw_step`, LAZYTRAIN_CPU_ISA read at each update): three steps on 200k elements
    (3 threads, dynamic chunks) give the auto path's bits, parameters and every state."""
    lib = requires_cpu_kernel()
    requires_isa(lib, isa)
    p, grad, opt = _prepared_state(torch.bfloat16, torch.bfloat16, "kahan", "8bit", 200_003, 256, seed=4)
    out = {}
    for which in ("auto", isa):
        monkeypatch.setenv(K.ISA_ENV, which)
        q, st = p.detach().clone(), copy.deepcopy(opt.state[p])
        for k in range(3):
            st["step"] += 1
            hyper = F.AdamWHyper(lr=2e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=st["step"],
                                 clip_coef=0.5)
            assert F.adamw_step(q, grad * (k + 1), st, hyper, opt._books_for(p.device), block_size=256,
                                kernel="cpp", threads=3) == "cpp"
        out[which] = [q] + [v for v in st.values() if isinstance(v, torch.Tensor)]
    for a, b in zip(out["auto"], out[isa], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _simde_header() -> pathlib.Path | None:
    for root in ("/usr/include", "/usr/local/include"):
        h = pathlib.Path(root) / "simde" / "x86" / "avx512.h"
        if h.exists():
            return h
    return None


@pytest.fixture(scope="module")
def simde_kernel(tmp_path_factory):
    """The kernel source with the AVX-512 path forced on and its intrinsics from SIMDe (emulated with AVX2 / scalar
    code), built for this CPU."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= _cpu_flags():
        pytest.skip("the emulated build needs an x86 CPU with AVX2 + FMA (its reference is the AVX2 path)")
    if _simde_header() is None or shutil.which("g++") is None:
        pytest.skip("SIMDe headers (simde/x86/avx512.h; Debian: libsimde-dev) or g++ not found")
    src = K._SOURCE
    include, cond = "#include <immintrin.h>\n", ("#if defined(__AVX512F__) && defined(__AVX512BW__) && "
                                                 "defined(__AVX512VL__) && defined(__AVX512DQ__)")
    assert src.count(include) == 1 and src.count(cond) == 1, "the source's include / #if changed: update this test"
    shim = pathlib.Path(__file__).with_name("simde_avx512_shim.h")
    src = src.replace(include, f'{include}#define SIMDE_ENABLE_NATIVE_ALIASES\n#include <simde/x86/avx512.h>\n'
                               f'#include "{shim}"\n').replace(cond, "#if 1")
    d = tmp_path_factory.mktemp("simde")
    (d / "k.cpp").write_text(src)
    cmd = ["g++", "-O1", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-march=native", "-Wno-psabi",
           "-shared", "-fPIC", str(d / "k.cpp"), "-o", str(d / "k.so")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lib = K.bind_library(str(d / "k.so"))
    assert K.isa_paths(lib) == ["avx512", "avx2", "generic"]
    return lib


@pytest.mark.parametrize("ref", ["avx2", "generic"])
def test_avx512_path_under_simde_emulation(simde_kernel, ref):
    for n, steps, seed in RUNS:
        why = K.isa_bit_check(simde_kernel, "avx512", ref, n=n, seed=seed, steps=steps)
        assert why is None, f"emulated avx512 vs {ref}, {n} elements, {steps} step(s): {why}"


def test_a_path_whose_bits_failed_the_load_check_is_refused(monkeypatch):
    """Where the load-time bit check against AVX2 failed (`_configure_isa` records why), forcing that path raises
    instead of running it."""
    lib = requires_cpu_kernel()
    monkeypatch.setattr(lib, "_lt_refused", {"generic": "state1 differs"}, raising=False)
    with pytest.raises(RuntimeError, match="bits differ from AVX2's on this CPU"):
        K.resolve_isa(lib, "generic")
    monkeypatch.setenv(K.ISA_ENV, "generic")  # the optimizer refuses it when built, not at its first update
    with pytest.raises(ValueError, match="LAZYTRAIN_CPU_ISA=generic but that path's bits differ"):
        Hybrid8bitOptimizer([torch.nn.Parameter(torch.zeros(4))])
    monkeypatch.setenv(F.CPU_KERNEL_ENV, "torch")  # the pure-torch update never runs the C++ kernel's paths
    Hybrid8bitOptimizer([torch.nn.Parameter(torch.zeros(4))])
