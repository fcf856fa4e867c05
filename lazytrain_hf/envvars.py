"""Every ``LAZYTRAIN_*`` environment variable: one table, one parser.

`read(name)` is the only way the package reads one: an unset or empty variable gives the row's default; a value
its parser refuses raises one ``ValueError`` naming the variable, the value and what is accepted. Besides the
variables of `VARIABLES`, each `LazyTrainConfig` field ``<group>.<field>`` has a row ``LAZYTRAIN_<FIELD>`` (the flat
key in upper case, generated from the group dataclasses' fields), which fills that field when the user did not give it.
A ``LAZYTRAIN_*`` variable set in the environment that is in no row (a typo) gets one warning per process naming the
closest known variable (`warn_unknown`: checked at each `read` and when the ``lazytrain-hf`` command starts).
`render_markdown` writes the table; docs/environment.md is its output
(``python -m lazytrain_hf.envvars > docs/environment.md``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["EnvVar", "VARIABLES", "table", "read", "field_env_name", "unknown_variables", "warn_unknown",
           "render_markdown"]

PREFIX = "LAZYTRAIN_"
_NO_DEFAULT = object()


@dataclass(frozen=True)
class EnvVar:
    """One environment variable.

    Attributes:
        name: the variable, e.g. ``LAZYTRAIN_CPU_ISA``.
        parse: the stripped text -> value; raises ValueError when the text is not one of `accepted`.
        default: the value when the variable is unset or empty.
        accepted: what the parser takes, as the error and the docs say it ("one of ['auto', 'torch', 'cpp']").
        applies: where it is read (module / function, and when).
        help: what it does.
    """

    name: str
    parse: Callable[[str], Any]
    default: Any
    accepted: str
    applies: str
    help: str


def _choice(*values: str) -> tuple[Callable[[str], str], str]:
    def parse(text: str) -> str:
        if text.lower() not in values:
            raise ValueError(text)
        return text.lower()

    return parse, f"one of {list(values)}"


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


def _text(text: str) -> str:
    return text


_CPU_KERNEL, _CPU_KERNEL_OK = _choice("auto", "torch", "cpp")
_GPU_KERNEL, _GPU_KERNEL_OK = _choice("auto", "triton", "bnb", "torch")
_CPU_ISA, _CPU_ISA_OK = _choice("auto", "avx512", "avx2", "generic")
_CPU_LOOKUP, _CPU_LOOKUP_OK = _choice("auto", "gather", "scalar")

#: the variables that are not LazyTrainConfig fields
VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("LAZYTRAIN_CPU_KERNEL", _CPU_KERNEL, "auto", _CPU_KERNEL_OK,
           "optim.kernel_select.select_kernel, at each CPU update (checked when Hybrid8bitOptimizer is built)",
           "Forces the CPU update kernel: 'cpp' (the fused C++ kernel; raises if it cannot be built) or 'torch'. "
           "'auto': the C++ kernel where it builds and passes its self-check."),
    EnvVar("LAZYTRAIN_CPU_ISA", _CPU_ISA, "auto", _CPU_ISA_OK,
           "optim._cpu_kernel.resolve_isa, at each CPU update (checked when Hybrid8bitOptimizer is built)",
           "Forces the fused C++ kernel's vectorized path (the same bits on each); a path this CPU's build lacks "
           "is refused when the optimizer is built. 'auto': AVX2 where built, else generic."),
    EnvVar("LAZYTRAIN_CPU_LOOKUP", _CPU_LOOKUP, "auto", _CPU_LOOKUP_OK,
           "optim._cpu_kernel, when the fused C++ kernel is loaded (checked when Hybrid8bitOptimizer is built)",
           "Table reads of the AVX2 / AVX-512 paths (bit-identical). 'auto': measures both at load and takes the "
           "faster. A bad value met while loading the kernel is logged and measured as 'auto'."),
    EnvVar("LAZYTRAIN_GPU_KERNEL", _GPU_KERNEL, "auto", _GPU_KERNEL_OK,
           "optim.kernel_select.select_kernel, at each CUDA update (checked when Hybrid8bitOptimizer is built)",
           "Forces the CUDA update kernel: 'triton' (raises where it cannot run), 'bnb' (bitsandbytes) or "
           "'torch'. 'auto': Triton for 8-bit states where it passes its self-check, else bitsandbytes."),
    EnvVar("LAZYTRAIN_CPU_THREADS", _positive_int, None, "an integer >= 1",
           "config.cpu_threads (the CPU optimizer kernel's threads; checked when Hybrid8bitOptimizer is built)",
           "Threads of the CPU optimizer kernel. Unset: the cores this process may use divided among the ranks "
           "on this host (LOCAL_WORLD_SIZE), or torch.get_num_threads() in one process."),
    EnvVar("LAZYTRAIN_CACHE_DIR", Path, None, "a directory path",
           "profiling.hardware.cache_dir",
           "Directory of cached hardware probes. Unset: ~/.cache/lazytrain_hf."),
    EnvVar("LAZYTRAIN_CGROUP_ROOT", Path, None, "a directory path",
           "profiling.limits.cgroup_root (the host-memory limit, when a LazyTrainer is built and at each plan)",
           "Where the cgroup filesystem is mounted (cgroup v2 memory.max, v1 memory/memory.limit_in_bytes are read "
           "there for this process's cgroup from /proc/self/cgroup and its parents). Unset: /sys/fs/cgroup."),
    EnvVar("LAZYTRAIN_GSM8K_DIR", Path, None, "a directory path",
           "benchmarks.common.gsm8k_dir (benchmarks, GSM8K tests)",
           "The GSM8K folder (train.jsonl). Unset: <repo>/../shared/data/gsm8k."),
    EnvVar("LAZYTRAIN_GIT_COMMIT", _text, None, "any text (a commit hash)",
           "benchmarks.common.git_commit (result rows)",
           "The commit recorded in benchmark rows. Unset: this checkout's git HEAD."),
)}


def field_env_name(field_name: str) -> str:
    """``LAZYTRAIN_<FIELD>``: the variable that fills the LazyTrainConfig field `field_name` (its flat key, e.g.
    "policy" for planning.policy) when the user did not give it."""
    return PREFIX + field_name.upper()


def _field_var(group: str, f: dataclasses.Field) -> EnvVar:
    from .config import _CHOICES, SIZE_FIELDS, parse_bytes, parse_duration

    hint = str(f.type)
    if f.name in _CHOICES:
        parse, accepted = _choice(*_CHOICES[f.name])
    elif hint in ("bool", "bool | None"):
        def parse(text: str) -> bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)

        accepted = "true or false (also 1 / 0, yes / no, on / off)"
    elif f.name in SIZE_FIELDS:
        parse, accepted = parse_bytes, "a size with its unit, such as '24GiB', '80GB' or '4096B'"
    elif "duration" in f.metadata:
        parse, accepted = parse_duration, "a duration with its unit, such as '90s', '2min' or '1h'"
    elif hint.startswith("int"):
        parse, accepted = int, "an integer"
    elif hint == "float":
        parse, accepted = float, "a number"
    elif hint.startswith("list"):
        def parse(text: str) -> list[str]:
            return [s for s in text.split(",") if s]

        accepted = "a comma-separated list"
    else:
        parse, accepted = _text, "any text"
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return EnvVar(field_env_name(f.name), parse, default, accepted,
                  f"LazyTrainConfig.{group}.{f.name}, when its group is built",
                  f"Fills {group}.{f.name} (flat key {f.name}) when it is not given (an explicit value, grouped or "
                  "flat, a key of a dict / YAML / JSON config, always wins).")


@functools.cache
def _table() -> dict[str, EnvVar]:
    from .config import config_fields

    fields = {field_env_name(f.name): _field_var(g, f) for g, f in config_fields()}
    clash = sorted(set(fields) & set(VARIABLES))
    if clash:
        raise RuntimeError(f"environment variables {clash} are both LazyTrainConfig fields and other settings")
    return {**VARIABLES, **fields}


def table() -> dict[str, EnvVar]:
    """Every variable: `VARIABLES`, then one ``LAZYTRAIN_<FIELD>`` per LazyTrainConfig field (all groups)."""
    return dict(_table())


def unknown_variables(environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """{variable: the closest known one, or None} for each ``LAZYTRAIN_*`` variable of `environ` (default
    `os.environ`) that is no row of `table` (the package ignores it)."""
    env = os.environ if environ is None else environ
    known = _table()
    tails = [k.removeprefix(PREFIX) for k in known]  # compared without the prefix every name shares

    def closest(name: str) -> str | None:
        match = difflib.get_close_matches(name.removeprefix(PREFIX), tails, n=1, cutoff=0.6)
        return PREFIX + match[0] if match else None

    return {name: closest(name) for name in sorted(env) if name.startswith(PREFIX) and name not in known}


#: unknown variables already warned about in this process
_WARNED: set[str] = set()


def warn_unknown() -> None:
    """Warn once per process for each unknown ``LAZYTRAIN_*`` variable set (`unknown_variables`), naming the
    closest known one."""
    for name, close in unknown_variables().items():
        if name in _WARNED:
            continue
        _WARNED.add(name)
        hint = f"did you mean {close}? " if close else ""
        warnings.warn(f"environment variable {name} is not one lazytrain_hf reads and is ignored; {hint}The known "
                      "ones are listed in docs/environment.md (python -m lazytrain_hf.envvars).", stacklevel=2)


def read(name: str, default: Any = _NO_DEFAULT) -> Any:
    """The parsed value of environment variable `name` (a row of `table`), read now.

    Args:
        name: e.g. ``"LAZYTRAIN_CPU_ISA"``.
        default: returned when the variable is unset or empty (only whitespace); the row's default if omitted.

    Raises:
        KeyError: `name` is not in the table.
        ValueError: the value is not what the row accepts (names the variable, the value and the accepted values).
    """
    var = _table()[name]
    warn_unknown()
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return var.default if default is _NO_DEFAULT else default
    try:
        return var.parse(raw.strip())
    except ValueError:
        raise ValueError(f"environment {name} must be {var.accepted}, but got {raw!r}; unset it for the default "
                         f"({_show(var.default)})") from None


def _show(value: Any) -> str:
    return "none" if value is None else repr(value)


def render_markdown() -> str:
    """The table as Markdown (docs/environment.md)."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["# Environment variables", "",
             "Generated from `lazytrain_hf/envvars.py` (`python -m lazytrain_hf.envvars > docs/environment.md`).",
             "Each is read by `lazytrain_hf.envvars.read`: unset or empty gives the default; a value outside",
             "'Accepted' raises one `ValueError` naming the variable, the value and the accepted values.",
             "A `LAZYTRAIN_<FIELD>` variable (the flat key in upper case, for any group) fills that field of",
             "`LazyTrainConfig` only when the user did not give it, grouped or flat (as an argument, or as a key of",
             "a dict / YAML / JSON config); [configuration.md](configuration.md) lists the keys.",
             "A `LAZYTRAIN_*` variable set but not in this table (a typo) is ignored, with one warning per process",
             "naming the closest variable here.", "",
             "| Variable | Accepted | Default | Read by | Meaning |", "| --- | --- | --- | --- | --- |"]
    for var in _table().values():
        lines.append(f"| `{var.name}` | {cell(var.accepted)} | {cell(_show(var.default))} | {cell(var.applies)} "
                     f"| {cell(var.help)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render_markdown(), end="")
