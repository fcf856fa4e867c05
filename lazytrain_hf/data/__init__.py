"""GSM8K / MetaMathQA data for fine-tuning and exact-match evaluation, built on ``datasets`` and ``transformers``.

Typical use::

    from lazytrain_hf.data import load_tokenizer, load_math_dataset, tokenize_for_sft, make_collator

    tokenizer = load_tokenizer("qwen-offline")          # bundled Qwen tokenizer, no network
    train = load_math_dataset("../shared/data/gsm8k", split="train")
    train_tok = tokenize_for_sft(train, tokenizer, max_length=512)
    collator = make_collator(tokenizer, pad_to_multiple_of=8)
    ...
    metrics = evaluate_exact_match(model, tokenizer, load_math_dataset(path, split="test"), limit=200)
    write_metrics_json("outputs/eval.json", metrics)
"""

from .evaluate import evaluate_exact_match, write_metrics_json
from .math_data import (
    DEFAULT_PROMPT_TEMPLATE,
    IGNORE_INDEX,
    SCHEMAS,
    PackedRowsCollator,
    extract_answer,
    format_example,
    format_prompt,
    is_exact_match,
    load_math_dataset,
    make_collator,
    normalize_answer,
    pack_rows,
    tokenize_for_sft,
)
from .tokenizer import QWEN_OFFLINE, load_tokenizer, qwen_offline_tokenizer_dir

__all__ = [
    "DEFAULT_PROMPT_TEMPLATE",
    "IGNORE_INDEX",
    "PackedRowsCollator",
    "QWEN_OFFLINE",
    "SCHEMAS",
    "evaluate_exact_match",
    "extract_answer",
    "format_example",
    "format_prompt",
    "is_exact_match",
    "load_math_dataset",
    "load_tokenizer",
    "make_collator",
    "normalize_answer",
    "pack_rows",
    "qwen_offline_tokenizer_dir",
    "tokenize_for_sft",
    "write_metrics_json",
]
