"""Shared benchmark helpers: machine facts, results JSON (shared/RESULTS_FORMAT.md), GSM8K token streams,
fast random-weight models of the real shapes, and their bitsandbytes 4-bit bases."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lazytrain_hf import envvars, quantized

GIB = 1024**3
ROW_KEYS = ("system", "model", "params", "gpu_cap_gib", "batch_size", "seq_len", "status", "reason",
            "step_s_median", "step_s_p10", "step_s_p90", "steps_timed", "tokens_per_s", "tflops_6nd",
            "tflops_executed", "peak_gpu_gib", "peak_host_rss_gib", "pinned_planned_gib", "pinned_locked_gib",
            "exposed_h2d_ms", "exposed_d2h_ms", "optimizer_ms", "predicted_step_s", "solve_ms", "mip_gap", "extra")


def machine() -> dict[str, Any]:
    import transformers

    m = {"cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
         "python": platform.python_version()}
    try:
        import psutil

        m["host_memory_gib"] = round(psutil.virtual_memory().total / GIB, 1)
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            m["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
    except OSError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / GIB, 1))
    return m


def git_commit() -> str | None:
    """LAZYTRAIN_GIT_COMMIT when set (the GPU machine's copy of the tree carries a stale .git: pass the local
    `git rev-parse HEAD` in the command), else this checkout's HEAD."""
    if envvars.read("LAZYTRAIN_GIT_COMMIT"):
        return envvars.read("LAZYTRAIN_GIT_COMMIT")
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def row(**kw: Any) -> dict[str, Any]:
    """A results row with every key of the format present (None where it does not apply)."""
    r = {k: None for k in ROW_KEYS}
    r["extra"] = {}
    r.update(kw)
    return r


def percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]  # noqa: E731
    return {"step_s_median": statistics.median(xs), "step_s_p10": q(0.1), "step_s_p90": q(0.9),
            "steps_timed": len(xs)}


def append_results(path: str | Path, suite: str, rows: list[dict[str, Any]]) -> None:
    """Merge rows into `path` (created with the format's header if absent); written atomically."""
    path = Path(path)
    doc = json.loads(path.read_text()) if path.is_file() else {
        "suite": suite, "date": datetime.date.today().isoformat(),
        "command": " ".join(["python -m benchmarks." + Path(sys.argv[0]).stem, *sys.argv[1:]]),
        "git_commit": git_commit(), "machine": machine(), "rows": []}
    cmd = " ".join(["python -m benchmarks." + Path(sys.argv[0]).stem, *sys.argv[1:]])
    doc.setdefault("commands", [])
    if cmd not in doc["commands"]:
        doc["commands"].append(cmd)
    doc["rows"].extend(rows)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)


