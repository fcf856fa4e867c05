"""Tests for ``lazytrain_hf/data/math_data.py``: answers, loading, schema detection, SFT tokenization, collator."""

import json
import logging
import re

import datasets
import pytest
import torch

from lazytrain_hf.data import (
    DEFAULT_PROMPT_TEMPLATE,
    IGNORE_INDEX,
    extract_answer,
    format_example,
    format_prompt,
    is_exact_match,
    load_math_dataset,
    make_collator,
    pack_rows,
    tokenize_for_sft,
)

NORMALIZED_COLUMNS = ["prompt", "response", "reference"]

METAMATH_ROWS = [
    {
        "query": "What is half of 3/2?",
        "response": "Half of 3/2 is 3/4.\nThe answer is: \\frac{3}{4}",
        "type": "MATH_Rephrased",
        "original_question": "Compute half of 3/2.",
    },
    {
        "query": "Tom has 3 apples and buys 1,200 more. How many apples does he have?",
        "response": "He has 3 + 1200 = 1203 apples. The answer is: 1,203",
        "type": "GSM_AnsAug",
        "original_question": "Tom has 3 apples...",
    },
    {
        "query": "A pen costs $2. How much do 9 pens cost?",
        "response": "9 * 2 = 18. The answer is: $18.00.",
        "type": "GSM_SV",
        "original_question": "A pen costs $2...",
    },
]
GSM8K_ROWS = [
    {"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"},
    {"question": "What is 10 - 4?", "answer": "10 - 4 = <<10-4=6>>6\n#### 6"},
]

# ----------------------------------------------------------------------------------------------------------
# Answers
# ----------------------------------------------------------------------------------------------------------

# text, expected extract_answer(text)
EXTRACT_CASES = [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72"),
    ("#### 1,000", "1000"),
    ("#### $18.00", "18"),
    ("#### 12.0", "12"),
    ("#### -3", "-3"),
    ("#### 0.50", "0.5"),
    ("#### 5.", "5"),
    ("#### 007", "7"),
    ("first #### 3\nthen #### 4", "4"),
    ("#### 72\n\nQuestion: another problem", "72"),
    ("####\n 9 \n", "9"),
    ("The answer is: 3/4", "3/4"),
    ("The answer is: \\frac{1}{2}", "\\frac{1}{2}"),
    ("The answer is: (2,3)", "(2,3)"),
    ("It is 17. The answer is: 18", "18"),
    ("The answer is: 18 dollars.", "18"),
    ("the answer is 7", "7"),
    ("The answer is: 1 The answer is: 2", "2"),
    ("#### 5\nThe answer is: 6", "5"),  # '####' wins over 'The answer is:'
    ("no final answer here", None),
    ("####", None),
    ("The answer is: $ .", None),
]


@pytest.mark.parametrize("text, expected", EXTRACT_CASES, ids=[repr(case[0])[:40] for case in EXTRACT_CASES])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


# prediction text, reference, expected is_exact_match
MATCH_CASES = [
    ("... so 72 clips.\n#### 72", "72", True),
    ("#### 72.0", "72", True),
    ("#### 1,000", "1000", True),
    ("The answer is: 72", "72", True),
    ("#### 72", "Worked solution.\n#### 72", True),
    ("#### 71", "72", False),
    ("72", "72", False),  # no marker: nothing extracted
    ("#### 3/4", "0.75", False),  # fractions stay text
    ("The answer is: \\frac{3}{4}", "\\frac{3}{4}", True),
]


@pytest.mark.parametrize("prediction, reference, expected", MATCH_CASES)
def test_is_exact_match(prediction, reference, expected):
    assert is_exact_match(prediction, reference) is expected


# ----------------------------------------------------------------------------------------------------------
# Loading and schema detection
# ----------------------------------------------------------------------------------------------------------


