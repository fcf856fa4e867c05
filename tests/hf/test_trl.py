"""TRL's SFTTrainer through `LazyTrainerMixin` with an `SFTConfig`: TRL's own loss (its fused LM head over the
streamed layers), completion-only masking and TRL's logged metrics equal the stock SFTTrainer's (fp32, gradient
accumulation 2, clipping); the config's defaults that are the executor's business are taken over."""

from __future__ import annotations

import copy
import logging
import math
import pickle

import pytest
import torch

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from lazytrain_hf import LazyTrainerMixin, LazyTrainingArguments  # noqa: E402
from lazytrain_hf.hf.foreign_args import lazy_args_class  # noqa: E402
from lazytrain_hf.models import load_model  # noqa: E402

from ..conftest import rel_err  # noqa: E402
from .test_trainer import EXACT, NOISE_ONLY, _logs  # noqa: E402
from .test_user_loss import _assert_equal_runs  # noqa: E402


class LazySFT(LazyTrainerMixin, SFTTrainer):
    pass


def _tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the model's vocabulary ("w3" is token 3), built in memory: nothing downloads."""
    words = {"[UNK]": 0, "<pad>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<pad>", eos_token="</s>")


def _prompt_completion(vocab: int, n: int = 12, seed: int = 0) -> Dataset:
    """Prompt / completion pairs of unequal lengths (prompts 2..6 words, completions 3..9)."""
    g = torch.Generator().manual_seed(seed)
    words = lambda k: " ".join(f"w{int(i)}" for i in torch.randint(3, vocab, (k,), generator=g))  # noqa: E731
    return Dataset.from_list([{"prompt": words(2 + i % 5), "completion": " " + words(3 + (i * 5) % 7)} for i in range(n)])


def _config(tmp_path, name: str, **kw) -> dict:
    base = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                max_steps=3, learning_rate=1e-3, weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="constant",
                logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
                dataloader_num_workers=0, disable_tqdm=True, bf16=False, completion_only_loss=True, max_length=None)
    base.update(kw)
    return base


def _pair(tmp_path, arch: str = "qwen3-tiny", lazy_cfg: dict | None = None, **kw):
    model = load_model(arch, "float32", seed=3)
    vocab = model.config.vocab_size
    ds, tok = _prompt_completion(vocab), _tokenizer(vocab)
    stock = SFTTrainer(model=copy.deepcopy(model), args=SFTConfig(**_config(tmp_path, "stock", optim="adamw_torch",
                                                                             **kw)),
                       train_dataset=ds, processing_class=tok)
    stock.train()
    # the SFTConfig as a TRL user writes it (TRL's default optimizer and gradient checkpointing: taken over)
    lazy = LazySFT(model=model, args=SFTConfig(**_config(tmp_path, "lazy", **kw)), train_dataset=ds,
                   processing_class=tok, lazytrain_config={**EXACT, **(lazy_cfg or {})})
    lazy.train()
    return stock, lazy


def test_the_takeover_lines_reach_a_script_that_set_no_log_level(tmp_path, caplog, monkeypatch):
    """The SFTConfig's defaults taken over are logged while the arguments convert, before the Trainer sets up its
    logging: the lazytrain_hf logger's level is set first, so a fresh process (no level set) prints them."""
    monkeypatch.setattr(logging.getLogger("lazytrain_hf"), "level", logging.NOTSET)
    model = load_model("qwen3-tiny", "float32", seed=3)
    vocab = model.config.vocab_size
    LazySFT(model=model, args=SFTConfig(**_config(tmp_path, "lazy")), train_dataset=_prompt_completion(vocab),
            processing_class=_tokenizer(vocab), lazytrain_config=dict(EXACT))
    text = [r.message for r in caplog.records]
    assert any("gradient_checkpointing=True (SFTConfig's default) is taken over" in m for m in text), text
    assert any("is replaced by 'lazytrain_hybrid8'" in m for m in text), text


