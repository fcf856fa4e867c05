"""Model names resolved offline first (lazytrain_hf/sources.py): registry names and local directories never touch
the network; a Hub id costs one short request (none under HF_HUB_OFFLINE), never huggingface_hub's 5 retries with
back-off (~40-55 s on a machine without network before)."""

from __future__ import annotations

import time
import types

import huggingface_hub
import pytest

from lazytrain_hf import sources
from lazytrain_hf.models import resolve_config


@pytest.fixture
def hub(monkeypatch):
    """Count Hub requests; `hub.error` is what the (single) HEAD raises, None = the file exists."""
    class Hub:
        calls = 0
        error: BaseException | None = None

    def head(url, timeout=None, **kwargs):
        Hub.calls += 1
        Hub.timeout = timeout
        Hub.url = url
        if Hub.error is not None:
            raise Hub.error
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", head)
    monkeypatch.setattr(sources, "_cached", lambda name, filename="config.json": False)
    monkeypatch.setattr(sources, "_LOCATED", {})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return Hub


def test_registry_names_and_local_directories_need_no_network(hub, tmp_path):
    from transformers import Qwen3Config

    assert sources.locate_model("qwen2.5-7b") == ("registry", "qwen2.5-7b")
    Qwen3Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=512).save_pretrained(tmp_path / "m")
    assert sources.locate_model(str(tmp_path / "m")) == ("local", str(tmp_path / "m"))
    assert resolve_config(str(tmp_path / "m")).num_hidden_layers == 2
    assert hub.calls == 0


def test_unreachable_hub_fails_after_one_short_try(hub):
    hub.error = ConnectionError("[Errno -2] Name or service not known")
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as e:
        resolve_config("qwen9-999b")
    assert time.perf_counter() - t0 < 5 and hub.calls == 1 and hub.timeout <= 5
    msg = str(e.value)
    assert "unreachable" in msg and "qwen2.5-7b" in msg and "qwen3-8b" in msg  # the known config names
    assert "./my-model" in msg  # how to pass a local path


def test_offline_mode_asks_only_the_cache(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set") as e:
        sources.locate_model("Qwen/Qwen2.5-7B")
    assert hub.calls == 0 and "Did you mean 'qwen2.5-7b'" in str(e.value)
    monkeypatch.setattr(sources, "_cached", lambda name, filename="config.json": True)
    assert sources.locate_model("Qwen/Qwen2.5-7B") == ("cache", "Qwen/Qwen2.5-7B")


def test_unknown_hub_id_and_cached_fallback(hub, monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError

    response = types.SimpleNamespace(status_code=404, headers={}, request=None)
    hub.error = RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)
    with pytest.raises(ValueError, match="not a known config name, a local directory, or a model on the Hub"):
        sources.locate_model("someone/no-such-model")
    hub.error = TimeoutError("timed out")
    monkeypatch.setattr(sources, "_cached", lambda name, filename="config.json": True)  # unreachable, but in the cache: use it offline
    assert sources.locate_model("Qwen/Qwen3-8B") == ("cache", "Qwen/Qwen3-8B")
    hub.error = None
    assert sources.locate_model("Qwen/Qwen2.5-3B") == ("hub", "Qwen/Qwen2.5-3B")


@pytest.mark.parametrize("name", ["./no-model", "/no/such/model/dir", "not a valid id!"])
def test_bad_paths_and_ids_fail_without_a_request(hub, name):
    with pytest.raises(ValueError, match="Known config names"):
        sources.locate_model(name)
    assert hub.calls == 0


@pytest.mark.parametrize("name, match", [
    ("qwen-ofline", "did you mean 'qwen-offline'"), ("Qwen_Offline", "did you mean 'qwen-offline'"),
    ("qwen3-tiny-vocab", "model registry name"), ("./no-tokenizer", "does not exist"),
    ("not a valid id!", "not a local directory or a Hub id"),
])
def test_tokenizer_typos_fail_without_a_request(hub, name, match):
    """Before: AutoTokenizer.from_pretrained("qwen-ofline") spent ~64 s in huggingface_hub's retries."""
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        sources.locate_tokenizer(name)
    assert hub.calls == 0 and "Fix: use 'qwen-offline'" in str(e.value)


def test_tokenizer_hub_ids_one_short_request_or_the_cache(hub, monkeypatch, tmp_path):
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError

    assert sources.locate_tokenizer("qwen-offline") == ("bundled", "qwen-offline")
    assert sources.locate_tokenizer(str(tmp_path)) == ("local", str(tmp_path))
    assert hub.calls == 0
    # online: a real Hub id still loads from the Hub (the request asks for its tokenizer_config.json)
    assert sources.locate_tokenizer("Qwen/Qwen3-8B") == ("hub", "Qwen/Qwen3-8B")
    assert hub.calls == 1 and hub.url.endswith("tokenizer_config.json") and hub.timeout <= 5
    response = types.SimpleNamespace(status_code=404, headers={}, request=None)
    hub.error = RemoteEntryNotFoundError("404 Entry Not Found", response=response)  # the repository exists
    assert sources.locate_tokenizer("someone/tokenizer-json-only") == ("hub", "someone/tokenizer-json-only")
    hub.error = RepositoryNotFoundError("404 Client Error: Repository Not Found", response=response)
    with pytest.raises(ValueError, match="is not a local directory or a repository on the Hub"):
        sources.locate_tokenizer("Qwen/Qwen3-8B-typo")
    hub.error = ConnectionError("[Errno -2] Name or service not known")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="unreachable .*Fix: use 'qwen-offline'"):
        sources.locate_tokenizer("Qwen/Qwen2.5-7B")
    assert time.perf_counter() - t0 < 5
    calls = hub.calls
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline: the cache alone, no request
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set .*Fix: use 'qwen-offline'"):
        sources.locate_tokenizer("Qwen/Qwen2.5-3B")
    monkeypatch.setattr(sources, "_cached", lambda name, filename="config.json": filename == "tokenizer_config.json")
    assert sources.locate_tokenizer("Qwen/Qwen2.5-3B") == ("cache", "Qwen/Qwen2.5-3B")
    assert hub.calls == calls


def test_load_tokenizer_reads_a_cached_hub_tokenizer_without_the_network(hub, monkeypatch):
    """A tokenizer only the cache has is loaded with local_files_only (no request), a typo fails before any."""
    from lazytrain_hf.data import tokenizer as tokenizer_module

    seen = {}

    def from_pretrained(source, **kwargs):
        seen.update(source=source, **kwargs)
        raise OSError("stop here")
    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sources, "_cached", lambda name, filename="config.json": True)
    with pytest.raises(OSError, match="stop here"):
        tokenizer_module.load_tokenizer("Qwen/Qwen3-8B")
    assert seen == {"source": "Qwen/Qwen3-8B", "local_files_only": True}
    seen.clear()
    with pytest.raises(ValueError, match="did you mean 'qwen-offline'"):
        tokenizer_module.load_tokenizer("qwen-oflline")
    assert not seen and hub.calls == 0
