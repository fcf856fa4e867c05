"""Aligned file I/O for the NVMe activation tier: O_DIRECT where the filesystem allows it, buffered otherwise.

Files hold a tensor's raw bytes padded with zeros to a multiple of `ALIGN` (4096 bytes), the alignment O_DIRECT
needs for the buffer address, the length and the file offset; the caller remembers the true byte count, so any
tensor size round-trips bit-exactly. A filesystem that refuses O_DIRECT (EINVAL at open or at the first write,
e.g. tmpfs) gets buffered I/O, noted once per directory in the log. Every failure removes the file it was writing:
no half-written file stays behind. Short writes or reads raise an OSError naming the file and the byte counts;
a full disk (ENOSPC / EDQUOT) raises one OSError naming the directory and the fix.
"""

from __future__ import annotations

import errno
import logging
import os

import torch

__all__ = ["ALIGN", "aligned_empty", "padded", "read_file", "write_file"]

ALIGN = 4096  # bytes: O_DIRECT buffer, length and offset alignment (covers 512- and 4096-byte sector disks)
CHUNK = 1 << 30  # bytes per pwrite/preadv call (Linux moves at most ~2 GiB per call)
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_log = logging.getLogger(__name__)
_noted_buffered: set[str] = set()


class _DirectRefused(Exception):
    """The filesystem accepted open(O_DIRECT) but refused the aligned write (EINVAL)."""


def padded(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN (bytes)."""
    return -(-nbytes // ALIGN) * ALIGN


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """Uninitialized host uint8 tensor of `padded(nbytes)` bytes whose data pointer is ALIGN-aligned.

    Args:
        nbytes: bytes the caller will use (the tensor is padded up to the alignment).
        pin: allocate page-locked (pinned) memory (needs CUDA).
    """
    n = padded(nbytes)
    raw = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    if raw.data_ptr() % ALIGN == 0:  # pinned blocks are page-aligned: no slack (the host cache rounds to 2^k)
        return raw
    raw = torch.empty(n + ALIGN, dtype=torch.uint8, pin_memory=pin)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + n]


def _note_buffered(directory: str, why: str) -> None:
    key = os.path.realpath(directory)
    if key not in _noted_buffered:
        _noted_buffered.add(key)
        _log.warning("NVMe activation tier: O_DIRECT is not available in %s (%s); using buffered file I/O "
                     "(activations pass through the page cache)", directory, why)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _disk_full(path: str, total: int, done: int, err: OSError) -> OSError:
    d = os.path.dirname(path) or "."
    return OSError(err.errno, f"NVMe activation tier: no space left in {d!r} while writing "
                   f"{os.path.basename(path)} ({done} of {total} bytes written; the file was removed). "
                   "Free space there, point lazytrain_config.nvme_dir at a disk with room, or set a smaller "
                   "lazytrain_config.nvme_budget (or activation_tier='cpu') so fewer activations go to disk.")


def _pwrite_all(fd: int, path: str, mv: memoryview, direct: bool) -> None:
    total, done = len(mv), 0
    while done < total:
        n = min(CHUNK, total - done)
        try:
            w = os.pwrite(fd, mv[done:done + n], done)
        except OSError as e:
            if e.errno in _DISK_FULL:
                raise _disk_full(path, total, done, e) from e
            if direct and done == 0 and e.errno == errno.EINVAL:
                raise _DirectRefused(str(e)) from e
            raise OSError(e.errno, f"NVMe activation tier: writing {path} failed after {done} of {total} bytes: "
                          f"{e.strerror}") from e
        if w != n:
            raise OSError(errno.EIO, f"NVMe activation tier: short write to {path}: {done + w} of {total} bytes "
                          f"written (call asked for {n}, wrote {w}; is {os.path.dirname(path)!r} full?); "
                          "the file was removed")
        done += w


def write_file(path: str, buf: torch.Tensor, nbytes: int, direct: bool) -> bool:
    """Write `buf` (from `aligned_empty(nbytes)`, first `nbytes` bytes meaningful) to a new file `path`.

    Args:
        path: file to create (must not exist).
        buf: ALIGN-aligned contiguous host uint8 tensor of `padded(nbytes)` bytes; its padding is zeroed here.
        nbytes: true byte count of the data.
        direct: try O_DIRECT first.

    Returns:
        True when the file was written with O_DIRECT, False when buffered.

    Raises:
        OSError: disk full (naming the directory and the fix), short write, or any other I/O error; the file
            is removed before raising.
    """
    if buf.numel() != padded(nbytes) or buf.data_ptr() % ALIGN:
        raise ValueError(f"buffer must be {ALIGN}-byte aligned and {padded(nbytes)} bytes long, got "
                         f"{buf.numel()} bytes at address {buf.data_ptr():#x}")
    if buf.numel() > nbytes:
        buf[nbytes:].zero_()
    mv = memoryview(buf.numpy()).cast("B")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    use_direct = direct and hasattr(os, "O_DIRECT")
    while True:
        try:
            fd = os.open(path, flags | (os.O_DIRECT if use_direct else 0), 0o600)
        except OSError as e:
            _remove(path)  # some kernels create the file before refusing O_DIRECT
            if use_direct and e.errno == errno.EINVAL:
                _note_buffered(os.path.dirname(path), "open(O_DIRECT) failed with EINVAL")
                use_direct = False
                continue
            if e.errno in _DISK_FULL:
                raise _disk_full(path, len(mv), 0, e) from e
            raise
        try:
            _pwrite_all(fd, path, mv, use_direct)
            return use_direct
        except _DirectRefused as e:
            _note_buffered(os.path.dirname(path), f"aligned O_DIRECT write failed: {e}")
            use_direct = False
        except BaseException:
            os.close(fd)
            fd = -1
            _remove(path)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        _remove(path)


def read_file(path: str, buf: torch.Tensor, direct: bool) -> None:
    """Fill `buf` (ALIGN-aligned host uint8, the file's padded length) from `path`.

    Args:
        path: a file written by `write_file`.
        buf: destination from `aligned_empty(nbytes)`.
        direct: the file was written with O_DIRECT (read it the same way; falls back to buffered on EINVAL).

    Raises:
        OSError: short read (file shorter than expected), naming the file and the byte counts.
    """
    mv = memoryview(buf.numpy()).cast("B")
    total, done = len(mv), 0
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | os.O_DIRECT) if direct and hasattr(os, "O_DIRECT") else os.open(path, flags)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        fd = os.open(path, flags)
    try:
        while done < total:
            n = min(CHUNK, total - done)
            r = os.preadv(fd, [mv[done:done + n]], done)
            if r != n:
                raise OSError(errno.EIO, f"NVMe activation tier: short read from {path}: {done + r} of {total} "
                              f"bytes read (file truncated or damaged)")
            done += r
    finally:
        os.close(fd)
