"""GSM8K / MetaMathQA loading, answer extraction, prompt formatting and SFT tokenization.

Two source schemas are accepted and normalized to one (see :data:`SCHEMAS`):

- GSM8K (OpenAI, Cobbe et al. 2021): ``question``, ``answer``; the answer's last line is ``#### <number>``.
- MetaMathQA (Yu et al. 2023, the data set the LazyTrain paper trains on): ``query``, ``response``; the
  response ends with ``The answer is: <answer>``.

Normalized columns: ``prompt`` (the question), ``response`` (the full worked solution, trained on verbatim)
and ``reference`` (the final answer after :func:`extract_answer`'s normalization).

Exact match follows MetaMath's GSM8K convention: compare the answer after the last ``####`` (or
"The answer is:") in the generation with the reference answer.
"""

import bisect
import hashlib
import logging
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import datasets
from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, PreTrainedTokenizerBase

from ..sources import SCHEMA_HELP, SCHEMAS, local_data_file, match_schema

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_PROMPT_TEMPLATE",
    "IGNORE_INDEX",
    "SCHEMAS",
    "extract_answer",
    "format_example",
    "format_prompt",
    "is_exact_match",
    "load_math_dataset",
    "make_collator",
    "normalize_answer",
    "pack_rows",
    "PackedRowsCollator",
    "tokenize_for_sft",
]

DEFAULT_PROMPT_TEMPLATE = "Question: {prompt}\nAnswer: "
"""Plain prompt for base models; ``{prompt}`` is replaced by the question, the response follows directly."""

IGNORE_INDEX = -100
"""Label value that ``torch.nn.CrossEntropyLoss`` (and HF models' loss) ignores: prompt tokens and padding."""


_NORMALIZED_COLUMNS = ("prompt", "response", "reference")

# "####" (GSM8K) or "The answer is:" (MetaMathQA; colon optional, any case); the last match wins.
_ANSWER_MARKER = re.compile(r"####|the answer is:?", re.IGNORECASE)
# A plain decimal number after "$", thousands commas and a trailing period are removed: -3, 12.0, .5
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
# A number followed only by unit words ("18 dollars", "5 apples") -> the number.
_NUMBER_WITH_UNITS = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s+[A-Za-z][A-Za-z\s]*")


# ----------------------------------------------------------------------------------------------------------
# Answers
# ----------------------------------------------------------------------------------------------------------


def _canonical_number(text: str) -> str:
    """Write a decimal number one way: ``"12.0"`` -> ``"12"``, ``"-0.50"`` -> ``"-0.5"``, ``"007"`` -> ``"7"``."""
    value = Decimal(text)
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def normalize_answer(text: str) -> str | None:
    """Normalize a final-answer string so equal answers compare equal as strings.

    Strips whitespace, ``$`` signs and a trailing period; numbers lose thousands commas and get one canonical
    form (``"1,000.0"`` -> ``"1000"``); a number followed only by unit words keeps the number
    (``"18 dollars"`` -> ``"18"``). Anything else (fractions ``"3/4"``, LaTeX ``"\\frac{1}{2}"``, tuples
    ``"(2,3)"``) is kept as text after the same stripping; ``"3/4"`` and ``"0.75"`` do not match.

    Args:
        text (str): the answer, without its ``####`` / "The answer is:" marker.

    Returns:
        str | None: the normalized answer, or None if nothing is left.
    """
    answer = text.strip().replace("$", "").strip().rstrip(".").strip()
    if not answer:
        return None
    without_commas = answer.replace(",", "")
    if _NUMBER.fullmatch(without_commas):
        return _canonical_number(without_commas)
    with_units = _NUMBER_WITH_UNITS.fullmatch(without_commas)
    if with_units:
        return _canonical_number(with_units.group(1))
    return answer


def extract_answer(text: str) -> str | None:
    """Extract the final answer from a GSM8K solution, a MetaMathQA response or a model generation.

    Takes the first non-empty line after the last ``####`` marker, or, when there is none, after the last
    "The answer is:", then applies :func:`normalize_answer`.

    Examples:
        ``"... 48+24=72 clips.\\n#### 72"`` -> ``"72"``; ``"... The answer is: 1,200.00"`` -> ``"1200"``;
        ``"The answer is: \\frac{3}{4}"`` -> ``"\\frac{3}{4}"``; ``"no marker here"`` -> None.

    Args:
        text (str): solution or generated text.

    Returns:
        str | None: the normalized final answer, or None if there is no marker or nothing follows it.
    """
    hashes = text.rfind("####")
    if hashes >= 0:
        tail = text[hashes + len("####") :]
    else:
        matches = list(_ANSWER_MARKER.finditer(text))
        if not matches:
            return None
        tail = text[matches[-1].end() :]
    first_line = next((line for line in tail.splitlines() if line.strip()), "")
    return normalize_answer(first_line)


