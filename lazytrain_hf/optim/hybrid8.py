"""`Hybrid8bitOptimizer`: AdamW with blockwise 8-bit states, master weights and fused gradient clipping.

The optimizer owns the loop (lazy state setup, clip bookkeeping, kernel choice); the math lives
in `lazytrain_hf.optim.functional` (one kernel per device plus a pure-torch reference).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import envvars
from ..config import cpu_threads
from . import functional as F
from .quant import num_blocks, zero_code

__all__ = ["Hybrid8bitOptimizer", "GradSource", "STATE_TENSOR_KEYS"]

logger = logging.getLogger(__name__)

GradSource = Callable[[Tensor], "Tensor | None"]
"""``fn(param) -> fp32 gradient tensor (param.numel() elements) or None (param has no gradient this step)``."""
Stage = Callable[[Tensor, Tensor, dict[str, Any]], "tuple[Tensor, Tensor, dict[str, Any]]"]
StateAllocator = Callable[[Tensor, tuple, torch.dtype], "Tensor | None"]
"""``fn(param, grad, state) -> (param, grad, state) copies the update runs on`` (see `step_deferred`)."""

STATE_TENSOR_KEYS = ("state1", "state2", "absmax1", "absmax2", "master", "kahan")
"""Per-parameter state tensors. None of them is ever cast on load (bitsandbytes' ``non_castable_tensor_keys``):
codes stay uint8, absmax and master fp32, Kahan buffers in the parameter dtype."""

_STATE_KEYS = frozenset(STATE_TENSOR_KEYS) | {"step"}
_STATE_DTYPES = ("8bit", "fp32")
_MASTER_CHOICES = ("auto", "fp32", "kahan", "stochastic", "none")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_ (and so the HF Trainer): coef = max_norm / (norm + 1e-6)


@dataclass
class _PendingClip:
    """Clip request from `clip_grad_norm`, resolved (one host sync) at the first update that needs it."""

    norm: Tensor            # pre-clip global L2 norm, fp32 scalar on any device
    max_norm: float
    coef: float | None = None   # min(1, max_norm / (norm / scale + 1e-6)) / scale, in fp32 as torch does
    skip: bool = False          # the norm is non-finite: updates are skipped
    scale: float = 1.0          # the gradients are `scale` x the true ones (fp16 loss scaling, hf/loss_scale.py)


class Hybrid8bitOptimizer(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as ``torch.optim.AdamW``) with the Hybrid 8-bit features:

    - **8-bit states**: first moment on a signed, second on an unsigned dynamic map, per-block fp32 absmax
      (bitsandbytes' layout and state keys). Costs 2 bytes/param plus 8 bytes per block instead of 8 bytes/param.
      Tensors with fewer than ``min_8bit_size`` elements and ``fp32_state_params`` (embeddings, lm_head) keep
      fp32 states. ``state_dtype="fp32"``: all states fp32 (then, with fp32 params, the result equals
      ``torch.optim.AdamW``).
      Maps (`lazytrain_hf.optim.quant`): the signed map is bitsandbytes' with its lowest code set to exactly
      -1.0 (code 0), so +1 and -1 are both codes and the element that sets a block's absmax decodes exactly
      whatever its sign; its zero is code 127. The unsigned map (v) has 0 at code 0 and 1 at code 255.
    - **v floor** (Note [v floor] in `quant`): a positive second moment is never stored as the zero code; one
      that would round to it (a tiny v in a block whose absmax is 1e12 times larger: heavy-tailed gradients)
      is stored as the smallest non-zero code, ``qmap2[1] * absmax2`` (3.25e-7 x absmax2). Without it an
      element whose gradient then becomes 0 would move by ``lr * m / eps`` (millions of lr); with it the update
      is at most about ``lr * |m| / sqrt(qmap2[1] * absmax2)`` (before bias correction). All kernels apply it
      (bitsandbytes' CUDA kernel by flooring its v codes at 1 after the update). Tested in
      ``tests/optim/test_v_floor_heavy_tails.py``.
    - **Master weights** for bf16/fp16 params, so that updates far below the bf16 resolution (lr = 1e-5 on
      weights of size 1e-2) accumulate: ``"fp32"`` keeps an fp32 copy (+4 bytes/param), ``"kahan"`` a
      compensation buffer in the param dtype (+2 bytes/param, about fp32 accuracy), ``"none"`` rounds each
      update into the param (small updates vanish), ``"auto"`` = kahan for bf16 params, fp32 for fp16 ones
      (fp16's narrow range would flush small compensations to zero), none for fp32; ``"stochastic"``: no master
      copy (0 bytes), bf16 params written with stochastic rounding (`functional.stochastic_round_bf16`: unbiased,
      bits from the parameter's index and step, so a resumed run draws the same), on the pure-torch update only
      (on a CPU ~75x slower than the fused kernel: for quality comparisons; fp16 params get fp32 masters).
      Kahan is the default for bf16 because it trained as fp32 masters do (same losses to 4 digits over 300 GSM8K
      steps at lr 1e-5: benchmarks/results/quality-cpu-20261203.json) with 2 bytes less host memory and PCIe per
      parameter.
    - **Fused clipping**: `clip_grad_norm` only records the coefficient ``min(1, max_norm / (norm + 1e-6))``
      (HF Trainer / torch semantics, pre-clip norm returned); the next update multiplies gradients by it inside
      the kernel. Gradients are never rescaled in a separate pass and never modified. ``grad_scale=S`` (fp16 loss
      scaling, `lazytrain_hf.hf.loss_scale`): the gradients are unscaled first through the same coefficient,
      ``min(1, max_norm / (norm / S + 1e-6)) / S``, on every update path (serial, deferred, GPU-staged).
    - **Non-finite norm**: the update is skipped entirely (no weight, state or step counter changes) and a
      warning is logged. The stock HF Trainer would write NaN into the weights instead (documented difference).
    - **Layer-wise updates**: `step_params` updates a subset (the streaming executor calls it per layer) with the
      same clip coefficient; `set_grad_source` reads fp32 gradients from the executor's host buffers.
    - **Kernels** per device behind `lazytrain_hf.optim.functional`: fused C++ on CPU (pure-torch fallback); on
      CUDA a fused Triton kernel for 8-bit states (the C++ kernel's bits; bitsandbytes where Triton is missing or
      fails its self-check, and for fp32 states); pure torch elsewhere.

    Args:
        params: parameters or param-group dicts (groups may override any default below).
        lr (float, defaults to 1e-3): learning rate (the HF LR scheduler writes ``group["lr"]``).
        betas (tuple[float, float], defaults to (0.9, 0.999)): moment decay rates, each in [0, 1).
        eps (float, defaults to 1e-8): added to ``sqrt(v_hat)``.
        weight_decay (float, defaults to 0.0): decoupled decay, ``p *= 1 - lr * weight_decay``.
        block_size (int, defaults to 256): elements per quantization block; a power of two in [64, 65536]
            (on CUDA the Triton kernel takes powers of two up to 4096, bitsandbytes' kernel only 256; other sizes
            use the pure-torch path there).
        min_8bit_size (int, defaults to 4096): tensors with fewer elements keep fp32 states.
        state_dtype (str, defaults to "8bit"): "8bit" or "fp32".
        master_weights (str, defaults to "auto"): "auto", "fp32", "kahan", "stochastic" or "none" (see above).
        fp32_state_params (iterable of Tensor, defaults to None): parameters that always keep fp32 states.

    Raises:
        ValueError: any invalid hyperparameter, or a bad LAZYTRAIN_CPU_KERNEL / LAZYTRAIN_CPU_ISA /
            LAZYTRAIN_GPU_KERNEL / LAZYTRAIN_CPU_THREADS value, or a LAZYTRAIN_CPU_ISA path the fused CPU kernel
            cannot run on this CPU (all problems listed at once, each with the value received).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        state_dtype: str = "8bit",
        master_weights: str = "auto",
        fp32_state_params: Iterable[Tensor] | None = None,
    ) -> None:
        defaults: dict[str, Any] = dict(
            lr=lr, betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas, eps=eps,
            weight_decay=weight_decay, block_size=block_size, min_8bit_size=min_8bit_size,
            state_dtype=state_dtype.lower() if isinstance(state_dtype, str) else state_dtype,
            master_weights=master_weights.lower() if isinstance(master_weights, str) else master_weights,
        )
        problems = _validate_group(defaults)
        # the environment overrides, read at each update: a typo fails here, not after a first step
        for choice in (F.cpu_kernel_choice, F.cpu_isa_choice, F.gpu_kernel_choice, cpu_threads,
                       functools.partial(envvars.read, "LAZYTRAIN_CPU_LOOKUP")):
            try:
                choice()
            except ValueError as e:
                problems.append(str(e))
        try:  # a forced ISA path this CPU's build lacks: refused now, not at the first update
            isa_problem = F.forced_isa_problem()
        except ValueError:  # a bad value, listed above
            isa_problem = None
        if isa_problem is not None:
            problems.append(isa_problem)
        if problems:
            raise ValueError("Invalid Hybrid8bitOptimizer arguments:\n  - " + "\n  - ".join(problems))
        # id(param) of parameters that always keep fp32 states
        self._fp32_state_ids: set[int] = {id(p) for p in (fp32_state_params or ())}
        # id(param) -> index of its param group (rebuilt when groups change)
        self._group_index: dict[int, int] = {}
        # device -> codebooks (quantization maps; lookup tables on CPU), shared by all params on that device
        self._books: dict[torch.device, F.Codebooks] = {}
        self._grad_source: GradSource | None = None
        self._state_alloc: StateAllocator | None = None
        self._pending: _PendingClip | None = None
        self._deferred_ids: set[int] = set()  # params whose update `step` hands to `_on_deferred_step`
        self._on_deferred_step: Callable[[dict[str, Any]], None] | None = None
        self.last_step_skipped: bool = False
        # prepared moments (`prepare_states`): id(param) -> fp32 (m, v) buffers, reused every step; `_prep_ready`:
        # those dequantized from the current states. `_prep_writes` counts each param's state writes, odd while one
        # runs (a seqlock: a preparation that overlapped a write is not marked ready)
        self._prep_bufs: dict[int, tuple[Tensor, Tensor]] = {}
        self._prep_ready: set[int] = set()
        self._prep_writes: dict[int, int] = {}
        self._prep_lock = threading.Lock()
        super().__init__(params, defaults)
        if any(g["master_weights"] == "stochastic" for g in self.param_groups):
            logger.warning("Hybrid8bitOptimizer: master_weights='stochastic' runs the pure-torch update (on a CPU "
                           "~75x slower than the fused kernel): for quality comparisons; the default 'auto' (Kahan "
                           "for bf16) is the fast path")

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; its options are validated like the constructor's.

        Raises:
            ValueError: invalid options (all listed).
        """
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        for key in ("state_dtype", "master_weights"):
            if isinstance(merged.get(key), str):
                merged[key] = merged[key].lower()
                if key in param_group:
                    param_group[key] = merged[key]
        problems = _validate_group(merged)
        if problems:
            raise ValueError("Invalid Hybrid8bitOptimizer param group:\n  - " + "\n  - ".join(problems))
        super().add_param_group(param_group)
        self._group_index, self._numbers = {}, None

    def _param_number(self, p: Tensor) -> int:
        """``p``'s position among all parameters of all groups, in order: the stochastic rounding's seed (the same
        in a run resumed on the same model)."""
        numbers = getattr(self, "_numbers", None)
        if numbers is None or id(p) not in numbers:
            numbers = self._numbers = {id(q): i for i, q in enumerate(q for g in self.param_groups
                                                                      for q in g["params"])}
        return numbers[id(p)]

    def _group_of(self, p: Tensor) -> dict[str, Any]:
        idx = self._group_index.get(id(p))
        if idx is None:
            self._group_index = {id(q): i for i, g in enumerate(self.param_groups) for q in g["params"]}
            idx = self._group_index.get(id(p))
            if idx is None:
                raise ValueError(f"step_params got a tensor of shape {tuple(p.shape)} that is not a parameter of "
                                 "this optimizer")
        return self.param_groups[idx]

    # ------------------------------------------------------------------ gradients and clipping
    def set_state_allocator(self, fn: StateAllocator | None) -> None:
        """Where new state tensors live: ``fn(param, shape, dtype)`` returns a tensor (e.g. from the executor's
        exact-size pinned arena) or None for the default (on the param's device, pinned like it). Set it before
        the first step or `load_state_dict`."""
        self._state_alloc = fn

    def set_grad_source(self, fn: GradSource | None) -> None:
        """Read gradients through ``fn(param)`` instead of ``param.grad`` (None restores ``param.grad``).

        ``fn`` returns an fp32 tensor with ``param.numel()`` elements (any shape; on the param's device, or it is
        copied there) or None when the param has no gradient. The optimizer never modifies it.
        """
        if fn is not None and not callable(fn):
            raise TypeError(f"set_grad_source expects a callable or None, but got {type(fn).__name__}")
        self._grad_source = fn

    def _grad_of(self, p: Tensor) -> Tensor | None:
        g = self._grad_source(p) if self._grad_source is not None else p.grad
        if g is None:
            return None
        if g.is_sparse:
            raise RuntimeError("Hybrid8bitOptimizer does not support sparse gradients")
        if g.numel() != p.numel():
            raise ValueError(f"gradient has {g.numel()} elements but its parameter {tuple(p.shape)} has "
                             f"{p.numel()}")
        return g

    @torch.no_grad()
    def grad_norm(self) -> Tensor:
        """Global pre-clip L2 norm over the gradients of all params (CPU and CUDA mixed).

        Per-tensor norms are computed in fp32 on each gradient's device (``torch._foreach_norm``), gathered on the
        first gradient's device and combined, as ``torch.nn.utils.clip_grad_norm_`` does.

        Returns:
            fp32 0-dim tensor on the first gradient's device (0.0 on CPU when no param has a gradient).
        """
        by_device: dict[torch.device, list[Tensor]] = defaultdict(list)
        for group in self.param_groups:
            for p in group["params"]:
                g = self._grad_of(p)
                if g is not None:
                    by_device[g.device].append(g)
        if not by_device:
            return torch.zeros((), dtype=torch.float32)
        first = next(iter(by_device))
        norms: list[Tensor] = []
        for grads in by_device.values():
            if all(g.dtype == torch.float32 for g in grads):
                norms.extend(torch._foreach_norm(grads, 2.0))
            else:
                norms.extend(torch._foreach_norm(grads, 2.0, dtype=torch.float32))
        return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0).float()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm: Tensor | None = None, *, grad_scale: float = 1.0) -> Tensor:
        """Record gradient clipping for the next update; return the pre-clip global norm.

        The coefficient ``min(1, max_norm / (norm + 1e-6))`` (fp32, as torch and the HF Trainer) is applied inside
        the next `step` and every `step_params` call until the next `clip_grad_norm` or the end of a `step`. A
        non-finite norm makes those updates no-ops (logged once). No gradient is modified here.

        With ``grad_scale`` S (fp16 loss scaling: the gradients are S x the true ones) the gradients are unscaled
        first, as ``GradScaler.unscale_`` before ``clip_grad_norm_``: the clip coefficient is that of ``norm / S``
        and the updates multiply each gradient by ``coef / S`` (exact for a power-of-two S). A non-finite scaled
        norm (an inf / NaN gradient: an fp16 overflow) skips the step without a warning (the scaler reports it).

        Args:
            max_norm: clipping threshold (> 0), as ``TrainingArguments.max_grad_norm``; ``float("inf")`` only
                checks the norm (a non-finite norm still skips the update).
            norm: the pre-clip global L2 norm when the caller already has it (the executor accumulates it while
                gradients are produced); None: computed with `grad_norm`.

            grad_scale: the factor the gradients carry (1: none); a positive finite number.

        Returns:
            The pre-clip norm of the unscaled gradients (``norm`` itself when given and ``grad_scale`` is 1).

        Raises:
            ValueError: ``max_norm`` is not a positive number, or ``grad_scale`` not a positive finite one.
        """
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"clip_grad_norm: max_norm must be a positive number (inf: no clipping), but got "
                             f"{max_norm!r}")
        if isinstance(grad_scale, bool) or not isinstance(grad_scale, (int, float)) or \
                not (math.isfinite(grad_scale) and grad_scale > 0):
            raise ValueError(f"clip_grad_norm: grad_scale must be a positive finite number, but got {grad_scale!r}")
        if norm is None:
            norm = self.grad_norm()
        elif not isinstance(norm, Tensor):
            norm = torch.tensor(float(norm), dtype=torch.float32)
        self._pending = _PendingClip(norm=norm.detach(), max_norm=float(max_norm), scale=float(grad_scale))
        return norm if grad_scale == 1.0 else norm / grad_scale

    def _resolve_clip(self) -> tuple[float, bool]:
        """``(clip coefficient, skip)`` for the current update; the first call per clip request syncs once."""
        pc = self._pending
        if pc is None:
            return 1.0, False
        if pc.coef is None:
            total = pc.norm.detach().to("cpu", torch.float32)
            if not bool(torch.isfinite(total)):
                pc.coef, pc.skip = 1.0, True
                if pc.scale == 1.0:  # a scaled run's overflow is the loss scaler's to report
                    logger.warning(
                        "Hybrid8bitOptimizer: global gradient norm is %s; skipping this optimizer step (weights, "
                        "optimizer states and step counters unchanged). The stock HF Trainer would apply it and "
                        "write NaN/inf into the weights.", float(total))
            else:
                # unscale, then clip (GradScaler.unscale_ then clip_grad_norm_): a power-of-two scale is exact
                coef = torch.clamp(pc.max_norm / (total / pc.scale + _CLIP_EPS), max=1.0)
                pc.coef = float(coef) / pc.scale
        return pc.coef, pc.skip

    # ------------------------------------------------------------------ updates
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient; applies and then clears the recorded clip request.

        Returns:
            The closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            params = [p for group in self.param_groups for p in group["params"]]
            if self._on_deferred_step is None:
                self._update(params)
            else:
                snapshot = self.step_snapshot()
                self._update([p for p in params if id(p) not in self._deferred_ids], snapshot)
                self._on_deferred_step(snapshot)
        finally:
            self._pending = None
        return loss

    def set_deferred(self, params: list[Tensor] | None,
                     on_step: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Hand the updates of `params` to their owner: `step` updates every other parameter at once, then calls
        ``on_step(snapshot)``; the owner later applies ``step_deferred(some_params, snapshot)`` (for example layer
        by layer, overlapped with the next forward), with the learning rates and clip coefficient of that step
        even when the LR scheduler has moved on. None: every parameter is updated in `step` again.
        """
        self._deferred_ids = {id(p) for p in params or []}
        self._on_deferred_step = on_step if params else None

    def step_snapshot(self) -> dict[str, Any]:
        """What an update needs from this moment: clip (coefficient, skip) and each group's hyper-parameters."""
        coef, skip = self._resolve_clip()
        self.last_step_skipped = skip
        keys = ("lr", "betas", "eps", "weight_decay")
        return {"clip": (coef, skip), "groups": {id(g): {k: g[k] for k in keys} for g in self.param_groups}}

    @torch.no_grad()
    def step_deferred(self, params: list[Tensor], snapshot: dict[str, Any], stage: Stage | None = None) -> None:
        """Apply the update of `params` that a `step` deferred (see `set_deferred`).

        Args:
            stage: run each update on other copies of the tensors, e.g. on the GPU for a parameter held in host
                memory: ``stage(p, grad, state) -> (p_dev, grad_dev, state_dev)`` where `state_dev` maps the same
                keys as `state` (tensors copied to the device). The update runs on those; the caller copies
                `p_dev` and the `state_dev` tensors back (streaming/executor.py). The step counter is kept here.
        """
        self._update(list(params), snapshot, stage)

    @torch.no_grad()
    def step_params(self, params: list[Tensor]) -> None:
        """Update only ``params`` (each a parameter of this optimizer), with the recorded clip coefficient.

        The clip request stays in force for further `step_params` calls (the executor updates layer by layer)
        until the next `clip_grad_norm` or `step`. The caller must not update a parameter twice per step.

        Raises:
            ValueError: a tensor that is not a parameter of this optimizer.
        """
        self._update(list(params))

    def _update(self, params: list[Tensor], snapshot: dict[str, Any] | None = None,
                stage: Stage | None = None) -> None:
        if snapshot is None:
            clip_coef, skip = self._resolve_clip()
            self.last_step_skipped = skip
        else:
            clip_coef, skip = snapshot["clip"]
        if skip:
            return
        for p in params:
            group = self._group_of(p)
            hp = group if snapshot is None else {**group, **snapshot["groups"][id(group)]}
            g = self._grad_of(p)
            if g is None:
                continue
            state = self.state[p]
            if not state:
                self._init_state(p, group)
            target, tstate = p, state
            if stage is not None:
                target, g, tstate = stage(p, g, state)
            if g.device != target.device:
                g = g.to(target.device)
            beta1, beta2 = hp["betas"]
            step = int(state["step"]) + 1
            stochastic = _resolve_master(group["master_weights"], p.dtype) == "stochastic"
            hyper = F.AdamWHyper(lr=float(hp["lr"]), beta1=float(beta1), beta2=float(beta2),
                                 eps=float(hp["eps"]), weight_decay=float(hp["weight_decay"]),
                                 step=step, clip_coef=clip_coef,
                                 sr_seed=F.update_seed(self._param_number(p), step) if stochastic else None)
            key = id(p)
            with self._prep_lock:  # the update below rewrites the states: their prepared copy goes stale
                bufs = self._prep_bufs.get(key) if key in self._prep_ready else None
                self._prep_ready.discard(key)
                self._prep_writes[key] = self._prep_writes.get(key, 0) + 1
            try:
                prepared = bufs if stage is None else None
                F.adamw_step(target, g, tstate, hyper, self._books_for(target.device),
                             block_size=int(group["block_size"]), prepared=prepared)
            finally:
                with self._prep_lock:
                    self._prep_writes[key] += 1
            state["step"] = hyper.step   # counted once the update went through

    @torch.no_grad()
    def prepare_states(self, params: list[Tensor], *, threads: int | None = None,
                       stop: Callable[[], bool] | None = None) -> int:
        """Dequantize the 8-bit moments of `params` into fp32 host buffers ahead of their next update, whose fused
        CPU kernel then reads them instead of its own dequantization (half its table reads; the same values, so the
        same bits). The executor's update worker runs this for the next step's CPU-updated layers while the CPU
        would otherwise idle (streaming/updates.py). Any later write of a state (an update on any device,
        `load_state_dict`) discards its prepared copy, so a stale one is never read.

        Host memory: 8 bytes per prepared element (fp32 m and v), allocated at the first call and kept.

        Args:
            params: parameters of this optimizer; those without 8-bit CPU states (or when the fused CPU kernel is
                unavailable, `functional.can_prepare_cpp`) are skipped.
            threads: OpenMP threads (default `lazytrain_hf.config.cpu_threads()`).
            stop: checked before each parameter; True ends the call early (the rest stay unprepared).

        Returns:
            Elements prepared (count).
        """
        done = 0
        for p in params:
            if stop is not None and stop():
                break
            state = self.state.get(p)
            if not state or not F.can_prepare_cpp(p, state) or \
                    _resolve_master(self._group_of(p)["master_weights"], p.dtype) == "stochastic":
                continue  # (stochastic rounding runs the torch update, which reads no prepared moments)
            bufs = self._prep_bufs.get(id(p))
            if bufs is None:
                n = p.numel()
                bufs = self._prep_bufs[id(p)] = (torch.empty(n, dtype=torch.float32),
                                                  torch.empty(n, dtype=torch.float32))
            with self._prep_lock:
                self._prep_ready.discard(id(p))
                writes = self._prep_writes.get(id(p), 0)
            if writes % 2:  # an update is writing these states now
                continue
            F.dequantize_states_cpp(state, self._books_for(p.device), bufs,
                                    block_size=int(self._group_of(p)["block_size"]), threads=threads)
            with self._prep_lock:  # unless a write (or a load_state_dict) touched the states meanwhile
                if self._prep_writes.get(id(p), 0) == writes and self.state.get(p) is state:
                    self._prep_ready.add(id(p))
            done += p.numel()
        return done

    def release_prepared(self, params: Iterable[Tensor]) -> int:
        """Free the `prepare_states` buffers of `params` (e.g. layers no longer prepared after a re-plan), so
        that the buffers held stay within the budget of the layers prepared now; returns the bytes freed."""
        freed = 0
        with self._prep_lock:
            for p in params:
                self._prep_ready.discard(id(p))
                bufs = self._prep_bufs.pop(id(p), None)
                if bufs is not None:
                    freed += 4 * (bufs[0].numel() + bufs[1].numel())
        return freed

    def prepared_bytes(self) -> int:
        """Host bytes held by `prepare_states` buffers (8 per prepared element)."""
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self._prep_bufs.values())

    def _books_for(self, device: torch.device) -> F.Codebooks:
        books = self._books.get(device)
        if books is None:
            books = self._books[device] = F.Codebooks.for_device(device)
        return books

    def wants_8bit(self, p: Tensor) -> bool:
        """Whether ``p`` (a parameter of this optimizer; False for others) gets 8-bit states in this run."""
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
        return group is not None and self._wants_8bit(p, group)

    def _wants_8bit(self, p: Tensor, group: dict[str, Any]) -> bool:
        """Whether this run gives ``p`` 8-bit states (else fp32): the group's state_dtype, its size, fp32_state_params."""
        return (group["state_dtype"] == "8bit" and p.numel() >= group["min_8bit_size"]
                and id(p) not in self._fp32_state_ids)

    def _state_layout(self, p: Tensor, group: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Key -> (shape, dtype) of each state tensor ``p`` gets (one source for allocation and `state_specs`)."""
        shape = tuple(p.shape)
        if self._wants_8bit(p, group):
            nb = (num_blocks(p.numel(), group["block_size"]),)
            out = {"state1": (shape, torch.uint8), "state2": (shape, torch.uint8),
                   "absmax1": (nb, torch.float32), "absmax2": (nb, torch.float32)}
        else:
            out = {"state1": (shape, torch.float32), "state2": (shape, torch.float32)}
        mode = _resolve_master(group["master_weights"], p.dtype)
        if mode not in ("none", "stochastic"):
            out[mode if mode == "kahan" else "master"] = (shape, p.dtype if mode == "kahan" else torch.float32)
        return out

    def state_specs(self, state_dict: dict[str, Any] | None = None) -> list[tuple[Tensor, tuple[int, ...], torch.dtype]]:
        """(parameter, shape, dtype) of every state tensor an allocator (`set_state_allocator`) will be asked for,
        so it can size its memory up front (the executor's `reserve_states`). Without `state_dict`: what the first
        step allocates for the parameters that have no state yet (moments, absmax, master or Kahan buffers). With
        one: what `load_state_dict(state_dict)` allocates (the saved layout, which may differ from this run's
        options) plus, for parameters it holds no state for, what their first step allocates (accelerate reloads
        an optimizer's own empty state when it wraps it). Saved entries that do not fit are still listed (the load
        reports them)."""
        saved_of: dict[int, dict[str, Any]] = {}
        if state_dict is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            ids = [i for g in state_dict.get("param_groups", []) for i in g.get("params", [])]
            states = state_dict.get("state", {})
            saved_of = {id(p): states[i] for i, p in zip(ids, params) if states.get(i)}
        out: list[tuple[Tensor, tuple[int, ...], torch.dtype]] = []
        for group in self.param_groups:
            for p in group["params"]:
                saved = saved_of.get(id(p))
                if saved:
                    out += [(p, _saved_shape(k, v, p), v.dtype) for k, v in saved.items()
                            if k != "step" and isinstance(v, Tensor)]
                elif state_dict is not None or not self.state.get(p):  # a load replaces every state
                    out += [(p, shape, dtype) for shape, dtype in self._state_layout(p, group).values()]
        return out

    @torch.no_grad()
    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        """Allocate the states of ``p`` on its device (pinned when ``p`` is pinned host memory)."""
        state = self.state[p]
        a = self._state_alloc
        state["step"] = 0
        books = None
        for key, (shape, dtype) in self._state_layout(p, group).items():
            state[key] = t = _alloc_like(p, shape, dtype, a)
            if dtype == torch.uint8:  # 8-bit codes (state1 / state2) start at the code of 0
                books = books or self._books_for(p.device)
                t.fill_(zero_code((books.qmap1 if key == "state1" else books.qmap2).cpu()))
            elif key == "master":
                t.copy_(p.detach())
            else:
                t.zero_()

    # ------------------------------------------------------------------ accounting and checkpoints
    def state_bytes(self) -> dict[str, int]:
        """Bytes of per-parameter optimizer state (moments, absmax, master weights, Kahan buffers) by device type.

        Returns:
            ``{"cpu": bytes, "cuda": bytes, ...}`` with the device types that hold state (empty before the first
            step). The two 1 KiB quantization maps per device are not counted.
        """
        out: dict[str, int] = {}
        for state in self.state.values():
            for v in state.values():
                if isinstance(v, Tensor):
                    out[v.device.type] = out.get(v.device.type, 0) + v.numel() * v.element_size()
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (tensors and primitives only), with states that are small views of a large
        shared buffer copied out compactly.

        States from a `set_state_allocator` arena (the executor's pinned chunks of 512 MiB) are views, and
        `torch.save` writes a view's whole storage: a 40 MB model's optimizer.pt was 1.15 GB. When the buffers
        behind the states exceed the states' own bytes by more than max(64 MiB, 10%), every view smaller than its
        buffer is cloned (for a 7B model the chunks' unused tails are ~2% and nothing is copied).
        """
        sd = super().state_dict()
        tensors = [v for st in sd["state"].values() for v in st.values() if isinstance(v, Tensor) and v.numel()]
        used = sum(v.numel() * v.element_size() for v in tensors)
        held = sum({v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in tensors}.values())
        if held - used > max(64 * 2**20, used // 10):
            for st in sd["state"].values():
                for k, v in st.items():
                    if isinstance(v, Tensor) and v.untyped_storage().nbytes() > v.numel() * v.element_size():
                        st[k] = v.clone()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict` (as saved, or after ``torch.load(weights_only=True)``).

        Each state tensor is allocated on its parameter's device (pinned when the parameter is pinned host memory)
        with its *saved* dtype and copied once from wherever the loaded tensor lives: nothing is staged on the GPU
        and nothing is cast (uint8 codes, fp32 master, Kahan buffers keep their dtypes). The group options
        (lr, betas, ...) come from the saved groups, as in torch.

        Raises:
            ValueError: group count or sizes differ, or a saved state does not fit its parameter (all listed).
        """
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(f"loaded state dict has {len(saved_groups)} parameter groups, but the optimizer has "
                             f"{len(groups)}")
        problems: list[str] = []
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                problems.append(f"group {i}: {len(sg['params'])} saved parameters, optimizer has {len(g['params'])}")
        if problems:
            raise ValueError("loaded state dict does not match the optimizer's groups:\n  - " + "\n  - ".join(problems))
        # saved options win (as in torch); options the file lacks keep their current values. The layout options
        # decide how the saved states are stored, so a run asking for others is told it does not get them
        changed = sorted({f"{k}={sg[k]!r} (this run asked for {g[k]!r})" for g, sg in zip(groups, saved_groups)
                          for k in _LAYOUT_OPTIONS if k in sg and k in g and sg[k] != g[k]})
        if changed:
            logger.warning("the loaded optimizer state was saved with %s; continuing with the saved options, which "
                           "its states are stored in. To change them, load the model from the checkpoint directory "
                           "(from_pretrained) and train without resume_from_checkpoint: new optimizer states",
                           ", ".join(changed))
        new_groups = [{**g, **sg, "params": g["params"]} for g, sg in zip(groups, saved_groups)]
        id_map = {old: (p, ng) for g, sg, ng in zip(groups, saved_groups, new_groups)
                  for old, p in zip(sg["params"], g["params"])}
        new_state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        id_map_group = {id(p): ng for p, ng in id_map.values()}
        for key, saved in state_dict["state"].items():
            if key not in id_map:
                problems.append(f"state for parameter index {key!r}, which no group lists")
                continue
            p, group = id_map[key]
            restored = _restore_state(p, saved, int(group["block_size"]), f"parameter {key}", problems,
                                      self._state_alloc)
            if restored is not None:
                new_state[p] = restored
        if problems:
            raise ValueError("cannot load optimizer state:\n  - " + "\n  - ".join(_collapse(problems)))
        # fp32_state_params (fp32_state_modules) is not a group option: compare each restored state with this run's
        # choice, so that a resume naming other modules is told it keeps the saved states, as for the options above
        kept8 = sum(1 for p, st in new_state.items() if st["state1"].dtype == torch.uint8
                    and id(p) in self._fp32_state_ids)
        kept32 = sum(1 for p, st in new_state.items() if st["state1"].dtype != torch.uint8
                     and self._wants_8bit(p, id_map_group[id(p)]))
        kept = [f"{kept8} parameters' 8-bit states that this run's fp32_state_modules / fp32_state_params asks "
                "fp32 for"] * bool(kept8) + [f"{kept32} parameters' fp32 states that this run would store in 8 "
                                             "bits"] * bool(kept32)
        if kept:
            logger.warning("the loaded optimizer state keeps %s; continuing with the saved states. To change them, "
                           "load the model from the checkpoint directory (from_pretrained) and train without "
                           "resume_from_checkpoint", " and ".join(kept))
        with self._prep_lock:
            self._prep_ready.clear()
        self.__setstate__({"state": new_state, "param_groups": new_groups})
        self._group_index, self._numbers = {}, None
        self._pending = None
        self.last_step_skipped = False
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


# ---------------------------------------------------------------------- helpers
#: group options that decide how a parameter's states are stored (a resumed run keeps the saved ones)
_LAYOUT_OPTIONS = ("block_size", "min_8bit_size", "state_dtype", "master_weights")


def _validate_group(group: dict[str, Any]) -> list[str]:
    """Every problem with a group's options, as messages naming the option, the rule and the value."""
    problems: list[str] = []

    def number(key: str, value: Any, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
        if not ok:
            rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            problems.append(f"{key} must be a number in {rng}, but got {value!r}")

    lr = group.get("lr")
    if isinstance(lr, Tensor):
        lr = float(lr)
    number("lr (TrainingArguments.learning_rate)", lr, 0.0, math.inf, hi_open=True)
    betas = group.get("betas")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        problems.append(f"betas must be a pair (beta1, beta2), but got {betas!r}")
    else:
        number("betas[0] (adam_beta1)", betas[0], 0.0, 1.0, hi_open=True)
        number("betas[1] (adam_beta2)", betas[1], 0.0, 1.0, hi_open=True)
    number("eps (adam_epsilon)", group.get("eps"), 0.0, math.inf, hi_open=True)
    number("weight_decay", group.get("weight_decay"), 0.0, math.inf, hi_open=True)
    bs = group.get("block_size")
    if not isinstance(bs, int) or isinstance(bs, bool) or not 64 <= bs <= 65536 or bs & (bs - 1):
        problems.append(f"block_size must be a power of two in [64, 65536], but got {bs!r}")
    m8 = group.get("min_8bit_size")
    if not isinstance(m8, int) or isinstance(m8, bool) or m8 < 0:
        problems.append(f"min_8bit_size must be an integer >= 0, but got {m8!r}")
    if group.get("state_dtype") not in _STATE_DTYPES:
        problems.append(f"state_dtype must be one of {list(_STATE_DTYPES)}, but got {group.get('state_dtype')!r}")
    if group.get("master_weights") not in _MASTER_CHOICES:
        problems.append(f"master_weights must be one of {list(_MASTER_CHOICES)}, but got "
                        f"{group.get('master_weights')!r}")
    return problems


def _collapse(problems: list[str], shown: int = 5) -> list[str]:
    """Problems ``"parameter K: text"`` that share their text, as one line naming the first `shown` parameters and
    how many there are (a checkpoint of another optimizer fails on every parameter: one line, not hundreds)."""
    by_text: dict[str, list[str]] = {}
    for prob in problems:
        head, sep, text = prob.partition(": ")
        if sep and head.startswith("parameter "):
            by_text.setdefault(text, []).append(head.removeprefix("parameter "))
        else:
            by_text.setdefault(prob, []).append("")
    out = []
    for text, who in by_text.items():
        if len(who) == 1:
            out.append(f"parameter {who[0]}: {text}" if who[0] else text)
        else:
            more = f" and {len(who) - shown} more" if len(who) > shown else ""
            out.append(f"parameters {', '.join(who[:shown])}{more} ({len(who)} in all): {text}")
    return out


def _resolve_master(choice: str, dtype: torch.dtype) -> str:
    """``"fp32"``, ``"kahan"``, ``"stochastic"`` or ``"none"`` for a parameter of ``dtype`` under the
    ``master_weights`` option `choice` (fp32 params never need one; "auto": kahan for bf16, fp32 for fp16;
    "stochastic": bf16 only, fp32 for fp16)."""
    if dtype not in _LOW_PRECISION or choice == "none":
        return "none"
    if choice == "auto":
        return "kahan" if dtype == torch.bfloat16 else "fp32"
    if choice == "stochastic" and dtype != torch.bfloat16:
        return "fp32"
    return choice


def _alloc_like(p: Tensor, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                alloc: StateAllocator | None = None) -> Tensor:
    """Uninitialized tensor on ``p``'s device; from ``alloc`` when it returns one (the executor's exact-size pinned
    arena for streamed layers, whose states may be streamed to the GPU). Other host states stay pageable even for a
    pinned ``p``: the CPU updates them in place and they never cross PCIe, and the caching host allocator would round
    each up to a power of two (a 248k x 5120 fp32 moment: 5.1 GB locked as 8 GiB)."""
    t = alloc(p, tuple(shape), dtype) if alloc is not None else None
    if t is not None:
        return t
    return torch.empty(shape, dtype=dtype, device=p.device)


def _saved_shape(key: str, value: Tensor, p: Tensor) -> tuple[int, ...]:
    """The shape a saved state tensor is restored in: absmax as saved (one per block), the rest as ``p``."""
    return tuple(value.shape) if key.startswith("absmax") else tuple(p.shape)


def _restore_state(p: Tensor, saved: dict[str, Any], block_size: int, where: str,
                   problems: list[str], alloc: StateAllocator | None = None) -> dict[str, Any] | None:
    """Copy one parameter's saved state next to ``p`` (device, pinnedness), keeping the saved dtypes."""
    unknown = sorted(set(saved) - _STATE_KEYS)
    if unknown:
        problems.append(f"{where}: unknown state keys {unknown} (expected {sorted(_STATE_KEYS)}); was it saved by "
                        "another optimizer? Resume with the optim that wrote it, or load the weights alone "
                        "(from_pretrained on the checkpoint directory) and train without resume_from_checkpoint")
        return None
    out: dict[str, Any] = {}
    n = p.numel()
    for key, value in saved.items():
        if key == "step":
            out[key] = int(value.item()) if isinstance(value, Tensor) else int(value)
            continue
        if not isinstance(value, Tensor):
            problems.append(f"{where}: state {key!r} must be a tensor, but got {type(value).__name__}")
            continue
        expected = num_blocks(n, block_size) if key.startswith("absmax") else n
        if value.numel() != expected:
            problems.append(f"{where}: state {key!r} has {value.numel()} elements, expected {expected} for a "
                            f"parameter of shape {tuple(p.shape)} (block_size {block_size})")
            continue
        shape = _saved_shape(key, value, p)
        out[key] = _alloc_like(p, shape, value.dtype, alloc).copy_(value.reshape(shape))
    if "step" not in out or "state1" not in out or "state2" not in out:
        problems.append(f"{where}: saved state lacks 'step', 'state1' or 'state2'")
        return None
    if out["state1"].dtype == torch.uint8 and ("absmax1" not in out or "absmax2" not in out):
        problems.append(f"{where}: 8-bit states without 'absmax1'/'absmax2'")
        return None
    return out
