"""Machine rates the planner needs: PCIe, NVMe, GEMM throughput, optimizer update rates, memory sizes.

`H200_DEFAULTS` holds the figures measured on the lent H200 machine (benchmarks/NOTES.md, 2026-11-29). `probe()` measures
the same quantities on the CUDA device in use (pinned copies timed with CUDA events, a bf16 GEMM, a disk write and
read of a temporary file) and caches the result per machine fingerprint in
``~/.cache/lazytrain_hf/hardware-<fingerprint>.json`` (directory overridable with ``LAZYTRAIN_CACHE_DIR``). On a
machine without CUDA it returns the defaults marked ``measured=False``. The optimizer update rates are timed with
`optimizer_rate` (the Hybrid8bitOptimizer's own kernels: the C++ CPU kernel on this process's CPU threads, and
the fused Triton kernel on the GPU, or bitsandbytes' where Triton is missing) unless passed in.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["HardwareProfile", "H200_DEFAULTS", "probe", "machine_fingerprint", "cache_dir", "optimizer_rate"]

MIB = 1024**2
GIB = 1024**3


@dataclass
class HardwareProfile:
    """Rates and sizes of one machine.

    Attributes:
        h2d_gbps: pinned host-to-device copy bandwidth, alone (GB/s, 1 GB = 1e9 bytes).
        d2h_gbps: pinned device-to-host copy bandwidth, alone (GB/s).
        bidir_gbps: bandwidth of each direction while both copy at once (GB/s, each way).
        nvme_read_gbps, nvme_write_gbps: disk bandwidth of the NVMe activation tier's directory (GB/s).
        gpu_tflops: dense bf16 GEMM throughput (TFLOP/s, 8192^3 matmul).
        cpu_optim_params_per_s: optimizer update rate on the CPU (parameters/s, all cores).
        gpu_optim_params_per_s: optimizer update rate on the GPU (parameters/s), transfers excluded.
        gpu_memory_bytes: total device memory (bytes).
        host_memory_bytes: total host RAM (bytes).
        measured: True when probed on this machine; False for defaults.
        source: where the numbers come from (free text).
        device_name: the GPU's name ("" for defaults).
        notes: per-field remarks (which fields were not measured and why).
    """

    h2d_gbps: float
    d2h_gbps: float
    bidir_gbps: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    gpu_tflops: float
    cpu_optim_params_per_s: float
    gpu_optim_params_per_s: float
    gpu_memory_bytes: int
    host_memory_bytes: int
    measured: bool = False
    source: str = ""
    device_name: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        """The profile of a probe's JSON object (unknown keys ignored).

        Raises:
            ValueError: not an object, required keys missing, or a rate / size that is not a number > 0 (one
                message naming every such key).
        """
        if not isinstance(d, dict):
            raise ValueError(f"a hardware profile is a JSON object of rates and sizes (as lazytrain_hf.profiling."
                             f"probe writes), but got a {type(d).__name__}")
        fields = dataclasses.fields(cls)
        required = [f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        problems = []
        missing = [k for k in required if k not in d]
        if missing:
            problems.append(f"missing keys {missing}")
        bad = [k for k in required if k in d and not _positive(d[k], allow_zero=k.startswith("nvme_"))]
        if bad:
            problems.append(f"not numbers > 0: {', '.join(f'{k}={d[k]!r}' for k in bad)}")
        if problems:
            raise ValueError(f"invalid hardware profile: {'; '.join(problems)}")
        known = {f.name for f in fields}
        return cls(**{k: v for k, v in d.items() if k in known})

    def planner_rates(self) -> dict[str, float]:
        """The `CostModel` rate fields (GB/s, params/s)."""
        return {"h2d_gbps": self.h2d_gbps, "d2h_gbps": self.d2h_gbps, "bidir_gbps": self.bidir_gbps,
                "nvme_read_gbps": self.nvme_read_gbps, "nvme_write_gbps": self.nvme_write_gbps,
                "cpu_optim_params_per_s": self.cpu_optim_params_per_s,
                "gpu_optim_params_per_s": self.gpu_optim_params_per_s}


def _positive(x: Any, allow_zero: bool = False) -> bool:
    """A finite number > 0 (>= 0 with `allow_zero`: a probe without an NVMe directory)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return False
    return x >= 0 if allow_zero else x > 0


