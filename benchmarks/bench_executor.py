"""Executor benchmark on the GPU machine: LazyTrain (fixed / MILP schedule) vs the all-on-GPU stock path.

    python -m benchmarks.bench_executor --system lazytrain_fixed --model qwen2.5-7b --gpu-cap-gib 24 \
        --batch-sizes 8,16,32,64 --out benchmarks/results/executor-YYYYMMDD.json

Each invocation measures one system over several batch sizes (GSM8K token rows, seq 1024, real Qwen tokenizer),
1 warm-up step (2 on CUDA) then `--steps` timed steps per batch size, and appends rows (shared/RESULTS_FORMAT.md) to --out.
A step is forward + backward + global-norm clip + optimizer update, CUDA-synchronized at both ends.
`tflops_6nd` = 6 x params x tokens / step time (padding would count; these rows have none).
Out-of-memory is caught and reported as status "oom".

Data parallel: launched with `torchrun --nproc_per_node N` (one process per GPU, NCCL), each rank runs its own
executor on its own B rows per step (global batch N x B); rank 0 writes the rows, with `world_size` N,
`tokens_per_s` for all ranks together and `tflops_6nd` per GPU. `--dp-updates sharded`: each rank updates only its
share of the layers and broadcasts them (lazytrain_config.dp_updates; the rows' extra says which, and rank 0's
optimizer-state and gradient-D2H bytes).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from lazytrain_hf.streaming.executor import UPDATE_COUNTERS

from .common import GIB, append_results, fast_random_model, gsm8k_token_rows, percentiles, row


def _executed_flops(model: Any, ex: Any, tokens: int, seq_len: int) -> float:
    """FLOPs that ran: every layer's forward, its re-forward in backward (unless retained), backward (2x forward),
    recompute forwards, causal attention (2·T·H per token per layer forward), and the resident head 6·N·tokens."""
    L = ex.num_layers
    layer_params = sum(p.numel() for layer in ex.layers for p in layer.parameters()) / L
    resident = sum(p.numel() for p in ex.resident_parameters())
    H = model.config.hidden_size
    per_layer_fwd = 2 * layer_params * tokens + 2 * tokens * seq_len * H
    retained = sum(lp.retain for lp in ex.schedule.layers)
    fwd_passes = L + (L - retained) + ex.stats.recomputed_layers
    return per_layer_fwd * (fwd_passes + 2 * L) + 6 * resident * tokens


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def _reset_peak(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(args: argparse.Namespace) -> float | None:
    return torch.cuda.max_memory_allocated() / GIB if args.device == "cuda" else None


def _empty_cache(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.empty_cache()


def _peak_rss_gib() -> float | None:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
    except ImportError:
        return None


def run_lazytrain(args: argparse.Namespace, policy: str) -> list[dict[str, Any]]:
    from lazytrain_hf.config import LazyTrainConfig, cpu_threads
    from lazytrain_hf.optim import Hybrid8bitOptimizer
    from lazytrain_hf.planning.fixed import fixed_schedule
    from lazytrain_hf.streaming.executor import StreamingExecutor

    model = fast_random_model(args.model, torch.bfloat16)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    cfg = LazyTrainConfig(device=args.device, checkpoint_every=args.checkpoint_every, activation_tier=args.tier,
                          max_rows_per_pass=args.rows_per_pass, loss_chunk_tokens=args.loss_chunk_tokens,
                          gpu_memory_budget=f"{args.gpu_cap_gib}GiB" if args.gpu_cap_gib else None,
                          overlap_optimizer=not args.no_overlap, dp_updates=args.dp_updates)
    t0 = time.perf_counter()
    ex = StreamingExecutor(model, cfg, args.device, host_grad_dtype="param")
    setup_s = time.perf_counter() - t0
    # fp32 states for the 1.09 B embedding + lm_head params would hold 8.7 GB of the 24 GiB GPU budget: 8-bit
    # states there unless asked (quality knob, not a throughput one).
    emb = [model.get_input_embeddings().weight, model.get_output_embeddings().weight] if args.fp32_embedding_states \
        else []
    opt = Hybrid8bitOptimizer(list({id(p): p for p in model.parameters()}.values()), lr=1e-5, weight_decay=0.01,
                              master_weights=args.master_weights, fp32_state_params=emb)
    opt.set_grad_source(ex.grad_source)
    opt.set_state_allocator(ex.state_alloc)
    if not args.no_overlap:
        ex.attach_optimizer(opt)  # layer updates overlap the next forward; step time is steady-state
    world, rank = getattr(args, "world", 1), getattr(args, "rank", 0)
    # 2 warm-up steps: the first deferred update allocates and touches the optimizer states during step 2's
    # forward (a fresh GPU machine grows host memory at ~3 s per 8 GiB: 28-49 s seen in one step)
    warm = 2 if args.device == "cuda" else 1
    data = gsm8k_token_rows(args.seq_len, max(args.batch_sizes) * (args.steps + warm) * world)
    rows = []
    for B in args.batch_sizes:
        r = row(system=f"lazytrain_{policy}", model=args.model, params=n_params, gpu_cap_gib=args.gpu_cap_gib,
                batch_size=B, seq_len=args.seq_len, status="ok")
        r["extra"].update(world_size=world, optimizer_cpu_threads=cpu_threads(), cpu_kernel=_cpu_kernel_facts(),
                          dp_updates=ex.config.resolved_dp_updates() if ex.dp is not None else None)
        try:
            cm = _cost_model(model, cfg, B, args)
            if policy == "milp":  # as the LazyTrainer plans: layer times measured at one row pass on CUDA
                from lazytrain_hf.hf.plan import measured_layer_costs

                cm, layer_costs = measured_layer_costs(cm, model.config, cfg, ex.device, B, args.seq_len)
                r["extra"]["layer_costs"] = layer_costs
            if policy == "fixed":
                sched = fixed_schedule(ex.num_layers, args.checkpoint_every, args.tier, args.prefetch_depth)
            else:
                from lazytrain_hf.planning.milp import solve_milp

                sched = solve_milp(cm, time_limit_s=10.0, gpu_optimizer=args.gpu_optimizer and not args.no_overlap)
                r.update(solve_ms=sched.solver.get("solve_ms"), mip_gap=sched.solver.get("mip_gap"))
            from lazytrain_hf.planning.estimate import evaluate

            est = evaluate(cm.for_schedule(sched), sched)  # the cost model's view of this schedule, fixed or MILP
            r.update(predicted_step_s=est.step_ms / 1e3)
            r["extra"].update(predicted_peak_gpu_gib=est.peak_gpu_bytes / GIB, plan_gpu_gib=cm.gpu_bytes / GIB,
                              cost_model_rates={k: getattr(cm, k) for k in (
                                  "h2d_gbps", "d2h_gbps", "bidir_gbps", "cpu_optim_params_per_s",
                                  "gpu_optim_params_per_s")})
            ex.set_schedule(sched)
            ex.instrument(True)
            _reset_peak(args)
            times, fb, optim, h2d, d2h = [], [], [], [], []
            waits: dict[str, list[float]] = {k: [] for k in UPDATE_COUNTERS}
            trace: list[tuple] = []  # (loss, grad norm, step skipped) per step, read after the timed loop
            mem: dict[str, float] = {}
            for step in range(args.steps + warm):
                first = (step * world + rank) * B  # rank r's share of the global batch
                ids = data[first:first + B]
                _sync(args)
                _phase_memory(args, mem, "base")
                t0 = time.perf_counter()
                loss = ex.forward_backward(ids, ids, denominator=_global_targets(ids, ex))
                _sync(args)
                _phase_memory(args, mem, "fwd_bwd")
                t1 = time.perf_counter()
                norm = ex.grad_norm()
                opt.clip_grad_norm(1.0, norm)
                opt.step()
                ex.zero_grad()
                trace.append((loss, norm, opt.last_step_skipped))
                _sync(args)
                _phase_memory(args, mem, "optimizer")
                t2 = time.perf_counter()
                if step >= warm:
                    times.append(t2 - t0)
                    fb.append(t1 - t0)
                    optim.append(t2 - t1)
                    h2d.append(ex.stats.extra.get("exposed_h2d_ms", 0.0))
                    d2h.append(ex.stats.extra.get("exposed_d2h_ms", 0.0))
                    for k, v in waits.items():  # deferred CPU updates: blocked time, worker time, ...
                        if k in ex.stats.extra:  # absent: not a zero
                            v.append(ex.stats.extra[k])
            med = statistics.median(times)
            tokens = B * args.seq_len  # per GPU
            pinned = ex.pinned_bytes
            losses = [float(x) for x, _, _ in trace]
            norms = [float(n) for _, n, _ in trace]
            skipped = sum(sk for _, _, sk in trace)
            r["extra"].update(losses=losses, grad_norms=norms, skipped_steps=skipped)
            if skipped:  # a skipped update costs nothing: the timings would flatter a broken run
                r.update(status="error", reason=f"non-finite gradient norm: {skipped} of {len(trace)} optimizer "
                         f"steps skipped (losses {losses}); timings not comparable")
            r.update(percentiles(times), tokens_per_s=world * tokens / med, tflops_6nd=6 * n_params * tokens / med / 1e12,
                     tflops_executed=_executed_flops(model, ex, tokens, args.seq_len) / med / 1e12,
                     peak_gpu_gib=max(mem.values(), default=None), peak_host_rss_gib=_peak_rss_gib(),
                     pinned_planned_gib=pinned["planned"] / GIB,
                     pinned_locked_gib=(pinned["registered"] + pinned["host_allocator"]) / GIB,
                     exposed_h2d_ms=statistics.median(h2d), exposed_d2h_ms=statistics.median(d2h),
                     optimizer_ms=statistics.median(optim) * 1e3)
            r["extra"].update({k: statistics.median(v) for k, v in waits.items() if v})
            r["extra"].update(fwd_bwd_ms=statistics.median(fb) * 1e3, setup_s=setup_s, **mem,
                              pinned_gib={k: v / GIB for k, v in pinned.items()},
                              weight_loads=ex.stats.weight_loads, recomputed_layers=ex.stats.recomputed_layers,
                              h2d_weight_gib=ex.stats.h2d_weight_bytes / GIB,
                              d2h_grad_gib=ex.stats.d2h_grad_bytes / GIB, act_d2h_gib=ex.stats.act_d2h_bytes / GIB,
                              rows_per_pass=args.rows_per_pass, master_weights=args.master_weights,
                              overlap_optimizer=not args.no_overlap,
                              optimizer_state_bytes=opt.state_bytes(), schedule_policy=sched.policy,
                              checkpoints=sum(lp.checkpoint for lp in sched.layers),
                              retained=sum(lp.retain for lp in sched.layers),
                              gpu_updated_layers=sum(lp.optimizer_device == "gpu" for lp in sched.layers),
                              device_updates=ex.device_updates,
                              shard_broadcasts=ex.shard.broadcasts if ex.shard is not None else None,
                              tiers=sorted({lp.tier for lp in sched.layers if lp.checkpoint}),
                              prefetch_depth=sched.prefetch_depth,
                              host_bytes_per_param=(ex.store.param_bytes + ex.store.grad_bytes +
                                                    sum(opt.state_bytes().values())) / n_params)
        except torch.OutOfMemoryError as e:
            r.update(status="oom", reason=str(e).splitlines()[0][:300])
        except Exception as e:  # report, do not hide: the row carries the error
            r.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
        ex.zero_grad()
        _finish_row(args, rows, r)
    ex.close()  # deferred layer updates finish before the process (and its worker thread) exits
    return rows


def _phase_memory(args: argparse.Namespace, mem: dict[str, float], phase: str) -> None:
    """Largest peak (GiB) of one phase of the step over the timed steps ("base": allocated when the step begins),
    then reset the peak counter for the next phase."""
    if args.device != "cuda":
        return
    val = (torch.cuda.memory_allocated() if phase == "base" else torch.cuda.max_memory_allocated()) / GIB
    mem[f"mem_{phase}_gib"] = max(mem.get(f"mem_{phase}_gib", 0.0), val)
    torch.cuda.reset_peak_memory_stats()


def _cost_model(model: Any, cfg: Any, B: int, args: argparse.Namespace) -> Any:
    """Analytic cost model at the plan budget: --plan-gpu-gib (default --gpu-cap-gib, else free memory) less
    --gpu-memory-margin, as the LazyTrainer plans (lazytrain_hf/hf/plan.py)."""
    import psutil

    from lazytrain_hf.profiling.analytic import analytic_cost_model
    from lazytrain_hf.profiling.hardware import probe

    hw = probe(args.device)
    plan_gib = args.plan_gpu_gib or args.gpu_cap_gib
    gpu = int(plan_gib * GIB) if plan_gib else (torch.cuda.mem_get_info()[0] if args.device == "cuda" else 80 * GIB)
    return analytic_cost_model(model.config, B, args.seq_len, hw, gpu_bytes=int(gpu * (1 - args.gpu_memory_margin)),
                               host_bytes=int(0.9 * psutil.virtual_memory().total),
                               loss_chunk_tokens=cfg.loss_chunk_tokens, master_weights=args.master_weights,
                               rows_per_pass=args.rows_per_pass)


def run_stock(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The all-on-GPU path the stock Trainer runs: HF model on the GPU, activation checkpointing, fused AdamW."""
    model = fast_random_model(args.model, torch.bfloat16).to(args.device)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=args.device == "cuda")
    data = gsm8k_token_rows(args.seq_len, max(args.batch_sizes) * (args.steps + 1))
    rows = []
    for B in args.batch_sizes:
        r = row(system="stock_trainer", model=args.model, params=n_params, gpu_cap_gib=args.gpu_cap_gib,
                batch_size=B, seq_len=args.seq_len, status="ok")
        try:
            _reset_peak(args)
            times = []
            for step in range(args.steps + 1):
                ids = data[step * B:(step + 1) * B].to(args.device)
                _sync(args)
                t0 = time.perf_counter()
                model(input_ids=ids, labels=ids).loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                _sync(args)
                if step > 0:
                    times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            tokens = B * args.seq_len
            r.update(percentiles(times), tokens_per_s=tokens / med, tflops_6nd=6 * n_params * tokens / med / 1e12,
                     peak_gpu_gib=_peak_gib(args), peak_host_rss_gib=_peak_rss_gib())
            r["extra"]["optimizer"] = "torch AdamW fused, all on GPU, activation checkpointing"
        except torch.OutOfMemoryError as e:
            r.update(status="oom", reason=str(e).splitlines()[0][:300])
        opt.zero_grad(set_to_none=True)
        _finish_row(args, rows, r)
    return rows


