"""`LazyTrainConfig`: every knob of the executor, planner and optimizer, in validated groups by concern.

Groups (one dataclass each): `planning`, `memory`, `streaming`, `optimizer`, `data_parallel`, `interruption`,
`experimental`. Every field has short help in its metadata (``field(metadata={"help": ...})``, as transformers'
TrainingArguments); docs/configuration.md is generated from it (``python -m lazytrain_hf.config > docs/configuration.md``).

Field names are unique across the groups, so each key also has a flat spelling, the field name alone: ``policy``
means ``planning.policy`` in a dict / YAML / JSON config, as a keyword (``LazyTrainConfig(policy="milp")``), in
``--set lazytrain.policy=milp`` and as an attribute (``cfg.policy`` reads and writes ``cfg.planning.policy``).

Resolution order for each field: the value given by the user (grouped or flat), then the environment variable
`LAZYTRAIN_<FIELD>` (the flat name in upper case; parsed by lazytrain_hf.envvars, docs/environment.md), then the
default. All problems are collected and raised at once in one `ValueError`, each message naming the key as the user
wrote it, the rule, the value received and the fix.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from . import envvars

__all__ = ["LazyTrainConfig", "PlanningConfig", "MemoryConfig", "StreamingConfig", "OptimizerConfig",
           "DataParallelConfig", "InterruptionConfig", "ExperimentalConfig", "GROUPS", "FLAT_KEYS", "SIZE_FIELDS",
           "parse_bytes", "parse_duration", "format_bytes", "GIB", "did_you_mean", "cpu_threads", "config_fields", "render_markdown"]

GIB = 1024**3
_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


#: a number and its unit (letters, maybe none), as sizes and durations are written
_NUMBER_UNIT = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_bytes(value: int | float | str | None) -> int | None:
    """Parse a memory size such as ``"24GiB"``, ``"80 GB"`` or ``25769803776`` into bytes. A number is a byte
    count; a string other than "0" needs its unit ("24" from an environment variable or a text field would be 24
    bytes, surely not meant: "24B" says bytes).

    Raises:
        ValueError: the string is not a number followed by one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '24GiB', but got {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    m = _NUMBER_UNIT.fullmatch(str(value))
    if m and not m.group(2) and float(m.group(1)) > 0:  # "0" is 0 in any unit
        raise ValueError(f"{value!r} has no unit (it would be {m.group(1)} bytes); give one, e.g. '{m.group(1)}GiB' "
                         f"(or '{m.group(1)}B' for bytes)")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size such as '24GiB' or '80GB', but got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


_SECONDS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def parse_duration(value: int | float | str | None) -> float | None:
    """Parse a duration such as ``"90s"``, ``"2min"``, ``"1.5h"`` or ``90`` (a number: seconds) into seconds. A string
    needs its unit (s / sec, m / min, h), as sizes do.

    Raises:
        ValueError: not a number, nor a number followed by one of those units.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as '90s', but got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    m = _NUMBER_UNIT.fullmatch(str(value))
    if m and not m.group(2):
        raise ValueError(f"{value!r} has no unit; give one, e.g. '{m.group(1)}s' (or '{m.group(1)}min')")
    if not m or m.group(2).lower() not in _SECONDS:
        raise ValueError(f"expected a duration such as '90s', '2min' or '1h', but got {value!r}")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


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
    """Format bytes as GiB with two decimals, MiB below 0.01 GiB (so a small size does not read "0.00 GiB");
    ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    return f"{n / 2**20:.2f} MiB" if 0 < abs(n) < 0.01 * GIB else f"{n / GIB:.2f} GiB"


_WHERE = "lazytrain_config"  # how messages name the keys (recipes name them lazytrain.<key>)
_HEADING = "Invalid LazyTrain configuration:\n  - "
_UNSET = object()


@dataclass
class _Build:
    problems: list[str]
    names: dict[str, str]  # field -> the key as the user wrote it


# set while LazyTrainConfig builds its groups: they add their problems to the one error instead of raising
_BUILD: contextvars.ContextVar[_Build | None] = contextvars.ContextVar("lazytrain_config_build", default=None)


def _records_given(cls: type) -> type:
    """Wrap the dataclass `__init__` to record the fields passed (positionally or by name); `__post_init__` pops
    the record, so instances hold only their fields (`==`, `asdict`, pickling as plain dataclasses)."""
    init = cls.__init__
    names = tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_given"] = frozenset(names[:len(args)]) | kwargs.keys()
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


class _Group:
    """A group of fields. A field not given is filled from `LAZYTRAIN_<FIELD>` when that is set; then every field
    is normalized and checked from its metadata (choices, range, size) and `_check`. Built alone, a group raises
    its problems; built by `LazyTrainConfig`, they join that one error."""

    GROUP: ClassVar[str] = ""

    def __post_init__(self) -> None:
        given = self.__dict__.pop("_given", frozenset())
        build = _BUILD.get()
        problems = build.problems if build is not None else []
        names = build.names if build is not None else {}

        def name(key: str) -> str:
            return names.get(key) or f"{_WHERE}.{self.GROUP}.{key}"

        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            if f.name in given:
                continue
            try:
                env = envvars.read(envvars.field_env_name(f.name), default=_UNSET)
            except ValueError as e:
                problems.append(str(e))
                continue
            if env is not _UNSET:
                setattr(self, f.name, env)
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            _check_field(self, f, name(f.name), problems)
        self._check(name, problems)
        if build is None and problems:
            raise ValueError(_HEADING + "\n  - ".join(problems))

    def _check(self, name: Callable[[str], str], problems: list[str]) -> None:
        """Checks beyond one field's metadata."""


def _check_field(obj: Any, f: dataclasses.Field, key: str, problems: list[str]) -> None:
    value, meta = getattr(obj, f.name), f.metadata
    if "choices" in meta:
        if isinstance(value, str):
            value = value.lower()
            setattr(obj, f.name, value)
        if value not in meta["choices"]:
            problems.append(f"{key} must be one of {list(meta['choices'])}, but got {value!r}")
    elif f.type in ("bool", "bool | None"):  # a YAML / --set "maybe" or "false" string would read as true
        if not isinstance(value, bool) and not (value is None and f.type == "bool | None"):
            either = "true or false" + (" (or null: the default)" if f.type == "bool | None" else "")
            problems.append(f"{key} must be {either}, but got {value!r}")
    elif "size" in meta:
        try:
            value = parse_bytes(value)
        except ValueError as e:
            problems.append(f"{key}: {e}")
            return
        setattr(obj, f.name, value)
        if value is not None and value < 0:
            problems.append(f"{key} must be a size >= 0 such as {meta['size']}, but got {value}")
    elif "duration" in meta:
        try:
            value = parse_duration(value)
        except ValueError as e:
            problems.append(f"{key}: {e}")
            return
        setattr(obj, f.name, value)
        if value is not None and not value > 0:
            problems.append(f"{key} must be a duration > 0 such as {meta['duration']} (unset: no grace period), "
                            f"but got {value!r}")
    elif "range" in meta and not (value is None and "None" in str(f.type)):
        _check_int(problems, key, value, *meta["range"])


def _check_int(problems: list[str], key: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        problems.append(f"{key} must be an integer in [{lo}, {hi}], but got {value!r}")


def _help(text: str, **checks: Any) -> dict[str, Any]:
    return {"help": text, **checks}


@_records_given
@dataclass
class PlanningConfig(_Group):
    """How the schedule (checkpoints, recomputation, placement, rows per pass) is made."""

    GROUP: ClassVar[str] = "planning"

    policy: str = field(default="milp", metadata=_help(
        '"milp": solved by the HiGHS planner (lazytrain_hf.planning), what the benchmarks run; "fixed": a checkpoint '
        'every `checkpoint_every` layers, kept in `activation_tier` (the MegaTrain-equivalent baseline); "none": no '
        "executor, the plain HF Trainer path.", choices=("fixed", "milp", "none")))
    checkpoint_every: int = field(default=4, metadata=_help(
        "Fixed policy: keep the input of every k-th decoder layer; the layers in between are recomputed in "
        "backward.", range=(1, 10_000)))
    activation_tier: str = field(default="gpu", metadata=_help(
        'Fixed policy: where kept layer inputs live: "gpu" (the compute device), "cpu" (pinned host memory) or '
        '"nvme" (files in memory.nvme_dir).', choices=("gpu", "cpu", "nvme")))
    prefetch_depth: int = field(default=1, metadata=_help(
        "Decoder layers whose weights are streamed ahead of compute; the device holds prefetch_depth + 1 weight "
        "slots per layer structure.", range=(1, 3)))
    max_rows_per_pass: int | None = field(default=None, metadata=_help(
        "Rows (sequences) of a micro-batch a decoder layer processes at once: the layer runs over the micro-batch in "
        "row chunks with its weights loaded once, so its activation memory follows this, not the micro-batch size. "
        "None: the plan's own rows per pass (the MILP's; the fixed policy's rule: the micro-batch, then halves, the first "
        "that fits the budget, one row when none does).",
        range=(1, 1 << 20)))
    resident_placement: str = field(default="auto", metadata=_help(
        'Where the input embedding and the LM head live with their gradients and fp32 optimizer states: "gpu"; '
        '"host_embedding" (the embedding in host memory, looked up and updated on the CPU; untied heads only); '
        '"host" (the LM head too; its weights are copied to the GPU once per step); "host_sliced" (as "host", but '
        "the head's weights stream to the GPU in vocabulary slices and its gradient comes back slice by slice: no "
        'GPU copy of the whole head; the Trainer\'s own loss only); "auto": policy "milp" plans "gpu", '
        '"host_embedding" and "host" and takes the fastest that fits, "host_sliced" only when none fits; policy '
        '"fixed" keeps them on the GPU when they take at most half the GPU budget, else "host". The final norm '
        "stays on the GPU; data-parallel runs keep them on the GPU.",
        choices=("auto", "gpu", "host_embedding", "host", "host_sliced")))
    gpu_memory_margin: float = field(default=0.12, metadata=_help(
        "Fraction of the GPU budget the MILP keeps free for allocator fragmentation and workspaces the analytic "
        "cost model does not count, in [0, 0.9); the default follows the out-of-memory runs in benchmarks/NOTES.md."))
    schedule_path: str | None = field(default=None, metadata=_help(
        "A saved schedule JSON to run instead of planning."))
    plan_buckets: int = field(default=4, metadata=_help(
        'Policy "milp": sequence-length buckets planned at the start of training (powers of two up to the longest '
        "sequence, one solve each); each batch runs the plan of the smallest bucket that holds it, and a batch longer "
        "than every bucket (a collator padding past the data) gets a bucket planned for it, with a warning. 1: one "
        "plan for the longest sequence.", range=(1, 16)))
    solver_time_limit_s: float = field(default=10.0, metadata=_help("HiGHS time limit per solve, in seconds."))
    calibrate_steps: int | None = field(default=None, metadata=_help(
        'Policy "milp": after this many measured optimizer steps, compare the measured step time and CPU update '
        "rate with the plan's and, when they are off, plan once more with the measured figures (hf/calibrate.py); a "
        "switch to that plan is measured over as many steps again and undone when it ran no faster. "
        "None: 3 on CUDA, off elsewhere; 0: off (the plan stays the first one).", range=(0, 1000)))

    def _check(self, name: Callable[[str], str], problems: list[str]) -> None:
        margin = self.gpu_memory_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 0.9:
            problems.append(f"{name('gpu_memory_margin')} must be a fraction in [0, 0.9), e.g. 0.12 (the default), "
                            f"but got {margin!r}")
        if self.schedule_path and not Path(self.schedule_path).is_file():
            problems.append(f"{name('schedule_path')}: no file at {self.schedule_path!r}")


@_records_given
@dataclass
class MemoryConfig(_Group):
    """The memory budgets the plan must fit (sizes take a unit, e.g. "24GiB" or "80GB", or are a byte count given
    as a number)."""

    GROUP: ClassVar[str] = "memory"

    gpu_memory_budget: int | str | None = field(default=None, metadata=_help(
        'Device memory the plan may use, e.g. "24GiB". None: what the device reports free.', size="'24GiB'"))
    host_memory_budget: int | str | None = field(default=None, metadata=_help(
        "Pinned host memory the plan may use, per process. None: 90% of RAM divided among the data-parallel ranks "
        "on this host (LOCAL_WORLD_SIZE).", size="'100GiB'"))
    nvme_dir: str | None = field(default=None, metadata=_help(
        'Directory on a fast local disk for the "nvme" activation tier; required when that tier is used.'))
    nvme_budget: int | str | None = field(default=None, metadata=_help(
        "Bytes the plan may write to nvme_dir.", size="'200GiB'"))
    expandable_segments: bool | None = field(default=None, metadata=_help(
        "CUDA: the caching allocator's expandable segments for this process from the trainer's start (as "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), so that blocks freed by one layer pass are reused at any "
        "size by the next instead of fragmenting the budget; the user's other allocator settings are kept. None: on, "
        "unless PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF is set (then as it says). Policy \"none\" leaves the "
        "allocator as it is."))


@_records_given
@dataclass
class StreamingConfig(_Group):
    """The executor that streams decoder layers through the compute device."""

    GROUP: ClassVar[str] = "streaming"

    device: str = field(default="auto", metadata=_help(
        'Compute device of the executor; "auto": "cuda" when available, else "cpu".',
        choices=("auto", "cuda", "cpu")))
    loss_chunk_tokens: int = field(default=2048, metadata=_help(
        "Tokens per chunk of the chunked cross-entropy head, so the [batch, seq, vocab] logits never exist at once "
        "(peak logits bytes: chunk x vocab x 4).", range=(1, 1 << 30)))


@_records_given
@dataclass
class OptimizerConfig(_Group):
    """The Hybrid 8-bit AdamW (lazytrain_hybrid8)."""

    GROUP: ClassVar[str] = "optimizer"

    state_dtype: str = field(default="8bit", metadata=_help(
        'Optimizer moments: "8bit" (blockwise quantized) or "fp32".', choices=("8bit", "fp32")))
    master_weights: str = field(default="auto", metadata=_help(
        '"fp32" master copy, "kahan" (compensated bf16), "stochastic" (no copy: bf16 parameters written with '
        "stochastic rounding; experimental, for quality comparisons: only the pure-torch update runs it, on a CPU "
        '~75x slower than the fused kernel the plan prices) or "none" (update rounded to the parameter dtype); "auto": kahan for bf16 '
        "parameters, fp32 for fp16 ones, none for fp32 ones.", choices=("auto", "fp32", "kahan", "stochastic", "none")))
    block_size: int = field(default=256, metadata=_help(
        "Quantization block size (elements per absmax, a power of two), as bitsandbytes.", range=(64, 1 << 16)))
    min_8bit_size: int = field(default=4096, metadata=_help(
        "Tensors with fewer elements keep fp32 states (the bitsandbytes default).", range=(0, 1 << 40)))
    fp32_state_modules: list[str] = field(default_factory=list, metadata=_help(
        'Extra module-name parts whose parameters keep fp32 states (a list, or a "q_proj|k_proj" string); the '
        "embedding and LM head keep them unless resident_state_dtype is 8bit."))
    resident_state_dtype: str = field(default="fp32", metadata=_help(
        'The input embedding and LM head moments: "fp32" (8 bytes per parameter, as bitsandbytes keeps them) or '
        '"8bit" (blockwise, as the layers\'; 2.2 instead of 8.7 GB at Qwen2.5-7B, which frees GPU memory when they '
        "sit on the GPU). The planner prices what the optimizer keeps.", choices=("fp32", "8bit")))

    def _check(self, name: Callable[[str], str], problems: list[str]) -> None:
        if isinstance(self.fp32_state_modules, str):  # "q_proj|k_proj", as in optim_args
            self.fp32_state_modules = [m for m in self.fp32_state_modules.split("|") if m]
        if isinstance(self.block_size, int) and self.block_size & (self.block_size - 1):
            problems.append(f"{name('block_size')} must be a power of two, but got {self.block_size}")


@_records_given
@dataclass
class DataParallelConfig(_Group):
    """Runs of two or more ranks (ignored in one process)."""

    GROUP: ClassVar[str] = "data_parallel"

    dp_updates: str = field(default="auto", metadata=_help(
        '"replicated": every rank all-reduces every layer\'s gradient and applies every update (full optimizer '
        'states per rank); "sharded": streamed layer i is updated only on rank i % world, which holds its states '
        "(about 1/world of the states' host memory and gradient copies per rank) and broadcasts the updated "
        'weights at the layer\'s next load; needs overlap_optimizer. "auto": sharded when overlap_optimizer is on, '
        "else replicated (the step times are in benchmarks/results/executor-ddp-sharded-20261129.json).",
        choices=("auto", "replicated", "sharded")))
    dp_host_weights: str = field(default="auto", metadata=_help(
        '"shared": the ranks on one host map one host copy of the streamed decoder layers\' weights (a file in '
        "/dev/shm the host's first rank creates; each layer's owner writes its updates there), so those weights take "
        "their bytes once per host instead of once per rank; needs sharded updates (dp_updates) and room for the "
        'weights in /dev/shm (docker --shm-size). "per_rank": every rank its own copy. "auto": shared when two or '
        "more ranks run on the host and the updates are sharded, else per_rank. Gradients and optimizer states stay "
        "per rank either way; the results are bit for bit the same (tests/hf/test_ddp.py).",
        choices=("auto", "shared", "per_rank")))


@_records_given
@dataclass
class InterruptionConfig(_Group):
    """The stop on SIGTERM / SIGINT: at the next optimizer-step boundary, with a checkpoint (hf/longrun.py)."""

    GROUP: ClassVar[str] = "interruption"

    interrupt_grace_period: float | str | None = field(default=None, metadata=_help(
        'The time the platform allows between SIGTERM and killing the process, e.g. "90s" or "2min" (a number: '
        "seconds). Set, the stop writes its checkpoint only when the save fits in what is left of it (the estimate: "
        "the duration of the last timed save, of this run or recorded in the newest checkpoint's manifest); else "
        "it writes none and says that a resume continues from the last periodic checkpoint. None: the checkpoint "
        "is always written.", duration="'90s'"))


@_records_given
@dataclass
class ExperimentalConfig(_Group):
    """Switches kept for measurements and comparisons; the defaults are what the benchmarks support."""

    GROUP: ClassVar[str] = "experimental"

    cap_gpu_memory: bool = field(default=False, metadata=_help(
        "Enforce memory.gpu_memory_budget on the CUDA caching allocator (torch.cuda.set_per_process_memory_fraction),"
        " emulating a smaller GPU."))
    pin_memory: bool = field(default=True, metadata=_help(
        "Keep host weights and gradients in pinned (page-locked) memory on CUDA, as the asynchronous copies need."))
    overlap_optimizer: bool = field(default=True, metadata=_help(
        "Run the streamed layers' optimizer updates on a CPU worker overlapped with the next forward (layer i's "
        "update lands before layer i is streamed in); False: serially inside optimizer.step()."))
    gpu_layer_updates: bool = field(default=True, metadata=_help(
        "Let the MILP place streamed layers' optimizer updates on the GPU (at the layer's next load, streamed "
        "states; needs overlap_optimizer and CUDA) where the cost model predicts a shorter step (measured: "
        "benchmarks/NOTES.md)."))
    keep_gpu_grads: bool = field(default=True, metadata=_help(
        "A GPU-updated layer keeps its gradient on the GPU from its backward to its update (the plan budgets it), "
        "instead of a round trip through the host; only with gradient_accumulation_steps 1. Also applies to a "
        "loaded schedule planned with kept gradients. False: every gradient goes to the host."))
    prepared_states_budget: int | str = field(default=0, metadata=_help(
        "Host memory for dequantizing the next step's CPU-updated layers' moments into fp32 ahead of time (8 bytes "
        "per parameter, layers in update order while they fit), so their next update reads less (bit-identical). "
        "0: off; benchmarks/NOTES.md has why off is the default. Needs overlap_optimizer; not counted by the "
        "planner's host accounting, so leave room in memory.host_memory_budget.", size="'20GiB' (0: off)"))
    profile_layers: bool = field(default=True, metadata=_help(
        'Policy "milp" on CUDA: before each solve, time one decoder layer of each kind at the planned shape '
        "(profiling/layer_costs.py, a second or two, longer with compile_linear_attention: its compile) and plan "
        "with the larger of the measured and analytic figures."))
    solver_mip_rel_gap: float = field(default=0.01, metadata=_help("HiGHS relative MIP gap."))
    compile_linear_attention: bool = field(default=False, metadata=_help(
        "Qwen3.5 / Qwen3.6 Gated DeltaNet layers on transformers' reference PyTorch kernels (flash-linear-attention "
        "unusable: lazytrain_hf/kernels.py): compile each layer's linear_attn module with torch.compile (default "
        "inductor) in the executor and in the planner's layer profiling, which then prices the compiled layer. One "
        "Qwen3.6-27B-width layer, 8 x 1024 bf16 on an H200: forward + backward 58.1 ms instead of 83.7 ms, peak "
        "memory 12.15 instead of 5.98 GiB, 95 s to compile "
        "(benchmarks/results/linear_attention-compile-20261202.json). A new pass shape compiles again (another "
        "number of 64-token chunks, a 1-row pass, with or without grad); past torch._dynamo's recompile limit (8 "
        "graphs) new shapes run uncompiled. No effect where flash-linear-attention runs, or with policy none."))


#: group name -> its dataclass, in the order of LazyTrainConfig's fields
GROUPS: dict[str, type[_Group]] = {cls.GROUP: cls for cls in (
    PlanningConfig, MemoryConfig, StreamingConfig, OptimizerConfig, DataParallelConfig, InterruptionConfig,
    ExperimentalConfig)}
#: flat key -> "group.key"
FLAT_KEYS: dict[str, str] = {f.name: f"{g}.{f.name}" for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
# the flat dataclass's field order: positional arguments and `to_dict()` follow it
_FLAT_ORDER = (
    "policy", "device", "checkpoint_every", "activation_tier", "prefetch_depth", "gpu_memory_budget", "cap_gpu_memory",
    "gpu_memory_margin", "host_memory_budget", "nvme_dir", "nvme_budget", "pin_memory", "max_rows_per_pass",
    "overlap_optimizer", "gpu_layer_updates", "keep_gpu_grads", "prepared_states_budget", "dp_updates",
    "loss_chunk_tokens", "schedule_path", "plan_buckets", "solver_time_limit_s", "profile_layers", "calibrate_steps",
    "solver_mip_rel_gap", "state_dtype", "master_weights", "block_size", "min_8bit_size", "fp32_state_modules",
    "resident_placement", "compile_linear_attention", "interrupt_grace_period", "dp_host_weights",
    "resident_state_dtype", "expandable_segments")
assert sorted(_FLAT_ORDER) == sorted(FLAT_KEYS), "every field has one flat key, in _FLAT_ORDER"


def config_fields() -> Iterator[tuple[str, dataclasses.Field]]:
    """(group, field) for every field of every group, in group order."""
    for g, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            yield g, f


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


#: fields that are memory sizes (bytes, or strings such as "24GiB"), with an example value
SIZE_FIELDS: dict[str, str] = {f.name: f.metadata["size"] for _, f in config_fields() if "size" in f.metadata}
_CHOICES: dict[str, tuple[str, ...]] = {f.name: f.metadata["choices"] for _, f in config_fields()
                                        if "choices" in f.metadata}


@dataclass(init=False)
class LazyTrainConfig:
    """Configuration of the LazyTrain executor, planner and Hybrid 8-bit optimizer, one group per concern.

    Each keyword is a group (a dict of its keys, or the group's dataclass) or a flat key (a field name, mapped onto
    its group: `FLAT_KEYS`); positional arguments are flat keys in the order of `to_dict()`. A field the caller
    gives is used as given, even when it equals the default; a field not given is filled from the environment
    variable `LAZYTRAIN_<FIELD>` when it is set, else takes its default. A flat key and the same field in a group
    dict with different values is an error; a flat key next to a group dataclass edits a copy of it (as
    `dataclasses.replace(cfg, policy="milp")` does). `cfg.<field>` reads and writes `cfg.<group>.<field>`;
    `LazyTrainConfig.<field>` is the field's default.

    Raises:
        ValueError: every problem at once: unknown keys (with did-you-mean), invalid values, a field given twice.
    """

    planning: PlanningConfig = field(default_factory=PlanningConfig, metadata=_help(PlanningConfig.__doc__))
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata=_help(MemoryConfig.__doc__))
    streaming: StreamingConfig = field(default_factory=StreamingConfig, metadata=_help(StreamingConfig.__doc__))
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig, metadata=_help(OptimizerConfig.__doc__))
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig,
                                              metadata=_help(DataParallelConfig.__doc__))
    interruption: InterruptionConfig = field(default_factory=InterruptionConfig,
                                             metadata=_help(InterruptionConfig.__doc__))
    experimental: ExperimentalConfig = field(default_factory=ExperimentalConfig,
                                             metadata=_help(ExperimentalConfig.__doc__))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(_FLAT_ORDER):
            raise TypeError(f"LazyTrainConfig takes at most {len(_FLAT_ORDER)} positional arguments")
        for key, value in zip(_FLAT_ORDER, args):
            if key in kwargs:
                raise TypeError(f"LazyTrainConfig got multiple values for argument {key!r}")
            kwargs[key] = value
        self._build(kwargs)

    def _build(self, values: dict[Any, Any]) -> None:
        problems: list[str] = []
        names: dict[str, str] = {}
        given: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        bases: dict[str, _Group] = {}
        flat: dict[str, Any] = {}
        unknown: dict[str, list[str]] = {}  # "" (top level) or a group -> its unknown keys
        for key, value in values.items():
            if key in GROUPS:
                cls = GROUPS[key]
                if isinstance(value, cls):
                    bases[key] = value
                elif isinstance(value, dict):
                    known = {f.name for f in dataclasses.fields(cls)}
                    for k, v in value.items():
                        if k in known:
                            given[key][k], names[k] = v, f"{_WHERE}.{key}.{k}"
                        elif k in FLAT_KEYS:
                            problems.append(f"{_WHERE}.{key}.{k}: {k} is a key of {FLAT_KEYS[k].split('.')[0]}; "
                                            f"write {_WHERE}.{FLAT_KEYS[k]} (or {_WHERE}.{k})")
                        else:
                            unknown.setdefault(key, []).append(str(k))
                elif value is not None:
                    keys = [f.name for f in dataclasses.fields(cls)]
                    problems.append(f"{_WHERE}.{key} must be a mapping of its keys {keys}, but got {value!r}")
            elif key in FLAT_KEYS:
                flat[key] = value
            else:
                unknown.setdefault("", []).append(str(key))
        for k, v in flat.items():
            g = FLAT_KEYS[k].split(".")[0]
            if k in given[g]:
                if given[g][k] != v:
                    problems.append(f"{_WHERE}.{k}={v!r} and {_WHERE}.{g}.{k}={given[g][k]!r} set the same field; "
                                    "keep one of them")
                continue
            given[g][k], names[k] = v, f"{_WHERE}.{k}"
        heads: list[str] = []  # unknown keys first
        for g, bad in unknown.items():
            if g:
                known = [f.name for f in dataclasses.fields(GROUPS[g])]
                heads.append(f"Unknown {_WHERE} key(s) {sorted(f'{g}.{k}' for k in bad)}; allowed in {g}: {known}"
                             + did_you_mean(bad, known, f"{_WHERE}.{g}"))
            else:
                hint = did_you_mean(bad, [*GROUPS, *FLAT_KEYS], _WHERE)
                heads.insert(0, f"Unknown {_WHERE} key(s) {sorted(bad)}; allowed: the groups {list(GROUPS)} (a "
                             "mapping each) or any of their keys alone (docs/configuration.md)" + hint)
        problems[:0] = heads
        token = _BUILD.set(_Build(problems, names))
        try:
            for g, cls in GROUPS.items():
                group = dataclasses.replace(bases[g], **given[g]) if g in bases else cls(**given[g])
                self.__dict__[g] = group
        finally:
            _BUILD.reset(token)
        self._check(lambda k: names.get(k) or f"{_WHERE}.{FLAT_KEYS[k]}", problems)
        if problems:
            raise ValueError(_HEADING + "\n  - ".join(problems))

    def _check(self, name: Callable[[str], str], problems: list[str]) -> None:
        """Checks across groups."""
        if self.activation_tier == "nvme" and not self.nvme_dir:
            problems.append(f"{name('activation_tier')}='nvme' needs {name('nvme_dir')} (a directory on a fast local "
                            "disk), but nvme_dir is not set")
        if self.dp_updates == "sharded" and self.overlap_optimizer is False:
            problems.append(f"{name('dp_updates')}='sharded' needs overlap_optimizer=True (the sharded update "
                            "runs through the deferred per-layer updater); set overlap_optimizer=True or "
                            "dp_updates='replicated'")
        if self.dp_host_weights == "shared" and self.resolved_dp_updates() != "sharded":
            problems.append(f"{name('dp_host_weights')}='shared' needs sharded updates (each layer written by one "
                            f"rank), but {name('dp_updates')}={self.dp_updates!r} with overlap_optimizer="
                            f"{self.overlap_optimizer!r} updates every layer on every rank; set dp_updates='sharded' "
                            "(with overlap_optimizer=True) or dp_host_weights='per_rank'")
        if self.prepared_states_budget and self.overlap_optimizer is False:
            problems.append(f"{name('prepared_states_budget')} needs overlap_optimizer=True (the update worker "
                            "prepares the moments); set overlap_optimizer=True or prepared_states_budget=0")

    def __setstate__(self, state: dict[str, Any]) -> None:
        if set(state) <= set(GROUPS):
            self.__dict__.update(state)
            for g, cls in GROUPS.items():  # pickled before the group existed: its defaults
                if g not in self.__dict__:
                    self.__dict__[g] = cls()
        else:  # pickled when LazyTrainConfig was one flat dataclass: its fields are the flat keys
            self._build({k: v for k, v in state.items() if not str(k).startswith("_")})

    @classmethod
    def from_any(cls, value: LazyTrainConfig | dict[str, Any] | str | os.PathLike | None) -> LazyTrainConfig:
        """Build from a config, a dict (grouped and / or flat keys), a JSON object string (as HF's command line
        passes dict arguments, e.g. `--lazytrain_config '{"planning": {"policy": "milp"}}'`), a YAML path (its
        `lazytrain:` section when it has one) or None (defaults).

        Raises:
            ValueError: unknown keys (all listed, with did-you-mean), invalid values, a field given both grouped and
                flat with different values, or a string that starts with "{" but is not a JSON object.
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
            if isinstance(value, dict) and isinstance(value.get("lazytrain"), dict):
                value = value["lazytrain"]
        if not isinstance(value, dict):
            raise ValueError(f"lazytrain_config must be a dict or a YAML path, but got {type(value).__name__}")
        cfg = cls.__new__(cls)
        cfg._build(dict(value))
        return cfg

    def to_dict(self, grouped: bool = False) -> dict[str, Any]:
        """The flat form {key: value} (what `LazyTrainingArguments.lazytrain_config` and benchmark rows hold), or
        with `grouped` the grouped form {group: {key: value}} (`dataclasses.asdict`). Both load with `from_any`."""
        nested = dataclasses.asdict(self)
        if grouped:
            return nested
        return {k: nested[FLAT_KEYS[k].split(".")[0]][k] for k in _FLAT_ORDER}

    def resolved_dp_updates(self) -> str:
        """"replicated" or "sharded": what `dp_updates` means with >= 2 ranks ("auto": sharded when the overlapped
        optimizer is on, the measured faster of the two)."""
        if self.dp_updates != "auto":
            return self.dp_updates
        return "sharded" if self.overlap_optimizer else "replicated"

    def resolved_dp_host_weights(self, ranks_on_host: int) -> str:
        """"shared" or "per_rank": what `dp_host_weights` means with `ranks_on_host` data-parallel ranks on this host
        ("auto": shared with two or more and sharded updates)."""
        if ranks_on_host < 2 or self.dp_host_weights == "per_rank" or self.resolved_dp_updates() != "sharded":
            return "per_rank"
        return "shared"

    def resolved_device(self) -> str:
        """The compute device string ("cuda" or "cpu") after resolving "auto"."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


