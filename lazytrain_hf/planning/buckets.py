"""Re-planning per sequence-length bucket: one schedule per bucket, looked up by a batch's sequence length.

Variable-length batches change every activation size, so the best plan for 256 tokens is not the best for 4096.
`plan_buckets` solves once per bucket (a bounded list, by default powers of two up to the longest sequence) with a cost
model built for that bucket's length; `BucketSchedules.schedule_for(seq_len)` returns the plan of the smallest bucket >=
seq_len. A bucket's plan fits any shorter sequence: every memory term of the cost model grows with T (the batch is
padded to at most the bucket length, so the plan for the bucket is a safe upper bound).

Pure like the rest of `planning`: the caller supplies `build(seq_len) -> CostModel` (analytic or measured costs).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .cost_model import CostModel
from .planner import make_schedule
from .schedule import Schedule

__all__ = ["seq_len_buckets", "plan_buckets", "BucketSchedules", "schedule_for", "MAX_BUCKETS"]

#: Upper bound on the number of buckets (solves) per `plan_buckets` call.
MAX_BUCKETS = 16


def seq_len_buckets(max_seq_len: int, min_seq_len: int = 128, max_buckets: int = 8) -> list[int]:
    """Bucket lengths (tokens): powers of two from `min_seq_len` (rounded up to one) below `max_seq_len`, then
    `max_seq_len` itself, at most `max_buckets` of them (the shortest are dropped first: short sequences then
    share a longer bucket's plan, which fits them).

    Examples: (1024) -> [128, 256, 512, 1024]; (3000, 512) -> [512, 1024, 2048, 3000].

    Raises:
        ValueError: max_seq_len < 1, min_seq_len < 1, or max_buckets outside 1..MAX_BUCKETS.
    """
    problems = []
    if max_seq_len < 1 or min_seq_len < 1:
        problems.append(f"max_seq_len and min_seq_len must be >= 1, but got {max_seq_len} and {min_seq_len}")
    if not 1 <= max_buckets <= MAX_BUCKETS:
        problems.append(f"max_buckets must be in [1, {MAX_BUCKETS}], but got {max_buckets}")
    if problems:
        raise ValueError("seq_len_buckets: " + "; ".join(problems))
    out: list[int] = []
    b = 1 << max(0, (min(min_seq_len, max_seq_len) - 1).bit_length())  # smallest power of two >= min_seq_len
    while b < max_seq_len:
        out.append(b)
        b *= 2
    out.append(max_seq_len)
    return out[-max_buckets:]


@dataclass
class BucketSchedules:
    """One schedule per sequence-length bucket.

    Attributes:
        schedules: bucket length (tokens) -> the schedule planned for sequences of that length.
    """

    schedules: dict[int, Schedule] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.schedules = {int(k): v if isinstance(v, Schedule) else Schedule.from_dict(v)
                          for k, v in sorted(self.schedules.items(), key=lambda kv: int(kv[0]))}
        if not self.schedules:
            raise ValueError("BucketSchedules needs at least one bucket")

    @property
    def buckets(self) -> list[int]:
        """Bucket lengths (tokens), ascending."""
        return list(self.schedules)

    def bucket_for(self, seq_len: int) -> int:
        """The smallest bucket >= `seq_len` (tokens).

        Raises:
            ValueError: seq_len < 1 or longer than the largest bucket (no plan covers it: re-plan with a larger
                maximum).
        """
        b = self.buckets
        k = bisect.bisect_left(b, seq_len)
        if seq_len < 1 or k == len(b):
            raise ValueError(f"no schedule for sequence length {seq_len}: the buckets are {b} (tokens); plan with "
                             f"max_seq_len >= {seq_len}")
        return b[k]

    def schedule_for(self, seq_len: int) -> Schedule:
        """The schedule of `bucket_for(seq_len)` (see there for errors)."""
        return self.schedules[self.bucket_for(seq_len)]

    def to_dict(self) -> dict[str, Any]:
        return {"schedules": {str(k): s.to_dict() for k, s in self.schedules.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BucketSchedules:
        return cls({int(k): Schedule.from_dict(v) for k, v in d["schedules"].items()})


def schedule_for(plans: BucketSchedules, seq_len: int) -> Schedule:
    """Function form of `BucketSchedules.schedule_for`."""
    return plans.schedule_for(seq_len)


def plan_buckets(build: Callable[[int], CostModel], buckets: Sequence[int], policy: str = "milp",
                 **make_schedule_kwargs: Any) -> BucketSchedules:
    """Solve one schedule per bucket.

    Args:
        build: sequence length (tokens) -> the cost model for a micro-batch padded to that length (same model,
            batch size, machine and budgets).
        buckets: bucket lengths (tokens), e.g. `seq_len_buckets(max_seq_len)`; duplicates are dropped; at most
            `MAX_BUCKETS` distinct values (each is one solve of up to `time_limit_s`).
        policy: "milp" or "fixed" (as `make_schedule`).
        **make_schedule_kwargs: passed to `make_schedule` for every bucket (time_limit_s, mip_rel_gap,
            gpu_optimizer, prefetch_depths, ...). A `fingerprint` is not accepted: each bucket's schedule gets
            the hash of its own cost model.

    Returns:
        `BucketSchedules`; each schedule's `predicted` is for its bucket length and `solver["seq_len_bucket"]`
        records the bucket.

    Raises:
        ValueError: no buckets, more than MAX_BUCKETS, a bucket < 1, or a `fingerprint` argument.
        InfeasiblePlanError: some bucket has no schedule within the budgets (the message names the bucket); the
            caller may drop the longer buckets and cap the sequence length instead.
    """
    from .milp import InfeasiblePlanError

    distinct = sorted(set(int(b) for b in buckets))
    problems = []
    if not distinct:
        problems.append("buckets is empty")
    if len(distinct) > MAX_BUCKETS:
        problems.append(f"at most {MAX_BUCKETS} buckets (one solve each), but got {len(distinct)}")
    if distinct and distinct[0] < 1:
        problems.append(f"bucket lengths must be >= 1, but got {distinct[0]}")
    if "fingerprint" in make_schedule_kwargs:
        problems.append("fingerprint is per bucket (the hash of its cost model); do not pass one")
    if problems:
        raise ValueError("plan_buckets: " + "; ".join(problems))
    out: dict[int, Schedule] = {}
    for b in distinct:
        try:
            sched = make_schedule(build(b), policy, **make_schedule_kwargs)
        except InfeasiblePlanError as e:
            raise e.restated(f"sequence-length bucket {b}: {e}") from e
        sched.solver = {**sched.solver, "seq_len_bucket": b}
        out[b] = sched
    return BucketSchedules(out)