def test_real_gsm8k_splits_normalize(gsm8k_path):
    test = load_math_dataset(str(gsm8k_path), split="test")
    train = load_math_dataset(str(gsm8k_path), split="train")
    assert (len(train), len(test)) == (7473, 1319)  # sizes from the data README
    assert test.column_names == NORMALIZED_COLUMNS
    # Every GSM8K reference is an integer after normalization (commas removed).
    assert all(re.fullmatch(r"-?\d+", reference) for reference in test["reference"])
    first = json.loads((gsm8k_path / "test.jsonl").read_text(encoding="utf-8").splitlines()[0])
    assert test[0]["prompt"] == first["question"]
    assert test[0]["response"] == first["answer"]
    assert test[0]["reference"] == first["answer"].rsplit("####", 1)[1].strip().replace(",", "")


def test_gsm8k_file_with_limit_and_seed(gsm8k_path):
    path = str(gsm8k_path / "test.jsonl")
    in_order = load_math_dataset(path, limit=5, seed=None)
    lines = (gsm8k_path / "test.jsonl").read_text(encoding="utf-8").splitlines()[:5]
    assert in_order["prompt"] == [json.loads(line)["question"] for line in lines]
    shuffled = load_math_dataset(path, limit=5, seed=1)
    assert len(shuffled) == 5
    assert shuffled["prompt"] == load_math_dataset(path, limit=5, seed=1)["prompt"]  # reproducible
    assert shuffled["prompt"] != in_order["prompt"]
    assert len(load_math_dataset(path, limit=10_000)) == 1319  # a limit above the size keeps everything


def test_metamathqa_schema_from_jsonl(write_jsonl):
    ds = load_math_dataset(str(write_jsonl(METAMATH_ROWS)))
    assert ds.column_names == NORMALIZED_COLUMNS
    assert ds["prompt"] == [row["query"] for row in METAMATH_ROWS]
    assert ds["response"] == [row["response"] for row in METAMATH_ROWS]
    assert ds["reference"] == ["\\frac{3}{4}", "1203", "18"]


def test_directory_source_picks_split_file(write_jsonl, tmp_path):
    write_jsonl(GSM8K_ROWS, "gsm/train.jsonl")
    write_jsonl(GSM8K_ROWS[:1], "gsm/test.jsonl")
    assert load_math_dataset(str(tmp_path / "gsm"), split="train")["reference"] == ["5", "6"]
    assert load_math_dataset(str(tmp_path / "gsm"), split="test")["reference"] == ["5"]


