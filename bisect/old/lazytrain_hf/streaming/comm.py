"""Data parallelism for the streaming executor over torch.distributed (one process per GPU, DESIGN.md §2).

Each rank runs its own executor on its share of the global batch and keeps a full replica of the host store and
optimizer state; gradients are summed over ranks with all-reduce (NCCL on GPUs, gloo on CPUs):
  streamed layers: per layer, as soon as its backward ends, on the slot's flat gradient buffers (NCCL: async on the
                   communication stream, the D2H copy waits for it, the compute stream does not), so the reduction
                   overlaps the backward of the next layers;
  resident parts:  (embedding, final norm, lm_head) once per accumulation window, after its last micro-batch, like
                   DDP's `no_sync` (their `.grad` accumulates locally in between).
Every rank then applies the same update to identical weights (replicated optimizer). The Trainer's loss scaling
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

    def all_reduce_(self, tensors: list[torch.Tensor]) -> None:
        """SUM all-reduce in place, blocking. CUDA tensors under a host backend (gloo) are read only after the
        current stream has produced them."""
        if not self.async_device and any(t.is_cuda for t in tensors):
            torch.cuda.current_stream(tensors[0].device).synchronize()
        for t in tensors:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values into every rank's `tensors`, in place. Host tensors under NCCL are staged through the
        compute device one at a time (at most one layer buffer of extra device memory)."""
        for t in tensors:
            if self.backend == "nccl" and t.device.type != "cuda":
                tmp = t.to(self.device)
                dist.broadcast(tmp, src=0, group=self.group)
                t.copy_(tmp)
                del tmp
            else:
                dist.broadcast(t, src=0, group=self.group)