def is_exact_match(prediction_text: str, reference: str) -> bool:
    """Whether a generation's final answer equals the reference answer (MetaMath GSM8K convention).

    Args:
        prediction_text (str): the model's generated text; its answer is read with :func:`extract_answer`.
        reference (str): the reference answer, either already extracted (the ``reference`` column of
            :func:`load_math_dataset`) or a full solution containing ``####`` / "The answer is:".

    Returns:
        bool: True if both answers exist and are equal after normalization.
    """
    predicted = extract_answer(prediction_text)
    if predicted is None:
        return False
    expected = extract_answer(reference) if _ANSWER_MARKER.search(reference) else normalize_answer(reference)
    return expected is not None and predicted == expected


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


def _read_jsonl(path: Path, source: str) -> datasets.Dataset:
    """Load one local JSON Lines file with the ``datasets`` json builder.

    Raises:
        ValueError: the file is empty or is not valid JSON Lines.
    """
    # The json builder fails with a bare StopIteration on an empty file: check first.
    with path.open("rb") as handle:
        empty = not any(line.strip() for line in handle)
    if empty:
        raise ValueError(
            f"math data set {source!r} is empty: '{path}' has no rows. Fix: point `source` at a JSONL file with "
            f"one example per line ({SCHEMA_HELP})."
        )
    try:
        return datasets.load_dataset("json", data_files=str(path), split="train")
    except datasets.exceptions.DatasetGenerationError as err:
        cause = err.__cause__ or err
        raise ValueError(
            f"math data set {source!r}: '{path}' is not valid JSON Lines ({cause}). Fix: write one JSON object "
            f"per line ({SCHEMA_HELP})."
        ) from err


def _load_raw(source: str, split: str, name: str | None) -> datasets.Dataset:
    """Resolve ``source`` (JSONL file, directory with ``{split}.jsonl``, or Hub id) to a raw Dataset."""
    local = local_data_file(source, split)  # raises for a local path that does not exist
    if local is not None:
        return _read_jsonl(local, source)
    try:
        loaded = datasets.load_dataset(source, name, split=split)
    except Exception as err:  # datasets raises many types here (missing repo, no network, bad split)
        raise OSError(
            f"math data set {source!r} is not a local file or directory, and loading it from the Hugging Face Hub "
            f"(split={split!r}, name={name!r}) failed: {err}. Fix: if it is a local path, check that it exists; "
            "otherwise check the Hub id, the split name and network access."
        ) from err
    if not isinstance(loaded, datasets.Dataset):
        raise ValueError(
            f"math data set {source!r} loaded as {type(loaded).__name__}, not a Dataset: pass one split "
            "(for example split='train')."
        )
    return loaded


def _detect_schema(columns: list[str], source: str) -> tuple[str, str, str]:
    """Return ``(schema name, question column, solution column)`` for the first schema ``columns`` contain.

    Raises:
        ValueError: neither schema matches; the message lists the columns found and both expected schemas.
    """
    found = match_schema(columns)
    if found is not None:
        return found
    raise ValueError(
        f"math data set {source!r} matches neither supported schema: found columns {sorted(columns)}. Expected "
        f"{SCHEMA_HELP}. Fix: rename the columns (Dataset.rename_columns) or point `source` at GSM8K/MetaMathQA data."
    )


def _normalize_batch(batch: dict[str, list[Any]], question_col: str, solution_col: str) -> dict[str, list[Any]]:
    """Batched map: source columns -> ``prompt``, ``response``, ``reference`` (None if no final answer)."""
    return {
        "prompt": batch[question_col],
        "response": batch[solution_col],
        "reference": [extract_answer(text or "") for text in batch[solution_col]],
    }


