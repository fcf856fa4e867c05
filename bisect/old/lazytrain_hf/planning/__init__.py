"""Planning: a `CostModel` (plain numbers) in, a `Schedule` (per-layer plan) out.

Pure: imports neither CUDA code nor transformers (`lazytrain_hf.profiling` turns configs and measurements into
cost models). HiGHS (`highspy`) and matplotlib are imported only when a MILP is solved or a timeline drawn.
"""

from .buckets import BucketSchedules, plan_buckets, schedule_for, seq_len_buckets
from .cost_model import CostModel, transfer_ms
from .estimate import PlanEstimate, evaluate, recompute_flags
from .fixed import fixed_schedule
from .milp import GIB, InfeasiblePlanError, fixed_candidates, min_gpu_bytes, solve_milp
from .planner import POLICIES, largest_feasible_batch, make_schedule, make_schedule_from_config
from .schedule import TIERS, LayerPlan, Schedule, fingerprint
from .simulator import LANES, SimulationResult, simulate
from .timeline import plot_timeline

__all__ = [
    "CostModel", "transfer_ms", "PlanEstimate", "evaluate", "recompute_flags", "fixed_schedule", "GIB",
    "InfeasiblePlanError", "fixed_candidates", "min_gpu_bytes", "solve_milp", "POLICIES", "largest_feasible_batch",
    "make_schedule", "make_schedule_from_config", "TIERS", "LayerPlan", "Schedule", "fingerprint", "LANES",
    "SimulationResult", "simulate", "plot_timeline", "BucketSchedules", "plan_buckets", "schedule_for",
    "seq_len_buckets",
]
