"""fp16=True under LazyTrainer: GradScaler's dynamic loss scale, unscaled inside the fused clip and update.

On CPU the model computes in its own dtype (no fp16 autocast there, as accelerate), so with fp32 weights the scaled
run is exact against the unscaled one (a power-of-two scale commutes with rounding): the unscale is tested exactly.
An overflow is provoked by a scale near fp32's range (the norm of the scaled gradients is inf).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import TrainerCallback

from lazytrain_hf import LazyTrainer, LazyTrainingArguments
from lazytrain_hf.hf.loss_scale import LossScaler
from lazytrain_hf.models import load_model
from lazytrain_hf.optim import Hybrid8bitOptimizer

from ..conftest import rel_err
from .test_trainer import EXACT, _collate, _common, _dataset, _logs
from .test_user_loss import WeightedLoss

ROWS_PER_STEP = 4  # per_device_train_batch_size 2 x gradient_accumulation_steps 2 (`_common`)


def _trainer(tmp_path, name, model, ds, scaler=None, callbacks=None, cfg=None, cls=LazyTrainer, **kw):
    args = LazyTrainingArguments(**_common(tmp_path, name, train_sampling_strategy="sequential", **kw),
                                 lazytrain_config=dict(cfg or EXACT))
    t = cls(model=model, args=args, train_dataset=ds, data_collator=_collate, callbacks=callbacks)
    if scaler is not None:
        for k, v in scaler.items():
            setattr(t.loss_scaler, k, v)
    return t


class Snapshots(TrainerCallback):
    """After each optimizer step (deferred updates landed): every parameter, optimizer state tensor and step
    counter, the LR scheduler's step count."""

    def __init__(self) -> None:
        self.trainer: LazyTrainer | None = None
        self.steps: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        tr = self.trainer
        tr.executor.flush_updates()
        opt = tr._inner_optimizer(tr.optimizer)
        self.steps.append({
            "params": {n: p.detach().clone() for n, p in tr.model.named_parameters()},
            "states": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
                       for i, p in enumerate(p for g in opt.param_groups for p in g["params"])},
            "sched": tr.lr_scheduler.last_epoch,
        })


def _same(a: dict, b: dict) -> bool:
    return a["params"].keys() == b["params"].keys() and all(
        torch.equal(a["params"][n], b["params"][n]) for n in a["params"]) and a["states"].keys() == b["states"].keys() \
        and all(a["states"][i].keys() == b["states"][i].keys() and all(
            torch.equal(v, b["states"][i][k]) if torch.is_tensor(v) else v == b["states"][i][k]
            for k, v in a["states"][i].items()) for i in a["states"])


def test_loss_scaler_follows_grad_scaler():
    """The scale and growth tracker after each step equal torch.amp.GradScaler's for the same overflow pattern."""
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    ours = LossScaler(init_scale=2.0 ** 10, growth_interval=3)
    for overflow in [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0]:
        ref.scale(torch.ones(()))  # (GradScaler sets its scale up here)
        p.grad = torch.full((3,), math.inf if overflow else 1.0)
        ref.step(opt)
        ref.update()
        ours.update(bool(overflow))
        assert ours.scale == ref.get_scale() and ours._growth_tracker == ref.state_dict()["_growth_tracker"]
    restored = LossScaler()
    restored.load_state_dict(ref.state_dict())
    assert restored.state_dict() == ours.state_dict()
    assert LossScaler().state_dict().keys() == torch.amp.GradScaler("cpu").state_dict().keys()


class _UserLossTrainer(WeightedLoss, LazyTrainer):
    pass


@pytest.mark.parametrize("max_grad_norm, cls", [(1.0, LazyTrainer), (0.0, LazyTrainer), (1.0, _UserLossTrainer)],
                         ids=["clip", "no-clip", "user-loss"])