@pytest.mark.parametrize("arch, placement", [("qwen3-tiny", "gpu"), ("qwen3-tiny-untied", "host")])
def test_sft_trainer_through_the_mixin_trains_as_the_stock_sft_trainer(tmp_path, caplog, arch, placement):
    with caplog.at_level(logging.INFO, logger="lazytrain_hf"):
        stock, lazy = _pair(tmp_path, arch, lazy_cfg={"resident_placement": placement})
    assert isinstance(lazy.args, LazyTrainingArguments) and isinstance(lazy.args, SFTConfig)
    assert lazy.executor.resident.placement == placement
    assert stock.args.gradient_checkpointing and not lazy.args.gradient_checkpointing
    assert sum("gradient_checkpointing=True (SFTConfig's default) is taken over" in r.message
               for r in caplog.records) == 1
    assert lazy.user_loss == ["compute_loss of SFTTrainer"]
    # completion-only: the prompts' labels are masked in the batches both trained on
    batch = lazy.data_collator([lazy.train_dataset[i] for i in range(2)])
    assert batch["labels"].eq(-100).any() and batch["labels"].ne(-100).any()
    _assert_equal_runs(stock, lazy, ("loss", "grad_norm", "mean_token_accuracy", "entropy", "num_tokens"))


def test_the_completion_only_loss_differs_from_the_full_sequence_loss(tmp_path):
    """The masking is what the equality above exercises: without it the first loss is another number."""
    _, masked = _pair(tmp_path / "masked", max_steps=1)
    _, full = _pair(tmp_path / "full", max_steps=1, completion_only_loss=False)
    assert not math.isclose(_logs(masked, "loss")[0], _logs(full, "loss")[0], rel_tol=1e-3)


def test_sft_padding_free_packs_rows_and_trains_as_the_stock_sft_trainer(tmp_path):
    """SFTConfig(padding_free=True): TRL's collator puts a micro-batch's examples in one row with positions that
    restart per example, and the streamed layers train on it as the stock SFTTrainer does (transformers builds the
    block-causal mask from the positions)."""
    stock, lazy = _pair(tmp_path, padding_free=True)
    batch = lazy.data_collator([lazy.train_dataset[i] for i in range(2)])
    lengths = [len(lazy.train_dataset[i]["input_ids"]) for i in range(2)]
    assert batch["input_ids"].shape == (1, sum(lengths))
    assert batch["position_ids"][0, lengths[0]] == 0  # the second example starts over
    _assert_equal_runs(stock, lazy, ("loss", "grad_norm", "mean_token_accuracy", "num_tokens"))


