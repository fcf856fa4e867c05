"""Trains a tiny model with LazyTrainer for a few steps and saves its parameters and log (one file per rank).

Run alone (one process) or under `python -m torch.distributed.run --nproc_per_node N`; tests/hf/test_ddp.py compares
the two. Not a test module itself (pytest collects test_*.py only).

    python tests/hf/ddp_worker.py --out DIR --per-device-batch 4 [--device cpu|cuda] [--steps 3] [--ga 1,2]
        [--dp-updates replicated|sharded] [--host-weights auto|shared|per_rank] [--gpu-updates] [--save-resume]

Writes DIR/rank<R>_ga<G>.pt: {"params": name -> tensor, "logs": Trainer log rows with a loss, "world": N,
"state_bytes": the executor's optimizer-state arena bytes, "d2h_grad_bytes": gradient D2H bytes of the last
micro-batch, "h2d_weight_bytes", "broadcasts": sharded load-time layer broadcasts, "weight_ranks": ranks mapping the
store's weights (2: one host copy shared, streaming/shared_host.py), "weight_bytes" / "store_bytes": the store's
weights and this rank's share of weights and gradients (`pinned_bytes["store"]`), "planned_host_bytes": the plan's
host bytes per rank}. --save-resume: a checkpoint at
step 2 (DIR/run<G>/checkpoint-2), then a second trainer resumes from it and trains to the end; adds "resumed"
(its final params), "state_at_save" and "state_after_load" (this rank's optimizer states, parameter name -> dict).
--gpu-updates: a fixed schedule whose layers 1 and 2 run their optimizer update GPU-side (on the compute device at
the layer's next load; the same path on a CPU device).
"""

from __future__ import annotations

import argparse
import os

import torch
from tiny_data import tiny_dataset  # this script's folder is on sys.path
from transformers import TrainerCallback
from worker_exit import exit_worker  # this script's folder is on sys.path

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
    p.add_argument("--dp-updates", default="replicated")
    p.add_argument("--host-weights", default="auto")
    p.add_argument("--gpu-updates", action="store_true")
    p.add_argument("--save-resume", action="store_true")
    a = p.parse_args()
    for tag in a.ga.split(","):
        train(a, tag)
    exit_worker()


def _schedule_file(a: argparse.Namespace, model: torch.nn.Module) -> str:
    from lazytrain_hf.planning.fixed import fixed_schedule

    sched = fixed_schedule(model.config.num_hidden_layers, 2)
    for i in (1, 2):
        sched.layers[i].optimizer_device = "gpu"
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"schedule{os.environ.get('RANK', '0')}.json")
    sched.to_json(path)
    return path


def _states(trainer: LazyTrainer) -> dict[str, dict]:
    """This rank's optimizer states by parameter name (tensors cloned to the CPU)."""
    opt = trainer._inner_optimizer(trainer.optimizer)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)]: {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in st.items()}
            for p, st in opt.state.items() if st}


class _Snap(TrainerCallback):
    """Records this rank's optimizer states after the checkpoint is written, or right after a resume loaded them."""

    def __init__(self, when: str) -> None:
        self.when, self.trainer, self.states = when, None, None

    def on_save(self, args, state, control, **kw):
        if self.when == "save" and state.global_step == 2:  # the Trainer saves at the last step too
            self.states = _states(self.trainer)

    def on_train_begin(self, args, state, control, **kw):
        if self.when == "load":
            self.states = _states(self.trainer)


def _trainer(a: argparse.Namespace, tag: str, snap: str | None = None) -> tuple[LazyTrainer, _Snap]:
    ga, average_tokens, stock = int(tag.rstrip("ns")), "n" not in tag, "s" in tag
    model = load_model(a.arch, "float32", seed=3)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = a.per_device_batch * world * ga * a.steps  # exactly one epoch of the global batch
    save = {"save_strategy": "steps", "save_steps": 2} if a.save_resume else {"save_strategy": "no"}
    lazy = {"state_dtype": "fp32", "master_weights": "none", "checkpoint_every": 2, "loss_chunk_tokens": 16,
            "max_rows_per_pass": 2, "device": a.device, "dp_updates": a.dp_updates, "dp_host_weights": a.host_weights}
    if a.gpu_updates:
        lazy["schedule_path"] = _schedule_file(a, model)
    args = LazyTrainingArguments(
        output_dir=os.path.join(a.out, f"run{tag}"), per_device_train_batch_size=a.per_device_batch,
        gradient_accumulation_steps=ga, max_steps=a.steps, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=0.5,
        lr_scheduler_type="linear", logging_steps=1, report_to=[], use_cpu=a.device == "cpu",
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True, **save,
        average_tokens_across_devices=average_tokens, **({"optim": "adamw_torch"} if stock else {}),
        lazytrain_config={"policy": "none"} if stock else lazy)
    cb = _Snap(snap or "")
    trainer = LazyTrainer(model=model, args=args, train_dataset=tiny_dataset(model.config.vocab_size, n),
                          data_collator=collate, callbacks=[cb])
    cb.trainer = trainer
    return trainer, cb


def _params(trainer: LazyTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in trainer.model.named_parameters()}


def train(a: argparse.Namespace, tag: str) -> None:
    trainer, snap = _trainer(a, tag, "save")
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    ex = trainer.executor
    out = {"params": _params(trainer), "logs": [h for h in trainer.state.log_history if "loss" in h],
           "world": trainer.args.world_size}
    if ex is not None:
        out.update(state_bytes=ex.state_arena.used_bytes, d2h_grad_bytes=ex.stats.d2h_grad_bytes,
                   h2d_weight_bytes=ex.stats.h2d_weight_bytes,
                   broadcasts=ex.shard.broadcasts if ex.shard is not None else 0, weight_ranks=ex.store.weight_ranks,
                   weight_bytes=ex.store.param_bytes, store_bytes=ex.pinned_bytes["store"],
                   planned_host_bytes=ex.schedule.predicted.get("pinned_host_bytes"))
        ex.close()
    if a.save_resume:
        resumed, load = _trainer(a, tag, "load")
        resumed.train(resume_from_checkpoint=os.path.join(a.out, f"run{tag}", "checkpoint-2"))
        out.update(resumed=_params(resumed), state_at_save=snap.states, state_after_load=load.states,
                   resumed_state_bytes=resumed.executor.state_arena.used_bytes)
        resumed.executor.close()
    torch.save(out, os.path.join(a.out, f"rank{rank}_ga{tag}.pt"))


if __name__ == "__main__":
    main()
