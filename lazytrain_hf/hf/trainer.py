"""`LazyTrainer`: the HF Trainer with the layer-streaming executor behind a few overridden hooks.

Overridden: `_wrap_model` (returns the StreamingModel, so accelerate neither wraps nor moves the
model), `get_optimizer_cls_and_kwargs` / `create_optimizer` (Hybrid8bitOptimizer reading the executor's fp32 host
gradients), `training_step` (the executor's forward + backward), `_clip_grad_norm` / `_get_grad_norm` (the global
norm from the executor's gradient buffers; the clip coefficient is folded into the optimizer update), `log`
(throughput and memory metrics), `_save_scaler` / `_load_scaler` (fp16's loss scale, hf/loss_scale.py). Logging, evaluation, checkpointing, resume, LR scheduling, gradient accumulation
and callbacks stay the Trainer's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer

from ..config import GIB, LazyTrainConfig
from ..kernels import select_linear_attention
from ..models import check_supported
from ..planning.schedule import Schedule
from ..profiling.limits import ResourceLimitError
from ..streaming.executor import StreamingExecutor
from ..streaming.head import shift_labels
from ..streaming.model import StreamingModel
from ..streaming.packing import check_collator, prepare_batch
from ..streaming.quant import logical_numel
from . import checkpoint, log_setup, peft_support, preflight, recovery
from .args import LazyTrainingArguments
from .calibrate import Calibration
from .callback import LazyTrainCallback
from .foreign_args import to_lazy_args
from .longrun import LongRunCallback
from .loss_scale import LossScaler
from .metrics import StepMeter
from .plans import RunPlans
from .recovery import Window
from .trl_hooks import TRLHooks, check_reference
from .user_loss import StreamedCausalLM, fused_forward, user_loss_reasons

__all__ = ["LazyTrainer", "LazyTrainerMixin"]

logger = logging.getLogger(__name__)

_SUPPORTED_INPUTS = {"input_ids", "attention_mask", "labels", "position_ids"}


class LazyTrainerMixin(TRLHooks):
    """The executor hooks, mixable into any `Trainer` subclass (e.g. TRL's SFTTrainer):
    ``class LazySFTTrainer(LazyTrainerMixin, SFTTrainer): ...`` (the mixin must come first).

    `args`: a LazyTrainingArguments, or another Trainer's TrainingArguments subclass (TRL's `SFTConfig`, ...) with
    the LazyTrain settings given as ``lazytrain_config=`` (a dict, a YAML path or a LazyTrainConfig): converted to
    ``Lazy<class>`` (hf/foreign_args.py), its default ``gradient_checkpointing=True`` and default optimizer taken
    over by the executor with a log line.

    Raises (at construction, before any training time is spent):
        TypeError: `args` is not a TrainingArguments.
        ValueError: an empty `train_dataset`, unsupported architecture, `gradient_checkpointing=True`, an optimizer other than
            lazytrain_hybrid8 for a model with trainable streamed parameters, a `compute_loss_func`, a prompt-learning
            PEFT method, a TRL reference the executor cannot stream (`ref_model=`, hf/trl_hooks.py), or invalid
            `lazytrain_config` (or one given both to the trainer and in LazyTrainingArguments).

    A `peft.PeftModel` (LoRA) and models with frozen decoder parameters train through the executor's frozen-layer
    path (streaming/executor.py, Note [frozen layers]); `save_model` and checkpoints write what the stock Trainer
    writes for them (PEFT: the adapter files).
    """

    def __init__(self, *pos: Any, lazytrain_config: dict[str, Any] | str | LazyTrainConfig | None = None,
                 **kwargs: Any) -> None:
        # the Trainer's own signature: DPOTrainer takes ref_model second, before args
        bound = inspect.signature(super().__init__).bind(*pos, **kwargs)
        bound.apply_defaults()
        named = bound.arguments
        model = named.get("model")
        # another Trainer's arguments (TRL's SFTConfig, ...): converted to Lazy<class>, their TRL defaults that are
        # the executor's business taken over (hf/foreign_args.py)
        # before the conversion, whose takeover lines (like the plan lines) must reach a script that configured no
        # logging; the converted arguments keep the given ones' log levels
        log_setup.configure(named.get("args"))
        args = named["args"] = to_lazy_args(named.get("args"), lazytrain_config)
        cfg = args.lazy_config
        self.lazy_config: LazyTrainConfig = cfg
        self.executor: StreamingExecutor | None = None
        #: the run's plans: request, bucket plans, calibration, re-planning (hf/plans.py; None with policy "none")
        self.plans: RunPlans | None = None
        #: out-of-memory errors recovered from by re-planning (hf/recovery.py); also in the logged metrics
        self.oom_recoveries: int = 0
        self._window = Window()  # this accumulation window's micro-batches, to run them again after an abort
        #: the signal (SIGTERM / SIGINT) that stopped the last `train` at a step boundary, None when it ran out
        self.interrupted: int | None = None
        #: after an interrupted `train`: the checkpoint a resume continues from (the one written at the stop, or with
        #: `interrupt_grace_period` too short for a save, the last complete one; None when there is none)
        self.interrupt_checkpoint: str | None = None
        self._device_ids_checked = False  # this train()'s first micro-batch on the GPU had its token ids checked
        self._deferred_ref_logps: list = []  # DPOTrainer's reference log-probabilities, run once the executor is built
        #: fp16=True's dynamic loss scale (hf/loss_scale.py; None without fp16 or with policy "none"). Its
        #: `scale` / `growth_interval` / ... may be set before `train()`; a resume restores its state
        self.loss_scaler: LossScaler | None = None
        _check_not_empty(named.get("train_dataset"))
        if cfg.policy != "none":
            if model is None:
                raise ValueError("LazyTrainer needs `model` (model_init is not supported with the executor)")
            check_supported(model.config)
            check_collator(model.config, named.get("data_collator"))
            _refuse_forward_options(model, args)
            peft_support.check_peft_method(model, named.get("peft_config"))
            check_reference(type(self).__name__, named)  # hf/trl_hooks.py
            # gradient checkpointing on the model (peft's prepare_model_for_kbit_training turns it on): the executor
            # turns it off and recomputes as its schedule says (streaming/executor.py, Note [frozen layers])
        super().__init__(*bound.args, **bound.kwargs)
        self.longrun = LongRunCallback(self)
        if cfg.policy == "none":
            self.add_callback(self.longrun)
            if cfg.resident_placement != "auto":
                logger.warning("lazytrain_config.resident_placement=%r has no effect with policy 'none' (the stock "
                               "Trainer path keeps the whole model where the Trainer puts it)", cfg.resident_placement)
            if cfg.compile_linear_attention:
                logger.warning("lazytrain_config.compile_linear_attention has no effect with policy 'none' (the stock "
                               "Trainer path runs the model as given)")
            #: the Gated DeltaNet kernels the model runs ("fla", "torch", "torch_compile" in the executor; None: no
            #: linear-attention layers)
            self.linear_attention_kernel = select_linear_attention(self.model, self.args.device)
            return
        _check_placement_for_loss(cfg.resident_placement, user_loss_reasons(self, Trainer.compute_loss))
        fp32_weights = any(p.dtype == torch.float32 for p in self.model.parameters())
        device = self.args.device if cfg.device == "auto" else torch.device(cfg.device)
        if device.type == self.args.device.type and device.index is None:
            device = self.args.device  # "cuda" means this rank's GPU (cuda:LOCAL_RANK under accelerate / torchrun)
        #: whether the CUDA allocator's expandable segments are on (None: not a CUDA run)
        self.expandable_segments = use_expandable_segments(cfg.expandable_segments) if device.type == "cuda" \
            else None
        if device.type == "cuda" and cfg.cap_gpu_memory and cfg.gpu_memory_budget:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.gpu_memory_budget / total), device)
        # fp32 host accumulators only when micro-batches are summed; else the autograd gradient as is (bf16: 2 B/param)
        grad_dtype = "fp32" if self.args.gradient_accumulation_steps > 1 else "param"
        preflight.check_host_before_pinning(self)  # the executor page-locks weights, gradients, then states
        self.linear_attention_kernel = select_linear_attention(  # before layers are copied
            self.model, device, compile=cfg.compile_linear_attention)
        peft_support.check_quantized(self.model)
        self.executor = StreamingExecutor(self.model, cfg, device, host_grad_dtype=grad_dtype)
        peft_support.check_optimizer(self.executor, args)
        if self.args.fp16:
            self._setup_fp16(fp32_weights)
        if self.args.bf16 and fp32_weights:  # as the stock Trainer's autocast: fp32 master weights, bf16 matmuls
            self.executor.autocast_dtype = torch.bfloat16
            logger.info("LazyTrain: bf16=True over float32 weights: the decoder layers and the LM head compute "
                        "under bfloat16 autocast (the loss in float32), the weights and their updates stay float32 "
                        "and stream 4 bytes per parameter; a model loaded with dtype=torch.bfloat16 streams 2 "
                        "(lazytrain_config master_weights='fp32' keeps float32 master weights)")
        dp = self.executor.dp
        mode = "sharded" if self.executor.shard is not None else "replicated"
        logger.info("LazyTrain executor on %s: %s", device, f"data parallel, rank {dp.rank} of {dp.world} "
                    f"({dp.backend}), {mode} optimizer updates" if dp is not None
                    else "one process (no data parallelism)")
        self.streaming_model = StreamingModel(self.executor)
        #: what defines the loss when it is not the executor's chunked cross-entropy (hf/user_loss.py)
        self.user_loss: list[str] = user_loss_reasons(self, Trainer.compute_loss)
        #: the model `compute_loss` receives in training when `user_loss` is not empty
        self.user_loss_model: StreamedCausalLM | None = None
        if self.user_loss:
            self.user_loss_model = StreamedCausalLM(self.executor)
            logger.info("LazyTrain: the loss is the user's (%s): the streamed layers run behind compute_loss, the "
                        "model returning full [B, T, V] logits (or, asked for TRL's fused_lm_head, per-token "
                        "log-probabilities computed tile by tile) instead of the executor's chunked cross-entropy",
                        ", ".join(self.user_loss))
        self.run_deferred_ref_logps()  # hf/trl_hooks.py
        self.plans = RunPlans(self)
        params = {id(p): p for p in self.model.parameters()}.values()
        self.meter = StepMeter(sum(logical_numel(p) for p in params if p.requires_grad), device,
                               frozen_params=sum(logical_numel(p) for p in params if not p.requires_grad))
        self.add_callback(LazyTrainCallback(self))
        self.add_callback(self.longrun)  # after the plan: its train-begin checks read it

    # ---- training, checkpoints (hf/checkpoint.py, hf/longrun.py) ------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *pos: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, resuming only from a complete checkpoint (True: the newest complete one, incomplete ones
        skipped with a warning) and stopping at a step boundary with a checkpoint on SIGTERM / SIGINT
        (`interrupted` is then the signal)."""
        peft_support.check_trainable(self.model)
        resume = checkpoint.resolve_resume(resume_from_checkpoint, self.args.output_dir)
        self._device_ids_checked = False
        with self.longrun.handling_signals():
            return super().train(resume, *pos, **kwargs)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        ex = self.executor
        # the save's collectives (deferred updates; sharded data parallel: every layer's states gathered on rank 0)
        # run on every rank before any file is written, so a rank whose write fails leaves none waiting in one
        if ex is not None:
            ex.flush_updates()
        states = (contextlib.nullcontext() if ex is None
                  else ex.gathered_optimizer_states(self._inner_optimizer(self.optimizer)))
        try:
            with states:
                seconds = checkpoint.save_atomically(self, super()._save_checkpoint, model, trial,
                                                     clock=self.longrun.clock)
        except (checkpoint.CheckpointSaveError, ResourceLimitError) as e:
            # a periodic save that found no room left nothing partial behind (every rank raised it: the ranks
            # agreed in save_atomically): training goes on and the next save tries again. An interruption's save
            # or the last step's raise.
            if self.longrun._stopping or self.state.global_step >= self.state.max_steps:
                raise
            logger.error("%s; training continues, the next save tries again", e)
            return
        self.longrun.note_save(seconds)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        with checkpoint.naming_load_errors(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, ckpt: str | None) -> None:
        with checkpoint.naming_load_errors(str(ckpt)):
            super()._load_optimizer_and_scheduler(ckpt)

    # ---- planning ------------------------------------------------------------------------------------------
    def plan_schedule(self) -> Schedule:
        """Solve the MILP for this run's batch shape (per_device_train_batch_size x max sequence length).

        Raises:
            InfeasiblePlanError: no schedule fits; the fix in lazytrain_config keys and TrainingArguments.
        """
        from .plan import InfeasiblePlanError, plan_for_trainer, trainer_error

        try:
            return plan_for_trainer(self)
        except InfeasiblePlanError as e:
            raise trainer_error(self, e) from None

    @property
    def calibration(self) -> Calibration | None:
        """`plans.calibration` (read-only; benchmarks/systems.py reads it from the trainer)."""
        return self.plans.calibration if self.plans is not None else None

    # ---- model and optimizer -------------------------------------------------------------------------------
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if self.executor is None:
            return super()._wrap_model(model, training, dataloader)
        self.model.train(training)  # a PEFT model's own mode too (TRL logs by it): the wrappers hold its base
        if not training and self.user_loss_model is not None:
            return self.user_loss_model  # evaluation's compute_loss: the HF model's name, loss and logits, no grad
        return self.streaming_model

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, Any]:
        from ..optim import Hybrid8bitOptimizer

        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        if isinstance(args, LazyTrainingArguments) and cls is Hybrid8bitOptimizer:  # policy "none" included
            cfg = args.lazy_config
            from .register import params_named, parse_optim_args_text

            explicit = set(parse_optim_args_text(args.optim_args))  # the handler's reading
            extra = {"state_dtype": cfg.state_dtype, "master_weights": cfg.master_weights,
                     "block_size": cfg.block_size, "min_8bit_size": cfg.min_8bit_size}
            kwargs.update({k: v for k, v in extra.items() if k not in explicit})
            named = params_named(model, cfg.fp32_state_modules) if cfg.fp32_state_modules and model is not None else []
            fp32 = list(kwargs.get("fp32_state_params") or []) + named
            if cfg.resident_state_dtype == "8bit" and model is not None:  # unless fp32_state_modules names them
                parts = (model.get_input_embeddings(), model.get_output_embeddings())
                resident = {id(m.weight) for m in parts if getattr(m, "weight", None) is not None}
                keep = {id(p) for p in named}
                fp32 = [p for p in fp32 if id(p) not in resident or id(p) in keep]
            if fp32 or "fp32_state_params" in kwargs:
                kwargs["fp32_state_params"] = fp32
        return cls, kwargs

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        opt = super().create_optimizer(model)
        if self.executor is not None and not peft_support.is_hybrid8(self._inner_optimizer(opt)):
            return opt  # another optimizer: every parameter it updates is resident (`peft_support.check_optimizer`)
        if self.executor is not None:
            inner = self._inner_optimizer(opt)
            inner.set_grad_source(self.executor.grad_source)
            inner.set_state_allocator(self.executor.state_alloc)  # exact-size pinned states (before any resume)
            self.executor.reserve_states(inner)  # ... in one chunk per dtype: locked bytes == planned
            if self.lazy_config.overlap_optimizer:
                self.executor.attach_optimizer(inner)
        return opt

    def _setup_fp16(self, fp32_weights: bool) -> None:
        """fp16=True: the executor's own loss scaler (hf/loss_scale.py) in place of accelerate's GradScaler (which
        would unscale `.grad`, never the executor's gradient buffers), and fp16 autocast over fp32 weights on CUDA.

        Raises:
            ValueError: an optimizer other than lazytrain_hybrid8 (the unscale and the overflow skip happen inside
                its fused update).
        """
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        if optim != peft_support.OPTIM_NAME:
            raise ValueError(f"fp16=True with optim={optim!r} under the LazyTrain executor: the fp16 loss scaler "
                             f"unscales the gradients and skips overflowing steps inside {peft_support.OPTIM_NAME}'s "
                             f"fused update, which {optim!r} does not have. Use bf16=True (no loss scaling needed, "
                             f"on GPUs with bfloat16), optim='{peft_support.OPTIM_NAME}', or "
                             "lazytrain_config.policy='none' (the stock Trainer path)")
        handler = getattr(self.accelerator, "scaler_handler", None)  # accelerate's GradScalerKwargs, if given
        kwargs = handler.to_kwargs() if handler is not None else {}
        self.loss_scaler = LossScaler(**{k: v for k, v in kwargs.items() if k != "enabled"})
        self.accelerator.scaler = None  # its optimizer wrapper must not run a second (gradient-less) scaler
        dtype = next(p.dtype for p in self.model.parameters())
        if fp32_weights and self.executor.device.type == "cuda":
            self.executor.autocast_dtype = torch.float16
            compute = "the decoder layers compute under float16 autocast, the weights and their updates stay " \
                      "float32; the LM head computes under it too, the loss in float32"
        elif fp32_weights:  # as accelerate: no fp16 autocast off the GPU
            compute = f"on {self.executor.device.type} the model computes in its own dtype (float32: no fp16 " \
                      "autocast off CUDA, as the stock Trainer)"
        else:
            compute = f"the model computes in its own dtype ({str(dtype).removeprefix('torch.')})"
        logger.info("LazyTrain: fp16=True: %s; dynamic loss scale from %g (GradScaler's rule: x%g after %d steps "
                    "without overflow, x%g and the step skipped on one)", compute, self.loss_scaler.scale,
                    self.loss_scaler.growth_factor, self.loss_scaler.growth_interval,
                    self.loss_scaler.backoff_factor)
        if dtype == torch.bfloat16:
            logger.warning("fp16=True on bfloat16 weights: the model computes in bfloat16, which needs no loss "
                           "scaling; bf16=True is the setting for it")

    def _loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def loss_scale_step_done(self) -> None:
        """After `optimizer.step()` (LazyTrainCallback.on_optimizer_step): update the loss scale from whether the
        step was skipped, and tell accelerate, so that the Trainer does not step the LR scheduler for a skipped
        step (as with the stock fp16 GradScaler)."""
        if self.loss_scaler is None:
            return
        skipped = bool(getattr(self._inner_optimizer(self.optimizer), "last_step_skipped", False))
        before = self.loss_scaler.scale
        self.loss_scaler.update(skipped)
        if hasattr(self.optimizer, "_is_overflow"):  # AcceleratedOptimizer: read by optimizer_step_was_skipped
            self.optimizer._is_overflow = skipped
        if skipped:
            logger.info("LazyTrain fp16: gradient overflow at loss scale %g (step %d): optimizer step skipped, loss "
                        "scale -> %g", before, self.state.global_step + 1, self.loss_scaler.scale)

    def _save_scaler(self, output_dir: str) -> None:
        if self.loss_scaler is None:
            return super()._save_scaler(output_dir)
        if self.args.should_save:
            from transformers.trainer import SCALER_NAME

            torch.save(self.loss_scaler.state_dict(), os.path.join(output_dir, SCALER_NAME))

    def _load_scaler(self, ckpt: str | None) -> None:
        if self.loss_scaler is None:
            return super()._load_scaler(ckpt)
        from transformers.trainer import SCALER_NAME

        path = os.path.join(ckpt, SCALER_NAME) if ckpt is not None else None
        if path is not None and os.path.isfile(path):  # none (a run saved without fp16): the initial scale
            with checkpoint.naming_load_errors(str(ckpt)):
                self.loss_scaler.load_state_dict(torch.load(path, weights_only=True))

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """The stock warning, less tied aliases: a checkpoint of a tied model has no `lm_head.weight` (save drops
        the alias; the embedding it shares storage with was loaded), which the Trainer reports as missing."""
        tied = tied_aliases(self.model)
        missing = [k for k in load_result.missing_keys if k not in tied or tied[k] in load_result.missing_keys]
        super()._issue_warnings_after_load(load_result._replace(missing_keys=missing))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The stock save; outside a checkpoint (whose save is atomic and checked: hf/checkpoint.py) with the free
        space checked first and a full disk made one error naming the bytes and the last complete checkpoint."""
        if _internal_call:
            return super().save_model(output_dir, _internal_call)
        stock = super().save_model
        out = output_dir if output_dir is not None else self.args.output_dir
        checkpoint.save_model_checked(self, lambda: stock(output_dir, _internal_call), out)

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        ex = self.executor
        if ex is not None and ex.shard is None:
            ex.flush_updates()  # deferred layer updates land before the weights are written
        elif ex is not None:  # rank 0 only: no collective here; the callback flushed on every rank before saving
            ex._flush_local()
            if ex.shard.stale:
                raise RuntimeError("dp_updates='sharded': layers updated by other ranks are not yet broadcast; call "
                                   "trainer.executor.flush_updates() on every rank before save_model")
        super()._save(output_dir, state_dict)

    @staticmethod
    def _inner_optimizer(opt: Any) -> Any:
        return getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps ours

    # ---- one micro-batch -----------------------------------------------------------------------------------
    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        ids = inputs.get("input_ids")
        # a batch on the GPU (accelerate puts it there) is checked at its first micro-batch only: reading the
        # reduction back waits for the GPU, which would drain the executor's queued work every micro-batch
        if not (torch.is_tensor(ids) and ids.device.type != "cpu" and self._device_ids_checked):
            check_token_ids(inputs, self.model)
            self._device_ids_checked = True
        if self.executor is None:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()
        self.model.train()  # a PEFT model's own mode too (after an evaluation, `_wrap_model`)
        inputs = prepare_batch(inputs, self.model.config)  # packed rows: boundary keys checked and dropped
        unknown = set(inputs) - _SUPPORTED_INPUTS
        # with the user's loss, compute_loss takes the batch and the streamed model's forward checks what it gets
        if unknown and self.user_loss_model is None:
            raise ValueError(f"the LazyTrain executor takes {sorted(_SUPPORTED_INPUTS)} but the batch also has "
                             f"{sorted(unknown)}; drop those columns (remove_unused_columns=True) or use "
                             "lazytrain_config.policy='none'")
        if "labels" not in inputs and self.user_loss_model is None:
            raise ValueError("the batch has no `labels`; the executor trains causal LMs with a labels column "
                             "(-100 = ignored), e.g. from DataCollatorForLanguageModeling(mlm=False)")
        inputs = self._prepare_inputs(inputs)
        # Ranks' gradients are SUMMED (streaming/comm.py), so the denominator is global: DDP's average of the
        # ranks' losses (each x world when the token count is already global, as Trainer.compute_loss does).
        world = self.executor.dp.world if self.executor.dp is not None else 1
        if self.user_loss_model is not None:
            denominator = num_items_in_batch  # compute_loss's own argument; it normalizes its loss itself
        elif num_items_in_batch is not None and self.model_accepts_loss_kwargs:
            denominator = num_items_in_batch  # token-weighted over the whole accumulation window, as HF
            if not self.args.average_tokens_across_devices:
                denominator = denominator * world  # a per-rank count: the ranks' losses are averaged
        else:  # per-micro-batch mean, scaled for accumulation as the Trainer does
            denominator = shift_labels(inputs["labels"]).ne(-100).sum().clamp(min=1) * \
                self.current_gradient_accumulation_steps
            denominator = denominator * world
        sync = self.accelerator.sync_gradients
        window = self._window
        if self.executor.grads.microbatches == 0:  # nothing accumulated since zero_grad: a new window
            window.start(self.executor.device)
        while True:
            pos = 0
            try:
                if window.replay:  # after an abort: the window so far, as it ran (same RNG stream)
                    window.restore_rng(self.executor.device)
                    for pos in range(len(window.items)):  # (pos: which one failed)
                        self._microbatch(*window.items[pos])
                    window.replay = False
                pos = len(window.items)
                loss = self._microbatch(inputs, denominator, sync)
                break
            except torch.OutOfMemoryError as e:
                miss = recovery.measure_oom(self, e, pos, self.plans.step_peak_reset)
                reason = recovery.unrecoverable(self)
                if reason is not None:
                    self._abort_quietly()
                    raise recovery.oom_error(self, miss, reason) from e
            self._recover(miss)  # outside the handler: the failed pass's frames (and tensors) are gone
        window.items.append((inputs, denominator, sync))
        self.meter.add_tokens(inputs["input_ids"].numel())  # this rank's tokens: per-GPU tokens/s and TFLOPS
        return loss.detach().to(self.args.device)

    def _microbatch(self, inputs: dict[str, Any], denominator: Any, sync: bool) -> torch.Tensor:
        """One micro-batch's forward and backward under the plan of its sequence-length bucket; returns the loss
        to log (this rank's; the Trainer averages the ranks')."""
        self.plans.for_batch(inputs["input_ids"].shape[1])
        world = self.executor.dp.world if self.executor.dp is not None else 1
        scale = self._loss_scale()  # fp16: every gradient is S x the true one (unscaled in the optimizer)
        if self.user_loss_model is not None:
            loss = self._user_loss_microbatch(inputs, denominator, sync, world, scale)
        else:
            loss = self.executor.forward_backward(inputs["input_ids"], inputs["labels"], inputs.get("attention_mask"),
                                                  inputs.get("position_ids"),
                                                  denominator=denominator if scale == 1.0 else denominator / scale,
                                                  sync_gradients=sync) * world  # the mean over ranks, as HF logs it
            loss = loss / scale if scale != 1.0 else loss
        x = self.executor.stats.extra
        skipped = getattr(self._inner_optimizer(self.optimizer), "last_step_skipped", False)
        self.plans.microbatch_done(x.get("cpu_update_ms"), x.get("cpu_update_params"), skipped)
        return loss

    def _user_loss_microbatch(self, inputs: dict[str, Any], num_items_in_batch: Any, sync: bool,
                              world: int, scale: float = 1.0) -> torch.Tensor:
        """The stock `training_step`'s loss and backward, with `compute_loss` given the streamed model."""
        facade = self.user_loss_model
        facade.sync_gradients = sync
        facade.train(self.model.training)
        facade.pending = None
        try:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(facade, dict(inputs), num_items_in_batch=num_items_in_batch)
            run = facade.pending
            if run is None:
                raise RuntimeError(f"{type(self).__name__}.compute_loss never called the model with gradients "
                                   "enabled; the LazyTrain executor trains through that call. Call the `model` "
                                   "argument compute_loss receives (self.model is the HF model itself, whose "
                                   "layers the executor streams: calling it runs them unstreamed)")
            scaled = getattr(self, "loss_is_scaled_for_ga", None)
            if scaled is None:  # as the stock Trainer decides it
                scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or \
                    self.compute_loss_func is not None
            if not scaled:
                loss = loss / self.current_gradient_accumulation_steps
            if not loss.requires_grad:
                raise RuntimeError(f"the loss {type(self).__name__}.compute_loss returned does not require grad")
            # ranks' gradients are summed (streaming/comm.py); DDP averages them. fp16: the loss scale S
            seeded = loss * scale if scale != 1.0 else loss
            (seeded / world if world > 1 else seeded).backward()
            if run.state != "backward":
                raise RuntimeError(f"the loss {type(self).__name__}.compute_loss returned does not depend on the "
                                   "model's output (its backward never reached the decoder layers)")
            run.finish(self.executor)
        finally:
            if facade.pending is not None and facade.pending.state != "done":
                facade.pending.close()  # an exception: the executor is cleaned up by abort_microbatch
            facade.pending = None
        return loss.detach()

    # ---- out-of-memory recovery (hf/recovery.py) -----------------------------------------------------------
    def _recover(self, miss: Any) -> None:
        """Drop the failed micro-batch and the window's gradients, re-plan with less GPU memory, and mark the
        window to run again from its first micro-batch.

        Raises:
            RuntimeError: no plan fits the reduced budget (the out-of-memory error's figures and the fix).
        """
        import gc

        from ..planning.milp import InfeasiblePlanError

        self.oom_recoveries += 1
        ex = self.executor
        ex.abort_microbatch()
        gc.collect()
        if ex.device.type == "cuda":
            torch.cuda.empty_cache()
            if self.plans.step_peak_reset:  # a checked step: its peak check measures the run again, not the failure
                torch.cuda.reset_peak_memory_stats(ex.device)
        try:
            plans = self.plans.recover(miss)
        except InfeasiblePlanError as e:
            reason = f"no plan fits the GPU budget less the measured overshoot ({e})"
            raise recovery.oom_error(self, miss, reason) from e
        recovery.log_replan(miss, plans, "CUDA out of memory", "; running the accumulation window again from its "
                            f"first micro-batch (recovery {self.oom_recoveries} of {recovery.MAX_OOM_RECOVERIES})")
        self._window.replay = True

    def _abort_quietly(self) -> None:
        """Before the out-of-memory error ends the run: the executor left clean (an error of its own is logged, the
        out-of-memory error raised)."""
        try:
            self.executor.abort_microbatch()
        except Exception as e:
            logger.warning("LazyTrain: cleaning up after the out-of-memory error failed (%s: %s)", type(e).__name__, e)

    # ---- gradient norm and clipping ------------------------------------------------------------------------
    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        if self.executor is None:
            return super()._clip_grad_norm(model)
        norm = self.executor.grad_norm()
        opt = self._inner_optimizer(self.optimizer)
        if not peft_support.is_hybrid8(opt):
            return peft_support.clip_resident(self.executor, self.args.max_grad_norm, norm)
        # fp16: the norm logged is the unscaled one; the unscale and clip reach every update (hf/loss_scale.py)
        return opt.clip_grad_norm(self.args.max_grad_norm, norm, grad_scale=self._loss_scale())

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if self.executor is not None and grad_norm is None and not peft_support.is_hybrid8(
                self._inner_optimizer(self.optimizer)):
            grad_norm = self.executor.grad_norm()
        elif self.executor is not None and grad_norm is None:
            # max_grad_norm == 0: no clipping, but a non-finite norm still skips the step (documented difference)
            grad_norm = self._inner_optimizer(self.optimizer).clip_grad_norm(float("inf"), self.executor.grad_norm(),
                                                                             grad_scale=self._loss_scale())
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # ---- metrics -------------------------------------------------------------------------------------------
    def executor_metrics(self) -> dict[str, float]:
        ex = self.executor
        st = ex.stats
        pinned = ex.pinned_bytes
        m = {"pinned_host_gib": round((pinned["registered"] + pinned["host_allocator"]) / GIB, 3),
             "h2d_weight_gib_per_microbatch": round(st.h2d_weight_bytes / GIB, 4),
             "recomputed_layers": float(st.recomputed_layers), "oom_recoveries": float(self.oom_recoveries)}
        opt = self._inner_optimizer(self.optimizer) if self.optimizer is not None else None
        if opt is not None and getattr(opt, "last_step_skipped", False):
            m["optimizer_step_skipped"] = 1.0
        if self.loss_scaler is not None:
            m["loss_scale"] = self.loss_scaler.scale  # after this step's update, as GradScaler.get_scale()
        return m

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.executor is not None and "loss" in logs and self.meter.last:
            logs = {**logs, **self.meter.last}
        super().log(logs, *args, **kwargs)


