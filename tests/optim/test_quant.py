"""Quantization maps and blockwise (de)quantization (lazytrain_hf/optim/quant.py), and the C++ quantizer."""

from __future__ import annotations

import contextlib

import pytest
import torch

from lazytrain_hf.optim import _cpu_kernel
from lazytrain_hf.optim.quant import (
    LUT_EXP_RANGE,
    LUT_MANT_BITS,
    code_lookup_table,
    code_midpoints,
    dequantize_blockwise,
    dynamic_map,
    max_code_gap,
    num_blocks,
    quantize_blockwise,
    zero_code,
)

SIZES = [1, 255, 256, 4097, 10_000]
BLOCKS = [64, 100, 256]   # 100: blocks that do not divide any of the sizes


def requires_cpu_kernel():
    ok, reason = _cpu_kernel.cpu_kernel_status()
    if not ok:
        pytest.skip(f"fused CPU kernel not built (needs a C++ compiler with OpenMP): {reason[:300]}")
    return _cpu_kernel.load_cpu_kernel()


@contextlib.contextmanager
def lookup_mode(lib, mode: str):
    """Run the kernel's AVX2 path with ``mode`` table reads (`_cpu_kernel.LOOKUP_MODES`), restored afterwards;
    skips when the library has no AVX2 path (a portable build)."""
    before = lib.lt_get_lookup()
    if before < 0:
        pytest.skip("the kernel library has no AVX2 path (one table-read mode only)")
    lib.lt_set_lookup(_cpu_kernel.LOOKUP_MODES[mode])
    try:
        yield
    finally:
        lib.lt_set_lookup(before)


def heavy_tailed(n: int, seed: int = 0) -> torch.Tensor:
    """[n] fp32 values spanning ~10 decades, both signs, plus exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 4)
    x[::17] = 0.0
    return x


@pytest.mark.parametrize("signed", [True, False])
def test_map_properties(signed):
    q = dynamic_map(signed)
    assert q.shape == (256,) and q.dtype == torch.float32
    assert bool((q[1:] > q[:-1]).all()), "codes must be strictly increasing"
    assert q[-1].item() == 1.0
    assert (q == 0).sum().item() == 1
    if signed:
        assert q[0].item() == -1.0 and zero_code(q) == 127
    else:
        assert q[0].item() == 0.0 and zero_code(q) == 0 and bool((q >= 0).all())


def test_maps_follow_bitsandbytes():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    assert torch.equal(dynamic_map(False), bnbf.create_dynamic_map(signed=False))
    ours, theirs = dynamic_map(True), bnbf.create_dynamic_map(signed=True)
    assert torch.equal(ours[1:], theirs[1:])          # only the lowest code differs: -1.0 instead of -0.99297
    assert theirs[0].item() > -1.0


def _lut_codes(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """torch emulation of the C++ lookup (quant.code_lookup_table's contract) for fp32 x."""
    u = x.view(torch.int32).long() & 0xFFFFFFFF
    sign, e = u >> 31, (u >> 23) & 0xFF
    rel = (e - (127 - LUT_EXP_RANGE)).clamp(max=LUT_EXP_RANGE)
    mant = (u >> (23 - LUT_MANT_BITS)) & ((1 << LUT_MANT_BITS) - 1)
    key = torch.where(rel < 0, torch.zeros_like(rel), 1 + ((rel.clamp(min=0) << LUT_MANT_BITS) | mant))
    entry = lut.long()[sign * (lut.numel() // 2) + key]
    base, t, low = entry & 0xFF, entry >> 16, u & ((1 << (23 - LUT_MANT_BITS)) - 1)
    return base + torch.where(sign == 1, low < t, low > t).long()


@pytest.mark.parametrize("signed", [True, False])
def test_lookup_table_equals_bucketize(signed):
    q = dynamic_map(signed)
    mids = code_midpoints(q)
    lut = code_lookup_table(q)
    assert lut.dtype == torch.int32
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0)), q])
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 3.0, -3.0, 2.0**-24, -(2.0**-24), 1e-30])
    x = torch.cat([near, special, heavy_tailed(50_000).clamp(-1.5, 1.5), torch.rand(50_000) * 2 - 1])
    assert torch.equal(_lut_codes(x, lut), torch.bucketize(x, mids))


