"""Blockwise dynamic 8-bit quantization of optimizer states (bitsandbytes-compatible layout), in pure torch.

A tensor of N elements is cut into ``ceil(N / block_size)`` blocks of ``block_size`` consecutive elements (the
last block may be partial). Each block keeps one fp32 ``absmax`` (max |x| over the block) and one uint8 code per
element; the code indexes a 256-entry *dynamic map* (``qmap``) of values in [-1, 1] and decodes as
``qmap[code] * absmax``. Rounding is to the nearest code (ties go to the lower code, as ``torch.bucketize`` with
``right=False`` on the 255 midpoints between codes).

The maps follow bitsandbytes' ``create_dynamic_map`` (Dettmers, "8-Bit Approximations for Parallelism in Deep
Learning", arXiv 1511.04561): a dynamic exponent (decades 1e-6 .. 1) with a linear fraction whose resolution
grows with the magnitude.

- Unsigned map (second moment ``v >= 0``): exactly bitsandbytes' ``create_dynamic_map(signed=False)``:
  ``qmap[0] = 0``, ``qmap[255] = 1``, smallest non-zero code 3.25e-7.
- Signed map (first moment): bitsandbytes' ``create_dynamic_map(signed=True)`` with its lowest code
  (-0.99297) replaced by -1.0, so that both +1 and -1 are codes and the element that sets a block's absmax is
  stored exactly whatever its sign. bitsandbytes' CUDA kernels already assume ``qmap[0] == -1`` for signed maps
  (``quantize_2D<1>`` starts its search from ``lower = -1``). ``qmap[127] = 0``.

Note [v floor]: with exact nearest rounding, a small positive second moment in a block whose absmax is large
(heavy-tailed gradients: v spans 12+ decades inside one block) rounds to the zero code. If the gradient of that
element is then 0 (an embedding row whose token is absent), ``m / (sqrt(v) + eps)`` becomes ``m / eps``: updates
orders of magnitude too large. ``quantize_blockwise(..., nonzero_floor=True)`` never stores a non-zero element
as the zero code: it takes the smallest code of the element's sign instead (``qmap2[1] * absmax`` for v), which
bounds ``m / sqrt(v)``. The optimizer uses it for v; the tests in ``tests/optim/test_quant.py`` and
``tests/optim/test_hybrid8.py::test_v_floor_bounds_update_under_heavy_tails`` cite this note.

The CPU kernel finds codes with one read of a lookup table keyed on the float's exponent and top mantissa bits
(`code_lookup_table`), which gives exactly the same codes as ``torch.bucketize`` on the midpoints; the table is
verified when it is built.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = [
    "QMAP_SIZE",
    "LUT_EXP_RANGE",
    "LUT_MANT_BITS",
    "dynamic_map",
    "code_midpoints",
    "code_lookup_table",
    "zero_code",
    "num_blocks",
    "quantize_blockwise",
    "dequantize_blockwise",
    "max_code_gap",
]

QMAP_SIZE = 256
# Lookup table geometry (see `code_lookup_table`): magnitudes below 2**-LUT_EXP_RANGE share one bucket (they all
# round to the zero code: the smallest non-zero midpoint of either map is about 1.6e-7 > 2**-24 = 6e-8); above,
# one row of 2**LUT_MANT_BITS buckets per binary exponent up to 2**0.
LUT_EXP_RANGE = 24
LUT_MANT_BITS = 8


def _dynamic_map_values(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> list[float]:
    """The value list of bitsandbytes' ``create_dynamic_map`` (same arithmetic, fp32 linspace), unsorted."""
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                             else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:  # not reached for 8 bits / 7 exponent bits; kept for parity with bitsandbytes
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
    data.append(0.0)
    data.append(1.0)
    return data