def gsm8k_dir(data_dir: str | None = None) -> Path:
    """The GSM8K folder: `data_dir`, else LAZYTRAIN_GSM8K_DIR, else <repo>/../shared/data/gsm8k.

    Raises:
        FileNotFoundError: it has no train.jsonl (names the two ways to point at it).
    """
    d = Path(data_dir or envvars.read("LAZYTRAIN_GSM8K_DIR") or
             Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k")
    if not (d / "train.jsonl").is_file():
        raise FileNotFoundError(f"no GSM8K train.jsonl in {d}: pass --data-dir /path/to/gsm8k or set "
                                "LAZYTRAIN_GSM8K_DIR")
    return d


def gsm8k_token_rows(seq_len: int, num_rows: int, data_dir: str | None = None, split: str = "train") -> torch.Tensor:
    """[num_rows, seq_len] int64: GSM8K problems of `split` ("train" or "test"; question + answer, eos-separated)
    tokenized with the real Qwen tokenizer and packed into rows; repeats the stream if needed (folder: `gsm8k_dir`)."""
    from lazytrain_hf.data import load_tokenizer

    data_dir = gsm8k_dir(data_dir)
    tok = load_tokenizer("qwen-offline")
    ids: list[int] = []
    need = seq_len * num_rows
    with open(Path(data_dir) / f"{split}.jsonl") as f:
        for line in f:
            ex = json.loads(line)
            ids.extend(tok(ex["question"] + "\n" + ex["answer"])["input_ids"] + [tok.eos_token_id])
            if len(ids) >= need:
                break
    while len(ids) < need:
        ids.extend(ids[: need - len(ids)])
    return torch.tensor(ids[:need]).view(num_rows, seq_len)


#: options of a model string "<name>:<option>=<value>[:...]" -> the config field each sets
MODEL_OPTIONS = {"layers": "num_hidden_layers"}


def parse_model(spec: str) -> tuple[str, dict[str, int]]:
    """A harness model string as (name, options): ``"qwen3.6-27b:layers=16"`` -> ``("qwen3.6-27b",
    {"num_hidden_layers": 16})``, the registry (or Hub / local) shape with its first 16 decoder layers; a string
    without ``:`` (or an existing folder) -> ``(spec, {})``.

    Raises:
        ValueError: an option other than ``layers=N`` (N an integer >= 1), or one given twice.
    """
    if ":" not in spec or Path(spec).is_dir():
        return spec, {}
    name, *opts = spec.split(":")
    out: dict[str, int] = {}
    for opt in opts:
        key, eq, value = opt.partition("=")
        field = MODEL_OPTIONS.get(key.strip())
        if not eq or field is None or not value.strip().isdigit() or int(value) < 1 or field in out:
            raise ValueError(f"model {spec!r}: option {opt!r} is not understood; write <name>:layers=N with N an "
                             "integer >= 1, e.g. qwen3.6-27b:layers=16")
        out[field] = int(value)
    if not name:
        raise ValueError(f"model {spec!r}: no model name before ':'; e.g. qwen3.6-27b:layers=16")
    return name, out


def depth_overrides(name: str, num_hidden_layers: int) -> dict[str, Any]:
    """Config overrides that keep the first `num_hidden_layers` decoder layers of `name`'s config: the count and,
    where the config lists a kind per layer (`layer_types`: Qwen3.5's 3 linear_attention : 1 full_attention, Qwen2's
    sliding / full), that list cut to the same length, so the kept layers are the deep model's first ones (a loaded
    config keeps its own list otherwise: a count without the list leaves the two inconsistent). For
    `lazytrain_hf.models.resolve_config(name, **overrides)` and `load_model(name, dtype, **overrides)`.

    Raises:
        ValueError: the config lists fewer layer kinds than `num_hidden_layers`.
    """
    from lazytrain_hf.models import resolve_config

    types = getattr(resolve_config(name), "layer_types", None)
    if types is None:
        return {"num_hidden_layers": num_hidden_layers}
    if num_hidden_layers > len(types):
        raise ValueError(f"model {name!r} has {len(types)} layers: layers={num_hidden_layers} cannot be taken from it; "
                         f"pass layers=N with N <= {len(types)}")
    return {"num_hidden_layers": num_hidden_layers, "layer_types": list(types[:num_hidden_layers])}


def model_overrides(spec: str) -> tuple[str, dict[str, Any]]:
    """(name, config overrides) of a harness model string (`parse_model`, `depth_overrides`)."""
    name, opts = parse_model(spec)
    n = opts.get("num_hidden_layers")
    return name, ({} if n is None else depth_overrides(name, n))


def fast_random_model(name: str, dtype: torch.dtype = torch.bfloat16):
    """The registry shape `name` (a harness model string: `parse_model`) on the CPU with N(0, 0.02) weights, unit
    norms, zero biases; built on the meta device and filled in place (seconds for 7B instead of minutes of
    per-module init)."""
    from transformers import AutoModelForCausalLM

    from lazytrain_hf.models import filled_from_bank, resolve_config

    base, overrides = model_overrides(name)
    config = resolve_config(base, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return filled_from_bank(model, dtype)


def logical_numel(p: torch.Tensor) -> int:
    """`lazytrain_hf.streaming.quant.logical_numel`, imported when called (the streaming package loads
    transformers)."""
    from lazytrain_hf.streaming.quant import logical_numel as numel

    return numel(p)


def quantized_host_bytes(name: str, quantization: dict[str, Any], dtype: torch.dtype = torch.bfloat16
                         ) -> dict[str, int]:
    """`lazytrain_hf.quantized.quantized_host_bytes` of a harness model string (`model_overrides`)."""
    from lazytrain_hf.models import resolve_config

    base, overrides = model_overrides(name)
    return quantized.quantized_host_bytes(resolve_config(base, **overrides), quantization, dtype)


def quantized_random_model(name: str, quantization: dict[str, Any], device: str = "cpu",
                           dtype: torch.dtype = torch.bfloat16):
    """`lazytrain_hf.quantized.quantized_random_model` of a harness model string (`model_overrides`), seed 0: the
    weights `fast_random_model` gives, in 4 bits, quantized on `device`, every tensor ending on the CPU."""
    base, overrides = model_overrides(name)
    return quantized.quantized_random_model(base, quantization, dtype, seed=0, device=device, **overrides)
