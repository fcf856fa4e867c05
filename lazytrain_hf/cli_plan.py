"""`lazytrain-hf plan`: plan a step for a model and budgets without a GPU (analytic costs on the meta device).

Example::

    lazytrain-hf plan --model qwen2.5-7b --gpu-memory 24GiB --host-memory 100GiB --batch-size 16 --seq-len 1024 \\
        --out-dir plans/

prints the per-layer plan (boundary tier, backward: kept / re-forward / rebuilt, optimizer placement), the predicted step time,
tokens/s, peak GPU and host memory, exposed transfer time, the solver's status / gap / time and the largest
feasible batch, and writes the schedule JSON, the cost model JSON and a timeline PNG to --out-dir.

Hardware rates: the H200 figures (`profiling.H200_DEFAULTS`), or this machine's cached probe
(`lazytrain_hf.profiling.probe`) when one exists, or a probe JSON given with --hardware.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

from .config import LazyTrainConfig

__all__ = ["add_arguments", "run", "output_stem"]

_GIB = 1024**3
_FIXED_DEFAULTS: dict[str, Any] = {"checkpoint_every": 4, "tier": "gpu", "prefetch_depth": 1}
# the Trainer's defaults (lazytrain_config; master_weights "auto" plans as kahan for bf16 weights): no CLI flags for these
_OPTIMIZER_LAYOUT: dict[str, Any] = {
    "loss_chunk_tokens": LazyTrainConfig.loss_chunk_tokens, "state_dtype": LazyTrainConfig.state_dtype,
    "master_weights": "kahan", "block_size": LazyTrainConfig.block_size}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `plan` subcommand's options to `parser`."""
    parser.add_argument("--model", required=True,
                        help="registry name (e.g. qwen2.5-7b, qwen3.6-27b), Hub id or local path")
    parser.add_argument("--gpu-memory", default=None,
                        help="GPU memory the plan may use, e.g. 24GiB (default: the hardware profile's GPU)")
    parser.add_argument("--gpu-memory-margin", type=float, default=LazyTrainConfig.gpu_memory_margin,
                        help="fraction of the GPU memory kept free for fragmentation and unmodelled workspaces "
                             "(default %(default)s, as lazytrain_config.gpu_memory_margin)")
    parser.add_argument("--host-memory", default=None,
                        help="host memory the plan may use, e.g. 100GiB (default: 90%% of the profile's RAM)")
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch size B (default 16)")
    parser.add_argument("--seq-len", type=int, default=1024, help="sequence length T (default 1024)")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1,
                        help="micro-batches per optimizer step, as TrainingArguments (default 1: the plan may keep "
                             "the GPU-updated layers' gradients on the GPU until their update, as "
                             "lazytrain_config.keep_gpu_grads; above 1 they go to the host, where they are summed). "
                             "The predicted step is one micro-batch's")
    parser.add_argument("--nvme-dir", default=None, help="directory for the NVMe activation tier (enables it)")
    parser.add_argument("--nvme-budget", default=None,
                        help="bytes the NVMe tier may write, e.g. 200GiB (default: 90%% of the free space)")
    parser.add_argument("--policy", choices=("milp", "fixed"), default="milp", help="planner (default milp)")
    # default None: given under --policy milp (which chooses these itself) they get a note
    parser.add_argument("--checkpoint-every", type=int, default=None,
                        help=f"fixed policy: checkpoint every k layers (default {_FIXED_DEFAULTS['checkpoint_every']})")
    parser.add_argument("--tier", choices=("gpu", "cpu", "nvme"), default=None,
                        help=f"fixed policy: boundary tier (default {_FIXED_DEFAULTS['tier']})")
    parser.add_argument("--prefetch-depth", type=int, default=None,
                        help=f"fixed policy: weight prefetch depth (default {_FIXED_DEFAULTS['prefetch_depth']}; "
                             f"the MILP tries 1-3)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="MILP time limit in seconds (default 10)")
    parser.add_argument("--mip-gap", type=float, default=0.01, help="MILP relative gap (default 0.01)")
    parser.add_argument("--gpu-optimizer", action=argparse.BooleanOptionalAction, default=True,
                        help="let the plan move layers' optimizer updates to the GPU (the executor runs them at "
                             "the layer's next load; lazytrain_config.gpu_layer_updates, default on)")
    parser.add_argument("--rows-per-pass", type=int, default=None,
                        help="the executor's max_rows_per_pass (layers run over the batch in chunks of this many rows)")
    parser.add_argument("--resident", choices=("auto", "gpu", "host_embedding", "host", "host_sliced"),
                        default="auto",
                        help="where the embedding and LM head live (lazytrain_config.resident_placement): on the "
                             "GPU, the embedding in host memory, both in host memory, or both with the head streamed "
                             "in vocabulary slices; auto (default): --policy milp plans gpu, host_embedding and host "
                             "and keeps the fastest that fits, host_sliced only when none fits; --policy fixed keeps "
                             "them on the GPU when they take at most half the GPU memory")
    parser.add_argument("--hardware", default=None,
                        help="hardware profile JSON (from lazytrain_hf.profiling.probe), or 'defaults' for the "
                             "H200 figures; default: this machine's cached probe if any, else the H200 figures")
    parser.add_argument("--max-batch", type=int, default=1024,
                        help="upper end of the largest-feasible-batch search (0 skips it)")
    parser.add_argument("--master-weights", choices=("fp32", "kahan", "stochastic", "none"), default="kahan",
                        help="the optimizer's master weights (lazytrain_config.master_weights; 'auto' plans as kahan "
                             "for bf16 weights): fp32 4 bytes per trained parameter in host memory, kahan 2, "
                             "stochastic and none 0 (default kahan)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=LazyTrainConfig.loss_chunk_tokens,
                        help="tokens per chunk of the LM head's loss (lazytrain_config.loss_chunk_tokens; default "
                             f"{LazyTrainConfig.loss_chunk_tokens}): the head's logits workspace, and an input of "
                             "the plan's fingerprint")
    lora = parser.add_argument_group("LoRA / QLoRA (as a recipe's peft: section; needs peft)")
    lora.add_argument("--lora-r", type=int, default=None,
                      help="plan a LoRA run of this rank (peft.r): the base is frozen (streamed read-only, 2 bytes "
                           "per parameter in host memory, no gradients or optimizer states), the adapters stay on "
                           "the GPU")
    lora.add_argument("--lora-target-modules", default=None,
                      help="peft.target_modules: comma-separated module names (q_proj,v_proj) or all-linear "
                           "(default: PEFT's default for the architecture)")
    lora.add_argument("--load-in-4bit", action="store_true",
                      help="QLoRA: the base loaded with BitsAndBytesConfig(load_in_4bit=True): the decoder layers' "
                           "linear weights 4-bit (about 0.5 byte per parameter plus the quantization state)")
    lora.add_argument("--bnb-4bit-use-double-quant", action="store_true",
                      help="with --load-in-4bit: BitsAndBytesConfig(bnb_4bit_use_double_quant=True)")
    parser.add_argument("--out-dir", default=None,
                        help="write schedule JSON, cost model JSON and timeline PNG here, named after the model, "
                             "batch, sequence length, policy and every non-default option (the paths are printed)")


def run(args: argparse.Namespace) -> int:
    """Run `plan`; returns the exit status (0 planned, 1 no schedule fits, 2 invalid arguments)."""
    ignored = _fixed_knobs(args)
    sizes, problems = _parse_sizes(args)
    problems = _check_numbers(args) + problems + _check_paths(args)
    if not problems:  # registry name / local directory / Hub id, without transformers and without Hub retries
        from .sources import locate_model

        try:
            locate_model(args.model)
        except ValueError as e:
            problems.append(f"--model: {e}")
    if problems:
        print("lazytrain-hf plan: invalid arguments:\n  - " + "\n  - ".join(problems), file=sys.stderr)
        return 2
    if ignored:
        print(f"note: --policy milp ignores {', '.join(ignored)} (they shape --policy fixed only; the MILP chooses "
              "them itself)")
    try:
        hardware = _hardware(args.hardware)
    except (OSError, ValueError) as e:
        print(f"lazytrain-hf plan: --hardware {args.hardware!r}: {e}", file=sys.stderr)
        return 2
    gpu_given, host_given = sizes["gpu_memory"], sizes["host_memory"]  # None: not given (0 was refused)
    for flag, given, total, what in (("--gpu-memory", gpu_given, hardware.gpu_memory_bytes, "GPU"),
                                     ("--host-memory", host_given, hardware.host_memory_bytes, "host RAM")):
        if given is not None and total and given > total:  # a what-if plan is allowed, but say it cannot run here
            print(f"note: {flag} {given / 2**30:.2f} GiB is more than the hardware profile's {what} "
                  f"({total / 2**30:.2f} GiB): the plan cannot run on that machine as planned")
    free_disk = _free_bytes(args.nvme_dir) if args.nvme_dir and sizes["nvme_budget"] is None else 0

    from .models import check_supported, resolve_config
    from .planning.fixed import fixed_resident
    from .planning.milp import InfeasiblePlanError, with_margin
    from .planning.planner import largest_feasible_batch, make_schedule, rows_options, search_plans, split_placements
    from .planning.request import resolve_request
    from .planning.schedule import RESIDENT_PLACEMENTS, input_hashes
    from .profiling.analytic import analytic_cost_model, model_shape, resident_placements

    try:
        config = resolve_config(args.model)
        check_supported(config)
    except (OSError, ValueError) as e:
        print(f"lazytrain-hf plan: --model {args.model!r}: {e}", file=sys.stderr)
        return 2
    shape = model_shape(config, args.model)
    try:
        frozen = _lora_costs(args, config)
    except (ImportError, ValueError) as e:
        print(f"lazytrain-hf plan: {e}", file=sys.stderr)
        return 2
    # budgets and defaults as the Trainer resolves them, with the hardware profile standing in for the device
    request = resolve_request(
        config.to_dict(), shape, batch_size=args.batch_size, seq_len=args.seq_len, hardware=hardware,
        gpu_memory_budget=gpu_given, host_memory_budget=host_given, nvme_budget=sizes["nvme_budget"],
        nvme=bool(args.nvme_dir), gpu_memory_margin=args.gpu_memory_margin, gpu_available=hardware.gpu_memory_bytes,
        host_total=hardware.host_memory_bytes, nvme_available=free_disk, policy=args.policy,
        fixed={k: getattr(args, k) for k in _FIXED_DEFAULTS}, rows_per_pass=args.rows_per_pass,
        resident=args.resident, gpu_optimizer=args.gpu_optimizer and args.master_weights != "stochastic",
        gradient_accumulation_steps=args.gradient_accumulation_steps, time_limit_s=args.time_limit,
        mip_rel_gap=args.mip_gap, name=args.model, frozen=_frozen_layout(frozen),
        **{**_OPTIMIZER_LAYOUT, "master_weights": args.master_weights, "loss_chunk_tokens": args.loss_chunk_tokens})

    def build(batch: int, resident: str, rows: int | None = args.rows_per_pass, seq: int = args.seq_len,
              **changes: Any) -> Any:
        return analytic_cost_model(shape, batch, seq, hardware, **{**request.cost_model_kwargs(rows, resident),
                                                                   **frozen, **changes})

    allowed = resident_placements(shape)
    if args.resident not in ("auto", *allowed):
        print(f"lazytrain-hf plan: --resident {args.resident}: this model ties its LM head to the embedding; use one "
              f"of {', '.join(allowed)}", file=sys.stderr)
        return 2
    if args.resident != "auto":
        candidates = [args.resident]
    elif args.policy == "fixed":
        candidates = [fixed_resident(build(args.batch_size, "gpu").resident_bytes, request.budgets.gpu_total, allowed)]
    else:
        candidates = list(allowed)
    cm = build(args.batch_size, candidates[0])
    inputs = request.inputs()
    fp = request.fingerprint()
    _print_header(args, shape, cm, hardware, frozen)
    tried: list[tuple[int, str, float | None]] = []  # (rows per pass, placement, predicted ms or None: no plan)
    built: dict[tuple[int, str], Any] = {}

    def solve(rows: int, resident: str) -> Any:
        c = built[rows, resident] = build(args.batch_size, resident, rows)
        try:
            s = make_schedule(c, args.policy, **request.fixed, time_limit_s=request.time_limit_s,
                              mip_rel_gap=request.mip_rel_gap, gpu_optimizer=request.gpu_optimizer, fingerprint=fp,
                              strict=True)
        except InfeasiblePlanError:
            tried.append((rows, resident, None))
            raise
        tried.append((rows, resident, s.predicted["step_ms"]))
        return s

    def one_row() -> int:  # the leanest rows per pass this run may take
        return args.rows_per_pass or 1

    # the largest rows per pass with a plan (unless --rows-per-pass), the fastest placement there; the fixed
    # policy takes rows per pass by the same rule in the Trainer (hf/plan.py fixed_plan_for_trainer)
    rows = rows_options(args.batch_size, args.rows_per_pass)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            sched = search_plans(solve, rows, *split_placements(candidates))
        except InfeasiblePlanError as e:
            e = with_margin(e, args.gpu_memory_margin)
            # leaner placements than the leanest tried (an explicit one, or the fixed rule's): less GPU memory
            order = RESIDENT_PLACEMENTS
            others = [p for p in allowed if p not in candidates and order.index(p) > order.index(candidates[-1])]
            batch = 0
            if args.batch_size > 1:  # the largest batch with a plan at these budgets, in the leanest setting tried
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    batch = largest_feasible_batch(lambda b: build(b, candidates[-1], one_row()), args.policy,
                                                   max_batch=args.batch_size - 1, **request.fixed)
            lean = lambda **kw: build(kw.pop("batch", args.batch_size), candidates[-1], one_row(), **kw)  # noqa: E731
            host = host_fixes(args, e, lean, batch)
            print(f"\nNo plan ({_tried_summary(tried)}): {e.facts} Fix: "
                  f"{cli_fix(args, e, batch, others, host, request.budgets.gpu_total)}.")
            return 1
    cm = built[sched.rows_per_pass, sched.resident]
    sched.solver["fingerprint_inputs"] = input_hashes(inputs)
    for w in caught:
        print(f"warning: {w.message}")
    _print_table(sched, cm)
    _print_resident(sched, cm, tried, candidates)
    _print_prediction(sched, cm)
    if args.max_batch > 0:
        # feasibility: the placement that needs the least GPU memory among those this run may take
        lean = candidates[-1] if args.policy == "milp" else sched.resident
        one = one_row()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            best = largest_feasible_batch(lambda b: build(b, lean, one), args.policy, max_batch=args.max_batch,
                                          checkpoint_every=args.checkpoint_every, tier=args.tier,
                                          prefetch_depth=args.prefetch_depth)
        cap = " (the search cap)" if best == args.max_batch else ""
        print(f"largest feasible batch ({args.policy}, seq {args.seq_len}): {best}{cap}")
    if args.out_dir:
        _write(args, sched, cm)
    else:
        print("(no files written: --out-dir DIR writes the schedule JSON, cost model JSON and timeline PNG)")
    return 0


def cli_fix(args: argparse.Namespace, e: Any, batch: int = 0, leaner: list[str] | tuple[str, ...] = (),
            host: list[str] | tuple[str, ...] = (), gpu_total: int | None = None) -> str:
    """The fix for the planning error `e` (`InfeasiblePlanError`) in `plan`'s flags, from its numbers.

    When the host budget is below what the host takes regardless of the plan (`e.host_too_small`) the fixes are
    host-side: the --host-memory that fits (with a --gpu-memory only when that is above `gpu_total`, the GPU budget
    planned with, before the margin) and the `host` fixes (`host_fixes`: each one checked to lower the host bytes).
    Otherwise: the GPU budget to pass, a batch of at most `batch` (the largest with a plan at the given budgets; 0:
    none or not searched) with the gradient accumulation that keeps the rows per optimizer step, fewer rows per pass,
    a `leaner` embedding / LM head placement, the `host` fixes, a shorter sequence."""
    fixes = []
    need = e.needed_gpu_bytes
    gpu = f"--gpu-memory {_flag_size(need)}" if need is not None else ""
    if e.host_too_small and e.min_host_bytes:
        above = need is not None and (gpu_total is None or need > gpu_total)
        fixes.append(f"--host-memory {_flag_size(e.min_host_bytes)}" + (f" {gpu}" if above else ""))
        return "pass " + ", or ".join(fixes + list(host))
    if gpu:
        fixes.append(gpu)
    if batch:
        from .planning.request import same_tokens_batch

        b, ga = same_tokens_batch(args.batch_size, args.gradient_accumulation_steps, batch)
        fixes.append(f"--batch-size {b} --gradient-accumulation-steps {ga} (the same rows per optimizer step; "
                     f"batches up to {batch} have a plan at these budgets)")
    if args.rows_per_pass and args.rows_per_pass > 1:
        fixes.append(f"--rows-per-pass 1 (now {args.rows_per_pass})")
    if leaner:
        fixes.append(f"--resident {leaner[-1]} (or auto: the embedding and LM head in host memory need less GPU "
                     "memory)")
    fixes += list(host)
    fixes.append(f"a shorter --seq-len (now {args.seq_len})")
    return "pass " + ", or ".join(fixes)


def host_fixes(args: argparse.Namespace, e: Any, build: Any, batch: int = 0) -> list[str]:
    """The host-side fixes for the planning error `e`, each checked on the cost models `build(**changes)` makes
    (`analytic_cost_model` of the leanest setting tried, with `batch`, `seq` or `master_weights` changed):

    * host budget below the host's fixed part (`e.host_too_small`): from fp32 masters --master-weights kahan (with
      the --host-memory it needs when it does not fit the budget either), and a smaller --batch-size (`batch`: the largest
      with a plan) or --seq-len only when it lowers the host's fixed part enough to fit (a host-placed embedding's
      staging buffer follows the tokens; weights, gradients and states do not);
    * a GPU budget that fits with more host memory for CPU-tier boundaries (`e.min_gpu_bytes_any_host`): the
      --host-memory that holds them, and the NVMe tier (--nvme-dir) when it has none.
    """
    fixes: list[str] = []
    budget = e.host_budget_bytes
    if budget is None:
        return fixes
    if e.host_too_small:
        here = build().host_fixed_bytes
        # from fp32 masters the leaner mode named is kahan; "none" never is: updates far below bf16's resolution
        # vanish (benchmarks/results/quality-cpu-20261203.json)
        lean = build(master_weights="kahan").host_fixed_bytes if args.master_weights == "fp32" else None
        # (one that needs a --host-memory as large as the plain fix's, as printed, is no fix)
        if lean is not None and lean < here and (lean <= budget or
                                                 _flag_size(lean) != _flag_size(e.min_host_bytes or here)):
            fits = "fits the host budget" if lean <= budget else f"with --host-memory {_flag_size(lean)}"
            fixes.append(f"--master-weights kahan (a compensated bf16 copy, 2 bytes per parameter: host fixed part "
                         f"{lean / _GIB:.2f} GiB, {fits})")
        if batch and build(batch=batch).host_fixed_bytes <= budget:
            from .planning.request import same_tokens_batch

            b, ga = same_tokens_batch(args.batch_size, args.gradient_accumulation_steps, batch)
            fixes.append(f"--batch-size {b} --gradient-accumulation-steps {ga} (the same rows per optimizer step)")
        seq = _largest(lambda t: build(seq=t).host_fixed_bytes <= budget, args.seq_len - 1)
        if seq:
            fixes.append(f"--seq-len {seq} (now {args.seq_len}: the host-placed embedding's staging buffer follows it)")
        return fixes
    any_host, gpu_budget = e.min_gpu_bytes_any_host, e.gpu_budget_bytes
    if any_host is not None and gpu_budget is not None and any_host <= gpu_budget:
        from .planning.infeasible import min_gpu_bytes

        cm = build()
        room = sum(cm.act_bytes) + 4 * max(cm.act_bytes)  # every boundary, as infeasible_error's unlimited host
        fits = lambda c: (min_gpu_bytes(c, time_limit_s=args.time_limit) or gpu_budget + 1) <= gpu_budget  # noqa: E731
        if fits(cm.with_budgets(pinned_host_bytes=cm.host_fixed_bytes + room)):
            fixes.append(f"--host-memory {_flag_size(cm.host_fixed_bytes + room)} (room for CPU-tier boundaries: "
                         "then this GPU budget fits)")
        if not args.nvme_dir and fits(cm.with_budgets(nvme_bytes=room)):
            fixes.append(f"--nvme-dir DIR with {_flag_size(room)} free (boundaries on NVMe instead of host memory)")
    return fixes


def _largest(ok: Any, hi: int) -> int:
    """The largest n in [1, hi] with ok(n), for ok monotone (true up to some n); 0 when ok(1) is false."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _lora_costs(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """`analytic_cost_model`'s frozen-part arguments of the LoRA run `args` describe (`--lora-r`; {} without it).

    Raises:
        ImportError: peft is not installed (the message names the install).
        ValueError: PEFT refuses the LoraConfig (named with the flag).
    """
    if args.lora_r is None:
        return {}
    try:
        import peft  # noqa: F401

        from .hf.peft_support import planned_lora_costs
    except ImportError as e:
        raise ImportError(f"--lora-r needs peft ({e}): pip install peft") from None
    targets = args.lora_target_modules
    if targets is not None and targets != "all-linear" and "," in targets:
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    try:
        return planned_lora_costs(config, args.lora_r, targets, args.load_in_4bit, args.bnb_4bit_use_double_quant)
    except ValueError as e:
        given = f"--lora-target-modules {args.lora_target_modules}" if args.lora_target_modules else \
            "PEFT's default target modules (no --lora-target-modules)"
        raise ValueError(f"--lora-r {args.lora_r} with {given}: PEFT cannot wrap {args.model!r} so: {e}. Fix: pass "
                         "--lora-target-modules (e.g. all-linear, or q_proj,v_proj)") from None


def _frozen_layout(frozen: dict[str, Any]) -> dict[str, Any] | None:
    """The plan input of the frozen layout (as the Trainer's `peft_support.frozen_layout`), None without LoRA."""
    if not frozen:
        return None
    from .hf.peft_support import layout_of

    return layout_of(frozen)


def _flag_size(nbytes: float) -> str:
    """Bytes as a size flag value, rounded up to 0.01 GiB (the value printed is itself enough)."""
    return f"{math.ceil(nbytes / _GIB * 100) / 100:.2f}GiB"


def _fixed_knobs(args: argparse.Namespace) -> list[str]:
    """Fill in the fixed-policy knobs' defaults; returns those given with --policy milp (unused there)."""
    given = [k for k in _FIXED_DEFAULTS if getattr(args, k) is not None]
    for k, default in _FIXED_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, default)
    return [f"--{k.replace('_', '-')}" for k in given] if args.policy == "milp" else []


def _parse_sizes(args: argparse.Namespace) -> tuple[dict[str, int | None], list[str]]:
    """Byte sizes of --gpu-memory, --host-memory, --nvme-budget (None when not given), and their problems."""
    from .config import parse_bytes

    sizes: dict[str, int | None] = {}
    problems = []
    for key in ("gpu_memory", "host_memory", "nvme_budget"):
        flag, value = f"--{key.replace('_', '-')}", getattr(args, key)
        if value is not None and re.fullmatch(r"\s*[0-9.]+\s*", str(value)):  # "24": bytes, surely not meant
            problems.append(f"{flag} {value}: give a unit, e.g. {value.strip()}GiB")
            continue
        try:
            sizes[key] = parse_bytes(value)
        except ValueError as e:
            problems.append(f"{flag}: {e}")
            continue
        if value is not None and not sizes[key]:
            problems.append(f"{flag} must be > 0, but got {value}")
    if args.nvme_budget is not None and not args.nvme_dir:
        problems.append("--nvme-budget needs --nvme-dir (the directory the NVMe tier writes to)")
    return sizes, problems


def _check_numbers(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.batch_size < 1:
        problems.append(f"--batch-size must be >= 1, but got {args.batch_size}")
    if args.seq_len < 1:
        problems.append(f"--seq-len must be >= 1, but got {args.seq_len}")
    if args.gradient_accumulation_steps < 1:
        problems.append(f"--gradient-accumulation-steps must be >= 1, but got {args.gradient_accumulation_steps}")
    if not 1 <= args.prefetch_depth <= 3:
        problems.append(f"--prefetch-depth must be in [1, 3], but got {args.prefetch_depth}")
    if args.checkpoint_every < 1:
        problems.append(f"--checkpoint-every must be >= 1, but got {args.checkpoint_every}")
    if args.rows_per_pass is not None and args.rows_per_pass < 1:
        problems.append(f"--rows-per-pass must be >= 1, but got {args.rows_per_pass}")
    if args.loss_chunk_tokens < 1:
        problems.append(f"--loss-chunk-tokens must be >= 1, but got {args.loss_chunk_tokens}")
    if args.tier == "nvme" and args.policy == "fixed" and not args.nvme_dir:
        problems.append("--tier nvme needs --nvme-dir")
    if not 0 <= args.gpu_memory_margin < 0.9:
        problems.append(f"--gpu-memory-margin must be in [0, 0.9), got {args.gpu_memory_margin}")
    if not args.time_limit > 0:  # also NaN
        problems.append(f"--time-limit must be > 0 seconds, but got {args.time_limit}")
    if not 0 <= args.mip_gap < 1:
        problems.append(f"--mip-gap must be in [0, 1) (0.01 = within 1%), but got {args.mip_gap}")
    if args.max_batch < 0:
        problems.append(f"--max-batch must be >= 0 (0 skips the search), but got {args.max_batch}")
    if args.lora_r is not None and args.lora_r < 1:
        problems.append(f"--lora-r must be >= 1, but got {args.lora_r}")
    if args.lora_r is None:
        given = [f for f, v in (("--lora-target-modules", args.lora_target_modules),
                                ("--load-in-4bit", args.load_in_4bit)) if v]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            problems.append(f"{' and '.join(given)} {verb} to a LoRA plan only: add --lora-r N (a 4-bit base trains "
                            "adapters only)")
    if args.bnb_4bit_use_double_quant and not args.load_in_4bit:
        problems.append("--bnb-4bit-use-double-quant needs --load-in-4bit")
    return problems


def _check_paths(args: argparse.Namespace) -> list[str]:
    """--nvme-dir and --out-dir must be directories or creatable (created here: before the solve, not after)."""
    problems = []
    for flag, path in (("--nvme-dir", args.nvme_dir), ("--out-dir", args.out_dir)):
        if not path:
            continue
        if Path(path).exists() and not Path(path).is_dir():
            problems.append(f"{flag} {path}: exists and is not a directory")
            continue
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            problems.append(f"{flag} {path}: cannot create the directory ({e.strerror or e})")
    return problems


def _hardware(spec: str | None) -> Any:
    from .profiling.hardware import H200_DEFAULTS, HardwareProfile, cache_dir, machine_fingerprint

    if spec == "defaults":
        return H200_DEFAULTS
    if spec:
        return HardwareProfile.from_dict(json.loads(Path(spec).read_text()))
    try:
        import torch

        if torch.cuda.is_available():
            path = cache_dir() / f"hardware-{machine_fingerprint('cuda')}.json"
            if path.is_file():
                return HardwareProfile.from_dict(json.loads(path.read_text()))
    except Exception:  # noqa: BLE001 - a broken CUDA setup must not stop planning
        pass
    return H200_DEFAULTS


def _free_bytes(directory: str) -> int:
    import shutil

    Path(directory).mkdir(parents=True, exist_ok=True)
    return int(0.9 * shutil.disk_usage(directory).free)


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / _GIB:.2f} GiB"


def _count(n: int) -> str:
    """7.62 B, 3.41 M, 12.0 K: a tiny test model is not "0.00 B"."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _print_header(args: argparse.Namespace, shape: Any, cm: Any, hardware: Any,
                  frozen: dict[str, Any] | None = None) -> None:
    print(f"model {args.model} ({shape.model_type}): {_count(shape.num_params)} params, {cm.num_layers} decoder "
          f"layers ({', '.join(f'{shape.layer_kinds.count(k)} {k}' for k in sorted(set(shape.layer_kinds)))})")
    if frozen:
        base = "4-bit" + (" (double quantization)" if args.bnb_4bit_use_double_quant else "") if args.load_in_4bit \
            else "bf16"
        print(f"LoRA r {args.lora_r} on {args.lora_target_modules or 'PEFT default modules'}: "
              f"{_count(int(frozen['adapter_params']))} adapter params on the GPU; the {base} base frozen "
              f"({sum(frozen['frozen'])} of {cm.num_layers} layers streamed read-only: weights only in host memory, "
              "no gradients or optimizer states)"
              + ("; embedding, norms and LM head in fp32 as peft.prepare_model_for_kbit_training leaves them"
                 if args.load_in_4bit else ""))
    margin = args.gpu_memory_margin
    kept = f" ({margin:.0%} of the GPU budget kept free: --gpu-memory-margin)" if margin else ""
    print(f"batch {args.batch_size} x seq {args.seq_len} = {cm.tokens_per_step} tokens/step; budgets: GPU "
          f"{_gib(cm.gpu_bytes)}{kept}, host {_gib(cm.pinned_host_bytes)} (fixed part {_gib(cm.host_fixed_bytes)} "
          f"with resident placement {cm.meta.get('resident', 'gpu')}), "
          f"NVMe {_gib(cm.nvme_bytes)}")
    print(f"hardware: {hardware.source}{'' if hardware.measured else ' (not measured here)'}; H2D "
          f"{hardware.h2d_gbps:.1f} / D2H {hardware.d2h_gbps:.1f} / both {hardware.bidir_gbps:.1f} GB/s, "
          f"{hardware.gpu_tflops:.0f} TFLOPS bf16, CPU optimizer {hardware.cpu_optim_params_per_s / 1e9:.2f} G params/s")
    def span(xs: list[float]) -> str:
        lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
        return lo if lo == hi else f"{lo}-{hi}"

    print(f"per layer (analytic): fwd {span(cm.fwd_ms)} ms, bwd {span(cm.bwd_ms)} ms, weights "
          f"{_gib(max(cm.param_bytes))}, boundary {_gib(max(cm.act_bytes))}, saved activations "
          f"{_gib(max(cm.saved_bytes))}")


def _print_table(sched: Any, cm: Any) -> None:
    from .planning.estimate import recompute_flags

    x = recompute_flags(sched)
    # backward: "kept" = activations retained from the forward (no second forward); "re-forward" = rerun once from
    # its own stored boundary input; "rebuilt" = no boundary of its own: rerun from an earlier boundary first
    print(f"\n{'layer':>5}  {'kind':<16} {'boundary':<8} {'backward':<10} {'optimizer':<9}")
    for i, lp in enumerate(sched.layers):
        tier = lp.tier if lp.checkpoint else "-"
        how = "kept" if lp.retain else ("rebuilt" if i and x[i - 1] else "re-forward")  # x[i-1]: input rebuilt
        opt = "-" if not cm.num_params[i] else lp.optimizer_device  # a frozen layer has no update
        print(f"{i:>5}  {cm.layer_kind[i]:<16} {tier:<8} {how:<10} {opt:<9}")
    print("(boundary: where the layer's input is stored for backward; backward: kept = activations retained, "
          "re-forward = forward rerun from its boundary, rebuilt = rerun from an earlier boundary; optimizer: "
          "where the layer's update runs, gpu = at its next load in the forward, cpu = host worker threads)")


def _tried_summary(tried: list[tuple[int, str, float | None]]) -> str:
    """The combinations planned, one entry per placement: "gpu: 8, 4 rows per pass no plan; host: 8 rows 123.4 ms"."""
    out = []
    for placement in dict.fromkeys(p for _, p, _ in tried):
        mine = [(r, ms) for r, p, ms in tried if p == placement]
        failed = [str(r) for r, ms in mine if ms is None]
        parts = [f"{', '.join(failed)} rows per pass: no plan"] if failed else []
        parts += [f"{r} rows per pass: {ms:.1f} ms" for r, ms in mine if ms is not None]
        out.append(f"{placement}: {'; '.join(parts)}")
    return "; ".join(out)


def _print_resident(sched: Any, cm: Any, tried: list[tuple[int, str, float | None]], candidates: list[str]) -> None:
    where = {"gpu": "embedding and LM head on the GPU (weights, gradients, optimizer states)",
             "host_embedding": "embedding in host memory (looked up and updated on the CPU); LM head on the GPU",
             "host": "embedding and LM head in host memory (updated on the CPU; the head's weights copied to the "
                     "GPU once per step)",
             "host_sliced": "embedding and LM head in host memory (updated on the CPU; the head's weights streamed "
                            "to the GPU in vocabulary slices, its gradient back slice by slice)"}[sched.resident]
    frozen = [n for n, f in (("embedding", cm.meta.get("frozen_embed")), ("LM head", cm.meta.get("frozen_head")))
              if f]
    if frozen:  # LoRA's base: weights only, nothing updated
        for text, by in ((" (weights, gradients, optimizer states)", ""), (" and updated on the CPU", " on the CPU"),
                         ("updated on the CPU; ", "")):
            where = where.replace(text, by)
        where += f"; {' and '.join(frozen)} frozen (weights only, no gradient or update)"
    print(f"\nresident parts: {where}: {_gib(cm.resident_bytes)} on the GPU, the head's workspace "
          f"{_gib(cm.head_work_bytes)} while it runs")
    rows = "all" if sched.rows_per_pass in (None, cm.meta.get("batch_size")) else sched.rows_per_pass
    print(f"rows per pass: {rows}")
    if len(tried) > 1:
        print(f"placements planned: {_tried_summary(tried)}")
    from .planning.planner import FALLBACK_PLACEMENTS

    skipped = [p for p in candidates if p in FALLBACK_PLACEMENTS and p not in {t[1] for t in tried}]
    for p in skipped:
        print(f"placement {p} not planned: auto tries it only when no other placement fits (not yet measured on a "
              f"GPU); --resident {p} plans it")


def _print_prediction(sched: Any, cm: Any) -> None:
    p, s = sched.predicted, sched.solver
    # 6 FLOPs per trained parameter and token, 4 per frozen one (no weight gradient), as the Trainer logs tflops
    trained = cm.num_params_total()
    frozen = max(0, int(cm.meta.get("num_params", trained)) + int(cm.meta.get("adapter_params", 0)) - trained)
    flops = (6 * trained + 4 * frozen) * cm.tokens_per_step / (p["step_ms"] / 1e3) / 1e12
    kept = sum(lp.retain for lp in sched.layers)
    rebuilt = p.get("recomputed_layers", 0)
    on_gpu = sum(lp.optimizer_device == "gpu" for lp in sched.layers)
    if not on_gpu:
        grads = ""
    elif sched.keep_grads:
        grads = ", their gradients kept there"
    elif cm.keeps_grads:  # solve_milp planned with and without kept gradients and kept the faster plan that fits
        grads = ", their gradients sent to the host (keeping them on the GPU planned slower or did not fit)"
    else:
        grads = ", their gradients sent to the host (--gradient-accumulation-steps above 1)"
    print(f"\npolicy {sched.policy}, prefetch depth {sched.prefetch_depth}, {len(sched.segments())} segments; in "
          f"backward {kept} layers kept, {len(sched.layers) - kept - rebuilt} re-forwarded, {rebuilt} rebuilt; "
          f"{on_gpu} layers updated on the GPU{grads}")
    print(f"predicted step {p['step_ms']:.1f} ms (simulated {p.get('simulated_step_ms', float('nan')):.1f} ms), "
          f"{p['tokens_per_s']:.0f} tokens/s, {flops:.1f} TFLOPS "
          f"({'6ND' if not frozen else '6 FLOPs per trained parameter and token, 4 per frozen one'})")
    print(f"  compute {p['compute_ms']:.1f} ms + re-forward / rebuild {p['recompute_ms']:.1f} ms + GPU optimizer "
          f"{p['gpu_optim_ms']:.1f} ms + exposed transfer {p['exposed_transfer_ms']:.1f} ms + exposed CPU optimizer "
          f"{p['exposed_optimizer_ms']:.1f} ms")
    print(f"peak GPU {_gib(p['peak_gpu_bytes'])} (the planner's bound, checked against the budget; the timeline "
          f"simulation's {_gib(p.get('simulated_peak_gpu_bytes'))}) of "
          f"{_gib(cm.gpu_bytes)}; host {_gib(p['pinned_host_bytes'])} of {_gib(cm.pinned_host_bytes)}; NVMe "
          f"{_gib(p['nvme_bytes'])}")
    if "status" in s:  # the MILP's (a fixed plan's solver holds only its fingerprint inputs)
        gap = "-" if s.get("mip_gap") is None else f"{100 * s['mip_gap']:.2f}%"
        depths = ", ".join(f"{d['prefetch_depth']}={d['status']}" for d in s.get("depths", []))
        print(f"solver: {s['status']}, gap {gap}, {s['solve_ms']:.0f} ms (per prefetch depth: {depths})")


def output_stem(args: argparse.Namespace, policy: str) -> str:
    """The file name stem of a plan's outputs: the model, batch, sequence length and policy, then every option
    that changes the plan and differs from its default, so two variants (e.g. with and without --no-gpu-optimizer,
    or two GPU budgets) never write over each other's files."""
    parts = [args.model, f"b{args.batch_size}", f"s{args.seq_len}", policy]
    if args.gpu_memory is not None:
        parts.append(f"gpu{args.gpu_memory}")
    if args.host_memory is not None:
        parts.append(f"host{args.host_memory}")
    if args.gpu_memory_margin != LazyTrainConfig.gpu_memory_margin:
        parts.append(f"margin{args.gpu_memory_margin:g}")
    if policy == "fixed":
        parts.append(f"every{args.checkpoint_every}-{args.tier}-prefetch{args.prefetch_depth}")
    else:
        if args.time_limit != 10.0:
            parts.append(f"limit{args.time_limit:g}s")
        if args.mip_gap != 0.01:
            parts.append(f"gap{args.mip_gap:g}")
    if not args.gpu_optimizer:
        parts.append("cpu-optimizer")
    if args.gradient_accumulation_steps != 1:
        parts.append(f"ga{args.gradient_accumulation_steps}")
    if args.rows_per_pass is not None:
        parts.append(f"rows{args.rows_per_pass}")
    if args.master_weights != "kahan":
        parts.append(f"master-{args.master_weights}")
    if args.loss_chunk_tokens != LazyTrainConfig.loss_chunk_tokens:
        parts.append(f"losschunk{args.loss_chunk_tokens}")
    if args.lora_r is not None:
        parts.append(f"lora{args.lora_r}" + (f"-{args.lora_target_modules}" if args.lora_target_modules else "")
                     + ("-4bit" if args.load_in_4bit else "") + ("-dq" if args.bnb_4bit_use_double_quant else ""))
    nvme_named = policy == "fixed" and args.tier == "nvme"  # "every4-nvme-prefetch1" says it already
    if args.nvme_dir and (args.nvme_budget or not nvme_named):
        parts.append("nvme" + (args.nvme_budget or ""))
    if args.hardware:
        parts.append(f"hw-{Path(args.hardware).stem}")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(str(p).replace(" ", "") for p in parts))


