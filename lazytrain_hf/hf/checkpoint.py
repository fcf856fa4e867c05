"""Atomic Trainer checkpoints: a checkpoint directory is either whole or absent.

`save_atomically` runs the Trainer's own `_save_checkpoint` (model, optimizer states, scheduler, RNG, trainer state)
into ``<output_dir>/.tmp-checkpoint-N/checkpoint-N``, adds the run's schedule and a manifest of every file and its
size (`MANIFEST_NAME`, written last), then renames it to ``<output_dir>/checkpoint-N`` and rotates old checkpoints
(`save_total_limit`). A save that fails (a full disk, an injected error) removes its partial directory and raises one
error (`CheckpointSaveError`: the bytes needed and free); a process killed during a save leaves only the staging
directory, which no resume picks up (its name does not match ``checkpoint-N``) and the next save removes. The
manifest also records how long the save took until it was written (``save_s``, `recorded_save_seconds`): a resumed
run's grace-period estimate before it has timed a save of its own (hf/longrun.py).

On resume, `resolve_resume` checks the checkpoint against its manifest (a missing or truncated file is named);
``resume_from_checkpoint=True`` and the CLI's ``--resume last`` take the newest complete checkpoint
(`last_complete_checkpoint`) and skip incomplete ones with a warning. `naming_load_errors` turns a damaged file's
load error into one error naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from typing import Any

from ..config import format_bytes
from ..profiling.limits import ResourceLimitError, check_need, disk_free

__all__ = ["MANIFEST_NAME", "STAGING_PREFIX", "CheckpointError", "CheckpointSaveError", "save_atomically",
           "save_model_checked", "checkpoint_problems", "last_complete_checkpoint", "resolve_resume",
           "naming_load_errors", "remove_stale_staging", "recorded_save_seconds"]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "lazytrain_checkpoint.json"
#: staging directories: ``.tmp-checkpoint-N`` (no ``checkpoint-N`` pattern matches it)
STAGING_PREFIX = ".tmp-"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from: incomplete, truncated or damaged (the file is named)."""


class CheckpointSaveError(OSError):
    """A checkpoint save that failed; the partial checkpoint was removed, the earlier ones are kept."""


# ---- saving -----------------------------------------------------------------------------------------------------
def _agree(code: int) -> int:
    """The largest of every rank's `code` (`longrun.max_over_ranks`; one process: `code` itself)."""
    from .longrun import max_over_ranks  # longrun imports this module

    return int(max_over_ranks([code])[0])


def _disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e).lower()  # safetensors and torch.save raise their own types
    return "no space left" in text or "disk quota exceeded" in text or "file write failed" in text