def load_math_dataset(
    source: str,
    split: str = "train",
    limit: int | None = None,
    seed: int | None = 0,
    *,
    name: str | None = None,
) -> datasets.Dataset:
    """Load GSM8K- or MetaMathQA-style math problems as ``prompt`` / ``response`` / ``reference`` columns.

    Every problem is raised here, before any model is loaded or trained.

    Args:
        source (str): a local JSONL file (``split`` is then ignored), a local directory containing
            ``{split}.jsonl`` (for example ``../shared/data/gsm8k``), or a Hugging Face Hub id, loaded with
            ``datasets.load_dataset(source, name, split=split)`` (needs network access).
        split (str, defaults to "train"): split name: the file ``{split}.jsonl`` in a directory, or the Hub split.
        limit (int | None, defaults to None): keep at most this many rows; None keeps all.
        seed (int | None, defaults to 0): with ``limit``, the rows kept are the first ``limit`` after a shuffle
            with this seed (a reproducible random subset); None keeps the first ``limit`` rows in file order.
            Without ``limit`` the order is never changed (the Trainer shuffles during training).
        name (str | None, defaults to None): Hub configuration name (``"main"`` for ``openai/gsm8k``).

    Returns:
        datasets.Dataset: columns ``prompt`` (question), ``response`` (worked solution, verbatim) and
        ``reference`` (normalized final answer, see :func:`extract_answer`).

    Raises:
        FileNotFoundError: a local path (or ``{split}.jsonl`` in a directory) does not exist.
        OSError: ``source`` is not local and loading it from the Hub failed.
        ValueError: ``limit`` < 1; the data set is empty or not valid JSON Lines; its columns match neither
            schema; or some solutions have no final answer (``####`` / "The answer is:").
    """
    if limit is not None and limit < 1:
        raise ValueError(f"load_math_dataset: limit must be a positive number of rows or None, but got {limit}.")
    raw = _load_raw(str(source), split, name)
    if len(raw) == 0:
        raise ValueError(
            f"math data set {source!r} (split {split!r}) has no rows. Fix: point `source` at a non-empty data set "
            f"({SCHEMA_HELP})."
        )
    _, question_col, solution_col = _detect_schema(list(raw.column_names), str(source))

    if limit is not None and limit < len(raw):
        if seed is not None:
            raw = raw.shuffle(seed=seed)
        raw = raw.select(range(limit))

    normalized = raw.map(
        _normalize_batch,
        batched=True,
        remove_columns=raw.column_names,
        fn_kwargs={"question_col": question_col, "solution_col": solution_col},
        desc="Normalizing math data set",
    )
    normalized = normalized.select_columns(list(_NORMALIZED_COLUMNS))  # fixed order, whatever the source's
    missing = [i for i, reference in enumerate(normalized["reference"]) if reference is None]
    if missing:
        first = missing[0]
        raise ValueError(
            f"math data set {source!r}: {len(missing)} of {len(normalized)} rows have no final answer (no '####' "
            f"or 'The answer is:' followed by an answer in column {solution_col!r}); first at row {first}: "
            f"{str(normalized[first]['response'])[-120:]!r}. Fix: end every solution with '#### <number>' "
            "(GSM8K) or 'The answer is: <answer>' (MetaMathQA), or drop those rows."
        )
    return normalized


# ----------------------------------------------------------------------------------------------------------
# Formatting and tokenization
# ----------------------------------------------------------------------------------------------------------


def _check_template(template: str) -> None:
    """Raise ValueError unless ``template`` has a ``{prompt}`` placeholder."""
    if "{prompt}" not in template:
        raise ValueError(
            f"prompt template must contain the placeholder '{{prompt}}', but got {template!r}. "
            f"Default: {DEFAULT_PROMPT_TEMPLATE!r}."
        )


def format_prompt(prompt: str, template: str = DEFAULT_PROMPT_TEMPLATE) -> str:
    """Render the model input for one question: ``template`` with ``{prompt}`` replaced.

    Plain replacement, not ``str.format``, so braces elsewhere (LaTeX in MATH questions) are safe.

    Args:
        prompt (str): the question.
        template (str, defaults to ``"Question: {prompt}\\nAnswer: "``): must contain ``{prompt}``.

    Returns:
        str: the prompt text the model continues (training prefix and generation input).

    Raises:
        ValueError: ``template`` has no ``{prompt}``.
    """
    _check_template(template)
    return template.replace("{prompt}", prompt)


