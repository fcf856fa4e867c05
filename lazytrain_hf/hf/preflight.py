"""Checks of a LazyTrainer run against the limits the process really has (profiling/limits.py), each raising one
error naming the need, the limit and where it came from, and the fix, before the resource is taken:

- `check_host_before_pinning`: when the trainer is built, before the executor page-locks the weights, gradients and
  optimizer states: those bytes (the plan's fixed host bytes) against the host-memory limit (cgroup, available RAM)
  shared by the ranks on this host; an explicit `host_memory_budget` above the limit is refused too. With one host
  copy of the weights for the host's ranks (`dp_host_weights`), that copy against the free space of /dev/shm.
- `check_plan`: at train begin, the plan's host bytes against the limit, its NVMe bytes against the free space of
  `nvme_dir`.
- `check_checkpoint_space`: at train begin (when checkpoints are saved) and before each save, a checkpoint's size
  (`checkpoint_bytes`: parameters and optimizer states) against the free space of the output directory.

RLIMIT_MEMLOCK bounds mlock() only: the executor page-locks through the CUDA driver (cudaHostRegister, pinned
copies), which that limit does not bound, so it is reported (`memlock_note`) and not enforced.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..config import format_bytes
from ..profiling.limits import Limit, check_need, disk_free, host_memory_limit, memlock_limit
from ..streaming.shared_host import check_shm_space, segment_bytes

__all__ = ["host_limit_per_rank", "fixed_host_bytes", "check_host_before_pinning", "check_plan", "checkpoint_bytes",
           "saved_model_bytes", "check_checkpoint_space", "memlock_note", "ranks_per_host", "shared_weight_ranks",
           "shared_copy_bytes"]

logger = logging.getLogger(__name__)

#: bytes of a checkpoint beyond parameters and optimizer states (configs, scheduler, RNG, trainer state, schedule)
CHECKPOINT_OVERHEAD_BYTES = 16 << 20


def ranks_per_host() -> int:
    """Processes of this run on this host (LOCAL_WORLD_SIZE; 1 without data parallelism)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def shared_weight_ranks(cfg: Any) -> int:
    """The ranks on this host that will map one host copy of the streamed weights (`dp_host_weights`,
    streaming/shared_host.py), from LOCAL_WORLD_SIZE before the executor exists; 1: each rank its own copy."""
    n = ranks_per_host()
    return n if cfg.resolved_dp_host_weights(n) == "shared" else 1


