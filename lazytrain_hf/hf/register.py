"""Registers ``optim="lazytrain_hybrid8"`` with transformers, so an unchanged HF script can select it.

transformers validates `TrainingArguments.optim` against the `OptimizerNames` enum (training_args.py) and
dispatches through `_OPTIMIZER_HANDLERS` (trainer_optimizer.py), which `Trainer.get_optimizer_cls_and_kwargs`
consults; both need the entry (verified on transformers 5.17 and 5.24).

Pickle compatibility: the Trainer saves `TrainingArguments` with `torch.save` (training_args.bin). The added enum
member pickles as the plain string "lazytrain_hybrid8", so the file loads in a process that never imports this
plugin.
"""

from __future__ import annotations

import enum
import importlib.abc
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = ["OPTIM_NAME", "register", "register_on_import", "is_registered", "parse_optim_args",
           "parse_optim_args_text"]

logger = logging.getLogger(__name__)

OPTIM_NAME = "lazytrain_hybrid8"
_MEMBER_NAME = "LAZYTRAIN_HYBRID8"
_SUPPORTED = "transformers 5.x (checked: 5.17, 5.24)"


#: `optim_args` keys the handler understands, and how each value is read
_OPTIM_ARGS: dict[str, Callable[[str], Any]] = {
    "block_size": int, "min_8bit_size": int, "state_dtype": str, "master_weights": str,
    "fp32_state_modules": lambda v: [m for m in v.split("|") if m],
}


def parse_optim_args(optim_args: dict[str, str] | None, model: Any = None) -> dict[str, Any]:
    """The handler's reading of `TrainingArguments.optim_args` (already split by transformers into {key: str}).

    Raises:
        ValueError: unknown keys, values of the wrong type and values the optimizer refuses (block_size not a
            power of two in [64, 65536], min_8bit_size < 0, state_dtype / master_weights not one of the choices),
            all listed in one message with an example; with `model`, also fp32_state_modules parts that match no
            parameter name of it.
    """
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in (optim_args or {}).items():
        if key not in _OPTIM_ARGS:
            problems.append(f"{key!r} is not understood (allowed: {', '.join(sorted(_OPTIM_ARGS))})")
            continue
        try:
            out[key] = _OPTIM_ARGS[key](value)
        except ValueError:
            problems.append(f"{key}={value!r} is not {'an integer' if _OPTIM_ARGS[key] is int else 'valid'}")
    problems += _value_problems(out)
    if model is not None and out.get("fp32_state_modules"):   # the name check joins the list when the model is known
        problems += [m for m in [_unmatched_modules(model, out["fp32_state_modules"])] if m]
    if problems:
        raise ValueError(f"optim_args for optim={OPTIM_NAME!r}: " + "; ".join(problems) + ". Example: "
                         "optim_args='block_size=256,master_weights=kahan,fp32_state_modules=q_proj|k_proj'")
    return out


def parse_optim_args_text(optim_args: str | None) -> dict[str, Any]:
    """`parse_optim_args` of the `TrainingArguments.optim_args` string, split as transformers splits it (for code
    that sees the string before the Trainer does: LazyTrainingArguments, LazyTrainer).

    Raises:
        ValueError: as `parse_optim_args`, or an entry that is not one key=value pair (message naming the fix).
    """
    from transformers.trainer_optimizer import _parse_optim_args

    entries = (optim_args or "").replace(" ", "").split(",") if optim_args else []
    bad = [e for e in entries if e.count("=") != 1 or ";" in e]  # transformers' split would fail or keep ';'
    if bad:
        read = dict(e.split("=") for e in entries if e not in bad)
        fixed = ",".join(e.replace(";", ",") for e in entries)
        fixed = fixed if ";" in optim_args and all(e.count("=") == 1 for e in fixed.split(",")) else None
        raise ValueError(f"optim_args={optim_args!r}: the format is comma-separated key=value pairs (as "
                         f"TrainingArguments.optim_args, split at ',' then '='), but {bad} "
                         f"{'is' if len(bad) == 1 else 'are'} not one key=value pair"
                         + (" (';' is no separator)" if ";" in optim_args else "") + f"; read so far: {read}. "
                         + (f"Fix: optim_args={fixed!r}" if fixed else "Fix: e.g. optim_args='block_size=256,"
                                                                       "master_weights=kahan'"))
    return parse_optim_args(_parse_optim_args(optim_args))


