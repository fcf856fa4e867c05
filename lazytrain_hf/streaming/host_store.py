"""Host parameter store: each decoder layer's parameters in contiguous (pinned) host buffers.

The module's parameters are re-pointed as views into the buffers, so host RAM holds one copy of the weights, not
two, and `save_pretrained` / the optimizer see the same bytes the executor streams. Gradients live beside the
weights in fp32 host buffers (accumulated across gradient-accumulation micro-batches in fp32). Data-parallel ranks of
one host may map one copy of the weights instead of one each (streaming/shared_host.py); gradients stay per process.
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from .nvme import ALIGN, aligned_empty, padded
from .quant import keep_packing, quant_key, quant_tensors, set_quant_tensor

if TYPE_CHECKING:
    from .shared_host import SharedHostWeights

__all__ = ["ParamSpec", "LayerBuffers", "LayerLayout", "layer_layout", "HostParamStore", "HostBufferPool",
           "PinnedArena", "structure_key", "page_exclusive_empty", "pin_tensor", "register_in_place", "unregister",
           "Registrations", "host_allocator_bytes", "sq_norm"]

logger = logging.getLogger(__name__)


#: elements per slice of `sq_norm`: a reduction that upcasts its input holds at most this many fp32 elements
SQ_NORM_SLICE = 1 << 24


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm as an fp64 scalar on t's device, reduced in at least fp32, over slices of `SQ_NORM_SLICE`
    elements: whether the reduction casts a bf16 input on the fly or into a temporary, no more than one slice is
    ever upcast (a whole 248k x 5120 LM-head gradient would be a 5 GB fp32 temporary)."""
    dtype = torch.promote_types(t.dtype, torch.float32)
    flat = t.reshape(-1)
    if flat.numel() <= SQ_NORM_SLICE:
        return torch.linalg.vector_norm(flat, dtype=dtype).double().square()
    parts = [torch.linalg.vector_norm(s, dtype=dtype).double().square() for s in flat.split(SQ_NORM_SLICE)]
    return torch.stack(parts).sum()


@dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives inside its layer's flat buffer of dtype `dtype` (offsets in elements); with
    `quant`, the tensor at that path of the parameter's 4-bit quantization state (streaming/quant.py)."""

    name: str
    dtype: torch.dtype
    offset: int
    numel: int
    shape: tuple[int, ...]
    quant: str = ""


@dataclass
class LayerBuffers:
    """One decoder layer's host memory.

    Attributes:
        weights: dtype -> flat 1-D tensor holding every parameter of that dtype (pinned when CUDA is used).
        grads: dtype -> flat 1-D gradient buffer, same length as `weights[dtype]`: fp32 (accumulators) or the
            parameter dtype (`grad_dtype="param"`: no accumulation, the autograd gradient as is).
        specs: one ParamSpec per streamed parameter, in `named_parameters()` order.
        frozen: the layer has parameters with requires_grad=False (Note [frozen layers]): only those are streamed
            (read-only: `grads` is empty), its trainable parameters stay on the compute device (`resident`).
        resident: a frozen layer's trainable parameters, (name, parameter) in `named_parameters()` order.
        quant: the quantization-state tensors of the layer's 4-bit weights (`ParamSpec.quant`), stored after the
            parameters in the same flat buffers: streamed with the packed weights, never written back.
    """

    weights: dict[torch.dtype, torch.Tensor]
    grads: dict[torch.dtype, torch.Tensor]
    specs: list[ParamSpec]
    frozen: bool = False
    resident: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    quant: list[ParamSpec] = field(default_factory=list)

    @property
    def param_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    @property
    def grad_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.grads.values())


