"""lazytrain-hf: fine-tune Hugging Face causal LMs with layer streaming (train), plan schedules (plan), probe hardware.

    lazytrain-hf train --config recipes/cpu_default.yaml [--set training.max_steps=20] [--resume DIR|last]
    lazytrain-hf plan  --model qwen2.5-7b --gpu-memory 24GiB --batch-size 16 --seq-len 1024
    lazytrain-hf probe [--nvme-dir DIR]

The same entry point runs under accelerate: ``accelerate launch -m lazytrain_hf.cli train --config ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["main", "train", "COMMANDS", "lora_config", "merged_model"]

logger = logging.getLogger("lazytrain_hf")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="recipe YAML (see recipes/)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a recipe value, e.g. --set training.max_steps=20 (repeatable)")
    p.add_argument("--resume", default=None,
                   help="resume from a checkpoint directory, or 'last' for the newest complete one in output_dir "
                        "(incomplete ones are skipped with a warning)")


def train(args: argparse.Namespace) -> int:
    """Fine-tune per recipe, save a HF checkpoint to <output_dir>/final, evaluate exact match, write metrics.json.

    A recipe with a peft section trains LoRA adapters (`get_peft_model` around the loaded model): <output_dir>/final
    then holds the adapter as PEFT writes it, and with peft.merge_on_save <output_dir>/merged the merged plain model.
    With model.quantization the base is loaded in 4 bits into host memory (`models.load_model`) and prepared as
    PEFT's QLoRA recipe does (`prepare_model_for_kbit_training`) before the adapters wrap it.

    Every input problem (recipe keys, data files, schema, architecture, conflicting flags) is raised before the
    model loads or training starts. On SIGTERM / SIGINT training stops at the next optimizer step with a complete
    checkpoint-N (hf/longrun.py) and this returns 128 + the signal number (143 for SIGTERM, 130 for SIGINT)
    without writing final/ or evaluating; ``--resume last`` continues the run exactly. With
    ``lazytrain.interrupt_grace_period`` set and a save that would not finish within it, no checkpoint is written at
    the stop and ``--resume last`` continues from the last periodic one (the log says which).
    """
    from .recipe import load_recipe

    # every check that needs neither torch nor transformers first: a mistake costs well under a second
    recipe = load_recipe(args.config, args.set)
    _preflight(recipe, args.resume)

    from . import LazyTrainer, LazyTrainingArguments
    from .data import (
        evaluate_exact_match,
        load_math_dataset,
        load_tokenizer,
        make_collator,
        pack_rows,
        tokenize_for_sft,
    )
    from .data.evaluate import write_metrics_json
    from .models import check_supported, load_model, resolve_config

    targs = LazyTrainingArguments(**recipe.training, lazytrain_config=recipe.lazytrain)
    config = resolve_config(recipe.model.name_or_path)
    if targs.lazy_config.policy != "none":
        check_supported(config)
    quant = recipe.model.quantization  # bitsandbytes' presence checked with the recipe
    from .hf.preflight import check_host_before_building

    # before data and model load
    check_host_before_building(config, recipe.model.dtype, recipe.model.name_or_path, quantization=quant)
    d = recipe.data
    if d.packing or d.padding_free:
        from .streaming.packing import check_packing_model

        check_packing_model(config, f"data.{'packing' if d.packing else 'padding_free'}: true")
    train_raw = load_math_dataset(d.source, d.train_split, limit=d.train_limit, seed=d.seed, name=d.hub_config)
    test_raw = None
    if recipe.eval_split:
        test_raw = load_math_dataset(d.source, recipe.eval_split, limit=d.test_limit, seed=d.seed, name=d.hub_config)
    tokenizer = load_tokenizer(recipe.tokenizer.name_or_path)
    if config.vocab_size < len(tokenizer):
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but model {recipe.model.name_or_path!r} has "
                         f"vocab_size={config.vocab_size}; pick a model whose vocabulary covers the tokenizer "
                         "(e.g. qwen3-tiny-vocab with the qwen-offline tokenizer)")
    try:
        train_ds = tokenize_for_sft(train_raw, tokenizer, d.max_length)
    except ValueError as e:  # every example dropped by the length filter: named as the recipe names it
        text = str(e).replace("Fix: increase max_length.", f"Fix: raise data.max_length (now {d.max_length}), e.g. "
                              f"--set data.max_length={2 * d.max_length}.")
        raise ValueError(f"data.source {d.source!r} (split {d.train_split!r}): {text}") from e
    if d.packing:
        train_ds = pack_rows(train_ds, d.max_length)
    lora = lora_config(recipe.peft) if recipe.peft is not None else None

    if quant is None:
        model = load_model(recipe.model.name_or_path, recipe.model.dtype, seed=targs.seed)
    else:
        model = _load_4bit_base(recipe, targs)
    if lora is not None:
        from peft import get_peft_model
        from transformers import set_seed

        set_seed(targs.seed)  # the adapters' initial values follow training.seed, whatever loading the base drew
        try:
            model = get_peft_model(model, lora)
        except (ValueError, TypeError, KeyError) as e:  # e.g. target_modules naming no module of this model
            raise ValueError(f"peft: cannot wrap {recipe.model.name_or_path!r} with this LoraConfig: "
                             f"{str(e).splitlines()[0]}") from e
        trainable, total = model.get_nb_trainable_parameters()
        logger.info("LoRA: %d trainable parameters of %d (%.3f%%)", trainable, total, 100 * trainable / max(total, 1))
    trainer = LazyTrainer(model=model, args=targs, train_dataset=train_ds,
                          data_collator=make_collator(tokenizer, pad_to_multiple_of=8, packing=d.packing,
                                                      padding_free=d.padding_free),
                          processing_class=tokenizer)
    resume: Any = args.resume
    if resume == "last":
        from .hf.checkpoint import last_complete_checkpoint

        resume = last_complete_checkpoint(targs.output_dir)  # _preflight saw one
        if resume is None:
            raise ValueError(f"--resume last: no complete checkpoint-N/ in {targs.output_dir!r} (every one there is "
                             "incomplete: see the warnings); drop --resume to start a new run")
    if resume:
        _check_resume_has_steps_left(Path(resume), targs.max_steps)
        logger.info("resuming from %s", resume)
    t0 = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=resume)
    if trainer.interrupted is not None:
        from .hf.longrun import exit_status

        status = exit_status(trainer.interrupted)
        logger.warning("training stopped by signal %d at step %d; exiting with status %d; --resume last continues "
                       "from %s", trainer.interrupted, trainer.state.global_step, status,
                       trainer.interrupt_checkpoint or "nothing (no checkpoint was saved)")
        return status
    out = Path(targs.output_dir)
    final = out / "final"
    trainer.save_model(str(final))  # the Trainer writes on the main process only
    if not trainer.is_world_process_zero():  # data parallel: the other ranks are done (rank 0 evaluates, reports)
        return 0
    tokenizer.save_pretrained(str(final))
    merged = None
    if lora is not None and recipe.merge_on_save:
        model = merged_model(trainer, model)
        merged = out / "merged"
        model.save_pretrained(str(merged))
        tokenizer.save_pretrained(str(merged))
    metrics: dict[str, Any] = {
        "recipe": recipe.path, "model": recipe.model.name_or_path, "train": result.metrics,
        "train_wall_s": round(time.perf_counter() - t0, 2), "checkpoint": str(final),
        "log_history": trainer.state.log_history,
        "lazytrain_config": targs.lazytrain_config,
    }
    if merged is not None:
        metrics["merged_checkpoint"] = str(merged)
    if test_raw is not None:
        eval_model, device = _model_for_generation(trainer, model)
        metrics["eval"] = evaluate_exact_match(eval_model, tokenizer, test_raw, recipe.eval.max_new_tokens,
                                               recipe.eval.batch_size, recipe.eval.limit, device)
        logger.info("exact match on %s: %.4f (%d/%d)", d.test_split, metrics["eval"]["exact_match"],
                    metrics["eval"]["num_correct"], metrics["eval"]["num_examples"])
    path = write_metrics_json(out / "metrics.json", metrics)
    print(json.dumps({"checkpoint": str(final), "metrics": str(path), "train_loss": result.metrics.get("train_loss"),
                      "exact_match": metrics.get("eval", {}).get("exact_match")}))
    return 0


def _load_4bit_base(recipe: Any, targs: Any) -> Any:
    """The recipe's base in 4 bits in host memory (`models.load_model` with model.quantization; a registry shape
    quantized on the run's GPU, or on the CPU without one), prepared as PEFT's QLoRA recipe does:
    `prepare_model_for_kbit_training` freezes every weight and casts the embedding, norms and LM head to float32;
    no gradient checkpointing (the executor's schedule decides what is recomputed)."""
    from peft import prepare_model_for_kbit_training

    from .models import load_model
    from .streaming.quant import is_4bit, logical_numel

    device = targs.device if targs.device.type == "cuda" else "cpu"
    t0 = time.perf_counter()
    base = load_model(recipe.model.name_or_path, recipe.model.dtype, seed=targs.seed,
                      quantization=recipe.model.quantization, quantize_on=device)
    params = {id(p): p for p in base.parameters()}.values()
    four = sum(logical_numel(p) for p in params if is_4bit(p))
    logger.info("4-bit base %s: %s of %s parameters in 4 bits, loaded in %.1f s", recipe.model.name_or_path,
                f"{four:,}", f"{sum(logical_numel(p) for p in params):,}", time.perf_counter() - t0)
    return prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)