def remove_stale_staging(run_dir: str) -> None:
    """Remove staging directories left by a save that was killed (they hold partial checkpoints: disk space the next
    save needs); one warning each."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return
    for name in names:
        if name.startswith(STAGING_PREFIX + "checkpoint-"):
            path = os.path.join(run_dir, name)
            logger.warning("LazyTrain: removing %s, an incomplete checkpoint save (the process ended during it)",
                           path)
            shutil.rmtree(path, ignore_errors=True)


def _manifest(ckpt: str, step: int, save_s: float) -> None:
    files = {}
    for root, _dirs, names in os.walk(ckpt):
        for n in names:
            p = os.path.join(root, n)
            files[os.path.relpath(p, ckpt)] = os.path.getsize(p)
    path = os.path.join(ckpt, MANIFEST_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"step": step, "save_s": round(save_s, 3), "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_atomically(trainer: Any, save: Callable[[Any, Any], None], model: Any, trial: Any,
                    clock: Callable[[], float] = time.monotonic) -> float:
    """Run `save` (the Trainer's `_save_checkpoint`) into a staging directory and rename it into place when
    complete. Checks the free space first (`hf.preflight.check_checkpoint_space`). Hub pushes and hyperparameter
    searches keep the stock layout (the push reads the directory as it is written). Returns the seconds the save
    took on `clock`; the manifest records them too (``save_s``, up to its own write).

    Data parallel: the ranks agree (`_agree`) on the space check and on the save's outcome, so every rank raises
    when any rank's write failed, and the main process renames the checkpoint only when every rank's files are in;
    `save` must run no collective (LazyTrainer._save_checkpoint runs them before).

    Raises:
        ResourceLimitError: less free space than the checkpoint's size (nothing was written).
        CheckpointSaveError: the save failed for lack of space, on this rank or another (the bytes needed and
            free); the partial checkpoint was removed.
    """
    from transformers.trainer import TRAINER_STATE_NAME, rotate_checkpoints

    from . import preflight

    args, state = trainer.args, trainer.state
    t0 = clock()
    if args.push_to_hub or trial is not None or getattr(trainer, "hp_search_backend", None) is not None:
        save(model, trial)
        return clock() - t0
    run_dir = args.output_dir
    name = f"checkpoint-{state.global_step}"
    stage_root = os.path.join(run_dir, STAGING_PREFIX + name)
    staged, final = os.path.join(stage_root, name), os.path.join(run_dir, name)
    main = args.should_save
    need = preflight.checkpoint_bytes(trainer)
    free = None
    short: ResourceLimitError | None = None
    if main:
        remove_stale_staging(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        free = disk_free(run_dir).bytes
        try:
            preflight.check_checkpoint_space(trainer, run_dir, need)
        except ResourceLimitError as e:
            short = e
    if _agree(int(short is not None)):  # every rank skips the save, or none does
        raise short or ResourceLimitError(f"LazyTrain: {name} not saved: the main process found too little free "
                                          f"space in {run_dir!r} (its log names the bytes)", need_bytes=need,
                                          limit=disk_free(run_dir))
    trainer._get_output_dir = lambda trial=None: stage_root  # the stock save writes <stage_root>/checkpoint-N
    failure: BaseException | None = None
    try:
        save(model, trial)  # no collective inside: the trainer ran them before (LazyTrainer._save_checkpoint)
    except Exception as e:
        failure = e
    finally:
        del trainer._get_output_dir  # the class's method again
    # 0: saved, 1: a disk filled, 2: another error; the largest over the ranks (also every rank's files written)
    own = 0 if failure is None else 1 if _disk_full(failure) and not isinstance(failure, ResourceLimitError) else 2
    code = _agree(own)
    if code:
        full_now = disk_free(run_dir).bytes if main else None
        if main:
            shutil.rmtree(stage_root, ignore_errors=True)
        if code == 2:
            if own == 2:
                raise failure
            raise RuntimeError(f"LazyTrain: saving {name} failed on another rank (its log has the error); the "
                               "partial checkpoint was removed") from failure
        last = last_complete_checkpoint(run_dir, warn=False) if main else None
        where = "" if failure is not None else " on another rank"
        cause = (f" ({type(failure).__name__}: {str(failure).splitlines()[0][:160] if str(failure) else ''})"
                 if failure is not None else "")
        raise CheckpointSaveError(
            errno.ENOSPC, f"LazyTrain: saving {name} failed for lack of disk space{where} in {run_dir!r}{cause}: it "
            f"needs about {format_bytes(need)}"
            f"{'' if free is None else f', {format_bytes(free)} were free when the save began'}"
            f"{'' if full_now is None else f' and {format_bytes(full_now)} when it failed'}. The partial "
            f"checkpoint was removed; {'the last complete one is ' + last if last else 'no earlier checkpoint'}"
            ". Fix: free space there, set save_total_limit, or point output_dir at a larger disk, then resume "
            "(resume_from_checkpoint=True, lazytrain-hf train --resume last)") from failure
    if not main:
        return clock() - t0
    best = state.best_model_checkpoint
    if best and os.path.abspath(best) == os.path.abspath(staged):
        state.best_model_checkpoint = final
        state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))  # it recorded the staging path
    ex = getattr(trainer, "executor", None)
    if ex is not None:
        from .callback import SCHEDULE_NAME

        ex.schedule.to_json(os.path.join(staged, SCHEDULE_NAME))
    _manifest(staged, state.global_step, clock() - t0)
    old = None
    if os.path.isdir(final):  # saved again at the same step: the new one replaces it whole
        old = os.path.join(run_dir, STAGING_PREFIX + "old-" + name)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    _fsync_dir(run_dir)
    os.rmdir(stage_root)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    rotate_checkpoints(output_dir=run_dir, save_total_limit=args.save_total_limit,
                       best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)
    return clock() - t0


def save_model_checked(trainer: Any, save: Callable[[], None], output_dir: str) -> None:
    """`save` (the stock `save_model` into `output_dir`, not a checkpoint) with its free space checked first and a
    full disk made one error. Checkpoints hold the run; this is the model a run ends with, written by the main
    process (the others pass through).

    Raises:
        ResourceLimitError: less free space than the model's weights (nothing was written).
        CheckpointSaveError: the save failed for lack of space: the bytes needed and free, and the last complete
            checkpoint to resume from.
    """
    from . import preflight

    if not trainer.args.should_save:
        return save()
    need = preflight.saved_model_bytes(trainer.model) + preflight.CHECKPOINT_OVERHEAD_BYTES
    os.makedirs(output_dir, exist_ok=True)
    free = disk_free(output_dir)
    check_need(need, free, f"saving the model to {output_dir!r}",
               "free space there or pass save_model a directory on a larger disk; the run's checkpoints are kept")
    try:
        save()
    except Exception as e:
        if not _disk_full(e):
            raise
        last = last_complete_checkpoint(trainer.args.output_dir, warn=False)
        raise CheckpointSaveError(
            errno.ENOSPC, f"LazyTrain: saving the model to {output_dir!r} failed for lack of disk space "
            f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}): it needs about "
            f"{format_bytes(need)}, {format_bytes(free.bytes)} were free when the save began and "
            f"{format_bytes(disk_free(output_dir).bytes)} when it failed. Fix: free space there and save again; "
            + (f"the last complete checkpoint is {last} (resume_from_checkpoint, lazytrain-hf train --resume last)"
               if last else "no checkpoint of the run was saved")) from e


def recorded_save_seconds(ckpt: str) -> float | None:
    """The seconds the save of `ckpt` took (its manifest's ``save_s``); None without a manifest or that record."""
    try:
        with open(os.path.join(ckpt, MANIFEST_NAME), encoding="utf-8") as f:
            seconds = float(json.load(f)["save_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return seconds if seconds > 0 else None


# ---- resuming ---------------------------------------------------------------------------------------------------
def checkpoint_problems(ckpt: str) -> list[str]:
    """What makes `ckpt` unusable for a resume: files of its manifest missing or of another size; without a
    manifest (a stock Trainer checkpoint) a missing trainer_state.json (the Trainer writes it last). Empty: whole."""
    if not os.path.isdir(ckpt):
        return [f"{ckpt} is not a directory"]
    path = os.path.join(ckpt, MANIFEST_NAME)
    if not os.path.isfile(path):
        return [] if os.path.isfile(os.path.join(ckpt, "trainer_state.json")) else \
            [f"{os.path.join(ckpt, 'trainer_state.json')} is missing (the save did not finish)"]
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path} cannot be read ({type(e).__name__}: {e})"]
    problems = []
    for rel, size in files.items():
        p = os.path.join(ckpt, rel)
        if not os.path.isfile(p):
            problems.append(f"{p} is missing")
        elif os.path.getsize(p) != size:
            problems.append(f"{p} has {os.path.getsize(p)} bytes, {size} when it was saved (truncated or "
                            "overwritten)")
    return problems


def _checkpoints(folder: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(folder, n)) for n in names if (m := _CHECKPOINT.match(n))]
    return sorted(((s, p) for s, p in found if os.path.isdir(p)), reverse=True)


def last_complete_checkpoint(folder: str, warn: bool = True) -> str | None:
    """The newest ``checkpoint-N`` in `folder` without `checkpoint_problems` (None: none); each newer incomplete one
    and each staging directory of a save that did not finish is skipped with a warning (`warn`)."""
    if warn:
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.startswith(STAGING_PREFIX + "checkpoint-"):
                logger.warning("LazyTrain: skipping %s, a checkpoint save that did not finish",
                               os.path.join(folder, name))
    for _step, path in _checkpoints(folder):
        problems = checkpoint_problems(path)
        if not problems:
            return path
        if warn:
            logger.warning("LazyTrain: skipping the incomplete checkpoint %s: %s", path, "; ".join(problems))
    return None


def resolve_resume(resume: Any, output_dir: str) -> Any:
    """The checkpoint to resume from: `resume` True gives the newest complete one in `output_dir`
    (`last_complete_checkpoint`); a path is checked (`checkpoint_problems`); None / False pass through.

    Raises:
        ValueError: True and no complete checkpoint in `output_dir`.
        CheckpointError: the given checkpoint is incomplete or truncated (the files named).
    """
    if isinstance(resume, bool):
        if not resume:
            return None
        path = last_complete_checkpoint(output_dir)
        if path is None:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir}): no complete "
                             "checkpoint-N there to resume from")
        return path
    if resume is None:
        return None
    problems = checkpoint_problems(str(resume))
    if problems:
        raise CheckpointError(f"LazyTrain: cannot resume from {resume}: {'; '.join(problems)}. Resume from an "
                              "earlier checkpoint (resume_from_checkpoint=True takes the newest complete one)")
    return resume


@contextlib.contextmanager
def naming_load_errors(checkpoint: str) -> Iterator[None]:
    """While loading from `checkpoint`: a file that torch.load cannot read raises one `CheckpointError` naming
    it."""
    import torch

    orig = torch.load

    def load(f: Any, *a: Any, **k: Any) -> Any:
        try:
            return orig(f, *a, **k)
        except Exception as e:
            size = os.path.getsize(f) if isinstance(f, (str, os.PathLike)) and os.path.isfile(f) else None
            raise CheckpointError(f"LazyTrain: cannot read {f}{f' ({size} bytes)' if size is not None else ''}: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}. The "
                                  f"file is damaged or truncated; resume from an earlier checkpoint than "
                                  f"{checkpoint}") from e

    torch.load = load
    try:
        yield
    finally:
        torch.load = orig