def _cpu_kernel_facts() -> dict[str, Any]:
    """Which CPU update kernel this host runs: build status, table-read mode, the self-check against the torch
    reference, and the LAZYTRAIN_CPU_KERNEL override (a non-finite run can then be compared with the torch kernel)."""
    from lazytrain_hf.config import cpu_threads
    from lazytrain_hf.optim import kernel_select as K
    from lazytrain_hf.optim._cpu_kernel import cpu_kernel_status

    return {"status": cpu_kernel_status()[1], "self_check": K.cpp_kernel_self_check(cpu_threads())[1],
            "env": os.environ.get(K.CPU_KERNEL_ENV)}


def _global_targets(ids: torch.Tensor, ex: Any) -> torch.Tensor | None:
    """The loss denominator: valid shifted targets over every rank's rows (gradients are summed over ranks)."""
    if ex.dp is None:
        return None
    n = torch.tensor(float(ids[:, 1:].numel()), device=ex.device)
    dist.all_reduce(n)
    return n


def _init_distributed(args: argparse.Namespace) -> None:
    """One process per GPU under torchrun: NCCL on cuda:LOCAL_RANK (gloo on CPU); world 1 otherwise."""
    args.world = int(os.environ.get("WORLD_SIZE", "1"))
    args.rank = int(os.environ.get("RANK", "0"))
    if args.world > 1:
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")