def _value_problems(parsed: dict[str, Any]) -> list[str]:
    """The optimizer's own rules (power-of-two block_size, state_dtype / master_weights choices, ...) for the keys
    `parsed` sets, so that a bad value is reported with the unknown / unreadable keys instead of one round later."""
    from ..optim.hybrid8 import _validate_group

    layout = {k: (v.lower() if isinstance(v, str) else v) for k, v in parsed.items() if k != "fp32_state_modules"}
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "block_size": 256,
             "min_8bit_size": 4096, "state_dtype": "8bit", "master_weights": "auto", **layout}
    return [p for p in _validate_group(group) if p.split(" ", 1)[0] in layout]


def _handler(ctx: Any) -> tuple[Any, dict[str, Any]]:
    """transformers optimizer handler: (optimizer class, kwargs) from the Trainer's OptimizerContext.

    `optim_args` keys understood: block_size, min_8bit_size, state_dtype (8bit|fp32), master_weights
    (auto|fp32|kahan|stochastic|none), fp32_state_modules (parameter-name substrings separated by "|", e.g. q_proj|k_proj:
    those parameters keep fp32 states). Embedding and lm_head parameters keep fp32 states (LazyTrainer drops them
    from the list with lazytrain_config.resident_state_dtype='8bit').
    """
    from ..optim import Hybrid8bitOptimizer

    kwargs: dict[str, Any] = dict(ctx.optimizer_kwargs)
    kwargs.update(ctx.adam_kwargs)
    kwargs.update(parse_optim_args(ctx.optim_args, model=ctx.model))
    modules = kwargs.pop("fp32_state_modules", None) or []
    model = ctx.model
    if model is not None:
        fp32 = []
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            mod = getattr(model, getter, lambda: None)()
            if mod is not None and getattr(mod, "weight", None) is not None:
                fp32.append(mod.weight)
        kwargs["fp32_state_params"] = fp32 + params_named(model, modules)
    return Hybrid8bitOptimizer, kwargs


def params_named(model: Any, parts: list[str]) -> list[Any]:
    """The parameters of `model` whose name contains any of `parts` (fp32_state_modules).

    Raises:
        ValueError: a part matches no parameter name (a typo would otherwise silently leave those parameters on
            8-bit states); the message gives the model's names to pick from.
    """
    if not parts:
        return []
    problem = _unmatched_modules(model, parts)
    if problem:
        raise ValueError(problem)
    return [p for n, p in model.named_parameters() if any(m in n for m in parts)]


def _unmatched_modules(model: Any, parts: list[str]) -> str | None:
    """The message for the `parts` that match no parameter name of `model`, listing its module names; None if all
    match."""
    names = [n for n, _ in model.named_parameters()]
    unmatched = [m for m in parts if not any(m in n for n in names)]
    if not unmatched:
        return None
    leaves = sorted({n.rsplit(".", 2)[-2] for n in names if n.count(".") >= 1})
    return (f"fp32_state_modules: {unmatched} match no parameter name of this model; use parts of its names such as "
            f"{leaves} (separated by '|', e.g. fp32_state_modules=q_proj|k_proj)")


class _PlainStrReduce:
    """`__reduce_ex__` for OptimizerNames that pickles our member as a plain str (see module docstring)."""

    def __init__(self, original: Any) -> None:
        self.original = original

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        original = self.original.__get__(obj, objtype)
        if getattr(obj, "_value_", None) == OPTIM_NAME:
            return lambda protocol=None: (str, (OPTIM_NAME,))
        return original