def test_fp16_scaled_run_equals_the_unscaled_one(tmp_path, monkeypatch, max_grad_norm, cls):
    """fp16=True (scale 2**16, grown after every step) equals fp16=False within 1e-6: loss, grad_norm (the
    unscaled norm), parameters; with clipping (it acts: grad_norm > 1), without (max_grad_norm 0), and with the
    user's `compute_loss` (its loss multiplied by the scale before backward)."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    ds = _dataset(model.config.vocab_size)
    plain = _trainer(tmp_path, "plain", copy.deepcopy(model), ds, max_grad_norm=max_grad_norm, max_steps=2, cls=cls)
    plain.train()
    scaled = _trainer(tmp_path, "fp16", model, ds, scaler={"growth_interval": 1}, fp16=True,
                      max_grad_norm=max_grad_norm, max_steps=2, cls=cls)
    assert bool(scaled.user_loss) == (cls is _UserLossTrainer)
    seen = []  # (norm of the gradient buffers, grad_scale) the optimizer got
    original = Hybrid8bitOptimizer.clip_grad_norm

    def spy(self, max_norm, norm=None, *, grad_scale=1.0):
        seen.append((float(norm), grad_scale))
        return original(self, max_norm, norm, grad_scale=grad_scale)

    monkeypatch.setattr(Hybrid8bitOptimizer, "clip_grad_norm", spy)
    scaled.train()
    assert [g for _, g in seen] == [2.0 ** 16, 2.0 ** 17]  # the buffers hold S x the gradient
    for (raw, g), logged in zip(seen, _logs(scaled, "grad_norm"), strict=True):
        assert math.isclose(raw, g * logged, rel_tol=1e-6), (raw, g, logged)
    assert _logs(scaled, "loss_scale") == [2.0 ** 17, 2.0 ** 18]
    assert "optimizer_step_skipped" not in scaled.state.log_history[-2]
    for key in ("loss", "grad_norm"):
        for a, b in zip(_logs(scaled, key), _logs(plain, key), strict=True):
            assert math.isclose(a, b, rel_tol=1e-6), (key, a, b)
    if max_grad_norm:
        assert any(g > max_grad_norm for g in _logs(plain, "grad_norm")), "the test must exercise clipping"
    ref = dict(plain.model.named_parameters())
    for name, p in scaled.model.named_parameters():
        assert rel_err(p.detach(), ref[name].detach()) < 1e-6, name


def test_an_overflowing_step_is_skipped_and_the_scale_halves(tmp_path):
    """A scale near fp32's range overflows every other step: a skipped step leaves every parameter, optimizer state
    and step counter bit-unchanged, halves the scale, does not step the LR scheduler (as the stock Trainer with
    GradScaler); the other steps equal an unscaled run on the batches those steps used (grad_norm: unscaled)."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    steps = 6
    ds = _dataset(model.config.vocab_size, n=steps * ROWS_PER_STEP)
    snaps = Snapshots()
    scaled = _trainer(tmp_path, "fp16", copy.deepcopy(model), ds, scaler={"scale": 2.0 ** 62, "growth_interval": 1},
                      callbacks=[snaps], fp16=True, max_steps=steps)
    snaps.trainer = scaled
    scaled.train()
    logs = [h for h in scaled.state.log_history if "loss" in h]
    skipped = [i for i, h in enumerate(logs) if h.get("optimizer_step_skipped")]
    # (a skipped first step has no earlier snapshot to compare with)
    assert [i for i in skipped if i > 0] and any(i not in skipped for i in range(skipped[0], steps)), skipped
    for i in (i for i in skipped if i > 0):
        assert _same(snaps.steps[i], snaps.steps[i - 1]), f"step {i + 1} was skipped but changed the state"
        assert logs[i]["loss_scale"] == logs[i - 1]["loss_scale"] / 2
        assert snaps.steps[i]["sched"] == snaps.steps[i - 1]["sched"]
        assert not math.isfinite(logs[i]["grad_norm"])
    kept = [i for i in range(steps) if i not in skipped]
    assert all(not _same(snaps.steps[i], snaps.steps[i - 1]) for i in kept if i > 0)
    assert scaled.lr_scheduler.last_epoch == len(kept)
    rows = [r for i in kept for r in range(i * ROWS_PER_STEP, (i + 1) * ROWS_PER_STEP)]
    plain = _trainer(tmp_path, "plain", model, ds.select(rows), max_steps=len(kept))
    plain.train()
    for a, b in zip([logs[i]["grad_norm"] for i in kept], _logs(plain, "grad_norm"), strict=True):
        assert math.isclose(a, b, rel_tol=1e-6), (a, b)
    ref = dict(plain.model.named_parameters())
    for name, p in scaled.model.named_parameters():
        assert rel_err(p.detach(), ref[name].detach()) < 1e-6, name