def _finish_row(args: argparse.Namespace, rows: list[dict[str, Any]], r: dict[str, Any]) -> None:
    gc.collect()
    _empty_cache(args)
    rows.append(r)
    if getattr(args, "rank", 0) != 0:
        return
    append_results(args.out, "executor", [r])  # row by row: a run cut short keeps what it measured
    print(_fmt(r), flush=True)


def _fmt(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['system']:16s} B={r['batch_size']:3d} {r['status']}: {r['reason']}"
    return (f"{r['system']:16s} B={r['batch_size']:3d} step {r['step_s_median']:.2f}s "
            f"tok/s {r['tokens_per_s']:.0f} TFLOPS6ND {r['tflops_6nd']:.1f} peakGPU {r['peak_gpu_gib'] or 0:.1f}GiB "
            f"h2d_exp {r['exposed_h2d_ms'] or 0:.0f}ms d2h_exp {r['exposed_d2h_ms'] or 0:.0f}ms "
            f"opt {r['optimizer_ms'] or 0:.0f}ms fb {r['extra'].get('fwd_bwd_ms', 0):.0f}ms "
            f"cpu_upd {r['extra'].get('cpu_update_ms', 0):.0f}ms wait {r['extra'].get('optimizer_wait_ms', 0):.0f}ms "
            f"(GPU idle {r['extra'].get('exposed_update_wait_ms', 0):.0f}ms)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=["lazytrain_fixed", "lazytrain_milp", "stock_trainer"], required=True)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--gpu-cap-gib", type=float, default=None)
    p.add_argument("--plan-gpu-gib", type=float, default=None, help="plan for this budget (default: the cap)")
    p.add_argument("--gpu-memory-margin", type=float, default=0.12, help="as lazytrain_config.gpu_memory_margin")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpoint-every", type=int, default=4)
    p.add_argument("--tier", default="gpu")
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--rows-per-pass", type=int, default=None)
    p.add_argument("--loss-chunk-tokens", type=int, default=8192)
    p.add_argument("--master-weights", default="kahan")
    p.add_argument("--fp32-embedding-states", action="store_true")
    p.add_argument("--no-overlap", action="store_true", help="optimizer updates serial after backward")
    p.add_argument("--gpu-optimizer", action="store_true",
                   help="MILP may place layers' updates on the GPU (lazytrain_config.gpu_layer_updates)")
    p.add_argument("--dp-updates", default="auto", choices=["auto", "replicated", "sharded"],
                   help="data parallel (torchrun): every rank updates every layer, or each its share (dp_updates)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run (CI) on a tiny shape")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    _init_distributed(args)
    if args.gpu_cap_gib and args.device == "cuda":
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * GIB / total))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.system == "stock_trainer":
        if args.world > 1:
            raise SystemExit("stock_trainer runs one process; launch it without torchrun")
        run_stock(args)
    else:
        run_lazytrain(args, args.system.split("_", 1)[1])
    if args.world > 1:
        dist.barrier()  # every rank is past its last collective before the group goes
        dist.destroy_process_group()
        # skip interpreter teardown: under torchrun both gloo ranks once died of SIGABRT after the results were
        # written (the CPU update worker and gloo's destructors at exit), which fails the launch
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
