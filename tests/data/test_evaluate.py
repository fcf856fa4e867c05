"""Tests for ``lazytrain_hf/data/evaluate.py``: exact-match evaluation and atomic metrics files."""

import json

import pytest
import torch

from lazytrain_hf.data import evaluate_exact_match, format_prompt, load_math_dataset, write_metrics_json

METRIC_KEYS = {"exact_match", "num_examples", "num_correct", "samples"}
SAMPLE_KEYS = {"prompt", "prediction", "reference", "extracted", "correct"}


@pytest.fixture(scope="module")
def gsm8k_test(gsm8k_path):
    """The first 7 GSM8K test problems, in file order (7: batches of 3 leave a partial last batch)."""
    return load_math_dataset(str(gsm8k_path), split="test", limit=7, seed=None)


def _fake_generate(tokenizer, answers_by_prompt, seen_padding_sides):
    """A ``generate`` that answers each (left-padded) prompt with its text from ``answers_by_prompt``."""

    def generate(input_ids, attention_mask, generation_config):
        seen_padding_sides.append(tokenizer.padding_side)
        assert generation_config.do_sample is False and generation_config.num_beams == 1
        assert bool(attention_mask[:, -1].all()), "prompts must be left-padded for generation"
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            prompt_text = tokenizer.decode(ids[mask.bool()])
            answer = answers_by_prompt[prompt_text]
            rows.append(tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id])
        width = max(len(row) for row in rows)
        new = [row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows]  # finished rows pad
        return torch.cat([input_ids, torch.tensor(new, dtype=input_ids.dtype)], dim=1)

    return generate


def test_tiny_qwen3_returns_valid_metrics(gsm8k_test, qwen_tokenizer, tiny_qwen3):
    tiny_qwen3.train()  # evaluation switches to eval mode and restores this
    metrics = evaluate_exact_match(tiny_qwen3, qwen_tokenizer, gsm8k_test, max_new_tokens=4, batch_size=3, limit=5)
    assert set(metrics) == METRIC_KEYS
    assert metrics["num_examples"] == 5
    assert 0 <= metrics["num_correct"] <= 5
    assert metrics["exact_match"] == pytest.approx(metrics["num_correct"] / 5)
    assert [sample["prompt"] for sample in metrics["samples"]] == gsm8k_test["prompt"][:5]
    for sample in metrics["samples"]:
        assert set(sample) == SAMPLE_KEYS
        assert isinstance(sample["prediction"], str) and isinstance(sample["correct"], bool)
    assert qwen_tokenizer.padding_side == "right"
    assert tiny_qwen3.training
    tiny_qwen3.eval()
    json.dumps(metrics)  # serializable as is


def test_generation_emitting_references_scores_one(gsm8k_test, qwen_tokenizer, tiny_qwen3, monkeypatch):
    # Each answer runs on into a new question with a wrong '####': scoring must stop at the new "Question:".
    answers = {
        format_prompt(row["prompt"]): f"Some reasoning.\n#### {row['reference']}\n\nQuestion: Next?\nAnswer: #### -1"
        for row in gsm8k_test
    }
    padding_sides: list[str] = []
    monkeypatch.setattr(tiny_qwen3, "generate", _fake_generate(qwen_tokenizer, answers, padding_sides))
    metrics = evaluate_exact_match(tiny_qwen3, qwen_tokenizer, gsm8k_test, max_new_tokens=8, batch_size=3)
    assert metrics["exact_match"] == 1.0
    assert (metrics["num_examples"], metrics["num_correct"]) == (7, 7)
    assert padding_sides == ["left"] * 3  # 3 + 3 + 1 prompts
    assert qwen_tokenizer.padding_side == "right"
    assert len(metrics["samples"]) == 5
    for sample, row in zip(metrics["samples"], gsm8k_test):
        assert sample["correct"] and sample["extracted"] == row["reference"] == sample["reference"]
        assert "Question:" not in sample["prediction"]


def test_wrong_answers_score_zero(gsm8k_test, qwen_tokenizer, tiny_qwen3, monkeypatch):
    answers = {format_prompt(row["prompt"]): f"#### {row['reference']}1" for row in gsm8k_test}
    monkeypatch.setattr(tiny_qwen3, "generate", _fake_generate(qwen_tokenizer, answers, []))
    metrics = evaluate_exact_match(tiny_qwen3, qwen_tokenizer, gsm8k_test, batch_size=4, limit=3)
    assert (metrics["exact_match"], metrics["num_correct"], metrics["num_examples"]) == (0.0, 0, 3)


def test_state_restored_when_generation_fails(gsm8k_test, qwen_tokenizer, tiny_qwen3, monkeypatch):
    def broken_generate(**kwargs):
        raise RuntimeError("generation failed")

    monkeypatch.setattr(tiny_qwen3, "generate", broken_generate)
    tiny_qwen3.train()
    with pytest.raises(RuntimeError, match="generation failed"):
        evaluate_exact_match(tiny_qwen3, qwen_tokenizer, gsm8k_test, limit=1)
    assert qwen_tokenizer.padding_side == "right"
    assert tiny_qwen3.training
    tiny_qwen3.eval()


def test_bad_arguments_are_reported_together(gsm8k_test, qwen_tokenizer, tiny_qwen3):
    with pytest.raises(ValueError, match=r"max_new_tokens must be >= 1, but got 0; batch_size must be >= 1"):
        evaluate_exact_match(tiny_qwen3, qwen_tokenizer, gsm8k_test, max_new_tokens=0, batch_size=0)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['reference'\].*load_math_dataset"):
        evaluate_exact_match(tiny_qwen3, qwen_tokenizer, gsm8k_test.remove_columns("reference"))
    with pytest.raises(ValueError, match="no rows"):
        evaluate_exact_match(tiny_qwen3, qwen_tokenizer, gsm8k_test.select([]))


def test_write_metrics_json_is_atomic(tmp_path):
    path = tmp_path / "runs" / "eval" / "metrics.json"
    metrics = {"exact_match": 0.5, "num_examples": 2, "num_correct": 1, "samples": []}
    assert write_metrics_json(path, metrics) == path  # parent folders are created
    assert json.loads(path.read_text(encoding="utf-8")) == metrics

    write_metrics_json(str(path), {**metrics, "exact_match": 1.0})  # overwrite, str path
    assert json.loads(path.read_text(encoding="utf-8"))["exact_match"] == 1.0

    with pytest.raises(TypeError):
        write_metrics_json(path, {"bad": object()})
    assert json.loads(path.read_text(encoding="utf-8"))["exact_match"] == 1.0  # old file untouched
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]  # no temporary file left behind
