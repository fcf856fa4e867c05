"""The soak suite: one long LazyTrainer run as a user runs it, watched for drift.

    python -m benchmarks.soak --out benchmarks/results/soak-YYYYMMDD.json [--budget-s 540]

GSM8K through the CLI's own data path (`load_math_dataset`, `tokenize_for_sft`, `make_collator`: batches padded to
their longest; grouped by length unless --random-batches, so that several length buckets' plans run and the run
switches between them), LazyTrainer with the product's defaults (the MILP policy) and a GPU budget, an NVMe tier
(`nvme_dir`; the default budgets make the longest bucket's plan use it), evaluation and an atomic checkpoint at
intervals (`save_total_limit` 1: the disk holds the last one and the one being written), until `--budget-s` runs
out. Every `--window` optimizer steps it records the process's RSS, the pinned bytes (planned and locked) and the
NVMe tier's peak bytes on disk (sampled every 0.25 s); every step, its time, real (non-pad) and computed (rows x
padded length) tokens, the sequence-length bucket its plan was for, its padded length and the running plan's
prediction for that length (`predicted_s`: the bucket plan's predicted step scaled by the analytic cost model's
ratio between the batch's length and the bucket's). The summary holds the targets: RSS growth between the first
window after warm-up and the last < 1%, pinned bytes constant, p95 step time per real token <= 1.2x its median
within each bucket (steps after warm-up), and no NVMe file left when training returns; as diagnostics per computed
token, and measured / predicted (`p95_over_median_vs_plan`: within a bucket the per-step costs that do not scale
with tokens, the update of every parameter and the weight streaming, make a short batch's tokens dearer; measured /
predicted takes that out and leaves drift and stalls). Results: shared/RESULTS_FORMAT.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .common import GIB, append_results, gsm8k_dir, percentiles, row

#: soak targets: RSS growth (first window after warm-up to the last), p95 / median step time per token per bucket
RSS_GROWTH_MAX, P95_RATIO_MAX = 0.01, 1.2


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _dir_bytes(d: str | None) -> tuple[int, int]:
    """(bytes, files) under `d` (0, 0 without one)."""
    if not d or not os.path.isdir(d):
        return 0, 0
    total = files = 0
    for root, _, names in os.walk(d):
        for n in names:
            try:
                total += os.path.getsize(os.path.join(root, n))
                files += 1
            except OSError:  # removed while walking: the tier frees files as boundaries are read back
                pass
    return total, files


class SoakRecorder(TrainerCallback):
    """Per optimizer step: wall time, real tokens, the plan's sequence-length bucket; per window: RSS, pinned
    bytes, NVMe bytes. Stops training at `deadline` (time.time())."""

    def __init__(self, trainer: Any, window: int, deadline: float, nvme_dir: str | None) -> None:
        self.trainer, self.window, self.deadline, self.nvme_dir = trainer, window, deadline, nvme_dir
        self.steps: list[dict[str, Any]] = []
        self.windows: list[dict[str, Any]] = []
        self.evals: list[dict[str, float]] = []
        self._tokens = self._computed = self._length = 0
        self._predicted: dict[tuple[int, int], float] = {}  # (id(plan), padded length) -> predicted step (s)
        self._t0 = 0.0
        self._nvme_peak = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None

    def add_tokens(self, real: int, computed: int, length: int = 0) -> None:
        """A micro-batch of this optimizer step trained `real` non-pad tokens of `computed` (rows x padded length
        `length`; called from `training_step`)."""
        self._tokens += real
        self._computed += computed
        self._length = max(self._length, length)

    def _predicted_s(self, length: int) -> float | None:
        """The running plan's step for a batch padded to `length` (s): its predicted step x the analytic cost
        model's step at `length` / at the plan's bucket (no layer is timed: `layer_costs` would profile a new
        length on the GPU mid-run). None without a MILP / fixed plan or a length."""
        ex = self.trainer.executor
        sched = ex.schedule
        bucket, planned = sched.solver.get("seq_len_bucket"), sched.predicted.get("step_ms")
        if not length or not bucket or not planned or self.trainer.plans is None:
            return None
        key = (id(sched), length)
        if key not in self._predicted:
            from lazytrain_hf.hf import plan
            from lazytrain_hf.planning.estimate import evaluate

            resident, rows = plan.running_choices(self.trainer)

            def step_ms(T: int) -> float:
                cm = plan.analytic_cost_model_for_trainer(self.trainer, T, resident, rows)
                return evaluate(cm.for_schedule(sched), sched).step_ms

            self._predicted[key] = planned / 1e3 * step_ms(length) / step_ms(int(bucket))
        return self._predicted[key]

    def _sample_nvme(self) -> None:
        # the tier's files live from a boundary's write in forward to its read in backward: sampled during steps,
        # not only at their ends
        while not self._stop.wait(0.25):
            self._nvme_peak = max(self._nvme_peak, _dir_bytes(self.nvme_dir)[0])

    def on_train_begin(self, args, state, control, **kwargs: Any):
        if self.nvme_dir and self._sampler is None:
            self._sampler = threading.Thread(target=self._sample_nvme, name="soak-nvme-sampler", daemon=True)
            self._sampler.start()

    def on_train_end(self, args, state, control, **kwargs: Any):
        self._stop.set()

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs: Any):
        self._sync()
        self._tokens = self._computed = self._length = 0
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs: Any):
        self._sync()
        took = time.perf_counter() - self._t0
        ex = self.trainer.executor
        self.steps.append({"step": state.global_step, "s": took, "tokens": self._tokens,
                           "computed_tokens": self._computed, "bucket": ex.schedule.solver.get("seq_len_bucket"),
                           "length": self._length, "predicted_s": self._predicted_s(self._length)})
        if state.global_step % self.window == 0:
            pinned = ex.pinned_bytes
            self.windows.append({"step": state.global_step, "time_s": time.time(), "rss_gib": _rss() / GIB,
                                 "pinned_planned_gib": pinned["planned"] / GIB,
                                 "pinned_locked_gib": (pinned["registered"] + pinned["host_allocator"]) / GIB,
                                 "nvme_peak_gib": self._nvme_peak / GIB})
            self._nvme_peak = 0
        if time.time() > self.deadline:
            control.should_training_stop = True
            control.should_save = False  # the budget's end: no checkpoint racing the call's limit

    def on_evaluate(self, args, state, control, metrics=None, **kwargs: Any):
        if metrics and "eval_loss" in metrics:
            self.evals.append({"step": state.global_step, "eval_loss": float(metrics["eval_loss"])})


def _p95(values: list[float]) -> float:
    """The 95th percentile of `values`, nearest rank."""
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(round(0.95 * (len(ranked) - 1))))]


def summarize(steps: list[dict[str, Any]], windows: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The soak targets from the recorded steps and windows (those after `warmup` optimizer steps)."""
    after = [w for w in windows if w["step"] > warmup]
    out: dict[str, Any] = {"windows_after_warmup": len(after)}
    if len(after) >= 2:
        first, last = after[0], after[-1]
        out["rss_growth"] = last["rss_gib"] / first["rss_gib"] - 1
        out["pinned_locked_change_gib"] = last["pinned_locked_gib"] - first["pinned_locked_gib"]
        out["rss_growth_met"] = out["rss_growth"] < RSS_GROWTH_MAX
        out["pinned_constant_met"] = abs(out["pinned_locked_change_gib"]) < 1 / 1024  # below one MiB
    buckets: dict[str, dict[str, Any]] = {}
    for b in sorted({s["bucket"] for s in steps if s["step"] > warmup}, key=lambda x: (x is None, x)):
        ours = [s for s in steps if s["step"] > warmup and s["bucket"] == b]
        per = [s["s"] / s["tokens"] for s in ours if s["tokens"]]
        if len(per) < 2:
            continue
        med, p95 = statistics.median(per), _p95(per)
        buckets[str(b)] = {"steps": len(per), "median_ms_per_ktoken": med * 1e6, "p95_ms_per_ktoken": p95 * 1e6,
                           "p95_over_median": p95 / med}
        # diagnostic: per computed token (rows x padded length), the work the step's kernels did; the target stays
        # per real token
        comp = [s["s"] / s["computed_tokens"] for s in ours if s.get("computed_tokens")]
        if len(comp) >= 2:
            buckets[str(b)]["p95_over_median_computed"] = _p95(comp) / statistics.median(comp)
        vs_plan = [s["s"] / s["predicted_s"] for s in ours if s.get("predicted_s")]
        if len(vs_plan) >= 2:
            buckets[str(b)].update(median_vs_plan=statistics.median(vs_plan),
                                   p95_over_median_vs_plan=_p95(vs_plan) / statistics.median(vs_plan))
    out["buckets"] = buckets
    if buckets:
        out["p95_met"] = all(v["p95_over_median"] <= P95_RATIO_MAX for v in buckets.values())
    return out


