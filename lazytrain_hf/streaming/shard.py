"""Sharded optimizer updates for data parallelism (`LazyTrainConfig.dp_updates="sharded"`).

Streamed layer i is owned by rank `i % world` (round-robin: every rank's first owned layer comes early, so the
updates that the next forward waits for finish about `world` times sooner than in the replicated mode, and the
layers the plan updates on the GPU, usually a contiguous run, are split evenly). Resident parts (embedding, final
norm, lm_head) stay replicated: all-reduced and updated on every rank.

  backward  the layer's gradient is SUM-reduced to its owner only (streaming/grads.py); other ranks skip its D2H
            copy and its squared norm; `StreamingExecutor.grad_norm` all-reduces the per-rank sums of squares.
  step      the LayerUpdater updates only owned layers (CPU worker or GPU-side at the next load); the optimizer
            never creates states for the others (Hybrid8 allocates states at a parameter's first update), so each
            rank holds ~1/world of the streamed layers' optimizer states. Every layer becomes `stale`.
  forward   at a stale layer's first load the owner loads it as usual (H2D, plus its GPU-side update if planned)
            and broadcasts the slot's weights; the other ranks skip the H2D copy, receive into the slot and copy
            the slot D2H into their host store (D2H stream, idle in forward). Loads are issued from the training
            thread in forward order 0..L-1 on every rank whatever the schedule (every layer's first load of a step
            is its forward), so every rank issues the broadcasts in the same order and after the same collectives.
            With one host copy shared by the host's ranks (streaming/shared_host.py) the copy-back stores the bytes
            the owner wrote there (Note [shared host weights ordering]).
  flush     (save, evaluate, end): stale layers are broadcast from the owner's host store (`resolve`; with one
            host copy for every rank, streaming/shared_host.py, a barrier: the owners wrote it).
  save      `gathered_states`: rank 0's optimizer holds every layer's states while the Trainer writes optimizer.pt
            (a file identical in content to the replicated mode's); loading keeps only the owned layers' states
            (`load_filter`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .comm import DataParallel
from .host_store import HostParamStore
from .weights import Slot

__all__ = ["ShardedUpdates"]


class ShardedUpdates:
    """Layer ownership and the weight broadcasts of sharded data-parallel updates.

    Args:
        dp: the process group wrapper (world >= 2).
        num_layers: streamed decoder layers.

    Attributes:
        owned: the layers this rank updates.
        stale: layers whose owner has updated them (or will, before their next load) since their last broadcast.
    """

    def __init__(self, dp: DataParallel, num_layers: int) -> None:
        self.dp = dp
        self.num_layers = num_layers
        self.owned = {i for i in range(num_layers) if self.owner(i) == dp.rank}
        self.stale: set[int] = set()
        self.broadcasts = 0  # layer broadcasts at load time (for tests and metrics)

    def owner(self, layer: int) -> int:
        """The group rank that updates `layer`."""
        return layer % self.dp.world

    def mark_step(self) -> None:
        """An optimizer step deferred every layer's update: each must be broadcast from its owner before use."""
        self.stale = set(range(self.num_layers))

    def receives(self, layer: int) -> bool:
        """True when this rank's next load of `layer` takes the weights from the owner instead of its host store
        (the streamer skips the H2D copy)."""
        return layer in self.stale and layer not in self.owned

    def after_load(self, slot: Slot, layer: int, host: dict[torch.dtype, torch.Tensor],
                   d2h_stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
        """Broadcast a stale layer's weights from the owner's slot into every rank's slot; a non-owner then copies
        them into its host store. Runs on the current stream (the H2D stream under CUDA, after the owner's load and
        GPU-side update were enqueued), so the slot is marked ready only after the broadcast.

        Returns:
            The non-owner's copy-back event (CUDA; recorded on `d2h_stream`): later loads of the layer and later
            loads into the slot must wait for it. None otherwise.
        """
        if layer not in self.stale:
            return None
        self.stale.discard(layer)
        self.broadcasts += 1
        self.dp.broadcast_device_(list(slot.weights.values()), self.owner(layer))
        if layer in self.owned:
            return None
        if d2h_stream is None:
            for dt, t in slot.weights.items():
                host[dt].copy_(t)
            return None
        d2h_stream.wait_stream(torch.cuda.current_stream(next(iter(slot.weights.values())).device))
        with torch.cuda.stream(d2h_stream):
            for dt, t in slot.weights.items():
                host[dt].copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(d2h_stream)
        return done

    def resolve(self, store: HostParamStore, barrier: Callable[[], None] | None = None) -> None:
        """Broadcast every stale layer from its owner's host store (collective: every rank calls it, after the
        owner's updates have landed). Layers in increasing order, as at load time. `barrier`: every rank maps the
        same host copy (streaming/shared_host.py), which holds the owners' updates already: wait for every rank
        instead."""
        if barrier is not None:
            barrier()
        else:
            for layer in sorted(self.stale):
                self.dp.broadcast_(list(store.buffers[layer].weights.values()), self.owner(layer))
        self.stale.clear()

    # ---- optimizer checkpoints ----------------------------------------------------------------------------
    def load_filter(self, layer_params: list[list[torch.Tensor]]):
        """A `load_state_dict` pre-hook for the optimizer that drops the states of layers other ranks own, so a
        complete optimizer.pt allocates only this rank's share."""
        foreign = {id(p) for i, ps in enumerate(layer_params) if i not in self.owned for p in ps}

        def hook(optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
            drop = {idx for g, sg in zip(optimizer.param_groups, state_dict["param_groups"])
                    for p, idx in zip(g["params"], sg["params"]) if id(p) in foreign}
            return {**state_dict, "state": {k: v for k, v in state_dict["state"].items() if k not in drop}}

        return hook

    @contextlib.contextmanager
    def gathered_states(self, optimizer: Any, layer_params: list[list[torch.Tensor]]):
        """Inside the block, rank 0's `optimizer.state` also holds the states of layers other ranks own (copied to
        ordinary host memory: at most the replicated mode's footprint, for the save only). Collective: every rank
        enters it. Per layer, the owner broadcasts the states' shapes and dtypes, then each tensor (staged through
        the device under NCCL)."""
        added: list[torch.Tensor] = []
        try:
            for i, params in enumerate(layer_params):
                src = self.owner(i)
                if src == 0:
                    continue
                meta: list[Any] = [None]
                if self.dp.rank == src:
                    meta = [[{k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v
                              for k, v in optimizer.state.get(p, {}).items()} for p in params]]
                self.dp.broadcast_object_(meta, src)
                for p, keys in zip(params, meta[0]):
                    if not keys:
                        continue
                    if self.dp.rank == src:
                        state = optimizer.state[p]
                    else:
                        state = {k: torch.empty(v[0], dtype=v[1]) if isinstance(v, tuple) else v
                                 for k, v in keys.items()}
                    self.dp.broadcast_([v for v in state.values() if torch.is_tensor(v)], src)
                    if self.dp.rank == 0:
                        optimizer.state[p] = state
                        added.append(p)
            yield
        finally:
            for p in added:
                optimizer.state.pop(p, None)