@functools.cache
def _dynamic_map_cpu(signed: bool) -> Tensor:
    data = sorted(_dynamic_map_values(signed))
    if len(data) != QMAP_SIZE:
        raise AssertionError(f"dynamic map must have {QMAP_SIZE} codes, but got {len(data)}")
    if signed:
        data[0] = -1.0  # replaces bitsandbytes' -0.99297: both +1 and -1 exact (see module docstring)
    qmap = torch.tensor(data, dtype=torch.float32)
    if not bool((qmap[1:] > qmap[:-1]).all()):
        raise AssertionError("dynamic map codes must be strictly increasing")
    return qmap


def dynamic_map(signed: bool, device: torch.device | str | None = None) -> Tensor:
    """The 256-code dynamic quantization map.

    Args:
        signed: True for the first moment (codes in [-1, 1], 0 at index 127), False for the second moment
            (codes in [0, 1], 0 at index 0).
        device: where the returned tensor lives (default CPU).

    Returns:
        fp32 tensor [256], strictly increasing, containing 0 and 1 (and -1 when signed). A fresh copy: callers may
        keep it in optimizer state.
    """
    qmap = _dynamic_map_cpu(bool(signed))
    return qmap.to(device=device, copy=True) if device is not None else qmap.clone()


def zero_code(qmap: Tensor) -> int:
    """Index of the code 0.0 in ``qmap`` (127 for the signed map, 0 for the unsigned one).

    Raises:
        ValueError: the map holds no exact zero.
    """
    hits = (qmap == 0).nonzero()
    if hits.numel() != 1:
        raise ValueError(f"qmap must contain 0.0 exactly once, but found it {hits.numel()} times")
    return int(hits[0, 0])


def code_midpoints(qmap: Tensor) -> Tensor:
    """Midpoints between consecutive codes: fp32 [255], ``(qmap[:-1] + qmap[1:]) / 2`` on ``qmap``'s device.

    ``torch.bucketize(x, code_midpoints(qmap))`` (``right=False``) is the index of the nearest code, ties going
    to the lower code.
    """
    _check_qmap(qmap)
    return (qmap[:-1] + qmap[1:]) * 0.5