def _kernel_lut_codes(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """torch emulation of the kernel's lookup (``nearest_code`` in _cpu_kernel's source) for fp32 x."""
    u = x.view(torch.int32).long() & 0xFFFFFFFF
    sign = u >> 31
    half = lut.numel() // 2
    key = (((u >> (23 - LUT_MANT_BITS)) & ((1 << (8 + LUT_MANT_BITS)) - 1))
           - (((127 - LUT_EXP_RANGE) << LUT_MANT_BITS) - 1)).clamp(0, half - 1)
    entry = lut.long()[sign * half + key]
    low_mask = (1 << (23 - LUT_MANT_BITS)) - 1
    low = (u ^ (sign * low_mask)) & low_mask    # mirrored for x < 0
    return (entry & 0xFF) + (low > (entry >> 16)).long()


@pytest.mark.parametrize("signed", [True, False])
def test_kernel_lookup_table_equals_bucketize(signed):
    """The kernel's table (mirrored thresholds for x < 0, one clamped bucket for |x| >= 2) gives the nearest code,
    ties to the lower one, for every kind of fp32 input (NaN excluded: it has no nearest code)."""
    q = dynamic_map(signed)
    mids = code_midpoints(q)
    lut = _cpu_kernel.kernel_lookup_table(q)
    assert lut.dtype == torch.int32 and torch.equal(lut[:lut.numel() // 2], code_lookup_table(q)[:lut.numel() // 2])
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0)), q])
    near = torch.cat([near, -near])
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0000001, -1.0000001, 2.0, -2.0, 3.0, -3.0, 1e30, -1e30,
                            float("inf"), -float("inf"), 2.0**-24, -(2.0**-24), 1e-30, -1e-30, 1e-45, -1e-45])
    x = torch.cat([near, special, heavy_tailed(50_000).clamp(-1.5, 1.5), torch.rand(50_000) * 2 - 1])
    assert torch.equal(_kernel_lut_codes(x, lut), torch.bucketize(x, mids))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block_size", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_round_trip_error_bound(n, block_size, signed):
    q = dynamic_map(signed)
    x = heavy_tailed(n, seed=n)
    x = x if signed else x.abs()
    codes, absmax = quantize_blockwise(x, q, block_size)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert absmax.shape == (num_blocks(n, block_size),) and absmax.dtype == torch.float32
    y = dequantize_blockwise(codes, absmax, q, block_size)
    pad = num_blocks(n, block_size) * block_size - n
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, block_size)
    assert torch.equal(absmax, blocks.abs().amax(1))
    scale = absmax.repeat_interleave(block_size)[:n]
    # nearest rounding: at most half the largest gap between codes, relative to the block's absmax
    assert bool(((y - x).abs() <= scale * max_code_gap(q) / 2 * (1 + 1e-6)).all())
    # the element that sets each block's absmax is stored exactly (+1 and -1 are codes)
    idx = blocks.abs().argmax(1)
    ybl = torch.nn.functional.pad(y, (0, pad)).view(-1, block_size)
    assert torch.equal(ybl.gather(1, idx[:, None]), blocks.gather(1, idx[:, None]))


def test_zero_block_and_empty():
    q = dynamic_map(True)
    codes, absmax = quantize_blockwise(torch.zeros(300), q, 256)
    assert torch.equal(absmax, torch.zeros(2)) and bool((codes == 127).all())
    assert torch.equal(dequantize_blockwise(codes, absmax, q, 256), torch.zeros(300))
    codes, absmax = quantize_blockwise(torch.zeros(0), q, 256)
    assert codes.numel() == 0 and absmax.numel() == 0