def test_sft_with_peft_config_trains_the_adapters_as_the_stock_sft_trainer(tmp_path):
    """SFTTrainer(peft_config=...) through the mixin: TRL wraps the model in its PEFT adapters, the executor streams
    the frozen base, and losses, gradient norms and the trained adapters equal the stock SFTTrainer's."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    vocab = model.config.vocab_size
    ds, tok = _prompt_completion(vocab), _tokenizer(vocab)

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                               init_lora_weights=False)

    torch.manual_seed(0)
    stock = SFTTrainer(model=copy.deepcopy(model), args=SFTConfig(**_config(tmp_path, "stock", optim="adamw_torch")),
                       train_dataset=ds, processing_class=tok, peft_config=lora())
    stock.train()
    torch.manual_seed(0)
    lazy = LazySFT(model=model, args=SFTConfig(**_config(tmp_path, "lazy", optim="adamw_torch")), train_dataset=ds,
                   processing_class=tok, peft_config=lora(), lazytrain_config=dict(EXACT))
    lazy.train()
    assert type(lazy.model).__name__ == "PeftModel" and all(lazy.executor.frozen)
    _assert_equal_runs(stock, lazy, ("loss", "grad_norm", "mean_token_accuracy"))


def test_the_lazy_sft_config_class_holds_both_settings(tmp_path):
    cls = lazy_args_class(SFTConfig)
    args = cls(**_config(tmp_path, "a"), lazytrain_config={"checkpoint_every": 3})
    assert args.lazy_config.checkpoint_every == 3 and args.completion_only_loss and args.logging_steps == 1
    assert not args.gradient_checkpointing and str(args.optim.value) == "lazytrain_hybrid8"
    again = pickle.loads(pickle.dumps(args))  # the Trainer saves training_args.bin with torch.save
    assert type(again) is cls and again.lazy_config.checkpoint_every == 3
    with pytest.raises(ValueError, match="gradient_checkpointing=True conflicts"):
        cls(**_config(tmp_path, "b"), gradient_checkpointing=True)  # set in the LazyTrain class: the user's choice


def test_lazytrain_config_given_twice_is_refused(tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=3)
    args = lazy_args_class(SFTConfig)(**_config(tmp_path, "a"))
    with pytest.raises(ValueError, match="set it in one place"):
        LazySFT(model=model, args=args, train_dataset=_prompt_completion(model.config.vocab_size),
                processing_class=_tokenizer(model.config.vocab_size), lazytrain_config=dict(EXACT))


def test_activation_offloading_is_refused_at_build(tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=3)
    with pytest.raises(ValueError, match="activation_offloading=True"):
        LazySFT(model=model, args=SFTConfig(**_config(tmp_path, "a"), activation_offloading=True),
                train_dataset=_prompt_completion(model.config.vocab_size),
                processing_class=_tokenizer(model.config.vocab_size), lazytrain_config=dict(EXACT))


class LazyDPO(LazyTrainerMixin, trl.DPOTrainer):
    pass


def _preference(vocab: int, n: int = 12, seed: int = 0) -> Dataset:
    """Prompt / chosen / rejected triples of unequal lengths (prompts 2..5 words, completions 2..7)."""
    g = torch.Generator().manual_seed(seed)
    words = lambda k: " ".join(f"w{int(i)}" for i in torch.randint(3, vocab, (k,), generator=g))  # noqa: E731
    return Dataset.from_list([{"prompt": words(2 + i % 4), "chosen": " " + words(3 + i % 5),
                               "rejected": " " + words(2 + (i * 3) % 5)} for i in range(n)])


def _dpo_kw(tmp_path, **kw) -> dict:
    base = {k: v for k, v in _config(tmp_path, "x").items() if k not in ("output_dir", "completion_only_loss")}
    return {**base, "beta": 0.5, **kw}


def _assert_dpo_runs_equal(stock, lazy, beta: float) -> None:
    """Three logged steps of loss, grad_norm, sequence log-probs and rewards equal the stock DPOTrainer's; clipping
    exercised; the policy moved off the reference; final parameters within 1e-5."""
    assert len(_logs(lazy, "loss")) == 3
    assert any(g > 1.0 for g in _logs(stock, "grad_norm")), "the test must exercise clipping"
    for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
        for a, b in zip(_logs(lazy, key), _logs(stock, key), strict=True):
            assert math.isclose(a, b, rel_tol=1e-5), (key, a, b)
    # rewards are beta x differences of sequence log-probs: 1e-5 of the log-probs they cancel from
    tol = 1e-5 * beta * max(abs(x) for x in _logs(stock, "logps/chosen") + _logs(stock, "logps/rejected"))
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        for a, b in zip(_logs(lazy, key), _logs(stock, key), strict=True):
            assert math.isclose(a, b, abs_tol=tol), (key, a, b)
    assert any(m != 0 for m in _logs(stock, "rewards/margins")), "the policy must move off the reference"
    stock_params = dict(stock.model.named_parameters())
    for name, p in lazy.model.named_parameters():
        if not name.endswith(NOISE_ONLY):
            assert rel_err(p.detach(), stock_params[name].detach()) < 1e-5, name


def test_dpo_with_precomputed_reference_log_probs_trains_as_the_stock_dpo_trainer(tmp_path, monkeypatch):
    """DPOTrainer takes ref_model second: the mixin binds the Trainer's own signature. The reference log-probs are
    precomputed by DPOTrainer when it is built, before the executor holds the model; the policy's pass is TRL's fused
    head over the streamed layers."""
    model = load_model("qwen3-tiny", "float32", seed=3)
    vocab = model.config.vocab_size
    ds, tok = _preference(vocab), _tokenizer(vocab)
    kw = _dpo_kw(tmp_path, precompute_ref_log_probs=True)
    stock = trl.DPOTrainer(model=copy.deepcopy(model), args=trl.DPOConfig(output_dir=str(tmp_path / "stock"),
                                                                           optim="adamw_torch", **kw),
                           train_dataset=ds, processing_class=tok)
    stock.train()
    ref_models = []
    original = trl.DPOTrainer.compute_ref_log_probs
    monkeypatch.setattr(trl.DPOTrainer, "compute_ref_log_probs",
                        lambda self, model, inputs: ref_models.append(type(model).__name__) or original(self, model,
                                                                                                       inputs))
    lazy = LazyDPO(model=model, args=trl.DPOConfig(output_dir=str(tmp_path / "lazy"), **kw), train_dataset=ds,
                   processing_class=tok, lazytrain_config=dict(EXACT))
    lazy.train()
    assert lazy.ref_model is None and lazy.user_loss == ["compute_loss of DPOTrainer"]
    # precomputed once the executor held the model, through its streamed no-grad forward
    assert ref_models and set(ref_models) == {"StreamedCausalLM"}
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        assert rel_err(torch.tensor(lazy.train_dataset[key]), torch.tensor(stock.train_dataset[key])) < 1e-5, key
    _assert_dpo_runs_equal(stock, lazy, kw["beta"])


def _lora_config():
    """LoRA on every linear layer, B initialized randomly: the policy differs from the base (the reference) from the
    first step."""
    return peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)


class _HeadGrads(TrainerCallback):
    """Whether the LM head held a gradient when each optimizer step began."""

    def __init__(self, head: torch.nn.Module) -> None:
        self.head, self.seen = head, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.seen.append(self.head.weight.grad is not None)


@pytest.mark.parametrize("arch, placement, wrapped, optim", [("qwen3-tiny", "gpu", False, None),
                                                             ("qwen2-tiny", "gpu", True, None),
                                                             ("qwen3-tiny-untied", "host", False, "adamw_torch")])
def test_dpo_with_a_peft_policy_trains_as_the_stock_dpo_trainer_with_peft(tmp_path, monkeypatch, arch, placement,
                                                                          wrapped, optim):
    """No ref_model: DPOTrainer's loss computes the reference after the policy's forward, the base with the adapters
    disabled (peft_config=) or TRL's frozen "ref" copy of a given adapter (a PeftModel). Under the executor that is a
    no-grad streamed forward (the host layers' own modules never run) that leaves the policy's pass, and so its
    gradient, as the stock trainer has it; a frozen LM head (on the host too) gets no gradient."""
    from lazytrain_hf.streaming.executor import StreamingExecutor

    model = load_model(arch, "float32", seed=3)
    vocab = model.config.vocab_size
    ds, tok = _preference(vocab), _tokenizer(vocab)
    kw = _dpo_kw(tmp_path, eval_strategy="steps", eval_steps=2)  # an evaluation between training steps

    def build(cls, m, name, optim, **extra):
        torch.manual_seed(0)  # the adapters' random init
        m, peft_kw = (peft.get_peft_model(m, _lora_config()), {}) if wrapped else (m, {"peft_config": _lora_config()})
        args = trl.DPOConfig(output_dir=str(tmp_path / name), **kw, **({"optim": optim} if optim else {}))
        return cls(model=m, args=args, train_dataset=ds, eval_dataset=_preference(vocab, n=6, seed=1),
                   processing_class=tok, **peft_kw, **extra)

    stock = build(trl.DPOTrainer, copy.deepcopy(model), "stock", "adamw_torch")
    stock.train()
    streamed = []
    original = StreamingExecutor.forward_hidden
    monkeypatch.setattr(StreamingExecutor, "forward_hidden",
                        lambda self, *a, **k: streamed.append(self.model.training) or original(self, *a, **k))
    # the fixed policy: the MILP's layer profiling would run the host layers' modules the check below watches
    lazy = build(LazyDPO, model, "lazy", optim, lazytrain_config={**EXACT, "resident_placement": placement,
                                                                 "policy": "fixed"})
    host_runs = []
    for layer in lazy.executor.layers:  # after the executor copied them into its slots' templates
        layer.register_forward_pre_hook(lambda m, a: host_runs.append(m))
    head = _HeadGrads(lazy.executor.resident.head)
    lazy.add_callback(head)
    lazy.train()
    assert isinstance(lazy.model, peft.PeftModel) and lazy.ref_model is None
    assert lazy.executor.resident.placement == placement and all(lazy.executor.frozen)
    assert ("ref" in lazy.model.peft_config) == wrapped  # TRL's frozen copy of a given adapter
    assert head.seen == [False] * 3
    _assert_dpo_runs_equal(stock, lazy, kw["beta"])  # training metrics only: the evaluations' are eval_*
    evals = [[h for h in t.state.log_history if "eval_loss" in h] for t in (stock, lazy)]
    for want, got in zip(*evals, strict=True):
        tol = 1e-5 * kw["beta"] * max(abs(want["eval_logps/chosen"]), abs(want["eval_logps/rejected"]))
        for key in ("eval_loss", "eval_logps/chosen", "eval_logps/rejected", "eval_rewards/chosen",
                    "eval_rewards/rejected"):
            assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=tol if "rewards" in key else 0), key
    # streamed, never the host layers' modules: one reference forward per training micro-batch; in each evaluation
    # (one batch) the policy's and the reference's
    assert streamed.count(True) == 6 and streamed.count(False) == 2 * len(evals[0]) and not host_runs


REFUSED = {"ref_model": r"ref_model= \(a second full model\) is not supported .* precompute_ref_log_probs=True .* PEFT",
           "no reference": r"loads a second copy of the model .* precompute_ref_log_probs=True .* PEFT policy",
           "prefix tuning": r"PEFT PREFIX_TUNING cannot run .*peft\.LoraConfig",
           "prompt tuning": r"PEFT PROMPT_TUNING cannot run .*peft\.LoraConfig"}


@pytest.mark.parametrize("case", list(REFUSED))
def test_references_and_peft_methods_the_executor_cannot_run_are_refused_at_build(tmp_path, monkeypatch, case):
    model = load_model("qwen3-tiny", "float32", seed=3)
    extra = {"ref_model": copy.deepcopy(model), "peft_config": _lora_config()} if case == "ref_model" else {}
    if case == "prefix tuning":
        extra["peft_config"] = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    if case == "prompt tuning":
        model = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    built = []
    monkeypatch.setattr(trl.DPOTrainer, "_prepare_dataset", lambda self, *a, **k: built.append(1))
    with pytest.raises(ValueError, match=REFUSED[case]):
        LazyDPO(model=model, args=trl.DPOConfig(output_dir=str(tmp_path / "a"), **_dpo_kw(tmp_path)),
                train_dataset=_preference(model.config.vocab_size), processing_class=_tokenizer(model.config.vocab_size),
                lazytrain_config=dict(EXACT), **extra)
    assert not built, "refused before TRL prepares the data"


def test_the_plan_reads_a_preference_data_sets_rows_and_lengths(tmp_path, caplog):
    """TRL's preference collator stacks chosen and rejected (2 rows per example), each prompt + completion, cut at
    max_length: the planned micro-batch is that, without the 1024-token fallback."""
    from lazytrain_hf.hf.plan import run_shape

    model = load_model("qwen3-tiny", "float32", seed=3)
    vocab = model.config.vocab_size
    for max_length, name in ((None, "a"), (9, "b")):
        lazy = LazyDPO(model=copy.deepcopy(model), args=trl.DPOConfig(output_dir=str(tmp_path / name),
                                                                      **_dpo_kw(tmp_path, max_length=max_length)),
                       train_dataset=_preference(vocab), processing_class=_tokenizer(vocab),
                       peft_config=_lora_config(), lazytrain_config=dict(EXACT))
        ds = lazy.train_dataset
        longest = max(len(p) + max(len(c), len(r)) for p, c, r in zip(ds["prompt_ids"], ds["chosen_ids"],
                                                                        ds["rejected_ids"], strict=True))
        assert longest > 9
        want = min(longest, max_length or longest)
        batch = lazy.data_collator([ds[i] for i in range(len(ds))])
        assert batch["input_ids"].shape == (2 * len(ds), want)  # what the collator makes of the whole data set
        with caplog.at_level(logging.WARNING, logger="lazytrain_hf"):
            assert run_shape(lazy) == (2 * lazy.args.per_device_train_batch_size, -(-want // 8) * 8)
        assert "cannot read input_ids lengths" not in caplog.text
