"""Which Gated DeltaNet (linear-attention) kernels run, chosen for the device the layers compute on.

Qwen3.5 / Qwen3.6 (`model_type="qwen3_5_text"`) and Qwen3-Next mix full-attention layers with Gated DeltaNet
layers. transformers runs those on `flash-linear-attention` (`fla`, Triton kernels) when it can import it, else
on its reference PyTorch functions (correct, several times slower, more activation memory). It binds the choice
in one of two ways, and this module reads and switches both:

- transformers >= 5.1x (5.17, 5.24 and 5.25 checked): `use_kernel_func_from_hub_with_fallback` wraps the
  module-level functions `torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn` and
  `causal_conv1d_update` when the modeling module is imported; the wrapper keeps the chosen implementation in its
  closure and `<Model>GatedDeltaNet.forward` calls the module-level names. The choice therefore belongs to the
  modeling module (every model of that architecture in the process), and switching rebinds those names there.
  Where the `kernels` package is installed (required from transformers 5.25), each wrapper is further turned into
  a `Func` nn.Module instance whose forward calls the wrapper; each GatedDeltaNet layer holds its own `Func` copies
  (`_kernel_funcs`) and routes the module-level calls to them, and `kernelize` (`use_kernels=True`) can point those
  copies, or the layer's whole forward, at a Hub kernel (recorded in the instance's `_kernel_repo`). From 5.25 the
  wrapper also sends inputs on a device fla does not support (the CPU) to the reference function.
- older transformers (5.2 .. 5.8 checked): `__init__` stores `self.chunk_gated_delta_rule`,
  `self.recurrent_gated_delta_rule`, `self.causal_conv1d_fn`, `self.causal_conv1d_update` and uses fla's
  `FusedRMSNormGated` as `self.norm`; switching sets those layer attributes.

fla importing is not enough for it to work: on CPU tensors its Triton kernels fail ("0 active drivers"), and on
Hopper (sm_90) with 3.4.0 <= Triton < 3.7.1 its gated backward (`chunk_bwd_dqkwg`) computes wrong gradients
(fla-org/flash-linear-attention#640; fla 0.6.0 raises a RuntimeError there instead) unless fla's tilelang backend
takes that kernel. `fla_usable` holds that check; `select_linear_attention` applies it to a model.

Where the reference functions run, `compile_linear_attention` compiles the GatedDeltaNet modules (`nn.Module.compile`,
default inductor), as benchmarks/bench_linear_attention.py measured them: a Qwen3.6-27B-width layer, 8 x 1024 bf16 on
an H200, forward + backward 58.1 ms instead of 83.7 ms, peak memory 12.15 instead of 5.98 GiB
(benchmarks/results/linear_attention-compile-20261202.json). LazyTrainConfig.compile_linear_attention turns it on.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["fla_usable", "select_linear_attention", "linear_attention_kernel", "linear_attention_layers",
           "use_reference_kernels", "compile_linear_attention", "TORCH_COMPILE"]

logger = logging.getLogger(__name__)

#: Triton versions whose Hopper code generation breaks fla's gated `chunk_bwd_dqkwg` (fla #640, fixed in 3.7.1).
TRITON_HOPPER_BAD = ((3, 4, 0), (3, 7, 1))

# transformers >= 5.1x: module-level names the GatedDeltaNet forward calls (gated delta rule, then the conv).
_RULE_GLOBALS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
_CONV_GLOBALS = ("causal_conv1d_fn", "causal_conv1d_update")
# Older transformers: layer attribute -> the modeling module's reference function (None: the forward's own
# nn.Conv1d path).
_RULE_ATTRS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
               "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule"}
_CONV_ATTRS = {"causal_conv1d_fn": None, "causal_conv1d_update": "torch_causal_conv1d_update"}

#: the path name of the reference functions inside compiled GatedDeltaNet modules
TORCH_COMPILE = "torch_compile"

# Log lines already written (one line per distinct decision per process).
_LOGGED: set[str] = set()


# ----------------------------------------------------------------------------------------------- environment


def _installed(name: str) -> bool:
    """A top-level package can be imported (found, not imported)."""
    return importlib.util.find_spec(name) is not None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fla_version() -> str | None:
    """fla's version: the `fla` package ships in `fla-core` from 0.5, in `flash-linear-attention` before."""
    return _version("fla-core") or _version("flash-linear-attention")