class _FlatAlias:
    """`cfg.<key>` reads and writes `cfg.<group>.<key>`; on the class it is the field's default."""

    def __init__(self, group: str, key: str) -> None:
        self.group, self.key = group, key

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return _default(GROUPS[self.group].__dataclass_fields__[self.key])
        return getattr(obj.__dict__[self.group], self.key)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.__dict__[self.group], self.key, value)


for _key, _path in FLAT_KEYS.items():
    setattr(LazyTrainConfig, _key, _FlatAlias(_path.split(".")[0], _key))


def _type_text(f: dataclasses.Field) -> str:
    meta, hint = f.metadata, str(f.type)
    if "choices" in meta:
        return "one of " + ", ".join(f"`{c}`" for c in meta["choices"])
    if "size" in meta:
        return "size" + (" or `None`" if "None" in hint else "") + f", e.g. `{meta['size'].split()[0]}`"
    if "duration" in meta:
        return "duration" + (" or `None`" if "None" in hint else "") + f", e.g. `{meta['duration']}`"
    if "range" in meta:
        return f"`{hint}`, in [{meta['range'][0]}, {meta['range'][1]}]"
    return f"`{hint}`"


def render_markdown() -> str:
    """docs/configuration.md: one table per group from the fields' help, then the flat keys."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [
        "# lazytrain_config keys", "",
        "Generated from the field help in `lazytrain_hf/config.py` "
        "(`python -m lazytrain_hf.config > docs/configuration.md`).", "",
        "`LazyTrainingArguments(lazytrain_config=...)` takes a dict, a YAML path or a JSON string; recipes take the",
        "same keys under `lazytrain:` and `--set lazytrain.planning.policy=milp`; in Python,",
        "`LazyTrainConfig(planning={\"policy\": \"milp\"})` or `LazyTrainConfig(planning=PlanningConfig(policy=\"milp\"))`.",
        "A key you give is used as given; a key not given is read from `LAZYTRAIN_<KEY>` (the key's flat name in upper",
        "case) when that variable is set ([environment.md](environment.md)), else takes its default. All problems are",
        "reported together in one error. Sizes take a unit (`\"24GiB\"`, `\"80GB\"`) or are a byte count given as a "
        "number (a string without a unit is refused).", "",
        "```yaml", "lazytrain:", "  planning:", "    policy: milp", "  memory:", "    gpu_memory_budget: 24GiB",
        "```", ""]
    for g, cls in GROUPS.items():
        lines += [f"## {g}", "", cell(cls.__doc__), "", "| Key | Type | Default | Help |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            lines.append(f"| `{g}.{f.name}` | {cell(_type_text(f))} | `{cell(repr(_default(f)))}` "
                         f"| {cell(f.metadata['help'])} |")
        lines.append("")
    lines += [
        "## Flat keys", "",
        "Every key also works without its group, as its flat name: `{\"policy\": \"milp\"}`, `policy: milp` in a recipe's",
        "`lazytrain:` section, `--set lazytrain.policy=milp`, `LazyTrainConfig(policy=\"milp\")`; `cfg.policy` reads and",
        "writes `cfg.planning.policy`. Giving a field both ways with different values is an error; a recipe's "
        "`--set` replaces the recipe's value in either spelling.",
        "`LazyTrainConfig.to_dict()` returns the flat form (as `LazyTrainingArguments.lazytrain_config` holds it),",
        "`to_dict(grouped=True)` the grouped one.", "",
        "| Flat key | Grouped key |", "| --- | --- |"]
    lines += [f"| `{k}` | `{FLAT_KEYS[k]}` |" for k in _FLAT_ORDER]
    lines += ["", "Environment variables of the kernels (`LAZYTRAIN_CPU_ISA`, `LAZYTRAIN_CPU_THREADS`, "
              "`LAZYTRAIN_GPU_KERNEL`, ...) are listed in [environment.md](environment.md)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