def _write(args: argparse.Namespace, sched: Any, cm: Any) -> list[Path]:
    from .planning.simulator import simulate
    from .planning.timeline import plot_timeline

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = output_stem(args, sched.policy)
    paths = [out / f"{stem}.schedule.json", out / f"{stem}.cost_model.json", out / f"{stem}.timeline.png"]
    cm = cm.for_schedule(sched)  # the plan as it runs (without kept gradients where it does not keep them)
    sched.to_json(paths[0])
    paths[1].write_text(json.dumps(cm.to_dict(), indent=1))
    p = sched.predicted
    sim = simulate(cm, sched)
    # the memory curve is the simulator's; the planner's peak (what the budget is checked against) is an upper bound
    title = (f"{args.model} B={args.batch_size} T={args.seq_len} {sched.policy}: predicted {p['step_ms']:.0f} ms, "
             f"{p['tokens_per_s']:.0f} tok/s, peak GPU {sim.peak_gpu_bytes / _GIB:.1f} GiB simulated "
             f"({p['peak_gpu_bytes'] / _GIB:.1f} GiB planned bound)")
    plot_timeline(sim, paths[2], title=title, gpu_budget_bytes=cm.gpu_bytes)
    print("wrote:\n" + "\n".join(f"  {path}" for path in paths))
    return paths


if __name__ == "__main__":  # python -m lazytrain_hf.cli_plan --model qwen2.5-7b ...
    _parser = argparse.ArgumentParser(prog="lazytrain-hf plan", description=__doc__.split("\n")[0])
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