def structure_key(layer: nn.Module, layer_type: str | None = None) -> tuple:
    """Hashable description of a layer's structure: layers with equal keys can share GPU templates/slots."""
    mods = tuple(type(m).__name__ for m in layer.modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    return (type(layer).__name__, layer_type, mods, params, quant_key(layer))


def page_exclusive_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """`numel` zero-filled host elements of `dtype` in pages of their own: an anonymous private mapping (mmap),
    so the tensor's storage starts on a page and no other allocation shares its pages.

    Why: cudaHostRegister locks whole pages. Two ordinary (64-byte aligned, heap) allocations can share a page, and
    registering the second fails with cudaErrorHostMemoryAlreadyRegistered, an error the CUDA runtime keeps as the
    thread's last error, so the next kernel launch check raises it at an unrelated call (seen on the H200: every
    GPU test after the first collision failed). The storage starting on the page also keeps `is_pinned()` (which
    reads the storage's first byte) true once registered.
    """
    size = torch.empty((), dtype=dtype).element_size()
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    buf = mmap.mmap(-1, padded(numel * size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype, count=numel)


def _clear_cuda_error() -> None:
    """Reset the calling thread's CUDA runtime error after a cudart call that failed: launch a tiny kernel, whose
    launch check reads (and so clears) the last error (c10's `C10_CUDA_KERNEL_LAUNCH_CHECK`). Without this the
    failed call's error resurfaces at the next unrelated kernel."""
    try:
        torch.empty(1, device=torch.device("cuda", torch.cuda.current_device())).zero_()
    except RuntimeError:  # pragma: no cover - CUDA only: the stale error, now cleared
        pass


def register_in_place(t: torch.Tensor) -> bool:
    """Page-lock `t`'s memory where it is with cudaHostRegister (its start page-aligned, its pages its own); True
    when cudaHostRegister returned 0. A failure clears CUDA's last error (`_clear_cuda_error`) and leaves `t`
    pageable."""
    try:
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))
    except Exception as e:  # pragma: no cover - CUDA only
        rc = -1
        logger.debug("cudaHostRegister raised %s", e)
    if rc > 0:
        _clear_cuda_error()
    if rc != 0:
        logger.debug("cudaHostRegister returned %s", rc)
    return rc == 0


def pin_tensor(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Page-lock `t`'s memory in place with cudaHostRegister (exact size: no power-of-two rounding of the caching
    host allocator). `t` must come from `page_exclusive_empty`: any other tensor (its start not page-aligned) is
    copied into pinned memory instead, since registering it could lock pages it shares with its neighbours. Where
    registration fails, the copy too (page-aligned, so O_DIRECT buffers stay usable). Success is cudaHostRegister's
    return code. Returns (tensor, registered_in_place)."""
    if t.numel() == 0:
        return t, False
    if t.data_ptr() % ALIGN == 0:
        if register_in_place(t):
            return t, True
        logger.debug("using a pinned copy")
    nbytes = t.numel() * t.element_size()
    copy = aligned_empty(nbytes, pin=True)[:nbytes].view(t.dtype).view(t.shape)
    return copy.copy_(t), False


def host_allocator_bytes() -> int:
    """Bytes PyTorch's caching host allocator holds page-locked (`pin_memory=True` blocks, active and cached,
    power-of-two rounded) in this process; 0 when CUDA is not in use."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


class Registrations:
    """Host buffers page-locked in place with cudaHostRegister (`pin_tensor`) and their total `bytes`: `pin` one,
    `drop` one before freeing it, `release` all (they stay valid as ordinary memory)."""

    def __init__(self) -> None:
        self._held: dict[int, torch.Tensor] = {}  # id(buffer) -> buffer
        self.bytes = 0

    def empty(self, numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        """`numel` zero-filled elements of `dtype` in pages of their own (`page_exclusive_empty`), page-locked in
        place when `pin` (counted here; a pinned copy where registration fails). The CPU path allocates the same
        way, so CPU tests run the memory a CUDA run registers (saving, loading, views)."""
        t = page_exclusive_empty(numel, dtype)
        return self.pin(t) if pin else t

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (from `page_exclusive_empty`) page-locked: in place (counted here) or, where registration fails, a
        caching-allocator copy."""
        t, in_place = pin_tensor(t)
        if in_place:
            self._held[id(t)] = t
            self.bytes += t.numel() * t.element_size()
        return t

    def drop(self, t: torch.Tensor) -> None:
        if self._held.pop(id(t), None) is not None:
            unregister([t])
            self.bytes -= t.numel() * t.element_size()

    def release(self) -> None:
        unregister(list(self._held.values()))
        self._held.clear()
        self.bytes = 0

    def __del__(self) -> None:
        # Note [host registration lifetime]: memory freed while still registered stays registered in the driver,
        # and a later allocation at the same address then fails cudaHostRegister ("already mapped") or is taken
        # for page-locked. Every owner keeps its buffers here, so an owner never closed unregisters them when it
        # goes, while this object still holds them (views in the model may keep them alive, as pageable memory).
        if self._held:
            try:
                self.release()
            except Exception:  # pragma: no cover - interpreter shutdown
                pass


def unregister(tensors: list[torch.Tensor]) -> None:
    """Undo `pin_tensor`'s in-place registrations (the tensors stay valid as ordinary memory) and empty the list."""
    failed = False
    for t in tensors:
        try:  # pragma: no cover - CUDA only
            failed |= int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) != 0
        except Exception:
            pass
    if failed:  # pragma: no cover - CUDA only
        _clear_cuda_error()
    tensors.clear()


