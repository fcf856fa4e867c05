"""Side-by-side harness: LazyTrain vs the systems users would pick instead, through the HF Trainer.

    python -m benchmarks.run --suite 7b --out benchmarks/results/7b-YYYYMMDD.json [--budget-s 540]
    python -m benchmarks.run --suite smoke --out /tmp/smoke.json                 # CPU, tiny shape (CI)
    python -m benchmarks.run --suite full --systems lazytrain_milp,stock_trainer_bnb8 --caps 24 --find-max-batch ...

Each (system, model, GPU cap) runs in its own process (benchmarks.worker), FSDP2 and DeepSpeed one process per
batch size: an out-of-memory error, a crash or a hang cannot take the harness down. A process that outlives
--timeout-s is killed and its unfinished rows are recorded "timeout". Rows are merged into --out as they arrive
(shared/RESULTS_FORMAT.md); a rerun skips every (system, model, cap, batch) already there with status ok, oom or
unsupported, so a suite longer than one 10-minute GPU call is covered in stages (--budget-s stops starting work and
kills what runs at the deadline without recording it, so the next call redoes it).
--find-max-batch searches each system's largest feasible batch (doubling, then bisection to adjacent batch sizes;
each probe a short run in its own process; a probe that trained only after a LazyTrain out-of-memory recovery counts
as infeasible) and stores it, with every probed size and its outcome, under "max_batch" in --out (saved after each
probe: an unfinished search resumes).

    python -m benchmarks.run --suite hybrid --out benchmarks/results/hybrid-YYYYMMDD.json --budget-s 510
    python -m benchmarks.run --suite paper --models qwen2.5-14b --out benchmarks/results/paper-YYYYMMDD.json

Models: registry names, Hub ids or local folders, each optionally with `:layers=N`: the same config with its first N
decoder layers (num_hidden_layers and a per-layer `layer_types` list cut alike; e.g. qwen3.6-27b:layers=16). Rows
keep the string as given in `model` and record extra.num_hidden_layers. The hybrid and paper suites run LazyTrain
with the product's defaults (extra.configuration "product defaults": lazytrain_config holds only the policy and the
GPU budget, the stock LazyTrainer); the 7b and full suites keep the harness's settings (benchmarks/systems.py).

    python -m benchmarks.run --suite lora --out benchmarks/results/lora-YYYYMMDD.json --budget-s 540

The lora suite (LoRA r 16 on every linear layer of a frozen base) holds both bases in one file. On a bf16 Qwen2.5-32B
shape: systems lazytrain_lora, stock_trainer_lora, fsdp2_cpu_offload_lora, tokens_per_step tokens per optimizer step
(gradient accumulation per batch size, recorded per row), the uncapped stock PEFT run's largest batch searched (up to
tokens_per_step / seq_len sequences) and measured there. On a Llama-3-70B shape in bitsandbytes nf4 with double
quantization and bf16 compute (systems.QLORA_QUANT): lazytrain_qlora, the same adapters under 24 GiB; the base is
built 4-bit module by module on the GPU (a bf16 70B would not fit the 128 GiB host) and ends on the CPU, as
from_pretrained(..., device_map="cpu") leaves it (`--models llama3-70b` runs that row alone). lora-smoke and
qlora-smoke are the CPU shapes (tests).

    python -m benchmarks.run --suite sft --out benchmarks/results/sft-YYYYMMDD.json --budget-s 540

The sft suite measures TRL's SFTTrainer through LazyTrainerMixin (lazytrain_sft: an SFTConfig of the same
hyper-parameters, TRL's loss, collator and metrics) against lazytrain_milp on the same rows, both with the product's
defaults, at 24 GiB and batch 32; sft-smoke is its CPU shape (tests).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lazytrain_hf.config import LazyTrainConfig

from .common import depth_overrides, git_commit, gsm8k_dir, model_overrides, parse_model, row
from .systems import (
    HARNESS_SETTINGS,
    LORA_BASE,
    LORA_DEFAULTS,
    LORA_SYSTEMS,
    ONE_BATCH_PER_PROCESS,
    PRODUCT_DEFAULTS,
    QLORA_QUANT,
    QLORA_SYSTEMS,
    SFT_SYSTEMS,
    SYSTEMS,
    unsupported_reason,
)
from .worker import fmt_row

FINAL = ("ok", "oom", "unsupported")
LT = ("lazytrain_milp", "lazytrain_fixed")
STOCK = ("stock_trainer", "stock_trainer_bnb8")
OFFLOAD = ("fsdp2_cpu_offload", "zero_offload")
ORDER = (*LT, *STOCK, *OFFLOAD)
#: run only where a suite (or --systems) names them
LORA = LORA_SYSTEMS
QLORA = QLORA_SYSTEMS
SFT = SFT_SYSTEMS

#: name -> settings. batch[cap][system]: batch sizes per GPU cap (None = uncapped). timeout[system]: seconds.
#: Optional: systems (default all), lazytrain (PRODUCT_DEFAULTS: LazyTrain rows as a user runs them; default the
#: harness's settings), max_batch_caps (caps whose largest batch is searched without --find-max-batch), row_s[cap]
#: (seconds a row takes: no row starts with less budget left, so a call's last minutes are not spent on a row the
#: deadline kills), system_row_s[system] (the same for one system, over row_s), model_systems[model] (the systems that
#: run on that model; default all), tokens_per_step (gradient accumulation: benchmarks/worker.py), lora (LoraConfig fields of the
#: LoRA systems; default systems.LORA_DEFAULTS), quantization (BitsAndBytesConfig fields of the QLoRA systems' base;
#: default systems.QLORA_QUANT), max_batch_systems (the systems searched at max_batch_caps; default
#: all), max_batch_limit (the search's largest batch; --max-batch-limit overrides; a dict: per system, 512 for the
#: others), max_batch_guess (LazyTrain searches start at the planner's largest batch: `planned_max_batch`),
#: max_batch_against (system -> the system whose completed search's largest batch it probes first: the claim
#: "largest >= the other's + 1" is decided by that one probe, the exact largest by the rest of the search),
#: measure_max_batch (measure each completed search's largest batch as a row too). A system a cap's batch dict gives [] does not run at that cap.
#: warm-up steps of the GPU suites running LazyTrain (not timed): the MILP calibrates on steps 3-5 (2 unused steps,
#: then 3 measured: hf/plans.py); a switch to its re-plan is a trial measured on steps 7-9 (step 6 allocates the new
#: plan's buffers) after which the run keeps it or goes back (hf/calibrate.py), so the timed steps, from step 11, run
#: the plan the run keeps. On 1 calibration step the measured CPU update rate varied 3.0-4.4 G params/s across rows
#: of one configuration (the 7b-*-20261130.json results).
LT_WARMUP = 10
SUITES: dict[str, dict[str, Any]] = {
    "smoke": dict(device="cpu", models=["qwen3-tiny"], caps=[None], seq_len=32, steps=2, warmup=1,
                  batch={None: {s: [2] for s in ORDER}}, timeout={s: 120 for s in ORDER}),
    "7b": dict(device="cuda", models=["qwen2.5-7b"], caps=[24, 80], seq_len=1024, steps=5, warmup=LT_WARMUP,
               batch={24: {**{s: [8, 16, 32, 64] for s in LT}, **{s: [1, 8] for s in STOCK},
                           **{s: [8] for s in OFFLOAD}},
                      80: {**{s: [64, 128] for s in LT}, "stock_trainer": [8, 16], "stock_trainer_bnb8": [8, 16, 32],
                           **{s: [8] for s in OFFLOAD}}},
               timeout={**{s: 420 for s in LT}, **{s: 240 for s in STOCK}, "fsdp2_cpu_offload": 360,
                        "zero_offload": 480}),
}
# The Qwen3.5 / 3.6 hybrid family (3 linear-attention : 1 full-attention layers) at 16 of qwen3.6-27b's 64 layers
# (8.6 B parameters, 2.5 B of them embedding + head): LazyTrain with the product's defaults.
# At 24 GiB the MILP is measured at B=8 and B=32, and both policies' largest batches are searched to adjacent sizes
# from the planner's largest (max_batch_guess: `planned_max_batch`; analytic, H200 figures: fixed 73, MILP 94), probes
# of 1 warm-up + 1 timed step (~2 min each at these batches): the claim is the MILP's largest >= the fixed policy's + 1,
# so the fixed policy's search probes the MILP's largest first.
# row_s[24]: B=32 ran 15 steps of ~8.5 s plus setup.
SUITES["hybrid"] = dict(device="cuda", models=["qwen3.6-27b:layers=16"], caps=[80, 24], seq_len=1024, steps=5,
                        warmup=LT_WARMUP, systems=list(LT), lazytrain=PRODUCT_DEFAULTS, max_batch_caps=[24],
                        max_batch_guess=True, max_batch_against={"lazytrain_fixed": "lazytrain_milp"},
                        batch={80: {s: [72] for s in LT}, 24: {"lazytrain_milp": [8, 32], "lazytrain_fixed": [8]}},
                        timeout={s: 480 for s in LT}, row_s={80: 270, 24: 170})
# The paper's dense range (3B to 14B) with the product's defaults, under 24 GiB and 80 GiB: LazyTrain MILP / fixed
# and the stock Trainer (its out-of-memory rows recorded where it does not fit), each system's largest batch under
# 24 GiB searched. At 1024 tokens per sequence, batch 32 is the 32k tokens per step the targets are stated at.
# row_s: a 14B step measured at batch 32 (9.3 s, full suite, 24 GiB) x 15 steps plus building the random model.
SUITES["paper"] = dict(device="cuda", models=["qwen2.5-3b", "qwen2.5-7b", "qwen3-8b", "qwen2.5-14b", "qwen3-14b"],
                       caps=[24, 80, None], seq_len=1024, steps=5, warmup=LT_WARMUP,
                       systems=["lazytrain_milp", "lazytrain_fixed", "stock_trainer"], lazytrain=PRODUCT_DEFAULTS,
                       max_batch_caps=[24], max_batch_guess=True,
                       batch={24: {**{s: [8, 16, 32] for s in LT}, "stock_trainer": [8, 16, 32]},
                              80: {**{s: [32, 64] for s in LT}, "stock_trainer": [8, 16, 32]},
                              # the stock Trainer on the whole GPU: the 24 GiB MILP rows' pair at 32k tokens a step
                              None: {**{s: [] for s in LT}, "stock_trainer": [32]}},
                       timeout={**{s: 540 for s in LT}, "stock_trainer": 300}, row_s={24: 200, 80: 240, None: 150})
# LoRA r 16 on every linear layer at 32k tokens per optimizer step, both bases in one file: a Qwen2.5-32B shape in
# bf16 and a Llama-3-70B shape in nf4 (model_systems: which systems run on which base).
# bf16 base: LazyTrain under 24 GiB (B 32: one micro-batch per step, the base streamed once per step; the plan splits
# it into row passes), the uncapped stock Trainer + PEFT at its largest batch up to 32 (a max-batch search after B 32,
# then that batch measured, with accumulation up to 32k tokens), the stock Trainer at 24 GiB (out of memory: the bf16
# base alone is 61 GiB), and FSDP2 CPU offload + PEFT at 24 GiB.
# 4-bit base (lazytrain_qlora: nf4 with double quantization, 70.6 B parameters, 68.5 B of them 4-bit: ~35 GB packed
# weights and state; the embedding and LM head fp32 after prepare_model_for_kbit_training, 8.4 GB): B 16 x 2
# micro-batches, since at B 32 the fp32 boundaries fill 111 of the 113 GiB host budget. Its row built the base in 30 s
# and ran 8 steps in 384 s (qlora-20261203.json), so it needs the whole of one --budget-s 570 call (row_s 500) and
# --steps 2 there (12 steps); a row killed at the deadline records nothing.
SUITES["lora"] = dict(device="cuda", models=["qwen2.5-32b", "llama3-70b"], caps=[24, None], seq_len=1024, steps=5,
                      warmup=LT_WARMUP, systems=[*LORA, *QLORA], model_systems={"qwen2.5-32b": LORA, "llama3-70b": QLORA},
                      lazytrain=PRODUCT_DEFAULTS, tokens_per_step=32768, lora=LORA_DEFAULTS, quantization=QLORA_QUANT,
                      batch={24: {"lazytrain_lora": [32], "stock_trainer_lora": [1], "fsdp2_cpu_offload_lora": [8],
                                  "lazytrain_qlora": [16]},
                             None: {"lazytrain_lora": [], "stock_trainer_lora": [32], "fsdp2_cpu_offload_lora": [],
                                    "lazytrain_qlora": []}},
                      max_batch_caps=[None], max_batch_systems=["stock_trainer_lora"], max_batch_limit=32,
                      measure_max_batch=True,
                      timeout={"lazytrain_lora": 540, "stock_trainer_lora": 420, "fsdp2_cpu_offload_lora": 540,
                               "lazytrain_qlora": 540},
                      row_s={24: 300, None: 240}, system_row_s={"lazytrain_qlora": 500})
SUITES["lora-smoke"] = dict(device="cpu", models=["qwen3-tiny"], caps=[None], seq_len=32, steps=2, warmup=1,
                            systems=list(LORA), lazytrain=PRODUCT_DEFAULTS, tokens_per_step=128, lora=LORA_DEFAULTS,
                            batch={None: {**{s: [2] for s in LORA}, "lazytrain_lora": [1, 2]}},
                            timeout={s: 240 for s in LORA})
# lazytrain_qlora on the CPU (tests): a tiny nf4 base
SUITES["qlora-smoke"] = dict(device="cpu", models=["llama-tiny"], caps=[None], seq_len=32, steps=2, warmup=1,
                             systems=list(QLORA), lazytrain=PRODUCT_DEFAULTS, tokens_per_step=128, lora=LORA_DEFAULTS,
                             quantization=QLORA_QUANT, batch={None: {"lazytrain_qlora": [2]}},
                             timeout={"lazytrain_qlora": 240})
# TRL's SFTTrainer through LazyTrainerMixin (lazytrain_sft: an SFTConfig, TRL's loss and collator) vs LazyTrainer
# (lazytrain_milp) on the same token rows, both with the product's defaults, at the 7b suite's shape and warm-up;
# sft-smoke is its CPU shape (tests)
SUITES["sft"] = dict(device="cuda", models=["qwen2.5-7b"], caps=[24], seq_len=1024, steps=5, warmup=LT_WARMUP,
                     systems=["lazytrain_milp", *SFT], lazytrain=PRODUCT_DEFAULTS,
                     batch={24: {s: [32] for s in ("lazytrain_milp", *SFT)}},
                     timeout={s: 480 for s in ("lazytrain_milp", *SFT)}, row_s={24: 240})
SUITES["sft-smoke"] = dict(device="cpu", models=["qwen3-tiny"], caps=[None], seq_len=32, steps=1, warmup=1,
                           systems=["lazytrain_milp", *SFT], lazytrain=PRODUCT_DEFAULTS,
                           batch={None: {s: [2] for s in ("lazytrain_milp", *SFT)}},
                           timeout={s: 240 for s in ("lazytrain_milp", *SFT)})
# The 7B recipe's data as it trains it (data.packing: GSM8K examples packed into 1024-token rows, positions restarting
# per example, loss on the answers; 32 rows a step, ~32k real tokens): LazyTrain MILP under 24 GiB with the product's
# defaults beside the uncapped stock Trainer on the same rows; extra.real_tokens_per_s counts the non-pad tokens.
SUITES["recipe"] = dict(device="cuda", models=["qwen2.5-7b"], caps=[24, None], seq_len=1024, steps=5,
                        warmup=LT_WARMUP,
                        systems=["lazytrain_milp", "stock_trainer"], lazytrain=PRODUCT_DEFAULTS,
                        data="packed_examples", tokens_per_step=32768,
                        # the stock Trainer: 8 rows x 4 micro-batches, its largest on an 80 GiB H100 (B=32 needs 105
                        # GiB, B=16 runs out of memory there too: recipe-20261205.json, recipe-pair-20261205.json)
                        batch={24: {"lazytrain_milp": [32], "stock_trainer": []},
                               None: {"lazytrain_milp": [], "stock_trainer": [8]}},
                        timeout={"lazytrain_milp": 480, "stock_trainer": 300}, row_s={24: 240, None: 150})
SUITES["recipe-smoke"] = dict(device="cpu", models=["qwen3-tiny"], caps=[None], seq_len=256, steps=1, warmup=1,
                              systems=["lazytrain_milp", "stock_trainer"], lazytrain=PRODUCT_DEFAULTS,
                              data="packed_examples", batch={None: {"lazytrain_milp": [2], "stock_trainer": [2]}},
                              timeout={"lazytrain_milp": 240, "stock_trainer": 240})
SUITES["full"] = dict(SUITES["7b"], models=["qwen2.5-3b", "qwen2.5-7b", "qwen3-8b"], caps=[24, 80, None],
                      batch={**SUITES["7b"]["batch"],
                             None: {**{s: [64, 128] for s in LT}, "stock_trainer": [8, 16, 32],
                                    "stock_trainer_bnb8": [8, 16, 32], **{s: [8] for s in OFFLOAD}}})


def _key(r: dict[str, Any]) -> tuple:
    return (r["system"], r["model"], r["gpu_cap_gib"], r["batch_size"])


def _machine() -> dict[str, Any]:
    """Machine facts without creating a CUDA context in the harness process (nvidia-smi for the GPU)."""
    import platform

    import torch
    import transformers

    m: dict[str, Any] = {"cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()}
    try:
        import psutil

        m["host_memory_gib"] = round(psutil.virtual_memory().total / 1024**3, 1)
    except ImportError:
        pass
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True)
        if q.returncode == 0 and q.stdout.strip():
            name, mib = q.stdout.strip().splitlines()[0].split(", ")
            m.update(gpu=name, gpu_memory_gib=round(float(mib) / 1024, 1))
    return m


class Results:
    """The --out document: header, rows keyed by (system, model, cap, batch), max-batch searches; saved atomically
    after every change."""

    def __init__(self, path: Path, suite: str, command: str) -> None:
        self.path = path
        if path.is_file():
            try:
                self.doc = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SystemExit(f"benchmarks.run: {path} is not a results file ({e}): pass another --out, or "
                                 "move this one away") from None
            if not isinstance(self.doc, dict) or self.doc.get("suite") != suite or "rows" not in self.doc:
                found = self.doc.get("suite") if isinstance(self.doc, dict) else None
                raise SystemExit(f"benchmarks.run: {path} holds suite {found!r}, not {suite!r}: pass another --out "
                                 f"(rows of two suites in one file would mix machines and shapes)")
        else:
            self.doc = {"suite": suite, "date": datetime.date.today().isoformat(), "command": command,
                        "git_commit": git_commit(), "machine": _machine(), "rows": []}
        self.doc.setdefault("commands", [])
        if command not in self.doc["commands"]:
            self.doc["commands"].append(command)
        self.doc.setdefault("max_batch", [])
        self.commit = git_commit()

    def _stamp(self, entry: dict[str, Any]) -> None:
        """A row or search written at another commit than the file's header names its own (extra.git_commit)."""
        if self.commit != self.doc.get("git_commit"):
            entry.setdefault("extra", {})["git_commit"] = self.commit

    def get(self, key: tuple) -> dict[str, Any] | None:
        return next((r for r in self.doc["rows"] if _key(r) == key), None)

    def done(self, key: tuple) -> bool:
        r = self.get(key)
        return r is not None and r["status"] in FINAL

    def put(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            depth = _depth(r["model"])
            if depth is not None:  # also on rows no worker wrote (timeout, crash)
                r.setdefault("extra", {}).setdefault("num_hidden_layers", depth)
            self._stamp(r)
            self.doc["rows"] = [x for x in self.doc["rows"] if _key(x) != _key(r)] + [r]
        self.save()

    def put_max_batch(self, entry: dict[str, Any]) -> None:
        k = (entry["system"], entry["model"], entry["gpu_cap_gib"])
        self._stamp(entry)
        self.doc["max_batch"] = [x for x in self.doc["max_batch"]
                                 if (x["system"], x["model"], x["gpu_cap_gib"]) != k] + [entry]
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        tmp.replace(self.path)


def _depth(model: str) -> int | None:
    try:
        return parse_model(model)[1].get("num_hidden_layers")
    except ValueError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the worker before exec (Linux): SIGKILL it when the harness dies, even by SIGKILL (an outer kill -9, the
    host's OOM killer), which no finally block sees; the worker's own session keeps it out of Ctrl-C's reach."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


#: the module run_process starts (tests substitute a worker that writes a row and then hangs in teardown)
WORKER_MODULE = "benchmarks.worker"


def run_process(spec: dict[str, Any], timeout_s: float, deadline: float, workdir: Path,
                on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Run benchmarks.worker on `spec` in a new process (own session); the rows it wrote, plus rows for the batch
    sizes it did not finish: "timeout" after `timeout_s`, "error"/"oom" when it died; none at the global deadline.
    `on_rows` receives each finished row as soon as the worker writes it (polled every second), so a row survives
    this process being killed while the worker tears down (7b-fixed-b64-fsdp2-20261130.json lost two measured rows to an
    outer `timeout` that fired while a 55 GiB pinned store was being freed)."""
    from .systems import distributed_env

    tag = f"{spec['system']}-{spec['model']}-{spec['gpu_cap_gib']}-{'_'.join(map(str, spec['batch_sizes']))}"
    tag = re.sub(r"[^A-Za-z0-9._-]", "_", tag)  # "qwen3.6-27b:layers=16": files that copy back from the GPU machine
    spec = dict(spec, rows_out=str(workdir / f"{tag}.jsonl"))
    Path(spec["rows_out"]).unlink(missing_ok=True)
    spec_path = workdir / f"{tag}.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    # one GPU per system: a single-process Trainer seeing several GPUs wraps the model in torch DataParallel and
    # trains on per_device_train_batch_size x n_gpu rows (the stock rows of a 2-GPU host once did)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    env["CUDA_VISIBLE_DEVICES"] = "0" if visible is None else visible.split(",")[0]
    if LORA_BASE.get(spec["system"], spec["system"]) in OFFLOAD:
        env.update(distributed_env(_free_port()))
    log = workdir / f"{tag}.log"
    limit = min(timeout_s, deadline - time.time())
    t0 = time.time()
    rows_out = Path(spec["rows_out"])

    def written() -> list[dict[str, Any]]:   # complete lines only: the worker may be mid-append
        text = rows_out.read_text() if rows_out.is_file() else ""
        return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]

    passed = 0
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(spec_path)], env=env,
                                stderr=err, cwd=Path(__file__).resolve().parents[1], start_new_session=True,
                                preexec_fn=_die_with_parent)
        killed: str | None = "interrupted"
        try:
            while True:
                try:
                    rc = proc.wait(timeout=max(0.05, min(1.0, t0 + max(1.0, limit) - time.time())))
                    killed = None
                    break
                except subprocess.TimeoutExpired:
                    rows = written()
                    if on_rows and len(rows) > passed:
                        on_rows(rows[passed:])
                        passed = len(rows)
                    if time.time() >= t0 + max(1.0, limit):
                        killed = "deadline" if limit < timeout_s else "timeout"
                        break
        finally:
            if killed:   # deadline, timeout, or this process interrupted (SIGTERM / Ctrl-C): never orphan a worker
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and what it started
                proc.wait()
                rc = proc.returncode
    rows = written()
    missing = [B for B in spec["batch_sizes"] if B not in {r["batch_size"] for r in rows}]
    if not missing or killed == "deadline":
        return rows
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
    if killed == "timeout":
        status, why = "timeout", f"killed after {timeout_s:.0f} s (per-process --timeout-s); log: {tail}"
    elif rc in (-signal.SIGKILL, 137):
        status, why = "oom", f"process killed by SIGKILL after {time.time() - t0:.0f} s (host out of memory?)"
    else:
        status, why = "error", f"process exited with {rc}: {tail}"
    base = dict(system=spec["system"], model=spec["model"], gpu_cap_gib=spec["gpu_cap_gib"], seq_len=spec["seq_len"])
    for i, B in enumerate(missing):
        rows.append(row(**base, batch_size=B, status=status,
                        reason=why if i == 0 else f"not run: batch {missing[0]} {status}"))
    return rows


def _spec(args: argparse.Namespace, suite: dict[str, Any], system: str, model: str, cap: float | None,
          batch_sizes: list[int], steps: int | None = None, warmup: int | None = None) -> dict[str, Any]:
    spec = dict(system=system, model=model, gpu_cap_gib=cap, batch_sizes=batch_sizes, seq_len=args.seq_len,
                steps=args.steps if steps is None else steps, warmup=args.warmup if warmup is None else warmup,
                device=args.device, data_dir=args.data_dir, zero_stage=args.zero_stage,
                configuration=_configuration(suite))
    if suite.get("tokens_per_step"):
        spec["tokens_per_step"] = suite["tokens_per_step"]
    if suite.get("data"):
        spec["data"] = suite["data"]
    if system in LORA_BASE:
        spec["lora"] = dict(suite.get("lora", LORA_DEFAULTS))
    if system in QLORA_SYSTEMS:
        spec["quantization"] = dict(suite.get("quantization", QLORA_QUANT))
    if spec["configuration"] == HARNESS_SETTINGS:  # the LazyTrain knobs of the 7b / full suites
        spec.update(rows_per_pass=args.rows_per_pass, checkpoint_every=4, master_weights="kahan",
                    loss_chunk_tokens=2048, embedding_states=args.embedding_states,
                    keep_gpu_grads=not args.no_kept_grads)
    return spec


def _configuration(suite: dict[str, Any]) -> str:
    """How a suite's LazyTrain rows are configured: PRODUCT_DEFAULTS or HARNESS_SETTINGS (benchmarks/systems.py)."""
    return suite.get("lazytrain", HARNESS_SETTINGS)


def _min_start(args: argparse.Namespace, suite: dict[str, Any], cap: float | None, system: str | None = None) -> float:
    return max(args.min_start_s, suite.get("system_row_s", {}).get(system, suite.get("row_s", {}).get(cap, 0)))


def _systems_of(suite: dict[str, Any], model: str, systems: list[str]) -> list[str]:
    """The systems of `systems` that run on `model` (the suite's model_systems; default all)."""
    return [s for s in systems if s in suite.get("model_systems", {}).get(model, systems)]


def _sizes(args: argparse.Namespace, suite: dict[str, Any], system: str, cap: float | None) -> list[int]:
    """The batch sizes to measure: --batch-sizes, else the suite's for (cap, system) ([] there: none), else [8]."""
    return args.batch_sizes or suite["batch"].get(cap, {}).get(system, [8])


def measure(args: argparse.Namespace, suite: dict[str, Any], res: Results, system: str, model: str,
            cap: float | None, deadline: float, workdir: Path, sizes: list[int] | None = None) -> None:
    """Rows of `system` at `cap` for `sizes` (default `_sizes`), each (system, model, cap, batch) done once."""
    sizes = _sizes(args, suite, system, cap) if sizes is None else sizes
    todo = [B for B in sorted(sizes) if not res.done((system, model, cap, B))]
    if not todo:
        return
    reason = unsupported_reason(system, args.device, check_imports=False)
    if reason:
        res.put([row(system=system, model=model, gpu_cap_gib=cap, batch_size=B, seq_len=args.seq_len,
                     status="unsupported", reason=reason) for B in todo])
        return
    groups = [[B] for B in todo] if system in ONE_BATCH_PER_PROCESS else [todo]
    for group in groups:
        if time.time() > deadline - _min_start(args, suite, cap, system):
            print(f"budget: not starting {system} {model} cap={cap} B={group}", flush=True)
            return
        rows = run_process(_spec(args, suite, system, model, cap, group), args.timeout_s or suite["timeout"][system],
                           deadline, workdir, on_rows=res.put)
        res.put(rows)
        for r in rows:
            if r["status"] != "ok" or system in ONE_BATCH_PER_PROCESS:
                print(fmt_row(r), flush=True)


#: the reason of a probe that trained only because LazyTrain recovered from running out of GPU memory
RECOVERED = "ran only after an out-of-memory recovery"


def probe_outcome(r: dict[str, Any]) -> tuple[bool | None, str | None]:
    """(feasible, reason) of a max-batch probe's row: feasible = trained with no out-of-memory recovery in its run
    (extra.oom_recoveries, warm-up included; LazyTrainer.oom_recoveries); out of memory, a timeout or a recovery:
    infeasible; anything else (an error, the deadline): None, the search cannot go on."""
    if ((r.get("extra") or {}).get("oom_recoveries") or 0) > 0:
        return False, RECOVERED
    if r["status"] == "ok":
        return True, None
    if r["status"] in ("oom", "timeout"):
        return False, r.get("reason")
    return None, r.get("reason")


def search_max_batch(probe: Callable[[int], bool | None], lo: int = 0, hi: int | None = None, limit: int = 512,
                     resolution: float = 0.0, progress: Callable[[int, int | None], None] | None = None,
                     guess: int | None = None) -> tuple[int, int | None, bool]:
    """The largest batch `probe` finds feasible: doubling from `lo` (the largest known feasible batch, 0: none)
    up to `limit` until a size is infeasible, then bisection between the largest feasible and the smallest
    infeasible (`hi`, None: none known) until they are adjacent, or hi - lo <= lo x `resolution`.

    `guess` (the planner's largest batch, `planned_max_batch`): probed first, then sizes away from it at offsets
    1, 2, 4, ... (above it while it is feasible, below while it is not), then bisection: a right guess settles the
    search in two probes, one off by k in about 2 log2(k) + 2.

    `probe(B)`: True feasible, False infeasible, None stop (an error, the budget); `progress(lo, hi)` is called
    after each probe that decided. Returns (largest feasible, 0 if none; smallest infeasible or None; complete:
    False when a probe stopped the search)."""

    def open_(B: int) -> bool:  # not yet decided, within the limit
        return lo < B <= limit and (hi is None or B < hi)

    while True:
        up = None if guess is None or lo < guess else min(limit, lo + max(1, lo - guess))
        down = None if guess is None or hi is None or hi > guess else hi - max(1, guess - hi)
        if guess is not None and open_(guess):
            B = guess
        elif up is not None and open_(up):
            B = up
        elif down is not None and open_(down):
            B = down
        elif hi is None:
            if lo >= limit:
                return lo, hi, True
            B = min(limit, max(1, lo * 2))
        elif hi - lo <= max(1, int(lo * resolution)):
            return lo, hi, True
        else:
            B = (lo + hi) // 2
        ok = probe(B)
        if ok is None:
            return lo, hi, False
        if ok:
            lo = B
        else:
            hi = B
        if progress is not None:
            progress(lo, hi)


def find_max_batch(args: argparse.Namespace, suite: dict[str, Any], res: Results, system: str, model: str,
                   cap: float | None, deadline: float, workdir: Path) -> None:
    """Largest batch that trains (1 warm-up + 1 timed step per probe, each its own process; `search_max_batch`,
    `probe_outcome`). Known rows and the probes of an unfinished search in --out seed the bounds; the entry is saved
    after every probe, so a search longer than one call resumes where it stopped."""
    key = (system, model, cap)
    entry = next((x for x in res.doc["max_batch"] if (x["system"], x["model"], x["gpu_cap_gib"]) == key), None)
    limit = args.max_batch_limits.get(system, args.max_batch_limit)
    if entry is not None and entry.get("complete") and entry.get("limit") == limit:
        return
    if unsupported_reason(system, args.device, check_imports=False):
        return
    probes: list[dict[str, Any]] = list(entry["probes"]) if entry else []
    known = [r for r in res.doc["rows"] if (r["system"], r["model"], r["gpu_cap_gib"]) == key
             and not str(r["reason"]).startswith("not run")]
    judged = [(r["batch_size"], probe_outcome(r)[0]) for r in known if r["status"] in ("ok", "oom")] + \
        [(p["batch_size"], p["feasible"]) for p in probes if p.get("feasible") is not None]
    lo = max((B for B, ok in judged if ok), default=0)
    hi = min((B for B, ok in judged if ok is False and B > lo), default=None)
    timeout = args.timeout_s or suite["timeout"][system]
    guess = entry.get("planned") if entry else None
    if guess is None and suite.get("max_batch_guess") and system in LT:
        guess = planned_max_batch(system, model, cap, suite["seq_len"], limit)

    def save(lo: int, hi: int | None, complete: bool) -> None:
        res.put_max_batch({"system": system, "model": model, "gpu_cap_gib": cap, "max_batch": lo or None,
                           "first_infeasible": hi, "limit": limit, "complete": complete, "planned": guess,
                           "probes": probes})

    def probe(B: int) -> bool | None:
        if time.time() > deadline - _min_start(args, suite, cap, system):
            print(f"budget: max-batch search of {system} cap={cap} stopped before B={B}", flush=True)
            return None
        rows = run_process(_spec(args, suite, system, model, cap, [B], steps=1, warmup=1), timeout, deadline,
                           workdir)
        r = rows[0] if rows else row(system=system, batch_size=B, status="deadline", reason="killed at the deadline")
        ok, reason = probe_outcome(r)
        probes.append({"batch_size": B, "status": r["status"], "feasible": ok, "reason": reason,
                       "oom_recoveries": (r.get("extra") or {}).get("oom_recoveries"), "step_s": r["step_s_median"],
                       "tflops_6nd": r["tflops_6nd"], "peak_gpu_gib": r["peak_gpu_gib"]})
        print(f"max-batch probe {system} cap={cap} B={B}: {r['status']}"
              + ("" if ok is None else " (feasible)" if ok else f" (infeasible: {str(reason)[:120]})"), flush=True)
        return ok

    rival = suite.get("max_batch_against", {}).get(system)
    top = searched_max_batch(res, rival, model, cap) if rival else None
    if top is not None and lo < top and (hi is None or hi > top):  # decide the claim against the rival first
        ok = probe(top)
        if ok is None:
            save(lo, hi, False)
            return
        lo, hi = (top, hi) if ok else (lo, top)
        save(lo, hi, False)
    lo, hi, complete = search_max_batch(probe, lo, hi, limit, args.max_batch_resolution,
                                        progress=lambda lo, hi: save(lo, hi, False), guess=guess)
    save(lo, hi, complete)


def planned_max_batch(system: str, model: str, cap: float | None, seq_len: int, limit: int) -> int | None:
    """The planner's largest feasible batch for a LazyTrain system (`lazytrain-hf plan --max-batch`: the analytic
    costs, this machine's hardware profile, the product's defaults, `cap` GiB of GPU), the search's first probe;
    None when it has none (no plan at batch 1, or the plan command failed)."""
    import contextlib
    import io

    from lazytrain_hf import cli_plan

    name, overrides = model_overrides(model)
    policy = {"lazytrain_milp": "milp", "lazytrain_fixed": "fixed"}.get(system)
    if policy is None:
        return None
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as d:
        target = name
        if overrides:  # a reduced-depth harness model: its config on disk, as a user's local model would be
            from lazytrain_hf.models import resolve_config

            resolve_config(name, **overrides).save_pretrained(d)
            target = d
        argv = ["--model", target, "--batch-size", "1", "--seq-len", str(seq_len), "--policy", policy,
                "--max-batch", str(limit)] + ([] if cap is None else ["--gpu-memory", f"{cap}GiB"])
        p = argparse.ArgumentParser()
        cli_plan.add_arguments(p)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = cli_plan.run(p.parse_args(argv))
    m = re.search(r"largest feasible batch \([a-z]+, seq \d+\): (\d+)", out.getvalue())
    guess = int(m.group(1)) if rc == 0 and m else None
    print(f"max-batch search {system} {model} cap={cap}: the planner's largest batch {guess}", flush=True)
    return guess or None


def searched_max_batch(res: Results, system: str, model: str, cap: float | None) -> int | None:
    """The largest feasible batch of a completed search in `res` (None: no search, unfinished, or none feasible)."""
    e = next((x for x in res.doc["max_batch"] if (x["system"], x["model"], x["gpu_cap_gib"]) == (system, model, cap)),
             None)
    return e["max_batch"] if e is not None and e.get("complete") else None


def _parse_caps(s: str) -> list[float | None]:
    return [None if c.strip().lower() in ("none", "uncapped", "0") else float(c) if "." in c else int(c)
            for c in s.split(",")]


DEFAULT_MARGIN = LazyTrainConfig.gpu_memory_margin  # LazyTrain's, when HARNESS_GPU_MEMORY_MARGIN is unset

#: the harness's A/B and profiling switches (environment, read in the workers) -> (type, range, what it takes);
#: the range is [lo, hi] for integers (hi None: open) and [lo, hi) for fractions
SWITCHES = {"HARNESS_SLOT_REUSE": (int, 0, 1, "0 or 1"), "HARNESS_PROFILE_STEP": (int, 0, None, "an integer >= 0"),
            "HARNESS_CALIBRATE_STEPS": (int, 0, None, "an integer >= 0"),
            "HARNESS_GPU_MEMORY_MARGIN": (float, 0.0, 0.9, "a fraction in [0, 0.9), as gpu_memory_margin")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), required=True)
    p.add_argument("--systems", type=lambda s: s.split(","), default=None, help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--caps", type=_parse_caps, default=None, help="GPU caps in GiB, e.g. 24,80,none")
    p.add_argument("--models", type=lambda s: s.split(","), default=None)
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="override the suite's per-system batch sizes")
    p.add_argument("--find-max-batch", action="store_true")
    p.add_argument("--skip-max-batch", action="store_true",
                   help="measure the suite's batch sizes only, not its largest-batch searches (max_batch_caps)")
    p.add_argument("--max-batch-limit", type=int, default=None, help="default: the suite's, else 512")
    p.add_argument("--max-batch-resolution", type=float, default=0.0,
                   help="bisection stops at hi-lo <= max(1, lo x this); default 0: adjacent batch sizes")
    p.add_argument("--steps", type=int, default=None, help="timed steps (suite default)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps, not timed (suite default)")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--timeout-s", type=float, default=None, help="per-process limit (suite default per system)")
    p.add_argument("--budget-s", type=float, default=None, help="stop starting work, and kill at, this many seconds")
    p.add_argument("--min-start-s", type=float, default=45.0, help="do not start a process with less time left")
    p.add_argument("--embedding-states", choices=["8bit", "fp32"], default=None,
                   help="LazyTrain rows of the harness's settings: embedding / lm_head optimizer states (default 8bit)")
    p.add_argument("--rows-per-pass", type=int, default=None,
                   help="LazyTrain rows of the harness's settings: lazytrain_config.max_rows_per_pass (sequences per "
                        "layer pass; default 8)")
    p.add_argument("--zero-stage", type=int, choices=[2, 3], default=3)
    p.add_argument("--no-kept-grads", action="store_true",
                   help="LazyTrain rows: lazytrain_config.keep_gpu_grads=False (every gradient goes to the host)")
    p.add_argument("--data-dir", default=None,
                   help="GSM8K folder (default: LAZYTRAIN_GSM8K_DIR, else <repo>/../shared/data/gsm8k)")
    p.add_argument("--out", required=True)
    p.add_argument("--log-dir", default=None,
                   help="keep each worker process's log (stderr) here, named by system-model-cap-batches; default: "
                        "a temporary folder, removed at the end")
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    if _configuration(suite) == PRODUCT_DEFAULTS:
        # a setting the product's defaults do not have would make these rows something a user does not run
        given = [flag for flag, v in (("--rows-per-pass", args.rows_per_pass), ("--embedding-states",
                                      args.embedding_states), ("--no-kept-grads", args.no_kept_grads or None))
                 if v is not None]
        given += [f"environment {k}" for k in ("HARNESS_CALIBRATE_STEPS", "HARNESS_GPU_MEMORY_MARGIN",
                                                "HARNESS_SLOT_REUSE") if k in os.environ]
        if given:
            p.error(f"suite {args.suite} runs LazyTrain with the product's defaults; {', '.join(given)} would change "
                    "them: leave it out (the 7b and full suites take it)")
    args.rows_per_pass = 8 if args.rows_per_pass is None else args.rows_per_pass
    if args.max_batch_limit is None:
        args.max_batch_limit = suite.get("max_batch_limit", 512)
    if isinstance(args.max_batch_limit, dict):  # per system (the suite's), 512 for the others
        args.max_batch_limits, args.max_batch_limit = dict(args.max_batch_limit), 512
    else:
        args.max_batch_limits = {}
    args.embedding_states = args.embedding_states or "8bit"
    for k in ("steps", "warmup", "seq_len", "device"):
        if getattr(args, k) is None:
            setattr(args, k, suite[k])
    for k in ("steps", "seq_len"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1 (got {getattr(args, k)})")
    if args.warmup < 0:
        p.error(f"--warmup must be at least 0 (got {args.warmup})")
    if args.rows_per_pass < 1:
        p.error(f"--rows-per-pass must be at least 1 (got {args.rows_per_pass})")
    if any(B < 1 for B in args.batch_sizes or []):
        p.error(f"every --batch-sizes entry must be at least 1 (got {args.batch_sizes})")
    for k in ("budget_s", "timeout_s"):   # 0 would silently mean "none" / "the suite default"
        if getattr(args, k) is not None and getattr(args, k) <= 0:
            p.error(f"--{k.replace('_', '-')} must be positive seconds (got {getattr(args, k)}); leave it out for "
                    f"{'no budget' if k == 'budget_s' else 'the suite default'}")
    if any(c is not None and c < 0 for c in args.caps or []) or args.max_batch_limit < 1 \
            or args.max_batch_resolution < 0:
        p.error("--caps must be GiB > 0 (or none), --max-batch-limit at least 1, --max-batch-resolution >= 0")
    if Path(args.out).is_dir():
        p.error(f"--out {args.out} is a folder: pass a JSON file path, e.g. {Path(args.out) / 'results.json'}")
    bad = set(args.systems or []) - set(SYSTEMS)
    if bad:
        p.error(f"unknown systems {sorted(bad)}; known: {', '.join(SYSTEMS)}")
    from lazytrain_hf.models import ARCHITECTURES

    # registry names, local model folders and Hub ids (owner/name), each optionally :layers=N, are what a worker can
    # build; anything else would only fail inside the worker after its imports, as an error row
    unknown = []
    for m in args.models or []:
        try:
            name, opts = parse_model(m)
        except ValueError as e:
            p.error(str(e))
        if not name or (name not in ARCHITECTURES and not Path(name).is_dir() and "/" not in name):
            unknown.append(m)
        elif opts and name in ARCHITECTURES:
            try:
                depth_overrides(name, opts["num_hidden_layers"])
            except ValueError as e:
                p.error(str(e))
    if unknown:
        p.error(f"unknown models {unknown}: use registry names ({', '.join(sorted(ARCHITECTURES))}), a local model "
                "folder or a Hub id, optionally with :layers=N (its first N decoder layers, e.g. qwen3.6-27b:layers=16)")
    # the harness's A/B and profiling switches are read in the workers: refuse bad values here, before any row runs
    for name, (kind, lo, hi, what) in SWITCHES.items():
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            val = kind(raw)
        except ValueError:
            val = lo - 1
        if not lo <= val or (hi is not None and (val > hi if kind is int else val >= hi)):
            p.error(f"environment {name}={raw!r}: must be {what}; unset it for the default")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda (the 7b and full suites' default) but no CUDA device is visible: run on the GPU "
                    "machine, or pass --device cpu (the smoke suite's default)")
    return args


def _env_settings() -> list[str]:
    """The environment settings that change what a row measures (LazyTrain's overrides, the slot-reuse A/B, the
    CUDA allocator's configuration), as `NAME=value` words for the recorded command; paths and the commit stamp are
    left out."""
    skip = {"LAZYTRAIN_GSM8K_DIR", "LAZYTRAIN_GIT_COMMIT"}
    return [f"{k}={os.environ[k]}" for k in sorted(os.environ)
            if (k.startswith("LAZYTRAIN_") and k not in skip) or k in SWITCHES or k == "PYTORCH_CUDA_ALLOC_CONF"]


def main(argv: list[str] | None = None, started: float | None = None) -> Results:
    """The harness. `started`: when --budget-s starts counting (epoch seconds; default now). The command line passes
    the process's start, so that the ~20 s of imports count against a budget sized to a fixed device call."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    suite = SUITES[args.suite]
    try:  # before any worker starts: every system reads the same token rows
        gsm8k_dir(args.data_dir)
    except FileNotFoundError as e:
        raise SystemExit(f"benchmarks.run: {e}") from None
    deadline = (started or time.time()) + (args.budget_s or 1e9)
    res = Results(Path(args.out), args.suite, " ".join([*_env_settings(), "python -m benchmarks.run", *argv]))
    other_seq = sorted({r["seq_len"] for r in res.doc["rows"]} - {args.seq_len, None})
    if other_seq:   # rows are keyed by system, model, cap and batch: a resume would keep them as if measured now
        raise SystemExit(f"benchmarks.run: {args.out} holds rows at seq_len {other_seq}, not {args.seq_len}: pass "
                         "another --out, or the same --seq-len to resume it")
    configuration = _configuration(suite)
    lt_rows = [r for r in res.doc["rows"] if str(r["system"]).startswith("lazytrain") and r["status"] != "unsupported"]
    other_conf = sorted({(r.get("extra") or {}).get("configuration") or HARNESS_SETTINGS for r in lt_rows
                         if (r.get("extra") or {}).get("lazytrain_config")} - {configuration})
    if other_conf:  # rows written before `configuration` was recorded ran the harness's settings
        raise SystemExit(f"benchmarks.run: {args.out} holds LazyTrain rows run with {other_conf}, not "
                         f"{configuration!r}: pass another --out")
    # (lazytrain_config key, this run's value, its flag, the value of a LazyTrain row that lacks the key: rows
    # written before keep_gpu_grads existed kept no gradients on the GPU; the margin is recorded only when set)
    margin = os.environ.get("HARNESS_GPU_MEMORY_MARGIN")
    for key, value, flag, missing in () if configuration == PRODUCT_DEFAULTS else (
            ("max_rows_per_pass", args.rows_per_pass, f"--rows-per-pass {args.rows_per_pass}", None),
            ("keep_gpu_grads", not args.no_kept_grads,
             "--no-kept-grads" if args.no_kept_grads else "kept gradients (no --no-kept-grads)", False),
            ("gpu_memory_margin", float(margin) if margin else DEFAULT_MARGIN,
             f"HARNESS_GPU_MEMORY_MARGIN={margin}" if margin else f"the default margin {DEFAULT_MARGIN}",
             DEFAULT_MARGIN)):
        configs = [(r.get("extra") or {}).get("lazytrain_config") for r in res.doc["rows"]]
        other = sorted({c.get(key, missing) for c in configs if isinstance(c, dict)} - {value, None}, key=str)
        if other:  # the same reason, for LazyTrain rows
            raise SystemExit(f"benchmarks.run: {args.out} holds LazyTrain rows with {key}={other}, not {flag}: "
                             "pass another --out, or the same setting to resume it")
    systems = [s for s in (*ORDER, *LORA, *QLORA, *SFT) if s in (args.systems or suite.get("systems") or ORDER)]
    searched = []
    with tempfile.TemporaryDirectory(prefix="bench-run-") as tmp:
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            tmp = args.log_dir
        for model in args.models or suite["models"]:
            for cap in suite["caps"] if args.caps is None else args.caps:
                for system in _systems_of(suite, model, systems):
                    measure(args, suite, res, system, model, cap, deadline, Path(tmp))
                    if args.find_max_batch or (cap in suite.get("max_batch_caps", ()) and not args.skip_max_batch
                                               and system in suite.get("max_batch_systems", systems)):
                        find_max_batch(args, suite, res, system, model, cap, deadline, Path(tmp))
                        searched.append((system, model, cap))
                        top = searched_max_batch(res, system, model, cap) if suite.get("measure_max_batch") else None
                        if top is not None:
                            measure(args, suite, res, system, model, cap, deadline, Path(tmp), sizes=[top])
    planned = [(s, m, c, B) for m in args.models or suite["models"]
               for c in (suite["caps"] if args.caps is None else args.caps) for s in _systems_of(suite, m, systems)
               for B in _sizes(args, suite, s, c)]
    if suite.get("measure_max_batch"):  # the searched largest batches, measured
        planned += [(s, m, c, top) for s, m, c in searched if (top := searched_max_batch(res, s, m, c)) is not None]
    left = [k for k in planned if not res.done(k)]
    left += [k for k in searched if not any((x["system"], x["model"], x["gpu_cap_gib"]) == k and x.get("complete")
                                            for x in res.doc["max_batch"])]
    subset = any(x is not None for x in (args.systems, args.caps, args.models, args.batch_sizes))
    print(f"{len(res.doc['rows'])} rows in {args.out}; " +
          (("all requested rows done (a subset of the suite)" if subset else "suite complete") if not left
           else f"REMAINING {len(left)} (rows error/timeout/not run, or unfinished max-batch searches): run the same "
           "command again with the same --out to resume"), flush=True)
    return res


if __name__ == "__main__":
    import psutil  # an accelerate dependency

    # SIGTERM (an outer `timeout`) unwinds like Ctrl-C: run_process kills its worker, rows already saved stay saved
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main(started=psutil.Process().create_time())
