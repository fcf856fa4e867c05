"""BENCHMARKS.md and a TFLOPS-vs-batch plot from a harness results file (benchmarks.run).

    python -m benchmarks.report benchmarks/results/7b-YYYYMMDD.json [more.json ...] [--md BENCHMARKS.md] [--png PATH]

Several results files of one suite (calls at different commits) are reported as one table: each row names the file
it came from, the header lists every file's commit and commands.

Markdown: the exact commands, one table per (model, GPU cap) with every row (failures with their reason), the ratios
LazyTrain-MILP / every other system (same batch, and best batch vs best batch), the largest feasible batches, and the
project's targets marked met / not met / not measured: LazyTrain vs the offloading systems (best TFLOPS and largest
batch per system), and 24 GiB vs the uncapped stock Trainer (LazyTrain-MILP at 24 GiB vs the uncapped stock Trainer
measured in the same results file, per batch 8-64, with the most recent file's pair deciding; exposed transfer share
of the step; host bytes per parameter; pinned memory locked vs planned; MegaTrain's 152 TFLOPS at batch 32 as a
reference). PNG (default benchmarks/results/<stem>.png): TFLOPS 6ND vs batch size per system, one panel per cap (a row
of panels per model), out-of-memory batches marked x.

LoRA rows (systems *_lora, suites lora / lora-smoke) get their own table (micro-batches per step, tokens per step,
TFLOPS executed and model, host bytes per base parameter) and targets: LazyTrain-LoRA at 24 GiB >= 0.85x the tokens/s
of the uncapped stock Trainer + PEFT (its best row, >= 32k tokens per optimizer step), the stock Trainer + PEFT out of
memory at 24 GiB, host bytes per base parameter <= 2.1 (bf16 base).

QLoRA rows (lazytrain_qlora, suites lora / qlora-smoke) get the same table with the base's quantization, and targets:
at 24 GiB, nf4 with LoRA r 16 on all linear layers, >= 800 tokens/s (>= 32k tokens per optimizer step), and host
bytes per base parameter <= 0.7 on every lazytrain_qlora row (4-bit weights counted by their original shape).

TRL rows (lazytrain_sft, suites sft / sft-smoke) get the target: lazytrain_sft >= 0.95x the tokens/s of lazytrain_milp
at the same model, cap and batch (TRL's SFTTrainer through LazyTrainerMixin vs LazyTrainer on the same rows).
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from pathlib import Path
from typing import Any

REF = "lazytrain_milp"
ORDER = ("lazytrain_milp", "lazytrain_fixed", "stock_trainer", "stock_trainer_bnb8", "fsdp2_cpu_offload",
         "zero_offload")


LORA_ORDER = ("lazytrain_lora", "stock_trainer_lora", "fsdp2_cpu_offload_lora")
QLORA_ORDER = ("lazytrain_qlora",)
SFT_ORDER = ("lazytrain_sft",)
ORDER = (*ORDER, *LORA_ORDER, *QLORA_ORDER, *SFT_ORDER)
#: the rows of lora_table: LoRA on a bf16 or a 4-bit base
ADAPTER_ORDER = (*LORA_ORDER, *QLORA_ORDER)


def _cap(c: Any) -> str:
    return "uncapped" if c is None else f"{c:g} GiB"


def _f(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:,.{nd}f}" if abs(x) >= 1 or x == 0 else f"{x:.3g}"


def _sort_key(r: dict[str, Any]) -> tuple:
    s = r["system"]
    return (ORDER.index(s) if s in ORDER else len(ORDER), s, r["batch_size"])


def _groups(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault((r["model"], r["gpu_cap_gib"]), []).append(r)
    caps = lambda k: (k[0], float("inf") if k[1] is None else k[1])  # noqa: E731
    return {k: sorted(out[k], key=_sort_key) for k in sorted(out, key=caps)}


def _best(rows: list[dict[str, Any]], system: str) -> dict[str, Any] | None:
    ok = [r for r in rows if r["system"] == system and r["status"] == "ok" and r["tflops_6nd"]]
    return max(ok, key=lambda r: r["tflops_6nd"], default=None)


#: characters of a note shown in a table cell; a longer note is cut at a word boundary and given in full below
NOTE_CELL = 100


def _step(r: dict[str, Any]) -> str:
    if r["step_s_median"] is None:
        return "-"
    if r["step_s_p10"] is None:   # a row recovered from a worker's printed line keeps only the median
        return f"{r['step_s_median']:.3f} (median only)"
    return f"{r['step_s_median']:.3f} ({r['step_s_p10']:.3f}-{r['step_s_p90']:.3f}, n={r['steps_timed']})"


def _note(r: dict[str, Any], full: dict[str, int]) -> str:
    """A row's note cell (its source file, its failure reason or how it was recovered, its out-of-memory
    recoveries); a note longer than NOTE_CELL ends at a word boundary with a reference to its full text, numbered in
    `full` (long note -> number)."""
    extra = r.get("extra") or {}
    recovered = "recovered from the worker's printed line" if extra.get("recovered_from_stdout") else ""
    oom = f"after {extra['oom_recoveries']} out-of-memory recoveries" if extra.get("oom_recoveries") else ""
    note = " ".join(((f"[{r['source']}] " if r.get("source") else "") + (r.get("reason") or recovered or oom)).split())
    if len(note) > NOTE_CELL:
        n = full.setdefault(note, len(full) + 1)
        note = textwrap.shorten(note, NOTE_CELL, placeholder=f" ... (note {n})")
    return note.replace("|", "/")


def _notes_in_full(full: dict[str, int]) -> list[str]:
    return ["", "Notes in full:", "", *[f"{n}. {text}" for text, n in full.items()]] if full else []


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows' table; notes longer than NOTE_CELL end at a word boundary with a reference to the full text, listed
    (once per distinct note) right below the table."""
    out = ["| system | batch | status | step s (p10-p90) | tokens/s | TFLOPS 6ND | TFLOPS exec | peak GPU GiB | "
           "peak RSS GiB | pinned GiB | exposed H2D / D2H ms | optimizer ms | note |",
           "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    full: dict[str, int] = {}  # long note -> its number below the table
    for r in rows:
        xfer = "-" if r["exposed_h2d_ms"] is None else f"{r['exposed_h2d_ms']:.0f} / {r['exposed_d2h_ms'] or 0:.0f}"
        out.append(f"| {r['system']} | {r['batch_size']} | {r['status']} | {_step(r)} | {_f(r['tokens_per_s'], 0)} | "
                   f"{_f(r['tflops_6nd'])} | {_f(r['tflops_executed'])} | {_f(r['peak_gpu_gib'])} | "
                   f"{_f(r['peak_host_rss_gib'])} | {_f(r['pinned_planned_gib'])} | {xfer} | "
                   f"{_f(r['optimizer_ms'], 0)} | {_note(r, full)} |")
    return out + _notes_in_full(full)


def _s(x: float) -> str:
    return f"{x:.3f}" if x >= 0.1 else f"{x:.3g}"


def hybrid_table(rows: list[dict[str, Any]]) -> list[str]:
    """The hybrid suite's table of one (model, cap): step time, TFLOPS 6ND, peak GPU memory, the MILP's prediction
    at train begin (and after calibration) with its error against the measured median, the linear-attention kernel
    that ran, and LazyTrain-MILP / LazyTrain-fixed TFLOPS at the same batch (on the MILP rows)."""
    fixed = {r["batch_size"]: r["tflops_6nd"] for r in rows
             if r["system"] == "lazytrain_fixed" and r["status"] == "ok" and r["tflops_6nd"]}
    out = ["| system | batch | status | step s (p10-p90) | TFLOPS 6ND | peak GPU GiB | predicted s (calibrated) | "
           "prediction error % | linear-attention kernel | MILP / fixed | note |",
           "| --- | ---: | --- | --- | ---: | ---: | --- | ---: | --- | ---: | --- |"]
    full: dict[str, int] = {}
    for r in rows:
        extra = r.get("extra") or {}
        pred, cal, med = r.get("predicted_step_s"), extra.get("predicted_step_s_calibrated"), r["step_s_median"]
        shown = "-" if pred is None else _s(pred) + (f" ({_s(cal)})" if cal is not None else "")
        err = f"{100 * (pred / med - 1):+.1f}" if pred and med else "-"
        ratio = (f"{r['tflops_6nd'] / fixed[r['batch_size']]:.2f}x" if r["system"] == REF and r["status"] == "ok"
                 and r["tflops_6nd"] and r["batch_size"] in fixed else "-")
        out.append(f"| {r['system']} | {r['batch_size']} | {r['status']} | {_step(r)} | {_f(r['tflops_6nd'])} | "
                   f"{_f(r['peak_gpu_gib'])} | {shown} | {err} | {extra.get('linear_attention_kernel') or '-'} | "
                   f"{ratio} | {_note(r, full)} |")
    return out + _notes_in_full(full)


def _quantization(e: dict[str, Any]) -> str:
    """A QLoRA row's base as recorded (worker.quantized_base): "nf4, double quant, bf16 compute, block 64,
    quantized on cuda, built in 41 s (peak RSS 38.2 GiB)"; "-" without one."""
    q, b = e.get("quantization") or {}, e.get("base_build") or {}
    if not q:
        return "-"
    parts = [str(q.get("quant_type")), "double quant" if q.get("double_quant") else "no double quant",
             f"{str(q.get('compute_dtype')).removeprefix('torch.').replace('bfloat16', 'bf16')} compute",
             f"block {q.get('blocksize')}", f"quantized on {q.get('quantized_on')}"]
    if b.get("build_s") is not None:
        parts.append(f"built in {b['build_s']:.0f} s (peak RSS {b.get('peak_rss_gib') or 0:.1f} GiB, base "
                     f"{b.get('base_host_gib') or 0:.1f} GiB)")
    return ", ".join(parts)


def lora_table(rows: list[dict[str, Any]]) -> list[str]:
    """The LoRA rows of one (model, cap): micro-batches per optimizer step, its tokens, tokens/s, TFLOPS executed
    and model (worker.py's definitions), peak memory, host bytes per base parameter, trainable / total parameters;
    with a 4-bit base (QLoRA rows) also its quantization and build."""
    quant = any((r.get("extra") or {}).get("quantization") for r in rows)
    out = ["| system | batch | micro-batches / step | tokens / step | status | step s (p10-p90) | tokens/s | "
           "TFLOPS exec | TFLOPS model | peak GPU GiB | peak RSS GiB | host B / base param | trainable / total params "
           + ("| 4-bit base " if quant else "") + "| note |",
           "| --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | "
           + ("--- | " if quant else "") + "--- |"]
    full: dict[str, int] = {}
    for r in rows:
        e = r.get("extra") or {}
        params = (f"{e['trainable_params']:,} / {e['total_params']:,}"
                  if e.get("trainable_params") and e.get("total_params") else "-")
        out.append(f"| {r['system']} | {r['batch_size']} | {e.get('gradient_accumulation_steps') or '-'} | "
                   f"{e.get('tokens_per_step') or '-'} | {r['status']} | {_step(r)} | {_f(r['tokens_per_s'], 0)} | "
                   f"{_f(r['tflops_executed'])} | {_f(e.get('tflops_model'))} | {_f(r['peak_gpu_gib'])} | "
                   f"{_f(r['peak_host_rss_gib'])} | {_f(e.get('host_bytes_per_base_param'), 2)} | {params} | "
                   + (f"{_quantization(e)} | " if quant else "") + f"{_note(r, full)} |")
    return out + _notes_in_full(full)


#: LoRA targets: LazyTrain-LoRA at this cap vs the uncapped stock Trainer + PEFT (tokens/s), at >= this many tokens
#: per optimizer step; host bytes per base parameter of a bf16 base
LORA_CAP, LORA_MIN_TOKENS, LORA_VS_STOCK, LORA_HOST_BYTES = 24, 32768, 0.85, 2.1


def lora_targets(doc: dict[str, Any], model: str) -> list[str]:
    """LoRA goals for `model`, each met / not met / not measured: lazytrain_lora at 24 GiB >= 0.85x the tokens/s of
    the uncapped stock_trainer_lora (best ok rows with >= 32k tokens per optimizer step), stock_trainer_lora out of
    memory at 24 GiB, and host bytes per base parameter <= 2.1 on every lazytrain_lora row (the largest decides)."""
    rows = [r for r in doc["rows"] if r["model"] == model]

    def best(system: str, cap: Any) -> dict[str, Any] | None:
        ok = [r for r in rows if (r["system"], r["gpu_cap_gib"], r["status"]) == (system, cap, "ok")
              and r["tokens_per_s"] and ((r.get("extra") or {}).get("tokens_per_step") or 0) >= LORA_MIN_TOKENS]
        return max(ok, key=lambda r: r["tokens_per_s"], default=None)

    def where(r: dict[str, Any]) -> str:
        e = r.get("extra") or {}
        return (f"B={r['batch_size']} x {e.get('gradient_accumulation_steps')}, {e.get('tokens_per_step')} tokens/step"
                + (f", {r['source']}" if r.get("source") else ""))

    out = [f"| target ({model}, LoRA) | measured | verdict |", "| --- | --- | --- |"]
    lt, st = best("lazytrain_lora", LORA_CAP), best("stock_trainer_lora", None)
    name = (f"{LORA_CAP} GiB: lazytrain_lora >= {LORA_VS_STOCK}x the uncapped stock_trainer_lora tokens/s "
            f"(>= {LORA_MIN_TOKENS // 1024}k tokens per optimizer step)")
    if lt and st:
        v = lt["tokens_per_s"] / st["tokens_per_s"]
        out.append(f"| {name} | {v:.2f}x ({lt['tokens_per_s']:,.0f} at {where(lt)} vs {st['tokens_per_s']:,.0f} at "
                   f"{where(st)}) | {'met' if v >= LORA_VS_STOCK else 'not met'} |")
    else:
        out.append(f"| {name} | - | not measured |")
    capped = [r for r in rows if (r["system"], r["gpu_cap_gib"]) == ("stock_trainer_lora", LORA_CAP)]
    name = f"{LORA_CAP} GiB: stock_trainer_lora runs out of memory"
    if capped:
        oom = all(r["status"] == "oom" for r in capped)
        shown = ", ".join(f"B={r['batch_size']}: {r['status']}" for r in sorted(capped, key=lambda r: r["batch_size"]))
        out.append(f"| {name} | {shown} | {'met' if oom else 'not met'} |")
    else:
        out.append(f"| {name} | - | not measured |")
    vals = [(e["host_bytes_per_base_param"], r) for r in rows if r["system"] == "lazytrain_lora" and r["status"] == "ok"
            and (e := r.get("extra") or {}).get("host_bytes_per_base_param") is not None]
    name = (f"host bytes per base parameter <= {LORA_HOST_BYTES} (lazytrain_lora, bf16 base; peak RSS less the CPU "
            "tier's activation buffers)")
    out.append(_largest_line(name, vals, LORA_HOST_BYTES,
                             lambda v, r: f"{v:.2f} (largest: {_cap(r['gpu_cap_gib'])}, {where(r)})"))
    return out


def _largest_line(name: str, items: list[tuple[float, dict[str, Any]]], limit: float, shown: Any) -> str:
    """A target row "the largest of `items` (value, row) <= `limit`": `shown(value, row)` and met / not met, or
    not measured without items."""
    if not items:
        return f"| {name} | - | not measured |"
    v, r = max(items, key=lambda x: x[0])
    return f"| {name} | {shown(v, r)} | {'met' if v <= limit else 'not met'} |"


#: QLoRA targets: lazytrain_qlora at this cap, on an nf4 base with LoRA r 16 on all linear layers and >= this many
#: tokens per optimizer step, >= this many tokens/s; host bytes per base parameter (4-bit weights counted by their
#: original shape) on every lazytrain_qlora row
QLORA_CAP, QLORA_MIN_TOKENS, QLORA_TOKENS_PER_S, QLORA_HOST_BYTES = 24, 32768, 800.0, 0.7


def qlora_targets(doc: dict[str, Any], model: str) -> list[str]:
    """QLoRA goals for `model`, each met / not met / not measured: at 24 GiB lazytrain_qlora (nf4, LoRA r 16 on
    all-linear, >= 32k tokens per optimizer step: the best such ok row) >= 800 tokens/s; host bytes per base parameter
    <= 0.7 on every ok lazytrain_qlora row (the largest decides). A target with no ok row shows the rows' statuses."""
    rows = [r for r in doc["rows"] if r["model"] == model and r["system"] in QLORA_ORDER]

    def claim(r: dict[str, Any]) -> bool:  # the row is of the stated configuration
        e = r.get("extra") or {}
        lora, q = e.get("lora") or {}, e.get("quantization") or {}
        return (q.get("quant_type") == "nf4" and lora.get("r") == 16 and lora.get("target_modules") == "all-linear"
                and (e.get("tokens_per_step") or 0) >= QLORA_MIN_TOKENS)

    def where(r: dict[str, Any]) -> str:
        e = r.get("extra") or {}
        return (f"{_cap(r['gpu_cap_gib'])}, B={r['batch_size']} x {e.get('gradient_accumulation_steps')}, "
                f"{e.get('tokens_per_step')} tokens/step, {e.get('base_params') or 0:,} base params"
                + (f", {r['source']}" if r.get("source") else ""))

    def statuses(rs: list[dict[str, Any]]) -> str:
        return "; ".join(f"{_cap(r['gpu_cap_gib'])} B={r['batch_size']}: {r['status']}" for r in rs) or "-"

    out = [f"| target ({model}, QLoRA) | measured | verdict |", "| --- | --- | --- |"]
    capped = [r for r in rows if r["gpu_cap_gib"] == QLORA_CAP]
    ok = [r for r in capped if r["status"] == "ok" and r["tokens_per_s"] and claim(r)]
    name = (f"{QLORA_CAP} GiB: lazytrain_qlora (nf4, LoRA r 16 on all linear layers, >= {QLORA_MIN_TOKENS // 1024}k "
            f"tokens per optimizer step) >= {QLORA_TOKENS_PER_S:g} tokens/s")
    if ok:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        out.append(f"| {name} | {best['tokens_per_s']:,.0f} ({where(best)}) | "
                   f"{'met' if best['tokens_per_s'] >= QLORA_TOKENS_PER_S else 'not met'} |")
    else:
        out.append(f"| {name} | {statuses(capped)} | not measured |")
    vals = [(e["host_bytes_per_base_param"], r) for r in rows if r["status"] == "ok"
            and (e := r.get("extra") or {}).get("host_bytes_per_base_param") is not None]
    name = (f"host bytes per base parameter <= {QLORA_HOST_BYTES} (lazytrain_qlora, 4-bit base; peak RSS less the "
            "CPU tier's activation buffers)")
    if vals:
        v, r = max(vals, key=lambda x: x[0])
        out.append(f"| {name} | {v:.2f} (largest: {where(r)}) | {'met' if v <= QLORA_HOST_BYTES else 'not met'} |")
    else:
        out.append(f"| {name} | {statuses(rows)} | not measured |")
    return out


#: TRL target: lazytrain_sft's tokens/s >= this x lazytrain_milp's at the same model, cap and batch
SFT_VS_MILP = 0.95


def sft_targets(doc: dict[str, Any], model: str) -> list[str]:
    """TRL's SFTTrainer through the mixin vs LazyTrainer for `model`: per (cap, batch) that lazytrain_sft ran at,
    lazytrain_sft / lazytrain_milp tokens/s, met at >= 0.95x; not measured unless both rows are ok."""
    rows = {(r["system"], r["gpu_cap_gib"], r["batch_size"]): r for r in doc["rows"] if r["model"] == model}
    out = [f"| target ({model}, TRL SFTTrainer) | measured | verdict |", "| --- | --- | --- |"]
    for (_, cap, B), sft in sorted(((k, r) for k, r in rows.items() if k[0] in SFT_ORDER),
                                   key=lambda kr: (float("inf") if kr[0][1] is None else kr[0][1], kr[0][2])):
        milp = rows.get(("lazytrain_milp", cap, B))
        name = f"{_cap(cap)}, B={B}: lazytrain_sft >= {SFT_VS_MILP}x the lazytrain_milp tokens/s"
        if milp and sft["status"] == milp["status"] == "ok" and sft["tokens_per_s"] and milp["tokens_per_s"]:
            v = sft["tokens_per_s"] / milp["tokens_per_s"]
            out.append(f"| {name} | {v:.3f}x ({sft['tokens_per_s']:,.0f} vs {milp['tokens_per_s']:,.0f}) | "
                       f"{'met' if v >= SFT_VS_MILP else 'not met'} |")
        else:
            out.append(f"| {name} | lazytrain_sft {sft['status']}, lazytrain_milp "
                       f"{milp['status'] if milp else 'not run'} | not measured |")
    return out


#: paper-suite targets (3B-14B dense, product defaults): every LazyTrain row's train-begin prediction within 10%;
#: under 24 GiB at >= 32k tokens per step the MILP >= 0.9x the uncapped stock Trainer's TFLOPS 6ND at the same batch;
#: 14B under 24 GiB: the exposed CPU-update wait <= 5% of the step and >= 370 TFLOPS 6ND; peak host RSS <= 7.0 bytes
#: per parameter for every LazyTrain row
PAPER_PRED, PAPER_VS_STOCK, PAPER_14B_WAIT, PAPER_14B_TFLOPS, PAPER_HOST_B = 0.10, 0.9, 0.05, 370.0, 7.0


def paper_targets(doc: dict[str, Any], model: str) -> list[str]:
    """The paper suite's targets for `model` (PAPER_*): one line each, "not measured" where a row is missing."""
    rows = [r for r in doc["rows"] if r["model"] == model]
    ok = [r for r in rows if r["system"] in LT_POLICIES and r["status"] == "ok"]
    out = [f"| target ({model}, product defaults) | measured | verdict |", "| --- | --- | --- |"]
    pred = [(r, r["predicted_step_s"] / r["step_s_median"] - 1) for r in ok
            if r.get("predicted_step_s") and r.get("step_s_median")]
    name = f"every LazyTrain row: prediction at train begin within {PAPER_PRED:.0%} of the measured median"
    if pred:
        r, e = max(pred, key=lambda x: abs(x[1]))
        out.append(f"| {name} | worst {e:+.1%} ({r['system']}, {_cap(r['gpu_cap_gib'])}, B={r['batch_size']}) | "
                   f"{'met' if abs(e) <= PAPER_PRED else 'not met'} |")
    else:
        out.append(f"| {name} | - | not measured |")
    stock = {r["batch_size"]: r for r in rows if r["system"] == "stock_trainer" and r["gpu_cap_gib"] is None}
    for r in sorted((r for r in rows if r["system"] == "lazytrain_milp" and r["gpu_cap_gib"] == 24
                     and r["batch_size"] * r["seq_len"] >= 32768), key=lambda r: r["batch_size"]):
        ref = stock.get(r["batch_size"])
        name = f"24 GiB, B={r['batch_size']}: lazytrain_milp >= {PAPER_VS_STOCK}x the uncapped stock Trainer's TFLOPS 6ND"
        if ref is None:
            out.append(f"| {name} | stock not run | not measured |")
        elif ref["status"] != "ok":  # the target holds where stock runs
            out.append(f"| {name} | stock {ref['status']} | n/a (stock does not run) |")
        elif r["status"] != "ok" or not r["tflops_6nd"]:
            out.append(f"| {name} | lazytrain_milp {r['status']} | not met |")
        else:
            v = r["tflops_6nd"] / ref["tflops_6nd"]
            out.append(f"| {name} | {v:.3f}x ({r['tflops_6nd']:.1f} vs {ref['tflops_6nd']:.1f}) | "
                       f"{'met' if v >= PAPER_VS_STOCK else 'not met'} |")
    if "14b" in model:
        big = [r for r in ok if r["system"] == "lazytrain_milp" and r["gpu_cap_gib"] == 24]
        name = (f"24 GiB: exposed CPU-update wait <= {PAPER_14B_WAIT:.0%} of the step and >= {PAPER_14B_TFLOPS:.0f} "
                "TFLOPS 6ND (best MILP row)")
        if big:
            r = max(big, key=lambda r: r["tflops_6nd"] or 0)
            wait = (r.get("extra") or {}).get("exposed_update_wait_ms")
            share = None if wait is None else wait / 1e3 / r["step_s_median"]
            met = share is not None and share <= PAPER_14B_WAIT and (r["tflops_6nd"] or 0) >= PAPER_14B_TFLOPS
            shown = "-" if share is None else f"{share:.1%}"
            out.append(f"| {name} | wait {shown}, {_f(r['tflops_6nd'])} TFLOPS (B={r['batch_size']}) | "
                       f"{'met' if met else 'not met'} |")
        else:
            out.append(f"| {name} | - | not measured |")
    host = [(r["peak_host_rss_gib"] * 2**30 / r["params"], r) for r in ok
            if r.get("peak_host_rss_gib") and r.get("params")]
    out.append(_largest_line(f"every LazyTrain row: peak host RSS <= {PAPER_HOST_B} bytes per parameter", host,
                             PAPER_HOST_B, lambda b, r: f"largest {b:.2f} ({r['system']}, {_cap(r['gpu_cap_gib'])}, "
                                                        f"B={r['batch_size']})"))
    return out


#: hybrid-family targets: at 80 GiB batch 72 the MILP >= this x the fixed policy and >= this TFLOPS 6ND; at 24 GiB
#: the MILP trains at batch >= 8 and its largest batch >= the fixed policy's + 1; every row's prediction at train
#: begin within 10% of its measured median
HYBRID_VS_FIXED, HYBRID_TFLOPS, HYBRID_PRED = 1.12, 250.0, 0.10
LT_POLICIES = ("lazytrain_milp", "lazytrain_fixed")


def hybrid_targets(doc: dict[str, Any], model: str) -> list[str]:
    """The hybrid suite's goals for `model`, each met / not met / not measured. A MILP search stopped at its limit
    counts as ">= limit" (`run.py`'s per-system max_batch_limit)."""
    rows = [r for r in doc["rows"] if r["model"] == model]

    def ok(system: str, cap: Any, B: int | None = None) -> list[dict[str, Any]]:
        return [r for r in rows if (r["system"], r["gpu_cap_gib"], r["status"]) == (system, cap, "ok")
                and (B is None or r["batch_size"] == B)
                and not ((r.get("extra") or {}).get("oom_recoveries") or 0)]

    out = [f"| target ({model}) | measured | verdict |", "| --- | --- | --- |"]
    m, f = ok("lazytrain_milp", 80, 72), ok("lazytrain_fixed", 80, 72)
    name = f"80 GiB, B=72: MILP >= {HYBRID_VS_FIXED}x fixed, no out-of-memory recovery"
    if m and f:
        v = f[0]["step_s_median"] / m[0]["step_s_median"]
        out.append(f"| {name} | {v:.2f}x ({m[0]['step_s_median']:.2f} vs {f[0]['step_s_median']:.2f} s) | "
                   f"{'met' if v >= HYBRID_VS_FIXED else 'not met'} |")
    else:
        out.append(f"| {name} | - | not measured |")
    name = f"80 GiB, B=72: MILP >= {HYBRID_TFLOPS:g} TFLOPS 6ND"
    out.append(f"| {name} | {m[0]['tflops_6nd']:.1f} | {'met' if m[0]['tflops_6nd'] >= HYBRID_TFLOPS else 'not met'} |"
               if m and m[0]["tflops_6nd"] else f"| {name} | - | not measured |")
    small = [r for r in ok("lazytrain_milp", 24) if r["batch_size"] >= 8]
    name = "24 GiB: MILP trains at batch >= 8"
    out.append(f"| {name} | B={max(r['batch_size'] for r in small)} | met |" if small
               else f"| {name} | - | {'not met' if any(r['gpu_cap_gib'] == 24 for r in rows) else 'not measured'} |")
    search = {e["system"]: e for e in doc.get("max_batch", []) if (e["model"], e["gpu_cap_gib"]) == (model, 24)}
    name = "24 GiB: MILP largest batch >= fixed's + 1 (searches to adjacent sizes)"
    em, ef = search.get("lazytrain_milp"), search.get("lazytrain_fixed")
    if em and ef and em.get("complete") and em.get("max_batch") and ef.get("max_batch"):
        at_limit = em.get("first_infeasible") is None and em["max_batch"] >= (em.get("limit") or 0)
        # an unfinished fixed search decides the claim once the fixed policy failed at or below the MILP's largest
        hi = ef.get("first_infeasible")
        fixed = str(ef["max_batch"]) if ef.get("complete") else \
            f"{ef['max_batch']}-{hi - 1} (search unfinished)" if hi else f">= {ef['max_batch']} (search unfinished)"
        shown = f"MILP {'>= ' if at_limit else ''}{em['max_batch']}, fixed {fixed}"
        if ef.get("complete"):
            verdict = "met" if em["max_batch"] >= ef["max_batch"] + 1 else "not met"
        else:
            verdict = "met" if hi is not None and hi <= em["max_batch"] else \
                "not met" if ef["max_batch"] >= em["max_batch"] else "not measured"
        out.append(f"| {name} | {shown} | {verdict} |")
    else:
        out.append(f"| {name} | - | not measured |")
    pred = [(r, r["predicted_step_s"] / r["step_s_median"] - 1) for r in rows if r["system"] in LT_POLICIES
            and r["status"] == "ok" and r.get("predicted_step_s") and r.get("step_s_median")]
    name = f"every LazyTrain row: prediction at train begin within {HYBRID_PRED:.0%} of the measured median"
    if pred:
        worst = max(pred, key=lambda x: abs(x[1]))
        out.append(f"| {name} | worst {worst[1]:+.1%} ({_cap(worst[0]['gpu_cap_gib'])}, B={worst[0]['batch_size']}) | "
                   f"{'met' if abs(worst[1]) <= HYBRID_PRED else 'not met'} |")
    else:
        out.append(f"| {name} | - | not measured |")
    kernels = sorted({str((r.get("extra") or {}).get("linear_attention_kernel")) for r in rows if r["status"] == "ok"})
    out.append(f"| the linear-attention kernel that ran is recorded | {', '.join(kernels) or '-'} | "
               f"{'met' if kernels and 'None' not in kernels else 'not measured' if not kernels else 'not met'} |")
    return out


#: how the LoRA rows count FLOPs (benchmarks/worker.py, systems.lora_flops)
LORA_FLOPS_TEXT = (
    "LoRA rows (`*_lora`: PEFT adapters on a frozen bf16 base; extra.lora holds the LoraConfig) train "
    "`tokens / step` tokens per optimizer step (batch x micro-batches per step x sequence length; gradient "
    "accumulation); a step is timed over all its micro-batches and tokens/s counts all its tokens. `TFLOPS 6ND` does "
    "not apply (6 FLOPs per parameter per token count weight gradients a frozen base does not compute). `TFLOPS exec` "
    "counts what ran: per decoder layer, every forward pass (the forward and each recompute) 2 x N_layer x tokens "
    "(N_layer: the layer's base and adapter parameters), the backward's input gradients 2 x N_layer x tokens, the "
    "adapters' weight gradients 2 x N_trainable x tokens, causal attention 2 x tokens x seq_len x heads x head_dim "
    "per forward and twice that in the backward; the frozen LM head 4 x N_head x tokens (forward and input "
    "gradient); the embedding lookup none. `TFLOPS model` = (4 x N_frozen + 6 x N_trainable) x tokens / step time, "
    "LazyTrainer's logged figure. Host bytes per base parameter = (peak RSS - the CPU activation tier's host buffers) "
    "/ base parameters.")
#: how QLoRA rows count parameters (benchmarks/worker.py)
QLORA_TEXT = (
    "QLoRA rows (`lazytrain_qlora`: the same adapters on a bitsandbytes 4-bit base, built module by module and "
    "quantized as from_pretrained with that BitsAndBytesConfig would, then peft.prepare_model_for_kbit_training, which "
    "keeps the embedding, norms and LM head in fp32) count every parameter as above with a 4-bit weight counted by its "
    "original shape (two per packed byte), so `TFLOPS exec`, `TFLOPS model` and host bytes per base parameter use the "
    "model's logical parameters.")


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    """LazyTrain-MILP / each other system: best vs best TFLOPS 6ND, and at each batch size both ran."""
    ref = _best(rows, REF)
    if ref is None:
        return [f"No measured {REF} row here: no ratios."]
    if not {r["system"] for r in rows} - {REF}:
        return [f"Only {REF} rows at this cap: no ratios here (the uncapped stock Trainer, where measured, is under "
                "cap none)."]
    mine = {r["batch_size"]: r["tflops_6nd"] for r in rows if r["system"] == REF and r["status"] == "ok"}
    out = [f"Ratios {REF} / system (TFLOPS 6ND). {REF} best: {ref['tflops_6nd']:.3g} at batch {ref['batch_size']}.",
           "", "| system | its best TFLOPS 6ND (batch) | best / best | same batch |", "| --- | --- | ---: | --- |"]
    for system in sorted({r["system"] for r in rows} - {REF}, key=lambda s: ORDER.index(s) if s in ORDER else 99):
        b = _best(rows, system)
        if b is None:
            st = sorted({r["status"] for r in rows if r["system"] == system})
            out.append(f"| {system} | none ({', '.join(st)}) | {REF} only | - |")
            continue
        same = [f"B={r['batch_size']}: {mine[r['batch_size']] / r['tflops_6nd']:.2f}x" for r in rows
                if r["system"] == system and r["status"] == "ok" and r["batch_size"] in mine and r["tflops_6nd"]]
        out.append(f"| {system} | {b['tflops_6nd']:.1f} ({b['batch_size']}) | {ref['tflops_6nd'] / b['tflops_6nd']:.2f}x "
                   f"| {'; '.join(same) or '-'} |")
    return out


def _probe(p: dict[str, Any]) -> str:
    ok = p.get("feasible", p["status"] == "ok" if p["status"] in ("ok", "oom", "timeout") else None)
    what = "feasible" if ok else ("infeasible" if ok is False else p["status"])
    why = " (out-of-memory recovery)" if p.get("oom_recoveries") else ""
    return f"{p['batch_size']} {what}{why}"


def max_batch_table(entries: list[dict[str, Any]]) -> list[str]:
    """The largest-batch searches, each with its probes in the order run (batch size and outcome)."""
    if not entries:
        return []
    out = ["| model | cap | system | largest feasible batch | first infeasible | complete | probes (in order) |",
           "| --- | --- | --- | ---: | ---: | --- | --- |"]
    for e in sorted(entries, key=lambda e: (e["model"], str(e["gpu_cap_gib"]), e["system"])):
        out.append(f"| {e['model']} | {_cap(e['gpu_cap_gib'])} | {e['system']} | {e['max_batch'] or 'none'} | "
                   f"{e['first_infeasible'] or '-'} | {e['complete']} | "
                   f"{'; '.join(_probe(p) for p in e['probes']) or '-'} |")
    return out


def _max_batch(doc: dict[str, Any], system: str, model: str, cap: Any) -> int | None:
    e = next((e for e in doc.get("max_batch", []) if (e["system"], e["model"], e["gpu_cap_gib"]) ==
              (system, model, cap)), None)
    if e is not None:
        return e["max_batch"]
    ok = [r["batch_size"] for r in doc["rows"] if (r["system"], r["model"], r["gpu_cap_gib"]) == (system, model, cap)
          and r["status"] == "ok"]
    return max(ok, default=None)


def targets(doc: dict[str, Any], model: str = "qwen2.5-7b") -> list[str]:
    """The published goals of LazyTrain vs the offloading systems, each met / not met / not measured."""
    rows = doc["rows"]
    by = {cap: [r for r in rows if r["model"] == model and r["gpu_cap_gib"] == cap] for cap in (24, 80)}
    best = lambda cap, s: (_best(by[cap], s) or {}).get("tflops_6nd")  # noqa: E731
    out = [f"| target ({model}) | measured | verdict |", "| --- | --- | --- |"]

    def check(name: str, value: float | None, goal: float, unit: str = "x") -> None:
        v = "not measured" if value is None else ("met" if value >= goal else "not met")
        shown = "-" if value is None else ("inf (the other system: no feasible batch)" if value == math.inf else
                                          f"{value:.2f}{unit}" if unit != "" else f"{value:g}")
        out.append(f"| {name} | {shown} | {v} |")

    def ran(cap: int, system: str) -> bool:   # rows, ok or failed (oom, error, timeout)
        return any(r["system"] == system for r in by[cap])

    # a MILP that ran and failed everywhere is "not met" (0), not "not measured"
    m24 = best(24, REF) or (0.0 if ran(24, REF) else None)
    m80 = best(80, REF) or (0.0 if ran(80, REF) else None)
    for other, goal in (("lazytrain_fixed", 1.3), ("fsdp2_cpu_offload", 3.0), ("zero_offload", 3.0)):
        o = best(24, other)
        value = m24 / o if m24 is not None and o else (math.inf if m24 and ran(24, other) else None)
        check(f"24 GiB: MILP >= {goal}x {other}", value, goal)
    check("24 GiB: MILP >= 350 TFLOPS 6ND", m24, 350, " TFLOPS")
    mb = _max_batch(doc, REF, model, 24)
    mb = mb if mb is not None else (0 if ran(24, REF) else None)
    check("24 GiB: MILP largest batch >= 64", mb, 64, "")
    b8 = _max_batch(doc, "stock_trainer_bnb8", model, 24)
    bnb_oom = any(r["system"] == "stock_trainer_bnb8" and r["status"] == "oom" for r in by[24])
    ratio = mb / b8 if mb is not None and b8 else (math.inf if mb and bnb_oom else None)
    searched = any((e["system"], e["model"], e["gpu_cap_gib"]) == ("stock_trainer_bnb8", model, 24)
                   for e in doc.get("max_batch", []))
    check("24 GiB: MILP largest batch >= 4x stock 8-bit Adam's" +
          ("" if searched or not b8 else " (8-bit Adam: largest measured batch, no search: an upper bound on the "
           "ratio)"), ratio, 4)
    check("80 GiB: MILP >= 450 TFLOPS 6ND at the best batch", m80, 450, " TFLOPS")
    return out


#: MILP at this cap vs the uncapped stock Trainer (the all-on-GPU baseline), per batch size
STOCK_PAIR_CAP, STOCK_PAIR_BATCHES, MEGATRAIN_B32 = 24, (8, 16, 32, 64), 152.0


def _per_file(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A document's rows split by their results file (row "source"; a merged doc's "sources" give the order), so a
    caller without the per-file docs never pairs rows of different runs."""
    by: dict[Any, list[dict[str, Any]]] = {}
    for r in doc["rows"]:
        by.setdefault(r.get("source"), []).append(r)
    names = [s["file"] for s in doc.get("sources", [])]
    return [(n or "this results file", {"rows": by[n]}) for n in names + [n for n in by if n not in names] if n in by]


def targets_vs_stock(doc: dict[str, Any], docs: list[tuple[str, dict[str, Any]]] | None = None,
                     model: str = "qwen2.5-7b") -> list[str]:
    """The goals of LazyTrain-MILP under a 24 GiB cap (seq 1024) vs the uncapped stock Trainer, each met / not met /
    not measured.
    `doc` is the merged document; `docs` the results files (name, doc) in command-line order, later = more recent
    (default: `doc`'s rows split by their source file)."""
    cap = STOCK_PAIR_CAP
    out = [f"| target ({model}) | measured | verdict |", "| --- | --- | --- |"]
    is_milp = lambda r: (r["system"], r["model"], r["gpu_cap_gib"]) == (REF, model, cap)  # noqa: E731
    is_stock = lambda r: (r["system"], r["model"], r["gpu_cap_gib"]) == ("stock_trainer", model, None)  # noqa: E731
    milp = sorted((r for r in doc["rows"] if is_milp(r) and r["status"] == "ok"), key=lambda r: r["batch_size"])

    # 1. same-run pairs only: the stock Trainer's speed drifts between machines and runs
    files = []
    for name, d in (docs if docs is not None else _per_file(doc)):
        last = {(r["system"], r["batch_size"]): r for r in d["rows"] if is_milp(r) or is_stock(r)}  # later row wins
        files.append((name, last))
    for B in STOCK_PAIR_BATCHES:
        name = f"{cap} GiB, B={B}: MILP >= 0.85x stock Trainer (uncapped) TFLOPS 6ND, same run"
        pairs = []
        for fname, last in files:
            m, st = last.get((REF, B)), last.get(("stock_trainer", B))
            if (m and st and m["status"] == st["status"] == "ok" and m["tflops_6nd"] and st["tflops_6nd"]
                    and m["seq_len"] == st["seq_len"]):   # equal tokens/step
                pairs.append((m["tflops_6nd"] / st["tflops_6nd"], fname))
        if pairs:
            ratio, fname = pairs[-1]
            lo, hi = min(p[0] for p in pairs), max(p[0] for p in pairs)
            spread = (f"all same-run pairs {lo:.2f}-{hi:.2f}x, n={len(pairs)}" if len(pairs) > 1 else
                      "the only same-run pair")
            out.append(f"| {name} | {ratio:.2f}x ({fname}); {spread} | {'met' if ratio >= 0.85 else 'not met'} |")
            continue
        st_rows = [r for _, last in files if (r := last.get(("stock_trainer", B)))]
        oom = [f for f, last in files if (last.get(("stock_trainer", B)) or {}).get("status") == "oom"]
        if oom and not any(r["status"] == "ok" for r in st_rows) and any(r["batch_size"] == B for r in milp):
            out.append(f"| {name} | stock out of memory uncapped ({oom[-1]}); MILP ok | met (LazyTrain only) |")
        else:
            out.append(f"| {name} | - | not measured |")

    # 2. exposed transfer share, only where a step has enough tokens to hide it
    big = [r for r in milp if r["seq_len"] and r["batch_size"] * r["seq_len"] >= 16384]
    for r in big:
        name = f"{cap} GiB, B={r['batch_size']}: exposed transfer <= 10% of step time (>= 16k tokens/step)"
        if r["exposed_h2d_ms"] is None or r["exposed_d2h_ms"] is None or not r["step_s_median"]:
            out.append(f"| {name} | - | not measured |")
            continue
        ms = r["exposed_h2d_ms"] + r["exposed_d2h_ms"]
        share = ms / (r["step_s_median"] * 1000)
        out.append(f"| {name} | {share:.1%} ({ms:.0f} of {r['step_s_median'] * 1000:.0f} ms, "
                   f"{r.get('source', 'this results file')}) | {'met' if share <= 0.10 else 'not met'} |")
    if not big:
        out.append(f"| {cap} GiB: exposed transfer <= 10% of step time (>= 16k tokens/step) | - | not measured |")

    # 3. and 4. the worst row decides (each batch's latest row; its file named, as rows of older code stay until
    # re-measured): (target, numerator key, its scale, denominator key, goal, shown as)
    masters = sorted({m for r in milp if (m := ((r.get("extra") or {}).get("lazytrain_config") or {})
                                          .get("master_weights"))})
    for what, num, scale, den, goal, shown in (
            (f"host bytes per parameter <= 10 (peak RSS; master weights: {', '.join(masters) or '-'})",
             "peak_host_rss_gib", 2**30, "params", 10, "{:.1f} (largest, B={}, {})"),
            ("pinned memory locked <= 1.05x planned", "pinned_locked_gib", 1, "pinned_planned_gib", 1.05,
             "{:.3f}x (largest, B={}, {})")):
        vals = [(r[num] * scale / r[den], r["batch_size"], r.get("source", "this results file")) for r in milp
                if r[num] is not None and r[den]]
        if vals:
            v, B, src = max(vals)
            out.append(f"| {cap} GiB: {what} | {shown.format(v, B, src)} | {'met' if v <= goal else 'not met'} |")
        else:
            out.append(f"| {cap} GiB: {what} | - | not measured |")

    # 5. reference point, not a goal of ours to tune for
    r32 = next((r for r in milp if r["batch_size"] == 32 and r["tflops_6nd"]), None)
    name = f"{cap} GiB, B=32: MILP vs MegaTrain's {MEGATRAIN_B32:g} TFLOPS (reference, same cap)"
    if r32:
        v = r32["tflops_6nd"] / MEGATRAIN_B32
        out.append(f"| {name} | {v:.2f}x ({r32['tflops_6nd']:.1f} TFLOPS 6ND, {r32.get('source', 'this results file')}) "
                   "| reference |")
    else:
        out.append(f"| {name} | - | not measured |")
    return out


def merge(docs: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One report document from several results files (name, doc) of one suite: rows and max-batch entries
    concatenated (a later file's row for the same (system, model, cap, batch) replaces an earlier one), each row's
    "source" set to its file's name; "sources" lists every file with its commit, date, machine and commands."""
    if len(docs) == 1:
        return docs[0][1]
    suites = {d["suite"] for _, d in docs}
    if len(suites) > 1:
        raise ValueError(f"results files of different suites {sorted(suites)}: report them separately")
    rows: dict[tuple, dict[str, Any]] = {}
    max_batch: dict[tuple, dict[str, Any]] = {}
    for name, d in docs:
        for r in d["rows"]:
            rows[(r["system"], r["model"], r["gpu_cap_gib"], r["batch_size"])] = dict(r, source=name)
        for e in d.get("max_batch", []):
            max_batch[(e["system"], e["model"], e["gpu_cap_gib"])] = dict(e, source=name)
    return {"suite": suites.pop(), "date": max(d["date"] for _, d in docs), "rows": list(rows.values()),
            "max_batch": list(max_batch.values()),
            "sources": [{"file": name, "git_commit": d.get("git_commit"), "date": d.get("date"),
                         "machine": d.get("machine", {}), "commands": d.get("commands", [d.get("command", "")]),
                         "notes": d.get("notes")} for name, d in docs]}


def _header(doc: dict[str, Any]) -> list[str]:
    def machine(m: dict[str, Any]) -> str:
        return (f"{m.get('gpu', 'no GPU')} ({m.get('gpu_memory_gib', '-')} GiB), {m.get('cpu_cores')} CPU cores, "
                f"{m.get('host_memory_gib', '-')} GiB host memory; torch {m.get('torch')}, "
                f"transformers {m.get('transformers')}")

    if "sources" not in doc:
        head = doc.get("git_commit")
        other: dict[str, list[str]] = {}  # rows and searches resumed at another commit name theirs (benchmarks/run.py)
        for r in doc.get("rows", []) + doc.get("max_batch", []):
            c = (r.get("extra") or {}).get("git_commit")
            if c and c != head:
                other.setdefault(c, []).append(f"{r['system']} {_cap(r['gpu_cap_gib'])} "
                                               + (f"B={r['batch_size']}" if "batch_size" in r else "search"))
        also = "".join(f"; commit `{c[:7]}`: {', '.join(v)}" for c, v in other.items())
        return [f"Commit `{head}`{' for the other rows' if other else ''}{also}, on "
                f"{machine(doc.get('machine', {}))}.", "",
                "Commands (in this order, resuming one results file):", "",
                "```", *doc.get("commands", [doc.get("command", "")]), "python -m benchmarks.report <results.json>",
                "```", ""]
    out = ["Rows from several results files (column `source`), each with its commit, machine and commands:", ""]
    for s in doc["sources"]:
        out += [f"- `{s['file']}` ({s['date']}): commit `{s['git_commit']}` on {machine(s['machine'])}.",
                *([f"  Notes: {s['notes']}"] if s.get("notes") else []), "", "  ```",
                *[f"  {c}" for c in s["commands"]], "  ```", ""]
    return out


def markdown(doc: dict[str, Any], png: str | None, docs: list[tuple[str, dict[str, Any]]] | None = None) -> str:
    """The report; `docs`, the results files (name, doc) that `doc` merges, in command-line order, for the
    same-run pairs of 24 GiB vs the uncapped stock Trainer (default: `doc`'s rows split by their source file)."""
    lines = [f"# Benchmarks: suite `{doc['suite']}`, {doc['date']}", "", *_header(doc),
             "All systems run through the HF Trainer on the same GSM8K token rows (real Qwen tokenizer, packed rows, no "
             "padding), bf16 random weights of the real config, AdamW lr 1e-5, betas (0.9, 0.999), eps 1e-8, weight "
             "decay 0.01, clip 1.0; warm-up steps are not timed. A step is timed from on_step_begin to on_step_end, "
             "device-synchronized. `TFLOPS 6ND` = 6 x parameters x tokens per step / step time (padding would count; "
             "these rows have none); `TFLOPS exec` counts what ran (recompute forwards and causal attention included). "
             "Caps: torch.cuda.set_per_process_memory_fraction. LazyTrain's optimizer ms is the exposed part only "
             "(layer updates overlap the next forward); DeepSpeed steps inside backward.", ""]
    lora_rows = [r for r in doc["rows"] if r["system"] in LORA_ORDER]
    qlora_rows = [r for r in doc["rows"] if r["system"] in QLORA_ORDER]
    if lora_rows or qlora_rows:
        lines += [LORA_FLOPS_TEXT, ""]
    if qlora_rows:
        lines += [QLORA_TEXT, ""]
    if doc.get("notes"):
        lines += [f"Notes: {doc['notes']}", ""]
    if png:
        lines += [f"![TFLOPS 6ND vs batch]({png})", ""]
    if doc["suite"] == "hybrid":
        confs = sorted({str((r.get("extra") or {}).get("configuration")) for r in doc["rows"]
                        if str(r["system"]).startswith("lazytrain")})
        lines += [f"LazyTrain configuration: {', '.join(confs)} (extra.lazytrain_config holds each row's). Predicted: "
                  "the MILP's step at train begin (layers timed on the GPU, before calibration), in parentheses after "
                  "calibration; prediction error = predicted / measured median - 1.", ""]
    for (model, cap), rows in _groups(doc["rows"]).items():
        if doc["suite"] == "hybrid":
            lines += [f"## {model}, GPU cap {_cap(cap)}", "", *hybrid_table(rows), ""]
        elif all(r["system"] in ADAPTER_ORDER for r in rows):
            kind = "QLoRA" if all(r["system"] in QLORA_ORDER for r in rows) else "LoRA"
            lines += [f"## {model}, GPU cap {_cap(cap)} ({kind})", "", *lora_table(rows), ""]
        else:
            lines += [f"## {model}, GPU cap {_cap(cap)}", "", *table(rows), "", *ratios(rows), ""]
    if doc.get("max_batch"):
        lines += ["## Largest feasible batch (from the planner's largest where the suite gives it, galloping, then "
                  "bisection; 1 warm-up + 1 timed step per probe)", "",
                  *max_batch_table(doc["max_batch"]), ""]
    if doc["suite"] == "hybrid":
        for model in sorted({r["model"] for r in doc["rows"]}):
            lines += [f"## Targets: {model}", "", *hybrid_targets(doc, model), ""]
    if doc["suite"] == "paper":
        for model in sorted({r["model"] for r in doc["rows"]}):
            lines += [f"## Targets: {model}", "", *paper_targets(doc, model), ""]
    for model in sorted({r["model"] for r in lora_rows}):
        lines += [f"## Targets: LoRA on {model}", "", *lora_targets(doc, model), ""]
    for model in sorted({r["model"] for r in qlora_rows}):
        lines += [f"## Targets: QLoRA on {model}", "", *qlora_targets(doc, model), ""]
    sft_rows = [r for r in doc["rows"] if r["system"] in SFT_ORDER]
    for model in sorted({r["model"] for r in sft_rows}):
        lines += [f"## Targets: TRL's SFTTrainer through LazyTrainerMixin on {model}", "", *sft_targets(doc, model), ""]
    if not sft_rows and any(r["model"] == "qwen2.5-7b" and r["system"] not in ADAPTER_ORDER for r in doc["rows"]):
        lines += ["## Targets: LazyTrain vs the offloading systems", "", *targets(doc), ""]
        lines += ["## Targets: 24 GiB vs the uncapped stock Trainer", "", *targets_vs_stock(doc, docs), ""]
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(doc["rows"])
    models = sorted({k[0] for k in groups})
    caps = sorted({k[1] for k in groups}, key=lambda c: float("inf") if c is None else c)
    fig, axes = plt.subplots(len(models), len(caps), figsize=(5 * len(caps), 3.8 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, cap in enumerate(caps):
            ax = axes[i][j]
            rows = groups.get((model, cap), [])
            for k, system in enumerate(s for s in ORDER if any(r["system"] == s for r in rows)):
                color = f"C{k}"
                ok = [r for r in rows if r["system"] == system and r["status"] == "ok"]
                label = system if ok else f"{system} (no ok row)"
                ax.plot([r["batch_size"] for r in ok], [r["tflops_6nd"] for r in ok], "o-", color=color, label=label)
                oom = [r["batch_size"] for r in rows if r["system"] == system and r["status"] == "oom"]
                ax.plot(oom, [0] * len(oom), "x", color=color, markersize=9)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}, cap {_cap(cap)}")
            ax.set_xlabel("batch size (sequences)")
            ax.set_ylabel("TFLOPS 6ND")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"suite {doc['suite']}, {doc['date']} (x at 0: out of memory)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="one or more results files of one suite")
    p.add_argument("--md", default=None, help="default: BENCHMARKS.md for a results file under benchmarks/results/ "
                   "(the committed table), else <results stem>.md next to the results file")
    p.add_argument("--png", default=None, help="default: <results stem>.png next to the results file")
    args = p.parse_args(argv)
    srcs = [Path(r) for r in args.results]
    docs = []
    for src in srcs:
        try:
            d = json.loads(src.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"benchmarks.report: cannot read {src}: {e}") from None
        if not isinstance(d, dict) or not isinstance(d.get("rows"), list) or "suite" not in d:
            raise SystemExit(f"benchmarks.report: {src} is not a results file (needs 'suite' and a 'rows' list; "
                             "shared/RESULTS_FORMAT.md)")
        docs.append((src.name, d))
    try:
        doc = merge(docs)
    except ValueError as e:
        raise SystemExit(f"benchmarks.report: {e} ({', '.join(str(s) for s in srcs)})") from None
    if not doc["rows"]:
        raise SystemExit(f"benchmarks.report: no rows in {', '.join(str(s) for s in srcs)}: nothing to report")
    src = srcs[0] if len(srcs) == 1 else srcs[0].with_name(f"{doc['suite']}-combined-{doc['date'].replace('-', '')}.json")
    png = Path(args.png) if args.png else src.with_suffix(".png")
    committed = src.resolve().parent == (Path(__file__).resolve().parent / "results")
    md = Path(args.md) if args.md else (Path(__file__).resolve().parents[1] / "BENCHMARKS.md" if committed
                                        else src.with_suffix(".md"))
    plot(doc, png)
    try:
        rel = png.resolve().relative_to(md.resolve().parent)
    except ValueError:
        rel = png.resolve()
    md.write_text(markdown(doc, str(rel), docs) + "\n")
    print(f"wrote {md} and {png}")
    return md, png


if __name__ == "__main__":
    main()