def format_example(
    prompt: str,
    response: str,
    template: str = DEFAULT_PROMPT_TEMPLATE,
    eos_token: str = "",
) -> str:
    """Render one full training example as text: formatted prompt, then the response, then ``eos_token``.

    For display and for text-based trainers. :func:`tokenize_for_sft` tokenizes the prompt and the response
    separately and appends ``tokenizer.eos_token_id`` instead, so its token ids may differ at the
    prompt/response boundary from tokenizing this string (the prompt tokens then equal the generation input).

    Args:
        prompt (str): the question.
        response (str): the worked solution.
        template (str, defaults to ``"Question: {prompt}\\nAnswer: "``): must contain ``{prompt}``.
        eos_token (str, defaults to ""): appended text, normally ``tokenizer.eos_token``.

    Returns:
        str: ``format_prompt(prompt, template) + response + eos_token``.
    """
    return format_prompt(prompt, template) + response + eos_token


def _tokenize_batch(
    batch: dict[str, list[str]],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    template: str,
) -> dict[str, list[list[int]]]:
    """Batched map: prompt/response text -> ``input_ids``, ``attention_mask``, ``labels`` (may drop rows)."""
    prompts = [format_prompt(prompt, template) for prompt in batch["prompt"]]
    # Prompt with the tokenizer's special tokens (as generation sees it), response without, then eos.
    prompt_ids = tokenizer(prompts, add_special_tokens=True)["input_ids"]
    response_ids = tokenizer(batch["response"], add_special_tokens=False)["input_ids"]
    eos_id = tokenizer.eos_token_id
    out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for prompt_part, response_part in zip(prompt_ids, response_ids):
        input_ids = (prompt_part + response_part + [eos_id])[:max_length]  # right truncation
        num_prompt = len(prompt_part)
        if num_prompt >= len(input_ids):
            continue  # the answer was truncated away entirely: nothing to learn from
        out["input_ids"].append(input_ids)
        out["attention_mask"].append([1] * len(input_ids))
        out["labels"].append([IGNORE_INDEX] * num_prompt + input_ids[num_prompt:])
    return out


def _sft_fingerprint(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    template: str,
) -> str | None:
    """A cache fingerprint for :func:`tokenize_for_sft`'s ``Dataset.map``, or None to let ``datasets`` hash.

    ``datasets`` fingerprints a map by dill-pickling its arguments; for the Qwen tokenizer that takes about
    2.7 s per call, whereas serializing the Rust backend and hashing it takes about 0.25 s. The fingerprint
    covers the input data set's fingerprint, the tokenization code, the backend (vocabulary, merges, added
    tokens, pre/post-processing), the special tokens, ``max_length`` and ``template``. Slow (pure-Python)
    tokenizers have no backend to serialize: None falls back to the ``datasets`` hash.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    code = _tokenize_batch.__code__
    digest = hashlib.sha256()
    for part in (
        ds._fingerprint,
        code.co_code.hex(),
        repr(code.co_consts),
        type(tokenizer).__name__,
        backend.to_str(),
        repr(sorted(tokenizer.special_tokens_map.items())),
        repr((tokenizer.eos_token_id, max_length, template)),
    ):
        digest.update(str(part).encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def tokenize_for_sft(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    *,
    template: str = DEFAULT_PROMPT_TEMPLATE,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Tokenize ``prompt`` / ``response`` rows for causal-LM SFT with the loss on answer tokens only.

    Each example is ``tokens(format_prompt(prompt)) + tokens(response) + [eos]``, right-truncated to
    ``max_length``; ``labels`` are ``-100`` on the prompt tokens and equal ``input_ids`` on the response and eos
    (HF causal-LM models shift labels internally). Examples whose answer is truncated away entirely (the
    prompt alone fills ``max_length``) are dropped, with a log line giving the count.

    Args:
        ds (datasets.Dataset): rows with ``prompt`` and ``response`` (from :func:`load_math_dataset`).
        tokenizer (PreTrainedTokenizerBase): needs an eos token (see :func:`load_tokenizer`).
        max_length (int): maximum sequence length in tokens, prompt included.
        template (str, defaults to ``"Question: {prompt}\\nAnswer: "``): prompt template, see :func:`format_prompt`.
        num_proc (int | None, defaults to None): worker processes for ``Dataset.map``.

    Returns:
        datasets.Dataset: exactly the columns ``input_ids``, ``attention_mask`` and ``labels`` (lists of int,
        unpadded, each of length <= ``max_length``); ready for :func:`make_collator`.

    Raises:
        ValueError: ``max_length`` < 2; ``ds`` lacks ``prompt`` / ``response``; ``template`` lacks ``{prompt}``;
            the tokenizer has no eos token; or every example was dropped.
    """
    if max_length < 2:
        raise ValueError(f"tokenize_for_sft: max_length must be at least 2 tokens, but got {max_length}.")
    missing = [column for column in ("prompt", "response") if column not in ds.column_names]
    if missing:
        raise ValueError(
            f"tokenize_for_sft: data set lacks column(s) {missing} (found {ds.column_names}). Fix: load it with "
            "load_math_dataset(), which normalizes GSM8K and MetaMathQA to prompt/response/reference."
        )
    _check_template(template)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "tokenize_for_sft: the tokenizer has no eos token, so answers cannot be terminated. Fix: load it with "
            "lazytrain_hf.data.load_tokenizer(), which sets eos and pad tokens."
        )
    tokenized = ds.map(
        _tokenize_batch,
        batched=True,
        remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "template": template},
        num_proc=num_proc,
        new_fingerprint=_sft_fingerprint(ds, tokenizer, max_length, template),
        desc="Tokenizing for SFT",
    )
    dropped = len(ds) - len(tokenized)
    eos = tokenizer.eos_token_id
    cut = sum(1 for ids in tokenized["input_ids"] if len(ids) == max_length and ids[-1] != eos) if len(tokenized) else 0
    if cut:
        logger.warning("tokenize_for_sft: %d of %d examples were cut at max_length=%d tokens (their answers lose the "
                       "end and the eos token); raise max_length to keep them whole", cut, len(tokenized), max_length)
    if len(tokenized) == 0:
        raise ValueError(
            f"tokenize_for_sft: all {len(ds)} examples were dropped because their prompt alone fills "
            f"max_length={max_length} tokens. Fix: increase max_length."
        )
    if dropped:
        logger.warning(
            "tokenize_for_sft: dropped %d of %d examples whose answer did not fit in max_length=%d tokens",
            dropped,
            len(ds),
            max_length,
        )
    return tokenized