def lora_config(values: dict[str, Any]) -> Any:
    """The `peft.LoraConfig` of a recipe's peft section (`Recipe.peft`).

    Raises:
        ValueError: PEFT refuses the combination of values (its message, named as the recipe's peft section).
    """
    from peft import LoraConfig

    try:
        return LoraConfig(**values)
    except (ValueError, TypeError) as e:
        raise ValueError(f"peft: {str(e).splitlines()[0]}") from e


def merged_model(trainer: Any, model: Any) -> Any:
    """The trained PEFT model with its LoRA weights merged into the base (`merge_and_unload`): a plain transformers
    model, on the CPU, whose `save_pretrained` output `from_pretrained` loads. The executor is closed first (its
    host copies are the model's parameters)."""
    ex = getattr(trainer, "executor", None)
    if ex is not None:
        ex.close()
    return model.to("cpu").merge_and_unload()


def _check_resume_has_steps_left(checkpoint: Path, max_steps: int) -> None:
    """Refuse to resume a run that already reached `max_steps`: the Trainer would train no step and this command
    would overwrite final/ and metrics.json with an empty run's.

    Raises:
        ValueError: the checkpoint's global_step is >= max_steps (> 0), naming the step and the fix.
    """
    state = checkpoint / "trainer_state.json"
    if max_steps <= 0 or not state.is_file():
        return
    step = int(json.loads(state.read_text()).get("global_step", 0))
    if step >= max_steps:
        raise ValueError(f"--resume {checkpoint}: that run already reached step {step} of training.max_steps="
                         f"{max_steps}; nothing is left to train (final/ and metrics.json are kept as they are). "
                         f"Continue it with --set training.max_steps={step + max(1, max_steps // 2)} (any value above "
                         f"{step}), or drop --resume to start a new run")