def test_resume_restores_the_loss_scale(tmp_path):
    """The checkpoint's scaler.pt (GradScaler's state dict) is restored: the resumed run continues with the saved
    scale and growth tracker and ends as the straight run (scale and parameters)."""
    model = load_model("qwen3-tiny", "float32", seed=7)
    ds = _dataset(model.config.vocab_size, n=16, seed=2)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, fp16=True)
    scaler = {"growth_interval": 2}
    straight = _trainer(tmp_path, "straight", copy.deepcopy(model), ds, scaler=scaler, **kw)
    straight.train()
    saved = torch.load(tmp_path / "straight" / "checkpoint-2" / "scaler.pt", weights_only=True)
    assert saved["scale"] == 2.0 ** 17 and saved["_growth_tracker"] == 0 and saved["growth_interval"] == 2
    assert straight.loss_scaler.scale == 2.0 ** 18
    resumed = _trainer(tmp_path, "straight", copy.deepcopy(model), ds, **kw)  # default growth_interval 2000
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    assert resumed.loss_scaler.state_dict() == straight.loss_scaler.state_dict()
    # (the resumed log history starts with the checkpoint's two steps)
    scales = [2.0 ** 16, 2.0 ** 17, 2.0 ** 17, 2.0 ** 18]  # (not restored: 2**16 at steps 3 and 4)
    assert _logs(resumed, "loss_scale") == _logs(straight, "loss_scale") == scales
    final = dict(straight.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert rel_err(p.detach(), final[name].detach()) < 1e-6, name


def test_fp16_with_another_optimizer_is_refused(tmp_path):
    """LoRA with optim adamw_torch (resident adapters only): fp16's scaler lives in lazytrain_hybrid8's update, so
    the combination is refused at construction, naming bf16=True."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(load_model("qwen3-tiny", "float32", seed=3),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"fp16=True with optim='adamw_torch'.*bf16=True"):
        _trainer(tmp_path, "lora", model, _dataset(model.config.vocab_size), fp16=True, optim="adamw_torch")


def test_an_fp16_model_trains_with_the_scaler_as_its_fp32_copy(tmp_path):
    """An fp16-loaded model (fp16 compute and gradients, fp32 master weights) with fp16=True follows the fp32 copy
    of the same weights: fp16 rounding apart, the logged grad_norm is the unscaled norm and the update is unscaled
    (the stock GradScaler refuses fp16 gradients)."""
    model = load_model("qwen3-tiny", "float16", seed=3)
    ds = _dataset(model.config.vocab_size)
    cfg = {**EXACT, "master_weights": "fp32"}
    wide = _trainer(tmp_path, "fp32", copy.deepcopy(model).float(), ds, cfg=cfg, max_steps=2)
    wide.train()
    half = _trainer(tmp_path, "fp16", model, ds, cfg=cfg, fp16=True, max_steps=2)
    half.train()
    assert _logs(half, "loss_scale") == [2.0 ** 16] * 2
    for key in ("loss", "grad_norm"):
        for a, b in zip(_logs(half, key), _logs(wide, key), strict=True):
            assert math.isclose(a, b, rel_tol=3e-3), (key, a, b)
    ref = dict(wide.model.named_parameters())
    for name, p in half.model.named_parameters():
        assert p.dtype == torch.float16
        assert rel_err(p.detach().float(), ref[name].detach()) < 1e-2, name
