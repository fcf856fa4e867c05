"""The resource limits a process really has: host memory (cgroup v2 / v1 limits, the memory other processes use),
page-locked memory (RLIMIT_MEMLOCK) and free disk space, each with where it came from.

A container's limit is not what `psutil.virtual_memory().total` reports (that is the host's RAM): a plan sized from
the host's RAM gets the process killed by the kernel's out-of-memory killer, with nothing saved. The cgroup tree is
read under `cgroup_root()` (``LAZYTRAIN_CGROUP_ROOT``, default /sys/fs/cgroup), the process's own cgroup from
/proc/self/cgroup.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..config import format_bytes

__all__ = ["Limit", "ResourceLimitError", "cgroup_root", "cgroup_limits", "host_memory_limit", "memlock_limit",
           "disk_free", "check_need"]

#: cgroup v1 reports "no limit" as a huge page-aligned number (2^63 - 4096 on x86-64)
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Limit:
    """A limit in bytes and where it came from (e.g. "cgroup v2 memory.max at /sys/fs/cgroup/memory.max")."""

    bytes: int
    source: str
    detail: str = ""

    def describe(self) -> str:
        """"24.00 GiB (cgroup v2 memory.max at ...; detail)"."""
        return f"{format_bytes(self.bytes)} ({self.source}{'; ' + self.detail if self.detail else ''})"


class ResourceLimitError(ValueError):
    """A run needs more of a resource (host memory, disk space) than the process has: the need, the limit (and
    where it came from) and the fix, in one message."""

    def __init__(self, message: str, *, need_bytes: int, limit: Limit) -> None:
        super().__init__(message)
        self.need_bytes = int(need_bytes)
        self.limit = limit


def cgroup_root() -> Path:
    """The cgroup filesystem's mount point: ``LAZYTRAIN_CGROUP_ROOT`` (tests point it at a directory tree), else
    /sys/fs/cgroup."""
    from ..envvars import read

    return Path(read("LAZYTRAIN_CGROUP_ROOT") or "/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _stat(path: Path, *keys: str) -> int:
    """The first of `keys` in a memory.stat file (0 when absent)."""
    found: dict[str, int] = {}
    for line in (_read(path) or "").splitlines():
        k, _, v = line.partition(" ")
        if k in keys and _int(v) is not None:
            found[k] = int(v)
    return next((found[k] for k in keys if k in found), 0)


def _own_cgroups(proc_cgroup: str | os.PathLike) -> tuple[str | None, str | None]:
    """(cgroup v2 path, cgroup v1 memory controller path) of this process from /proc/self/cgroup."""
    v2 = v1 = None
    for line in (_read(Path(proc_cgroup)) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _up(base: Path, rel: str | None) -> list[Path]:
    """`base`/`rel` and each of its parents up to `base` (the effective limit is the smallest on the way up; in a
    container the process's cgroup is often the mount's top)."""
    out = [base]
    if rel:
        parts = [p for p in rel.strip("/").split("/") if p]
        out = [base.joinpath(*parts[:i]) for i in range(len(parts), 0, -1)] + [base]
    return [p for p in out if p.is_dir()]


def cgroup_limits(root: str | os.PathLike | None = None, proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                  own_rss: int = 0) -> list[Limit]:
    """Memory limits of this process's cgroups (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, in its cgroup and
    every parent), each less what others in that cgroup use: its usage (``memory.current`` /
    ``memory.usage_in_bytes``) less page cache (reclaimable) and less `own_rss` (this process's, already counted
    by the caller's plan). Unlimited cgroups give nothing."""
    base = Path(root) if root is not None else cgroup_root()
    v2, v1 = _own_cgroups(proc_cgroup)
    out: list[Limit] = []
    dirs = [(d, "v2", "memory.max", "memory.current", ("file",)) for d in _up(base, v2)]
    dirs += [(d, "v1", "memory.limit_in_bytes", "memory.usage_in_bytes", ("total_cache", "cache"))
             for d in _up(base / "memory", v1)]
    for d, version, limit_name, usage_name, cache_keys in dirs:
        limit = _int(_read(d / limit_name))  # "max" (v2 unlimited) is no int
        if limit is None or limit >= _V1_UNLIMITED:
            continue
        usage = _int(_read(d / usage_name))
        others = 0
        if usage is not None:
            others = max(0, usage - _stat(d / "memory.stat", *cache_keys) - int(own_rss))
        detail = f"{format_bytes(limit)} limit, {format_bytes(others)} used by other processes of the cgroup" \
            if usage is not None else ""
        out.append(Limit(max(0, limit - others), f"cgroup {version} {limit_name} at {d / limit_name}", detail))
    return out


def _own_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def host_memory_limit(root: str | os.PathLike | None = None, proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                      own_rss: int | None = None) -> Limit:
    """The host memory this process may use in all: the smallest of its cgroup limits (`cgroup_limits`) and the
    memory available now (``psutil.virtual_memory().available``) plus what this process already holds (its
    resident set: the loaded model is part of what a plan counts)."""
    import psutil

    rss = _own_rss() if own_rss is None else int(own_rss)
    vm = psutil.virtual_memory()
    free = Limit(min(int(vm.total), int(vm.available) + rss), "memory available now (psutil available plus this "
                 "process's resident set)", f"{format_bytes(vm.total)} RAM, {format_bytes(vm.available)} available, "
                 f"{format_bytes(rss)} held by this process")
    return min([free, *cgroup_limits(root, proc_cgroup, rss)], key=lambda lim: lim.bytes)


def memlock_limit() -> Limit | None:
    """RLIMIT_MEMLOCK's soft limit (None: unlimited, or no such limit on this platform). It bounds mlock(); the
    CUDA driver's page-locking (cudaHostAlloc, cudaHostRegister) does not go through it."""
    try:
        import resource
    except ImportError:
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return None
    return Limit(int(soft), "RLIMIT_MEMLOCK (ulimit -l)")


def disk_free(path: str | os.PathLike) -> Limit:
    """Free bytes on the filesystem of `path` (its nearest existing parent when it does not exist yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    usage = shutil.disk_usage(p)
    return Limit(int(usage.free), f"free space on the disk of {str(p)!r}",
                 f"{format_bytes(usage.total)} disk")


def check_need(need_bytes: int, limit: Limit, what: str, fix: str) -> None:
    """Raise `ResourceLimitError` when `need_bytes` is above `limit`: "<what> needs N; <limit> ... Fix: <fix>".

    Raises:
        ResourceLimitError: need above the limit.
    """
    if need_bytes > limit.bytes:
        raise ResourceLimitError(f"LazyTrain: {what} needs {format_bytes(need_bytes)}, but this process has "
                                 f"{limit.describe()}. Fix: {fix}.", need_bytes=need_bytes, limit=limit)
