"""The end of a worker script that ran under torchrun (tests/hf/ddp_worker.py, tests/hf/interrupt_worker.py)."""

from __future__ import annotations

import os
import sys

import torch


def exit_worker() -> None:
    """Takes the process group down and exits 0 without interpreter teardown.

    With barrier + destroy_process_group alone, ranks still died of SIGABRT at exit on 2 loaded cores ("terminate
    called without an active exception": gloo's and the CPU update worker's threads against the interpreter's
    destructors), after every result file was written, which fails the launch. benchmarks/bench_executor.py ends the
    same way. Result files are closed before this is called (torch.save closes its path).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank is past its last collective before the group goes
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
