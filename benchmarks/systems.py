"""The systems of the side-by-side harness, each built as an HF Trainer over the same model and data.

Every system gets the same optimizer hyper-parameters (`HPARAMS`: AdamW lr / betas / eps / weight decay, clip 1.0,
constant LR), the same GSM8K token rows, warm-up steps excluded from timing. What differs is only what the system is:

- stock_trainer:      Trainer, everything on the GPU, activation checkpointing, adamw_torch_fused.
- stock_trainer_bnb8: the same with adamw_bnb_8bit (bitsandbytes 8-bit AdamW states).
- fsdp2_cpu_offload:  Trainer + accelerate FSDP2 on one process, CPUOffloadPolicy (parameters, gradients and the
                      AdamW step on the host), FSDP's activation checkpointing, pure bf16 parameters.
- zero_offload:       Trainer + DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU (DeepSpeedCPUAdam,
                      bf16 master weights / optimizer states), activation checkpointing.
- lazytrain_fixed / lazytrain_milp: LazyTrainer with the fixed (MegaTrain-equivalent) or the MILP schedule.

LoRA (PEFT adapters on a frozen base; the worker wraps the model with `peft.get_peft_model` and the suite's
`LoraConfig` right after building it):

- lazytrain_lora:         LazyTrainer with the product's defaults (lazytrain_config: the MILP policy and the GPU
                          budget only; optim lazytrain_hybrid8), bf16.
- stock_trainer_lora:     stock_trainer + PEFT: everything on the GPU, activation checkpointing, adamw_torch_fused.
- fsdp2_cpu_offload_lora: fsdp2_cpu_offload + PEFT, one batch size per process.

QLoRA (the same adapters on a bitsandbytes 4-bit base, `QLORA_QUANT`; the worker builds the base quantized layer by
layer, `common.quantized_random_model`, then `peft.prepare_model_for_kbit_training` and `get_peft_model`):

- lazytrain_qlora:        lazytrain_lora's LazyTrainer (product defaults, bf16) over the 4-bit base.

TRL (the same full fine-tuning as its base system, through another trainer class; `SFT_BASE`):

- lazytrain_sft:          TRL's SFTTrainer with `LazyTrainerMixin` (docs/trainer.md), an `SFTConfig` of the same
                          hyper-parameters (bf16; TRL's default optimizer and gradient checkpointing, which the mixin
                          takes over), the product's defaults as `lazytrain_config=`; TRL's own loss (its fused LM
                          head, entropy and token accuracy), TRL's collator over a `datasets.Dataset` of the token rows,
                          no packing. Measured against lazytrain_milp (the executor's chunked cross-entropy).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from lazytrain_hf.streaming.executor import UPDATE_COUNTERS

SYSTEMS = ("stock_trainer", "stock_trainer_bnb8", "fsdp2_cpu_offload", "zero_offload", "lazytrain_fixed",
           "lazytrain_milp")
#: systems whose Trainer is rebuilt per batch size in a fresh process (the wrapped model cannot be re-prepared)
ONE_BATCH_PER_PROCESS = ("fsdp2_cpu_offload", "zero_offload")
#: LoRA system -> the system it runs with PEFT adapters on a frozen base (lazytrain_lora: with the product defaults;
#: lazytrain_qlora: the same on a 4-bit base)
LORA_BASE = {"lazytrain_lora": "lazytrain_milp", "stock_trainer_lora": "stock_trainer",
             "fsdp2_cpu_offload_lora": "fsdp2_cpu_offload", "lazytrain_qlora": "lazytrain_milp"}
#: LoRA systems on a 4-bit base (bitsandbytes, `QLORA_QUANT`)
QLORA_SYSTEMS = ("lazytrain_qlora",)
LORA_SYSTEMS = tuple(s for s in LORA_BASE if s not in QLORA_SYSTEMS)
#: TRL system -> the system whose training it runs through TRL's trainer instead of LazyTrainer
SFT_BASE = {"lazytrain_sft": "lazytrain_milp"}
SFT_SYSTEMS = tuple(SFT_BASE)
SYSTEMS = (*SYSTEMS, *LORA_SYSTEMS, *QLORA_SYSTEMS, *SFT_SYSTEMS)
ONE_BATCH_PER_PROCESS = (*ONE_BATCH_PER_PROCESS, "fsdp2_cpu_offload_lora")
#: the LoRA suites' adapters: `peft.LoraConfig(**LORA_DEFAULTS)` (rank 16 on every linear layer of the decoder)
LORA_DEFAULTS: dict[str, Any] = dict(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0,
                                     task_type="CAUSAL_LM")
#: the QLoRA suites' base: `transformers.BitsAndBytesConfig(**QLORA_QUANT)` (nf4, double quantization, bf16 compute;
#: the compute dtype by name, so a spec stays JSON)
QLORA_QUANT: dict[str, Any] = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype="bfloat16")
#: identical optimizer hyper-parameters for every system (AdamW; LazyTrain's Hybrid8 takes the same ones)
HPARAMS: dict[str, Any] = dict(learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                               weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0)
GIB = 1024**3
#: spec["configuration"] of LazyTrain rows run as a user would: LazyTrainingArguments + a lazytrain_config of only
#: the policy and the GPU budget, the stock LazyTrainer (its optimizer, calibration and row passes as shipped)
PRODUCT_DEFAULTS = "product defaults"
#: the harness's own LazyTrain settings (8-bit embedding / head states, Kahan masters, 8 rows per pass, calibration
#: on the warm-up steps): the 7b and full suites
HARNESS_SETTINGS = "harness settings"


def unsupported_reason(system: str, device: str, check_imports: bool = True) -> str | None:
    """Why `system` cannot run on `device` here (None: it can be tried); `check_imports` also tries the packages
    a system needs (the harness parent skips that and leaves it to the system's own process)."""
    if system not in SYSTEMS:
        return f"unknown system {system!r}; known: {', '.join(SYSTEMS)}"
    if system in LORA_BASE:
        if check_imports:
            try:
                import peft  # noqa: F401
            except ImportError as e:
                return f"PEFT not importable ({e}): pip install peft"
            if system in QLORA_SYSTEMS:
                try:
                    import bitsandbytes  # noqa: F401
                except Exception as e:  # ImportError, or a library of another CUDA version
                    return (f"bitsandbytes not importable ({type(e).__name__}: {str(e)[:160]}): pip install "
                            "bitsandbytes (its CPU backend runs 4-bit on the CPU)")
        return unsupported_reason(LORA_BASE[system], device, check_imports)
    if system in SFT_BASE:
        if check_imports:
            try:
                import datasets  # noqa: F401
                import trl  # noqa: F401
            except ImportError as e:
                return f"TRL not importable ({e}): pip install lazytrain-hf[trl]"
        return unsupported_reason(SFT_BASE[system], device, check_imports)
    if device == "cpu" and system == "fsdp2_cpu_offload":
        return ("accelerate turns FSDP on only for a CUDA process group (distributed type MULTI_GPU); a CPU-only "
                "process has nothing to offload to")
    if system == "zero_offload":
        if device == "cpu":
            return ("not run on CPU: ZeRO-Offload offloads from a GPU to the host; DeepSpeed's CPU-accelerator path "
                    "(this config trained the tiny model through the Trainer there, by hand) is not what is compared, "
                    "and its JIT builds take minutes on 2 cores")
        if not check_imports:
            return None
        try:
            import deepspeed  # noqa: F401
        except Exception as e:  # ImportError, or a broken dependency (pydantic) inside it
            return (f"DeepSpeed not importable ({type(e).__name__}: {str(e)[:160]}); build it with "
                    "bash benchmarks/build_deepspeed_wheel.sh and carry .dssite/")
    return None


class StepTimer(TrainerCallback):
    """Times every optimizer step between on_step_begin and on_step_end (device-synchronized at both ends), the
    optimizer call between on_pre_optimizer_step and on_optimizer_step, the peak resident host memory at step ends,
    LazyTrain's exposed transfer stalls when the trainer has an executor, and (after `watch(model)`) the batch rows
    that entered the model's input embedding in each step: the rows a step really trained on, so a row whose batch
    size did not take effect cannot pass as measured."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.trainer: Any = None  # set after the Trainer exists (LazyTrain executor counters)
        # torch.profiler over one step (0-based index within a train() call), its kernel table written to
        # profile_path: where the GPU time of a step goes (HARNESS_PROFILE_STEP / HARNESS_PROFILE_DIR in worker.py)
        self.profile_step: int | None = None
        self.profile_path: Path | None = None
        self._prof: Any = None
        self.reset()

    def reset(self) -> None:
        self.step_s: list[float] = []
        self.optim_s: list[float] = []
        self.h2d_ms: list[float] = []
        self.d2h_ms: list[float] = []
        self.h2d_weight_bytes: list[int] = []  # weight H2D bytes per optimizer step (all its micro-batches)
        # CUDA caching allocator counters at each step end (cumulative): retries after freeing the cache, and
        # cudaMalloc / cudaFree calls; under a memory cap either costs device synchronizations inside the step
        self.alloc_counts: list[tuple[int, int, int]] = []
        self._h2d0 = 0
        self.update_ms: dict[str, list[float | None]] = {k: [] for k in UPDATE_COUNTERS}  # one entry per step
        self.op_ms: list[dict[str, list[float]]] = []  # per step: the last micro-batch's GPU time per op and layer
        self.rss_peak = 0
        self.skipped = 0  # optimizer steps skipped for a non-finite gradient norm (Hybrid8's `last_step_skipped`)
        self.rows: list[int] = []  # batch rows embedded per optimizer step (needs watch())
        self._rows = 0
        self._t0 = self._o0 = 0.0
        # LazyTrainer.oom_recoveries (0 where the trainer has none): at the first step's begin, then at each step end
        self.recoveries_at_start = 0
        self.recoveries: list[int] = []
        # the MILP plan the first step ran (planned at train begin, before any calibration re-plan): step_ms,
        # solve_ms, mip_gap
        self.plan_at_start: dict[str, Any] | None = None

    def watch(self, model: Any) -> None:
        """Count the rows of every batch entering `model`'s input embedding (a forward pre-hook; the embedding runs
        outside activation checkpointing, so a recomputed layer does not count twice)."""
        def count(_module: Any, args: tuple) -> None:
            if args and isinstance(args[0], torch.Tensor):
                self._rows += int(args[0].shape[0]) if args[0].dim() > 1 else 1

        model.get_input_embeddings().register_forward_pre_hook(count)

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs: Any):
        self.reset()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, args, state, control, **kwargs: Any):
        self._rows = 0
        ex = getattr(self.trainer, "executor", None)
        if not self.step_s:  # after every on_train_begin (LazyTrain plans there, after this callback's)
            self.recoveries_at_start = int(getattr(self.trainer, "oom_recoveries", 0) or 0)
            sched = getattr(ex, "schedule", None)
            if sched is not None and sched.policy in ("milp", "fixed"):
                self.plan_at_start = {"step_ms": sched.predicted.get("step_ms"),
                                      "solve_ms": sched.solver.get("solve_ms"), "mip_gap": sched.solver.get("mip_gap")}
        self._h2d0 = ex.streamer.h2d_bytes if ex is not None and ex.streamer is not None else 0
        if self.profile_step is not None and len(self.step_s) == self.profile_step:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]  # CUDA: kernels only (cheap)
            self._prof = profile(activities=acts)
            self._prof.__enter__()
        self._t0 = self._now()

    def on_pre_optimizer_step(self, args, state, control, **kwargs: Any):
        self._o0 = self._now()

    def on_optimizer_step(self, args, state, control, **kwargs: Any):
        self.optim_s.append(self._now() - self._o0)
        opt = kwargs.get("optimizer")
        opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the Trainer's optimizer
        self.skipped += bool(getattr(opt, "last_step_skipped", False))

    def on_step_end(self, args, state, control, **kwargs: Any):
        self.step_s.append(self._now() - self._t0)
        if self._prof is not None:
            self._write_profile()
        self.rows.append(self._rows)
        self.recoveries.append(int(getattr(self.trainer, "oom_recoveries", 0) or 0))
        self.rss_peak = max(self.rss_peak, _rss_bytes())
        if self.cuda:
            m = torch.cuda.memory_stats()
            self.alloc_counts.append((m.get("num_alloc_retries", 0), m.get("num_device_alloc", 0),
                                      m.get("num_device_free", 0)))
        ex = getattr(self.trainer, "executor", None)
        if ex is not None:
            self.h2d_ms.append(float(ex.stats.extra.get("exposed_h2d_ms", 0.0)))
            self.d2h_ms.append(float(ex.stats.extra.get("exposed_d2h_ms", 0.0)))
            if ex.streamer is not None:
                self.h2d_weight_bytes.append(ex.streamer.h2d_bytes - self._h2d0)
            for key, vals in self.update_ms.items():  # deferred CPU updates: blocked time, worker time, ...
                vals.append(ex.stats.extra.get(key))  # None when absent (no update ran yet), not a zero
            self.op_ms.append(getattr(ex.stats, "op_ms", {}))  # (stand-in executors in tests have none)

    def _write_profile(self) -> None:
        """Stop the profiler; write its per-name table (by device time on CUDA, CPU time otherwise) with the step's
        time, and the same totals as JSON beside it. A profile step beyond the run's steps writes nothing."""
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        key = "device_time_total" if self.cuda else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=80, max_name_column_width=90)
        path = self.profile_path or Path(f"profile-step{self.profile_step}.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"step {self.profile_step}: {self.step_s[-1] * 1e3:.1f} ms (profiled)\n{table}\n")
        per_name = {e.key: {"count": e.count, "device_us": getattr(e, key), "self_device_us":
                            getattr(e, "self_" + key)} for e in prof.key_averages()}
        path.with_suffix(".json").write_text(json.dumps({"step_ms": self.step_s[-1] * 1e3, "ops": per_name}))


def _rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return 0


def _training_args_cls(system: str):
    if system.startswith("lazytrain"):
        from lazytrain_hf.hf import LazyTrainingArguments

        return LazyTrainingArguments
    from transformers import TrainingArguments

    return TrainingArguments


def _checkpointing_kwargs(cls: Any) -> dict[str, bool]:
    """transformers >= 5.2x calls it `activation_checkpointing` (gradient_checkpointing is a deprecated alias)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {"activation_checkpointing": True} if "activation_checkpointing" in names else \
        {"gradient_checkpointing": True}


def deepspeed_config(stage: int = 3) -> dict[str, Any]:
    """ZeRO-Offload (stage 2: optimizer on the CPU) or ZeRO-Infinity-style stage 3 (parameters too) for the
    Trainer's `deepspeed=`; "auto" values are filled from TrainingArguments (same lr / betas / eps / wd / clip).
    bf16 master weights and optimizer states keep the host at ~8 bytes/parameter like the other systems' pure-bf16
    AdamW (fp32 masters and states would need ~16-18 bytes/parameter: 122-137 GB for 7.6 B, over a 128 GB host)."""
    zero: dict[str, Any] = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(offload_param={"device": "cpu", "pin_memory": True}, stage3_prefetch_bucket_size="auto",
                    stage3_param_persistence_threshold="auto", stage3_max_live_parameters=1e9,
                    stage3_max_reuse_distance=1e9, stage3_gather_16bit_weights_on_model_save=False)
    return {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}},
            "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto", "steps_per_print": 10**9, "wall_clock_breakdown": False}


def build_args(system: str, spec: dict[str, Any], batch_size: int, max_steps: int, output_dir: str | None = None):
    """TrainingArguments for one system and batch size; the settings each system differs in and `extra` facts.
    gradient_accumulation_steps: `accumulation(spec, batch_size)`."""
    if system in LORA_BASE:
        base = LORA_BASE[system]
        if base.startswith("lazytrain"):  # adapters are run as a user runs them: the product's defaults
            spec = dict(spec, configuration=PRODUCT_DEFAULTS)
        args, extra = build_args(base, spec, batch_size, max_steps, output_dir)
        return args, dict(extra, lora_of=base)
    device = spec["device"]
    kw: dict[str, Any] = dict(HPARAMS, output_dir=output_dir or tempfile.mkdtemp(prefix=f"bench-{system}-"),
                              per_device_train_batch_size=batch_size, max_steps=max_steps, logging_strategy="no",
                              save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                              logging_nan_inf_filter=False,  # a NaN loss must show, not become the running mean
                              remove_unused_columns=False, seed=0, use_cpu=device == "cpu",
                              gradient_accumulation_steps=accumulation(spec, batch_size))
    if system in SFT_BASE:
        from trl import SFTConfig

        # as a TRL user writes it: TRL's own defaults (its optimizer and gradient_checkpointing=True, both taken over
        # by the mixin); max_length None: the rows are already seq_len tokens, nothing to truncate. The LazyTrain
        # settings go to the trainer (build_trainer)
        return SFTConfig(**kw, bf16=True, packing=False, max_length=None), {
            "configuration": PRODUCT_DEFAULTS, "lazytrain_config": product_config(SFT_BASE[system], spec),
            "sft_of": SFT_BASE[system], "trainer": "LazyTrainerMixin + trl.SFTTrainer",
            "loss": "trl SFTTrainer.compute_loss (fused LM head, entropy, mean_token_accuracy)",
            "data": "datasets.Dataset input_ids, trl DataCollatorForLanguageModeling, no packing",
            "optimizer": "lazytrain_hybrid8 (defaults)", "gpu_update_kernel": _gpu_update_kernel()}
    cls = _training_args_cls(system)
    extra: dict[str, Any] = {}
    if system in ("stock_trainer", "stock_trainer_bnb8"):
        optim = "adamw_bnb_8bit" if system == "stock_trainer_bnb8" else \
            ("adamw_torch_fused" if device == "cuda" else "adamw_torch")
        kw.update(_checkpointing_kwargs(cls), optim=optim, bf16=True)
        extra.update(optimizer=optim, placement="all on the device", activation_checkpointing="every layer")
    elif system == "fsdp2_cpu_offload":
        # fsdp_config keys of transformers 5.x (checked in 5.17 and 5.24 TrainingArguments._process_fsdp_args).
        # bf16=False: pure bf16 parameters; with mixed precision accelerate upcasts FSDP2 parameters to fp32 masters
        # (16 bytes/parameter on the host with AdamW: 122 GB for 7.6 B, over the 128 GB host).
        kw.update(fsdp=True, fsdp_config={"version": 2, "cpu_offload": True, "activation_checkpointing": True,
                                          "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True,
                                          "state_dict_type": "FULL_STATE_DICT"},
                  optim="adamw_torch", bf16=False)
        extra.update(optimizer="adamw_torch (foreach) on the host", placement="FSDP2 CPUOffloadPolicy, 1 process",
                     activation_checkpointing="FSDP, every layer", precision="pure bf16 parameters")
    elif system == "zero_offload":
        stage = int(spec.get("zero_stage", 3))
        kw.update(_checkpointing_kwargs(cls), deepspeed=deepspeed_config(stage), bf16=True)
        extra.update(optimizer="DeepSpeedCPUAdam (AdamW mode, bf16 states)", zero_stage=stage,
                     placement="ZeRO-3 params + optimizer on the CPU" if stage == 3 else "ZeRO-2 optimizer on the CPU",
                     activation_checkpointing="every layer")
    elif spec.get("configuration") == PRODUCT_DEFAULTS:
        cfg = product_config(system, spec)
        kw.update(lazytrain_config=cfg, bf16=True)
        extra.update(configuration=PRODUCT_DEFAULTS, lazytrain_config=cfg, optimizer="lazytrain_hybrid8 (defaults)",
                     gpu_update_kernel=_gpu_update_kernel())
    else:
        policy = system.split("_", 1)[1]
        cap = spec.get("gpu_cap_gib")
        cfg = {"policy": policy, "device": device, "checkpoint_every": spec.get("checkpoint_every", 4),
               "activation_tier": "gpu", "max_rows_per_pass": spec.get("rows_per_pass", 8),
               "master_weights": spec.get("master_weights", "kahan"),
               "loss_chunk_tokens": spec.get("loss_chunk_tokens", 2048),
               "keep_gpu_grads": spec.get("keep_gpu_grads", True),
               # 8-bit embedding / LM head moments (the product's default keeps them fp32: 8.7 GB at Qwen2.5-7B)
               "resident_state_dtype": spec.get("embedding_states", "8bit"),
               "gpu_memory_budget": f"{cap}GiB" if cap else None, "cap_gpu_memory": bool(cap),
               # calibrate the MILP plan on the warm-up steps (the first two are never used: the overlapped
               # optimizer allocates its states in step 2), so the timed steps run one plan, predicted before them.
               # The step right after the re-plan is not timed either: the CPU update worker finished while the
               # solver ran, so that step waited for no update (7b-stock-vs-milp24-20261130.json: 0.4-0.9 s faster)
               # HARNESS_CALIBRATE_STEPS=0: run the first plan throughout (A/B rows on one plan)
               "calibrate_steps": int(os.environ.get("HARNESS_CALIBRATE_STEPS", max(0, int(spec.get("warmup", 0)) - 3)))}
        if os.environ.get("HARNESS_GPU_MEMORY_MARGIN"):  # the MILP's allocator margin (default 0.12)
            cfg["gpu_memory_margin"] = float(os.environ["HARNESS_GPU_MEMORY_MARGIN"])
        kw.update(lazytrain_config=cfg, bf16=True)
        extra.update(configuration=HARNESS_SETTINGS, optimizer="lazytrain_hybrid8 (8-bit states, Kahan bf16 master)",
                     lazytrain_config=cfg, embedding_states=spec.get("embedding_states", "8bit"),
                     gpu_update_kernel=_gpu_update_kernel())
    return cls(**kw), extra


def product_config(system: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The lazytrain_config of a LazyTrain system run with the product's defaults: its policy and the GPU budget.
    The budget is what a user of a GPU of that size would give; the worker caps the process for every system alike
    (cap_gpu_memory would do the same)."""
    cap = spec.get("gpu_cap_gib")
    return {"policy": system.split("_", 1)[1], **({"gpu_memory_budget": f"{cap}GiB"} if cap else {})}


def accumulation(spec: dict[str, Any], batch_size: int) -> int:
    """Micro-batches per optimizer step: ceil(spec["tokens_per_step"] / (batch_size x seq_len)), 1 without a
    tokens_per_step (every row of a step then has batch_size x seq_len tokens)."""
    tokens = spec.get("tokens_per_step")
    return max(1, math.ceil(tokens / (batch_size * spec["seq_len"]))) if tokens else 1


def _gpu_update_kernel() -> str:
    """The GPU-side layer updates' kernel: "triton" unless forced otherwise or triton is missing."""
    from lazytrain_hf.optim.kernel_select import gpu_kernel_choice, triton_status

    forced = gpu_kernel_choice()
    return forced if forced != "auto" else "triton" if triton_status()[0] else "bnb"


def build_trainer(system: str, spec: dict[str, Any], model: Any, args: Any, dataset: Any, timer: StepTimer):
    """The Trainer (or LazyTrainer) of `system` over `model` and `dataset`, with `timer` attached."""
    from transformers import Trainer, default_data_collator

    if system in SFT_BASE:  # TRL's collator; the tokenizer that made the rows gives TRL its pad and eos tokens
        from lazytrain_hf.data import load_tokenizer

        tok = load_tokenizer("qwen-offline")
        if tok.pad_token_id >= model.config.vocab_size:  # tiny test shapes (token ids folded into their vocabulary):
            args.pad_token = tok.convert_ids_to_tokens(0)  # TRL writes the pad id into the config; rows never pad
        trainer = _lazy_sft_cls()(model=model, args=args, train_dataset=dataset, callbacks=[timer],
                                  processing_class=tok,
                                  lazytrain_config=product_config(SFT_BASE[system], spec))
        timer.trainer = trainer
        return trainer
    common = dict(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                  callbacks=[timer])
    if system.startswith("lazytrain"):
        from lazytrain_hf.hf import LazyTrainer

        trainer = LazyTrainer(**common)
    else:
        trainer = Trainer(**common)
    timer.trainer = trainer
    return trainer


def _lazy_sft_cls():
    """`class LazySFT(LazyTrainerMixin, SFTTrainer)`, as docs/trainer.md has a TRL user write it."""
    from trl import SFTTrainer

    from lazytrain_hf import LazyTrainerMixin

    class LazySFT(LazyTrainerMixin, SFTTrainer):
        pass

    return LazySFT


def sft_metrics(trainer: Any) -> dict[str, Any]:
    """`extra` facts of a TRL row: what defined the loss (`LazyTrainer.user_loss`: "compute_loss of SFTTrainer" when
    TRL's loss ran) and TRL's own metrics of the run (its last log: entropy, mean_token_accuracy, num_tokens,
    averaged by SFTTrainer.log over the micro-batches since its previous log), and the optimizer and
    gradient_checkpointing the run had after the mixin took over SFTConfig's defaults."""
    last = next((h for h in reversed(trainer.state.log_history) if "mean_token_accuracy" in h), {})
    return {"user_loss": list(getattr(trainer, "user_loss", [])),
            "args_optim": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
            "args_gradient_checkpointing": bool(trainer.args.gradient_checkpointing),
            "trl_metrics": {k: last.get(k) for k in ("entropy", "mean_token_accuracy", "num_tokens")}}


def distributed_env(port: int) -> dict[str, str]:
    """Environment of a one-process process group (FSDP2 and DeepSpeed need one even on a single GPU)."""
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def lazytrain_metrics(trainer: Any, plan_at_start: dict[str, Any] | None = None) -> tuple[dict[str, Any],
                                                                                      dict[str, Any]]:
    """Row fields and `extra` facts read from a LazyTrainer's executor after training (empty for other trainers).

    predicted_step_s / solve_ms / mip_gap are those of the MILP plan made at train begin (after the profiler timed
    the layers, before any calibration re-plan): `plan_at_start` (StepTimer.plan_at_start), else the running plan.
    extra.predicted_step_s_calibrated: after calibration, the re-planned step, or the running plan valued at the
    measured costs when it was kept for want of a clear gain; None when no calibration changed the prediction.
    A plan's step is one micro-batch: with gradient accumulation both are per optimizer step (x the micro-batches,
    as the calibration compares them) and extra.predicted_micro_batch_s keeps the plan's own figure."""
    ex = getattr(trainer, "executor", None)
    if ex is None:
        return {}, {}
    sched = ex.schedule
    pinned = ex.pinned_bytes
    row: dict[str, Any] = {"pinned_planned_gib": pinned["planned"] / GIB,
                           "pinned_locked_gib": (pinned["registered"] + pinned["host_allocator"]) / GIB}
    cal = getattr(trainer, "calibration", None)
    calibrated = None
    if sched.policy in ("milp", "fixed"):  # the fixed policy's plan predicts too (hf/plan.py fixed_plan_for_trainer)
        start = plan_at_start or {"step_ms": sched.predicted.get("step_ms"), "solve_ms": sched.solver.get("solve_ms"),
                                  "mip_gap": sched.solver.get("mip_gap")}
        acc = int(getattr(getattr(trainer, "args", None), "gradient_accumulation_steps", 1) or 1)
        row.update(predicted_step_s=acc * (start["step_ms"] or 0) / 1e3 or None, solve_ms=start["solve_ms"],
                   mip_gap=start["mip_gap"])
        if cal is not None and cal.reverted:  # re-planned, then back: the replaced plan at those figures (a step)
            calibrated = cal.switched_from_ms / 1e3
        elif cal is not None and cal.done and cal.predicted_before_ms is not None:  # re-planned: the running plan's
            calibrated = acc * (sched.predicted.get("step_ms") or 0) / 1e3 or None
        elif cal is not None and cal.done and cal.kept_running_ms is not None:  # (ms per optimizer step)
            calibrated = cal.kept_running_ms / 1e3
    extra = {"predicted_step_s_calibrated": calibrated, "schedule_policy": sched.policy,
             "predicted_micro_batch_s": (start["step_ms"] or 0) / 1e3 or None if sched.policy in ("milp", "fixed")
             else None, "checkpoints": sum(lp.checkpoint for lp in sched.layers),
             "retained": sum(lp.retain for lp in sched.layers), "prefetch_depth": sched.prefetch_depth,
             "recomputed_layers": ex.stats.recomputed_layers, "weight_loads": ex.stats.weight_loads,
             "slot_reuse": ex.reuse_slots, "rows_per_pass": sched.rows_per_pass or ex.config.max_rows_per_pass,
             "resident": ex.resident.placement}
    if cal is not None and cal.done:  # measured warm-up steps vs the plan (hf/calibrate.py)
        extra["calibration"] = {"k": cal.k, "compute_scale": cal.scale, "cpu_optim_params_per_s": cal.cpu_rate,
                                "measured_cpu_rates": cal.cpu_rates, "step_ms": cal.step_ms,
                                "predicted_step_s_before": cal.predicted_before_ms and cal.predicted_before_ms / 1e3,
                                "kept_running_ms": cal.kept_running_ms, "replanned_ms": cal.replanned_ms,
                                "trial": {"switched_from_ms": cal.switched_from_ms, "switched_to_ms": cal.switched_to_ms,
                                          "step_ms": cal.trial, "ratio": cal.trial_ratio, "reverted": cal.reverted}}
    extra["gpu_updated_layers"] = sum(lp.optimizer_device == "gpu" for lp in sched.layers)
    extra["keep_grads"] = sched.keep_grads  # the plan kept their gradients on the GPU (kept_grad_gib at the end)
    extra["kept_grad_gib"] = ex.stats.extra.get("kept_grad_bytes", 0.0) / GIB
    extra["planned_cpu_optim_params_per_s"] = sched.solver.get("cpu_optim_params_per_s")
    # prepared moments (streaming/updates.py): the budget, the last preparation and the last step's CPU updates
    up = ex.updater
    if up is not None:
        x = ex.stats.extra
        extra["prepared_states"] = {
            "budget_gib": up.prepare_budget / GIB, "layers": len(up.prepare_layers()),
            "prepare_ms": x.get("prepare_ms"), "prepare_params": x.get("prepare_params"),
            "complete": x.get("prepare_complete"), "cpu_update_ms": x.get("cpu_update_ms"),
            "cpu_update_params": x.get("cpu_update_params"), "prepared_update_ms": x.get("cpu_update_prepared_ms"),
            "prepared_update_params": x.get("cpu_update_prepared_params")}
    return row, extra


def op_times(op_ms: list[dict[str, list[float]]], kinds: list[str], step_s: list[float],
             planned: dict[str, dict[str, float]] | None, micro_batches: int = 1) -> dict[str, Any] | None:
    """The timed steps' GPU time per executor op and layer kind (median ms over the steps, from
    `StepStats.op_ms`: one micro-batch's, the step's last), with the train-begin plan's figure for each
    (`planning.estimate.op_times`, per micro-batch too) and their ratio; busy_ms = their sum x `micro_batches`
    (the step's micro-batches taken alike), idle_ms = the step's wall time minus it (waits, launch gaps, the
    optimizer step, the embedding). None when no step was timed per op (not an instrumented CUDA run)."""
    steps = [(m, t) for m, t in zip(op_ms, step_s) if m]
    if not steps:
        return None
    per_step: list[dict[str, float]] = []
    for m, _ in steps:
        agg: dict[str, float] = {}
        for op, per_layer in m.items():
            for i, ms in enumerate(per_layer):
                key = f"{op} {'all' if op == 'head' else kinds[i]}"
                agg[key] = agg.get(key, 0.0) + ms
        per_step.append(agg)
    out: dict[str, Any] = {}
    for key in per_step[0]:
        med = statistics.median([a.get(key, 0.0) for a in per_step])
        op, kind = key.split(" ", 1)
        plan = (planned or {}).get(op, {}).get(kind)
        if med <= 0 and not plan:
            continue
        out[key] = {"measured_ms": round(med, 2), "planned_ms": None if plan is None else round(plan, 2),
                    "ratio": round(med / plan, 4) if plan else None}
    busy = [sum(a.values()) * micro_batches for a in per_step]
    out["busy_ms"] = round(statistics.median(busy), 1)
    out["idle_ms"] = round(statistics.median([t * 1e3 - b for (_, t), b in zip(steps, busy)]), 1)
    return out


def executed_flops(config: Any, n_params: int, tokens: int, seq_len: int, fwd_passes_per_layer: float,
                   layer_params: float | None = None) -> float:
    """FLOPs that ran in one step: each decoder layer's forward `fwd_passes_per_layer` times plus its backward
    (2 forwards), causal attention 2·T·H per token per layer forward, the rest (embedding + head) 6·N·tokens.
    Full activation checkpointing: fwd_passes_per_layer = 2 (forward + recompute)."""
    L = config.num_hidden_layers
    H = config.hidden_size
    if layer_params is None:
        inter = config.intermediate_size
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        hd = getattr(config, "head_dim", None) or H // heads
        layer_params = H * hd * (heads * 2 + kv * 2) + 3 * H * inter
    per_layer_fwd = 2 * layer_params * tokens + 2 * tokens * seq_len * H
    rest = max(0.0, n_params - L * layer_params)
    return per_layer_fwd * (fwd_passes_per_layer + 2) * L + 6 * rest * tokens


def lora_flops(config: Any, counts: dict[str, float], tokens: int, seq_len: int,
               fwd_passes_per_layer: float) -> dict[str, float]:
    """FLOPs of one optimizer step of adapter training on a frozen base (`tokens`: every token of the step).

    "executed" counts what ran: per decoder layer, with N_layer its parameters (frozen base plus adapters) and
    N_trainable its adapters, `fwd_passes_per_layer` forwards (forward + recomputes) of 2·N_layer·tokens, the
    backward's input gradients 2·N_layer·tokens, the adapters' weight gradients 2·N_trainable·tokens, and causal
    attention 2·tokens·T·(heads·head_dim) per forward and twice that in the backward; the LM head forward and input
    gradient 4·N_head·tokens (6 when it trains); the embedding lookup none.
    "model" is LazyTrainer's logged figure (hf/metrics.py): (4·N_frozen + 6·N_trainable)·tokens.

    counts: layer_params, layer_trainable (per decoder layer, mean over layers), head_params, head_trainable (0/1),
    frozen, trainable (whole model, each parameter once)."""
    L = config.num_hidden_layers
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    attn = 2 * tokens * seq_len * heads * hd
    n_layer, n_tr = counts["layer_params"], counts["layer_trainable"]
    layer = fwd_passes_per_layer * (2 * n_layer * tokens + attn) + 2 * n_layer * tokens + 2 * n_tr * tokens + 2 * attn
    head = (6 if counts["head_trainable"] else 4) * counts["head_params"] * tokens
    return {"executed": L * layer + head, "model": (4 * counts["frozen"] + 6 * counts["trainable"]) * tokens}
