"""Hand-checkable cost models shared by the planning tests.

`small_cm` is four identical layers with round numbers (GiB-sized activations, 100 MB of weights, fast PCIe and an
almost free CPU optimizer) so that the memory of each candidate plan can be worked out on paper:

    base = resident 1 GiB + 2 weight slots (depth 1) x 1e8 B
    backward peak of layer j = base + Q_j (stored) + m_j (segment working set)
                               + S (forward with grad) + bwd_work + 2 G (grad buffers) + A (prefetched boundary)
    head peak = base + Q_3 + A (final hidden) + head_work
"""

from __future__ import annotations

from typing import Any

import pytest

from lazytrain_hf.planning import CostModel

GIB = 1024**3
A = GIB // 4  # boundary bytes
S = 4 * GIB  # saved activations of one layer
P = 100_000_000  # weight (and gradient) bytes
BWD_WORK = GIB // 2
HOST_FIXED = 10 * GIB


def small_cm(num_layers: int = 4, **overrides: Any) -> CostModel:
    kw: dict[str, Any] = dict(fwd_ms=10.0, bwd_ms=20.0, param_bytes=P, act_bytes=A, saved_bytes=S,
                              fwd_work_bytes=GIB // 4, bwd_work_bytes=BWD_WORK, resident_bytes=GIB, head_ms=5.0,
                              head_work_bytes=GIB // 2, host_fixed_bytes=HOST_FIXED, gpu_bytes=12 * GIB,
                              pinned_host_bytes=100 * GIB, h2d_gbps=50.0, d2h_gbps=50.0, bidir_gbps=33.0,
                              cpu_optim_params_per_s=1e12, tokens_per_step=4096)
    kw.update(overrides)
    return CostModel.uniform(num_layers, **kw)


def backward_peak_all_cpu_tier() -> int:
    """Smallest peak of `small_cm` (depth 1): boundary 0 on the GPU, 1..3 in CPU memory, nothing retained."""
    base = GIB + 2 * P
    return base + A + A + S + BWD_WORK + 2 * P + A  # Q_j = A, m_j = fetched A, + prefetched A


@pytest.fixture
def cm4() -> CostModel:
    return small_cm()