#: One H200 and its host, measured 2026-11-29 (benchmarks/NOTES.md): pinned H2D 50.8 GB/s, D2H 54.1 GB/s, about 33 GB/s
#: each way when both run; bf16 GEMM 8192^3 787 TFLOPS; virtual disk with O_DIRECT write 1.0 GB/s, read 1.5 GB/s.
#: Optimizer rates measured 2026-11-30: Hybrid8 with Kahan master weights on the GPU through the fused Triton
#: kernel 70 G params/s (64 Mi params); on the 16 cores through the C++ kernel 3.6 G params/s inside training steps
#: (its dynamic chunks; 3.7-3.9 alone). Memory: 143,771 MiB GPU, 128 GiB host. A probe there (2026-11-29) read
#: H2D 55.0, D2H 54.8 GB/s, 49.5 GB/s each way when both ran (256 MiB copies on two streams), 791 TFLOPS; these
#: defaults keep the more conservative 33 GB/s.
H200_DEFAULTS = HardwareProfile(
    h2d_gbps=50.8, d2h_gbps=54.1, bidir_gbps=33.0, nvme_read_gbps=1.5, nvme_write_gbps=1.0, gpu_tflops=787.0,
    cpu_optim_params_per_s=3.6e9, gpu_optim_params_per_s=70.0e9, gpu_memory_bytes=143_771 * MIB,
    host_memory_bytes=128 * GIB, measured=False, source="H200 machine figures, 2026-11-29/30 (benchmarks/NOTES.md)",
    device_name="NVIDIA H200 (defaults)")


def cache_dir() -> Path:
    """Directory of cached probes: ``$LAZYTRAIN_CACHE_DIR`` or ``~/.cache/lazytrain_hf``."""
    from .. import envvars

    return envvars.read("LAZYTRAIN_CACHE_DIR") or Path.home() / ".cache" / "lazytrain_hf"


def machine_fingerprint(device: Any = "cuda", nvme_dir: str | os.PathLike | None = None) -> str:
    """16-hex-digit hash of what the probe's numbers depend on: GPU name and memory, CUDA and torch versions,
    host name, CPU count, RAM and the NVMe directory."""
    import torch

    from ..config import cpu_threads

    # cpu_threads: the CPU optimizer rate depends on the cores this process may use (taskset, ranks per host)
    parts: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "cpu_threads": cpu_threads(),
                             "ram": _host_memory_bytes(),
                             "torch": torch.__version__, "nvme_dir": str(Path(nvme_dir).resolve()) if nvme_dir else None}
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(dev)
        parts.update(gpu=props.name, gpu_mem=props.total_memory, cuda=torch.version.cuda)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def probe(device: Any = "cuda", nvme_dir: str | os.PathLike | None = None, *, refresh: bool = False,
          cpu_optim_params_per_s: float | None = None, gpu_optim_params_per_s: float | None = None,
          copy_bytes: int = 256 * MIB, disk_bytes: int = 256 * MIB) -> HardwareProfile:
    """Measure this machine's rates (or load them from the cache).

    Args:
        device: the CUDA device to probe ("cuda", "cuda:1", torch.device). A CPU device, or no CUDA: defaults.
        nvme_dir: directory of the NVMe activation tier; its disk is measured with a temporary file (removed).
            None: NVMe rates keep the defaults.
        refresh: measure again even when a cached probe exists.
        cpu_optim_params_per_s, gpu_optim_params_per_s: optimizer update rates to record (params/s); None times
            them with `optimizer_rate`.
        copy_bytes: size of each timed pinned copy (bytes).
        disk_bytes: size of the temporary file (bytes).

    Returns:
        A `HardwareProfile`, `measured=True` when it came from this machine's GPU.
    """
    import torch

    dev = torch.device(device)
    overrides = {k: v for k, v in (("cpu_optim_params_per_s", cpu_optim_params_per_s),
                                   ("gpu_optim_params_per_s", gpu_optim_params_per_s)) if v is not None}
    if dev.type != "cuda" or not torch.cuda.is_available():
        return dataclasses.replace(H200_DEFAULTS, **overrides, measured=False,
                                   source=H200_DEFAULTS.source + " (no CUDA device here: defaults)")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    fp = machine_fingerprint(dev, nvme_dir)
    path = cache_dir() / f"hardware-{fp}.json"
    if path.is_file() and not refresh:
        try:
            return dataclasses.replace(HardwareProfile.from_dict(json.loads(path.read_text())), **overrides)
        except (ValueError, TypeError):
            pass  # a corrupt cache entry: measure again
    prof = _measure(dev, nvme_dir, copy_bytes, disk_bytes)
    prof = dataclasses.replace(prof, **overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(prof.to_dict(), indent=1))
    tmp.replace(path)
    return prof


