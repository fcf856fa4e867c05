"""Optimizer-precision quality check: the same model, init and GSM8K token rows trained for --steps steps with each
master-weight / state configuration of LazyTrain's Hybrid8 optimizer (token ids folded modulo --vocab, the model
built with that vocabulary: CPU-sized), against fp32 everything (fp32 weights, the stock Trainer's torch AdamW). It
decides whether a leaner default (Kahan bf16 master weights, 8-bit embedding / LM-head states) trains as well as
the fp32 masters and fp32 embedding states it would replace.

    python -m benchmarks.quality --out benchmarks/results/quality-YYYYMMDD.json [--steps 300] [--model qwen3-tiny-vocab]

Rows (system = configuration): `fp32_reference` (fp32 weights, Trainer + adamw_torch), and LazyTrainer on bf16
weights with bf16=True: `default` (the product's defaults at the file's commit), `fp32_master` (master_weights
fp32), `kahan_8bit_resident` (master_weights kahan, resident_state_dtype 8bit), `kahan` (kahan, fp32 resident
states), `bf16_no_master` (master_weights none: updates rounded to bf16, the failure this check must be able to
see), `stochastic` (master_weights stochastic: no master copy, bf16 written with stochastic rounding). Each row's extra holds the training loss every --log-every steps, the mean of the last 50 steps' losses, the
held-out loss (GSM8K test rows) at the start and the end, and the final parameters' distance from the reference's
(every configuration starts from the bf16 rounding of one init, so the distance is the optimizer's). lr 1e-5,
weight decay 0.01, clip 1.0, constant schedule, as the paper's runs.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import git_commit, gsm8k_token_rows

#: configuration -> (weights dtype, lazytrain_config extras or None for the stock Trainer, optim)
CONFIGS: dict[str, tuple[torch.dtype, dict[str, Any] | None, str]] = {
    "fp32_reference": (torch.float32, None, "adamw_torch"),
    "default": (torch.bfloat16, {}, "lazytrain_hybrid8"),
    "fp32_master": (torch.bfloat16, {"master_weights": "fp32"}, "lazytrain_hybrid8"),
    "kahan_8bit_resident": (torch.bfloat16, {"master_weights": "kahan", "resident_state_dtype": "8bit"},
                            "lazytrain_hybrid8"),
    "kahan": (torch.bfloat16, {"master_weights": "kahan"}, "lazytrain_hybrid8"),
    "bf16_no_master": (torch.bfloat16, {"master_weights": "none"}, "lazytrain_hybrid8"),
    "stochastic": (torch.bfloat16, {"master_weights": "stochastic"}, "lazytrain_hybrid8"),
}


class Rows(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, rows: torch.Tensor, device: str) -> float:
    """Mean token loss of `rows` in fp32 compute on `device` (a copy of the model: the trained one is left as is)."""
    m = copy.deepcopy(model).float().to(device).eval()
    loss = float(sum(m(input_ids=r[None].to(device), labels=r[None].to(device)).loss for r in rows) / len(rows))
    del m
    return loss


def run_config(name: str, base: torch.nn.Module, train: torch.Tensor, held: torch.Tensor, args: argparse.Namespace,
               out_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from transformers import Trainer, TrainingArguments

    from lazytrain_hf import LazyTrainer, LazyTrainingArguments

    dtype, lazy, optim = CONFIGS[name]
    model = copy.deepcopy(base).to(dtype)
    common = dict(output_dir=os.path.join(out_dir, name), per_device_train_batch_size=args.batch_size,
                  max_steps=args.steps, learning_rate=1e-5, weight_decay=0.01, max_grad_norm=1.0,
                  lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[],
                  use_cpu=args.device == "cpu", seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
                  optim=optim)
    start = held_out_loss(model, held, args.device)
    t0 = time.perf_counter()
    if lazy is None:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=Rows(train))
    else:
        cfg = {"device": args.device, "loss_chunk_tokens": 512, "policy": args.policy, **lazy}
        trainer = LazyTrainer(model=model, args=LazyTrainingArguments(**common, bf16=True, lazytrain_config=cfg),
                              train_dataset=Rows(train))
    trainer.train()
    seconds = time.perf_counter() - t0
    ex = getattr(trainer, "executor", None)
    if ex is not None:
        ex.flush_updates()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    params = {k: v.detach().float().cpu().clone() for k, v in model.named_parameters()}
    extra = {"lazytrain_config": lazy, "optim": optim, "weights_dtype": str(dtype).removeprefix("torch."),
             "loss_every": losses[::args.log_every], "loss_last50_mean": sum(losses[-50:]) / len(losses[-50:]),
             "loss_first": losses[0], "held_out_loss_start": start,
             "held_out_loss_end": held_out_loss(model, held, args.device),
             "train_s": round(seconds, 1)}
    if ex is not None:
        ex.close()
    return extra, params


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-tiny-vocab")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--held-out-rows", type=int, default=16)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--vocab", type=int, default=8192,
                   help="the model's vocabulary; token ids are folded modulo it (0: the model's own)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--policy", default="milp", choices=["milp", "fixed", "none"],
                   help="lazytrain_config.policy of the LazyTrain rows; none: the stock forward and backward with the "
                        "same Hybrid8 optimizer (the update is what is compared; fast on the CPU)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)
    if "fp32_reference" not in args.configs:
        p.error("--configs must include fp32_reference (every row's distance is measured from it)")
    from lazytrain_hf.models import load_model

    torch.manual_seed(0)
    base = load_model(args.model, "float32", seed=0, **({"vocab_size": args.vocab} if args.vocab else {}))
    with torch.no_grad():  # every configuration starts from the same values: the bf16 rounding of the init
        for v in base.parameters():
            v.copy_(v.to(torch.bfloat16).float())
    vocab = base.config.vocab_size
    train = gsm8k_token_rows(args.seq_len, args.steps * args.batch_size, args.data_dir) % vocab
    held = gsm8k_token_rows(args.seq_len, args.held_out_rows, args.data_dir, split="test") % vocab
    doc: dict[str, Any] = {"suite": "quality", "date": datetime.date.today().isoformat(),
                           "command": " ".join(["python -m benchmarks.quality", *(argv or sys.argv[1:])]),
                           "git_commit": git_commit(), "machine": {"cpu_cores": os.cpu_count(),
                                                                   "torch": torch.__version__}, "rows": []}
    ref_params: dict[str, torch.Tensor] = {}
    start = {k: v.detach().float().clone() for k, v in base.named_parameters()}
    out_dir = tempfile.mkdtemp(prefix="lazytrain-quality-")  # the Trainers' output_dir: nothing is saved there
    for name in ["fp32_reference", *[c for c in args.configs if c != "fp32_reference"]]:
        extra, params = run_config(name, base, train, held, args, out_dir)
        if name == "fp32_reference":
            ref_params = params
        moved = sum(float((ref_params[k] - start[k]).norm() ** 2) for k in ref_params) ** 0.5
        extra["param_distance_from_reference"] = sum(float((params[k] - ref_params[k]).norm() ** 2)
                                                     for k in ref_params) ** 0.5
        extra["reference_distance_moved"] = moved  # how far the reference's parameters moved from the init
        doc["rows"].append({"system": name, "model": args.model, "params": sum(v.numel() for v in params.values()),
                            "gpu_cap_gib": None, "batch_size": args.batch_size, "seq_len": args.seq_len,
                            "status": "ok", "reason": None, "steps_timed": args.steps, "extra": extra})
        print(f"{name:22s} last-50 loss {extra['loss_last50_mean']:.4f}  held-out {extra['held_out_loss_start']:.4f}"
              f" -> {extra['held_out_loss_end']:.4f}  distance from reference "
              f"{extra['param_distance_from_reference']:.3e} (reference moved {moved:.3e})  {extra['train_s']} s",
              flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1))
    shutil.rmtree(out_dir, ignore_errors=True)
    return doc


if __name__ == "__main__":
    main()
