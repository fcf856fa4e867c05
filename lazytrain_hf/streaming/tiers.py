"""Activation tiers for materialized layer boundaries: keep on the device, offload to pinned CPU, or to NVMe files.

A boundary is a [B, T, H] hidden-state tensor. `ActivationStash.put(i, h, tier)` in forward, `get(i)` in
backward returns it on the compute device, bit-exact. CPU tier: async D2H on the D2H stream into pinned memory;
the event recorded after the copy orders the later H2D (Note [stash keep-alive]: the device source is NOT kept;
`record_stream` on the D2H stream stops the caching allocator from reusing its memory before the copy is done, so
an offloaded boundary leaves the GPU as soon as forward drops it). NVMe tier: D2H into a 4096-byte-aligned (pinned)
host buffer, then a background thread writes it to a file in `nvme_dir` with O_DIRECT where the filesystem allows
it (`nvme.write_file`; raw bytes of any dtype, padded to 4096 bytes, the true size remembered). At most
`max_pending_writes` boundaries wait in host memory for their write; a failed write (disk full, short write) raises
at the next `put`, at that boundary's `get`, or at `flush`, and leaves no file behind. Read-ahead: each `get(i)`
starts reading the next NVMe boundary backward will need (the largest stashed index below i) on the I/O threads.

Host memory (Note [stash buffers]): every host copy (CPU-tier boundary, NVMe write or read buffer) is a
`HostBufferPool` buffer of `padded(nbytes)` bytes, page-locked in place at its exact size and reused across steps
(not PyTorch's caching host allocator, which rounds a block up to a power of two). A buffer goes back to the pool
when its user is done: an NVMe write buffer once its file is written; a boundary's buffer once `get` has enqueued
its H2D copy, with an event recorded after that copy on the compute stream, which the next user waits for (the
D2H stream for a CPU-tier put, the calling thread for a file read into it). On a CPU device `get` returns the host
buffer itself, so buffers go back only at `clear`.

Fetch-ahead (CUDA, CPU tier): a boundary's H2D copy runs on the stash's own copy stream, and `get(i)` also starts
the copy of the next CPU-tier boundary backward will need (the largest stashed index below i), so it crosses PCIe
while segment i recomputes and runs backward, as the planner's simulator schedules boundary fetches
(planning/simulator.py: one boundary fetched ahead). On the compute stream each copy cost its whole transfer: 80
fp32 boundaries of a Llama-3-70B QLoRA run, ~11 ms each, in every micro-batch.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .host_store import HostBufferPool
from .nvme import padded, read_file, write_file

__all__ = ["ActivationStash"]


@dataclass(eq=False)  # identity comparison: entries hold tensors
class _Entry:
    tier: str
    tensor: torch.Tensor | None  # gpu: the tensor; cpu: pinned host copy; nvme: host copy until written
    src: torch.Tensor | None = None  # unused for offloaded tiers: Note [stash keep-alive]
    event: torch.cuda.Event | None = None
    path: str | None = None
    shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    nbytes: int = 0  # true byte count (the file is padded to 4096 bytes)
    buf: torch.Tensor | None = None  # cpu, nvme: the pool buffer behind `tensor` (nvme: until written)
    write: Future | None = None  # nvme: background write; result() is True when O_DIRECT was used
    read: Future | None = None  # nvme: read-ahead; result() is the host tensor
    read_buf: torch.Tensor | None = None  # nvme: the pool buffer a read filled
    device_copy: torch.Tensor | None = None  # cpu: the fetched-ahead copy on the compute device
    fetched: torch.cuda.Event | None = None  # cpu: recorded after that copy on the stash's H2D stream


class ActivationStash:
    """Holds materialized boundaries for one step.

    Args:
        device: compute device.
        nvme_dir: directory for "nvme" tier files (created if missing).
        pin: use pinned host buffers for the CPU and NVMe tiers (CUDA only).
        o_direct: try O_DIRECT for NVMe files (falls back to buffered I/O where the filesystem refuses it).
        io_threads: threads for NVMe writes and read-ahead.
        max_pending_writes: NVMe boundaries that may wait in host memory for their write before `put` blocks.

    Attributes:
        buffers: the host buffers of the CPU and NVMe tiers (Note [stash buffers]); page-locked when `pin`.
    """

    def __init__(self, device: torch.device, nvme_dir: str | None = None, pin: bool = True, *,
                 o_direct: bool = True, io_threads: int = 2, max_pending_writes: int = 2) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.pin = pin and self.cuda
        self.nvme_dir = nvme_dir
        self.o_direct = o_direct
        self.io_threads = io_threads
        self.max_pending_writes = max_pending_writes
        self.d2h_stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_stream = torch.cuda.Stream(device) if self.cuda else None  # boundary fetches (fetch-ahead)
        self.entries: dict[int, _Entry] = {}
        self.bytes_by_tier = {"gpu": 0, "cpu": 0, "nvme": 0}
        self.d2h_bytes = 0
        self.h2d_bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[_Entry] = []  # nvme entries whose write may not have finished, oldest first
        self.buffers = HostBufferPool(self.pin)
        self._consumed: list[torch.Tensor] = []  # CPU device: buffers `get` handed out, returned at `clear`

    def put(self, i: int, h: torch.Tensor, tier: str) -> None:
        nbytes = h.numel() * h.element_size()
        if tier == "gpu":
            self.bytes_by_tier[tier] += nbytes
            self.entries[i] = _Entry("gpu", h)
            return
        if tier == "nvme":
            if not self.nvme_dir:
                raise ValueError("activation tier 'nvme' needs lazytrain_config.nvme_dir")
            self._throttle()
        buf = self.buffers.acquire(padded(nbytes), self.d2h_stream)  # the D2H below waits for its last reader
        host = buf[:nbytes].view(h.dtype).view(h.shape)
        self.bytes_by_tier[tier] += nbytes
        if self.cuda:
            ev = torch.cuda.Event()
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.d2h_stream):
                host.copy_(h, non_blocking=True)
                ev.record(self.d2h_stream)
            h.record_stream(self.d2h_stream)
            entry = _Entry(tier, host, event=ev, shape=tuple(h.shape), dtype=h.dtype, buf=buf)
        else:
            host.copy_(h)
            entry = _Entry(tier, host, shape=tuple(h.shape), dtype=h.dtype, buf=buf)
        self.d2h_bytes += nbytes
        if tier == "nvme":
            os.makedirs(self.nvme_dir, exist_ok=True)
            entry.nbytes = nbytes
            entry.path = os.path.join(self.nvme_dir, f"boundary{i}-{uuid.uuid4().hex}.bin")
            entry.write = self._io().submit(self._write, entry)
            self._pending.append(entry)
        self.entries[i] = entry

    def _io(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="lazytrain-nvme")
        return self._pool

    def _throttle(self) -> None:
        """Raise a finished write's error; wait for the oldest writes while too many are pending."""
        for e in [e for e in self._pending if e.write.done()]:
            self._pending.remove(e)
            if e.write.exception() is not None:
                self._drop(e)
                e.write.result()
        while len(self._pending) >= self.max_pending_writes:
            e = self._pending.pop(0)
            if e.write.exception() is not None:  # waits for the write
                self._drop(e)
                e.write.result()

    def _drop(self, e: _Entry) -> None:
        for k, v in list(self.entries.items()):
            if v is e:
                del self.entries[k]

    def _write(self, e: _Entry) -> bool:
        """I/O thread: wait for the D2H copy, write the file, return the host buffer. True when O_DIRECT."""
        try:
            if e.event is not None:
                e.event.synchronize()
            e.src = None
            return write_file(e.path, e.buf[:padded(e.nbytes)], e.nbytes, self.o_direct)
        finally:
            self.buffers.release(e.buf, e.event)  # the event: in case the wait above was cut short
            e.tensor = e.buf = None

    def _read(self, e: _Entry) -> torch.Tensor:
        """Wait for e's write, then read its file into a pool buffer (`e.read_buf`; typed view returned)."""
        direct = e.write.result()
        buf = self.buffers.acquire(padded(e.nbytes))  # this thread writes it: waits for its last H2D reader
        try:
            read_file(e.path, buf[:padded(e.nbytes)], direct)
        except BaseException:
            self.buffers.release(buf)
            raise
        e.read_buf = buf
        return buf[:e.nbytes].view(e.dtype).view(e.shape)

    def _ahead(self, below: int) -> None:
        """After `get(below)`: start reading the next NVMe boundary backward needs from its file and, on CUDA,
        copying the next CPU-tier one to the device (each the largest stashed index below `below` of its tier)."""
        nvme = [k for k, e in self.entries.items() if e.tier == "nvme" and k < below and e.read is None]
        if nvme:
            e = self.entries[max(nvme)]
            e.read = self._io().submit(self._read, e)
        cpu = [k for k, e in self.entries.items() if e.tier == "cpu" and k < below] if self.cuda else []
        if cpu and self.entries[max(cpu)].device_copy is None:
            self._fetch(self.entries[max(cpu)])

    def get(self, i: int) -> torch.Tensor:
        """Boundary i on the compute device (removed from the stash)."""
        e = self.entries.pop(i)
        if e.tier == "gpu":
            self._ahead(i)
            return e.tensor
        if e.tier == "nvme":
            try:
                host = e.read.result() if e.read is not None else self._read(e)
            finally:
                if e in self._pending:
                    self._pending.remove(e)
                if os.path.exists(e.path):
                    os.unlink(e.path)
            buf = e.read_buf
        elif self.cuda:  # cpu tier: the copy runs (or ran, fetched ahead) on the H2D stream
            if e.device_copy is None:
                self._fetch(e)
            torch.cuda.current_stream(self.device).wait_event(e.fetched)
            out = e.device_copy
            e.device_copy = e.fetched = None
            self._ahead(i)
            return out
        else:
            host, buf = e.tensor, e.buf
        e.tensor = e.buf = e.read_buf = None
        self._ahead(i)
        self.h2d_bytes += host.numel() * host.element_size()
        out = host.to(self.device, non_blocking=self.cuda)
        if self.cuda:  # Note [stash buffers]: reusable once the H2D copy that reads it is done
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.buffers.release(buf, done)
        else:
            self._consumed.append(buf)  # `out` is the buffer itself
        return out

    def _fetch(self, e: _Entry) -> None:
        """Start cpu-tier entry e's H2D copy on the H2D stream, after its D2H; its host buffer goes back to the pool
        once the copy is done. The device copy is allocated from the compute stream's memory (where boundaries
        always came from: no blocks cached for another stream under a tight cap), so the copy waits for the compute
        work queued so far, the block's earlier users, and overlaps what is queued after."""
        s, compute = self.h2d_stream, torch.cuda.current_stream(self.device)
        e.device_copy = torch.empty(e.tensor.shape, dtype=e.tensor.dtype, device=self.device)
        s.wait_stream(compute)
        if e.event is not None:
            s.wait_event(e.event)
        with torch.cuda.stream(s):
            e.device_copy.copy_(e.tensor, non_blocking=True)
            e.fetched = torch.cuda.Event()
            e.fetched.record(s)
        e.device_copy.record_stream(s)  # freed on the compute stream: not reused before the copy is done
        self.h2d_bytes += e.tensor.numel() * e.tensor.element_size()
        self.buffers.release(e.buf, e.fetched)
        e.tensor = e.buf = None

    def flush(self) -> None:
        """Wait for every pending NVMe write; raise the first failure (its file already removed)."""
        while self._pending:
            e = self._pending.pop(0)
            if e.write.exception() is not None:
                self._drop(e)
                e.write.result()

    def clear(self) -> None:
        """End of a step: drop every boundary and return every host buffer to the pool."""
        for e in self.entries.values():
            for fut in (e.write, e.read):
                if fut is not None:
                    fut.exception()  # wait; errors of boundaries nobody asked for again are dropped
            if e.path and os.path.exists(e.path):
                os.unlink(e.path)
            if e.tier == "cpu" and e.buf is not None:
                self.buffers.release(e.buf, e.event)  # its D2H may still be running
            if e.read_buf is not None:  # nvme write buffers went back when their write ended
                self.buffers.release(e.read_buf)
            e.tensor = e.buf = e.read_buf = None
        for buf in self._consumed:
            self.buffers.release(buf)
        self._consumed.clear()
        self.entries.clear()
        self._pending.clear()
        self.bytes_by_tier = {"gpu": 0, "cpu": 0, "nvme": 0}

    def release(self) -> None:
        """Unregister the pool's page-locked buffers (after `clear`; they stay valid as ordinary memory)."""
        self.buffers.release_all()