def code_lookup_table(qmap: Tensor) -> Tensor:
    """Lookup table from a float's bits to its nearest code, for the CPU kernel (one table read per element).

    For x (normalized by the block's absmax) with sign bit s, biased exponent e and mantissa bits:
    ``rel = min(e - (127 - LUT_EXP_RANGE), LUT_EXP_RANGE)``; ``key = 0`` if ``rel < 0`` (|x| < 2**-24) else
    ``1 + (rel << LUT_MANT_BITS | top LUT_MANT_BITS mantissa bits)``. A bucket (one key and sign) holds at most
    one code midpoint (verified here). Its entry ``lut[s * half + key]`` packs ``base`` (bits 0-7: the code of
    the bucket's lowest x) and ``t`` (bits 16-30: the low ``23 - LUT_MANT_BITS`` mantissa bits of the midpoint,
    which shares every higher bit with x). With ``low`` = those bits of x, the nearest code is
    ``base + (low > t)`` for x >= 0 and ``base + (low < t)`` for x < 0; a bucket without a midpoint has
    ``t = 2**15 - 1`` (x >= 0) or ``t = 0`` (x < 0), so the comparison never fires. This equals
    ``torch.bucketize(x, code_midpoints(qmap))`` (ties to the lower code) for every float32 x.

    Args:
        qmap: fp32 [256] strictly increasing map (any device; the table is built on CPU).

    Returns:
        int32 tensor [2 * half] on CPU, ``half = 1 + (LUT_EXP_RANGE + 1) * 2**LUT_MANT_BITS`` (6,401 entries):
        first the buckets of non-negative x, then those of negative x (51 KB).

    Raises:
        ValueError: a bucket holds two or more midpoints (the map is too fine for the table geometry).
    """
    mids = code_midpoints(qmap.detach().to("cpu", torch.float32))
    k, mb = LUT_EXP_RANGE, LUT_MANT_BITS
    low_mask = (1 << (23 - mb)) - 1
    rows = torch.arange(k + 1, dtype=torch.float64).repeat_interleave(1 << mb)
    mant = torch.arange(1 << mb, dtype=torch.float64).repeat(k + 1)
    lo = torch.cat([torch.zeros(1, dtype=torch.float64), torch.exp2(rows - k) * (1 + mant / (1 << mb))])
    hi = torch.cat([torch.tensor([2.0**-k], dtype=torch.float64), torch.exp2(rows - k) * (1 + (mant + 1) / (1 << mb))])
    lo32, hi32 = lo.float(), hi.float()  # exactly representable (powers of two times short fractions)
    below_hi = torch.nextafter(hi32, torch.zeros_like(hi32))  # largest float32 inside the bucket
    # non-negative x in [lo, hi); negative x in (-hi, -lo]; counts of midpoints below each end
    pos_lo, pos_hi = torch.bucketize(lo32, mids), torch.bucketize(below_hi, mids)
    neg_lo, neg_hi = torch.bucketize(-below_hi, mids), torch.bucketize(-lo32, mids)
    spread = torch.maximum(pos_hi - pos_lo, neg_hi - neg_lo)
    if int(spread.max()) > 1:
        bad = int(spread.argmax())
        raise ValueError(f"code_lookup_table: bucket {bad} [{lo[bad].item():.3g}, {hi[bad].item():.3g}) holds "
                         f"{int(spread[bad])} code midpoints; raise LUT_MANT_BITS (now {mb})")
    last_row = slice(1 + k * (1 << mb), None)   # also holds |x| >= 2 (exponent clamped): must hold no midpoint
    if int(spread[0]) or int(spread[last_row].max()):
        raise ValueError("code_lookup_table: a midpoint lies below 2**-LUT_EXP_RANGE or at or above 1")
    padded = torch.cat([mids, torch.tensor([float("inf")])])

    def entries(base: Tensor, has_mid: Tensor, never: int) -> Tensor:
        mid_bits = padded[base].abs().view(torch.int32) & low_mask
        t = torch.where(has_mid, mid_bits, torch.full_like(mid_bits, never))
        return base.to(torch.int32) | (t << 16)

    return torch.cat([entries(pos_lo, pos_hi > pos_lo, low_mask), entries(neg_lo, neg_hi > neg_lo, 0)])


