"""Padding-free packed batches: several sequences concatenated in one row, positions restarting per sequence.

transformers' `DataCollatorWithFlattening` gives `input_ids` / `labels` / `position_ids` of shape [1, N] (labels
-100 at each sequence start) and, optionally, the FlashAttention boundaries `cu_seq_lens_q/k`, `max_length_q/k`
and `seq_idx`. The executor hands the HF base model the `position_ids` with no `attention_mask`, and the model's
own mask logic (`transformers.masking_utils.find_packed_sequence_indices`) restricts attention to each sequence:
a block-diagonal causal mask for sdpa / eager, per-sequence varlen for flash attention. The boundary keys carry
nothing the `position_ids` do not, so they are checked against them and dropped.

Gated DeltaNet (linear attention) layers carry a recurrent state and a causal convolution along the row, across
sequence boundaries: they are refused here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["BOUNDARY_KEYS", "has_linear_attention", "sequence_index", "packed_lengths", "check_packing_model",
           "check_collator", "check_packed", "prepare_batch", "is_flattening_collator", "packed_row_tokens"]

#: keys `DataCollatorWithFlattening` adds besides input_ids / labels / position_ids
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")

_PAD_FIX = ("Pad instead: a padding collator such as DataCollatorForSeq2Seq (lazytrain_hf.data.make_collator; "
            "in a recipe, data.packing and data.padding_free: false)")


def has_linear_attention(config: Any) -> bool:
    """The model has Gated DeltaNet (linear-attention) layers (Qwen3.5 / Qwen3.6 / Qwen3-Next `layer_types`)."""
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def sequence_index(position_ids: torch.Tensor) -> torch.Tensor | None:
    """[B, T] index of the sequence each token belongs to (positions restart => a new sequence), or None when every
    row holds one sequence (transformers' `find_packed_sequence_indices`, the rule the models' masks follow)."""
    from transformers.masking_utils import find_packed_sequence_indices

    return find_packed_sequence_indices(position_ids if position_ids.dim() == 2 else position_ids.view(1, -1))


def packed_lengths(position_ids: torch.Tensor) -> list[list[int]]:
    """The lengths of the sequences packed in each row of `position_ids` [B, T]."""
    idx = sequence_index(position_ids)
    if idx is None:
        return [[position_ids.shape[-1]] for _ in range(position_ids.shape[0])]
    return [torch.bincount(row).tolist() for row in idx]


def check_packing_model(config: Any, what: str) -> None:
    """Raise when the model cannot train on packed rows (`what` names the packed input)."""
    if has_linear_attention(config):
        raise ValueError(
            f"{what}: packed sequences (position_ids restarting inside a row) are not supported for "
            f"model_type={getattr(config, 'model_type', None)!r}: its Gated DeltaNet (linear-attention) layers carry "
            "their recurrent state and causal convolution across the sequence boundaries of a row; transformers' "
            "reference Gated DeltaNet kernels take no sequence boundaries and the executor hands these layers none, "
            f"so every sequence would see the ones before it. {_PAD_FIX}.")


def is_flattening_collator(collator: Any) -> bool:
    """`collator` is transformers' `DataCollatorWithFlattening` (or a subclass)."""
    from transformers import DataCollatorWithFlattening

    return isinstance(collator, DataCollatorWithFlattening)


def check_collator(config: Any, collator: Any) -> None:
    """Refuse a packing collator (`DataCollatorWithFlattening`, `lazytrain_hf.data.PackedRowsCollator`) for a model
    that cannot train on packed rows (at trainer build)."""
    from ..data.math_data import PackedRowsCollator

    if is_flattening_collator(collator):
        check_packing_model(config, "data_collator=DataCollatorWithFlattening")
    elif isinstance(collator, PackedRowsCollator):
        check_packing_model(config, "data_collator=PackedRowsCollator (rows of pack_rows)")


def check_packed(config: Any, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> None:
    """Raise when a batch packs several sequences into a row of a model that cannot honour their boundaries: a
    linear-attention model given `position_ids` that restart inside a row and no `attention_mask` (the packed
    form the models' masks read). Costs nothing for other models."""
    if position_ids is None or attention_mask is not None or not has_linear_attention(config):
        return
    if sequence_index(position_ids) is not None:
        check_packing_model(config, "this batch")


def prepare_batch(inputs: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """A `DataCollatorWithFlattening` batch as the executor takes it: the boundary keys (`BOUNDARY_KEYS`) checked
    against `position_ids` and dropped; an all-ones `attention_mask` next to packed `position_ids` dropped (with a
    mask, transformers would not read the packing and attention would cross sequences). Other batches pass as
    they are.

    Raises:
        ValueError: a linear-attention model given a packed batch (`check_packing_model`); boundary keys without
            `position_ids` or disagreeing with them; packed `position_ids` with a padding mask (zeros).
    """
    present = [k for k in BOUNDARY_KEYS if k in inputs]
    pos = inputs.get("position_ids")
    if not present and pos is None:
        return dict(inputs)
    out = {k: v for k, v in inputs.items() if k not in BOUNDARY_KEYS}
    if present and pos is None:
        raise ValueError(f"the batch has sequence boundaries {present} but no position_ids: the executor reads the "
                         "packing from position_ids restarting per sequence. Keep DataCollatorWithFlattening's "
                         "return_position_ids=True")
    idx = sequence_index(pos)
    if idx is None:
        return out
    check_packing_model(config, "this batch")
    mask = out.get("attention_mask")
    if mask is not None:
        if not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("the batch has packed position_ids (restarting inside a row) and an attention_mask with "
                             "padding: transformers ignores the packing when a mask is given, so attention would "
                             "cross sequences. Pack without padding (DataCollatorWithFlattening) or pad without "
                             "packing")
        del out["attention_mask"]
    lengths = None
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if key in inputs:
            cu = torch.as_tensor(inputs[key]).flatten().tolist()
            if lengths is None:  # once per batch, for either key
                lengths = [n for row in packed_lengths(pos) for n in row]
            if [b - a for a, b in zip(cu, cu[1:])] != lengths:
                raise ValueError(f"the batch's {key} {cu} disagree with its position_ids (sequences of "
                                 f"{lengths} tokens); build both with one DataCollatorWithFlattening")
    return out


def packed_row_tokens(lengths: list[int], sequences_per_row: int) -> int:
    """The longest packed row: the sum of the `sequences_per_row` longest of `lengths` (what a micro-batch of
    `DataCollatorWithFlattening` can hold)."""
    return sum(sorted(lengths, reverse=True)[:max(1, sequences_per_row)])
