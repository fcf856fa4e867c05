"""QLoRA: LoRA on a bitsandbytes 4-bit base through LazyTrainer equals the stock Trainer + PEFT on the same base.

The base is quantized on the CPU (bitsandbytes' CPU backend runs 4-bit forward and backward) with fp32 compute, so
both runs do the same arithmetic on the same dequantized weights and the comparison holds to 1e-5 relative, as for
LoRA on an fp32 base (tests/hf/test_lora.py). The packed weights and every layer's quantization state stay bit-unchanged.
An 8-bit base stays refused before training, with the fix named.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Trainer, TrainingArguments

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.hf.peft_support import frozen_costs
from lazytrain_hf.models import load_model
from lazytrain_hf.profiling import analytic_cost_model, model_shape
from lazytrain_hf.streaming.quant import quant_tensors

from .test_trainer import EXACT, _collate, _common, _logs
from .tiny_data import tiny_dataset

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")


def _qlora(base_dir, quant_type: str = "nf4", double: bool = True):
    """A PEFT LoRA model (r 8, all linear layers, B random) over the 4-bit base saved in `base_dir`."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                               bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), quantization_config=quant, device_map="cpu",
                                                dtype=torch.float32)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    torch.manual_seed(3)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, cfg)


def _base(tmp_path, arch: str):
    path = tmp_path / "base"
    load_model(arch, "float32", seed=3).save_pretrained(str(path))
    return path


def _frozen_state(model) -> dict[str, torch.Tensor]:
    """Every 4-bit weight's packed data and quantization-state tensors, and the other frozen parameters (copies)."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            continue
        out[name] = p.detach().clone()
        for path, t in quant_tensors(p):
            out[f"{name}:{path}"] = t.clone()
    return out


def _four_bit(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"]


@pytest.mark.parametrize("arch,quant_type,double,policy", [
    ("qwen2-tiny", "nf4", True, "fixed"), ("qwen2-tiny", "nf4", True, "milp"),
    ("qwen3-tiny", "nf4", True, "fixed"), ("qwen3-tiny", "nf4", True, "milp"),
    ("qwen3-tiny", "fp4", False, "fixed")])
def test_qlora_equals_stock_trainer_with_peft_on_the_same_4bit_base(tmp_path, arch, quant_type, double, policy):
    base = _base(tmp_path, arch)
    stock_model, model = _qlora(base, quant_type, double), _qlora(base, quant_type, double)
    assert _four_bit(model) and all(q.dtype == torch.uint8 for _, q in _four_bit(model))
    before = _frozen_state(model)
    assert all(torch.equal(t, before[k]) for k, t in _frozen_state(stock_model).items())  # the same base
    ds = tiny_dataset(model.config.vocab_size)
    stock = Trainer(model=stock_model, args=TrainingArguments(**_common(tmp_path, "stock", optim="adamw_torch")),
                    train_dataset=ds, data_collator=_collate)
    stock.train()
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", optim="adamw_torch"),
                                                               lazytrain_config={**EXACT, "policy": policy}),
                       train_dataset=ds, data_collator=_collate)
    lazy.train()

    assert len(_logs(lazy, "loss")) == len(_logs(stock, "loss")) == 3
    for key in ("loss", "grad_norm"):
        for a, b in zip(_logs(lazy, key), _logs(stock, key), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (key, a, b)
    assert any(g > 1.0 for g in _logs(stock, "grad_norm")), "the test must exercise clipping"
    ref = dict(stock.model.named_parameters())
    trained = [(n, p) for n, p in lazy.model.named_parameters() if p.requires_grad]
    assert trained
    for name, p in trained:
        want = ref[name].detach()
        assert (p.detach() - want).norm() <= 1e-5 * want.norm(), name
    after = _frozen_state(lazy.model)
    assert after.keys() == before.keys()
    for k, t in after.items():  # packed bytes, quantization state, norms: the same bits
        assert torch.equal(t, before[k]), k
    ex = lazy.executor
    assert all(ex.frozen) and ex.store.grad_bytes == 0 and ex.stats.d2h_grad_bytes == 0


def test_every_slot_load_carries_the_layers_own_quantization_state(tmp_path):
    """The host store holds each layer's quantization state after its packed weights (one host copy: the layer's
    state tensors view the store), and a slot loaded with layer i computes with layer i's state."""
    model = _qlora(_base(tmp_path, "qwen2-tiny"))
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", optim="adamw_torch"),
                                                               lazytrain_config=dict(EXACT)),
                       train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)
    ex = lazy.executor
    for layer, bufs in zip(ex.layers, ex.store.buffers):
        packed = sum(p.numel() for _, p in _four_bit(layer))
        qbytes = sum(t.numel() * t.element_size() for _, p in _four_bit(layer) for _, t in quant_tensors(p))
        assert bufs.quant and sum(s.numel * s.dtype.itemsize for s in bufs.quant) == qbytes
        q8 = sum(s.numel for s in bufs.quant if s.dtype == torch.uint8)  # packed bytes as they are, then the state
        assert packed + q8 <= bufs.weights[torch.uint8].numel() < packed + q8 + 64 * len(bufs.quant)
        assert all(s.offset * s.dtype.itemsize % 64 == 0 for s in bufs.quant)
        starts = {t.untyped_storage().data_ptr() for t in bufs.weights.values()}
        for _, p in _four_bit(layer):
            assert {t.untyped_storage().data_ptr() for _, t in quant_tensors(p)} <= starts
    assert not torch.equal(*(dict(quant_tensors(ex.layers[i].mlp.up_proj.base_layer.weight))["absmax"]
                             for i in (0, 1)))
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    lazy.model.eval()  # eval without gradients: where bitsandbytes' CPU path would repack the weights in place
    with torch.no_grad():
        want = lazy.model(input_ids=ids).logits
        got = lazy.streaming_model(input_ids=ids).logits
    assert (got - want).norm() <= 1e-6 * want.norm()
    for layer, bufs in zip(ex.layers, ex.store.buffers):  # the host layers still read the store's bytes
        starts = {t.untyped_storage().data_ptr() for t in bufs.weights.values()}
        assert all(p.untyped_storage().data_ptr() in starts for _, p in _four_bit(layer))
    for slot in ex.streamer.slots:  # and the slots their own buffers
        starts = {t.untyped_storage().data_ptr() for t in slot.weights.values()}
        assert all(p.untyped_storage().data_ptr() in starts and t.untyped_storage().data_ptr() in starts
                   for _, p in _four_bit(slot.module) for _, t in quant_tensors(p))


