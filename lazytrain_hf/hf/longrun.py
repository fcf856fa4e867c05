"""`LongRunCallback`: what a run of hours on a shared or rented machine needs from the Trainer events.

- Graceful interruption: while `LazyTrainer.train` runs (`handling_signals`), SIGTERM (spot preemption, a
  scheduler) and SIGINT (Ctrl-C) only set a flag; at the next optimizer-step boundary the callback asks the Trainer
  for a checkpoint and the end of training (`should_save`, `should_training_stop`), logs one line, and `train`
  returns with `LazyTrainer.interrupted` set to the signal number. Data-parallel ranks agree on the step (the flag is
  reduced across ranks at each step end). The previous handlers are restored when `train` returns; a second signal
  before the boundary runs the previous handler (the default one ends the process). `lazytrain-hf train` then exits
  with status 128 + the signal number (143 for SIGTERM, 130 for SIGINT) without writing the final model.
- Preflight at train begin (hf/preflight.py): the plan's host and NVMe bytes against the real limits, and, when
  checkpoints are saved, the free space of the output directory against a checkpoint's size.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from transformers import TrainerCallback

from . import preflight

__all__ = ["LongRunCallback", "INTERRUPT_SIGNALS", "exit_status"]

logger = logging.getLogger(__name__)

INTERRUPT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by `signum`: 128 + its number (143 SIGTERM, 130 SIGINT)."""
    return 128 + int(signum)


class LongRunCallback(TrainerCallback):
    """Added by `LazyTrainer` (every policy): graceful interruption and the train-begin preflight."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.received: int | None = None  # the signal received and not yet acted on
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
        self.received = signum
        logger.warning("LazyTrain: received %s; stopping at the end of this optimizer step and saving a checkpoint "
                       "(send it again to stop now, without one)", signal.Signals(signum).name)

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    @contextlib.contextmanager
    def handling_signals(self) -> Iterator[None]:
        """Install the handlers for the duration (main thread only: elsewhere signals cannot be handled)."""
        self.received = None
        self.trainer.interrupted = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._previous = {s: signal.signal(s, self._handle) for s in INTERRUPT_SIGNALS}
        try:
            yield
        finally:
            self._restore()

    def _agreed_signal(self) -> int | None:
        """The signal received on any rank (the largest number) or None: every rank stops at the same step."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.received
        import torch

        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        if device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([self.received or 0], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None

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

    def on_step_end(self, args, state, control, **kwargs: Any):
        signum = self._agreed_signal()
        if signum is None:
            return
        self.received = signum
        self.trainer.interrupted = signum
        control.should_save = True
        control.should_training_stop = True
        logger.warning("LazyTrain: %s: stopping after step %d and saving checkpoint-%d in %s; resume with "
                       "resume_from_checkpoint=True (lazytrain-hf train --resume last)", signal.Signals(signum).name,
                       state.global_step, state.global_step, args.output_dir)