def num_blocks(numel: int, block_size: int) -> int:
    """Number of quantization blocks for ``numel`` elements: ``ceil(numel / block_size)``."""
    return -(-int(numel) // int(block_size))


def _check_qmap(qmap: Tensor) -> None:
    if qmap.dtype != torch.float32 or qmap.shape != (QMAP_SIZE,):
        raise ValueError(f"qmap must be a float32 tensor of shape [{QMAP_SIZE}], but got "
                         f"{qmap.dtype} {tuple(qmap.shape)}")


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, but got {block_size!r}")


def _blocks_view(x: Tensor, block_size: int) -> Tensor:
    """x (any shape, N elements) -> fp32 [nblocks, block_size], zero-padded at the end (a copy when padded)."""
    flat = x.reshape(-1).float()
    pad = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(-1, block_size)


def quantize_blockwise(
    x: Tensor,
    qmap: Tensor,
    block_size: int = 256,
    *,
    nonzero_floor: bool = False,
    mids: Tensor | None = None,
    out: Tensor | None = None,
    absmax_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` blockwise to nearest codes of ``qmap``.

    Args:
        x: float tensor of any shape and floating dtype, N elements (N may be 0 or not a multiple of
            ``block_size``).
        qmap: fp32 [256] strictly increasing map on ``x``'s device (`dynamic_map`).
        block_size: elements per block (any positive integer; the last block may be partial).
        nonzero_floor: store a non-zero element never as the zero code, but as the smallest code of its sign
            (Note [v floor] in this module's docstring). Off: exact nearest rounding.
        mids: precomputed ``code_midpoints(qmap)`` (saves a small allocation per call).
        out: optional uint8 tensor with N elements to write the codes into (any shape).
        absmax_out: optional fp32 tensor [ceil(N / block_size)] to write the scales into.

    Returns:
        ``(codes, absmax)``: codes uint8 with ``x``'s shape (or ``out``), absmax fp32 [ceil(N / block_size)]
        = max |x| over each block. An all-zero block has absmax 0 and zero codes.

    Raises:
        ValueError: bad ``qmap``, ``block_size`` or output shapes.
    """
    _check_qmap(qmap)
    _check_block_size(block_size)
    n = x.numel()
    nb = num_blocks(n, block_size)
    if out is not None and (out.dtype != torch.uint8 or out.numel() != n):
        raise ValueError(f"out must be uint8 with {n} elements, but got {out.dtype} with {out.numel()}")
    if absmax_out is not None and (absmax_out.dtype != torch.float32 or absmax_out.numel() != nb):
        raise ValueError(f"absmax_out must be float32 with {nb} elements, but got {absmax_out.dtype} with "
                         f"{absmax_out.numel()}")
    if mids is None:
        mids = code_midpoints(qmap)
    blocks = _blocks_view(x, block_size)                      # [nb, B] fp32
    absmax = blocks.abs().amax(dim=1)                         # [nb]
    inv = torch.where(absmax > 0, absmax.reciprocal(), torch.zeros_like(absmax))
    normed = blocks * inv[:, None]                            # [nb, B] in [-1, 1]
    codes = torch.bucketize(normed, mids)                     # [nb, B] int64, nearest code (ties -> lower)
    if nonzero_floor:
        z = zero_code(qmap)
        codes = torch.where((codes == z) & (blocks > 0), torch.full_like(codes, z + 1), codes)
        if z > 0:
            codes = torch.where((codes == z) & (blocks < 0), torch.full_like(codes, z - 1), codes)
    codes = codes.reshape(-1)[:n].to(torch.uint8)
    if out is None:
        out = codes.view(x.shape)
    else:
        out.view(-1).copy_(codes)
    if absmax_out is None:
        absmax_out = absmax
    else:
        absmax_out.copy_(absmax)
    return out, absmax_out


def dequantize_blockwise(codes: Tensor, absmax: Tensor, qmap: Tensor, block_size: int = 256,
                         *, out: Tensor | None = None) -> Tensor:
    """Decode ``qmap[codes] * absmax[block]``.

    Args:
        codes: uint8 tensor of any shape, N elements.
        absmax: fp32 [ceil(N / block_size)] per-block scales.
        qmap: fp32 [256] map on ``codes``' device.
        block_size: elements per block, as used to quantize.
        out: optional fp32 tensor with N elements to write into.

    Returns:
        fp32 tensor with ``codes``' shape (or ``out``).

    Raises:
        ValueError: dtype or size mismatch.
    """
    _check_qmap(qmap)
    _check_block_size(block_size)
    n = codes.numel()
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be uint8, but got {codes.dtype}")
    if absmax.numel() != num_blocks(n, block_size):
        raise ValueError(f"absmax must have ceil({n} / {block_size}) = {num_blocks(n, block_size)} elements, "
                         f"but got {absmax.numel()}")
    values = qmap[codes.reshape(-1).long()]                   # [N] fp32
    scale = absmax.float().repeat_interleave(block_size)[:n]  # [N] fp32
    values.mul_(scale)
    if out is None:
        return values.view(codes.shape)
    if out.numel() != n or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 with {n} elements, but got {out.dtype} with {out.numel()}")
    out.view(-1).copy_(values)
    return out


def max_code_gap(qmap: Tensor) -> float:
    """Largest distance between consecutive codes (the worst-case rounding error is half of it times absmax)."""
    _check_qmap(qmap)
    return float((qmap[1:] - qmap[:-1]).max())