def test_cost_model_counts_the_4bit_bytes(tmp_path):
    """The frozen layout of a 4-bit base carries each layer's 4-bit parameters and streamed bytes (packed data +
    quantization state); the analytic cost model streams and keeps on the host those bytes plus 2 per remaining
    parameter, instead of 2 per parameter."""
    model = _qlora(_base(tmp_path, "qwen3-tiny"))
    lazy = LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", optim="adamw_torch"),
                                                               lazytrain_config=dict(EXACT)),
                       train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)
    costs = frozen_costs(lazy.executor)
    # the logged TFLOPS count a 4-bit weight by its original shape (the packed data holds 2 per byte)
    logical = {n: math.prod(p.quant_state.shape) if type(p).__name__ == "Params4bit" else p.numel()
               for n, p in model.named_parameters() if not p.requires_grad}
    assert lazy.meter.frozen_params == sum(logical.values()) > sum(p.numel() for p in model.parameters()
                                                                   if not p.requires_grad)
    for layer, (q, b) in zip(lazy.executor.layers, costs["quantized"], strict=True):
        four = _four_bit(layer)
        assert q == sum(math.prod(p.quant_state.shape) for _, p in four) == 2 * sum(p.numel() for _, p in four)
        assert b == sum(p.numel() + sum(t.numel() * t.element_size() for _, t in quant_tensors(p)) for _, p in four)
    kw = dict(gpu_bytes=2**30, host_bytes=2**32)
    plain = {k: v for k, v in costs.items() if k != "quantized"}
    cm4 = analytic_cost_model(model.config, 2, 16, **kw, **costs)
    cm16 = analytic_cost_model(model.config, 2, 16, **kw, **plain)
    params = model_shape(model.config).layer_params
    for i, (q, b) in enumerate(costs["quantized"]):
        assert cm16.param_bytes[i] == 2 * params[i]
        assert cm4.param_bytes[i] == 2 * (params[i] - q) + b < cm16.param_bytes[i]
    saved = sum(a - b for a, b in zip(cm16.param_bytes, cm4.param_bytes))
    assert cm16.host_fixed_bytes - cm4.host_fixed_bytes == saved > 0
    assert lazy.plans is not None and "quantized" in (lazy.plans.request.inputs(16).get("frozen") or {})


def test_an_8bit_base_is_refused_before_training(tmp_path):
    model = peft.get_peft_model(load_model("qwen2-tiny", "float32", seed=3),
                                peft.LoraConfig(r=4, target_modules=["q_proj"]))
    up = model.get_base_model().model.layers[0].mlp.up_proj
    up.weight = bnb.nn.Int8Params(torch.zeros_like(up.weight, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match=r"cannot stream bitsandbytes 8-bit weights \(.*layers\.0\.mlp\.up_proj"
                                         r"\.weight is Int8Params\).*load_in_4bit=True.*policy='none'"):
        LazyTrainer(model=model, args=LazyTrainingArguments(**_common(tmp_path, "lazy", optim="adamw_torch")),
                    train_dataset=tiny_dataset(model.config.vocab_size), data_collator=_collate)
