"""`CostModel`: everything the planner knows about one (model, batch shape, machine), as plain numbers.

The planner is pure: a `CostModel` goes in, a `Schedule` comes out. Profiling (`lazytrain_hf.profiling`) turns a
transformers config plus a hardware profile (measured or `profiling.H200_DEFAULTS`) into a `CostModel`;
tests build small ones by hand (`CostModel.uniform`). Units are in the field names: `_ms` milliseconds, `_bytes`
bytes, `_gbps` GB/s (1 GB = 1e9 bytes), `_params_per_s` parameters per second.

Per-layer lists are indexed by decoder layer i = 0..L-1. "Boundary i" is layer i's input ([B, T, H] bf16).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CostModel", "transfer_ms"]

_PER_LAYER = ("layer_kind", "num_params", "fwd_ms", "bwd_ms", "param_bytes", "grad_bytes", "act_bytes",
              "saved_bytes", "fwd_work_bytes", "bwd_work_bytes", "gpu_optim_h2d_bytes", "gpu_optim_d2h_bytes",
              "gpu_optim_work_bytes")


def transfer_ms(num_bytes: float, gbps: float) -> float:
    """Time in ms to move `num_bytes` at `gbps` GB/s (1 GB = 1e9 bytes): bytes / (gbps * 1e9) * 1e3."""
    return num_bytes / (gbps * 1e6)


@dataclass
class CostModel:
    """Per-layer costs, machine rates and budgets for one (model, batch shape, machine).

    Per-layer fields (lists of length L, one entry per decoder layer):
        layer_kind: structure id of the layer ("full_attention", "linear_attention", ...). Layers of one kind
            share GPU weight slots (`prefetch_depth + 1` slots per kind, sized for the kind's largest layer).
        num_params: trainable streamed parameters of the layer (count; sets the optimizer update time; 0 for a
            frozen layer, whose trainable parameters are resident: `head_optim_params`).
        fwd_ms: forward time on the GPU for the planned (batch, seq) (ms); also the cost of one recompute.
        bwd_ms: backward time (autograd through the layer, input and weight grads), without the re-forward (ms).
        param_bytes: bytes of the layer's weights streamed H2D each time the layer runs (bf16: 2 per param).
        grad_bytes: bytes of the layer's parameter gradients sent D2H in backward (bf16: 2 per param; 0 for a
            frozen layer, streamed read-only).
        act_bytes: A_i, bytes of boundary i, the layer's input hidden states [B, T, H] (bf16: B*T*H*2).
        saved_bytes: S_i, bytes of all autograd-saved activations of the layer (input included) when run with
            grad: what `retain` keeps on the GPU from forward to backward, and what a re-forward allocates.
        fwd_work_bytes: transient GPU bytes of a no-grad forward beyond its input and output (MLP intermediates,
            attention workspace, fp32 norm temporaries).
        bwd_work_bytes: transient GPU bytes of the layer's backward beyond `saved_bytes` and the parameter-gradient
            buffer (activation gradients, the incoming and outgoing hidden-state gradients).
        gpu_optim_h2d_bytes: extra H2D bytes when the layer's optimizer update runs on the GPU (8-bit states,
            master weights, gradients).
        gpu_optim_d2h_bytes: extra D2H bytes when the update runs on the GPU (states and updated weights back).
        gpu_optim_work_bytes: GPU bytes the on-GPU update holds while it runs (states and gradients).
        retained_bytes: bytes a retained layer holds from its forward to its backward (its activations for the
            whole micro-batch and its output). Empty: saved_bytes + act_bytes. Differs when the executor runs
            each layer over the micro-batch in row chunks: then saved_bytes / the work fields are one chunk's.
        kept_grad_bytes: bytes of the layer's gradient the executor keeps on the GPU from its backward to its
            on-GPU update at the next forward (`Schedule.keep_grads`), when that update runs there (o_i = 1): part
            of `grad_bytes` (not sent D2H), of `gpu_optim_h2d_bytes` (not sent back up) and of
            `gpu_optim_work_bytes` (not staged), held instead from B(i) to F(i) of the next step. Empty: none kept
            (gradient accumulation: the host sums them).

    Resident parts and the loss head (scalars):
        resident_bytes: bytes always on the GPU: embedding, lm_head, final norm, rotary tables.
        head_ms: final norm + lm_head + chunked cross-entropy, forward and backward, plus the embedding (ms).
        head_work_bytes: transient GPU bytes of the head: logits chunk and its gradient, norm activations,
            resident weight gradients (excluding the final hidden state, counted as a boundary).
        head_grad_bytes: resident gradients sent D2H right after the head (lm_head and final norm) (bytes).
        embed_grad_bytes: embedding gradient sent D2H at the end of backward (bytes; the tied weight's lives here).
        embed_optim_params: embedding parameters (count); head_optim_params: untied lm_head and final norm
            parameters, and the frozen layers' resident trainable ones (LoRA adapters) (count). Both are resident and updated at `optimizer.step()`, before the next forward
            (streaming/updates.py); the layers' updates are deferred and overlap the next forward.
        gpu_reserve_bytes: GPU bytes held back for allocator fragmentation and the CUDA context's leftovers.
        resident_optim_on_gpu: the resident parameters' update runs on the GPU (their states and gradients then
            live there, inside `resident_bytes`), as the executor does; False: on the CPU.
        resident_cpu_params: of the resident parameters, those updated on the CPU whatever
            `resident_optim_on_gpu` says: the parts placed in host memory (`Schedule.resident`) (count).
        head_h2d_bytes: the LM head's bf16 weights copied to the GPU once per step when the head lives in host memory
            (bytes; loaded with the last layer's weights, before the head).
        host_fixed_bytes: host bytes taken regardless of the plan: weights, gradients, optimizer states, master
            weights (pinned and pageable together).

    Machine rates:
        h2d_gbps, d2h_gbps: pinned host<->device copy bandwidth, one direction at a time (GB/s).
        bidir_gbps: bandwidth of each direction while both run at once (GB/s, each way).
        nvme_read_gbps, nvme_write_gbps: disk bandwidth for the "nvme" activation tier (GB/s).
        cpu_optim_params_per_s, gpu_optim_params_per_s: optimizer update rates (parameters/s).
        resident_cpu_rate_factor: the resident parts' CPU update rate as a fraction of `cpu_optim_params_per_s`
            (the layers' rate): their update moves more bytes per parameter (fp32 moments by default).

    Budgets:
        gpu_bytes: GPU memory the plan may use (bytes).
        pinned_host_bytes: host memory the plan may use: `host_fixed_bytes` plus CPU-tier boundaries and NVMe
            staging buffers must fit (bytes).
        nvme_bytes: disk bytes the plan may write for the "nvme" tier (0: tier unavailable).

    Other:
        tokens_per_step: B * T (sets tokens/s).
        meta: free-form description (model name, batch_size, seq_len, hardware source) for printing and
            fingerprints; the planner never reads it.
    """

    layer_kind: list[str]
    num_params: list[int]
    fwd_ms: list[float]
    bwd_ms: list[float]
    param_bytes: list[int]
    grad_bytes: list[int]
    act_bytes: list[int]
    saved_bytes: list[int]
    fwd_work_bytes: list[int]
    bwd_work_bytes: list[int]
    gpu_optim_h2d_bytes: list[int]
    gpu_optim_d2h_bytes: list[int]
    gpu_optim_work_bytes: list[int]
    retained_bytes: list[int] = field(default_factory=list)
    kept_grad_bytes: list[int] = field(default_factory=list)
    resident_bytes: int = 0
    head_ms: float = 0.0
    head_work_bytes: int = 0
    head_grad_bytes: int = 0
    embed_grad_bytes: int = 0
    embed_optim_params: int = 0
    head_optim_params: int = 0
    gpu_reserve_bytes: int = 0
    host_fixed_bytes: int = 0
    resident_optim_on_gpu: bool = False
    resident_cpu_params: int = 0
    head_h2d_bytes: int = 0
    h2d_gbps: float = 50.8
    d2h_gbps: float = 54.1
    bidir_gbps: float = 33.0
    nvme_read_gbps: float = 1.5
    nvme_write_gbps: float = 1.0
    cpu_optim_params_per_s: float = 1.0e9
    gpu_optim_params_per_s: float = 34.0e9
    resident_cpu_rate_factor: float = 1.0
    gpu_bytes: int = 0
    pinned_host_bytes: int = 0
    nvme_bytes: int = 0
    tokens_per_step: int = 1
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems: list[str] = []
        n = len(self.fwd_ms)
        if n < 1:
            problems.append("a cost model needs at least one layer (fwd_ms is empty)")
        for name in _PER_LAYER:
            value = list(getattr(self, name))
            setattr(self, name, value)
            if len(value) != n:
                problems.append(f"{name} must have one entry per layer ({n}), but got {len(value)}")
            elif name != "layer_kind":
                bad = [(i, v) for i, v in enumerate(value) if not _finite_nonneg(v)]
                if bad:
                    problems.append(f"{name} must be finite and >= 0, but got {name}[{bad[0][0]}]={bad[0][1]!r}")
        for name in ("h2d_gbps", "d2h_gbps", "bidir_gbps", "nvme_read_gbps", "nvme_write_gbps",
                     "cpu_optim_params_per_s", "gpu_optim_params_per_s", "resident_cpu_rate_factor"):
            v = getattr(self, name)
            if not (_finite_nonneg(v) and v > 0):
                problems.append(f"{name} must be > 0, but got {v!r}")
        for name in ("resident_bytes", "head_ms", "head_work_bytes", "head_grad_bytes", "embed_grad_bytes",
                     "embed_optim_params", "head_optim_params", "gpu_reserve_bytes", "host_fixed_bytes",
                     "resident_cpu_params", "head_h2d_bytes",
                     "gpu_bytes", "pinned_host_bytes", "nvme_bytes"):
            if not _finite_nonneg(getattr(self, name)):
                problems.append(f"{name} must be finite and >= 0, but got {getattr(self, name)!r}")
        if not (isinstance(self.tokens_per_step, int) and self.tokens_per_step >= 1):
            problems.append(f"tokens_per_step must be an integer >= 1, but got {self.tokens_per_step!r}")
        self.retained_bytes = list(self.retained_bytes)
        if self.retained_bytes and len(self.retained_bytes) != n:
            problems.append(f"retained_bytes must be empty or have one entry per layer ({n}), "
                            f"but got {len(self.retained_bytes)}")
        self.kept_grad_bytes = list(self.kept_grad_bytes)
        if self.kept_grad_bytes and len(self.kept_grad_bytes) != n:
            problems.append(f"kept_grad_bytes must be empty or have one entry per layer ({n}), "
                            f"but got {len(self.kept_grad_bytes)}")
        elif self.kept_grad_bytes and not problems:
            for i, k in enumerate(self.kept_grad_bytes):
                cap = min(self.grad_bytes[i], self.gpu_optim_h2d_bytes[i], self.gpu_optim_work_bytes[i])
                if not (_finite_nonneg(k) and k <= cap):
                    problems.append(f"kept_grad_bytes[{i}]={k!r} must be >= 0 and at most grad_bytes, "
                                    f"gpu_optim_h2d_bytes and gpu_optim_work_bytes ({cap})")
                    break
        if problems:
            raise ValueError("Invalid CostModel: " + "; ".join(problems))

    # ----------------------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """L, the number of decoder layers."""
        return len(self.fwd_ms)

    def cpu_optim_ms(self, i: int) -> float:
        """Time of layer i's optimizer update on the CPU (ms)."""
        return self.num_params[i] / self.cpu_optim_params_per_s * 1e3

    def gpu_optim_ms(self, i: int) -> float:
        """Time of layer i's optimizer update on the GPU (ms), transfers excluded."""
        return self.num_params[i] / self.gpu_optim_params_per_s * 1e3

    @property
    def resident_optim_ms(self) -> float:
        """Time of the resident parameters' update (embedding, lm_head, final norm) at `optimizer.step()`, before
        the next forward and the layers' CPU updates start (ms; on the GPU when `resident_optim_on_gpu`, except the
        `resident_cpu_params` placed in host memory; the two run one after the other in `optimizer.step()`)."""
        cpu_rate = self.cpu_optim_params_per_s * self.resident_cpu_rate_factor
        rate = self.gpu_optim_params_per_s if self.resident_optim_on_gpu else cpu_rate
        cpu = min(self.resident_cpu_params, self.embed_optim_params + self.head_optim_params)
        main = self.embed_optim_params + self.head_optim_params - cpu
        return (main / rate + cpu / cpu_rate) * 1e3

    def retained(self, i: int) -> int:
        """Bytes layer i holds on the GPU when retained (see `retained_bytes`)."""
        return int(self.retained_bytes[i]) if self.retained_bytes else int(self.saved_bytes[i] + self.act_bytes[i])

    def kept(self, i: int) -> int:
        """Bytes of layer i's gradient kept on the GPU when its update runs there (`kept_grad_bytes`; 0: none)."""
        return int(self.kept_grad_bytes[i]) if self.kept_grad_bytes else 0

    @property
    def keeps_grads(self) -> bool:
        """Whether GPU-updated layers keep their gradients on the GPU (the plan's `Schedule.keep_grads`)."""
        return any(self.kept_grad_bytes)

    def without_kept(self) -> CostModel:
        """A copy in which no gradient is kept on the GPU (every gradient goes to the host)."""
        return dataclasses.replace(self, kept_grad_bytes=[])

    def for_schedule(self, schedule: Any) -> CostModel:
        """This cost model as `schedule` runs it: without kept gradients where the schedule does not keep them
        (`Schedule.keep_grads`; `solve_milp` may return the plan it solved without them). `evaluate` / `simulate`
        read the kept bytes from the cost model alone, so pass them this to value a finished schedule."""
        return self if schedule.keep_grads or not self.keeps_grads else self.without_kept()

    def gpu_optim_up_bytes(self, i: int) -> int:
        """H2D bytes of layer i's on-GPU update on top of its weights: `gpu_optim_h2d_bytes` less the kept
        gradient."""
        return int(self.gpu_optim_h2d_bytes[i]) - self.kept(i)

    def gpu_optim_load_ms(self, i: int) -> float:
        """H2D time (ms, one way) of what layer i's on-GPU update needs loaded: its weights and `gpu_optim_up_bytes`."""
        return transfer_ms(self.gpu_optim_up_bytes(i) + self.param_bytes[i], self.h2d_gbps)

    def gpu_optim_workspace_bytes(self, i: int) -> int:
        """GPU bytes the on-GPU update of layer i stages while it runs: `gpu_optim_work_bytes` less the kept
        gradient (held elsewhere, see `memory_terms`)."""
        return int(self.gpu_optim_work_bytes[i]) - self.kept(i)

    def slot_bytes(self, prefetch_depth: int) -> int:
        """GPU bytes of the weight slots: (depth + 1) slots per layer kind, each the kind's largest layer."""
        largest: dict[str, int] = {}
        for kind, p in zip(self.layer_kind, self.param_bytes):
            largest[kind] = max(largest.get(kind, 0), int(p))
        return (prefetch_depth + 1) * sum(largest.values())

    def scaled_compute(self, k: float) -> CostModel:
        """A copy whose layer and head compute takes k times as long: forward / backward and head times x k
        (calibration from measured steps, hf/calibrate.py). Transfers, memory and the optimizer rates (GPU and CPU:
        separate kernels, measured on their own) are unchanged.

        Raises:
            ValueError: k <= 0."""
        if not k > 0:
            raise ValueError(f"compute scale must be > 0, but got {k}")
        return dataclasses.replace(self, fwd_ms=[t * k for t in self.fwd_ms], bwd_ms=[t * k for t in self.bwd_ms],
                                   head_ms=self.head_ms * k, meta=dict(self.meta, compute_scale=k))

    def with_cpu_optim_rate(self, params_per_s: float) -> CostModel:
        """A copy whose CPU optimizer updates `params_per_s` parameters/s (calibration: the rate the executor's
        update worker measured next to the running GPU work, hf/calibrate.py).

        Raises:
            ValueError: params_per_s <= 0."""
        if not params_per_s > 0:
            raise ValueError(f"CPU optimizer rate must be > 0 parameters/s, but got {params_per_s}")
        return dataclasses.replace(self, cpu_optim_params_per_s=float(params_per_s),
                                   meta=dict(self.meta, cpu_optim_params_per_s=float(params_per_s)))

    def compute_ms(self) -> float:
        """Compute that every plan runs once: forward + backward of all layers + head (ms), no recompute."""
        return sum(self.fwd_ms) + sum(self.bwd_ms) + self.head_ms

    def num_params_total(self) -> int:
        """Decoder-layer plus resident trainable parameters (count), for 6*N*tokens TFLOPS."""
        return sum(self.num_params) + self.embed_optim_params + self.head_optim_params

    def with_budgets(self, gpu_bytes: int | None = None, pinned_host_bytes: int | None = None,
                     nvme_bytes: int | None = None) -> CostModel:
        """A copy with some budgets replaced (bytes); None keeps the current value."""
        changes = {k: int(v) for k, v in (("gpu_bytes", gpu_bytes), ("pinned_host_bytes", pinned_host_bytes),
                                          ("nvme_bytes", nvme_bytes)) if v is not None}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        return cls(**d)

    @classmethod
    def uniform(cls, num_layers: int, *, fwd_ms: float, bwd_ms: float, param_bytes: int, act_bytes: int,
                saved_bytes: int, num_params: int | None = None, fwd_work_bytes: int = 0, bwd_work_bytes: int = 0,
                kind: str = "full_attention", **scalars: Any) -> CostModel:
        """L identical layers (tests, benchmarks). Grads are as large as weights; the on-GPU optimizer moves
        8 bytes/param each way (8-bit moments, fp32 master, bf16 grad or weight) and holds 8 bytes/param.
        Remaining keyword arguments set the scalar fields."""
        n = param_bytes // 2 if num_params is None else num_params
        return cls(layer_kind=[kind] * num_layers, num_params=[n] * num_layers, fwd_ms=[fwd_ms] * num_layers,
                   bwd_ms=[bwd_ms] * num_layers, param_bytes=[param_bytes] * num_layers,
                   grad_bytes=[param_bytes] * num_layers, act_bytes=[act_bytes] * num_layers,
                   saved_bytes=[saved_bytes] * num_layers, fwd_work_bytes=[fwd_work_bytes] * num_layers,
                   bwd_work_bytes=[bwd_work_bytes] * num_layers, gpu_optim_h2d_bytes=[8 * n] * num_layers,
                   gpu_optim_d2h_bytes=[8 * n] * num_layers, gpu_optim_work_bytes=[8 * n] * num_layers, **scalars)


def _finite_nonneg(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
