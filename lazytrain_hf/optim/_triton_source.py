"""The Triton source of `_triton_kernel` (imported only where ``triton`` is: Triton resolves a kernel's helper
functions through the module's globals)."""

import triton
import triton.language as tl


@triton.jit
def _bf16_bits(x):
    # f32_to_bf16 of the C++ source: round to nearest even, NaN -> 0x7FC0 (as uint32 in [0, 0xFFFF])
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, r)


@triton.jit
def _bf16_load(ptr, offs, mask):
    h = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (h << 16).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_store(ptr, offs, bits, mask):
    tl.store(ptr + offs, bits.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)


@triton.jit
def _umax(a, b):
    return tl.maximum(a, b)


@triton.jit
def _nearest_code(x, lut_ptr, half, shift, kmask, low_mask, key_off, key_max):
    # nearest_code of the C++ source: one lookup-table read and one comparison
    u = x.to(tl.uint32, bitcast=True)
    sign = u >> 31
    key = ((u >> shift) & kmask).to(tl.int32) - key_off
    key = tl.minimum(tl.maximum(key, 0), key_max)
    entry = tl.load(lut_ptr + sign.to(tl.int32) * half + key).to(tl.uint32, bitcast=True)
    low = tl.where(sign != 0, u ^ 0xFFFFFFFF, u) & low_mask
    return (entry & 0xFF) + (low > (entry >> 16)).to(tl.uint32)


@triton.jit
def hybrid8_adamw(p_ptr, g_ptr, c1_ptr, c2_ptr, a1_ptr, a2_ptr, master_ptr, kahan_ptr, q1_ptr, q2_ptr,
                  lut1_ptr, lut2_ptr, n, nblocks, clip, beta2, w1c, w2, eps, decay, nss, bc2,
                  half, shift, kmask, low_mask, key_off, key_max,
                  BLOCK: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr, P_BF16: tl.constexpr,
                  G_BF16: tl.constexpr, LERP_LOW: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = rows < nblocks
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = offs < n
    c1 = tl.load(c1_ptr + offs, mask=mask, other=0).to(tl.int32)
    c2 = tl.load(c2_ptr + offs, mask=mask, other=0).to(tl.int32)
    s1 = tl.load(a1_ptr + rows, mask=rmask, other=0.0)
    s2 = tl.load(a2_ptr + rows, mask=rmask, other=0.0)
    m = tl.load(q1_ptr + c1) * s1[:, None]
    v = tl.load(q2_ptr + c2) * s2[:, None]
    if G_BF16:
        g = _bf16_load(g_ptr, offs, mask)
    else:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    gv = g * clip
    if LERP_LOW:
        m = tl.fma(w1c, gv - m, m)
    else:
        m = tl.fma(w1c, gv - m, gv)
    v = v * beta2 + (w2 * gv) * gv
    if MODE == 1:  # fp32 master
        pf = tl.load(master_ptr + offs, mask=mask, other=0.0)
    elif MODE == 2:  # Kahan: bf16 parameter + bf16 compensation
        pf = _bf16_load(p_ptr, offs, mask) + _bf16_load(kahan_ptr, offs, mask)
    elif P_BF16:
        pf = _bf16_load(p_ptr, offs, mask)
    else:
        pf = tl.load(p_ptr + offs, mask=mask, other=0.0)
    pf = pf * decay
    denom = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
    pf = pf + tl.div_rn(nss * m, denom)
    if MODE == 1:
        tl.store(master_ptr + offs, pf, mask=mask)
    if MODE == 2:
        r = _bf16_bits(pf)
        _bf16_store(p_ptr, offs, r, mask)
        _bf16_store(kahan_ptr, offs, _bf16_bits(pf - (r << 16).to(tl.float32, bitcast=True)), mask)
    elif P_BF16:
        _bf16_store(p_ptr, offs, _bf16_bits(pf), mask)
    else:
        tl.store(p_ptr + offs, pf, mask=mask)
    # new per-block absmax through the float bits (tl.reduce, not tl.max: a helper of triton.language that the
    # interpreted copy could not call) (non-negative floats order as unsigned ints; NaN largest)
    b1 = tl.where(mask, m.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0)
    b2 = tl.where(mask, v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0)
    am1 = tl.reduce(b1, 1, _umax).to(tl.float32, bitcast=True)
    am2 = tl.reduce(b2, 1, _umax).to(tl.float32, bitcast=True)
    tl.store(a1_ptr + rows, am1, mask=rmask)
    tl.store(a2_ptr + rows, am2, mask=rmask)
    inv1 = tl.where(am1 > 0.0, tl.div_rn(tl.full(am1.shape, 1.0, tl.float32), am1), 0.0)
    inv2 = tl.where(am2 > 0.0, tl.div_rn(tl.full(am2.shape, 1.0, tl.float32), am2), 0.0)
    k1 = _nearest_code(m * inv1[:, None], lut1_ptr, half, shift, kmask, low_mask, key_off, key_max)
    k2 = _nearest_code(v * inv2[:, None], lut2_ptr, half, shift, kmask, low_mask, key_off, key_max)
    k2 = tl.where((k2 == 0) & (v > 0.0), 1, k2)  # Note [v floor]: a positive v never takes the zero code
    tl.store(c1_ptr + offs, k1.to(tl.uint8), mask=mask)
    tl.store(c2_ptr + offs, k2.to(tl.uint8), mask=mask)
