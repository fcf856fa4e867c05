"""`LazyTrainConfig`: every knob of the executor, planner and optimizer in one validated dataclass.

Resolution order for each field: the value given by the user, then the environment variable `LAZYTRAIN_<FIELD>`
(upper case; parsed by lazytrain_hf.envvars, docs/environment.md), then the default. All problems are collected and raised at once in
one `ValueError`, each message naming the key as the user wrote it, the rule, the value received and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import envvars

__all__ = ["LazyTrainConfig", "parse_bytes", "format_bytes", "GIB"]

GIB = 1024**3
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: int | float | str | None) -> int | None:
    """Parse a memory size such as ``"24GiB"``, ``"80 GB"`` or ``25769803776`` into bytes.

    Raises:
        ValueError: the string is not a number followed by one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '24GiB', but got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as '24GiB' or '80GB', but got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


#: LazyTrainConfig fields that are memory sizes (bytes, or strings such as "24GiB"), with an example value
SIZE_FIELDS = {"gpu_memory_budget": "'24GiB'", "host_memory_budget": "'100GiB'", "nvme_budget": "'200GiB'",
               "prepared_states_budget": "'20GiB' (0: off)"}


def did_you_mean(bad: list[str], known: Any, prefix: str = "") -> str:
    """' (did you mean training.max_steps?)' for the unknown keys `bad` that have a close key in `known` (difflib,
    cutoff 0.8; named `prefix.key`, or `key` without a prefix), else ''."""
    import difflib

    hints = [f"{prefix}.{m[0]}" if prefix else m[0] for k in bad
             if (m := difflib.get_close_matches(str(k), sorted(map(str, known)), n=1, cutoff=0.8))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""


def cpu_threads() -> int:
    """CPU threads for this process's optimizer kernel: the cores it may use divided among the ranks on this host
    (LOCAL_WORLD_SIZE, set by torchrun / accelerate launch; torchrun also sets OMP_NUM_THREADS=1, which would leave
    the CPU optimizer on one core). Single process: torch.get_num_threads(). Override: LAZYTRAIN_CPU_THREADS.

    Raises:
        ValueError: LAZYTRAIN_CPU_THREADS is set but not an integer >= 1.
    """
    import torch

    n = envvars.read("LAZYTRAIN_CPU_THREADS")
    if n is not None:
        return n
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    if local <= 1:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local)


def format_bytes(n: int | float | None) -> str:
    """Format bytes as GiB with two decimals (``None`` -> ``"-"``)."""
    return "-" if n is None else f"{n / GIB:.2f} GiB"


_CHOICES: dict[str, tuple[str, ...]] = {
    "policy": ("fixed", "milp", "none"),
    "device": ("auto", "cuda", "cpu"),
    "activation_tier": ("gpu", "cpu", "nvme"),
    "state_dtype": ("8bit", "fp32"),
    "master_weights": ("auto", "fp32", "kahan", "none"),
    "dp_updates": ("auto", "replicated", "sharded"),
    "resident_placement": ("auto", "gpu", "host_embedding", "host"),
}


