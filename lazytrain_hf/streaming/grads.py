"""Gradient sink: moves each layer's parameter gradients from its device slot into the host store.

Streams and events (CUDA):
  d2h stream: waits on `done` (recorded on the compute stream after the layer's backward), copies the slot's
              flat grad buffers to host memory, records `slot.grads_free`; the compute stream waits on
              `grads_free` before the slot's grad buffers are zeroed for their next layer.
Two paths:
  direct:     the host buffer has the slot's dtype and holds nothing yet this accumulation window: one async copy
              straight into the pinned host buffer, no CPU work at all (the usual case without accumulation).
  accumulate: D2H into the slot's pinned staging buffer; the CPU adds (or, first micro-batch, converts) it into the
              fp32 host buffer one layer later, while the GPU computes the next layer, or at `flush()`.
The squared L2 norm of every gradient is accumulated on the device in fp32 as it passes (on the D2H stream, after
any all-reduce); it is the global norm's square only when the window holds one micro-batch (`norm_from_device`),
otherwise the host buffers are summed.
Data parallel (`dp`, streaming/comm.py): the slot's gradients are SUM-all-reduced over ranks before they leave the
device; under NCCL the reduction is enqueued after the layer's backward and only the D2H stream waits for it.
Sharded updates (`shard`, streaming/shard.py): the gradient is SUM-reduced to the layer's owner only; other ranks
skip its D2H copy, its norm and its host buffer (the layer reports no gradient there, `has_grad`), and only
record `grads_free` once the reduction has read the slot.

Kept gradients (`keep_layers`: the schedule's GPU-updated layers, `Schedule.keep_grads`): the layer's update runs
on the device at its next load, so its gradient need not cross PCIe twice (D2H here, H2D again for the update).
With one micro-batch in the window the slot's gradient is copied device to device into a kept buffer instead
(the norm as above); the host buffer is then stale until `materialize` copies the kept one out (anything that
reads host gradients calls it first: `grad_source`, a second micro-batch, `flush`-time readers). The update
consumes the kept buffer (`kept_view`) and `drop`s it.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch

from .comm import DataParallel
from .host_store import HostParamStore, Registrations, sq_norm
from .shard import ShardedUpdates
from .weights import Slot, wait_on

__all__ = ["GradSink"]


@dataclass
class _Pending:
    layer: int
    staging: dict[torch.dtype, torch.Tensor]
    event: torch.cuda.Event
    first: bool


class GradSink:
    """Args: store (host buffers), device (compute device), dp (gradient all-reduce over ranks, or None),
    pin (page-lock the staging buffers; CUDA only), shard (sharded updates: reduce each layer to its owner).

    Attributes:
        staging_bytes: bytes of the accumulate path's staging buffers (one set per slot, allocated at its first
            use, kept: exact sizes, page-locked in place with cudaHostRegister when `pin`).
        registered_bytes: the part of `staging_bytes` page-locked in place.
    """

    def __init__(self, store: HostParamStore, device: torch.device, dp: DataParallel | None = None,
                 pin: bool = True, shard: ShardedUpdates | None = None) -> None:
        self.store = store
        self.device = device
        self.dp = dp
        self.shard = shard
        self.cuda = device.type == "cuda"
        self.pin = pin and self.cuda
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        # id(slot) -> (weak reference to the slot, dtype -> staging buffer)
        self._staging: dict[int, tuple[weakref.ref, dict[torch.dtype, torch.Tensor]]] = {}
        self._registered = Registrations()  # staging buffers page-locked in place
        self._pending: deque[_Pending] = deque()  # staged copies whose CPU add is still to do, FIFO
        self.sq = torch.zeros((), dtype=torch.float64, device=device)  # sum of squares seen this window
        self.microbatches = 0  # micro-batches since the last zero_grad
        self._fresh: set[int] = set(range(len(store.buffers)))  # layers whose host grads hold nothing yet
        self.d2h_bytes = 0
        self.staging_bytes = 0
        self.instrument = False  # record compute-stream stalls on gradient copies (exposed D2H), as WeightStreamer
        self.stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.keep_layers: set[int] = set()  # layers whose gradients stay on the device (see the module docstring)
        # layer -> (dtype -> kept gradient, flat like the slot's; event after its copy, None on CPU)
        self._kept: dict[int, tuple[dict[torch.dtype, torch.Tensor], torch.cuda.Event | None]] = {}

    def has_grad(self, layer: int) -> bool:
        return layer not in self._fresh

    def begin_microbatch(self) -> None:
        self.microbatches += 1
        if self.microbatches == 2:  # accumulation: the host buffers sum from here on
            self.materialize_all()

    # ---- kept gradients -------------------------------------------------------------------------------------
    def is_kept(self, layer: int) -> bool:
        return layer in self._kept

    @property
    def kept_bytes(self) -> int:
        """Device bytes of the kept gradients now held."""
        return sum(t.numel() * t.element_size() for bufs, _ in self._kept.values() for t in bufs.values())

    def kept_view(self, layer: int, dtype: torch.dtype, offset: int, numel: int, shape: torch.Size) -> torch.Tensor:
        """One parameter's kept gradient (a view into the layer's kept buffer of `dtype`, the host layout). CUDA:
        the current stream is ordered after the kept copy first."""
        bufs, ev = self._kept[layer]
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        return bufs[dtype][offset:offset + numel].view(shape)

    def drop(self, layer: int) -> None:
        """Forget `layer`'s kept gradient (its update has been queued on the compute stream, which may still read
        it: the allocator reuses the memory only after that stream's work, and after the copy on the D2H stream,
        `record_stream` at the copy)."""
        self._kept.pop(layer, None)

    def materialize(self, layer: int) -> None:
        """Copy `layer`'s kept gradient into its host buffer (blocking) and forget it; a no-op when none is kept."""
        hit = self._kept.pop(layer, None)
        if hit is None:
            return
        bufs, _ = hit
        host = self.store.buffers[layer].grads
        if not self.cuda:
            for dt, k in bufs.items():
                host[dt].copy_(k)
            return
        with torch.cuda.stream(self.d2h_stream):  # after the kept copy (same stream)
            for dt, k in bufs.items():
                host[dt].copy_(k, non_blocking=True)
            done = self._record()
        done.synchronize()

    def materialize_except(self, keep: set[int]) -> None:
        """Materialize every kept gradient of a layer not in `keep` (a new plan budgets kept gradients only for its
        own GPU-updated layers)."""
        for layer in sorted(i for i in self._kept if i not in keep):
            self.materialize(layer)

    def materialize_all(self) -> None:
        self.materialize_except(set())

    def drop_stale(self, pending: set[int]) -> None:
        """A new window: forget the kept gradients no pending update will read (`pending`: layers whose deferred
        update is still to run), so they hold no device memory through the next forward."""
        for layer in [i for i in self._kept if i not in pending]:
            del self._kept[layer]

    @property
    def norm_from_device(self) -> bool:
        """True when `sq` is the square of the whole window's gradient norm (one micro-batch since zero)."""
        return self.microbatches == 1

    def prepare(self, slot: Slot) -> None:
        """Before a backward on `slot`: wait until its grads were copied out, then zero them (compute stream)."""
        if self.cuda and slot.grads_free is not None:
            wait_on(self.device, slot.grads_free, self.stalls if self.instrument else None)
        for g in slot.grads.values():
            g.zero_()

    def push(self, slot: Slot, layer: int) -> None:
        """After layer `layer`'s backward on `slot`: send its grads to the host (async on CUDA), or keep them on the
        device (`keep_layers`, first micro-batch of the window)."""
        if self.shard is not None:
            dst = self.shard.owner(layer)
            if dst != self.shard.dp.rank:
                self._reduce_away(slot, dst)
                return
        host = self.store.buffers[layer].grads
        first = layer in self._fresh
        self._fresh.discard(layer)
        grads = list(slot.grads.values())
        keep = first and layer in self.keep_layers and self.microbatches <= 1
        self.materialize(layer)  # a kept gradient of this window (not first) or a stale one (first): host first
        if not keep:
            self.d2h_bytes += sum(g.numel() * g.element_size() for g in grads)
        direct = first and all(host[dt].dtype == g.dtype for dt, g in slot.grads.items())
        if not self.cuda:
            if self.shard is not None:
                self.dp.reduce_(grads, self.dp.rank)
            elif self.dp is not None:
                self.dp.all_reduce_(grads)
            kept = {}
            for dt, g in slot.grads.items():
                self.sq += sq_norm(g)
                if keep:
                    kept[dt] = g.clone()
                else:
                    host[dt].copy_(g) if first else host[dt].add_(g)
            if keep:
                self._kept[layer] = (kept, None)
            return
        compute = torch.cuda.current_stream(self.device)
        works = []
        if self.shard is not None and self.dp.async_device:
            works = self.dp.reduce_async(grads, self.dp.rank)  # this rank owns the layer
        elif self.shard is not None:
            self.dp.reduce_(grads, self.dp.rank)
        elif self.dp is not None and self.dp.async_device:
            works = self.dp.all_reduce_async(grads)  # after this layer's backward, on the NCCL stream
        elif self.dp is not None:
            self.dp.all_reduce_(grads)
        self.d2h_stream.wait_stream(compute)
        with torch.cuda.stream(self.d2h_stream):
            for w in works:
                w.wait()  # the D2H stream (not the compute stream) waits for the reduced gradients
            for g in grads:
                self.sq += sq_norm(g)
        if keep or direct:  # one async copy: device to device into a kept buffer, or straight to the host
            dst = {dt: torch.empty_like(g) for dt, g in slot.grads.items()} if keep else host  # compute-stream memory
            with torch.cuda.stream(self.d2h_stream):
                for dt, g in slot.grads.items():
                    dst[dt].copy_(g, non_blocking=True)
                slot.grads_free = self._record()
            if keep:
                for t in dst.values():  # written on the D2H stream: not reused before that copy
                    t.record_stream(self.d2h_stream)
                self._kept[layer] = (dst, slot.grads_free)
            return
        staging = self._staging_for(slot)
        for p in [p for p in self._pending if p.staging is staging]:  # staging still holds an earlier layer
            self._finish(p)
        with torch.cuda.stream(self.d2h_stream):
            for dt, g in slot.grads.items():
                staging[dt].copy_(g, non_blocking=True)
            ev = self._record()
        slot.grads_free = ev
        self._pending.append(_Pending(layer, staging, ev, first))
        while len(self._pending) > 1:  # add the previous layer's grads while the GPU runs this one
            self._finish(self._pending[0])

    def _reduce_away(self, slot: Slot, dst: int) -> None:
        """Sharded, a layer rank `dst` owns: contribute this rank's gradient to its reduction, nothing else. The
        slot's grad buffers are free once the reduction has read them (NCCL: an event on the D2H stream after it)."""
        grads = list(slot.grads.values())
        if not (self.cuda and self.dp.async_device):
            self.dp.reduce_(grads, dst)
            return
        works = self.dp.reduce_async(grads, dst)
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            for w in works:
                w.wait()
            slot.grads_free = self._record()

    def _record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(self.d2h_stream)
        return ev

    def _staging_for(self, slot: Slot) -> dict[torch.dtype, torch.Tensor]:
        """The slot's staging buffers: exact sizes, page-locked in place (the caching host allocator would round
        each up to a power of two). The sets of slots that no longer exist (a new prefetch depth rebuilt them) are
        freed first, so their ids, reused by new slots, never hand out a wrong-sized set."""
        hit = self._staging.get(id(slot))
        if hit is not None and hit[0]() is slot:
            return hit[1]
        for key, (ref, old) in list(self._staging.items()):
            if ref() is None:
                for p in [p for p in self._pending if p.staging is old]:
                    self._finish(p)
                del self._staging[key]
                self._free(old)
        staging = {}
        for dt, g in slot.grads.items():
            staging[dt] = self._registered.empty(g.numel(), g.dtype, self.pin)
        self._staging[id(slot)] = (weakref.ref(slot), staging)
        self.staging_bytes += sum(t.numel() * t.element_size() for t in staging.values())
        return staging

    def _free(self, staging: dict[torch.dtype, torch.Tensor]) -> None:
        for t in staging.values():
            self._registered.drop(t)
            self.staging_bytes -= t.numel() * t.element_size()

    def _finish(self, p: _Pending) -> None:
        p.event.synchronize()
        host = self.store.buffers[p.layer].grads
        for dt, s in p.staging.items():
            host[dt].copy_(s) if p.first else host[dt].add_(s)
        self._pending.remove(p)

    def flush(self) -> None:
        """Make every pushed gradient visible in the host buffers (end of a micro-batch); kept gradients stay on the
        device (`materialize`)."""
        if self.cuda:
            self.d2h_stream.synchronize()
        while self._pending:
            self._finish(self._pending[0])

    def zero(self) -> None:
        """Start a new accumulation window. No memset: each layer's first push overwrites its host buffer, and a
        layer with no push this window reports no gradient (`has_grad`)."""
        self.flush()
        self._fresh = set(range(len(self.store.buffers)))
        self.sq.zero_()
        self.microbatches = 0

    def release(self) -> None:
        """Unregister the page-locked staging buffers (after `flush`; they stay valid as ordinary memory)."""
        if hasattr(self, "_registered"):
            self._registered.release()

    @property
    def registered_bytes(self) -> int:
        """The part of `staging_bytes` page-locked in place."""
        return self._registered.bytes
