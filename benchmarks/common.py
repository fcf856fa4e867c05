"""Shared benchmark helpers: machine facts, results JSON (shared/RESULTS_FORMAT.md), GSM8K token streams,
fast random-weight models of the real shapes, and their bitsandbytes 4-bit bases."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lazytrain_hf import envvars

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


def gsm8k_token_rows(seq_len: int, num_rows: int, data_dir: str | None = None) -> torch.Tensor:
    """[num_rows, seq_len] int64: GSM8K train problems (question + answer, eos-separated) tokenized with the real
    Qwen tokenizer and packed into rows; repeats the stream if needed (folder: `gsm8k_dir`)."""
    from lazytrain_hf.data import load_tokenizer

    data_dir = gsm8k_dir(data_dir)
    tok = load_tokenizer("qwen-offline")
    ids: list[int] = []
    need = seq_len * num_rows
    with open(Path(data_dir) / "train.jsonl") as f:
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


def _random_bank(dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """A bank of N(0, 0.02) values tiled over every matrix: memory-bound copies instead of minutes of CPU RNG."""
    return torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(dtype).to(device)


def _fill_(name: str, p: torch.Tensor, bank: torch.Tensor) -> None:
    """`fast_random_model`'s value of one parameter, in place: a matrix tiles `bank` from its first element (so a
    parameter's values depend on its shape alone, not on the order parameters are filled), a norm is 1, the rest 0."""
    if p.dim() >= 2:
        flat = p.view(-1)
        for a in range(0, flat.numel(), bank.numel()):
            b = min(a + bank.numel(), flat.numel())
            flat[a:b].copy_(bank[: b - a])
    elif "norm" in name:
        p.fill_(1.0)
    else:
        p.zero_()


