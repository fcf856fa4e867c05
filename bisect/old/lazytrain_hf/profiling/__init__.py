"""Profiling: measure or estimate what the planner needs, and turn it into a `planning.CostModel`.

The only place with side effects on the planning path (CUDA timing, disk probes, a probe cache). torch and
transformers are imported inside the functions that need them.
"""

from .analytic import ModelShape, analytic_cost_model, layer_flops, model_shape
from .hardware import H200_DEFAULTS, HardwareProfile, cache_dir, machine_fingerprint, probe
from .layer_costs import LayerMeasurement, apply_layer_measurements, measure_layer_costs

__all__ = [
    "ModelShape", "analytic_cost_model", "layer_flops", "model_shape", "H200_DEFAULTS", "HardwareProfile",
    "cache_dir", "machine_fingerprint", "probe", "LayerMeasurement", "apply_layer_measurements",
    "measure_layer_costs",
]
