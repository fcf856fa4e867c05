"""Interrupts a data-parallel LazyTrainer run with SIGTERM on one rank and resumes it (tests/hf/test_longruns.py).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/hf/interrupt_worker.py --out DIR

Three runs of a tiny model, 6 steps, a checkpoint every 2 steps, sharded optimizer updates (the save gathers the
states from their owners, so ranks that disagree on saving would hang):

- ``ref``: uninterrupted.
- ``term``: SIGTERM reaches rank 1 only, during step 3; then a second trainer resumes (resume_from_checkpoint=True)
  and trains to the end.
- ``grace``: interrupt_grace_period 30 s on a clock the worker advances: rank 1's checkpoint saves take 50 s on it,
  rank 0's none; SIGTERM reaches rank 0 only, during step 3 (no save fits: the ranks must agree on that from rank
  1's estimate); then a resume to the end.

- ``full0`` / ``full1``: the disk fills during checkpoint-2's save on rank 0 (its model file) / rank 1 (its RNG
  file): both ranks log one error and train on; checkpoint-4 and checkpoint-6 are saved.

Writes DIR/rank<R>.pt: run -> {"logs": step -> loss (the resumed trainer's, from the step after its checkpoint),
"stopped_at", "interrupted", "interrupt_checkpoint", "files": the run directory's entries after the stop,
"params": the final parameters}.

With ``--launcher-term`` it runs one training only: rank 1 sends SIGTERM to its parent, the torchrun launcher, during
step 3; the launcher passes SIGTERM to every rank (and kills them 30 s later); DIR/launcher<R>.pt gets the row.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal

import torch
from tiny_data import tiny_dataset  # this script's folder is on sys.path
from transformers import Trainer, TrainerCallback
from worker_exit import exit_worker  # this script's folder is on sys.path

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model

SEQ, STEPS, BATCH, GA = 20, 6, 2, 2
RANK = int(os.environ.get("RANK", "0"))


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    pad = lambda key, v: torch.tensor([r[key] + [v] * (SEQ - len(r[key])) for r in rows])  # noqa: E731
    return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0), "labels": pad("labels", -100)}


class Clock:
    """A clock the worker advances (the grace period and save timing read it)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class SigtermAt(TrainerCallback):
    """SIGTERM during step `step`, on rank `rank` only, to process `pid` (default: this one)."""

    def __init__(self, rank: int, step: int, pid: int | None = None) -> None:
        self.rank, self.step, self.pid = rank, step, pid

    def on_step_begin(self, args, state, control, **kwargs):
        if RANK == self.rank and state.global_step == self.step - 1:
            os.kill(self.pid or os.getpid(), signal.SIGTERM)


def trainer(out: str, grace: str | None = None, callbacks: tuple = ()) -> LazyTrainer:
    model = load_model("qwen3-tiny", "float32", seed=3)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    lazy = {"state_dtype": "fp32", "master_weights": "none", "checkpoint_every": 2, "loss_chunk_tokens": 16,
            "max_rows_per_pass": 2, "device": "cpu", "dp_updates": "sharded"}
    if grace:
        lazy["interrupt_grace_period"] = grace
    args = LazyTrainingArguments(
        output_dir=out, per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, max_steps=STEPS,
        learning_rate=1e-3, weight_decay=0.1, max_grad_norm=0.5, lr_scheduler_type="linear", logging_steps=1,
        report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        save_strategy="steps", save_steps=2, lazytrain_config=lazy)
    ds = tiny_dataset(model.config.vocab_size, BATCH * world * GA * STEPS)
    return LazyTrainer(model=model, args=args, train_dataset=ds, data_collator=collate, callbacks=list(callbacks))


def losses(tr: LazyTrainer, after: int = 0) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in tr.state.log_history if "loss" in h and h["step"] > after}


def params(tr: LazyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.named_parameters()}


def stop_row(tr: LazyTrainer, out: str) -> dict:
    torch.distributed.barrier()  # every rank's files are written before the listing
    return {"stopped_at": tr.state.global_step, "interrupted": tr.interrupted,
            "interrupt_checkpoint": tr.interrupt_checkpoint, "files": sorted(os.listdir(out))}


def launcher_term(out: str) -> None:
    tr = trainer(os.path.join(out, "launcher"), callbacks=(SigtermAt(1, 3, pid=os.getppid()),))
    tr.train()
    torch.save(stop_row(tr, os.path.join(out, "launcher")), os.path.join(out, f"launcher{RANK}.pt"))


def runs(out_dir: str) -> None:
    res: dict[str, dict] = {}

    tr = trainer(os.path.join(out_dir, "ref"))
    tr.train()
    res["ref"] = {"logs": losses(tr), "params": params(tr)}
    tr.executor.close()

    for run, grace, signal_rank in (("term", None, 1), ("grace", "30s", 0)):
        out = os.path.join(out_dir, run)
        clock = Clock()
        orig = Trainer._save_checkpoint

        def slow(self, model, trial, orig=orig, clock=clock):
            orig(self, model, trial)
            if RANK == 1:
                clock.t += 50.0

        Trainer._save_checkpoint = slow
        try:
            tr = trainer(out, grace, (SigtermAt(signal_rank, 3),))
            tr.longrun.clock = clock
            tr.train()
        finally:
            Trainer._save_checkpoint = orig
        row = stop_row(tr, out)
        tr.executor.close()
        resumed = trainer(out, grace)
        resumed.train(resume_from_checkpoint=True)
        start = int(os.path.basename(tr.interrupt_checkpoint).split("-")[-1])
        res[run] = {**row, "logs": losses(resumed, after=start), "params": params(resumed),
                    "resumed_interrupted": resumed.interrupted}
        resumed.executor.close()
    for run, rank, method in (("full0", 0, "_save"), ("full1", 1, "_save_rng_state")):
        out = os.path.join(out_dir, run)
        orig = getattr(Trainer, method)

        def full(self, output_dir=None, *a, orig=orig, rank=rank, **k):
            if RANK == rank and self.state.global_step == 2:
                os.makedirs(output_dir, exist_ok=True)
                with open(os.path.join(output_dir, "partial.bin"), "wb") as f:
                    f.write(b"partial")
                raise OSError(errno.ENOSPC, "No space left on device", output_dir)
            return orig(self, output_dir, *a, **k)

        setattr(Trainer, method, full)
        try:
            tr = trainer(out)
            tr.train()
        finally:
            setattr(Trainer, method, orig)
        res[run] = {**stop_row(tr, out), "logs": losses(tr), "params": params(tr)}
        tr.executor.close()
    torch.save(res, os.path.join(out_dir, f"rank{RANK}.pt"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--launcher-term", action="store_true")
    a = p.parse_args()
    if a.launcher_term:
        launcher_term(a.out)
    else:
        runs(a.out)
    exit_worker()


if __name__ == "__main__":
    main()