def register() -> None:
    """Add "lazytrain_hybrid8" to transformers' OptimizerNames and optimizer handler table (idempotent).

    Raises:
        ImportError: this transformers version lacks `OptimizerNames` or `_OPTIMIZER_HANDLERS` (version drift);
            the message names the versions this plugin supports.
    """
    try:
        from transformers import trainer_optimizer, training_args
    except ImportError as e:
        _version_error(e)
    _patch_optimizer_names(training_args)
    _patch_handlers(trainer_optimizer)
    from transformers import trainer

    _patch_trainer(trainer)


def _version_error(e: Exception) -> NoReturn:
    import transformers

    raise ImportError(
        f"lazytrain_hf cannot register optim={OPTIM_NAME!r} with transformers {transformers.__version__}: "
        f"{e}. Supported: {_SUPPORTED}; install a supported version (pip install 'transformers>=5,<6')."
    ) from e


def _patch_optimizer_names(training_args: Any) -> None:
    """The enum member, in `transformers.training_args` (what `TrainingArguments(optim=...)` validates against)."""
    try:
        OptimizerNames = training_args.OptimizerNames  # noqa: N806
    except AttributeError as e:
        _version_error(e)
    if not issubclass(OptimizerNames, enum.Enum):
        raise ImportError(f"transformers' OptimizerNames changed shape; supported: {_SUPPORTED}")
    if OPTIM_NAME not in OptimizerNames._value2member_map_:
        member = str.__new__(OptimizerNames, OPTIM_NAME)
        member._name_ = _MEMBER_NAME
        member._value_ = OPTIM_NAME
        member.__objclass__ = OptimizerNames
        member._sort_order_ = len(OptimizerNames._member_names_)
        OptimizerNames._member_map_[_MEMBER_NAME] = member
        OptimizerNames._value2member_map_[OPTIM_NAME] = member
        OptimizerNames._member_names_.append(_MEMBER_NAME)
        type.__setattr__(OptimizerNames, _MEMBER_NAME, member)
        if not isinstance(OptimizerNames.__dict__.get("__reduce_ex__"), _PlainStrReduce):
            type.__setattr__(OptimizerNames, "__reduce_ex__", _PlainStrReduce(enum.Enum.__reduce_ex__))


def _patch_handlers(trainer_optimizer: Any) -> None:
    """The handler, in `transformers.trainer_optimizer` (what `Trainer.get_optimizer_cls_and_kwargs` consults)."""
    try:
        handlers = trainer_optimizer._OPTIMIZER_HANDLERS
    except AttributeError as e:
        _version_error(e)
    if not isinstance(handlers, dict):
        raise ImportError(f"transformers' _OPTIMIZER_HANDLERS changed shape; supported: {_SUPPORTED}")
    # trainer_optimizer imports training_args, so that module is complete here
    _patch_optimizer_names(sys.modules["transformers.training_args"])
    OptimizerNames = sys.modules["transformers.training_args"].OptimizerNames  # noqa: N806
    handlers[OptimizerNames(OPTIM_NAME)] = _handler


def _patch_trainer(trainer: Any) -> None:
    """Fused clipping and the non-finite-norm skip without clipping, in `transformers.trainer.Trainer`."""
    Trainer = trainer.Trainer  # noqa: N806
    if not getattr(Trainer._clip_grad_norm, "_lazytrain_fused", False):
        Trainer._clip_grad_norm = _fused_clip_grad_norm(Trainer._clip_grad_norm)
    if hasattr(Trainer, "_get_grad_norm") and not getattr(Trainer._get_grad_norm, "_lazytrain_fused", False):
        Trainer._get_grad_norm = _fused_get_grad_norm(Trainer._get_grad_norm)


#: transformers module -> what registering does to it once it is imported
_PATCHES: dict[str, Callable[[Any], None]] = {
    "transformers.training_args": _patch_optimizer_names,
    "transformers.trainer_optimizer": _patch_handlers,
    "transformers.trainer": _patch_trainer,
}