def use_expandable_segments(setting: bool | None) -> bool:
    """Turn the CUDA caching allocator's expandable segments on or off for this process (`memory.
    expandable_segments`; None: on unless the user's allocator settings, PYTORCH_ALLOC_CONF or else
    PYTORCH_CUDA_ALLOC_CONF as torch reads them, are set: those then decide). The user's other allocator settings
    are applied with it (torch resets the ones a new settings string omits). Segments allocated before keep their
    kind. Returns whether they are on from now. The streamed layers free and allocate activations of changing sizes
    under a capped budget: with fixed segments the 7B recipe's plan at 24 GiB retried allocations twice a step with
    62 cudaMalloc calls (benchmarks/results/recipe-20261205.json)."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    entries = [e.strip() for e in conf.split(",") if e.strip()]
    said = [e for e in entries if e.replace(" ", "").lower().startswith("expandable_segments:")]
    if setting is None:
        if entries:
            return bool(said) and said[-1].replace(" ", "").lower() == "expandable_segments:true"
        setting = True
    apply = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    apply(",".join([*(e for e in entries if e not in said), f"expandable_segments:{setting}"]))
    return setting


def check_token_ids(inputs: dict[str, Any], model: nn.Module) -> None:
    """Refuse a batch whose `input_ids` (or `labels`, -100 aside) hold ids outside the model's embedding rows
    [0, vocab_size), before any layer runs: the embedding would fail with a bare "IndexError: index out of range
    in self" deep in the step (on CUDA a device-side assert). One min / max reduction, read back to the host.

    Raises:
        ValueError: naming the largest (or negative) id, the model's vocab_size and the tokenizer / model fix.
    """
    emb = model.get_input_embeddings()
    rows = getattr(emb, "num_embeddings", None)
    ids, labels = inputs.get("input_ids"), inputs.get("labels")
    if rows is None or not torch.is_tensor(ids) or not ids.numel():
        return
    parts = [ids.min(), ids.max()]
    if torch.is_tensor(labels) and labels.numel():
        kept = labels.masked_fill(labels == -100, 0)
        parts += [kept.min(), kept.max()]
    lo, hi, *lab = torch.stack([p.to(ids.device, torch.long) for p in parts]).tolist()
    bad = [(key, lo_, hi_) for key, lo_, hi_ in (("input_ids", lo, hi), ("labels", *(lab or (0, 0))))
           if lo_ < 0 or hi_ >= rows]
    if not bad:
        return
    key, lo, hi = bad[0]
    vocab = getattr(model.config, "vocab_size", rows)
    what = f"a negative id ({lo})" if lo < 0 else f"token id {hi}"
    raise ValueError(f"the batch's {key} hold {what}, outside the model's vocabulary: vocab_size={vocab} "
                     f"({rows} embedding rows, ids 0..{rows - 1}). The data was tokenized with another tokenizer than "
                     "the model's. Fix: tokenize with the model's own tokenizer (or pick a model whose vocabulary "
                     "covers the tokenizer), or grow the embedding to the tokenizer: "
                     "model.resize_token_embeddings(len(tokenizer)).")


def _check_placement_for_loss(placement: str, user_loss: list[str]) -> None:
    """Refuse "host_sliced" (the executor's own loss over LM-head slices) when the loss is the user's, which
    multiplies by the whole head (hf/user_loss.py), before the executor pins anything."""
    if user_loss and placement == "host_sliced":
        raise ValueError(f"lazytrain_config.resident_placement='host_sliced' runs the executor's own loss over slices "
                         f"of the LM head, but the loss here is the user's ({', '.join(user_loss)}), which "
                         "multiplies by the whole head: set resident_placement to 'host' (its weights copied to the "
                         "GPU once per step) or 'auto'")


def _check_not_empty(train_dataset: Any) -> None:
    """Refuse a sized `train_dataset` with no rows when the trainer is built (the stock Trainer fails only in
    `train()`, with the sampler's "num_samples should be a positive integer value"); an unsized (iterable) one is
    not checked.

    Raises:
        ValueError: naming the data set and the filters that commonly empty one.
    """
    try:
        rows = len(train_dataset)
    except TypeError:  # None, or an IterableDataset
        return
    if rows:
        return
    info = getattr(train_dataset, "info", None)
    named = ", ".join(f"{k} {v!r}" for k, v in (("name", getattr(info, "dataset_name", None)),
                                               ("split", getattr(train_dataset, "split", None))) if v)
    raise ValueError(f"train_dataset ({type(train_dataset).__name__}{', ' + named if named else ''}) has no rows: "
                     "nothing to train on. Was every row filtered out (a length filter such as tokenize_for_sft's "
                     "max_length, a Dataset.filter, a limit of 0)? Fix: check the data set's source and its filters, "
                     "or raise the length limit.")


def _refuse_forward_options(model: nn.Module, args: Any) -> None:
    """Options acting on a forward the executor never calls: refused when the trainer is built.

    Raises:
        ValueError: naming the option and the fix.
    """
    fix = "or train with lazytrain_config policy 'none' (the stock Trainer path)"
    if getattr(args, "torch_compile", False):
        raise ValueError("torch_compile=True compiles the model's forward, which the LazyTrain executor never calls "
                         f"(it streams the decoder layers itself); set torch_compile=False, {fix}")
    if getattr(args, "activation_offloading", False):
        raise ValueError("activation_offloading=True (TRL) offloads the activations of the model's forward, which the "
                         "LazyTrain executor never calls (it places activations as its plan says); set "
                         f"activation_offloading=False, {fix}")
    if getattr(args, "use_liger_kernel", False):
        raise ValueError("use_liger_kernel=True patches the model's modules and its fused loss into the model's "
                         f"forward, which the LazyTrain executor does not run; set use_liger_kernel=False, {fix}")
    hooked = [n for n, hooks in (("forward hooks", model._forward_hooks), ("forward pre-hooks",
              model._forward_pre_hooks)) if hooks]
    if "forward" in vars(model) and fused_forward(model) is None:  # TRL's fused LM head runs (hf/user_loss.py)
        hooked.append("an instance-level forward")
    if hooked:
        raise ValueError(f"the model has {' and '.join(hooked)} on {type(model).__name__}: the LazyTrain executor "
                         "runs the embedding, decoder layers and head itself and never calls the model's forward. "
                         "Move that logic into compute_loss (it runs, with the streamed model), remove it, " + fix)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{name: the first name of the same Parameter} for every parameter reachable under two names (tied weights)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


class LazyTrainer(LazyTrainerMixin, Trainer):
    """`transformers.Trainer` running the LazyTrain layer-streaming executor.

    Example:
        >>> args = LazyTrainingArguments(output_dir="out", lazytrain_config={"checkpoint_every": 4})
        >>> LazyTrainer(model=model, args=args, train_dataset=ds, data_collator=collator).train()
    """