def _preflight(recipe: Any, resume: str | None) -> None:
    """The recipe's inputs that can be checked without torch / transformers / datasets, all problems at once:
    the model and tokenizer names (registry name / "qwen-offline", local directory, or a Hub id the Hub or the cache
    has: one short request each, after every local check passed), local data files and the --resume target.

    Raises:
        ValueError: the problems, one per line, each naming its fix.
    """
    from .sources import check_data_columns, check_tokenizer_path, local_data_file, locate_model, locate_tokenizer

    problems = []
    d = recipe.data
    splits = [d.train_split] + ([recipe.eval_split] if recipe.eval_split else [])
    for split in splits:
        try:
            local = local_data_file(d.source, split)
            if local is not None:
                check_data_columns(local)
        except (FileNotFoundError, ValueError) as e:
            problems.append(f"data.source: {e}")
            break
    try:
        check_tokenizer_path(recipe.tokenizer.name_or_path)
    except (FileNotFoundError, ValueError) as e:
        problems.append(f"tokenizer.name_or_path: {e}")
    out = Path(recipe.training["output_dir"])
    if resume == "last" and not list(out.glob("checkpoint-*")):
        problems.append(f"--resume last: no checkpoint-N/ in {str(out)!r} (training.output_dir) to resume from; "
                        "drop --resume to start a new run, or pass --resume DIR")
    elif resume not in (None, "last") and not Path(resume).is_dir():
        problems.append(f"--resume {resume}: no such checkpoint directory; pass a checkpoint-N/ directory written "
                        "by an earlier run, or 'last' for the newest in training.output_dir")
    if not problems:  # the Hub requests only when everything local is right
        for key, locate, name in (("model.name_or_path", locate_model, recipe.model.name_or_path),
                                  ("tokenizer.name_or_path", locate_tokenizer, recipe.tokenizer.name_or_path)):
            try:
                locate(name)
            except ValueError as e:
                problems.append(f"{key}: {e}")
    if problems:
        raise ValueError(f"recipe {recipe.path}:\n  - " + "\n  - ".join(problems))


