"""Tiny variable-length causal-LM examples shared by the Trainer tests and the data-parallel worker script."""

from __future__ import annotations

import torch
from datasets import Dataset


def tiny_dataset(vocab: int, n: int = 12, seed: int = 0) -> Dataset:
    """Examples of unequal length (5..20 tokens), loss masked on a 'prompt' prefix of varying length."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 5 + (i * 7) % 16
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        labels = [-100] * (1 + i % 3) + ids[1 + i % 3:]
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": labels})
    return Dataset.from_list(rows)
