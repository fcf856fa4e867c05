"""GPU: QLoRA through LazyTrainer equals the stock Trainer + PEFT on the same 4-bit base within bf16 tolerance.

The base is quantized once (bitsandbytes' CPU kernel) and the stock model moved to the GPU as it is, so both runs
hold the same packed bytes and quantization state; both train under bf16=True (autocast over the fp32 embedding,
norms, head and adapters that prepare_model_for_kbit_training leaves) with bitsandbytes' CUDA dequantization.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Trainer, TrainingArguments

from lazytrain_hf import LazyTrainer, LazyTrainingArguments

from ..conftest import rel_err, requires_cuda
from .test_qlora import _base, _frozen_state, _qlora
from .test_trainer import _collate, _common, _logs
from .tiny_data import tiny_dataset

pytestmark = [pytest.mark.gpu, requires_cuda]
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")


@pytest.mark.parametrize("arch", ["qwen3-tiny", "llama-tiny"])
def test_cuda_qlora_equals_stock_trainer_with_peft_in_bf16(tmp_path, arch):
    base = _base(tmp_path, arch)
    stock_model, model = _qlora(base).to("cuda"), _qlora(base)
    before = _frozen_state(model)
    ds = tiny_dataset(model.config.vocab_size)
    kw = dict(optim="adamw_torch", bf16=True, use_cpu=False, learning_rate=1e-3)
    stock = Trainer(model=stock_model, args=TrainingArguments(**_common(tmp_path, "stock", **kw)),
                    train_dataset=ds, data_collator=_collate)
    stock.train()
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", **kw),
                                                               lazytrain_config={"device": "cuda", "policy": "milp"}),
                       train_dataset=ds, data_collator=_collate)
    lazy.train()
    assert lazy.executor.autocast_dtype == torch.bfloat16
    assert len(_logs(lazy, "loss")) == len(_logs(stock, "loss")) == 3
    for key in ("loss", "grad_norm"):
        for a, b in zip(_logs(lazy, key), _logs(stock, key), strict=True):
            assert math.isclose(a, b, rel_tol=2e-2), (key, a, b)
    ref = dict(stock.model.named_parameters())
    trained = [(n, p) for n, p in lazy.model.named_parameters() if p.requires_grad]
    assert trained
    for name, p in trained:
        assert rel_err(p.detach().cpu(), ref[name].detach().cpu()) < 2e-2, name
    after = _frozen_state(lazy.model)
    for k, t in after.items():  # the base's packed bytes and state are never written back
        assert torch.equal(t.cpu(), before[k].cpu()), k
