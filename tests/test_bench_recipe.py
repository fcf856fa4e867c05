"""The harness's packed-example data (the recipe suite): GSM8K examples packed as a recipe with `data.packing: true`
packs them, and the recipe-smoke suite trains LazyTrain and the stock Trainer on those rows (CPU)."""

from __future__ import annotations

import json

import torch

from .conftest import requires_gsm8k


@requires_gsm8k
def test_packed_examples_are_the_recipes_rows():
    from benchmarks.common import gsm8k_dir
    from benchmarks.worker import PackedExamples
    from lazytrain_hf.data import load_math_dataset, load_tokenizer, pack_rows, tokenize_for_sft

    tok = load_tokenizer("qwen-offline")
    ds = PackedExamples(256, 40, None, tok.vocab_size + 1000)
    rows = pack_rows(tokenize_for_sft(load_math_dataset(str(gsm8k_dir(None)), "train"), tok, 256), 256)
    assert len(ds) == 40 and ds.batch["input_ids"].shape == (40, 256)
    for i in (0, 7, 39):
        n = len(rows[i]["input_ids"])
        item = ds[i]
        assert item["input_ids"][:n].tolist() == rows[i]["input_ids"] and item["labels"][:n].tolist() == rows[i]["labels"]
        assert (item["labels"][n:] == -100).all() and (item["input_ids"][n:] == tok.pad_token_id).all()
        pos = item["position_ids"]
        assert pos[:n].tolist() == rows[i]["position_ids"] and torch.equal(pos[n:], torch.arange(pos[n - 1] + 1,
                                                                                                 pos[n - 1] + 1 + 256 - n))
    real = sum(len(r) for r in rows["input_ids"]) / (len(rows) * 256)
    assert ds.real_fraction == real and 0.8 < real < 1


@requires_gsm8k
def test_recipe_smoke_suite_trains_both_systems_on_packed_rows(tmp_path):
    from benchmarks import run

    out = tmp_path / "recipe.json"
    run.main(["--suite", "recipe-smoke", "--out", str(out)])
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"lazytrain_milp", "stock_trainer"}
    for r in rows.values():
        assert r["status"] == "ok", r["reason"]
        e = r["extra"]
        assert e["data"] == "packed_examples" and 0.8 < e["real_fraction"] < 1
        assert abs(e["real_tokens_per_s"] - e["real_fraction"] * r["tokens_per_s"]) < 1e-6 * r["tokens_per_s"]
