"""Micro-benchmark of the optimizer update: params/s of each kernel, side by side.

Rows (``system`` in the JSON):
  hybrid8_torch             Hybrid8bitOptimizer, 8-bit states, pure-torch kernel (the fallback)
  hybrid8_cpp               Hybrid8bitOptimizer, 8-bit states, fused C++ kernel
  hybrid8_cpp_prepared      the same update with its moments prepared before each step (`prepare_states`,
                            untimed): the half the executor's worker leaves for the step window
  hybrid8_cpp_prepare       `prepare_states` alone (dequantize m and v into fp32): the half run ahead, during
                            the previous backward (its params/s counts the parameters dequantized)
  hybrid8_cpp_fp32_states   Hybrid8bitOptimizer, fp32 states, fused C++ kernel
  torch_adamw_fused_fp32    torch.optim.AdamW(fused=True), fp32 params and states (the speed to match)
  bnb_adamw8bit_cpu         bitsandbytes.optim.AdamW8bit on CPU, when bitsandbytes is installed
  GPU rows (CUDA; "unsupported" elsewhere), parameters and gradients on the GPU, each step synchronized:
  hybrid8_gpu               Hybrid8bitOptimizer, 8-bit states (bitsandbytes' blockwise kernel)
  hybrid8_gpu_triton        Hybrid8bitOptimizer, 8-bit states (the fused Triton kernel, the CUDA default)
  bnb_adamw8bit_gpu         bitsandbytes.optim.AdamW8bit
  torch_adamw_fused_fp32_gpu, torch_adamw_foreach_fp32_gpu   torch.optim.AdamW(fused / foreach), fp32

``--threads 1,8,16`` repeats the CPU rows at each thread count (GPU rows run once); ``--cpu-isa avx512,avx2``
repeats the C++ kernel's rows on each ISA path (``LAZYTRAIN_CPU_ISA`` set around the row, ``extra.cpu_isa``; a
path the build lacks gives an "unsupported" row). ``extra.moment_bytes_per_param``
counts the moments and their absmax only (the goal: <= 2.04 for 8-bit tensors); ``state_bytes_per_param`` adds
master weights / Kahan buffers.

Hybrid8 rows use ``--param-dtype`` params (bf16 by default) with ``--master-weights`` (auto by default: the
optimizer's default, a bf16 Kahan compensation for bf16 params; ``fp32``: an fp32 master copy), ``--grad-dtype`` gradients (fp32 by
default; the executor supplies bf16) through `set_grad_source`, and an active clip coefficient. Their ``extra``
records the fused CPU kernel's build and table-read mode (`cpu_kernel_status`).
Each row: ``--warmup`` untimed steps, then ``--steps`` timed steps; the median is reported. Timings are wall
clock on CPU tensors (no device synchronization needed).

    python -m benchmarks.bench_optim                          # 8 M params, all rows, JSON to benchmarks/results/
    python -m benchmarks.bench_optim --params 67108864 --threads 16 --out /tmp/bench.json
    python -m benchmarks.bench_optim --master-weights kahan --grad-dtype bf16 --threads 16   # as the executor
    python -m benchmarks.bench_optim --systems hybrid8_cpp --cpu-isa avx512,avx2 --threads 16   # ISA paths

The JSON follows shared/RESULTS_FORMAT.md (suite "hybrid8"; params_per_s and state_bytes_per_param in extra).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from lazytrain_hf.config import cpu_threads

from .common import ROW_KEYS, git_commit, machine

SYSTEMS = ["hybrid8_torch", "hybrid8_cpp", "hybrid8_cpp_fp32_states", "torch_adamw_fused_fp32", "bnb_adamw8bit_cpu",
           "hybrid8_cpp_prepared", "hybrid8_cpp_prepare"]
# the rows --cpu-isa repeats
CPP_SYSTEMS = ["hybrid8_cpp", "hybrid8_cpp_fp32_states", "hybrid8_cpp_prepared", "hybrid8_cpp_prepare"]
GPU_SYSTEMS = ["hybrid8_gpu", "hybrid8_gpu_triton", "bnb_adamw8bit_gpu", "torch_adamw_fused_fp32_gpu", "torch_adamw_foreach_fp32_gpu"]
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _synchronized(step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        step()
        torch.cuda.synchronize()

    return run


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _time_steps(step: Callable[[], None], warmup: int, steps: int,
                before: Callable[[], None] | None = None) -> list[float]:
    """Wall times of `steps` calls of `step` after `warmup` ones; `before` runs untimed ahead of each call."""
    out = []
    for k in range(warmup + steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        step()
        if k >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _tensors(n: int, count: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [n // count + (1 if i < n % count else 0) for i in range(count)]
    return [(torch.randn(s, generator=g) * 0.02).to(dtype) for s in sizes]


def _at_page_offset(t: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of `t` whose first byte sits `offset` bytes (mod 4096, a multiple of 64) into a page."""
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + 8192, dtype=torch.uint8)
    start = ((-raw.data_ptr()) % 4096 + offset) % 4096
    return raw[start:start + nbytes].view(t.dtype).view(t.shape).copy_(t)