def _model_for_generation(trainer: Any, model: Any) -> tuple[Any, Any]:
    """The trained model, whole on one device for `generate`: the GPU if it fits, else the CPU."""
    import torch

    ex = getattr(trainer, "executor", None)
    if ex is None:
        return model, trainer.args.device
    ex.close()
    if ex.device.type == "cuda":
        try:
            return model.to(ex.device), ex.device
        except torch.OutOfMemoryError:
            logger.warning("the model does not fit on the GPU for generation; evaluating on the CPU (slow)")
            torch.cuda.empty_cache()
    return model.to("cpu"), torch.device("cpu")


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    from .cli_plan import add_arguments

    add_arguments(p)


def plan(args: argparse.Namespace) -> int:
    """Solve the MILP for a model and budgets, print the per-layer plan, write schedule JSON and timeline PNG."""
    from .cli_plan import run

    return run(args)


def _add_probe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nvme-dir", default=None, help="directory whose disk is measured for the NVMe tier")
    p.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or auto (cuda when available; default)")


def probe(args: argparse.Namespace) -> int:
    """Measure (or, without a GPU, report the defaults of) PCIe, NVMe, GEMM and optimizer rates; cached per machine.

    Raises:
        ValueError: a --device that is not cuda, cuda:N, cpu or auto.
    """
    import torch

    from .profiling.hardware import probe as run_probe

    device = args.device.strip().lower()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda, cuda:N, cpu or auto, but got {args.device!r}")
    prof = run_probe(dev, nvme_dir=args.nvme_dir)
    print(json.dumps(prof.to_dict() if hasattr(prof, "to_dict") else prof.__dict__, indent=1, default=str))
    return 0


#: subcommand -> (argument builder, function, help)
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int], str]] = {
    "train": (_add_train_args, train, "fine-tune from a recipe YAML"),
    "plan": (_add_plan_args, plan, "plan a schedule (MILP) for a model and budgets; no GPU needed"),
    "probe": (_add_probe_args, probe, "measure this machine's PCIe / NVMe / GEMM / optimizer rates"),
}


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n")
    parser = argparse.ArgumentParser(prog="lazytrain-hf", description=doc[0],
                                     epilog="examples:\n" + "\n".join(doc[2:5]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging; errors are raised with their traceback")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, _fn, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="as lazytrain-hf -v (accepted after the command too)")
        add(sp)
    args = parser.parse_args(argv)
    from .envvars import warn_unknown

    warn_unknown()  # a misspelt LAZYTRAIN_* variable, whichever command reads the environment
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command][1](args)
    except (ValueError, FileNotFoundError) as e:
        if args.verbose:
            raise
        print(f"lazytrain-hf {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a save that failed for lack of disk space: its one message, not a traceback
        from .hf.checkpoint import CheckpointSaveError  # imported by then: only a train run raises it

        if args.verbose or not isinstance(e, CheckpointSaveError):
            raise
        print(f"lazytrain-hf {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