def _rebuild_rotary(model: Any) -> None:
    """Rotary modules built anew on the CPU (to_empty / the meta device left their tables uninitialized)."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if hasattr(child, "inv_freq") and hasattr(child, "config"):
                setattr(parent, child_name, type(child)(child.config))


def fast_random_model(name: str, dtype: torch.dtype = torch.bfloat16):
    """The registry shape `name` (a harness model string: `parse_model`) on the CPU with N(0, 0.02) weights, unit
    norms, zero biases; built on the meta device and filled in place (seconds for 7B instead of minutes of
    per-module init)."""
    from transformers import AutoModelForCausalLM

    from lazytrain_hf.models import resolve_config

    base, overrides = model_overrides(name)
    config = resolve_config(base, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu")
    bank = _random_bank(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            _fill_(n, p, bank)
        _rebuild_rotary(model)
    model.tie_weights()
    return model


def logical_numel(p: torch.Tensor) -> int:
    """The parameters `p` stands for: a bitsandbytes 4-bit weight its original shape's (its packed uint8 data holds
    two per byte), any other tensor its numel."""
    from lazytrain_hf.streaming.quant import is_4bit

    return math.prod(p.quant_state.shape) if is_4bit(p) else p.numel()


def _quantized_skeleton(name: str, quantization: dict[str, Any], dtype: torch.dtype):
    """(model on the meta device with transformers' Linear4bit modules in place of nn.Linear, its HfQuantizer)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    from lazytrain_hf.models import resolve_config

    base, overrides = model_overrides(name)
    config = resolve_config(base, **overrides)
    quant = BitsAndBytesConfig(**quantization)
    if not quant.load_in_4bit:
        raise ValueError(f"quantization {quantization}: only load_in_4bit=True bases are built here")
    hfq = AutoHfQuantizer.from_config(quant, pre_quantized=False)
    hfq.validate_environment(device_map={"": "cpu"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hfq.preprocess_model(model=model, dtype=dtype, device_map={"": "cpu"})  # nn.Linear -> Linear4bit, on meta
    return model, hfq


def quantized_host_bytes(name: str, quantization: dict[str, Any], dtype: torch.dtype = torch.bfloat16
                         ) -> dict[str, int]:
    """Host bytes of `quantized_random_model(name, quantization)`, from its meta skeleton (nothing is allocated):
    per 4-bit weight of n parameters (block size b, bitsandbytes' layout) n / 2 packed bytes, then the state:
    with double quantization one uint8 absmax per block, an fp32 offset, the 16-entry fp32 code, and the nested
    state's fp32 absmax per 256 blocks and 256-entry fp32 code; without it one fp32 absmax per block and the code.
    The other parameters (embedding, norms, LM head; tied ones once) at `dtype`'s size.

    Returns four_bit_params, packed, state, other_params, other_bytes, total."""
    import bitsandbytes as bnb

    model, hfq = _quantized_skeleton(name, quantization, dtype)
    q = hfq.quantization_config
    block = 64  # Params4bit's default, the one transformers' Linear4bit weights keep
    out = dict.fromkeys(("four_bit_params", "packed", "state", "other_params", "other_bytes"), 0)
    seen: set[int] = set()
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
                n = p.numel()
                blocks = -(-n // block)
                out["four_bit_params"] += n
                out["packed"] += -(-n // 2)
                out["state"] += (blocks + 4 + 16 * 4 + 4 * -(-blocks // 256) + 256 * 4
                                 if q.bnb_4bit_use_double_quant else 4 * blocks + 16 * 4)
            else:
                out["other_params"] += p.numel()
                out["other_bytes"] += p.numel() * dtype.itemsize
    out["total"] = out["packed"] + out["state"] + out["other_bytes"]
    return out


def quantized_random_model(name: str, quantization: dict[str, Any], device: str = "cpu",
                           dtype: torch.dtype = torch.bfloat16):
    """The registry shape `name` (a harness model string) with `fast_random_model`'s weights, its linear layers in
    bitsandbytes 4 bits as `AutoModelForCausalLM.from_pretrained(..., quantization_config=
    BitsAndBytesConfig(**quantization), device_map="cpu", dtype=dtype)` gives them for those `dtype` weights: the
    same Linear4bit modules (transformers' replace_with_bnb_linear; the LM head and tied weights kept in `dtype`),
    each weight quantized by the same `Params4bit(value, **meta.__dict__).to(device)`, and the model's
    `hf_quantizer`, `is_quantized`, `quantization_method`, `is_loaded_in_4bit` and `config.quantization_config`.

    Built without the whole model in `dtype` ever existing (a bf16 70B would not fit a 128 GiB host): the skeleton
    on the meta device, then module by module one weight at a time is filled in `dtype` on `device`, quantized there
    and its packed data and quantization state moved to the CPU, so host memory peaks at the built model plus one
    linear's packed weights (on `device` "cpu": plus bitsandbytes' fp32 temporaries of one weight). `device` "cuda"
    fills and quantizes on the GPU (bitsandbytes' CUDA kernel: minutes faster for a 70B; its bits may differ from
    the CPU kernel's, as from_pretrained's would with device_map="cuda"); every tensor of the result is on the CPU."""
    import bitsandbytes as bnb

    model, hfq = _quantized_skeleton(name, quantization, dtype)
    qdev = torch.device(device)
    banks = {torch.device("cpu"): _random_bank(dtype)}
    if qdev.type != "cpu":
        banks[qdev] = banks[torch.device("cpu")].to(qdev)
    done: dict[int, torch.nn.Parameter] = {}  # meta parameter -> its built one (tied weights stay one parameter)
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for pname, p in list(module.named_parameters(recurse=False)):
                if id(p) in done:
                    setattr(module, pname, done[id(p)])
                    continue
                full = f"{prefix}.{pname}" if prefix else pname
                if isinstance(module, bnb.nn.Linear4bit) and pname == "weight":
                    value = torch.empty(p.shape, dtype=dtype, device=qdev)
                    _fill_(full, value, banks[qdev])
                    # transformers' Bnb4bitQuantize.convert: quantized by Params4bit.to, the module's quant_state set
                    new = bnb.nn.Params4bit(value, requires_grad=False, **p.__dict__).to(qdev)
                    del value
                    if qdev.type != "cpu":
                        new.data = new.data.cpu()
                        new.quant_state.to("cpu")  # in place: the module's quant_state is the same object
                    module._is_hf_initialized = new._is_hf_initialized = True
                else:
                    new = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    _fill_(full, new.data, banks[torch.device("cpu")])
                done[id(p)] = new
                setattr(module, pname, new)
        _rebuild_rotary(model)
    model.tie_weights()
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{name}: tensors left on the meta device after the build: {left[:5]}")
    del banks
    if qdev.type == "cuda":
        torch.cuda.empty_cache()
    model.hf_quantizer = hfq
    hfq.postprocess_model(model)  # config.quantization_config, is_loaded_in_4bit
    return model.eval()  # as from_pretrained returns it
