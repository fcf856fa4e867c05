"""Shared test helpers: tiny models of the real architectures, random batches, gradient comparison."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

GSM8K_DIR = Path(os.environ.get("LAZYTRAIN_GSM8K_DIR", Path(__file__).resolve().parents[2] / "shared/data/gsm8k"))

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
requires_gsm8k = pytest.mark.skipif(not (GSM8K_DIR / "train.jsonl").is_file(),
                                    reason=f"GSM8K not found at {GSM8K_DIR} (set LAZYTRAIN_GSM8K_DIR)")


def random_batch(vocab: int, B: int = 2, T: int = 24, pad_tail: int = 6, prompt: int = 5, seed: int = 0):
    """[B, T] input_ids / attention_mask / labels with right padding on row 1 and masked prompt tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if B > 1 and pad_tail:
        mask[1, T - pad_tail:] = 0
    labels = ids.clone()
    labels[:, :prompt] = -100
    labels[mask == 0] = -100
    return ids, mask, labels


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()
