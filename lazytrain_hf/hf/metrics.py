"""Throughput and memory metrics added to the Trainer's logs.

`tflops` is the convention of MegaTrain and LazyTrain (and PaLM, Chowdhery et al. 2022, appendix B, without the
attention term): 6 x N x tokens / step time, N = trainable parameters, tokens = input_ids.numel() of every
micro-batch of the optimizer step. Padding tokens count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..config import GIB

__all__ = ["StepMeter", "tflops_6nd"]


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def tflops_6nd(num_params: int, tokens: int, seconds: float) -> float:
    """6·N·tokens / seconds in TFLOP/s (0.0 when seconds <= 0)."""
    return 6.0 * num_params * tokens / seconds / 1e12 if seconds > 0 else 0.0


@dataclass
class StepMeter:
    """Times optimizer steps and counts their tokens; `metrics()` gives the latest values for `Trainer.log`."""

    num_params: int  # trainable: 6 FLOPs per parameter per token (forward, input and weight gradients)
    device: torch.device
    frozen_params: int = 0  # 4 FLOPs per parameter per token: forward and input gradient, no weight gradient
    peak_tflops: float | None = None  # device bf16 peak for MFU, TFLOP/s
    tokens: int = 0
    _t0: float | None = None
    _retries0: int = 0
    last: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self._sync()
        self._retries0 = self._alloc_retries()
        self._t0 = time.perf_counter()
        self.tokens = 0

    def add_tokens(self, n: int) -> None:
        self.tokens += int(n)

    def stop(self, extra: dict[str, float] | None = None) -> None:
        if self._t0 is None:
            return
        self._sync()
        dt = time.perf_counter() - self._t0
        self._t0 = None
        m = {"step_time_s": _sig(dt),
             "tokens_per_second": _sig(self.tokens / dt) if dt > 0 else 0.0,
             "tflops": _sig(tflops_6nd(self.num_params, self.tokens, dt)
                            + tflops_6nd(self.frozen_params, self.tokens, dt) * 4 / 6)}
        if self.peak_tflops:
            m["mfu"] = _sig(m["tflops"] / self.peak_tflops)
        if self.device.type == "cuda":
            m["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(self.device) / GIB, 3)
            m["cuda_alloc_retries"] = self._alloc_retries() - self._retries0
        m.update(extra or {})
        self.last = m

    def _alloc_retries(self) -> int:
        """The CUDA caching allocator's `num_alloc_retries` (torch.cuda.memory_stats): allocations that failed at
        the memory cap and succeeded after the cache was freed, each one a device synchronization. 0 off CUDA."""
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