def test_hub_id_goes_through_datasets_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(METAMATH_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    ds = load_math_dataset("meta-math/MetaMathQA", split="train", limit=2, seed=None)
    assert calls == [("meta-math/MetaMathQA", None, "train")]
    assert ds["reference"] == ["\\frac{3}{4}", "1203"]


def test_hub_failure_is_explained(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(OSError, match="Hugging Face Hub.*no network"):
        load_math_dataset("openai/gsm8k", name="main")


# name, file contents (None: do not create), load_math_dataset kwargs, error type, regexes the message must match
ERROR_CASES = [
    ("missing_file", None, {}, FileNotFoundError, [r"missing\.jsonl", r"Hub id"]),
    ("empty_file", "", {}, ValueError, [r"empty", r"no rows"]),
    ("blank_lines_only", "\n\n", {}, ValueError, [r"no rows"]),
    ("invalid_json", '{"question": "q", "answer": "#### 1"}\nnot json\n', {}, ValueError, [r"not valid JSON Lines"]),
    (
        "unknown_schema",
        '{"text": "q", "label": 1}\n',
        {},
        ValueError,
        [r"neither supported schema", r"\['label', 'text'\]", r"'question', 'answer'", r"'query', 'response'"],
    ),
    (
        "no_final_answer",
        '{"question": "q1", "answer": "#### 1"}\n{"question": "q2", "answer": "just text"}\n',
        {},
        ValueError,
        [r"1 of 2 rows have no final answer", r"row 1"],
    ),
    ("bad_limit", '{"question": "q", "answer": "#### 1"}\n', {"limit": 0}, ValueError, [r"limit must be"]),
]


@pytest.mark.parametrize(
    "content, kwargs, error, patterns", [case[1:] for case in ERROR_CASES], ids=[case[0] for case in ERROR_CASES]
)
def test_load_errors_are_clear(tmp_path, content, kwargs, error, patterns):
    path = tmp_path / "missing.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(error) as excinfo:
        load_math_dataset(str(path), **kwargs)
    for pattern in patterns:
        assert re.search(pattern, str(excinfo.value)), (pattern, str(excinfo.value))


def test_directory_without_split_lists_files(write_jsonl, tmp_path):
    write_jsonl(GSM8K_ROWS, "gsm/train.jsonl")
    with pytest.raises(FileNotFoundError, match=r"no 'validation\.jsonl'.*train\.jsonl"):
        load_math_dataset(str(tmp_path / "gsm"), split="validation")


# ----------------------------------------------------------------------------------------------------------
# Formatting, tokenization, collation
# ----------------------------------------------------------------------------------------------------------


def test_format_example_and_template_checks():
    assert format_prompt("What is {x}?") == "Question: What is {x}?\nAnswer: "  # braces in questions are safe
    assert format_example("q", "r", eos_token="<eos>") == "Question: q\nAnswer: r<eos>"
    assert format_example("q", "r", template="Q: {prompt}\nA:") == "Q: q\nA:r"
    with pytest.raises(ValueError, match=r"\{prompt\}"):
        format_prompt("q", template="Question without placeholder")


@pytest.fixture(scope="module")
def gsm8k_sample(gsm8k_path):
    """The first 16 GSM8K test problems, in file order."""
    return load_math_dataset(str(gsm8k_path), split="test", limit=16, seed=None)


def test_labels_mask_prompt_and_keep_answer(gsm8k_sample, qwen_tokenizer):
    tokenized = tokenize_for_sft(gsm8k_sample, qwen_tokenizer, max_length=1024)
    assert tokenized.column_names == ["input_ids", "attention_mask", "labels"]
    assert len(tokenized) == len(gsm8k_sample)
    for row, example in zip(gsm8k_sample, tokenized):
        prompt_ids = qwen_tokenizer(format_prompt(row["prompt"])).input_ids
        num_prompt = len(prompt_ids)
        input_ids, labels = example["input_ids"], example["labels"]
        assert input_ids[:num_prompt] == prompt_ids  # exactly what generation is fed
        assert labels[:num_prompt] == [IGNORE_INDEX] * num_prompt
        assert labels[num_prompt:] == input_ids[num_prompt:]
        assert input_ids[-1] == qwen_tokenizer.eos_token_id
        assert example["attention_mask"] == [1] * len(input_ids)
        answer_ids = [token for token in labels if token != IGNORE_INDEX]
        assert qwen_tokenizer.decode(answer_ids) == row["response"] + qwen_tokenizer.eos_token
        assert extract_answer(qwen_tokenizer.decode(answer_ids, skip_special_tokens=True)) == row["reference"]


def test_truncation_keeps_answer_prefix_and_drops_answerless(gsm8k_sample, qwen_tokenizer, caplog):
    first = gsm8k_sample.select([0])
    num_prompt = len(qwen_tokenizer(format_prompt(first[0]["prompt"])).input_ids)
    truncated = tokenize_for_sft(first, qwen_tokenizer, max_length=num_prompt + 5)[0]
    assert len(truncated["input_ids"]) == num_prompt + 5
    assert sum(label != IGNORE_INDEX for label in truncated["labels"]) == 5
    assert truncated["input_ids"][-1] != qwen_tokenizer.eos_token_id  # eos was cut off with the answer's end

    long_question = {"prompt": "word " * 200, "response": "#### 1", "reference": "1"}
    mixed = datasets.Dataset.from_list([first[0], long_question])
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.data.math_data"):
        kept = tokenize_for_sft(mixed, qwen_tokenizer, max_length=num_prompt + 5)
    assert len(kept) == 1 and kept[0] == truncated
    assert "dropped 1 of 2" in caplog.text

    with pytest.raises(ValueError, match="increase max_length"):
        tokenize_for_sft(mixed, qwen_tokenizer, max_length=num_prompt)


def test_tokenize_rejects_unnormalized_data(qwen_tokenizer):
    raw = datasets.Dataset.from_list(GSM8K_ROWS)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['prompt', 'response'\].*load_math_dataset"):
        tokenize_for_sft(raw, qwen_tokenizer, max_length=64)
    with pytest.raises(ValueError, match="max_length must be at least 2"):
        tokenize_for_sft(raw, qwen_tokenizer, max_length=1)


@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_collator_right_pads_with_ignored_labels(gsm8k_sample, qwen_tokenizer, pad_to_multiple_of):
    tokenized = tokenize_for_sft(gsm8k_sample.select(range(3)), qwen_tokenizer, max_length=1024)
    features = [tokenized[i] for i in range(3)]
    lengths = [len(feature["input_ids"]) for feature in features]
    batch = make_collator(qwen_tokenizer, pad_to_multiple_of=pad_to_multiple_of)(features)

    width = max(lengths) if pad_to_multiple_of is None else -(-max(lengths) // 8) * 8
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for key in batch:
        assert batch[key].shape == (3, width) and batch[key].dtype == torch.long
    for row, (feature, length) in enumerate(zip(features, lengths)):
        assert batch["input_ids"][row, :length].tolist() == feature["input_ids"]  # right padding
        assert batch["labels"][row, :length].tolist() == feature["labels"]
        assert (batch["input_ids"][row, length:] == qwen_tokenizer.pad_token_id).all()
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].tolist() == [1] * length + [0] * (width - length)


def test_collated_batch_trains_tiny_qwen3(gsm8k_sample, qwen_tokenizer, tiny_qwen3):
    tokenized = tokenize_for_sft(gsm8k_sample.select(range(2)), qwen_tokenizer, max_length=128)
    batch = make_collator(qwen_tokenizer)([tokenized[0], tokenized[1]])
    with torch.no_grad():
        loss = tiny_qwen3(**batch).loss
    assert torch.isfinite(loss)


def test_collator_refuses_left_padding_and_bad_multiple(qwen_tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="pad_to_multiple_of must be"):
        make_collator(qwen_tokenizer, pad_to_multiple_of=0)
    monkeypatch.setattr(qwen_tokenizer, "padding_side", "left")
    with pytest.raises(ValueError, match="padding_side = 'right'"):
        make_collator(qwen_tokenizer)


def test_default_template_is_the_documented_one():
    assert DEFAULT_PROMPT_TEMPLATE == "Question: {prompt}\nAnswer: "


def test_map_cache_fingerprint_follows_arguments(gsm8k_sample, qwen_tokenizer):
    # File-backed data sets cache map results by fingerprint: a stale hit would return the wrong lengths.
    ds = gsm8k_sample.select(range(2))
    full = tokenize_for_sft(ds, qwen_tokenizer, max_length=1024)
    short = tokenize_for_sft(ds, qwen_tokenizer, max_length=64)
    other_template = tokenize_for_sft(ds, qwen_tokenizer, max_length=1024, template="Q: {prompt}\nA: ")
    assert max(len(ids) for ids in short["input_ids"]) == 64 < max(len(ids) for ids in full["input_ids"])
    assert other_template[0]["input_ids"] != full[0]["input_ids"]
    assert len({full._fingerprint, short._fingerprint, other_template._fingerprint}) == 3
    assert tokenize_for_sft(ds, qwen_tokenizer, max_length=1024)._fingerprint == full._fingerprint


def test_padding_free_collator_concatenates_without_padding(gsm8k_sample, qwen_tokenizer):
    tokenized = tokenize_for_sft(gsm8k_sample.select(range(3)), qwen_tokenizer, max_length=1024)
    features = [tokenized[i] for i in range(3)]
    batch = make_collator(qwen_tokenizer, padding_free=True)(features)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"][0].tolist() == [t for f in features for t in f["input_ids"]]
    # the prompt is masked, so the labels are the examples' own: nothing of one example is trained from another
    assert batch["labels"][0].tolist() == [t for f in features for t in f["labels"]]
    assert batch["position_ids"][0].tolist() == [i for f in features for i in range(len(f["input_ids"]))]


def test_pack_rows_best_fit_decreasing():
    lengths = [7, 3, 5, 2, 6, 4, 1, 8]
    ds = datasets.Dataset.from_dict({"input_ids": [list(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)],
                                     "labels": [[-100] + list(range(100 * i + 1, 100 * i + n))
                                                for i, n in enumerate(lengths)]})
    rows = pack_rows(ds, 10)
    # longest first, each into the tightest room: 8+2, 7+3, 6+4, 5+1 (36 tokens, 4 rows: no fewer fit)
    assert [len(r) for r in rows["input_ids"]] == [10, 10, 10, 6]
    assert sorted(t for r in rows["input_ids"] for t in r) == sorted(t for r in ds["input_ids"] for t in r)
    for ids, labels, pos in zip(rows["input_ids"], rows["labels"], rows["position_ids"], strict=True):
        starts = [k for k, p in enumerate(pos) if p == 0]
        assert starts[0] == 0 and all(labels[k] == -100 for k in starts)  # no example learns from the one before
        for a, b in zip(starts, starts[1:] + [len(ids)]):
            i = ids[a] // 100  # the example: its tokens, positions 0.., its own labels after the first
            assert ids[a:b] == ds["input_ids"][i] and pos[a:b] == list(range(b - a))
            assert labels[a + 1:b] == ds["labels"][i][1:]
    with pytest.raises(ValueError, match="more than row_length=6"):
        pack_rows(ds, 6)
    with pytest.raises(ValueError, match="tokenize_for_sft"):
        pack_rows(datasets.Dataset.from_dict({"text": ["a"]}), 6)


def test_packed_rows_collator_pads_as_the_last_example(gsm8k_sample, qwen_tokenizer):
    rows = pack_rows(tokenize_for_sft(gsm8k_sample.select(range(6)), qwen_tokenizer, max_length=512), 512)
    features = [rows[i] for i in range(len(rows))]
    batch = make_collator(qwen_tokenizer, pad_to_multiple_of=8, packing=True)(features)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask: the models read the packing
    T = batch["input_ids"].shape[1]
    assert T % 8 == 0 and T >= max(len(f["input_ids"]) for f in features)
    for k, f in enumerate(features):
        n = len(f["input_ids"])
        assert batch["input_ids"][k, :n].tolist() == f["input_ids"]
        assert (batch["input_ids"][k, n:] == qwen_tokenizer.pad_token_id).all() and (batch["labels"][k, n:] == -100).all()
        last = f["position_ids"][-1]
        assert batch["position_ids"][k, n:].tolist() == list(range(last + 1, last + 1 + T - n))
    with pytest.raises(ValueError, match="pick one"):
        make_collator(qwen_tokenizer, packing=True, padding_free=True)
    unpacked = tokenize_for_sft(gsm8k_sample.select(range(2)), qwen_tokenizer, max_length=512)
    with pytest.raises(ValueError, match=r"rows of pack_rows.*lazytrain_hf\.data\.pack_rows first"):
        make_collator(qwen_tokenizer, packing=True)([unpacked[0], unpacked[1]])


def test_examples_cut_at_max_length_are_counted(gsm8k_sample, qwen_tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.data.math_data"):
        whole = tokenize_for_sft(gsm8k_sample.select(range(8)), qwen_tokenizer, max_length=1024)
    assert "were cut at max_length" not in caplog.text
    lengths = sorted(len(x) for x in whole["input_ids"])
    limit = lengths[4] - 1  # the longer examples (at least 4) no longer fit
    prompt_fits = [n for n in lengths if n > limit]
    with caplog.at_level(logging.WARNING, logger="lazytrain_hf.data.math_data"):
        cut = tokenize_for_sft(gsm8k_sample.select(range(8)), qwen_tokenizer, max_length=limit)
    assert f"{len(prompt_fits)} of {len(cut)} examples were cut at max_length={limit} tokens" in caplog.text