def _triton_version() -> str | None:
    v = _version("triton")
    if v is None:
        try:
            import triton

            v = getattr(triton, "__version__", None)
        except Exception:  # noqa: BLE001 - a broken triton reads as absent
            v = None
    return v


def _vtuple(v: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(v).release


def _has_nvcc() -> bool:
    """What fla's `has_usable_nvcc` checks (tilelang compiles with nvcc at first use)."""
    try:
        from fla.utils import has_usable_nvcc

        return bool(has_usable_nvcc())
    except Exception:  # noqa: BLE001 - older fla: the same guesses by hand
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        return bool((home and (Path(home) / "bin" / "nvcc").exists()) or shutil.which("nvcc")
                    or Path("/usr/local/cuda/bin/nvcc").exists())


def _tilelang_backend() -> tuple[bool, str]:
    """Whether fla routes its gated `chunk_bwd_dqkwg` to tilelang (fla.backends dispatch), with why not."""
    if os.environ.get("FLA_DISABLE_BACKEND_DISPATCH") == "1":
        return False, "FLA_DISABLE_BACKEND_DISPATCH=1 turns its tilelang backend off"
    if not _installed("tilelang"):
        return False, "tilelang is not installed"
    if os.environ.get("FLA_TILELANG") == "0":
        return False, "FLA_TILELANG=0 turns its tilelang backend off"
    try:
        has_backend = importlib.util.find_spec("fla.ops.common.backends.tilelang") is not None
    except (ImportError, ValueError):
        has_backend = False
    if not has_backend:
        return False, "this fla version has no tilelang backend"
    if not _has_nvcc():
        return False, "tilelang is installed but no nvcc was found"
    return True, "tilelang backend"


def fla_usable(device: torch.device | str) -> tuple[bool, str]:
    """Whether flash-linear-attention's gated-delta-rule kernels run correctly, forward and backward, on `device`.

    Checks, in order: a CUDA device; `fla` installed; CUDA available; on NVIDIA Hopper (compute capability 9.x)
    with 3.4.0 <= Triton < 3.7.1, fla's tilelang backend available (tilelang installed, nvcc found, not turned
    off by FLA_TILELANG=0 or FLA_DISABLE_BACKEND_DISPATCH=1). fla's FlashQLA backend (package `flash_qla`, bf16
    and head dims 128 only) is not counted: it depends on the model's shapes.

    Returns:
        (usable, reason): the reason names the versions and, when unusable, the fix.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return False, f"the layers run on {dev.type}; flash-linear-attention's Triton kernels need a CUDA GPU"
    if not _installed("fla"):
        return False, "flash-linear-attention is not installed (pip install 'lazytrain-hf[fla]')"
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    fla_v = _fla_version() or "(unknown version)"
    triton_v = _triton_version()
    if triton_v is None:
        return False, f"flash-linear-attention {fla_v} needs Triton, which is not installed"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    lo, hi = TRITON_HOPPER_BAD
    hopper = torch.version.hip is None and major == 9  # ROCm reports gfx9xx as 9.x: not Hopper
    if hopper and lo <= _vtuple(triton_v) < hi:
        ok, why = _tilelang_backend()
        if not ok:
            return False, (f"flash-linear-attention {fla_v} needs Triton >= 3.7.1 or tilelang for its gated-delta-rule "
                           f"backward on Hopper; this machine has Triton {triton_v} and {why}")
        return True, f"flash-linear-attention {fla_v}, Triton {triton_v} with the tilelang backend on sm_{major}{minor}"
    return True, f"flash-linear-attention {fla_v}, Triton {triton_v} on sm_{major}{minor}"


# ---------------------------------------------------------------------------------------------- reading layers


def _modeling_module(layer: torch.nn.Module) -> Any:
    return sys.modules[type(layer).__module__]


def _attribute_design(layer: torch.nn.Module) -> bool:
    """True for transformers that store the kernels on the layer (older releases)."""
    return "chunk_gated_delta_rule" in vars(layer)


def linear_attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet modules (Qwen3.5 / Qwen3.6 / Qwen3-Next `linear_attn`), in module order."""
    out = []
    for m in model.modules():
        if not type(m).__name__.endswith("GatedDeltaNet"):
            continue
        if _attribute_design(m) or callable(getattr(_modeling_module(m), _RULE_GLOBALS[0], None)):
            out.append(m)
    return out


def _func_target(fn: Any) -> Any:
    """The function a `kernels` Func module calls (`use_kernel_forward_from_hub` applied to a function), else None."""
    if not isinstance(fn, torch.nn.Module) or not hasattr(type(fn), "kernel_layer_name"):
        return None
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars or forward.__closure__ is None:
        return None
    return forward.__closure__[code.co_freevars.index("func")].cell_contents


def _hub_repo(module: Any) -> Any:
    """The Hub repository `kernels.kernelize` bound this module's forward to, else None."""
    if not isinstance(module, torch.nn.Module) or "forward" not in vars(module):
        return None
    return vars(module).get("_kernel_repo")


def _hub_kind(repo: Any) -> str:
    """The path name of a Hub kernel: "hub:" and its repository id (or local path)."""
    ident = getattr(repo, "_repo_id", None) or getattr(repo, "_repo_path", None) or type(repo).__name__
    return f"hub:{ident}"


def _dispatched(layer: torch.nn.Module, fn: Any) -> Any:
    """What the layer's call of the module-level kernel `fn` runs: a Func the layer class lists
    (`use_kernelized_func`) is routed to the layer's own copy, of the same class, in `_kernel_funcs`."""
    if _func_target(fn) is None:
        return fn
    own = vars(layer).get("_kernel_funcs", {}).get(getattr(fn, "kernel_layer_name", None))
    return own if own is not None and type(own) is type(fn) else fn


def _implementation(fn: Any) -> Any:
    """What a kernel callable runs: transformers' fallback wrapper keeps its choice in the closure (inside a
    `kernels` Func module where `kernels` is installed)."""
    replaced = getattr(fn, "_lazytrain_reference_of", None)
    if replaced is not None:
        return getattr(fn, "__wrapped__", fn)
    fn = _func_target(fn) or fn
    code = getattr(fn, "__code__", None)
    if code is not None and "implementation" in code.co_freevars:
        try:
            return inspect.getclosurevars(fn).nonlocals.get("implementation", fn)
        except (TypeError, ValueError):
            return fn
    return fn


def _kind(fn: Any, home: str) -> str:
    """"fla", "torch" (a reference function: defined in the layer's modeling module `home` or in transformers, or
    None for the forward's own conv path), else the implementing package."""
    if fn is None:
        return "torch"
    repo = _hub_repo(fn)
    if repo is not None:
        return _hub_kind(repo)
    module = getattr(_implementation(fn), "__module__", None) or ""
    top = module.split(".", 1)[0]
    if top == "fla":
        return "fla"
    if module == home or top == "transformers":
        return "torch"
    return top or "unknown"


def _rule_fn(layer: torch.nn.Module) -> Any:
    if _attribute_design(layer):
        return vars(layer)["chunk_gated_delta_rule"]
    return _dispatched(layer, getattr(_modeling_module(layer), _RULE_GLOBALS[0]))


def _compiled(layer: torch.nn.Module) -> bool:
    return getattr(layer, "_compiled_call_impl", None) is not None


def _layer_kind(layer: torch.nn.Module, compiled: bool = True) -> str:
    """The layer's path; `compiled=False`: what its kernel names are bound to, compiled or not."""
    repo = _hub_repo(layer)
    if repo is not None:  # kernelize replaced the whole layer's forward
        return _hub_kind(repo)
    kind = _kind(_rule_fn(layer), type(layer).__module__)
    return TORCH_COMPILE if compiled and kind == "torch" and _compiled(layer) else kind


def _one(kinds: set[str]) -> str | None:
    if not kinds:
        return None
    return kinds.pop() if len(kinds) == 1 else "mixed"


def linear_attention_kernel(model: torch.nn.Module) -> str | None:
    """The gated-delta-rule path the model's linear-attention layers are set to now, read from the layers.

    Returns:
        "fla" (flash-linear-attention), "torch" (transformers' reference PyTorch functions), "torch_compile" (those
        inside compiled modules: `compile_linear_attention`), "hub:<repository>" (a Hub kernel bound by
        `kernels.kernelize`), another package's name, "mixed" when layers differ, or None for a model without such
        layers.
    """
    return _one({_layer_kind(layer) for layer in linear_attention_layers(model)})


# -------------------------------------------------------------------------------------------------- switching


def _reference(current: Callable, torch_fn: Callable) -> Callable:
    """transformers' reference function behind a guard: it has no notion of sequence boundaries, so packed
    sequences (cu_seqlens / seq_idx) would leak into each other."""
    name = getattr(torch_fn, "__name__", "kernel")
    params = inspect.signature(torch_fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(torch_fn)
    def reference(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise ValueError(f"{name}: packed sequences (cu_seqlens / seq_idx) need flash-linear-attention; the "
                             "reference PyTorch kernel would mix the sequences. Train without packing, or on a "
                             "machine where fla_usable() is true.")
        kwargs.pop("cu_seqlens", None)
        kwargs.pop("seq_idx", None)
        if not takes_any:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        return torch_fn(*args, **kwargs)

    reference._lazytrain_reference_of = current  # type: ignore[attr-defined]
    return reference


def _torch_function(fn: Callable) -> Callable:
    """The reference PyTorch function behind transformers' fallback wrapper (inside a `kernels` Func module where
    `kernels` is installed)."""
    fn = _func_target(fn) or fn
    code = getattr(fn, "__code__", None)
    if code is not None and "torch_function" in code.co_freevars:
        ref = inspect.getclosurevars(fn).nonlocals.get("torch_function")
        if ref is not None:
            return ref
    return inspect.unwrap(fn)


def _use_reference(layers: list[torch.nn.Module], conv: bool) -> list[str]:
    """Point every layer at transformers' reference functions (the gated delta rule; the causal conv too when
    `conv`); fla's FusedRMSNormGated is replaced by the model's own gated RMSNorm sharing its weight, and a layer
    forward `kernelize` replaced with a Hub kernel is restored to the class's.

    Returns:
        what was switched ("module.name" or "layer attribute" entries), empty when nothing needed it.
    """
    changed: list[str] = []
    done_modules: set[str] = set()
    for layer in layers:
        mod = _modeling_module(layer)
        if _attribute_design(layer):
            attrs = dict(_RULE_ATTRS, **(_CONV_ATTRS if conv else {}))
            for attr, ref_name in attrs.items():
                cur = vars(layer).get(attr)
                if _kind(cur, mod.__name__) == "torch":
                    continue
                setattr(layer, attr, None if ref_name is None else getattr(mod, ref_name))
                changed.append(f"{type(layer).__name__}.{attr}")
            norm = getattr(layer, "norm", None)
            if norm is not None and type(norm).__module__.split(".", 1)[0] == "fla":
                layer.norm = _reference_norm(mod, norm, layer)
                changed.append(f"{type(layer).__name__}.norm")
            continue
        if _hub_repo(layer) is not None:
            del layer.forward
            vars(layer).pop("_kernel_repo", None)
            changed.append(f"{type(layer).__name__}.forward")
        if mod.__name__ in done_modules:
            continue
        done_modules.add(mod.__name__)
        same_module = [m for m in layers if _modeling_module(m) is mod]
        for name in _RULE_GLOBALS + (_CONV_GLOBALS if conv else ()):
            cur = getattr(mod, name, None)
            if cur is None or all(_kind(_dispatched(m, cur), mod.__name__) == "torch" for m in same_module):
                continue
            # the plain reference function: the layers' calls no longer reach their Func copies either
            setattr(mod, name, _reference(cur, _torch_function(cur)))
            changed.append(f"{mod.__name__}.{name}")
    return changed


def _reference_norm(mod: Any, norm: torch.nn.Module, layer: torch.nn.Module) -> torch.nn.Module:
    """The modeling module's gated RMSNorm (norm, then SiLU gate, as fla's FusedRMSNormGated), same weight object
    (parameter identity is kept for optimizers and host stores)."""
    cls = next((v for k, v in vars(mod).items() if k.endswith("RMSNormGated") and isinstance(v, type)), None)
    if cls is None:
        return norm
    eps = getattr(norm, "eps", getattr(layer, "layer_norm_epsilon", 1e-6))
    new = cls(norm.weight.shape[0], eps=eps)
    new.weight = norm.weight
    return new


def use_reference_kernels(model: torch.nn.Module, conv: bool = False) -> list[str]:
    """Run the model's linear-attention layers on transformers' reference PyTorch functions whatever is installed
    (benchmarks, or to rule a kernel out); the causal conv too when `conv`. Idempotent; logs nothing.

    Returns:
        what was switched ("module.name" or "Layer.attribute"), empty when nothing needed it.
    """
    return _use_reference(linear_attention_layers(model), conv=conv)


def compile_linear_attention(module: torch.nn.Module) -> int:
    """Compile every GatedDeltaNet module inside `module` that is not compiled yet (`nn.Module.compile()`, default
    inductor), in place; the first call of each input shape and grad mode compiles (a Qwen3.6-27B-width layer at
    8 x 1024 took 95 s on an H200), later ones reuse it across modules of one class. Compile the modules that run:
    a deep copy of a compiled module would keep calling the original.

    Returns:
        how many modules were compiled now (0: none, or all were already).
    """
    count = 0
    for layer in linear_attention_layers(module):
        if not _compiled(layer):
            layer.compile()
            count += 1
    return count


def _say(path: str, reason: str, warn: bool) -> None:
    label = {"fla": "flash-linear-attention kernels", "torch": "transformers' reference PyTorch kernels",
             TORCH_COMPILE: "transformers' reference PyTorch kernels, compiled with torch.compile"
             }.get(path, f"Hub kernel {path[4:]}" if path.startswith("hub:") else f"{path} kernels")
    msg = f"Gated DeltaNet layers: {label} ({reason})"
    if msg in _LOGGED:
        return
    _LOGGED.add(msg)
    (logger.warning if warn else logger.info)(msg)


def select_linear_attention(model: torch.nn.Module, device: torch.device | str, log: bool = True,
                            compile: bool = False) -> str | None:
    """Decide which gated-delta-rule kernels the model's linear-attention layers run on `device` (where they
    compute, not where the model is stored: LazyTrain keeps the model on the CPU and runs layers on the GPU), switch
    the layers to transformers' reference PyTorch functions where flash-linear-attention is bound but would fail,
    and log one line saying which path runs and why (`log=False`: the same decision, silently, for the profiler's
    layers built from the model's config). Idempotent.

    `compile`: where the reference functions run, report (and log) "torch_compile": the caller compiles the modules
    it runs with `compile_linear_attention` (this function compiles nothing: the executor runs copies of the layers).
    Where fla or a Hub kernel runs, it changes nothing.

    On a device other than CUDA the causal conv is switched to the reference too (causal-conv1d is CUDA-only).
    With transformers >= 5.1x the switch rebinds the modeling module's kernel names (see the module docstring),
    so it applies to every model of that architecture in the process, as transformers' own choice does.

    Returns:
        "fla", "torch" ("torch_compile" with `compile`), "hub:<repository>" when `kernels.kernelize` bound a Hub
        kernel or another package's name when transformers bound it (either left as is), or None for a model without
        linear-attention layers (nothing is changed or logged).
    """
    layers = linear_attention_layers(model)
    if not layers:
        return None
    dev = torch.device(device)
    current = _one({_layer_kind(layer, compiled=False) for layer in layers})
    usable, why = fla_usable(dev)
    conv = dev.type != "cuda"
    say = _say if log else (lambda *a, **kw: None)
    if current == "fla" and usable:
        say("fla", why, warn=False)
        return "fla"
    if current not in ("fla", "torch", "mixed"):
        how = "bound by kernels.kernelize (use_kernels)" if current.startswith("hub:") else "bound by transformers"
        say(current, f"{how}; left as is", warn=False)
        return current
    _use_reference(layers, conv=conv)
    if current in ("fla", "mixed") or not usable:
        reason = why
    else:  # fla would work here, but transformers did not bind it
        reason = ("transformers did not bind flash-linear-attention: it could not import it when it loaded the "
                  "model code")
    path = TORCH_COMPILE if compile else "torch"
    say(path, reason, warn=dev.type == "cuda")
    return path