class PinnedArena:
    """Page-locked host memory for many tensors (optimizer states beside the host store) at their exact size.

    PyTorch's caching host allocator (`pin_memory=True`) rounds every block up to a power of two: a 7B model's MLP
    states (68 MB codes, 136 MB Kahan buffers) would lock 128 / 256 MB each. The arena carves tensors first-fit from
    chunks of about `chunk_bytes`, one pool per dtype (so tensors sharing a storage share its dtype, as torch.save
    requires), page-locked in place with cudaHostRegister (`pin_tensor`); locked bytes exceed used bytes by at most
    the chunks' unused tails. `reserve` sizes a pool's next chunk to a known total instead (the executor reserves the
    optimizer's states: without it the tails and the last chunks' free space were 2.5 GiB at Qwen2.5-7B, 1.05x).
    Without `pin` it hands out ordinary memory. Thread-safe (the CPU update worker and GPU-side updates allocate
    states concurrently). Nothing is freed before `release`.

    Attributes:
        used_bytes: bytes handed out; reserved_bytes: bytes allocated in chunks (page-locked when `pin`);
        registered_bytes: bytes of the chunks page-locked in place (a chunk `pin_tensor` could not register is a
            caching-allocator copy: `host_allocator_bytes`).
    """

    def __init__(self, pin: bool, chunk_bytes: int = 512 * 2**20) -> None:
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self._chunks: dict[torch.dtype, list[list]] = {}  # dtype -> [[1-D tensor, next free element], ...]
        self._registered = Registrations()
        self._lock = threading.Lock()
        self._next: dict[torch.dtype, int] = {}  # dtype -> elements of that pool's next chunk (`reserve`)
        self.used_bytes = 0
        self.reserved_bytes = 0

    @staticmethod
    def footprint(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
        """Elements an `alloc` of `shape` takes from its chunk (rounded up to 64 bytes, the alignment)."""
        align = max(1, 64 // dtype.itemsize)
        return -(-math.prod(shape) // align) * align

    def reserve(self, sizes: dict[torch.dtype, int]) -> None:
        """Make the next chunk of each dtype's pool exactly `sizes[dtype]` elements (the sum of `footprint` over the
        tensors about to be allocated), allocated lazily by the first `alloc` that needs a chunk; allocations beyond
        it open ordinary chunks. Replaces every reservation not yet taken (a resume re-reserves for the saved
        layout). So locked bytes equal used bytes when the estimate is exact."""
        with self._lock:
            self._next = {dt: int(n) for dt, n in sizes.items() if n > 0}

    def alloc(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of `shape` and `dtype` (64-byte aligned) in the arena."""
        size = dtype.itemsize
        n = math.prod(shape)
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        need = self.footprint(shape, dtype)  # elements
        with self._lock:
            pool = self._chunks.setdefault(dtype, [])
            chunk = next((c for c in pool if c[0].numel() - c[1] >= need), None)
            if chunk is None:
                t = self._registered.empty(max(self._next.pop(dtype, 0) or self.chunk_bytes // size, need), dtype,
                                           self.pin)
                chunk = [t, 0]
                pool.append(chunk)
                self.reserved_bytes += t.numel() * size
            out = chunk[0][chunk[1]:chunk[1] + n].view(shape)
            chunk[1] += need
            self.used_bytes += n * size
        return out

    def chunks(self) -> list[torch.Tensor]:
        return [c[0] for pool in self._chunks.values() for c in pool]

    def release(self) -> None:
        """Unregister the page-locked chunks (tensors stay valid as ordinary memory)."""
        if hasattr(self, "_registered"):
            self._registered.release()

    @property
    def registered_bytes(self) -> int:
        return self._registered.bytes


class HostBufferPool:
    """Reusable host buffers of exact sizes, page-locked in place (the activation tiers' boundary copies).

    PyTorch's caching host allocator would round every boundary up to a power of two (a 470 MB boundary locks a
    512 MB block). The pool hands out 1-D uint8 buffers `ALIGN`-aligned (O_DIRECT needs it) of exactly the size
    first asked for, page-locked with cudaHostRegister (`pin_tensor`) when `pin`, and reuses them across steps.

    `acquire(nbytes)` returns the smallest free buffer of at least `nbytes` bytes (the caller slices it), else a new
    one; before allocating, free buffers smaller than the request are dropped, so sizes that grow across steps
    (dynamic padding) do not accumulate buffers. `release(buf, event)` gives a buffer back; `event` (CUDA) is
    recorded after the last asynchronous copy that reads or writes it, and the next user orders itself after it:
    `acquire(..., stream=s)` makes stream `s` wait for it (the user's copy is on `s`), otherwise the calling
    thread waits (the user touches the bytes from the CPU). Thread-safe (NVMe I/O threads acquire and release).

    Attributes:
        held_bytes: bytes of every buffer the pool holds (in use or free).
        in_use_bytes: bytes of the buffers handed out now; high_water_bytes: their maximum so far.
        registered_bytes: bytes page-locked in place (== held_bytes when pinning succeeded).
        allocations: buffers allocated so far.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        self._in_use: dict[int, torch.Tensor] = {}  # id(buffer) -> buffer
        self._registered = Registrations()
        self._lock = threading.Lock()
        self.held_bytes = self.in_use_bytes = self.high_water_bytes = 0
        self.allocations = 0

    def acquire(self, nbytes: int, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """A buffer of at least `nbytes` bytes, safe to use on `stream` (None: from this thread, now)."""
        with self._lock:
            fits = [k for k, (b, _) in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                buf, event = self._free.pop(min(fits, key=lambda k: self._free[k][0].numel()))
            else:
                small = [(b, ev) for b, ev in self._free if b.numel() < nbytes]
                self._free = [f for f in self._free if f[0].numel() >= nbytes]
                for b, ev in small:
                    self._drop(b, ev)
                buf, event = self._allocate(nbytes), None
            self._in_use[id(buf)] = buf
            self.in_use_bytes += buf.numel()
            self.high_water_bytes = max(self.high_water_bytes, self.in_use_bytes)
        if event is not None and stream is not None:
            stream.wait_event(event)
        elif event is not None:
            event.synchronize()
        return buf

    def release(self, buf: torch.Tensor, event: torch.cuda.Event | None = None) -> None:
        """Give `buf` (as `acquire` returned it) back; `event`: completes after its last pending async copy."""
        with self._lock:
            if self._in_use.pop(id(buf), None) is None:
                raise ValueError("release() of a buffer this pool did not hand out (or released twice)")
            self.in_use_bytes -= buf.numel()
            self._free.append((buf, event))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        buf = page_exclusive_empty(nbytes, torch.uint8)  # ALIGN-aligned start (O_DIRECT), exactly nbytes
        if self.pin and nbytes:
            buf = self._registered.pin(buf)
        self.held_bytes += buf.numel()
        self.allocations += 1
        return buf

    def _drop(self, buf: torch.Tensor, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()  # no copy may still touch memory that is unregistered and freed
        self._registered.drop(buf)
        self.held_bytes -= buf.numel()

    def trim(self) -> None:
        """Free every buffer not in use (unregistering it first)."""
        with self._lock:
            free, self._free = self._free, []
            for b, ev in free:
                self._drop(b, ev)

    def __del__(self) -> None:
        self.release_all()  # Note [host registration lifetime]

    def release_all(self) -> None:
        """Unregister every page-locked buffer (in use or not; they stay valid as ordinary memory)."""
        for _, ev in getattr(self, "_free", []):
            if ev is not None:
                try:
                    ev.synchronize()
                except Exception:  # pragma: no cover - interpreter shutdown
                    pass
        if hasattr(self, "_registered"):
            self._registered.release()

    @property
    def registered_bytes(self) -> int:
        return self._registered.bytes


@dataclass
class LayerLayout:
    """Where a layer's streamed parameters go in its flat host buffers, before any buffer exists.

    Attributes:
        named: (name, parameter) of the streamed parameters, in `named_parameters()` order.
        specs, quant: as `LayerBuffers.specs` / `LayerBuffers.quant`.
        sizes: dtype -> elements of the layer's flat weight buffer of that dtype.
        frozen, resident: as `LayerBuffers.frozen` / `LayerBuffers.resident`.
    """

    named: list[tuple[str, nn.Parameter]]
    specs: list[ParamSpec]
    quant: list[ParamSpec]
    sizes: dict[torch.dtype, int]
    frozen: bool
    resident: list[tuple[str, nn.Parameter]]


def layer_layout(layer: nn.Module) -> LayerLayout:
    """The host layout of `layer` (reads shapes only: nothing is allocated or moved)."""
    named = list(layer.named_parameters())
    frozen = not all(p.requires_grad for _, p in named)
    resident = [(n, p) for n, p in named if frozen and p.requires_grad]
    named = [(n, p) for n, p in named if not (frozen and p.requires_grad)]
    sizes: dict[torch.dtype, int] = {}
    specs = []
    for name, p in named:
        off = sizes.get(p.dtype, 0)
        specs.append(ParamSpec(name, p.dtype, off, p.numel(), tuple(p.shape)))
        sizes[p.dtype] = off + p.numel()
    quant = []  # after every parameter, so the parameters' offsets do not depend on quantization
    for name, p in named:
        for path, t in quant_tensors(p):
            align = max(1, 64 // t.dtype.itemsize)  # 64-byte aligned starts, for the GPU kernels' vector loads
            off = -(-sizes.get(t.dtype, 0) // align) * align
            quant.append(ParamSpec(name, t.dtype, off, t.numel(), tuple(t.shape), path))
            sizes[t.dtype] = off + t.numel()
    return LayerLayout(named, specs, quant, sizes, frozen, resident)


class HostParamStore:
    """Owns the host buffers of every streamed decoder layer.

    Args:
        layers: the model's decoder layers (their parameters are re-pointed into the store's buffers).
        pin: page-lock the buffers (only meaningful with a CUDA device; needed for async H2D/D2H).
        grad_dtype: "fp32" (accumulate micro-batches in fp32) or "param" (gradients kept in the parameter dtype:
            half the host bytes for bf16 models; right when there is one micro-batch per optimizer step).
        shared: the weights live in one host copy that the data-parallel ranks of this host map
            (streaming/shared_host.py; a collective of those ranks): only its writer copies the layers' weights in,
            the other ranks' parameters view it and their own copies are dropped. None: this process's own buffers.
            Gradients are this process's own either way.

    Attributes:
        buffers: one LayerBuffers per layer.
        shared: as given.
        pinned_bytes: bytes this store page-locked (weights + grads), in place or as `pin_memory()` copies; a shared
            copy counts this rank's share (`weight_share_bytes`).
        registered_bytes: the part page-locked in place with cudaHostRegister (exact sizes; a shared copy: its
            share).
    """

    def __init__(self, layers: nn.ModuleList, pin: bool = False, grad_dtype: str = "fp32",
                 shared: SharedHostWeights | None = None) -> None:
        if grad_dtype not in ("fp32", "param"):
            raise ValueError(f"grad_dtype must be 'fp32' or 'param', but got {grad_dtype!r}")
        self.grad_dtype = grad_dtype
        self.shared = shared
        self.buffers: list[LayerBuffers] = []
        self.pinned_bytes = 0
        self._registered = Registrations()
        layouts = []
        for layer in layers:
            keep_packing(layer)
            layouts.append(layer_layout(layer))
        if shared is None:
            weights = [{dt: self._registered.empty(n, dt, pin) for dt, n in lay.sizes.items()} for lay in layouts]
        else:
            weights = shared.allocate([lay.sizes for lay in layouts])
        for lay, w in zip(layouts, weights):
            self.buffers.append(self._adopt(lay, w, pin))
        if pin and shared is not None:
            self.pinned_bytes += self.weight_share_bytes

    def _adopt(self, lay: LayerLayout, weights: dict[torch.dtype, torch.Tensor], pin: bool) -> LayerBuffers:
        gdt = (lambda dt: torch.float32) if self.grad_dtype == "fp32" else (lambda dt: dt)
        grads = {} if lay.frozen else {dt: self._registered.empty(n, gdt(dt), pin) for dt, n in lay.sizes.items()}
        if pin:
            own = (grads,) if self.shared is not None else (weights, grads)
            self.pinned_bytes += sum(t.numel() * t.element_size() for st in own for t in st.values())
        # a shared copy is filled by its writer alone; the other ranks' parameters only view it
        write = self.shared is None or self.shared.writes_initial
        for (_, p), s in zip(lay.named, lay.specs):
            view = weights[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
            if write:
                view.copy_(p.data)
            p.data = view  # the module now reads and writes the store's bytes: one copy in host RAM
        params = dict(lay.named)
        for s in lay.quant:
            view = weights[s.dtype][s.offset:s.offset + s.numel].view(s.shape)
            if write:
                view.copy_(dict(quant_tensors(params[s.name]))[s.quant])
            set_quant_tensor(params[s.name], s.quant, view)
        return LayerBuffers(weights, grads, lay.specs, lay.frozen, lay.resident, lay.quant)

    @property
    def frozen(self) -> list[bool]:
        """Per layer: streamed read-only (`LayerBuffers.frozen`)."""
        return [b.frozen for b in self.buffers]

    def grad_view(self, layer: int, spec: ParamSpec) -> torch.Tensor:
        """Gradient of one parameter, shape `spec.shape` (a view into the layer's grad buffer)."""
        return self.buffers[layer].grads[spec.dtype][spec.offset:spec.offset + spec.numel].view(spec.shape)

    def zero_grads(self) -> None:
        for b in self.buffers:
            for g in b.grads.values():
                g.zero_()

    def grad_sq_sum(self, layers: list[int] | None = None) -> torch.Tensor:
        """Sum of squared host gradients of `layers` (default: all), fp64 scalar on the CPU."""
        total = torch.zeros((), dtype=torch.float64)
        for i in range(len(self.buffers)) if layers is None else layers:
            for g in self.buffers[i].grads.values():
                total += sq_norm(g)
        return total

    @property
    def param_bytes(self) -> int:
        """Bytes of every layer's weights, as the model sees them (a shared copy whole)."""
        return sum(b.param_bytes for b in self.buffers)

    @property
    def weight_ranks(self) -> int:
        """Processes whose parameters view these weights: the ranks mapping the shared copy, else 1."""
        return self.shared.ranks if self.shared is not None else 1

    @property
    def weight_share_bytes(self) -> int:
        """This process's share of `param_bytes`: all of it, or 1 / `weight_ranks` of a copy the host's ranks share
        (counted once per host over its ranks)."""
        return self.param_bytes // self.weight_ranks

    @property
    def grad_bytes(self) -> int:
        return sum(b.grad_bytes for b in self.buffers)

    def release(self) -> None:
        """Unregister page-locked memory (the tensors stay valid as ordinary memory)."""
        if hasattr(self, "_registered"):
            self._registered.release()
        if getattr(self, "shared", None) is not None:
            self.shared.release()

    @property
    def registered_bytes(self) -> int:
        own = self._registered.bytes
        return own + (self.shared.registered_bytes // self.shared.ranks if self.shared is not None else 0)
