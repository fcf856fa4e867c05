"""GPU weight slots and the H2D weight streamer.

Per distinct layer structure (Qwen3.5 mixes linear- and full-attention layers) the device holds
`prefetch_depth + 1` slots. A slot is a template module whose parameters are views into the slot's flat device
buffers (zero-copy binding: loading layer i is one H2D copy per dtype into the slot, no device-to-device copy)
and whose `.grad` tensors are views into flat device gradient buffers (one D2H copy per dtype after backward).

Streams (CUDA only; on CPU every copy is a plain synchronous copy and events are None):
  compute: the caller's current stream; runs layers.
  h2d:     weight loads; waits on `slot.free` (compute is done reading the old weights) before overwriting.
Events:
  slot.ready: recorded on h2d after the load; compute waits on it before running the slot.
  slot.free:  recorded on compute after the last use; h2d waits on it before the next load into the slot.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .host_store import HostParamStore
from .quant import keep_packing, set_quant_tensor, template_copy

__all__ = ["Slot", "WeightStreamer", "wait_on"]


def wait_on(device: torch.device, event: torch.cuda.Event,
            stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None) -> None:
    """Make the current (compute) stream wait for `event`; with `stalls`, bracket the wait with timing events
    whose elapsed time is how long compute stood still (exposed transfer)."""
    stream = torch.cuda.current_stream(device)
    if stalls is None:
        stream.wait_event(event)
        return
    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record(stream)
    stream.wait_event(event)
    after.record(stream)
    stalls.append((before, after))


@dataclass
class Slot:
    """One device-resident layer instance.

    Attributes:
        module: template layer whose parameters view `weights` and whose grads view `grads`.
        weights: dtype -> flat device buffer of the layer's parameters.
        grads: dtype -> flat device buffer of the layer's parameter gradients (parameter dtype).
        layer: index of the decoder layer whose weights the slot holds (-1: none).
    """

    module: nn.Module
    weights: dict[torch.dtype, torch.Tensor]
    grads: dict[torch.dtype, torch.Tensor]
    layer: int = -1
    ready: torch.cuda.Event | None = None
    free: torch.cuda.Event | None = None
    grads_free: torch.cuda.Event | None = None  # recorded on the D2H stream once `grads` were copied out
    storage_ptrs: set[int] = field(default_factory=set)
    version: object = None  # `WeightStreamer.host_version` of the weights loaded (None: unknown)
    held: int = -1  # after `invalidate`: the layer whose current host weights the slot still holds (-1: none)
    # (module, attribute) in `module` of each resident parameter of a frozen layer, bound at every load
    binds: list[tuple[nn.Module, str]] = field(default_factory=list)


class WeightStreamer:
    """Streams decoder-layer weights from a HostParamStore into device slots along a known access sequence.

    Args:
        layers: the host decoder layers (templates are deep copies, re-bound to device slots).
        store: the host buffers of those layers.
        keys: structure key per layer; layers with equal keys share slots.
        device: compute device.
        prefetch_depth: accesses issued ahead of the one being computed (slots per structure = depth + 1).
    """

    def __init__(self, layers: nn.ModuleList, store: HostParamStore, keys: list[tuple], device: torch.device,
                 prefetch_depth: int = 1) -> None:
        self.store = store
        self.keys = keys
        self.device = device
        self.depth = prefetch_depth
        self.cuda = device.type == "cuda"
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pools: dict[tuple, list[Slot]] = {}
        for i, key in enumerate(keys):
            if key not in self.pools:
                self.pools[key] = [self._make_slot(layers[i], i) for _ in range(prefetch_depth + 1)]
        self.h2d_bytes = 0  # bytes loaded since the last reset (for metrics)
        # (before, after) events on the compute stream around each wait for a weight load: their elapsed time is
        # how long compute stalled on H2D (exposed transfer). Filled only when `instrument` is set.
        self.before_load = None  # callable(layer): blocks until the host weights of `layer` may be read
        # callable(slot, layer): runs after the weights' H2D is enqueued (on the H2D stream under CUDA) and before
        # the slot is marked ready: the executor's GPU-side optimizer update of a freshly loaded layer
        self.after_load = None
        # callable(layer) -> True: this load takes the weights from elsewhere (sharded data parallel: a broadcast
        # from the layer's owner in `before_compute`), so the H2D copy from the host store is skipped
        self.skip_h2d = None
        # callable(layer) -> a token that changes whenever the layer's host weights may have changed, or None (not
        # tracked): a slot loaded at the same token still holds them (Note [slot reuse] in streaming/executor.py)
        self.host_version = None
        # callable(slot, layer): on the compute stream once the slot is ready, before compute uses it (the executor
        # runs a staged GPU-side update there, then a sharded layer's broadcast)
        self.before_compute = None
        self.host_written: dict[int, torch.cuda.Event] = {}  # layer -> D2H of its updated host weights
        self.slot_read: dict[int, torch.cuda.Event] = {}  # id(slot) -> that D2H, which reads the slot
        self.instrument = False
        self.stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # (start, end) events on the H2D stream around each load's weight copies, after its waits (instrumented):
        # their elapsed time is the copies' own duration, so bytes / time is the H2D bandwidth reached in the step
        self.copies: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.loads = 0
        self._seq: list[int] = []
        self._pos = 0

    def _make_slot(self, layer: nn.Module, index: int) -> Slot:
        bufs = self.store.buffers[index]
        module = template_copy(layer).to(self.device)
        keep_packing(module)
        weights = {dt: torch.empty(t.numel(), dtype=dt, device=self.device) for dt, t in bufs.weights.items()}
        # a frozen layer's slot has no gradient buffers (Note [frozen layers] in streaming/executor.py)
        grads = {} if bufs.frozen else {dt: torch.zeros(t.numel(), dtype=dt, device=self.device)
                                        for dt, t in bufs.weights.items()}
        params = dict(module.named_parameters())
        for s in bufs.specs:
            p = params[s.name]
            p.data = weights[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
            if not bufs.frozen:
                p.grad = grads[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
        for s in bufs.quant:  # the 4-bit weights' states view the slot too: a load copies the layer's own state
            set_quant_tensor(params[s.name], s.quant, weights[s.dtype][s.offset:s.offset + s.numel].view(s.shape))
        for m in module.modules():  # bitsandbytes keeps a second reference beside the weight's
            if hasattr(m, "quant_state") and getattr(getattr(m, "weight", None), "quant_state", None) is not None:
                m.quant_state = m.weight.quant_state
        binds = []  # where the loaded layer's own resident parameters go in the template
        for name, _ in bufs.resident:
            owner, _, attr = name.rpartition(".")
            binds.append((module.get_submodule(owner), attr))
        ptrs = {t.untyped_storage().data_ptr() for t in weights.values()}
        ev = (torch.cuda.Event(), torch.cuda.Event()) if self.cuda else (None, None)
        return Slot(module=module, weights=weights, grads=grads, layer=-1, ready=ev[0], free=ev[1], storage_ptrs=ptrs,
                    binds=binds)

    @property
    def slots(self) -> list[Slot]:
        return [s for pool in self.pools.values() for s in pool]

    @property
    def device_bytes(self) -> int:
        """Device bytes held by all slots (weights + grads)."""
        return sum(t.numel() * t.element_size() for s in self.slots for d in (s.weights, s.grads) for t in d.values())

    # ---- access sequence -------------------------------------------------------------------------------------
    def begin(self, sequence: list[int]) -> None:
        """Start a pass over `sequence` (layer indices in the order they will be used) and prefetch its head."""
        self._seq = list(sequence)
        self._pos = 0
        for k in range(min(self.depth, len(self._seq))):
            self._issue(k)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Inside the block another pass may `begin` and run (a no-grad forward while a training pass waits for its
        head's gradient); after it the current pass's access sequence is back where it was and its prefetch window
        is issued again (the other pass may have loaded other layers into those slots)."""
        seq, pos = self._seq, self._pos
        try:
            yield
        finally:
            self._seq, self._pos = seq, pos
            for k in range(pos, min(pos + self.depth, len(seq))):
                self._issue(k)

    def acquire(self, layer: int) -> Slot:
        """The slot holding `layer`'s weights, ready for compute on the current stream. Must follow the sequence."""
        if self._pos >= len(self._seq) or self._seq[self._pos] != layer:
            raise RuntimeError(f"weight access out of order: expected {self._seq[self._pos:self._pos + 1]}, "
                               f"got layer {layer}")
        slot = self._issue(self._pos)
        if self._pos + self.depth < len(self._seq):
            self._issue(self._pos + self.depth)
        if self.cuda:
            wait_on(self.device, slot.ready, self.stalls if self.instrument else None)
        if self.before_compute is not None:
            self.before_compute(slot, layer)
        self._pos += 1
        return slot

    def release(self, slot: Slot) -> None:
        """Compute is done with the slot's weights (for now): later loads into it wait for this point."""
        if self.cuda:
            slot.free.record(torch.cuda.current_stream(self.device))

    def _issue(self, k: int) -> Slot:
        layer = self._seq[k]
        pool = self.pools[self.keys[layer]]
        for s in pool:
            if s.layer == layer:
                return s
        # Victim: a slot whose layer is not needed between the current access and access k; one that still holds
        # this layer's weights first (Note [slot reuse]: loaded without the H2D copy).
        needed = set(self._seq[self._pos:k + 1])
        victims = [s for s in pool if s.layer not in needed]
        if not victims:  # cannot happen with depth + 1 slots per structure; be loud if it does
            raise RuntimeError("no free weight slot; prefetch window larger than the slot pool")
        slot = next((s for s in victims if s.held == layer), victims[0])
        pool.remove(slot)
        pool.append(slot)  # LRU order: most recently loaded last
        self._load(slot, layer, reuse=slot.held == layer)
        return slot

    def _load(self, slot: Slot, layer: int, reuse: bool = False) -> None:
        """Load `layer` into `slot`: the H2D copy (unless `reuse`: the slot holds its current weights, or a sharded
        rank receives them), then the `after_load` hook, then `slot.ready`."""
        if self.before_load is not None:
            self.before_load(layer)  # a deferred optimizer update of this layer must land first
        host = self.store.buffers[layer].weights
        copy = not reuse and (self.skip_h2d is None or not self.skip_h2d(layer))
        slot.held = -1
        slot.version = self.host_version(layer) if self.host_version is not None else None
        if self.cuda:
            with torch.cuda.stream(self.h2d_stream):
                self.h2d_stream.wait_event(slot.free)
                if layer in self.host_written:  # a GPU-side update is still writing this layer's host weights
                    self.h2d_stream.wait_event(self.host_written[layer])
                if id(slot) in self.slot_read:  # ... or still copying this slot's updated weights out
                    self.h2d_stream.wait_event(self.slot_read[id(slot)])
                timed = self.instrument and copy
                if timed:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(self.h2d_stream)
                for dt, dst in slot.weights.items() if copy else ():
                    dst.copy_(host[dt], non_blocking=True)
                if timed:
                    end.record(self.h2d_stream)
                    self.copies.append((start, end))
                if self.after_load is not None:
                    self.after_load(slot, layer)
                slot.ready.record(self.h2d_stream)
        else:
            for dt, dst in slot.weights.items() if copy else ():
                dst.copy_(host[dt])
            if self.after_load is not None:
                self.after_load(slot, layer)
        for (owner, attr), (_, p) in zip(slot.binds, self.store.buffers[layer].resident):
            owner._parameters[attr] = p  # the layer's own trainable parameter: autograd accumulates into its .grad
        slot.layer = layer
        self.loads += 1
        if copy:
            self.h2d_bytes += sum(t.numel() * t.element_size() for t in host.values())

    def invalidate(self) -> None:
        """Start a new pass: forget which layers the slots hold (host weights may have changed, e.g. after an
        optimizer step), except that a slot whose `host_version` is still current remembers its layer (`Slot.held`)
        and a load of that layer takes it without the H2D copy (Note [slot reuse] in streaming/executor.py)."""
        for s in self.slots:
            current = s.layer >= 0 and s.version is not None and s.version == self.host_version(s.layer)
            s.held = s.layer if current else -1
            s.layer = -1

    def forget(self) -> None:
        """No slot is known to hold current host weights (they may be written by code outside the executor)."""
        for s in self.slots:
            s.version = None
