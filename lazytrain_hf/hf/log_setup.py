"""Where LazyTrain's log lines go when the script configured no logging.

The plan lines (rows per pass, where the embedding / LM head live, the predicted step, optimizer-bound hints) are
INFO records of the ``lazytrain_hf`` logger. Python prints nothing below WARNING from a logger without a handler,
so a script that never calls `logging.basicConfig` would see none of them. `configure` gives the logger a stderr
handler that speaks only while no handler is on the root logger (a script's own logging config, pytest's capture,
the CLI's basicConfig take over with no duplicate lines) and sets its level from the Trainer's `log_level` /
`log_level_replica`, as the stock Trainer sets transformers' verbosity: "passive" is INFO on the main process and
`log_level_replica` (default WARNING) on the others. A level the script set on the logger itself is kept.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

__all__ = ["configure", "LOGGER_NAME"]

LOGGER_NAME = "lazytrain_hf"


class _FallbackHandler(logging.StreamHandler):
    """stderr, only while the root logger has no handler of its own (records also propagate to it)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _handler() -> _FallbackHandler | None:
    return next((h for h in logging.getLogger(LOGGER_NAME).handlers if isinstance(h, _FallbackHandler)), None)


def configure(args: Any) -> None:
    """Attach the fallback handler (once per process) and set the ``lazytrain_hf`` level from `args` (a
    TrainingArguments): its explicit `log_level` on the main process / `log_level_replica` on the others; with
    "passive", INFO on the main process (or the root logger's level where it is lower, as the CLI's --verbose), WARNING
    on the others, and only where the logger's level was never set."""
    log = logging.getLogger(LOGGER_NAME)
    if _handler() is None:
        h = _FallbackHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[%(levelname)s|lazytrain_hf] %(message)s"))
        log.addHandler(h)
    main = getattr(args, "should_log", True)
    chosen = getattr(args, "log_level", "passive") if main else getattr(args, "log_level_replica", "warning")
    if chosen in (None, "passive", -1):
        if log.level == logging.NOTSET:  # INFO on the main process unless the root logger already lets more through
            if not main:
                log.setLevel(logging.WARNING)
            elif log.getEffectiveLevel() > logging.INFO:
                log.setLevel(logging.INFO)
        return
    level = logging.getLevelName(str(chosen).upper()) if isinstance(chosen, str) else int(chosen)
    if isinstance(level, int):
        log.setLevel(level)