def _state_bytes(opt: torch.optim.Optimizer, keys: tuple[str, ...] | None = None) -> int:
    """Bytes of the optimizer's per-parameter tensor states (only `keys` when given)."""
    return sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items()
               if isinstance(v, torch.Tensor) and v.dim() > 0 and (keys is None or k in keys))


_MOMENTS = ("state1", "state2", "absmax1", "absmax2", "exp_avg", "exp_avg_sq", "qmap1", "qmap2")


def _params(args: argparse.Namespace, dtype: torch.dtype, device: str) -> list[torch.nn.Parameter]:
    """`args.params` parameters in `args.tensors` tensors on `device`, each with a random gradient."""
    params = [torch.nn.Parameter(t.to(device)) for t in _tensors(args.params, args.tensors, dtype)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _hybrid8_gpu(args: argparse.Namespace, kernel: str) -> tuple[Callable[[], None], int, int]:
    """Hybrid8 on the GPU with `kernel` forced (``LAZYTRAIN_GPU_KERNEL`` set around each step)."""
    from lazytrain_hf.optim import Hybrid8bitOptimizer
    from lazytrain_hf.optim.functional import GPU_KERNEL_ENV

    opt = Hybrid8bitOptimizer(_params(args, _DTYPES[args.param_dtype], "cuda"), lr=1e-5, weight_decay=0.01,
                              master_weights=args.master_weights)
    norm = torch.tensor(2.0, device="cuda")

    def step() -> None:
        with mock.patch.dict(os.environ, {GPU_KERNEL_ENV: kernel}):
            opt.clip_grad_norm(1.0, norm=norm)
            opt.step()

    step()
    return step, _state_bytes(opt), _state_bytes(opt, _MOMENTS)


def _torch_adamw(args: argparse.Namespace, device: str, impl: str) -> tuple[Callable[[], None], int, int]:
    """torch.optim.AdamW with fp32 parameters on `device`, `impl` "fused" or "foreach"."""
    opt = torch.optim.AdamW(_params(args, torch.float32, device), lr=1e-5, weight_decay=0.01, **{impl: True})
    opt.step()
    return opt.step, _state_bytes(opt), _state_bytes(opt, _MOMENTS)


def _bnb(args: argparse.Namespace, device: str) -> tuple[Callable[[], None], int, int]:
    import bitsandbytes as bnb

    opt = bnb.optim.AdamW8bit(_params(args, _DTYPES[args.param_dtype], device), lr=1e-5, weight_decay=0.01)
    opt.step()
    return opt.step, _state_bytes(opt), _state_bytes(opt, _MOMENTS)


def _hybrid8(args: argparse.Namespace, kernel: str, state_dtype: str, prepare: str | None = None) -> tuple:
    """--stagger K: the parameter, its gradient and each optimizer state buffer start at distinct page offsets
    (0, K, 2K, ... mod 4096): Intel cores stall a load that follows a store to an address with the same low 12
    bits (4K aliasing), and the executor's page-aligned buffers of one layer all share their low 12 bits.

    prepare "before": the step's moments are prepared (`prepare_states`) untimed before each step (a 4th return
    value, which `run_row` runs untimed); "only": the timed call is `prepare_states` alone."""
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    os.environ["LAZYTRAIN_CPU_KERNEL"] = kernel
    k = args.stagger
    tensors = _tensors(args.params, args.tensors, _DTYPES[args.param_dtype])
    params = [torch.nn.Parameter(_at_page_offset(t, 0) if k else t) for t in tensors]
    grads = {id(p): (torch.randn(p.numel()) * 1e-3).to(_DTYPES[args.grad_dtype]) for p in params}   # host gradients
    if k:
        grads = {key: _at_page_offset(g, k) for key, g in grads.items()}
    opt = Hybrid8bitOptimizer(params, lr=1e-5, weight_decay=0.01, state_dtype=state_dtype,
                              master_weights=args.master_weights)
    if k:
        nth = itertools.count(2)  # offsets 0 and K are the parameter's and the gradient's

        def alloc(p: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
            return _at_page_offset(torch.empty(shape, dtype=dtype), (next(nth) * k) % 4096)

        opt.set_state_allocator(alloc)
    opt.set_grad_source(lambda p: grads[id(p)])
    norm = torch.tensor(2.0)

    def step() -> None:
        opt.clip_grad_norm(1.0, norm=norm)   # coefficient 0.5, folded into the update
        opt.step()

    step()   # allocate states
    if prepare == "only":
        return lambda: opt.prepare_states(params), _state_bytes(opt), _state_bytes(opt, _MOMENTS)
    if prepare == "before":
        return step, _state_bytes(opt), _state_bytes(opt, _MOMENTS), lambda: opt.prepare_states(params)
    return step, _state_bytes(opt), _state_bytes(opt, _MOMENTS)


def run_row(system: str, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    pdtype = "fp32" if system.startswith("torch_adamw") else args.param_dtype
    gpu = system in GPU_SYSTEMS
    row.update(system=system, model=f"synthetic-{args.tensors}x", params=args.params,
               extra={"param_dtype": pdtype, "device": "cuda" if gpu else "cpu", "tensors": args.tensors,
                      **({} if gpu else {"threads": torch.get_num_threads(), "kernel_threads": cpu_threads()})})
    if gpu and not torch.cuda.is_available():
        row.update(status="unsupported", reason="needs CUDA")
        return row
    if system.startswith("hybrid8"):
        from lazytrain_hf.optim import cpu_kernel_status

        row["extra"].update(master_weights=args.master_weights, grad_dtype=args.grad_dtype, stagger_bytes=args.stagger)
        if system != "hybrid8_torch":
            row["extra"]["cpu_kernel"] = cpu_kernel_status()[1]
    try:
        builders: dict[str, Callable[[], tuple]] = {
            "hybrid8_torch": lambda: _hybrid8(args, "torch", "8bit"),
            "hybrid8_cpp": lambda: _hybrid8(args, "cpp", "8bit"),
            "hybrid8_cpp_fp32_states": lambda: _hybrid8(args, "cpp", "fp32"),
            "hybrid8_cpp_prepared": lambda: _hybrid8(args, "cpp", "8bit", prepare="before"),
            "hybrid8_cpp_prepare": lambda: _hybrid8(args, "cpp", "8bit", prepare="only"),
            "torch_adamw_fused_fp32": lambda: _torch_adamw(args, "cpu", "fused"),
            "bnb_adamw8bit_cpu": lambda: _bnb(args, "cpu"),
            "hybrid8_gpu": lambda: _hybrid8_gpu(args, "bnb"),
            "hybrid8_gpu_triton": lambda: _hybrid8_gpu(args, "triton"),
            "bnb_adamw8bit_gpu": lambda: _bnb(args, "cuda"),
            "torch_adamw_fused_fp32_gpu": lambda: _torch_adamw(args, "cuda", "fused"),
            "torch_adamw_foreach_fp32_gpu": lambda: _torch_adamw(args, "cuda", "foreach"),
        }
        if system not in builders:
            raise ValueError(f"unknown system {system!r}; choose from {SYSTEMS + GPU_SYSTEMS}")
        step, nbytes, moment_bytes, *before = builders[system]()
        if gpu:
            step = _synchronized(step)
        steps = args.steps if system != "hybrid8_torch" else max(5, args.steps // 2)
        times = _time_steps(step, args.warmup, steps, *before)
        if gpu:
            del step  # frees the GPU tensors before the next row
            torch.cuda.empty_cache()
    except ImportError as e:
        row.update(status="unsupported", reason=f"{type(e).__name__}: {e}")
        return row
    except Exception as e:  # noqa: BLE001 - a benchmark row records the failure and the run goes on
        row.update(status="error", reason=f"{type(e).__name__}: {e}"[:500])
        return row
    med = statistics.median(times)
    row.update(status="ok", step_s_median=med, step_s_p10=_pct(times, 0.1), step_s_p90=_pct(times, 0.9),
               steps_timed=len(times), optimizer_ms=med * 1e3)
    row["extra"].update(params_per_s=args.params / med, state_bytes_per_param=nbytes / args.params,
                        moment_bytes_per_param=moment_bytes / args.params)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=8 * 2**20, help="parameters per row (default 8 Mi)")
    ap.add_argument("--tensors", type=int, default=1, help="split the parameters into this many tensors")
    ap.add_argument("--param-dtype", choices=sorted(_DTYPES), default="bf16", help="hybrid8 / bnb param dtype")
    ap.add_argument("--master-weights", choices=["auto", "fp32", "kahan", "stochastic", "none"], default="auto",
                    help="hybrid8 master weights (auto: kahan for bf16 params, the optimizer's default)")
    ap.add_argument("--grad-dtype", choices=sorted(_DTYPES), default="fp32", help="hybrid8 host gradient dtype")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row (at least 5 reported)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    ap.add_argument("--threads", type=_thread_counts, default=None,
                    help="torch / OpenMP threads, or a list (1,8,16) to repeat the CPU rows (default: torch's)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {SYSTEMS + GPU_SYSTEMS}")
    ap.add_argument("--stagger", type=int, default=0,
                    help="hybrid8: put parameter, gradient and state buffers at page offsets 0, K, 2K, ... bytes "
                         "(a multiple of 64; 0: as allocated)")
    ap.add_argument("--triton-launch", type=_launches, default=None,
                    help="hybrid8_gpu_triton: repeat the row for each launch shape ROWS:WARPS (quantization blocks and "
                         "warps per program), e.g. 4:4,8:4,8:8 (default: the kernel's own)")
    ap.add_argument("--cpu-isa", type=_isas, default=None,
                    help="hybrid8_cpp rows: repeat them on each ISA path of the C++ kernel, e.g. avx512,avx2 "
                         "(LAZYTRAIN_CPU_ISA; default: the environment's, else auto: AVX2 where built; a path this CPU's "
                         "build lacks gives an 'unsupported' row)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"),
                    help="JSON file, or a directory for hybrid8-<YYYYMMDD>.json")
    args = ap.parse_args(argv)
    if args.stagger % 64 or args.stagger < 0:
        ap.error(f"--stagger must be a non-negative multiple of 64 bytes, but got {args.stagger}")
    if args.tensors < 1 or args.params < args.tensors:
        ap.error(f"--params must be at least --tensors (>= 1), but got --params {args.params} --tensors "
                 f"{args.tensors}")
    args.steps = max(5, args.steps)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS + GPU_SYSTEMS]
    if unknown or not systems:
        ap.error(f"--systems: unknown {unknown or args.systems!r}; choose from {SYSTEMS + GPU_SYSTEMS}")
    if args.triton_launch and "hybrid8_gpu_triton" not in systems:
        ap.error("--triton-launch sweeps the hybrid8_gpu_triton row: add it to --systems")
    if args.cpu_isa and not set(CPP_SYSTEMS) & set(systems):
        ap.error(f"--cpu-isa sweeps the C++ kernel's rows: add one of {CPP_SYSTEMS} to --systems")
    rows = []
    print(f"{'system':28s} {'thr':>3s} {'dtype':5s} {'ms/step':>9s} {'M params/s':>11s} {'B/param':>8s} "
          f"{'moments':>8s}")
    # main() is also called in-process (tests): leave the caller's thread settings and environment as they were
    with mock.patch.dict(os.environ), contextlib.ExitStack() as restore:
        restore.callback(torch.set_num_threads, torch.get_num_threads())
        for threads in args.threads or [None]:
            if threads:
                # the C++ kernel takes lazytrain_hf.config.cpu_threads(), which LAZYTRAIN_CPU_THREADS overrides
                # (gpu_session.sh exports it with CPUSET): set both, or every row would run on the exported count
                torch.set_num_threads(threads)
                os.environ["LAZYTRAIN_CPU_THREADS"] = str(threads)
            for system in systems:
                if system in GPU_SYSTEMS and threads != (args.threads or [None])[0]:
                    continue  # GPU rows once
                for launch in (args.triton_launch or [None]) if system == "hybrid8_gpu_triton" else [None]:
                    for isa in (args.cpu_isa or [None]) if system in CPP_SYSTEMS else [None]:
                        row = _run_with_isa(system, args, launch, isa)
                        rows.append(row)
                        _print_row(row)
    for threads in sorted({r["extra"].get("threads") for r in rows} - {None}):
        fused = next((r for r in rows if r["system"] == "torch_adamw_fused_fp32" and r["status"] == "ok"
                      and r["extra"].get("threads") == threads), None)
        if fused:
            print(f"{threads} threads, params/s / torch_adamw_fused_fp32's: " + ", ".join(
                f"{_label(r)} {r['extra']['params_per_s'] / fused['extra']['params_per_s']:.2f}"
                for r in rows if r["status"] == "ok" and r["extra"].get("threads") == threads))
        if args.cpu_isa and len(args.cpu_isa) > 1:   # each ISA path's rate against the first one's
            for system in CPP_SYSTEMS:
                by_isa = {r["extra"]["cpu_isa"]: r["extra"]["params_per_s"] for r in rows
                          if r["system"] == system and r["status"] == "ok" and r["extra"].get("threads") == threads
                          and "cpu_isa" in r["extra"]}
                base = args.cpu_isa[0]
                if base in by_isa and len(by_isa) > 1:
                    print(f"{threads} threads, {system} params/s / {base}'s: " + ", ".join(
                        f"{isa} {rate / by_isa[base]:.2f}" for isa, rate in by_isa.items()))
    result = {"suite": "hybrid8", "date": dt.date.today().isoformat(),
              "command": shlex.join(["python", "-m", "benchmarks.bench_optim", *(sys.argv[1:] if argv is None else argv)]),
              "git_commit": git_commit(), "machine": machine(), "rows": rows}
    out = Path(args.out)
    if out.suffix != ".json":
        out = out / f"hybrid8-{dt.date.today():%Y%m%d}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


def _run_with_launch(system: str, args: argparse.Namespace, launch: tuple[int, int] | None) -> dict[str, Any]:
    """`run_row` with the Triton kernel's launch shape set to `launch` (rows, warps) for the row, then restored."""
    if launch is None:
        return run_row(system, args)
    from lazytrain_hf.optim._triton_kernel import LAUNCH

    with mock.patch.dict(LAUNCH, rows=launch[0], num_warps=launch[1]):
        row = run_row(system, args)
    row["extra"]["triton_launch"] = {"rows": launch[0], "num_warps": launch[1]}
    return row


def _run_with_isa(system: str, args: argparse.Namespace, launch: tuple[int, int] | None,
                  isa: str | None) -> dict[str, Any]:
    """`_run_with_launch` with the C++ kernel's ISA path forced to `isa` (``LAZYTRAIN_CPU_ISA``, read at each update)
    for the row, then restored; a path the build lacks gives an "unsupported" row."""
    if isa is None:
        return _run_with_launch(system, args, launch)
    from lazytrain_hf.optim._cpu_kernel import ISA_ENV, isa_paths, load_cpu_kernel

    lib = load_cpu_kernel()
    if lib is not None and isa not in isa_paths(lib):
        row: dict[str, Any] = dict.fromkeys(ROW_KEYS)
        row.update(system=system, model=f"synthetic-{args.tensors}x", params=args.params, status="unsupported",
                   reason=f"the C++ kernel built on this CPU has no {isa} path (it has {', '.join(isa_paths(lib))})",
                   extra={"cpu_isa": isa, "threads": torch.get_num_threads()})
        return row
    with mock.patch.dict(os.environ, {ISA_ENV: isa}):
        row = _run_with_launch(system, args, launch)
    row["extra"]["cpu_isa"] = isa
    return row


def _isas(text: str) -> list[str]:
    from lazytrain_hf.optim._cpu_kernel import ISA_CODES

    names = [x.strip().lower() for x in text.split(",")]
    if not names or any(x not in ISA_CODES for x in names):
        raise argparse.ArgumentTypeError(f"expected ISA paths from {list(ISA_CODES)} such as avx512,avx2, but got "
                                         f"{text!r}")
    return names


def _launches(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        try:
            r, w = (int(x) for x in part.split(":"))
        except ValueError:
            r = w = 0
        if r < 1 or r & (r - 1) or w not in (1, 2, 4, 8, 16):
            raise argparse.ArgumentTypeError(f"expected ROWS:WARPS pairs (ROWS a power of two, WARPS 1-16 a power "
                                             f"of two) such as 4:4,8:8, but got {part!r}")
        out.append((r, w))
    return out


def _thread_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]  # an empty entry (1,,2) is a typo, not a skip
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected thread counts >= 1 such as 16 or 1,8,16, but got {text!r}")
    return counts


def _label(row: dict[str, Any]) -> str:
    return row["system"] + (f" [{row['extra']['cpu_isa']}]" if "cpu_isa" in row["extra"] else "")


def _print_row(row: dict[str, Any]) -> None:
    ex = row["extra"]
    thr = str(ex.get("threads", "gpu"))
    if "triton_launch" in ex:
        thr = f"{ex['triton_launch']['rows']}:{ex['triton_launch']['num_warps']}"
    name = _label(row)
    if row["status"] != "ok":
        print(f"{name:28s} {thr:>3s} {row['status']}: {row['reason']}")
        return
    print(f"{name:28s} {thr:>3s} {ex['param_dtype']:5s} {row['optimizer_ms']:9.1f} "
          f"{ex['params_per_s'] / 1e6:11.1f} {ex['state_bytes_per_param']:8.2f} {ex['moment_bytes_per_param']:8.2f}",
          flush=True)


if __name__ == "__main__":
    main()