def test_out_arguments_and_errors():
    q = dynamic_map(False)
    x = torch.rand(3, 100)
    out, am = torch.empty(300, dtype=torch.uint8), torch.empty(2)
    codes, absmax = quantize_blockwise(x, q, 256, out=out, absmax_out=am)
    assert codes is out and absmax is am
    ref_codes, ref_absmax = quantize_blockwise(x, q, 256)
    assert torch.equal(out, ref_codes.view(-1)) and torch.equal(am, ref_absmax)
    with pytest.raises(ValueError, match="out must be uint8"):
        quantize_blockwise(x, q, 256, out=torch.empty(299, dtype=torch.uint8))
    with pytest.raises(ValueError, match="absmax_out"):
        quantize_blockwise(x, q, 256, absmax_out=torch.empty(3))
    with pytest.raises(ValueError, match="block_size"):
        quantize_blockwise(x, q, 0)
    with pytest.raises(ValueError, match="qmap"):
        quantize_blockwise(x, q[:10], 256)
    with pytest.raises(ValueError, match="absmax must have"):
        dequantize_blockwise(out, torch.zeros(1), q, 256)


def test_v_floor_keeps_positive_values_off_the_zero_code():
    """Note [v floor] (quant.py): heavy-tailed v has elements 12 decades below its block's absmax."""
    q = dynamic_map(False)
    v = heavy_tailed(4096, seed=3).pow(2)
    v[::256] = 1e6  # one huge second moment per block
    exact, absmax = quantize_blockwise(v, q, 256)
    floored, absmax_f = quantize_blockwise(v, q, 256, nonzero_floor=True)
    assert torch.equal(absmax, absmax_f)
    collapsed = (v > 0) & (exact == 0)
    assert collapsed.sum() > 100, "the test data must exercise the collapse"
    assert bool((floored[v > 0] > 0).all()) and bool((floored[v == 0] == 0).all())
    assert bool((floored[collapsed] == 1).all())
    assert torch.equal(floored[~collapsed], exact[~collapsed])   # nothing else changes
    deq = dequantize_blockwise(floored, absmax, q, 256)
    assert bool((deq[v > 0] > 0).all())


def test_signed_floor_keeps_the_sign():
    q = dynamic_map(True)
    x = torch.tensor([1.0, 1e-9, -1e-9, 0.0] + [0.5] * 252)
    codes, _ = quantize_blockwise(x, q, 256, nonzero_floor=True)
    assert codes[:4].tolist() == [255, 128, 126, 127]


@pytest.mark.parametrize("lookup", sorted(_cpu_kernel.LOOKUP_MODES))
@pytest.mark.parametrize("nonzero_floor", [False, True])
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block_size", [64, 100, 256])
def test_cpp_quantizer_equals_torch(signed, block_size, nonzero_floor, lookup):
    lib = requires_cpu_kernel()
    with lookup_mode(lib, lookup):
        _check_cpp_quantizer(lib, signed, block_size, nonzero_floor)


def _check_cpp_quantizer(lib, signed, block_size, nonzero_floor):
    tables = _cpu_kernel.CpuTables.build(dynamic_map(True), dynamic_map(False))
    q = dynamic_map(signed)
    x = heavy_tailed(70_001, seed=block_size)
    x = x if signed else x.abs()
    ties = code_midpoints(q)[1:block_size]       # absmax 1 in block 0: exact ties, which both resolve
    x[0], x[1:1 + ties.numel()] = 1.0, ties        # towards the lower code
    for threads in (1, 2):
        codes, absmax = _cpu_kernel.cpu_quantize_blockwise(lib, tables, x, signed=signed, block_size=block_size,
                                                           nonzero_floor=nonzero_floor, threads=threads)
        ref_codes, ref_absmax = quantize_blockwise(x, q, block_size, nonzero_floor=nonzero_floor)
        assert torch.equal(absmax, ref_absmax)
        assert torch.equal(codes, ref_codes)
