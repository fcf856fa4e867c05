"""Packing equals the padded batch (fp32): padding-free rows (DataCollatorWithFlattening) and rows of `pack_rows`
(PackedRowsCollator), through the executor and LazyTrainer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, Trainer, TrainingArguments

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.data import PackedRowsCollator, pack_rows
from lazytrain_hf.hf.plan import run_shape
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.streaming.executor import StreamingExecutor
from lazytrain_hf.streaming.packing import packed_lengths, packed_row_tokens, prepare_batch

from ..conftest import rel_err
from .test_trainer import EXACT, NOISE_ONLY, _collate, _common, _logs
from .tiny_data import tiny_dataset

LENGTHS = [7, 12, 5, 9]


def _model(arch: str, attn: str):
    if arch == "llama-tiny":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048,
                             attn_implementation=attn)
        torch.manual_seed(1)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return load_model(arch, "float32", seed=1, attn_implementation=attn)


def _features(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * (1 + i % 2) + ids[1 + i % 2:]})
    return out


def _padded(features: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(f["input_ids"]) for f in features)
    pad = lambda key, v: torch.tensor([f[key] + [v] * (T - len(f[key])) for f in features])  # noqa: E731
    mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (T - len(f["input_ids"])) for f in features])
    return pad("input_ids", 0), mask, pad("labels", -100)


def _reference(model, ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _executor_equals(model, batch, ref_loss, ref_grads, tmp_path) -> StreamingExecutor:
    """The packed `batch` through an executor over `model`: its loss and every gradient within 1e-5 of the
    reference's; the executor, for more passes."""
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=7, nvme_dir=str(tmp_path)), "cpu",
                           fixed_schedule(4, 2, "cpu", 2))
    loss = ex.forward_backward(batch["input_ids"], batch["labels"], None, batch["position_ids"])
    assert rel_err(loss, ref_loss) < 1e-5
    for name, p in model.named_parameters():
        assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, name
    return ex


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3-tiny", "llama-tiny"])
def test_packed_batch_equals_the_padded_batch(arch, attn, tmp_path):
    """One packed row through the executor == HF autograd on the same sequences padded (loss and every gradient)."""
    model = _model(arch, attn)
    features = _features(model.config.vocab_size)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), *_padded(features))
    batch = prepare_batch(DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features), model.config)
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and "cu_seq_lens_q" not in batch
    assert packed_lengths(batch["position_ids"]) == [LENGTHS]

    ex = _executor_equals(model, batch, ref_loss, ref_grads, tmp_path)

    # the check has teeth: the same row read as one sequence (positions not restarting) is another batch
    whole = torch.arange(sum(LENGTHS)).view(1, -1)
    ex.zero_grad()
    assert rel_err(ex.forward_backward(batch["input_ids"], batch["labels"], None, whole), ref_loss) > 1e-3


def test_a_packed_batch_of_a_linear_attention_model_is_refused_with_the_fix(tmp_path):
    model = load_model("qwen3.5-tiny", "float32", seed=1)
    features = _features(model.config.vocab_size)
    batch = DataCollatorWithFlattening()(features)
    ex = StreamingExecutor(model, LazyTrainConfig(nvme_dir=str(tmp_path)), "cpu")
    with pytest.raises(ValueError, match=r"Gated DeltaNet.*Pad instead"):
        ex.forward_backward(batch["input_ids"], batch["labels"], None, batch["position_ids"])
    with pytest.raises(ValueError, match=r"Gated DeltaNet.*Pad instead"):
        prepare_batch(batch, model.config)
    one = DataCollatorWithFlattening()(features[:1])  # one sequence per row: nothing crosses a boundary
    ref_loss, _ = _reference(copy.deepcopy(model), torch.tensor([features[0]["input_ids"]]), None,
                             torch.tensor([features[0]["labels"]]))
    loss = ex.forward_backward(one["input_ids"], one["labels"], None, one["position_ids"])
    assert rel_err(loss, ref_loss) < 1e-5


@pytest.mark.parametrize("collator, name", [(DataCollatorWithFlattening(), "DataCollatorWithFlattening"),
                                            (PackedRowsCollator(pad_token_id=0), "PackedRowsCollator")])
def test_the_trainer_refuses_a_packing_collator_for_a_linear_attention_model(tmp_path, collator, name):
    model = load_model("qwen3.5-tiny", "float32", seed=1)
    args = LazyTrainingArguments(**_common(tmp_path, "lazy"), lazytrain_config=dict(EXACT))
    with pytest.raises(ValueError, match=rf"{name}.*Gated DeltaNet.*Pad instead"):
        LazyTrainer(model=model, args=args, train_dataset=tiny_dataset(model.config.vocab_size),
                    data_collator=collator)


