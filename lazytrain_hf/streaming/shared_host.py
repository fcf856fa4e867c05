"""One host copy of the streamed decoder layers' weights for the data-parallel ranks of a host
(`LazyTrainConfig.dp_host_weights`, "auto": shared when two or more ranks run on a host with sharded updates).

Without it every rank keeps its own copy of every layer's weights in host memory (`HostParamStore`): two ranks of
Qwen3.6-27B hold its 49 GB of bf16 layer weights twice. Here the ranks of a host map one file in /dev/shm (POSIX shared memory, a tmpfs)
instead, and each layer's weights take their bytes once per host. Gradients, optimizer states and master weights stay
each rank's own (the optimizer states sharded across the ranks, as before).

Lifecycle (`SharedHostWeights.allocate`, a collective of the host's ranks):
  check    the host's first rank (its lowest global rank, the "writer") checks the free space of /dev/shm
           (`check_shm_space`): too small, every rank raises one error naming the need, the limit and the fix
           (docker --shm-size, ...) before anything is allocated;
  create   the writer creates the file and reserves its pages
           (posix_fallocate: a full /dev/shm fails here, not with SIGBUS in the middle of training); the others map
           it once it exists; then it is unlinked, so its memory goes with the last mapping, also when a process dies;
  pin      on CUDA every process registers the whole mapping with cudaHostRegister (the same pages, page-locked once
           per process that maps them); on a CPU run it stays pageable, the same code path otherwise;
  fill     the writer copies its weights in (`HostParamStore`); `published` (a barrier of the host's ranks) orders that
           before any rank reads them. With several hosts the writers first receive rank 0's weights.

Note [shared host weights ordering]: only sharded updates write the copy during training (streaming/shard.py): layer
i's new weights are written by its owner alone (its CPU update in place, or a GPU-side update's copy-back), and every
other rank copies the weights it receives by broadcast back into its host store, which is now the same memory: the
same bytes the owner writes. So
  - no rank reads a layer while its owner changes it: an owner starts writing only after `step_boundary` (at each
    optimizer step, before any update starts), where each rank's copies that read or write the copy (its H2D and D2H
    streams) have finished and every rank of the host has arrived; until a layer's broadcast, the other ranks do not
    read it (they receive it instead of loading it);
  - after the broadcast a rank reads the layer only after its own copy-back (CUDA: its loads wait for that event,
    `WeightStreamer.host_written`; CPU: a plain copy), which stored the owner's bytes, however late the owner's own
    write (a GPU-side update's asynchronous copy-back) lands.
A flush (save, evaluate) on one host needs no broadcast: once every rank's updates have landed (`_flush_local`) a
barrier makes the copy current for all (`ShardedUpdates.resolve`).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import format_bytes
from ..profiling.limits import Limit, ResourceLimitError, check_need, disk_free
from .host_store import register_in_place, unregister
from .nvme import ALIGN

__all__ = ["SHM_DIR", "HostRanks", "host_ranks", "SharedHostWeights", "shared_weights_for", "segment_bytes",
           "check_shm_space", "shm_fix"]

logger = logging.getLogger(__name__)

#: where the shared copy lives: POSIX shared memory (a tmpfs; docker's default is 64 MB, --shm-size sets it)
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class HostRanks:
    """The ranks of the torch.distributed world on this host.

    Attributes:
        ranks: global ranks on this host, ascending (the first one writes the shared copy).
        group: a gloo group of `ranks` (host-side barriers, whatever the world's backend).
        writers: the first rank of every host, ascending (rank 0 first).
        writer_group: a group of `writers` with the world's backend (None: one host).
    """

    ranks: tuple[int, ...]
    group: Any
    writers: tuple[int, ...]
    writer_group: Any = None

    @property
    def writer(self) -> int:
        return self.ranks[0]

    @property
    def one_host(self) -> bool:
        """Every rank of the world is on this host (one copy for all)."""
        return len(self.writers) == 1


def _host_key() -> str:
    """What identifies this machine's /dev/shm: its name and boot id."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def host_ranks() -> HostRanks:
    """Which ranks of the world run on this host (a collective of the world: every rank creates every host's group,
    in the same order, as torch.distributed.new_group requires)."""
    world = dist.get_world_size()
    keys: list[Any] = [None] * world
    # over gloo: an NCCL world's object collectives would need this rank's GPU set as the current device
    dist.all_gather_object(keys, _host_key(), group=dist.new_group(backend="gloo"))
    by_host: dict[str, list[int]] = {}
    for r, k in enumerate(keys):
        by_host.setdefault(k, []).append(r)
    hosts = sorted(by_host.values())
    me = dist.get_rank()
    mine: tuple[tuple[int, ...], Any] | None = None
    for ranks in hosts:
        group = dist.new_group(ranks, backend="gloo")
        if me in ranks:
            mine = (tuple(ranks), group)
    writers = tuple(r[0] for r in hosts)
    writer_group = dist.new_group(list(writers)) if len(writers) > 1 else None
    assert mine is not None
    return HostRanks(mine[0], mine[1], writers, writer_group)


def segment_bytes(sizes: list[dict[torch.dtype, int]]) -> int:
    """Bytes of the shared file for per-layer buffer sizes (dtype -> elements): every buffer starts on a page."""
    return sum(-(-n * dt.itemsize // ALIGN) * ALIGN for s in sizes for dt, n in s.items())


def shm_fix(need_bytes: int, directory: str = SHM_DIR) -> str:
    """How to give the shared copy room, or do without it."""
    size = -(-int(need_bytes * 1.1) // 2**30)
    return (f"a larger {directory} (docker run --shm-size={size}g, docker compose shm_size: {size}gb, Kubernetes: an "
            f"emptyDir volume with medium: Memory mounted at {directory}), or lazytrain_config.dp_host_weights="
            "'per_rank' (each rank its own copy of the weights in its own memory)")


def check_shm_space(need_bytes: int, ranks: int, directory: str = SHM_DIR) -> None:
    """The shared copy (`need_bytes`) against the free space of `directory`.

    Raises:
        ResourceLimitError: not enough room (the need, the limit and its source, the fix).
    """
    usage = shutil.disk_usage(directory)
    lim = Limit(int(usage.free), f"free space of {directory}, the shared-memory file system",
                f"{format_bytes(usage.total)} in all")
    check_need(int(need_bytes), lim, f"the one host copy of the decoder layers' weights that the {ranks} ranks on "
               f"this host share ({directory})", shm_fix(need_bytes, directory))


class SharedHostWeights:
    """The host's one copy of the streamed layers' weights, mapped by each of its ranks (see the module docstring).

    Args:
        host: the ranks of this host (`host_ranks`; two or more).
        pin: page-lock the mapping with cudaHostRegister (CUDA runs); False: pageable (CPU runs).
        directory: the shared-memory file system (`SHM_DIR`).

    Attributes:
        nbytes: bytes of the mapping (every buffer page-aligned); registered_bytes: the part page-locked in place
            by this process (all of it, or 0).
        path: the file, unlinked once every rank of the host has mapped it.
    """

    def __init__(self, host: HostRanks, pin: bool, directory: str = SHM_DIR) -> None:
        if len(host.ranks) < 2:
            raise ValueError(f"a shared host copy needs two or more ranks on the host, but got ranks {host.ranks}")
        self.host = host
        self.pin = pin
        self.directory = directory
        self.nbytes = 0
        self.registered_bytes = 0
        self.path = ""
        self._segment: torch.Tensor | None = None
        self._registered: list[torch.Tensor] = []

    @property
    def ranks(self) -> int:
        """Ranks mapping the copy (every rank of this host)."""
        return len(self.host.ranks)

    @property
    def writes_initial(self) -> bool:
        """This rank fills the copy with its weights (the host's first rank)."""
        return dist.get_rank() == self.host.writer

    def allocate(self, sizes: list[dict[torch.dtype, int]]) -> list[dict[torch.dtype, torch.Tensor]]:
        """Map the copy and carve one flat buffer per layer and dtype (`sizes[i][dtype]` elements each, starting on a
        page). A collective of the host's ranks; every rank passes the same sizes.

        Raises:
            ResourceLimitError: /dev/shm has too little room (the writer checks before anything is allocated and
                tells the others, so every rank raises the same error), or it filled up as the pages were reserved.
            RuntimeError: a rank could not map the writer's file (another /dev/shm: ranks of one machine in
                separate containers).
        """
        total = segment_bytes(sizes)
        fd, status = -1, [None]  # the writer's (file name, error message or None)
        if self.writes_initial:
            fd, path, error = self._create(total)
            status = [(path, error)]
        dist.broadcast_object_list(status, self.host.writer, group=self.host.group)
        path, error = status[0]
        self.path = path
        if error is not None:
            raise ResourceLimitError(error, need_bytes=total, limit=disk_free(self.directory))
        mine = None
        try:
            if fd < 0:
                fd = os.open(path, os.O_RDWR)
            buf = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) if total \
                else None
        except OSError as e:
            mine = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
        finally:
            if fd >= 0:
                os.close(fd)  # the mapping keeps the file's pages
        failed: list[Any] = [None] * self.ranks
        dist.all_gather_object(failed, mine, group=self.host.group)
        if self.writes_initial:
            os.unlink(path)  # every rank has mapped it (or failed): its memory lives as long as a mapping does
        failed = [f for f in failed if f]
        if failed:
            raise RuntimeError(f"LazyTrain: the ranks on this host could not all map the shared copy of the weights "
                               f"({path}): {'; '.join(failed)}. Run them in one container (one {self.directory}), or "
                               "set lazytrain_config.dp_host_weights='per_rank'")
        self.nbytes = total
        self._segment = torch.frombuffer(buf, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
        if self.pin and total:
            if register_in_place(self._segment):
                self._registered.append(self._segment)
                self.registered_bytes = total
            else:
                logger.warning("LazyTrain: cudaHostRegister failed for the shared host copy of the weights (%s): it "
                               "stays pageable, so weight copies run slower", format_bytes(total))
        out, off = [], 0
        for layer in sizes:
            bufs = {}
            for dt, n in layer.items():
                bufs[dt] = self._segment[off:off + n * dt.itemsize].view(dt)
                off += -(-n * dt.itemsize // ALIGN) * ALIGN
            out.append(bufs)
        return out

    def _create(self, total: int) -> tuple[int, str, str | None]:
        """The writer: (open fd or -1, path, error message or None) of a new file of `total` bytes whose pages are
        reserved, after the free-space check."""
        path = os.path.join(self.directory, f"lazytrain-weights-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            check_shm_space(total, self.ranks, self.directory)
        except ResourceLimitError as e:
            return -1, path, str(e)
        fd = -1
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            if total:
                try:
                    os.posix_fallocate(fd, 0, total)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # no fallocate: pages come at first write
                        raise
                    os.ftruncate(fd, total)
            return fd, path, None
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            if os.path.exists(path):
                os.unlink(path)
            return -1, path, (f"LazyTrain: the one host copy of the decoder layers' weights needs "
                              f"{format_bytes(total)} in {self.directory}, but creating it failed ({e}). Fix: "
                              f"{shm_fix(total, self.directory)}.")

    def published(self) -> None:
        """The writer has filled the copy: from here every rank of the host may read it (a barrier of the host)."""
        self.barrier()

    def step_boundary(self, streams: list[Any]) -> None:
        """At an optimizer step, before any owner writes its layers' new weights (Note [shared host weights
        ordering]): this rank's copies that read or write the copy have finished (CUDA: its H2D and D2H `streams`;
        None entries are skipped), then every rank of the host is here."""
        for s in streams:
            if s is not None:
                s.synchronize()
        self.barrier()

    def barrier(self) -> None:
        dist.barrier(group=self.host.group)

    def release(self) -> None:
        """Unregister the page-locked mapping (it stays valid as ordinary memory until its last view goes)."""
        if self._registered:
            unregister(self._registered)
            self.registered_bytes = 0


def shared_weights_for(dp: Any, config: Any, sharded: bool, pin: bool) -> SharedHostWeights | None:
    """The shared host copy this rank's executor uses (`config.dp_host_weights`), or None: one process, copies per
    rank, replicated updates (every rank writes every layer), a process group other than the world, or one rank on
    this host. A collective of the world whenever `dp` is set with sharded updates and sharing is not off."""
    if dp is None or not sharded or config.dp_host_weights == "per_rank" or dp.group is not None:
        return None
    host = host_ranks()
    if config.resolved_dp_host_weights(len(host.ranks)) != "shared":
        if config.dp_host_weights == "shared":
            logger.warning("lazytrain_config.dp_host_weights='shared' has no effect with one rank on this host")
        return None
    return SharedHostWeights(host, pin)