def pack_rows(ds: datasets.Dataset, row_length: int) -> datasets.Dataset:
    """Pack tokenized examples (:func:`tokenize_for_sft` output) into rows of at most ``row_length`` tokens, best
    fit decreasing (TRL's ``packing_strategy="bfd"``): each example, longest first, goes to the row whose free room
    fits it most tightly, or starts a row. An example is never split.

    Each row holds ``input_ids``, ``labels`` and ``position_ids`` restarting at 0 per example (the models restrict
    attention to each example from the positions), with label -100 at each example's first token, as transformers'
    ``DataCollatorWithFlattening`` sets it, so no example learns from the one before it. Batch the rows with
    :class:`PackedRowsCollator` (``make_collator(..., packing=True)``).

    Args:
        ds (datasets.Dataset): ``input_ids`` and ``labels`` columns, each example at most ``row_length`` tokens.
        row_length (int): tokens per row at most (the recipe's ``data.max_length``).

    Returns:
        datasets.Dataset: one row per packed row, columns ``input_ids``, ``labels``, ``position_ids``.

    Raises:
        ValueError: ``row_length`` < 2, a missing column, or an example longer than ``row_length``.
    """
    if row_length < 2:
        raise ValueError(f"pack_rows: row_length must be at least 2 tokens, but got {row_length}.")
    missing = [c for c in ("input_ids", "labels") if c not in ds.column_names]
    if missing:
        raise ValueError(f"pack_rows: data set lacks column(s) {missing} (found {ds.column_names}). Fix: tokenize it "
                         "with tokenize_for_sft() first.")
    ids, labels = ds["input_ids"], ds["labels"]
    lengths = [len(x) for x in ids]
    if max(lengths, default=0) > row_length:
        raise ValueError(f"pack_rows: an example has {max(lengths)} tokens, more than row_length={row_length}. Fix: "
                         f"tokenize with max_length <= {row_length}.")
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free tokens, row), sorted: the tightest fit is the first >= the length
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = row_length, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for members in rows:
        out["input_ids"].append([t for i in members for t in ids[i]])
        out["labels"].append([t for i in members for t in [IGNORE_INDEX, *labels[i][1:]]])
        out["position_ids"].append([p for i in members for p in range(lengths[i])])
    total = sum(lengths)
    logger.info("pack_rows: %d examples (%d tokens) in %d rows of <= %d tokens (%.1f%% of the rows' room filled)",
                len(lengths), total, len(rows), row_length, 100 * total / max(1, len(rows) * row_length))
    return datasets.Dataset.from_dict(out)