def _measure(dev: Any, nvme_dir: str | os.PathLike | None, copy_bytes: int, disk_bytes: int) -> HardwareProfile:
    import torch

    torch.cuda.set_device(dev)
    props = torch.cuda.get_device_properties(dev)
    notes: dict[str, str] = {}
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    gpu2 = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    h2d = _copy_gbps(gpu, host, copy_bytes)
    d2h = _copy_gbps(host, gpu, copy_bytes)
    bidir = _bidir_gbps(host, gpu, host2, gpu2, copy_bytes)
    del host, host2, gpu, gpu2
    torch.cuda.synchronize(dev)
    if hasattr(torch._C, "_host_emptyCache"):  # the probe's pinned blocks would stay cached, page-locked, for good
        torch._C._host_emptyCache()
    tflops = _gemm_tflops(dev)
    nvme_r, nvme_w = H200_DEFAULTS.nvme_read_gbps, H200_DEFAULTS.nvme_write_gbps
    if nvme_dir is not None:
        nvme_w, nvme_r = _disk_gbps(Path(nvme_dir), disk_bytes)
    else:
        notes["nvme"] = "default (no nvme_dir given)"
    return HardwareProfile(h2d_gbps=h2d, d2h_gbps=d2h, bidir_gbps=bidir, nvme_read_gbps=nvme_r,
                           nvme_write_gbps=nvme_w, gpu_tflops=tflops,
                           cpu_optim_params_per_s=_rate_or_default("cpu", "cpu_optim_params_per_s", notes),
                           gpu_optim_params_per_s=_rate_or_default(dev, "gpu_optim_params_per_s", notes),
                           gpu_memory_bytes=int(props.total_memory), host_memory_bytes=_host_memory_bytes(),
                           measured=True, source=f"probe {time.strftime('%Y-%m-%d')}", device_name=props.name,
                           notes=notes)