@dataclass
class LazyTrainConfig:
    """Configuration of the LazyTrain executor, planner and Hybrid 8-bit optimizer.

    A field the caller gives (a constructor argument, positional or by name, or a key of the dict / YAML / JSON
    config passed to `from_any`) is used as given, even when it equals the default. A field not given is filled
    from the environment variable `LAZYTRAIN_<FIELD>` when it is set (lazytrain_hf.envvars parses it; a bad value
    is one of the problems raised), else takes its default. `__init__` records the given names for
    `__post_init__`, which drops them: instances hold only their fields (`==`, `asdict`, pickling as a plain
    dataclass). `dataclasses.replace` passes every field, so a copy keeps its values.

    Args:
        policy (str, defaults to "fixed"): how the schedule is made. "fixed": the MegaTrain-equivalent baseline
            (a checkpoint every `checkpoint_every` layers, boundaries in `activation_tier`); "milp": solved by the
            HiGHS planner (lazytrain_hf.planning); "none": no executor, the plain HF Trainer path.
        device (str, defaults to "auto"): compute device of the executor: "cuda" when available, else "cpu".
        checkpoint_every (int, defaults to 4): fixed policy: materialize the input of every k-th decoder layer;
            layers in between are recomputed in backward.
        activation_tier (str, defaults to "gpu"): fixed policy: where materialized boundaries live
            ("gpu" = the compute device, "cpu" = pinned host memory, "nvme" = files in `nvme_dir`).
        prefetch_depth (int, defaults to 1): number of decoder layers whose weights are streamed ahead of
            compute (1-3); the device holds `prefetch_depth + 1` weight slots per layer structure.
        gpu_memory_budget (str or int, defaults to None): device memory the plan may use, e.g. "24GiB".
            None: what the device reports free. Also caps the process with
            `torch.cuda.set_per_process_memory_fraction` when `cap_gpu_memory` is true.
        cap_gpu_memory (bool, defaults to False): enforce `gpu_memory_budget` on the CUDA caching allocator
            (emulates a smaller GPU).
        gpu_memory_margin (float, defaults to 0.12): fraction of the GPU budget the MILP keeps free for allocator
            fragmentation and workspaces the analytic cost model does not count. On the H200 (benchmarks/NOTES.md,
            2026-11-29) a plan predicted at 23.4 GB ran out of memory under a 25.8 GB cap: >= 9% under-prediction.
        host_memory_budget (str or int, defaults to None): pinned host memory the plan may use (per process). None:
            90% of RAM divided among the data-parallel ranks on this host (LOCAL_WORLD_SIZE).
        nvme_dir (str, defaults to None): directory for the "nvme" tier; required when that tier is used.
        nvme_budget (str or int, defaults to None): bytes the plan may write to `nvme_dir`.
        pin_memory (bool, defaults to True): keep host weights and gradients in pinned (page-locked) memory
            when the device is CUDA (needed for asynchronous H2D/D2H copies).
        max_rows_per_pass (int, defaults to None): rows (sequences) of a micro-batch a decoder layer processes at
            once; the layer runs over the micro-batch in row chunks with its weights loaded once, so a layer's
            activation memory scales with this instead of the micro-batch size. None: the whole micro-batch.
        overlap_optimizer (bool, defaults to True): run the streamed layers' optimizer updates on a CPU worker
            overlapped with the next forward (layer i's update must land before layer i is streamed in) instead
            of serially inside `optimizer.step()`.
        gpu_layer_updates (bool, defaults to True): let the MILP place streamed layers' optimizer updates on the
            GPU (run at the layer's next load, streamed states; needs overlap_optimizer and a CUDA device); the
            plan moves a layer only where the cost model predicts a shorter step. Measured on an H200 (Qwen2.5-7B shape, 24 GiB
            cap, 16 cores): 1.5x the CPU-only MILP plan at batch 8, 1.14x at batch 64 (benchmarks/NOTES.md).
        keep_gpu_grads (bool, defaults to True): a GPU-updated layer keeps its gradient on the GPU from its
            backward to its update at the next load, instead of sending it D2H and back H2D (2 bytes per parameter
            each way); the plan budgets the GPU memory it holds. Only with gradient_accumulation_steps 1 (with
            accumulation the host sums the gradients); False sends every gradient to the host. Both also apply to a
            schedule loaded from `schedule_path` that was planned with kept gradients.
        prepared_states_budget (int or str, defaults to 0): host memory (bytes, or e.g. "20GiB") for the next
            step's CPU-updated layers' moments dequantized ahead into fp32 (8 bytes per parameter) by the update
            worker after a step's updates, while the CPU would idle through forward and backward; those layers'
            next update then skips half its table reads (bit-identical). Layers are taken in update order (layer 0
            first) while they fit. 0: off, the default: on the H200 host (16 cores) the prepared update ran only
            1.09x the full one alone (it reads 8 bytes per parameter instead of 2) and no faster inside training
            steps (2026-11-30, benchmarks/NOTES.md); it may pay on CPUs with slow gathers (1.16x on 2 Zen 3
            cores). Needs overlap_optimizer. The planner's host
            memory accounting does not count these buffers: leave room for them in host_memory_budget.
        dp_updates (str, defaults to "auto"): data parallel only (>= 2 ranks; ignored in one process).
            "replicated": every rank all-reduces every layer's gradient and applies every update (full optimizer
            states per rank). "sharded": streamed layer i's update runs only on rank i % world (its gradient is
            reduced to that rank, other ranks skip its D2H copy and never allocate its optimizer states: ~1/world
            of the states' host memory and of the gradient D2H bytes per rank); the updated weights are broadcast
            from the owner at the layer's next load. Needs overlap_optimizer. "auto": sharded when overlap_optimizer
            is on, else replicated. Measured on 2 H200s (Qwen2.5-7B shape, 24 GiB cap, batch 32 per GPU): sharded
            4.17 s per step, replicated 4.63 s, 1 GPU 4.41 s (benchmarks/results/executor-ddp-sharded-20261129.json).
        profile_layers (bool, defaults to True): policy "milp" on CUDA: before each solve, time one decoder layer
            of each kind at the planned (rows per pass, seq) on the GPU (profiling/layer_costs.py, ~1-2 s) and plan
            with those forward / backward times and memory figures (the larger of measured and analytic) instead
            of the analytic ones alone (which under-predicted the measured 7B step by 7-17% on an H200 in
            2026-11-29's runs); a pass that does not fit is measured at fewer rows and scaled.
        calibrate_steps (int, defaults to None): policy "milp": after this many measured optimizer steps (the
            first one or two are not counted) compare the measured step time with the plan's prediction and the
            CPU update worker's measured rate (parameters/s) with the planned one; when the GPU compute is off by
            more than 5% or the rate by more than 10%, solve again with the compute costs scaled to match and the
            measured rate (hf/calibrate.py); once per run. None: 3 on CUDA, off elsewhere; 0: off.
        loss_chunk_tokens (int, defaults to 2048): tokens per chunk of the chunked cross-entropy head, so the
            [B, T, V] logits never exist at once (peak logits bytes = chunk x V x 4).
        schedule_path (str, defaults to None): load a saved schedule JSON instead of planning.
        plan_buckets (int, defaults to 4): policy "milp": sequence-length buckets planned at the start of training
            (powers of two up to the longest sequence, one MILP solve each); each batch runs the plan of the
            smallest bucket that holds it. 1: one plan for the longest sequence.
        solver_time_limit_s (float, defaults to 10.0): HiGHS time limit (s).
        solver_mip_rel_gap (float, defaults to 0.01): HiGHS relative MIP gap.
        state_dtype (str, defaults to "8bit"): Hybrid8 optimizer moments: "8bit" blockwise or "fp32".
        master_weights (str, defaults to "auto"): "fp32" master copy, "kahan" compensated bf16, "none"
            (update in the parameter dtype); "auto" = fp32 for bf16/fp16 parameters, none for fp32 ones.
        block_size (int, defaults to 256): quantization block size (elements per absmax), as bitsandbytes.
        min_8bit_size (int, defaults to 4096): tensors with fewer elements keep fp32 states (bitsandbytes default).
        fp32_state_modules (list of str, defaults to []): extra module-name substrings whose parameters keep fp32
            states (embeddings and lm_head always do).
        resident_placement (str, defaults to "auto"): where the input embedding and the LM head live with their
            gradients and (fp32) optimizer states: "gpu"; "host_embedding" (the embedding in host memory: looked up
            and updated on the CPU; untied heads only); "host" (the LM head too: updated on the CPU, its weights
            copied to the GPU once per step); "auto": policy "milp" plans each placement and takes the fastest that
            fits; policy "fixed" keeps them on the GPU when they take at most half the GPU budget, else "host"
            (streaming/resident.py). The final norm stays on the GPU. Data parallel runs keep them on the GPU.
    """

    policy: str = "fixed"
    device: str = "auto"
    checkpoint_every: int = 4
    activation_tier: str = "gpu"
    prefetch_depth: int = 1
    gpu_memory_budget: int | str | None = None
    cap_gpu_memory: bool = False
    gpu_memory_margin: float = 0.12
    host_memory_budget: int | str | None = None
    nvme_dir: str | None = None
    nvme_budget: int | str | None = None
    pin_memory: bool = True
    max_rows_per_pass: int | None = None
    overlap_optimizer: bool = True
    gpu_layer_updates: bool = True
    keep_gpu_grads: bool = True
    prepared_states_budget: int | str = 0
    dp_updates: str = "auto"
    loss_chunk_tokens: int = 2048
    schedule_path: str | None = None
    plan_buckets: int = 4
    solver_time_limit_s: float = 10.0
    profile_layers: bool = True
    calibrate_steps: int | None = None
    solver_mip_rel_gap: float = 0.01
    state_dtype: str = "8bit"
    master_weights: str = "auto"
    block_size: int = 256
    min_8bit_size: int = 4096
    fp32_state_modules: list[str] = field(default_factory=list)
    resident_placement: str = "auto"

    def __post_init__(self) -> None:
        problems: list[str] = []
        given = self.__dict__.pop("_given", frozenset())
        # 1. resolve: a given value > environment > default
        for f in dataclasses.fields(self):
            if f.init and f.name not in given:
                try:
                    env = envvars.read(envvars.field_env_name(f.name), default=_UNSET)
                except ValueError as e:
                    problems.append(str(e))
                    continue
                if env is not _UNSET:
                    setattr(self, f.name, env)
        # 2. normalize
        for key in _CHOICES:
            if isinstance(getattr(self, key), str):
                setattr(self, key, getattr(self, key).lower())
        for key in SIZE_FIELDS:
            try:
                setattr(self, key, parse_bytes(getattr(self, key)))
            except ValueError as e:
                problems.append(f"lazytrain_config.{key}: {e}")
        if isinstance(self.fp32_state_modules, str):  # "q_proj|k_proj", as in optim_args
            self.fp32_state_modules = [m for m in self.fp32_state_modules.split("|") if m]
        # 3. validate
        for key, allowed in _CHOICES.items():
            if getattr(self, key) not in allowed:
                problems.append(f"lazytrain_config.{key} must be one of {list(allowed)}, but got {getattr(self, key)!r}")
        for f in dataclasses.fields(self):  # a YAML / --set "maybe" or "false" string would read as true
            if str(f.type) == "bool" and not isinstance(getattr(self, f.name), bool):
                problems.append(f"lazytrain_config.{f.name} must be true or false, but got {getattr(self, f.name)!r}")
        _check_int(problems, "checkpoint_every", self.checkpoint_every, 1, 10_000)
        _check_int(problems, "prefetch_depth", self.prefetch_depth, 1, 3)
        _check_int(problems, "plan_buckets", self.plan_buckets, 1, 16)
        margin = self.gpu_memory_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 0.9:
            problems.append(f"lazytrain_config.gpu_memory_margin must be a fraction in [0, 0.9), e.g. 0.12 (the "
                            f"default), but got {margin!r}")
        for key, example in SIZE_FIELDS.items():
            value = getattr(self, key)
            if isinstance(value, int) and value < 0:
                problems.append(f"lazytrain_config.{key} must be a size >= 0 such as {example}, but got {value}")
        _check_int(problems, "loss_chunk_tokens", self.loss_chunk_tokens, 1, 1 << 30)
        if self.calibrate_steps is not None:
            _check_int(problems, "calibrate_steps", self.calibrate_steps, 0, 1000)
        if self.max_rows_per_pass is not None:
            _check_int(problems, "max_rows_per_pass", self.max_rows_per_pass, 1, 1 << 20)
        _check_int(problems, "block_size", self.block_size, 64, 1 << 16)
        _check_int(problems, "min_8bit_size", self.min_8bit_size, 0, 1 << 40)
        if isinstance(self.block_size, int) and self.block_size & (self.block_size - 1):
            problems.append(f"lazytrain_config.block_size must be a power of two, but got {self.block_size}")
        if self.activation_tier == "nvme" and not self.nvme_dir:
            problems.append("lazytrain_config.activation_tier='nvme' needs lazytrain_config.nvme_dir (a directory "
                            "on a fast local disk), but nvme_dir is not set")
        if self.dp_updates == "sharded" and not self.overlap_optimizer:
            problems.append("lazytrain_config.dp_updates='sharded' needs overlap_optimizer=True (the sharded update "
                            "runs through the deferred per-layer updater); set overlap_optimizer=True or "
                            "dp_updates='replicated'")
        if self.prepared_states_budget and not self.overlap_optimizer:
            problems.append("lazytrain_config.prepared_states_budget needs overlap_optimizer=True (the update worker "
                            "prepares the moments); set overlap_optimizer=True or prepared_states_budget=0")
        if self.schedule_path and not Path(self.schedule_path).is_file():
            problems.append(f"lazytrain_config.schedule_path: no file at {self.schedule_path!r}")
        if problems:
            raise ValueError("Invalid LazyTrain configuration:\n  - " + "\n  - ".join(problems))

    @classmethod
    def from_any(cls, value: LazyTrainConfig | dict[str, Any] | str | os.PathLike | None) -> LazyTrainConfig:
        """Build from a config, a dict, a JSON object string (as HF's command line passes dict arguments, e.g.
        `--lazytrain_config '{"policy": "milp"}'`), a YAML path or None (defaults).

        Raises:
            ValueError: unknown keys (all listed, with the allowed keys), invalid values, or a string that starts
                with "{" but is not a JSON object.
            FileNotFoundError: a YAML path that does not exist.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.lstrip().startswith("{"):
            import json

            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"lazytrain_config looks like JSON but does not parse ({e}); pass a dict, a JSON "
                                 "object such as '{\"policy\": \"milp\"}', or a YAML path") from None
        if isinstance(value, (str, os.PathLike)):
            import yaml

            path = Path(value)
            if not path.is_file():
                raise FileNotFoundError(f"lazytrain_config: no YAML file at {str(path)!r}")
            value = yaml.safe_load(path.read_text()) or {}
            if "lazytrain" in value and isinstance(value["lazytrain"], dict):
                value = value["lazytrain"]
        if not isinstance(value, dict):
            raise ValueError(f"lazytrain_config must be a dict or a YAML path, but got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:  # one error: the unknown keys and whatever else is wrong with the known ones
            msg = (f"Unknown lazytrain_config key(s) {unknown}; allowed keys: {sorted(known)}"
                   + did_you_mean(unknown, known, "lazytrain_config"))
            try:
                cls(**{k: v for k, v in value.items() if k in known})
            except (ValueError, TypeError) as e:  # its problem lines, without its own heading
                msg += "\nAlso:\n" + str(e).split("\n", 1)[-1].rstrip()
            raise ValueError(msg)
        return cls(**value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved_dp_updates(self) -> str:
        """"replicated" or "sharded": what `dp_updates` means with >= 2 ranks ("auto": sharded when the overlapped
        optimizer is on, the measured faster of the two)."""
        if self.dp_updates != "auto":
            return self.dp_updates
        return "sharded" if self.overlap_optimizer else "replicated"

    def resolved_device(self) -> str:
        """The compute device string ("cuda" or "cpu") after resolving "auto"."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def _check_int(problems: list[str], key: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        problems.append(f"lazytrain_config.{key} must be an integer in [{lo}, {hi}], but got {value!r}")


_UNSET = object()
_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(LazyTrainConfig) if f.init)
_dataclass_init = LazyTrainConfig.__init__


@functools.wraps(_dataclass_init)
def _init_recording_given(self: LazyTrainConfig, *args: Any, **kwargs: Any) -> None:
    # the fields passed (positionally or by name); __post_init__ pops it, so it is not kept, pickled or compared
    self.__dict__["_given"] = frozenset(_FIELD_NAMES[:len(args)]) | kwargs.keys()
    _dataclass_init(self, *args, **kwargs)


LazyTrainConfig.__init__ = _init_recording_given  # type: ignore[method-assign]