@dataclass
class PackedRowsCollator:
    """Batch :func:`pack_rows` rows: each padded on the right to the batch's longest row (rounded up to
    ``pad_to_multiple_of``) with ``pad_token_id``, label -100 and positions that continue the row's last example, so
    the padding is part of that example: no real token attends to it (attention is causal) and no loss is taken on
    it. No ``attention_mask``: the models read the packing from ``position_ids`` only when none is given."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        if any("position_ids" not in f or "labels" not in f for f in features):
            raise ValueError("PackedRowsCollator batches the rows of pack_rows (input_ids, labels, position_ids), but "
                             f"got examples with {sorted(features[0])}. Pack the data set with "
                             "lazytrain_hf.data.pack_rows first, or batch examples with make_collator(tokenizer) "
                             "(packing=False)")
        T = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids, labels, pos = [], [], []
        for f in features:
            n = len(f["input_ids"])
            ids.append(list(f["input_ids"]) + [self.pad_token_id] * (T - n))
            labels.append(list(f["labels"]) + [IGNORE_INDEX] * (T - n))
            last = f["position_ids"][-1] if n else -1
            pos.append(list(f["position_ids"]) + list(range(last + 1, last + 1 + T - n)))
        return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "position_ids": torch.tensor(pos)}


def make_collator(
    tokenizer: PreTrainedTokenizerBase,
    pad_to_multiple_of: int | None = None,
    packing: bool = False,
    padding_free: bool = False,
) -> DataCollatorForSeq2Seq | DataCollatorWithFlattening | PackedRowsCollator:
    """Build the batch collator for :func:`tokenize_for_sft` output (transformers' ``DataCollatorForSeq2Seq``).

    Pads ``input_ids`` with the pad token, ``attention_mask`` with 0 and ``labels`` with -100, on the right,
    to the longest example in the batch (rounded up to ``pad_to_multiple_of``), and returns torch tensors of
    shape ``[B, T]``. With ``packing``: :class:`PackedRowsCollator`, for rows of :func:`pack_rows`. With
    ``padding_free``: transformers' ``DataCollatorWithFlattening``, the batch's examples concatenated into one row
    ``[1, N]`` without padding, ``position_ids`` restarting at each example and label -100 at each example's first
    token (the models restrict attention to each example from the positions).

    Args:
        tokenizer (PreTrainedTokenizerBase): needs a pad token and ``padding_side == "right"`` (as
            :func:`load_tokenizer` returns it).
        pad_to_multiple_of (int | None, defaults to None): round the padded length up to a multiple of this
            (8 or 64 suit tensor cores); None pads to the longest example only. Unused with ``padding_free``.
        packing (bool, defaults to False): batch :func:`pack_rows` rows.
        padding_free (bool, defaults to False): flatten each batch's examples into one row.

    Returns:
        DataCollatorForSeq2Seq | DataCollatorWithFlattening | PackedRowsCollator: a callable
        ``list[dict] -> dict[str, torch.Tensor]``.

    Raises:
        ValueError: no pad token; left padding; ``pad_to_multiple_of`` < 1; or both ``packing`` and
            ``padding_free``.
    """
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "make_collator: the tokenizer has no pad token. Fix: load it with lazytrain_hf.data.load_tokenizer(), "
            "or set tokenizer.pad_token."
        )
    if tokenizer.padding_side != "right":
        raise ValueError(
            f"make_collator: training batches are right-padded, but tokenizer.padding_side is "
            f"{tokenizer.padding_side!r}. Fix: set tokenizer.padding_side = 'right'."
        )
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"make_collator: pad_to_multiple_of must be >= 1 or None, but got {pad_to_multiple_of}.")
    if packing and padding_free:
        raise ValueError("make_collator: packing (rows of pack_rows) and padding_free (one flattened row per batch) "
                         "are two ways to pack; pick one.")
    if packing:
        return PackedRowsCollator(tokenizer.pad_token_id, pad_to_multiple_of)
    if padding_free:
        return DataCollatorWithFlattening(separator_id=IGNORE_INDEX, return_tensors="pt")
    return DataCollatorForSeq2Seq(
        tokenizer,
        padding=True,
        label_pad_token_id=IGNORE_INDEX,
        pad_to_multiple_of=pad_to_multiple_of,
        return_tensors="pt",
    )