def host_limit_per_rank(ranks: int | None = None) -> Limit:
    """This rank's share of the host-memory limit (`profiling.limits.host_memory_limit` / ranks on this host)."""
    lim = host_memory_limit()
    n = ranks or ranks_per_host()
    if n == 1:
        return lim
    return Limit(lim.bytes // n, f"{lim.source}, shared by {n} ranks on this host", lim.detail)


def _host_fixes(cfg: Any, plan_part: bool) -> str:
    fixes = []
    if plan_part:
        fixes += ["a smaller per_device_train_batch_size (fewer activations kept on the host)",
                  "the NVMe tier (lazytrain_config.nvme_dir on a fast disk, activation_tier 'nvme')"]
    if cfg.master_weights in ("fp32", "auto"):
        fixes.append("lazytrain_config.master_weights='kahan' (2 bytes per parameter instead of 4)")
    if cfg.state_dtype == "fp32":
        fixes.append("lazytrain_config.state_dtype='8bit' (2 bytes per parameter of moments instead of 8)")
    n = ranks_per_host()
    if n > 1 and shared_weight_ranks(cfg) == 1 and cfg.resolved_dp_updates() == "sharded":
        fixes.append(f"lazytrain_config.dp_host_weights='shared' (one copy of the weights for the {n} ranks on this "
                     "host instead of one each)")
    if n > 1:
        copy = "its own gradients and optimizer states" if shared_weight_ranks(cfg) > 1 else "its own host copy"
        fixes.append(f"fewer ranks per host (now {n}, each holds {copy})")
    fixes.append("a larger memory limit (docker --memory, the Kubernetes memory limit) or a machine with more RAM")
    return ", or ".join(fixes)


def fixed_host_bytes(trainer: Any) -> int:
    """Host bytes per rank the run takes whatever the plan: weights, gradients, optimizer states and master weights
    of the streamed layers, frozen layers' weights only (LoRA's base; `peft_support.model_frozen_costs`), weights
    shared by the host's ranks by this rank's share (`shared_weight_ranks`) (the analytic cost model's
    `host_fixed_bytes` with the embedding and LM head on the GPU, the placement taking the least host memory unless
    one is configured)."""
    from ..profiling.analytic import analytic_cost_model
    from .peft_support import model_frozen_costs
    from .plan import master_weights_priced, run_shape

    cfg = trainer.lazy_config
    B, T = run_shape(trainer)
    resident = cfg.resident_placement if cfg.resident_placement != "auto" else "gpu"
    if resident == "host_embedding" and getattr(trainer.model.config, "tie_word_embeddings", False):
        resident = "gpu"
    cm = analytic_cost_model(trainer.model.config, B, T, gpu_bytes=1, host_bytes=1,
                             state_dtype=cfg.state_dtype,
                             master_weights="fp32" if cfg.master_weights == "auto" else
                             master_weights_priced(cfg.master_weights, trainer.model),
                             block_size=cfg.block_size, resident=resident, host_weight_ranks=shared_weight_ranks(cfg),
                             **model_frozen_costs(trainer.model))
    return int(cm.host_fixed_bytes)


def shared_copy_bytes(model: Any) -> int:
    """Bytes of the one host copy of `model`'s decoder layers' weights that the host's ranks share
    (streaming/shared_host.py: every buffer on its own pages)."""
    from ..streaming.host_store import layer_layout
    from ..streaming.layer_calls import find_decoder, unwrap_peft

    base, _ = find_decoder(unwrap_peft(model))
    return segment_bytes([layer_layout(layer).sizes for layer in base.layers])


def check_host_before_pinning(trainer: Any) -> Limit:
    """Before the executor is built (it page-locks the layers' weights and gradients, then the optimizer states):
    with one host copy of the weights for the ranks of this host (`shared_weight_ranks`), its bytes against the free
    space of /dev/shm; `fixed_host_bytes` against this rank's share of the host-memory limit, and an explicit
    `host_memory_budget` against it. Returns the limit.

    Raises:
        ResourceLimitError: /dev/shm is too small for the shared copy, or the run's host memory is above the limit
            (need, limit and its source, fix).
    """
    cfg = trainer.lazy_config
    shared = shared_weight_ranks(cfg)
    if shared > 1:
        check_shm_space(shared_copy_bytes(trainer.model), shared)
    lim = host_limit_per_rank()
    check_need(fixed_host_bytes(trainer), lim, "the model's weights, gradients and optimizer states on the host",
               _host_fixes(cfg, plan_part=False))
    if cfg.host_memory_budget and cfg.host_memory_budget > lim.bytes:
        check_need(int(cfg.host_memory_budget), lim, f"lazytrain_config.host_memory_budget="
                   f"'{format_bytes(cfg.host_memory_budget)}'",
                   f"set host_memory_budget to at most '{int(0.9 * lim.bytes) >> 20}MiB' or leave it unset (the "
                   "default is 90% of this limit)")
    return lim


def check_plan(trainer: Any, schedule: Any) -> None:
    """At train begin: the plan's predicted host bytes against the host-memory limit and its NVMe bytes against the
    free space of `nvme_dir` (plans without predictions, e.g. a loaded schedule, are not checked).

    Raises:
        ResourceLimitError: the plan needs more than the limit or the free space.
    """
    cfg = trainer.lazy_config
    p = getattr(schedule, "predicted", None) or {}
    host = int(p.get("pinned_host_bytes") or 0)
    if host:
        check_need(host, host_limit_per_rank(), f"the plan ({schedule.policy}) on the host",
                   _host_fixes(cfg, plan_part=True))
    nvme = int(p.get("nvme_bytes") or 0)
    if nvme and cfg.nvme_dir:
        check_need(nvme, disk_free(cfg.nvme_dir), f"the plan's NVMe tier in {cfg.nvme_dir!r}",
                   "free space there, point lazytrain_config.nvme_dir at a disk with room, or set a smaller "
                   "lazytrain_config.nvme_budget")


def checkpoint_bytes(trainer: Any) -> int:
    """A checkpoint's size: the model's saved weights (`saved_model_bytes`: a PEFT model's adapters only) and the
    optimizer's states of every parameter it updates (the states held, plus, for parameters without them yet or held
    by another rank under sharded updates, what their first step allocates: the optimizer's `state_specs`; another
    optimizer without states yet: two fp32 moments per trainable parameter), plus a small allowance for the other
    files."""
    import torch

    params = {id(p): p for p in trainer.model.parameters()}.values()
    model = saved_model_bytes(trainer.model)
    opt = getattr(trainer, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)
    held = getattr(inner, "state", None) or {}
    states = sum(v.numel() * v.element_size() for st in held.values() for v in st.values()
                 if isinstance(v, torch.Tensor))
    specs = getattr(inner, "state_specs", None)
    if specs is not None:
        states += sum(int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
                      for _p, shape, dt in specs())
    elif not held:
        states = 8 * sum(p.numel() for p in params if p.requires_grad)
    if getattr(trainer.args, "save_only_model", False):
        states = 0
    return int(model + states + CHECKPOINT_OVERHEAD_BYTES)


def saved_model_bytes(model: Any) -> int:
    """Bytes of the weights `save_model` writes for `model`: a PEFT model's adapters (every adapter's
    `get_peft_model_state_dict`, modules_to_save included), not its frozen base; else each parameter once."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        from peft.utils import get_peft_model_state_dict

        tensors = {id(t): t for name in model.peft_config for t in get_peft_model_state_dict(
            model, adapter_name=name).values()}.values()
    else:
        tensors = {id(p): p for p in model.parameters()}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def check_checkpoint_space(trainer: Any, directory: str, need: int | None = None) -> None:
    """A checkpoint (`checkpoint_bytes`, or `need`) against the free space of `directory` (the output directory;
    a checkpoint is written whole before the previous one is rotated out).

    Raises:
        ResourceLimitError: not enough free space (the need, the free bytes, the fix).
    """
    need = checkpoint_bytes(trainer) if need is None else int(need)
    check_need(need, disk_free(directory), f"a checkpoint in {directory!r}",
               "free space there, set TrainingArguments.save_total_limit (fewer checkpoints kept), point output_dir "
               "at a larger disk, or save_only_model=True (no optimizer states: no exact resume)")


def memlock_note(pin: bool) -> str | None:
    """A line about RLIMIT_MEMLOCK when it is finite and the run page-locks host memory (the CUDA driver's
    page-locking is not bounded by it: nothing to enforce), else None."""
    lim = memlock_limit()
    if lim is None or not pin:
        return None
    return (f"RLIMIT_MEMLOCK is {format_bytes(lim.bytes)}; the executor page-locks host memory through the CUDA "
            "driver (cudaHostRegister, pinned copies), which that limit does not bound")


def check_host_before_building(config: Any, dtype: str, name: str, quantization: dict[str, Any] | None = None
                               ) -> None:
    """Before a model is built or loaded (`models.load_model`): its weights in `dtype` against this rank's share of
    the host-memory limit, so that a model too large for the host is one error instead of minutes of allocation and
    an out-of-memory kill. The run needs more than its weights (gradients, optimizer states): the Trainer checks that
    before pinning (`check_host_before_pinning`); `lazytrain-hf plan` names it beforehand. With `quantization`
    (`BitsAndBytesConfig` fields, 4 bits): the 4-bit weights with their quantization state
    (`quantized.quantized_host_bytes`) and the other parameters in float32, as `prepare_model_for_kbit_training`
    leaves them.

    Raises:
        ResourceLimitError: the weights alone are above the limit (need, limit and its source, fix).
    """
    import torch

    from ..profiling.analytic import model_shape

    try:
        n = model_shape(config).num_params  # counted on the meta device
    except ValueError:  # no decoder layers where the executor looks (policy "none" trains any causal LM)
        return
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    need, what = n * size, f"{n / 1e9:.2f} B parameters in {dtype}"
    if quantization is not None:
        from ..quantized import quantized_host_bytes

        q = quantized_host_bytes(config, quantization, dtype)
        need = q["packed"] + q["state"] + q["other_params"] * 4
        what = f"{n / 1e9:.2f} B parameters, {q['four_bit_params'] / 1e9:.2f} B of them in 4 bits, the rest in float32"
    check_need(need, host_limit_per_rank(), f"building {name!r} ({what})",
               "a smaller model, or a machine (or container memory limit) with more memory; `lazytrain-hf plan "
               "--model ...` gives the whole run's host need")
