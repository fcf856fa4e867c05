"""`LongRunCallback`: what a run of hours on a shared or rented machine needs from the Trainer events.

- Graceful interruption: while `LazyTrainer.train` runs (`handling_signals`), SIGTERM (spot preemption, a
  scheduler) and SIGINT (Ctrl-C) only set a flag; at the next optimizer-step boundary the callback asks the Trainer
  for a checkpoint and the end of training (`should_save`, `should_training_stop`; the evaluation due at that step is
  skipped), logs one line, and `train` returns with `LazyTrainer.interrupted` set to the signal number and
  `LazyTrainer.interrupt_checkpoint` to the checkpoint a resume continues from. Data-parallel ranks agree on the step
  (the flag is reduced across ranks at each step end). The previous handlers are restored when `train` returns; a
  second signal before the boundary runs the previous handler (the default one ends the process). `lazytrain-hf
  train` then exits with status 128 + the signal number (143 for SIGTERM, 130 for SIGINT) without writing the final
  model.
- Grace period (`lazytrain_config.interrupt_grace_period`): the time the platform allows between SIGTERM and the
  kill. At the boundary the save's duration is estimated (`last_save_s`: the duration of the newest timed save,
  this run's or the one the newest checkpoint's manifest records; a run's checkpoints all have the same size); when
  it does not fit in what is left, no checkpoint is started (it would be cut half way) and the line names the last
  complete checkpoint, which `--resume last` continues from. Ranks agree on the decision: the earliest receipt of the signal
  and the longest estimate over the ranks decide.
- Save timing: each checkpoint save is timed (`note_save`, one info line with its bytes and seconds).
- Preflight at train begin (hf/preflight.py): the plan's host and NVMe bytes against the real limits, and, when
  checkpoints are saved, the free space of the output directory against a checkpoint's size.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from transformers import TrainerCallback

from ..config import GIB, format_bytes
from . import checkpoint, preflight

__all__ = ["LongRunCallback", "INTERRUPT_SIGNALS", "exit_status"]

logger = logging.getLogger(__name__)

INTERRUPT_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_RESUME = "resume_from_checkpoint=True (lazytrain-hf train --resume last)"


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by `signum`: 128 + its number (143 SIGTERM, 130 SIGINT)."""
    return 128 + int(signum)


