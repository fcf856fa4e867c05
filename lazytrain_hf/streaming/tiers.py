"""Activation tiers for materialized layer boundaries: keep on the device, offload to pinned CPU, or to NVMe files.

A boundary is a [B, T, H] hidden-state tensor. `ActivationStash.put(i, h, tier)` in forward, `get(i)` in
backward returns it on the compute device, bit-exact. CPU tier: async D2H on the D2H stream into pinned memory;
the event recorded after the copy guards the source tensor, which the stash keeps alive until the copy is done
(Note [stash keep-alive]). NVMe tier: the pinned copy is written to a file in `nvme_dir` (raw bytes, any dtype);
short writes or reads raise.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

__all__ = ["ActivationStash"]


@dataclass
class _Entry:
    tier: str
    tensor: torch.Tensor | None  # gpu: the tensor; cpu: pinned host copy; nvme: None once written
    src: torch.Tensor | None = None  # Note [stash keep-alive]: device source kept until its D2H copy is done
    event: torch.cuda.Event | None = None
    path: str | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None


class ActivationStash:
    """Holds materialized boundaries for one step.

    Args:
        device: compute device.
        nvme_dir: directory for "nvme" tier files (created if missing).
        pin: use pinned host buffers for the CPU tier (CUDA only).
    """

    def __init__(self, device: torch.device, nvme_dir: str | None = None, pin: bool = True) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin and self.cuda
        self.nvme_dir = nvme_dir
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.entries: dict[int, _Entry] = {}
        self.bytes_by_tier = {"gpu": 0, "cpu": 0, "nvme": 0}
        self.d2h_bytes = 0
        self.h2d_bytes = 0

    def put(self, i: int, h: torch.Tensor, tier: str) -> None:
        nbytes = h.numel() * h.element_size()
        self.bytes_by_tier[tier] += nbytes
        if tier == "gpu":
            self.entries[i] = _Entry("gpu", h)
            return
        host = torch.empty(h.shape, dtype=h.dtype, pin_memory=self.pin)
        if self.cuda:
            ev = torch.cuda.Event()
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                host.copy_(h, non_blocking=True)
                ev.record(self.d2h_stream)
            h.record_stream(self.d2h_stream)
            entry = _Entry(tier, host, src=h, event=ev, shape=tuple(h.shape), dtype=h.dtype)
        else:
            host.copy_(h)
            entry = _Entry(tier, host, shape=tuple(h.shape), dtype=h.dtype)
        self.d2h_bytes += nbytes
        if tier == "nvme":
            self._write(i, entry)
        self.entries[i] = entry

    def _write(self, i: int, entry: _Entry) -> None:
        if not self.nvme_dir:
            raise ValueError("activation tier 'nvme' needs lazytrain_config.nvme_dir")
        os.makedirs(self.nvme_dir, exist_ok=True)
        if entry.event is not None:
            entry.event.synchronize()
        entry.src = None
        raw = entry.tensor.contiguous().view(-1).view(torch.uint8).numpy()
        fd, path = tempfile.mkstemp(prefix=f"boundary{i}-", suffix=".bin", dir=self.nvme_dir)
        try:
            written = os.write(fd, raw.tobytes()) if raw.nbytes else 0
            if written != raw.nbytes:
                raise OSError(f"short write to {path}: {written} of {raw.nbytes} bytes (disk full?)")
        finally:
            os.close(fd)
        entry.tensor, entry.path = None, path

    def get(self, i: int) -> torch.Tensor:
        """Boundary i on the compute device (removed from the stash)."""
        e = self.entries.pop(i)
        if e.tier == "gpu":
            return e.tensor
        if e.tier == "nvme":
            nbytes = int(torch.Size(e.shape).numel()) * torch.empty((), dtype=e.dtype).element_size()
            with open(e.path, "rb") as f:
                data = f.read()
            os.unlink(e.path)
            if len(data) != nbytes:
                raise OSError(f"short read from {e.path}: {len(data)} of {nbytes} bytes")
            host = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(e.dtype).view(e.shape) if nbytes else \
                torch.empty(e.shape, dtype=e.dtype)
            if self.pin:
                host = host.pin_memory()
        else:
            if e.event is not None:
                torch.cuda.current_stream(self.device).wait_event(e.event)
            host = e.tensor
        self.h2d_bytes += host.numel() * host.element_size()
        return host.to(self.device, non_blocking=self.cuda)

    def clear(self) -> None:
        for e in self.entries.values():
            if e.path and os.path.exists(e.path):
                os.unlink(e.path)
        self.entries.clear()
        self.bytes_by_tier = {"gpu": 0, "cpu": 0, "nvme": 0}
