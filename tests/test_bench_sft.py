"""The harness's TRL system (lazytrain_sft) on the CPU: its data reaches the model as the same batches as
lazytrain_milp's, the sft-smoke suite trains both systems (lazytrain_sft through TRL's SFTTrainer loss and
metrics, the product's defaults), and the report's lazytrain_sft / lazytrain_milp target."""

from __future__ import annotations

import json

import pytest
import torch

from .conftest import requires_gsm8k

pytest.importorskip("trl")


def test_sft_data_gives_the_same_batches_as_the_token_rows():
    """TRL's collator over the `datasets.Dataset` yields lazytrain_milp's input_ids and labels (every token counts,
    no padding), with an all-ones attention mask."""
    from transformers import default_data_collator
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from benchmarks.worker import TokenRows, sft_dataset

    ids = torch.randint(0, 1000, (4, 16), generator=torch.Generator().manual_seed(0))
    plain = default_data_collator([TokenRows(ids)[i] for i in (2, 0)])
    ds = sft_dataset(ids)
    assert ds.column_names == ["input_ids"] and len(ds) == 4
    sft = DataCollatorForLanguageModeling(pad_token_id=1)([ds[i] for i in (2, 0)])
    assert torch.equal(sft["input_ids"], plain["input_ids"]) and torch.equal(sft["labels"], plain["labels"])
    assert sft["attention_mask"].eq(1).all()


@requires_gsm8k
def test_sft_smoke_suite_runs_trls_loss_beside_lazytrain_milp(tmp_path):
    from benchmarks import run

    out = tmp_path / "sft.json"
    run.main(["--suite", "sft-smoke", "--out", str(out)])
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"lazytrain_milp", "lazytrain_sft"}
    for r in rows.values():
        assert r["status"] == "ok", r["reason"]
        assert r["tokens_per_s"] > 0 and r["tflops_6nd"] > 0
        assert r["extra"]["configuration"] == "product defaults" and r["extra"]["lazytrain_config"] == {"policy": "milp"}
        assert r["extra"]["rows_per_step"] == [2, 2]
    sft, milp = rows["lazytrain_sft"]["extra"], rows["lazytrain_milp"]["extra"]
    assert "user_loss" not in milp  # the executor's own loss
    assert sft["user_loss"] == ["compute_loss of SFTTrainer"] and sft["trainer"] == "LazyTrainerMixin + trl.SFTTrainer"
    m = sft["trl_metrics"]  # logged by SFTTrainer.compute_loss / log: TRL's fused LM head ran
    assert m["entropy"] > 0 and 0 <= m["mean_token_accuracy"] <= 1 and m["num_tokens"] == 2 * 2 * 32
    # SFTConfig's defaults that are the executor's business were taken over
    assert sft["args_optim"] == "lazytrain_hybrid8" and sft["args_gradient_checkpointing"] is False


def test_report_sft_target_is_the_tokens_per_s_ratio_at_the_same_batch():
    from benchmarks.common import row
    from benchmarks.report import markdown

    base = dict(model="m", gpu_cap_gib=24, seq_len=1024, status="ok")
    doc = {"suite": "sft", "date": "d", "git_commit": "c", "commands": [], "machine": {}, "max_batch": [],
           "rows": [row(system="lazytrain_milp", batch_size=32, tokens_per_s=1000.0, **base),
                    row(system="lazytrain_sft", batch_size=32, tokens_per_s=960.0, **base),
                    row(system="lazytrain_milp", batch_size=8, tokens_per_s=1000.0, **base),
                    row(system="lazytrain_sft", batch_size=8, tokens_per_s=900.0, **base),
                    row(system="lazytrain_sft", batch_size=16, **dict(base, status="oom"))]}
    text = markdown(doc, None)
    assert "| 24 GiB, B=32: lazytrain_sft >= 0.95x the lazytrain_milp tokens/s | 0.960x (960 vs 1,000) | met |" in text
    assert "| 24 GiB, B=8: lazytrain_sft >= 0.95x the lazytrain_milp tokens/s | 0.900x (900 vs 1,000) | not met |" \
        in text
    assert "B=16: lazytrain_sft >= 0.95x the lazytrain_milp tokens/s | lazytrain_sft oom, lazytrain_milp not run | " \
        "not measured |" in text