def _dist() -> Any:
    """torch.distributed when a group of two or more ranks is up, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _reduce_device(dist: Any) -> Any:
    import torch

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over_ranks(values: list[float]) -> list[float]:
    """Each of `values`, the largest over the ranks (a collective: every rank calls it); one process: as given."""
    dist = _dist()
    if dist is None:
        return list(values)
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=_reduce_device(dist))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class LongRunCallback(TrainerCallback):
    """Added by `LazyTrainer` (every policy): graceful interruption, the grace period, save timing and the
    train-begin preflight."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.received: int | None = None  # the signal received and not yet acted on
        self.received_at: float | None = None  # `clock()` when it was received
        #: the clock of the grace period and of save timing, in seconds (tests substitute their own)
        self.clock: Callable[[], float] = time.monotonic
        #: seconds of the newest timed save (this process's, else the newest checkpoint's manifest); None: none
        self.last_save_s: float | None = None
        self._stopping = False  # this train() stops at the boundary just acted on
        self._previous: dict[int, Any] = {}

    # ---- signals ----------------------------------------------------------------------------------------------
    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:  # a second signal: the previous behaviour (default: the process ends)
            prev = self._previous.get(signum, signal.SIG_DFL)
            self._restore()
            if callable(prev):
                prev(signum, frame)
            else:
                signal.raise_signal(signum)
            return
        self.received, self.received_at = signum, self.clock()
        logger.warning("LazyTrain: received %s; stopping at the end of this optimizer step and saving a checkpoint "
                       "(send it again to stop now, without one)", signal.Signals(signum).name)

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        """Install the handlers for the duration (main thread only: elsewhere signals cannot be handled)."""
        self.received = self.received_at = None
        self._stopping = False
        self.trainer.interrupted = None
        self.trainer.interrupt_checkpoint = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._previous = {s: signal.signal(s, self._handle) for s in INTERRUPT_SIGNALS}
        try:
            yield
        finally:
            self._restore()

    # ---- save timing and the grace period ---------------------------------------------------------------------
    @property
    def grace_period_s(self) -> float | None:
        """`lazytrain_config.interrupt_grace_period` in seconds (None: not set)."""
        return self.trainer.lazy_config.interrupt_grace_period

    def note_save(self, seconds: float) -> None:
        """Record a checkpoint save that took `seconds` (`last_save_s`, the grace period's estimate), with one info line."""
        need = preflight.checkpoint_bytes(self.trainer)
        if seconds > 0:
            self.last_save_s = seconds
        logger.info("LazyTrain: checkpoint-%d saved in %.1f s (%s, %.2f GiB/s)", self.trainer.state.global_step,
                    seconds, format_bytes(need), need / GIB / seconds if seconds > 0 else float("inf"))

    def _agreed(self) -> tuple[int | None, float | None, float | None]:
        """(signal, seconds since it was received, save estimate in seconds), the same on every rank: the signal
        received on any rank (the largest number), the earliest receipt, the longest estimate; None: none."""
        elapsed = self.clock() - self.received_at if self.received_at is not None else -1.0
        estimate = self.last_save_s if self.grace_period_s is not None else None
        if _dist() is None:
            return self.received, None if self.received is None else elapsed, estimate
        signum, elapsed, estimate = max_over_ranks([self.received or 0, elapsed, -1.0 if estimate is None else estimate])
        return (int(signum) or None), elapsed, (None if estimate < 0 else estimate)

    def _last_checkpoint(self, output_dir: str) -> str | None:
        """The newest complete checkpoint in `output_dir` as the main process sees it (every rank gets its
        answer: the ranks must take the same decision)."""
        path = checkpoint.last_complete_checkpoint(output_dir, warn=False) if self.trainer.args.should_save else None
        dist = _dist()
        if dist is None:
            return path
        import torch

        step = int(os.path.basename(path).split("-")[-1]) if path else -1
        t = torch.tensor([step], dtype=torch.int64, device=_reduce_device(dist))
        dist.broadcast(t, src=0)
        step = int(t.item())
        return os.path.join(output_dir, f"checkpoint-{step}") if step >= 0 else None

    # ---- events -----------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs: Any):
        tr = self.trainer
        control.should_training_stop = False  # an interrupted run's checkpoint recorded its stop request
        ex = getattr(tr, "executor", None)
        if ex is not None:
            preflight.check_plan(tr, ex.schedule)
            note = preflight.memlock_note(ex.device.type == "cuda" and tr.lazy_config.pin_memory)
            if note:
                logger.debug("LazyTrain: %s", note)
        if args.save_strategy != "no" and args.should_save:
            preflight.check_checkpoint_space(tr, args.output_dir)
        if self.grace_period_s is not None and self.last_save_s is None:  # a resumed run: its checkpoint's save
            last = checkpoint.last_complete_checkpoint(args.output_dir, warn=False)
            self.last_save_s = checkpoint.recorded_save_seconds(last) if last else None

    def on_step_end(self, args, state, control, **kwargs: Any):
        signum, elapsed, estimate = self._agreed()
        if signum is None:
            return
        tr, step, name = self.trainer, state.global_step, signal.Signals(signum).name
        self.received, self._stopping = signum, True
        tr.interrupted = signum
        control.should_training_stop = True
        control.should_evaluate = False  # its time belongs to the save
        grace = self.grace_period_s
        if grace is None or estimate is None:
            timing = "" if grace is None else (f" (no save of this run has been timed yet, so whether it fits in "
                                               f"the {grace:.0f} s grace period is not known)")
        else:
            left = grace - elapsed
            timing = (f" (it takes about {estimate:.0f} s; {max(left, 0):.0f} s of the {grace:.0f} s grace period "
                      "are left)")
            if estimate > left:
                last = self._last_checkpoint(args.output_dir)
                if last is not None:
                    control.should_save = False  # a save cut half way by the kill is worth nothing
                    tr.interrupt_checkpoint = last
                    done = int(os.path.basename(last).split("-")[-1])
                    again = f"step {step} runs" if done + 1 == step else f"steps {done + 1}-{step} run"
                    logger.warning(
                        "LazyTrain: %s: stopping after step %d without a new checkpoint: saving one (%s) takes about "
                        "%.0f s (the last timed save) and %.0f s of the %.0f s grace period "
                        "(lazytrain_config.interrupt_grace_period) are left; %s continues from %s (%s again)",
                        name, step, format_bytes(preflight.checkpoint_bytes(tr)), estimate, max(left, 0), grace,
                        _RESUME, last, again)
                    return
                timing = (f" (it takes about {estimate:.0f} s, more than the {max(left, 0):.0f} s left of the "
                          f"{grace:.0f} s grace period, but there is no earlier checkpoint to fall back to)")
        control.should_save = True
        ex = getattr(tr, "executor", None)
        if ex is not None:  # LazyTrainCallback's step end ran before this save was asked for: land the updates
            ex.flush_updates()  # (a collective under sharded updates: every rank is here)
        tr.interrupt_checkpoint = os.path.join(args.output_dir, f"checkpoint-{step}")
        logger.warning("LazyTrain: %s: stopping after step %d and saving checkpoint-%d in %s%s; resume with %s",
                       name, step, step, args.output_dir, timing, _RESUME)

    def on_epoch_end(self, args, state, control, **kwargs: Any):
        if self._stopping:  # the boundary saved already (or decided not to): no epoch-end save or evaluation
            control.should_save = False
            control.should_evaluate = False