def optimizer_rate(device: Any = "cpu", numel: int = 2**26, steps: int = 3, master_weights: str = "kahan",
                   state_dtype: str = "8bit") -> float:
    """Parameters per second of one Hybrid8bitOptimizer AdamW update on `device` (median of `steps` timed steps
    after one warm-up): a bf16 parameter of `numel` elements (default 2^26: ~0.5 GB of weight, gradient, states
    and master buffers) with 8-bit blockwise states and Kahan-compensated bf16 master weights, as a streamed
    decoder layer is updated (CPU: the C++ kernel on `lazytrain_hf.config.cpu_threads()` threads, else the torch
    fallback; CUDA: the fused Triton kernel where triton imports, else bitsandbytes'). The planner's cost model divides a layer's parameter
    count by this rate."""
    import torch

    from ..optim import Hybrid8bitOptimizer

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((0.02 * torch.randn(numel, generator=gen)).to(torch.bfloat16).to(dev))
    p.grad = (1e-3 * torch.randn(numel, generator=gen)).to(torch.bfloat16).to(dev)
    opt = Hybrid8bitOptimizer([p], lr=1e-5, state_dtype=state_dtype, master_weights=master_weights)
    times = []
    for step in range(steps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if step:
            times.append(time.perf_counter() - t0)
    times.sort()
    return numel / times[len(times) // 2]


def _rate_or_default(device: Any, key: str, notes: dict[str, str]) -> float:
    try:
        return optimizer_rate(device)
    except Exception as e:  # a missing compiler or bitsandbytes build: plan with the H200 figure, say so
        notes[key] = f"default (timing failed: {type(e).__name__}: {e})"[:300]
        return getattr(H200_DEFAULTS, key)


def _copy_gbps(dst: Any, src: Any, nbytes: int, reps: int = 10) -> float:
    """GB/s of an async `dst.copy_(src)` on the current stream, timed with CUDA events (median of `reps`)."""
    import torch

    def copy() -> None:
        dst.copy_(src, non_blocking=True)

    for _ in range(2):
        copy()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        copy()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))  # ms
    times.sort()
    return nbytes / (times[len(times) // 2] * 1e6)


def _bidir_gbps(host: Any, gpu: Any, host2: Any, gpu2: Any, nbytes: int, reps: int = 5) -> float:
    """Per-direction GB/s while an H2D and a D2H copy of `nbytes` run at once on two streams."""
    import torch

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    times = []
    for rep in range(reps + 1):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        s1.wait_event(start)
        s2.wait_event(start)
        with torch.cuda.stream(s1):
            gpu.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(gpu2, non_blocking=True)
        e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e1.record(s1)
        e2.record(s2)
        torch.cuda.synchronize()
        if rep:  # the first round is a warm-up
            times.append(max(start.elapsed_time(e1), start.elapsed_time(e2)))
    times.sort()
    return nbytes / (times[len(times) // 2] * 1e6)


def _gemm_tflops(dev: Any, n: int = 8192, reps: int = 10) -> float:
    """bf16 n^3 matmul throughput (TFLOP/s = 2 n^3 / time)."""
    import torch

    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) * 1e9)


def _disk_gbps(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write GB/s, read GB/s) of a temporary file in `directory`: O_DIRECT when the file system allows it
    (page cache bypassed, as the NVMe tier does), else buffered with fsync and a cache drop before reading."""
    directory.mkdir(parents=True, exist_ok=True)
    block = 16 * MIB
    nbytes = max(block, nbytes // block * block)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT requires
    buf.write(os.urandom(1024) * (block // 1024))
    fd_tmp, name = tempfile.mkstemp(prefix="lazytrain-probe-", dir=directory)
    os.close(fd_tmp)
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | direct)
        except OSError:
            direct = 0
            fd = os.open(name, os.O_WRONLY)
        t0 = time.perf_counter()
        try:
            for _ in range(nbytes // block):
                os.write(fd, buf)
        except OSError:  # O_DIRECT refused at write time: fall back to buffered I/O
            os.close(fd)
            direct = 0
            fd = os.open(name, os.O_WRONLY | os.O_TRUNC)
            t0 = time.perf_counter()
            for _ in range(nbytes // block):
                os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        fd = os.open(name, os.O_RDONLY | direct)
        if not direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for _ in range(nbytes // block):
            os.readv(fd, [buf])
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        os.unlink(name)
        buf.close()
    return nbytes / (write_s * 1e9), nbytes / (read_s * 1e9)


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return H200_DEFAULTS.host_memory_bytes
