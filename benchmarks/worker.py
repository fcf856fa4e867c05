"""One harness process: one system, one model, one GPU cap, one or more batch sizes (ascending).

    python -m benchmarks.worker SPEC.json

SPEC (written by benchmarks.run): system, model, gpu_cap_gib (GiB or null), batch_sizes, seq_len, steps (timed),
warmup, device, rows_out (JSON-lines file, one results row per batch size, appended as each finishes so a killed
process keeps what it measured), configuration (LazyTrain: "product defaults" or "harness settings", then the knobs
rows_per_pass, checkpoint_every, master_weights, loss_chunk_tokens, embedding_states, keep_gpu_grads) and zero_stage.
Rows follow shared/RESULTS_FORMAT.md; every row records extra.num_hidden_layers, every trained row
extra.oom_recoveries (all / timed steps) and extra.linear_attention_kernel.
Out of memory (GPU) is caught and reported as status "oom"; batch sizes above one that ran out of memory are
reported "oom" without being run.

Optional SPEC keys: tokens_per_step (gradient accumulation: each batch size B runs ceil(tokens_per_step / (B x
seq_len)) micro-batches per optimizer step, `systems.accumulation`; timings stay per optimizer step and tokens_per_s
counts every token of the step; rows record extra.gradient_accumulation_steps and extra.tokens_per_step) and lora
(LoRA systems: `peft.LoraConfig` fields; the model is wrapped with `peft.get_peft_model` once, right after it is
built). LoRA rows record extra.lora, extra.trainable_params / total_params / base_params, and count FLOPs that ran
(`systems.lora_flops`): tflops_executed = per decoder layer, forwards and recomputes 2·N_layer·tokens each, the
backward's input gradients 2·N_layer·tokens and adapter weight gradients 2·N_trainable·tokens, causal attention
(2·tokens·T·heads·head_dim per forward, twice that backward), plus the frozen LM head's forward and input gradient
4·N_head·tokens; extra.tflops_model = (4·N_frozen + 6·N_trainable)·tokens / step (LazyTrainer's logged figure);
tflops_6nd is null (6·N counts weight gradients a frozen base does not compute). LazyTrain LoRA rows also record
extra.host_bytes_per_base_param = (peak RSS - the CPU activation tier's host buffers, executor.pinned_bytes
["activations"]) / base parameters.

QLoRA systems (lazytrain_qlora) also take quantization (`transformers.BitsAndBytesConfig` fields, default
systems.QLORA_QUANT): the base is built 4-bit module by module (`common.quantized_random_model`; on the GPU when
device is cuda, every tensor ending on the CPU), then `peft.prepare_model_for_kbit_training(use_gradient_checkpointing
=False)` (the embedding, norms and LM head to fp32) and `get_peft_model`. Their rows record extra.quantization (quant
type, double quantization, compute dtype, block size, storage, where it was quantized) and extra.base_build (seconds,
the process's peak RSS through the build, the built base's host bytes); parameter counts (params, base_params,
layer_params, frozen, the FLOPs above) count a 4-bit weight by its original shape (`common.logical_numel`), not its
packed bytes.

TRL systems (lazytrain_sft) get the token rows as a `datasets.Dataset` of `input_ids` (`sft_dataset`) and TRL's
collator; their rows count FLOPs and time as their base system's (lazytrain_milp) and record extra.trainer, extra.loss,
extra.user_loss (what defined the loss), extra.trl_metrics (TRL's logged entropy, mean_token_accuracy, num_tokens)
and the optimizer and gradient checkpointing the run had (extra.args_optim, extra.args_gradient_checkpointing).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from .common import GIB, fast_random_model, gsm8k_token_rows, logical_numel, percentiles, quantized_random_model, row
from .systems import (
    LORA_BASE,
    ONE_BATCH_PER_PROCESS,
    QLORA_QUANT,
    QLORA_SYSTEMS,
    SFT_BASE,
    StepTimer,
    accumulation,
    build_args,
    build_trainer,
    executed_flops,
    lazytrain_metrics,
    lora_flops,
    op_times,
    sft_metrics,
    unsupported_reason,
)


class TokenRows(torch.utils.data.Dataset):
    """[N, T] token rows as causal-LM examples (labels = input_ids; every token counts, no padding).
    `ds["input_ids"]` gives all rows (LazyTrain's planner reads the sequence length from it)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int | str) -> Any:
        if isinstance(i, str):
            if i not in ("input_ids", "labels"):
                raise KeyError(i)
            return list(self.ids)
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class PackedExamples(torch.utils.data.Dataset):
    """GSM8K train examples as a recipe with `data.packing: true` trains them: `tokenize_for_sft` (loss on the
    answers), `pack_rows` into rows of `seq_len` tokens, each row padded to `seq_len` as `PackedRowsCollator` pads
    it (so `default_data_collator` stacks them), repeated to `num_rows`. `real_fraction`: the non-pad share of the
    rows' tokens."""

    def __init__(self, seq_len: int, num_rows: int, data_dir: str | None, vocab_size: int) -> None:
        from lazytrain_hf.data import PackedRowsCollator, load_math_dataset, load_tokenizer, pack_rows, tokenize_for_sft

        from .common import gsm8k_dir

        tok = load_tokenizer("qwen-offline")
        raw = load_math_dataset(str(gsm8k_dir(data_dir)), "train")
        rows = pack_rows(tokenize_for_sft(raw, tok, seq_len), seq_len)
        pad = tok.pad_token_id if tok.pad_token_id < vocab_size else 0
        feats = [rows[i] for i in range(len(rows))]
        self.real_fraction = sum(len(f["input_ids"]) for f in feats) / (len(feats) * seq_len)
        feats = (feats * -(-num_rows // len(feats)))[:num_rows]
        batch = PackedRowsCollator(pad, pad_to_multiple_of=seq_len)(feats)  # rows <= seq_len: each padded to it
        if int(batch["input_ids"].max()) >= vocab_size:  # tiny test shapes: fold the ids into their vocabulary
            batch["input_ids"] %= vocab_size
            batch["labels"] = torch.where(batch["labels"] >= 0, batch["labels"] % vocab_size, batch["labels"])
        self.batch = batch

    def __len__(self) -> int:
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, i: int | str) -> Any:
        if isinstance(i, str):  # a column, as the planner reads the sequence length
            if i not in self.batch:
                raise KeyError(i)
            return list(self.batch[i])
        return {k: v[i] for k, v in self.batch.items()}


def sft_dataset(ids: torch.Tensor) -> Any:
    """The same [N, T] token rows as a `datasets.Dataset` with an `input_ids` column, as TRL's SFTTrainer takes
    tokenized data (it skips its tokenization; its collator makes the labels and the attention mask)."""
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": ids.tolist()})


def _emit(out: Path, r: dict[str, Any]) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(r, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    print(fmt_row(r), flush=True)


def fmt_row(r: dict[str, Any]) -> str:
    head = f"{r['system']:18s} {r['model']} cap={r['gpu_cap_gib']} B={r['batch_size']:<4d}"
    if r["status"] != "ok":
        return f"{head} {r['status']}: {r['reason']}"
    extra = r.get("extra") or {}
    flops = (f"TFLOPS6ND {r['tflops_6nd']:.1f}" if r["tflops_6nd"] is not None else
             f"TFLOPSexec {r['tflops_executed'] or 0:.1f} TFLOPSmodel {extra.get('tflops_model') or 0:.1f}")
    accum = f" x{extra['gradient_accumulation_steps']}" if extra.get("gradient_accumulation_steps", 1) > 1 else ""
    return (f"{head}{accum} step {r['step_s_median']:.3f}s tok/s {r['tokens_per_s']:.0f} {flops} "
            f"peakGPU {r['peak_gpu_gib'] or 0:.1f}GiB RSS {r['peak_host_rss_gib'] or 0:.1f}GiB "
            f"opt {r['optimizer_ms'] or 0:.0f}ms"
            + (f" pred {r['predicted_step_s']:.3f}s" if r.get("predicted_step_s") else "")
            + (f" cpu_upd {r['extra']['cpu_update_ms']:.0f}ms wait {r['extra'].get('optimizer_wait_ms', 0):.0f}ms"
               f" (GPU idle {r['extra'].get('exposed_update_wait_ms', 0):.0f}ms)"
               if "cpu_update_ms" in r.get("extra", {}) else "")
            + (f" ops busy {extra['gpu_op_ms']['busy_ms']:.0f}ms idle {extra['gpu_op_ms']['idle_ms']:.0f}ms"
               if extra.get("gpu_op_ms") else ""))


def recoveries(timer: StepTimer, warm: int) -> dict[str, int]:
    """Out-of-memory recoveries (LazyTrainer.oom_recoveries) in this train() call: all, and in its timed steps."""
    r = timer.recoveries
    if not r:
        return {"oom_recoveries": 0, "oom_recoveries_timed": 0}
    before_timed = r[warm - 1] if 0 < warm <= len(r) else timer.recoveries_at_start
    return {"oom_recoveries": r[-1] - timer.recoveries_at_start,
            "oom_recoveries_timed": r[-1] - before_timed if warm < len(r) else 0}


def linear_attention_kernel(model: Any, trainer: Any = None) -> str | None:
    """Which linear-attention kernel the model's linear-attention layers ran: the LazyTrainer's own record
    (`linear_attention_kernel`: its executor runs compiled copies of the layers under "torch_compile"), else read
    from the model's layers (lazytrain_hf.kernels); None where that module is absent."""
    if getattr(trainer, "linear_attention_kernel", None) is not None:
        return trainer.linear_attention_kernel
    try:
        from lazytrain_hf.kernels import linear_attention_kernel as which
    except ImportError:
        return None
    return which(model)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _measure(spec: dict[str, Any], system: str, B: int, trainer: Any, timer: StepTimer, facts: dict[str, Any],
             model_config: Any) -> dict[str, Any]:
    """Row fields from the timer after one train() of warmup + steps optimizer steps."""
    warm = spec["warmup"]
    times = timer.step_s[warm:]
    if not times:
        raise RuntimeError(f"no timed step: {len(timer.step_s)} steps ran, {warm} of them warm-up")
    med = statistics.median(times)
    accum = accumulation(spec, B)
    tokens = B * spec["seq_len"] * accum  # every micro-batch of the optimizer step
    n = facts["params"]
    lora = system in LORA_BASE
    fields: dict[str, Any] = dict(percentiles(times), tokens_per_s=tokens / med,
                                  tflops_6nd=None if lora else 6 * n * tokens / med / 1e12,
                                  peak_host_rss_gib=timer.rss_peak / GIB if timer.rss_peak else None)
    if spec["device"] == "cuda":
        fields["peak_gpu_gib"] = torch.cuda.max_memory_allocated() / GIB
    extra: dict[str, Any] = {"step_s": [round(t, 4) for t in timer.step_s], "warmup_steps": warm,
                             "rows_per_step": timer.rows, "gradient_accumulation_steps": accum,
                             "tokens_per_step": tokens, **recoveries(timer, warm)}
    if spec["device"] == "cuda":
        extra["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        c = timer.alloc_counts
        if len(c) > warm:  # per timed step: allocator retries, cudaMalloc and cudaFree calls
            base_c = c[warm - 1] if warm else (0, 0, 0)
            n_t = len(c) - warm
            extra["alloc_per_step"] = dict(zip(("retries", "cuda_malloc", "cuda_free"),
                                               ((c[-1][i] - base_c[i]) / n_t for i in range(3)), strict=True))
        # the allocator's settings as in effect (LazyTrainer sets expandable segments itself), else the environment's
        get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        extra["cuda_alloc_conf"] = get() if get is not None else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if system != "zero_offload" and timer.optim_s[warm:]:
        fields["optimizer_ms"] = statistics.median(timer.optim_s[warm:]) * 1e3
    elif system == "zero_offload":
        extra["optimizer_note"] = "DeepSpeed steps inside backward (engine.step); not separable from the Trainer"
    if spec.get("real_fraction") is not None:  # packed examples: the rows' non-pad share of the data set's tokens
        extra.update(data="packed_examples", real_fraction=spec["real_fraction"],
                     real_tokens_per_s=spec["real_fraction"] * tokens / med)
    lt_fields, lt_extra = lazytrain_metrics(trainer, timer.plan_at_start)
    fields.update(lt_fields)
    extra.update(lt_extra)
    if system in SFT_BASE:
        extra.update(sft_metrics(trainer))
    L = model_config.num_hidden_layers
    if system.startswith("lazytrain"):
        if timer.h2d_ms[warm:]:
            fields.update(exposed_h2d_ms=statistics.median(timer.h2d_ms[warm:]),
                          exposed_d2h_ms=statistics.median(timer.d2h_ms[warm:]))
        if timer.h2d_weight_bytes[warm:]:
            extra["h2d_weight_gib_per_step"] = statistics.median(timer.h2d_weight_bytes[warm:]) / GIB
        timed = {k: [x for x in v[warm:] if x is not None] for k, v in timer.update_ms.items()}
        extra.update({k: statistics.median(v) for k, v in timed.items() if v})
        # every step's CPU update (warm-up included): whether its in-step rate drifts over the run
        extra["cpu_update_ms_per_step"] = [None if x is None else round(x, 1) for x in timer.update_ms["cpu_update_ms"]]
        fwd = (L + (L - lt_extra["retained"]) + lt_extra["recomputed_layers"]) / L
        extra["optimizer_note"] = "exposed part only: streamed layers' updates overlap the next forward"
        sched = trainer.executor.schedule
        planned = sched.solver.get("op_ms")  # the running plan's, at the profiled costs (before its compute scale)
        scale = sched.solver.get("compute_scale") or 1.0
        if planned:
            planned = {op: {k: v / scale for k, v in by_kind.items()} for op, by_kind in planned.items()}
        kinds = ["linear_attention" if t == "linear_attention" else "full_attention"  # the cost model's kinds
                 for t in (getattr(model_config, "layer_types", None) or ["full_attention"] * L)[:L]]
        ops = op_times(timer.op_ms[warm:], kinds, timer.step_s[warm:], planned,
                       micro_batches=extra.get("gradient_accumulation_steps", 1))
        if ops is not None:
            extra["gpu_op_ms"] = ops
    else:
        fwd = 2.0  # forward + recompute in backward (checkpointing every layer)
    if lora:
        flops = lora_flops(model_config, facts, tokens, spec["seq_len"], fwd)
        fields["tflops_executed"] = flops["executed"] / med / 1e12
        extra.update(tflops_model=flops["model"] / med / 1e12, fwd_passes_per_layer=fwd, lora=spec["lora"],
                     trainable_params=facts["trainable"], total_params=facts["params"],
                     base_params=facts["base_params"])
        ex = getattr(trainer, "executor", None)
        if ex is not None and timer.rss_peak:
            act = ex.pinned_bytes["activations"]
            extra.update(cpu_tier_activation_gib=act / GIB,
                         host_bytes_per_base_param=(timer.rss_peak - act) / facts["base_params"])
    else:
        fields["tflops_executed"] = executed_flops(model_config, n, tokens, spec["seq_len"], fwd,
                                                   facts["layer_params"]) / med / 1e12
    fields["extra"] = extra
    return fields


def quantized_base(model: str, quantization: dict[str, Any], device: str) -> tuple[Any, dict[str, Any]]:
    """The 4-bit base of a QLoRA row (`common.quantized_random_model`, quantized on `device`) and the row's
    extra.quantization (what the built weights hold) and extra.base_build (seconds, the process's peak RSS through
    the build, the base's host bytes: packed weights, their quantization state and the other parameters)."""
    import resource

    from lazytrain_hf.streaming.quant import is_4bit, quant_tensors

    t0 = time.perf_counter()
    base = quantized_random_model(model, quantization, device)
    build_s = time.perf_counter() - t0
    params = list({id(p): p for p in base.parameters()}.values())
    four = [p for p in params if is_4bit(p)]
    if not four:
        raise RuntimeError(f"{model}: the quantized build holds no 4-bit weight")
    qs = four[0].quant_state
    host = sum(p.numel() * p.element_size() + sum(t.numel() * t.element_size() for _, t in quant_tensors(p))
               for p in params)
    extra = {"quantization": {"quant_type": qs.quant_type, "double_quant": bool(qs.nested),
                              "compute_dtype": str(quantization.get("bnb_4bit_compute_dtype", "float32")),
                              "blocksize": qs.blocksize, "nested_blocksize": qs.state2.blocksize if qs.nested else None,
                              "quant_storage": str(four[0].dtype).removeprefix("torch."), "quantized_on": device,
                              "four_bit_params": sum(logical_numel(p) for p in four),
                              "prepare_model_for_kbit_training": True},
             "base_build": {"build_s": round(build_s, 2), "base_host_gib": host / GIB,
                            # ru_maxrss: KiB on Linux; the process's peak so far, i.e. through the build
                            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}}
    print(f"quantized base {model}: {build_s:.1f} s on {device}, {host / GIB:.2f} GiB on the host, peak RSS "
          f"{extra['base_build']['peak_rss_gib']:.2f} GiB", file=sys.stderr, flush=True)
    return base, extra


def run(spec: dict[str, Any]) -> None:
    system, device = spec["system"], spec["device"]
    out = Path(spec["rows_out"])
    base = dict(system=system, model=spec["model"], gpu_cap_gib=spec["gpu_cap_gib"], seq_len=spec["seq_len"])
    reason = unsupported_reason(system, device)
    if reason:
        for B in spec["batch_sizes"]:
            _emit(out, row(**base, batch_size=B, status="unsupported", reason=reason))
        return
    if device == "cuda":
        cap = spec["gpu_cap_gib"]
        if cap:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GIB / total))
    t0 = time.perf_counter()
    quant_extra: dict[str, Any] = {}
    if system in QLORA_SYSTEMS:
        model, quant_extra = quantized_base(spec["model"], spec.get("quantization") or QLORA_QUANT, device)
    else:
        model = fast_random_model(spec["model"], torch.bfloat16)
    model.config.use_cache = False
    layers = model.model.layers
    base_params = sum(logical_numel(p) for p in {id(p): p for p in model.parameters()}.values())
    if system in LORA_BASE:
        import peft

        if system in QLORA_SYSTEMS:  # as the QLoRA tests and PEFT's QLoRA recipe: base frozen, the rest in fp32
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        model = peft.get_peft_model(model, peft.LoraConfig(**spec["lora"]))
    unique = {id(p): p for p in model.parameters()}.values()
    facts = {"params": sum(logical_numel(p) for p in unique),
             "layer_params": sum(logical_numel(p) for p in layers.parameters()) / len(layers)}
    if system in LORA_BASE:  # the counts of `lora_flops`
        head = model.get_output_embeddings()
        facts.update(base_params=base_params, trainable=sum(p.numel() for p in unique if p.requires_grad),
                     layer_trainable=sum(p.numel() for p in layers.parameters() if p.requires_grad) / len(layers),
                     head_params=logical_numel(head.weight), head_trainable=int(head.weight.requires_grad))
        facts["frozen"] = facts["params"] - facts["trainable"]
    # FSDP2's fully_shard moves each parameter's data to the GPU and frees it once the parameter object is dropped:
    # a reference held here kept a whole 32B base on the GPU (out of memory at 24 GiB)
    del unique
    rows_needed = max(B * accumulation(spec, B) for B in spec["batch_sizes"]) * (spec["steps"] + spec["warmup"])
    folded = None
    if spec.get("data") == "packed_examples":
        dataset = PackedExamples(spec["seq_len"], rows_needed, spec.get("data_dir"), model.config.vocab_size)
        spec["real_fraction"] = dataset.real_fraction
    else:
        ids = gsm8k_token_rows(spec["seq_len"], rows_needed, spec.get("data_dir"))
        if int(ids.max()) >= model.config.vocab_size:  # tiny test shapes: fold the real token ids into their vocabulary
            folded = model.config.vocab_size
            ids = ids % folded
        dataset = sft_dataset(ids) if system in SFT_BASE else TokenRows(ids)
    setup_s = time.perf_counter() - t0
    timer = StepTimer(device)
    timer.watch(model)
    trainer, build_extra, oom_at = None, {}, None
    for B in spec["batch_sizes"]:
        r = row(**base, params=facts["params"], batch_size=B, status="ok",
                extra={"num_hidden_layers": model.config.num_hidden_layers, **quant_extra})
        if os.environ.get("HARNESS_PROFILE_STEP"):  # one profiled step per row (it counts among the timed ones)
            timer.profile_step = int(os.environ["HARNESS_PROFILE_STEP"])
            timer.profile_path = (Path(os.environ.get("HARNESS_PROFILE_DIR", ".")) /
                                  f"profile-{system}-cap{spec['gpu_cap_gib']}-b{B}.txt")
        if oom_at is not None:
            r.update(status="oom", reason=f"not run: batch {oom_at} was already out of memory")
            _emit(out, r)
            continue
        steps = spec["steps"] + spec["warmup"]
        try:
            t1 = time.perf_counter()
            if trainer is None:
                args, build_extra = build_args(system, spec, B, steps)
                trainer = build_trainer(system, spec, model, args, dataset, timer)
                if getattr(trainer, "executor", None) is not None and device == "cuda":
                    trainer.executor.instrument(True)
                if getattr(trainer, "executor", None) is not None and os.environ.get("HARNESS_SLOT_REUSE") == "0":
                    trainer.executor.reuse_slots = False  # A/B of Note [slot reuse] (streaming/executor.py)
            else:  # LazyTrain: same Trainer and executor, new batch size (the MILP replans at train begin)
                trainer.args.per_device_train_batch_size = B
                trainer._train_batch_size = B
                trainer.args.gradient_accumulation_steps = accumulation(spec, B)
                trainer.args.max_steps = steps
            trainer.train()
            fields = _measure(spec, system, B, trainer, timer, facts, model.config)
            r["extra"].update(fields.pop("extra"))
            r.update(fields)
            r["extra"]["linear_attention_kernel"] = linear_attention_kernel(model, trainer)
            wrong = sorted({n for n in timer.rows if n != B * trainer.args.gradient_accumulation_steps})
            rec = r["extra"]["oom_recoveries"]
            if wrong:  # the timings would be of another batch size
                r.update(status="error", reason=f"steps trained on {wrong} rows, not batch {B} x "
                         f"{trainer.args.gradient_accumulation_steps} micro-batches: the batch size did not take "
                         "effect; timings not comparable" +
                         (f" ({rec} out-of-memory recoveries ran steps again)" if rec else ""))
            elif timer.skipped:  # a skipped update costs nothing: its timings would flatter a broken run
                r.update(status="error", reason=f"non-finite gradient norm: {timer.skipped} optimizer steps "
                         "skipped; timings not comparable")
            r["extra"].update(build_extra, setup_s=round(setup_s, 2), train_call_s=round(time.perf_counter() - t1, 2))
            if folded:
                r["extra"]["token_ids_folded_modulo"] = folded
            if timer.profile_step is not None:  # None: the run had fewer steps than the profile step's index
                done = timer.profile_path is not None and timer.profile_path.exists()
                r["extra"].update(profiled_step=timer.profile_step, profile=str(timer.profile_path) if done else None)
        except Exception as e:  # the row carries the failure; a crash of the process is the parent's to report
            traceback.print_exc(file=sys.stderr)
            kind = type(e).__name__
            if _is_oom(e) or "Infeasible" in kind:
                oom_at = B
                r.update(status="oom", reason=f"{kind}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            else:
                r.update(status="error", reason=f"{kind}: {str(e)[:300]}")
            r["extra"].update(build_extra)
            if trainer is not None and getattr(trainer, "oom_recoveries", 0):
                r["extra"]["oom_recoveries"] = int(trainer.oom_recoveries) - timer.recoveries_at_start
            trainer = None  # a failed train() can leave the Trainer half-stepped: rebuild for the next size
            if device == "cuda":
                torch.cuda.empty_cache()
        _emit(out, r)
        if system in ONE_BATCH_PER_PROCESS:
            trainer = None
        elif not system.startswith("lazytrain") and trainer is not None:
            # stock: a fresh Trainer per batch size (only LazyTrain's executor is worth keeping). Drop every reference
            # to the old optimizer states (accelerate's prepared objects, the timer's trainer) before the next
            # Trainer allocates its own
            trainer.accelerator.free_memory()
            trainer.optimizer = trainer.lr_scheduler = None
            trainer = timer.trainer = None
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(spec)


if __name__ == "__main__":
    main()
