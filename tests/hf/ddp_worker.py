"""Trains a tiny model with LazyTrainer for a few steps and saves its parameters and log (one file per rank).

Run alone (one process) or under `python -m torch.distributed.run --nproc_per_node N`; tests/hf/test_ddp.py compares
the two. Not a test module itself (pytest collects test_*.py only).

    python tests/hf/ddp_worker.py --out DIR --per-device-batch 4 [--device cpu|cuda] [--steps 3] [--ga 1,2]

Writes DIR/rank<R>_ga<G>.pt: {"params": name -> tensor, "logs": Trainer log rows with a loss, "world": N}.
"""

from __future__ import annotations

import argparse
import os

import torch
from tiny_data import tiny_dataset  # this script's folder is on sys.path

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.models import load_model

SEQ = 20


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-pads to a fixed SEQ so every rank's micro-batch has the single-process run's row shape."""
    pad = lambda key, v: torch.tensor([r[key] + [v] * (SEQ - len(r[key])) for r in rows])  # noqa: E731
    return {"input_ids": pad("input_ids", 0), "attention_mask": pad("attention_mask", 0), "labels": pad("labels", -100)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--per-device-batch", type=int, required=True)
    p.add_argument("--ga", default="1,2,2n,2ns", help="gradient accumulation steps, one run each; suffix n: "
                   "average_tokens_across_devices=False; suffix s: the stock Trainer (policy none, adamw_torch)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--arch", default="qwen3-tiny")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    for tag in a.ga.split(","):
        train(a, tag)


def train(a: argparse.Namespace, tag: str) -> None:
    ga, average_tokens, stock = int(tag.rstrip("ns")), "n" not in tag, "s" in tag
    model = load_model(a.arch, "float32", seed=3)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = a.per_device_batch * world * ga * a.steps  # exactly one epoch of the global batch
    args = LazyTrainingArguments(
        output_dir=os.path.join(a.out, f"run{tag}"), per_device_train_batch_size=a.per_device_batch,
        gradient_accumulation_steps=ga, max_steps=a.steps, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=0.5,
        lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[], use_cpu=a.device == "cpu",
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        average_tokens_across_devices=average_tokens, **({"optim": "adamw_torch"} if stock else {}),
        lazytrain_config={"policy": "none"} if stock else
        {"state_dtype": "fp32", "master_weights": "none", "checkpoint_every": 2, "loss_chunk_tokens": 16,
         "max_rows_per_pass": 2, "device": a.device})
    trainer = LazyTrainer(model=model, args=args, train_dataset=tiny_dataset(model.config.vocab_size, n),
                          data_collator=collate)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    params = {k: v.detach().cpu().clone() for k, v in model.named_parameters()}
    logs = [h for h in trainer.state.log_history if "loss" in h]
    torch.save({"params": params, "logs": logs, "world": trainer.args.world_size},
               os.path.join(a.out, f"rank{rank}_ga{tag}.pt"))
    if trainer.executor is not None:
        trainer.executor.close()


if __name__ == "__main__":
    main()
