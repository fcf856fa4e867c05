"""Layer streaming: host parameter store, weight slots, activation tiers, chunked head, executor."""

from .executor import StepStats, StreamingExecutor, plan_ops
from .host_store import HostParamStore
from .model import StreamingModel

__all__ = ["StreamingExecutor", "StepStats", "plan_ops", "HostParamStore", "StreamingModel"]