def register_on_import() -> None:
    """Register without importing transformers: patch the modules of `_PATCHES` already imported now, and each of
    the others right after it is imported (a `sys.meta_path` hook). `import lazytrain_hf` calls this, so a script
    that imports the plugin and then transformers gets the optimizer, while `lazytrain-hf` can parse and check its
    arguments before paying for torch / transformers (~13 s)."""
    pending = {}
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            pending[name] = patch
        else:
            _apply(patch, module)
    if pending and not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook(pending))


def _apply(patch: Callable[[Any], None], module: Any) -> None:
    try:
        patch(module)
    except ImportError as e:  # never break the user's `import transformers...` itself; say why the optim is missing
        warnings.warn(str(e), stacklevel=2)


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of `pending` it asks the other finders for the spec and wraps that
    loader's `exec_module` so the patch runs as soon as the module body has run; removes itself when done."""

    def __init__(self, pending: dict[str, Callable[[Any], None]]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, exec_module = spec.loader, spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch = self.pending.pop(module.__name__, None)
            if patch is not None:
                _apply(patch, module)
            if not self.pending and self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = exec_and_patch  # this spec's own loader instance
        return spec


def _fused_optimizer(trainer: Any, model: Any) -> Any:
    """The trainer's Hybrid8bitOptimizer when it may compute the global gradient norm itself: a plain
    single-device or DDP run (gradients already reduced, no fp16 loss scaler); None for FSDP, DeepSpeed, XLA, mixed
    device meshes, fp16 scaling and other optimizers (they keep the Trainer's own path)."""
    from accelerate.utils import DistributedType

    from ..optim import Hybrid8bitOptimizer

    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    plain = (trainer.accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU,
                                                      DistributedType.MULTI_CPU)
             and getattr(trainer.accelerator, "scaler", None) is None
             and not getattr(trainer, "is_fsdp_enabled", False) and not getattr(trainer, "is_deepspeed_enabled", False)
             and not (hasattr(trainer, "_has_mixed_mesh_grads") and trainer._has_mixed_mesh_grads(model)))
    return opt if isinstance(opt, Hybrid8bitOptimizer) and plain else None


def _fused_clip_grad_norm(original: Any) -> Any:
    """Wrap `Trainer._clip_grad_norm`: with a fused-capable Hybrid8bitOptimizer (`_fused_optimizer`) the optimizer
    computes the pre-clip global norm and folds the clip coefficient into its next update instead of the Trainer
    scaling every gradient in a separate pass."""

    def _clip_grad_norm(self: Any, model: Any) -> Any:
        opt = _fused_optimizer(self, model)
        return opt.clip_grad_norm(self.args.max_grad_norm) if opt is not None else original(self, model)

    _clip_grad_norm._lazytrain_fused = True  # type: ignore[attr-defined]
    return _clip_grad_norm


def _fused_get_grad_norm(original: Any) -> Any:
    """Wrap `Trainer._get_grad_norm` (called with grad_norm=None when max_grad_norm is 0: no clipping): the
    optimizer computes the norm with an infinite max norm, so a non-finite norm still skips its step, as with
    clipping (the Trainer's own pass would let NaN reach the weights)."""

    def _get_grad_norm(self: Any, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            opt = _fused_optimizer(self, model)
            if opt is not None:
                grad_norm = opt.clip_grad_norm(float("inf"))
        return original(self, model, grad_norm=grad_norm)

    _get_grad_norm._lazytrain_fused = True  # type: ignore[attr-defined]
    return _get_grad_norm


def is_registered() -> bool:
    try:
        from transformers import trainer_optimizer
        from transformers.training_args import OptimizerNames
    except ImportError:
        return False
    return OPTIM_NAME in OptimizerNames._value2member_map_ and OPTIM_NAME in trainer_optimizer._OPTIMIZER_HANDLERS