def _group_by_length() -> dict[str, Any]:
    """The TrainingArguments keyword for length-grouped batches: `train_sampling_strategy` from transformers 5.2x,
    `group_by_length` before."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in names \
        else {"group_by_length": True}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lazytrain_hf import LazyTrainer, LazyTrainingArguments
    from lazytrain_hf.data import load_math_dataset, load_tokenizer, make_collator, tokenize_for_sft

    deadline = time.time() + args.budget_s
    data = gsm8k_dir(args.data_dir)
    tok = load_tokenizer("qwen-offline")
    train = tokenize_for_sft(load_math_dataset(str(data), "train"), tok, args.max_length)
    test = tokenize_for_sft(load_math_dataset(str(data), "test", limit=args.eval_rows), tok, args.max_length)
    cuda = args.device == "cuda"
    if cuda:
        from .common import fast_random_model

        model = fast_random_model(args.model)
    else:
        from lazytrain_hf.models import load_model

        model = load_model(args.model, "float32", seed=0)
    params = sum(p.numel() for p in model.parameters())
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="soak-"))
    nvme_dir = str(work / "nvme")
    os.makedirs(nvme_dir, exist_ok=True)
    cfg: dict[str, Any] = {"nvme_dir": nvme_dir}
    if cuda:
        cfg["gpu_memory_budget"] = f"{args.gpu_cap}GiB"
        torch.cuda.set_per_process_memory_fraction(args.gpu_cap * GIB / torch.cuda.get_device_properties(0).total_memory)
    if args.host_memory_budget:
        cfg["host_memory_budget"] = args.host_memory_budget
    targs = LazyTrainingArguments(
        output_dir=str(work / "out"), per_device_train_batch_size=args.batch_size, max_steps=args.max_steps,
        learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant", bf16=cuda,
        logging_steps=args.window, eval_strategy="steps", eval_steps=args.eval_every, per_device_eval_batch_size=8,
        save_strategy="steps", save_steps=args.save_every, save_total_limit=1, report_to=[], use_cpu=not cuda,
        seed=0, dataloader_num_workers=0, disable_tqdm=True, lazytrain_config=cfg,
        **({} if args.random_batches else _group_by_length()))
    trainer = LazyTrainer(model=model, args=targs, train_dataset=train, eval_dataset=test,
                          data_collator=make_collator(tok, pad_to_multiple_of=8), processing_class=tok)
    recorder = SoakRecorder(trainer, args.window, deadline, nvme_dir)
    trainer.add_callback(recorder)
    step = trainer.training_step

    def counted_step(model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> Any:  # real tokens per micro-batch
        recorder.add_tokens(int(inputs["attention_mask"].sum()), inputs["input_ids"].numel(),
                            int(inputs["input_ids"].shape[-1]))
        return step(model, inputs, *a, **k)

    trainer.training_step = counted_step
    t0 = time.time()
    status, reason = "ok", None
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 -- a soak reports its failure as its row
        status, reason = ("oom" if "out of memory" in str(e).lower() else "error"), f"{type(e).__name__}: {e}"[:500]
    nvme_left = _dir_bytes(nvme_dir)
    steps, windows = recorder.steps, recorder.windows
    summary = summarize(steps, windows, args.warmup)
    summary["nvme_files_left"] = nvme_left[1]
    summary["nvme_clean_met"] = nvme_left[1] == 0
    ckpts = sorted(p.name for p in (work / "out").glob("checkpoint-*"))
    times = [s["s"] for s in steps if s["step"] > args.warmup]
    ex = getattr(trainer, "executor", None)
    schedule = ex.schedule if ex is not None else None
    tiers = sorted({lp.tier for lp in schedule.layers if lp.checkpoint}) if schedule is not None else []
    r = row(system="lazytrain_milp", model=args.model, params=params, gpu_cap_gib=args.gpu_cap if cuda else None,
            batch_size=args.batch_size, seq_len=args.max_length, status=status, reason=reason,
            **(percentiles(times) if times else {"steps_timed": 0}),
            peak_host_rss_gib=max((w["rss_gib"] for w in windows), default=None),
            peak_gpu_gib=torch.cuda.max_memory_allocated() / GIB if cuda else None,
            extra={"configuration": "product defaults", "lazytrain_config": cfg,
                   "batches": "random" if args.random_batches else "grouped by length",
                   "schedule_policy": schedule.policy if schedule is not None else None, "wall_s": time.time() - t0,
                   "optimizer_steps": len(steps), "warmup_steps": args.warmup, "window_steps": args.window,
                   "eval_every": args.eval_every, "save_every": args.save_every, "checkpoints_left": ckpts,
                   "boundary_tiers": tiers, "summary": summary, "windows": windows, "evals": recorder.evals,
                   "steps": [{k: (round(v, 5) if isinstance(v, float) else v) for k, v in s.items()} for s in steps]})
    if not args.keep_work_dir and not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return r


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results JSON (suite 'soak'; rows are appended)")
    p.add_argument("--model", default="qwen2.5-3b", help="registry name (default qwen2.5-3b; CPU: a tiny one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    # qwen2.5-3b, B=96 x <=512 tokens: at 24 GiB the MILP keeps every boundary on the GPU; at 16 GiB with 22 GiB of
    # host memory (its fixed part is 20.75 GiB) the longest bucket's plan puts ~0.56 GiB of them on NVMe
    # (`lazytrain-hf plan --model qwen2.5-3b --gpu-memory 16GiB --host-memory 22GiB --nvme-dir DIR --batch-size 96
    # --seq-len 512`)
    p.add_argument("--gpu-cap", type=float, default=16, help="GPU budget and cap in GiB (default 16)")
    p.add_argument("--host-memory-budget", default=None,
                   help="lazytrain_config.host_memory_budget (default on CUDA: 22GiB, so that the plan uses NVMe)")
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--max-length", type=int, default=512, help="tokens per example at most (GSM8K: 100-400)")
    p.add_argument("--max-steps", type=int, default=100000, help="optimizer steps at most (the budget stops first)")
    p.add_argument("--budget-s", type=float, default=540, help="wall seconds of training, setup included")
    p.add_argument("--window", type=int, default=20, help="optimizer steps per recorded window")
    p.add_argument("--warmup", type=int, default=20, help="optimizer steps left out of the targets")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-rows", type=int, default=64)
    p.add_argument("--save-every", type=int, default=100, help="a checkpoint of the 3B (Kahan master weights) "
                   "is ~19 GiB: with save_total_limit 1 an atomic save needs room for two on the 64 GiB disk")
    p.add_argument("--data-dir", default=None, help="GSM8K folder (default: LAZYTRAIN_GSM8K_DIR or ../shared/data)")
    p.add_argument("--work-dir", default=None, help="checkpoints and the NVMe tier (default: a temporary directory)")
    p.add_argument("--keep-work-dir", action="store_true")
    p.add_argument("--random-batches", action="store_true",
                   help="batches of random examples (default: grouped by length, so that each length bucket's plan "
                        "runs and the run switches between them)")
    args = p.parse_args(argv)
    if args.host_memory_budget is None and args.device == "cuda":
        args.host_memory_budget = "22GiB"
    if min(args.batch_size, args.max_length, args.window, args.eval_every, args.save_every, args.max_steps) < 1 \
            or args.warmup < 0 or args.budget_s <= 0:
        p.error("--batch-size, --max-length, --window, --eval-every, --save-every, --max-steps must be >= 1, "
                "--warmup >= 0 and --budget-s > 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    r = run(args)
    append_results(args.out, "soak", [r])
    s = r["extra"]["summary"]
    print(f"soak {r['model']}: {r['status']} {r['extra']['optimizer_steps']} steps, windows {s['windows_after_warmup']}"
          f", RSS growth {s.get('rss_growth', float('nan')):+.2%}, pinned change "
          f"{s.get('pinned_locked_change_gib', float('nan')):+.4f} GiB, p95/median per bucket "
          f"{ {b: round(v['p95_over_median'], 3) for b, v in s['buckets'].items()} } (measured / planned "
          f"{ {b: round(v['p95_over_median_vs_plan'], 3) for b, v in s['buckets'].items() if 'p95_over_median_vs_plan' in v} }"
          f"), NVMe files left "
          f"{s['nvme_files_left']}, tiers {r['extra']['boundary_tiers']}", flush=True)
    return r


if __name__ == "__main__":
    main(sys.argv[1:])