def test_prepare_batch_checks_the_boundaries_and_the_mask():
    config = load_model("qwen3-tiny", "float32").config
    features = _features(config.vocab_size)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    out = prepare_batch(batch, config)
    assert set(out) == {"input_ids", "labels", "position_ids"}
    bad = dict(batch, cu_seq_lens_q=torch.tensor([0, 7, 19, 33], dtype=torch.int32))  # not the packed lengths
    with pytest.raises(ValueError, match="disagree with its position_ids"):
        prepare_batch(bad, config)
    ones = torch.ones_like(batch["input_ids"])
    assert "attention_mask" not in prepare_batch(dict(batch, attention_mask=ones), config)
    padded = ones.clone()
    padded[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask with padding"):
        prepare_batch(dict(batch, attention_mask=padded), config)
    with pytest.raises(ValueError, match="no position_ids"):
        prepare_batch({k: v for k, v in batch.items() if k != "position_ids"}, config)
    plain = {"input_ids": ones, "labels": ones, "attention_mask": padded}  # a padded batch passes untouched
    assert prepare_batch(plain, config).keys() == plain.keys()


def _assert_equal_runs(stock, lazy) -> None:
    """3 logged losses and gradient norms, and the final weights, within 1e-5 of the stock Trainer's."""
    for key in ("loss", "grad_norm"):
        assert len(_logs(lazy, key)) == 3
        for a, b in zip(_logs(lazy, key), _logs(stock, key), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (key, a, b)
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        if not name.endswith(NOISE_ONLY):
            assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name


@pytest.mark.parametrize("policy", ["fixed", "milp"])
def test_lazytrainer_on_packed_batches_equals_the_stock_trainer_on_padded_ones(tmp_path, policy):
    """LazyTrainer with DataCollatorWithFlattening (boundary keys too) == the stock Trainer on the same examples
    padded: losses, gradient norms (clipped) and weights after 3 steps with accumulation; the plan is for one packed
    row of the longest per_device_train_batch_size sequences."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    ds = tiny_dataset(model.config.vocab_size)
    stock = Trainer(model=copy.deepcopy(model), train_dataset=ds, data_collator=_collate,
                    args=TrainingArguments(**_common(tmp_path, "stock", optim="adamw_torch")))
    stock.train()
    lazy = LazyTrainer(model=model, train_dataset=ds,
                       data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=True),
                       args=LazyTrainingArguments(**_common(tmp_path, "lazy"),
                                                  lazytrain_config={**EXACT, "policy": policy}))
    lazy.train()
    lengths = [len(x) for x in ds["input_ids"]]
    assert run_shape(lazy) == (1, -(-packed_row_tokens(lengths, 2) // 8) * 8)
    assert lazy.plans.request.batch_size == 1
    _assert_equal_runs(stock, lazy)


def test_packed_row_tokens_is_the_longest_packing():
    assert packed_row_tokens([5, 20, 9, 13], 2) == 33
    assert packed_row_tokens([5, 20], 4) == 25


ROW_LENGTHS = [7, 12, 5, 9, 11, 3]


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3-tiny", "llama-tiny"])
def test_packed_rows_equal_the_padded_batch(arch, tmp_path):
    """Rows of `pack_rows` (two rows, the shorter one padded as its last example) through the executor == HF autograd
    on the same examples padded one per row: loss and every gradient."""
    model = _model(arch, "sdpa")
    features = _features(model.config.vocab_size, ROW_LENGTHS)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), *_padded(features))
    rows = pack_rows(Dataset.from_list(features), 24)
    batch = PackedRowsCollator(pad_token_id=0, pad_to_multiple_of=8)([rows[i] for i in range(len(rows))])
    assert batch["input_ids"].shape == (2, 24) and sorted(map(len, rows["input_ids"])) == [23, 24]
    assert sorted(n for row in packed_lengths(batch["position_ids"]) for n in row) == [3, 5, 7, 9, 12, 11 + 1]
    ex = _executor_equals(model, batch, ref_loss, ref_grads, tmp_path)
    # the check has teeth: without pack_rows' -100 at each example's first token, one example learns from another
    labels = batch["labels"].clone()
    labels[batch["position_ids"] == 0] = batch["input_ids"][batch["position_ids"] == 0]
    ex.zero_grad()
    assert rel_err(ex.forward_backward(batch["input_ids"], labels, None, batch["position_ids"]), ref_loss) > 1e-3


def test_lazytrainer_on_packed_rows_equals_the_stock_trainer(tmp_path):
    """LazyTrainer on `pack_rows` rows (PackedRowsCollator) == the stock Trainer on the same rows: losses, gradient
    norms (clipped) and weights after 3 steps with accumulation 2; the plan is for the rows' length."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    ds = pack_rows(tiny_dataset(model.config.vocab_size, n=24).remove_columns("attention_mask"), 32)
    collate = PackedRowsCollator(pad_token_id=0, pad_to_multiple_of=8)
    stock = Trainer(model=copy.deepcopy(model), train_dataset=ds, data_collator=collate,
                    args=TrainingArguments(**_common(tmp_path, "stock", optim="adamw_torch")))
    stock.train()
    lazy = LazyTrainer(model=model, train_dataset=ds, data_collator=collate,
                       args=LazyTrainingArguments(**_common(tmp_path, "lazy"), lazytrain_config=dict(EXACT)))
    lazy.train()
    assert run_shape(lazy) == (2, 32)
    _assert_equal_runs(stock, lazy)
