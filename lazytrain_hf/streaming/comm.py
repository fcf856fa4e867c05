"""Data parallelism for the streaming executor over torch.distributed (one process per GPU).

Each rank runs its own executor on its share of the global batch and keeps a full replica of the host store and
optimizer state; gradients are summed over ranks with all-reduce (NCCL on GPUs, gloo on CPUs):
  streamed layers: per layer, as soon as its backward ends, on the slot's flat gradient buffers (NCCL: async on the
                   communication stream, the D2H copy waits for it, the compute stream does not), so the reduction
                   overlaps the backward of the next layers;
  resident parts:  (embedding, final norm, lm_head) once per accumulation window, after its last micro-batch, like
                   DDP's `no_sync` (their `.grad` accumulates locally in between).
Every rank then applies the same update to identical weights (replicated optimizer), or, with
`dp_updates="sharded"`, each streamed layer's gradient is reduced to its owner only, which alone updates the layer
and broadcasts the new weights (streaming/shard.py). The Trainer's loss scaling
convention is kept: the executor's loss denominator is the global token count, so a SUM all-reduce gives the
exact global-batch gradient (transformers `Trainer.compute_loss`, `average_tokens_across_devices`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["DataParallel"]


class DataParallel:
    """Gradient all-reduce and initial weight broadcast for one process group.

    Args:
        device: this rank's compute device (cuda:<local_rank> with NCCL, cpu with gloo).
        group: process group (default: the world).

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("DataParallel needs torch.distributed initialized (launch with accelerate launch "
                               "or torchrun)")
        self.device = device
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = str(dist.get_backend(group)).lower()
        # NCCL reduces device tensors asynchronously on its own stream; gloo reduces CPU tensors in place, blocking
        self.async_device = self.backend == "nccl" and device.type == "cuda"

    @staticmethod
    def from_env(device: torch.device) -> DataParallel | None:
        """The world group when this process is one of >= 2 ranks, else None (single-process training)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return DataParallel(device)
        return None

    def all_reduce_async(self, tensors: list[torch.Tensor]) -> list[dist.Work]:
        """SUM all-reduce of device tensors, enqueued after the current stream's work; `work.wait()` makes the
        calling stream wait for the result (NCCL only)."""
        return [dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True) for t in tensors]

    def _global(self, r: int) -> int:
        """The global rank of this group's rank `r` (what torch.distributed's src / dst arguments take)."""
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def reduce_async(self, tensors: list[torch.Tensor], dst: int) -> list[dist.Work]:
        """SUM reduce of device tensors into group rank `dst`'s copies (NCCL only; other ranks' tensors are left
        unspecified), enqueued after the current stream's work; `work.wait()` makes the calling stream wait."""
        return [dist.reduce(t, self._global(dst), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                for t in tensors]

    def reduce_(self, tensors: list[torch.Tensor], dst: int) -> None:
        """SUM reduce into group rank `dst`'s tensors, blocking (other ranks' tensors are left unspecified)."""
        if not self.async_device and any(t.is_cuda for t in tensors):
            torch.cuda.current_stream(tensors[0].device).synchronize()
        for t in tensors:
            dist.reduce(t, self._global(dst), op=dist.ReduceOp.SUM, group=self.group)

    def broadcast_device_(self, tensors: list[torch.Tensor], src: int) -> None:
        """Group rank `src`'s values into every rank's `tensors` (on the compute device, or CPU under gloo), in
        place, ordered on the current stream: NCCL runs it after the stream's earlier work and the stream waits
        for it (the host does not); a host backend blocks after the stream's work is done."""
        if self.async_device:
            for t in tensors:
                dist.broadcast(t, self._global(src), group=self.group, async_op=True).wait()
            return
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream(tensors[0].device).synchronize()
        for t in tensors:
            dist.broadcast(t, self._global(src), group=self.group)

    def broadcast_object_(self, objects: list, src: int) -> None:
        """`dist.broadcast_object_list` from group rank `src` (small metadata; pickled)."""
        dist.broadcast_object_list(objects, self._global(src), group=self.group,
                                   device=self.device if self.backend == "nccl" else None)

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None:
        """SUM all-reduce in place, blocking. CUDA tensors under a host backend (gloo) are read only after the
        current stream has produced them."""
        if not self.async_device and any(t.is_cuda for t in tensors):
            torch.cuda.current_stream(tensors[0].device).synchronize()
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast_(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Group rank `src`'s values into every rank's `tensors`, in place, blocking. Host tensors under NCCL are
        staged through the compute device one at a time (at most one layer buffer of extra device memory)."""
        for t in tensors:
            if self.backend == "nccl" and t.device.type != "cuda":
                tmp = t.to(self.device)
                dist.broadcast(tmp, self._global(src), group=self.group)
                t.copy_(tmp)
                del tmp
            else:
                dist.broadcast(t, self._global(src), group=self.group)

