"""ActivationStash tiers: bit-exact round trips (NVMe with O_DIRECT and buffered), disk-full and short-I/O errors."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

from lazytrain_hf.streaming import nvme
from lazytrain_hf.streaming.tiers import ActivationStash
from tests.conftest import requires_cuda

SIZES = [1, 511, 4097, 14_412_000]
DTYPES = [torch.bfloat16, torch.float32]
CPU = torch.device("cpu")


def _bits(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """n elements with random bit patterns (NaN payloads, infinities and subnormals included)."""
    g = torch.Generator().manual_seed(seed)
    ibits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    info = torch.iinfo(ibits)
    return torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(ibits).view(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ibits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ibits), b.view(ibits))


def _direct_supported(d: str) -> bool:
    try:
        fd = os.open(os.path.join(d, "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(d, "probe"))
    return True


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_nvme_round_trip_bit_exact(tmp_path, n, dtype, mode):
    stash = ActivationStash(CPU, str(tmp_path), o_direct=mode == "direct")
    x = _bits(n, dtype)
    h = x.view(1, 1, n) if n % 7 else x.view(1, 7, n // 7)
    stash.put(3, h, "nvme")
    written_direct = stash.entries[3].write.result()
    assert written_direct == (mode == "direct" and _direct_supported(str(tmp_path)))
    files = os.listdir(tmp_path)
    assert len(files) == 1 and os.path.getsize(tmp_path / files[0]) == nvme.padded(n * x.element_size())
    y = stash.get(3)
    assert _same_bits(y, h)
    assert os.listdir(tmp_path) == []
    assert stash.bytes_by_tier["nvme"] == stash.d2h_bytes == stash.h2d_bytes == n * x.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("tier", ["gpu", "cpu"])
def test_other_tiers_round_trip(tier, dtype):
    stash = ActivationStash(CPU)
    for n in SIZES:
        h = _bits(n, dtype, seed=n).view(1, 1, n)
        stash.put(n, h, tier)
        assert _same_bits(stash.get(n), h)


def test_buffered_fallback_when_o_direct_refused(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(nvme, "_noted_buffered", set())
    stash = ActivationStash(CPU, str(tmp_path))
    xs = {i: _bits(4097, torch.bfloat16, seed=i).view(1, 17, 241) for i in range(3)}
    with caplog.at_level(logging.WARNING, logger=nvme.__name__):
        for i, x in xs.items():
            stash.put(i, x, "nvme")
        stash.flush()
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "O_DIRECT" in caplog.records[0].getMessage() and len(caplog.records) == 1
    assert all(stash.entries[i].write.result() is False for i in xs)
    for i in reversed(xs):
        assert _same_bits(stash.get(i), xs[i])
    assert os.listdir(tmp_path) == []


def test_read_ahead_and_clear(tmp_path):
    stash = ActivationStash(CPU, str(tmp_path))
    xs = {i: _bits(511, torch.float32, seed=i).view(1, 1, 511) for i in range(4)}
    for i, x in xs.items():
        stash.put(i, x, "cpu" if i == 2 else "nvme")
    assert _same_bits(stash.get(3), xs[3])
    assert stash.entries[1].read is not None  # next NVMe boundary below 3 is being read ahead (2 is on the CPU)
    assert stash.entries[0].read is None
    assert _same_bits(stash.get(2), xs[2]) and _same_bits(stash.get(1), xs[1])
    assert stash.entries[0].read is not None
    stash.clear()
    assert os.listdir(tmp_path) == [] and stash.entries == {}


@pytest.mark.parametrize("mode", ["direct", "buffered"])
@pytest.mark.parametrize("failure", ["enospc", "short", "enospc-midway"])
def test_full_disk_clear_error_and_no_file(tmp_path, monkeypatch, mode, failure):
    real_pwrite = os.pwrite
    calls = []

    def full(fd, data, offset):
        calls.append(len(data))
        if failure == "short":
            return real_pwrite(fd, data[:len(data) // 2], offset)
        if failure == "enospc-midway" and len(calls) == 1:
            return real_pwrite(fd, data, offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(nvme, "CHUNK", 8192)  # several calls per file so a failure can come mid-way
    monkeypatch.setattr(os, "pwrite", full)
    stash = ActivationStash(CPU, str(tmp_path), o_direct=mode == "direct")
    stash.put(0, _bits(14_412, torch.bfloat16).view(1, 1, -1), "nvme")
    with pytest.raises(OSError) as info:
        stash.get(0)
    msg = str(info.value)
    if failure == "short":
        assert "short write" in msg and "of 32768 bytes" in msg and "boundary0-" in msg
    else:
        assert info.value.errno == errno.ENOSPC
        assert str(tmp_path) in msg and "nvme_dir" in msg and "nvme_budget" in msg
        assert ("8192 of 32768" if failure == "enospc-midway" else "0 of 32768") in msg
    assert os.listdir(tmp_path) == []


def test_write_error_raised_at_next_put(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    stash = ActivationStash(CPU, str(tmp_path), max_pending_writes=1)
    x = _bits(100, torch.float32).view(1, 1, 100)
    stash.put(0, x, "nvme")
    with pytest.raises(OSError, match="no space left"):
        stash.put(1, x, "nvme")
    assert 0 not in stash.entries
    stash.clear()
    assert os.listdir(tmp_path) == []


def test_short_read_names_file(tmp_path):
    stash = ActivationStash(CPU, str(tmp_path))
    stash.put(0, _bits(5000, torch.float32).view(1, 1, -1), "nvme")
    stash.flush()
    path = stash.entries[0].path
    os.truncate(path, 4096)
    with pytest.raises(OSError, match=r"short read from .*boundary0-.*: 4096 of 20480 bytes"):
        stash.get(0)
    assert not os.path.exists(path)


def test_nvme_needs_dir():
    with pytest.raises(ValueError, match="nvme_dir"):
        ActivationStash(CPU).put(0, torch.zeros(1, 1, 4), "nvme")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["gpu", "cpu", "nvme"])
def test_cuda_round_trip(tmp_path, tier):
    dev = torch.device("cuda")
    stash = ActivationStash(dev, str(tmp_path))
    xs = {i: _bits(n, torch.bfloat16, seed=i).view(1, 1, n).to(dev) for i, n in enumerate(SIZES)}
    for i, x in xs.items():
        stash.put(i, x, tier)
    for i in reversed(xs):
        assert _same_bits(stash.get(i).cpu(), xs[i].cpu())
    stash.clear()
    assert os.listdir(tmp_path) == []


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_cuda_offload_frees_device_memory(tmp_path, tier):
    """An offloaded boundary must leave the GPU when forward drops it (it once stayed until backward read it: a
    24 GiB plan with CPU-tier boundaries ran out of memory at batch 64)."""
    dev = torch.device("cuda")
    stash = ActivationStash(dev, str(tmp_path))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    for i in range(4):
        h = torch.randn(64, 1024, 256, device=dev, dtype=torch.bfloat16)  # 32 MiB each
        stash.put(i, h, tier)
        del h
    torch.cuda.synchronize()
    probe = torch.empty(1, device=dev)  # an allocation makes the allocator retire blocks whose streams finished
    assert torch.cuda.memory_allocated(dev) - before < 2**20, "offloaded boundaries still held on the GPU"
    del probe
    assert stash.get(3).shape == (64, 1024, 256)
    stash.clear()


@requires_cuda
@pytest.mark.gpu
def test_cuda_cpu_tier_fetches_the_next_boundary_ahead_off_the_compute_stream(tmp_path):
    """get(i) starts the H2D copy of the next CPU-tier boundary backward needs on the stash's own stream: it
    completes while the compute stream is still busy, and every boundary comes back bit-exact, whatever the tiers
    between them."""
    dev = torch.device("cuda")
    stash = ActivationStash(dev, str(tmp_path))
    tiers = ["cpu", "gpu", "cpu", "nvme", "cpu"]
    xs = {i: _bits(4096, torch.bfloat16, seed=i).view(1, 4, 1024).to(dev) for i in range(len(tiers))}
    for i, x in xs.items():
        stash.put(i, x, tiers[i])
    torch.cuda.synchronize()
    got = {4: stash.get(4)}
    ahead = stash.entries[2]
    assert ahead.device_copy is not None and ahead.tensor is None  # fetched ahead, its host buffer given back
    torch.cuda._sleep(2_000_000_000)  # the compute stream busy for about a second
    ahead.fetched.synchronize()
    assert not torch.cuda.current_stream(dev).query(), "the fetch-ahead waited for the compute stream"
    for i in (3, 2, 1, 0):
        got[i] = stash.get(i)
    for i, x in xs.items():
        assert _same_bits(got[i].cpu(), x.cpu()), i
    stash.clear()


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 4097, 1 << 20])
def test_aligned_empty(nbytes):
    buf = nvme.aligned_empty(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nvme.padded(nbytes) and buf.data_ptr() % nvme.ALIGN == 0
    assert nvme.padded(nbytes) % nvme.ALIGN == 0 and 0 <= nvme.padded(nbytes) - nbytes < nvme.ALIGN
