"""The layer-streaming executor: runs one micro-batch's forward and backward under a Schedule.

Data flow: the resident parts (embedding, rotary, final norm, lm_head) live on the compute device;
decoder layers live in the HostParamStore and are streamed into device slots. Forward runs each layer without
grad and stashes the boundaries the schedule materializes; the head computes the chunked loss and dL/dh_L;
backward walks the segments in reverse, recomputes the inputs inside each segment, runs each layer forward with
grad on its slot, backpropagates, and adds the layer's parameter gradients into fp32 host buffers.

The per-layer keyword arguments (rotary cos/sin, attention masks, position ids) are captured by running the HF
base model's own forward with stand-in layers (`Capture`), so the executor follows each architecture's and
each transformers version's own mask and position logic instead of re-implementing it.

Note [slot reuse]: backward ends with its last layers (1, 0 at prefetch depth 1) in weight slots, and the next
forward starts with them. A slot whose weights still equal the host copy is loaded without the H2D copy (the load's
hooks still run: a GPU-side update is staged and applied on the slot as after a copy). The slot records the layer's
`LayerUpdater.host_writes` count at its load (`WeightStreamer.host_version`): the updater counts a CPU update when
the step starts it and a pending device update when it is applied on the host (a flush, a schedule change, a second
step with no pass between); a GPU-side update writes the slot and the host copy alike and is not counted. So every
slot is reused between micro-batches of one step, and after a step the GPU-updated layers. Sharded data parallel
(weights arrive by broadcast) and a run without the deferred updater reuse nothing. Code that writes the decoder
layers' host weights itself (model.load_state_dict, in-place edits) calls `flush_updates` first, as it must anyway
for the pending updates not to land on top of what it wrote; the flush also forgets every slot's count.

Note [frozen layers]: a decoder layer with any requires_grad=False parameter (LoRA's base weights, plain freezing)
is frozen: only its frozen parameters are in the host store, streamed read-only (no gradient buffers, no gradient
D2H, no optimizer state; the host copy is the only one). Its trainable parameters (LoRA A / B, small) are resident:
moved to the compute device once, updated by the optimizer at `optimizer.step()` like the embedding, and bound into
the slot's template module at each load (`Slot.binds`), so the slot runs the layer's own forward (peft's
`lora.Linear`: dropout, scaling, the active adapter) and backward accumulates straight into their `.grad`. Backward
through a frozen layer computes the input gradient and those gradients only. A PEFT model runs as the HF model it
wraps (`get_base_model()`); gradient checkpointing on the model is turned off (the schedule recomputes).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Generator
from typing import Any

import torch
from torch import nn

from ..config import LazyTrainConfig, cpu_threads
from ..kernels import TORCH_COMPILE, compile_linear_attention, select_linear_attention
from ..models import check_supported
from ..planning.fixed import fixed_schedule
from ..planning.schedule import Schedule
from .comm import DataParallel
from .device_updates import DeviceUpdater
from .grads import GradSink
from .head import chunked_lm_loss, chunked_logits, shift_labels
from .host_store import HostParamStore, ParamSpec, PinnedArena, host_allocator_bytes, sq_norm, structure_key
from .layer_calls import (
    Capture,
    StopCapture,
    find_decoder,
    plan_ops,
    retained_output,
    slice_rows,
    take_over_recomputation,
    unwrap_peft,
)
from .packing import check_packed
from .resident import ResidentParts, initial_placement
from .rng import LayerRng
from .shard import ShardedUpdates
from .shared_host import shared_weights_for
from .stats import UPDATE_COUNTERS, OpTimer, StepStats, step_extra
from .tiers import ActivationStash
from .updates import LayerUpdater
from .weights import Slot, WeightStreamer

__all__ = ["StreamingExecutor", "StepStats", "UPDATE_COUNTERS", "plan_ops", "find_decoder"]

logger = logging.getLogger(__name__)


class StreamingExecutor:
    """Runs a Hugging Face causal LM with its decoder layers streamed from host memory.

    Args:
        model: a supported HF causal LM (Qwen2 / Qwen3 / Qwen3.5 text / Llama) on the CPU, or a PEFT model of one.
            Its decoder-layer parameters are moved into pinned host buffers (views; one copy) and its other modules
            to `device` (a frozen layer's trainable parameters too: Note [frozen layers]).
        config: LazyTrainConfig (loss chunking, pinning, NVMe dir, fixed-policy defaults).
        device: compute device ("cuda" or "cpu"; the CPU path runs the same code with plain copies).
        schedule: the plan; defaults to the fixed policy from `config`.
        host_grad_dtype: "fp32" (accumulate gradient-accumulation micro-batches in fp32 on the host) or "param"
            (keep the autograd gradient in the parameter dtype; one micro-batch per optimizer step).
        data_parallel: "auto" (all-reduce gradients over the torch.distributed world when it has >= 2 ranks),
            a DataParallel, or None (this process trains alone). See streaming/comm.py; with
            sharded updates (`config.dp_updates`, "auto" = sharded with the overlapped optimizer) each rank updates
            only its share of the layers (streaming/shard.py).

    Raises:
        ValueError: unsupported architecture, or a schedule whose layer count differs from the model's.
    """

    def __init__(self, model: nn.Module, config: LazyTrainConfig | None = None,
                 device: torch.device | str | None = None, schedule: Schedule | None = None,
                 host_grad_dtype: str = "fp32", data_parallel: DataParallel | str | None = "auto") -> None:
        self.config = config or LazyTrainConfig()
        check_supported(model.config)
        model = unwrap_peft(model)
        self.base, self.layer_prefix = find_decoder(model)
        take_over_recomputation(model)
        self.model = model
        self.device = torch.device(device or self.config.resolved_device())
        #: the Gated DeltaNet path the layers run ("fla", "torch", "torch_compile": the slots' GatedDeltaNet modules
        #: are compiled, `config.compile_linear_attention`; None: no linear-attention layers)
        self.linear_attention_kernel = select_linear_attention(  # before layers are copied
            model, self.device, compile=self.config.compile_linear_attention)
        self.layers: nn.ModuleList = self.base.layers
        self.num_layers = len(self.layers)
        ltypes = getattr(model.config, "layer_types", None) or [None] * self.num_layers
        self.keys = [structure_key(layer, ltypes[i]) for i, layer in enumerate(self.layers)]
        pin = self.config.pin_memory and self.device.type == "cuda"
        self._place_resident()
        self.resident = ResidentParts(model, self.base, self.device, pin)  # embedding / LM head placement
        self._optimizer: Any = None  # the optimizer over this model (`reserve_states`): moves with a placement
        self.dp = DataParallel.from_env(self.device) if data_parallel == "auto" else data_parallel
        sharded = self.dp is not None and self.config.resolved_dp_updates() == "sharded"
        if self.config.dp_updates == "sharded" and self.dp is None:
            logger.warning("lazytrain_config.dp_updates='sharded' has no effect in a single process (launch >= 2 "
                           "ranks with torchrun or accelerate launch --multi_gpu)")
        self.shard = ShardedUpdates(self.dp, self.num_layers) if sharded else None
        # the host's ranks map one copy of the layers' weights (streaming/shared_host.py), else each its own
        self.host_share = shared_weights_for(self.dp, self.config, sharded, pin)
        self.store = HostParamStore(self.layers, pin=pin, grad_dtype=host_grad_dtype, shared=self.host_share)
        self.frozen = self.store.frozen  # per layer: streamed read-only (Note [frozen layers])
        self._rng = LayerRng(self.layers, model.config, self.device)  # Note [dropout in recompute]
        for b in self.store.buffers:  # a frozen layer's trainable parameters (LoRA adapters) live on the device
            for _, p in b.resident:
                if p.device != self.device:
                    p.data = p.data.to(self.device)
        self.state_arena = PinnedArena(pin)  # the streamed layers' optimizer states (`state_alloc`)
        self._reserve_hooks: dict[int, Any] = {}  # id(optimizer) -> its load pre-hook (`reserve_states`)
        self.grads = GradSink(self.store, self.device, self.dp, pin=pin, shard=self.shard)
        self.stash = ActivationStash(self.device, self.config.nvme_dir, pin=pin)
        self._param_specs: dict[int, tuple[int, ParamSpec]] = {}
        for i, layer in enumerate(self.layers):
            params = dict(layer.named_parameters())
            for spec in self.store.buffers[i].specs:
                self._param_specs[id(params[spec.name])] = (i, spec)
        self._resident = [p for p in {id(p): p for p in model.parameters()}.values()
                          if id(p) not in self._param_specs]
        if self.dp is not None:
            threads = cpu_threads()
            if torch.get_num_threads() < threads:  # torchrun's OMP_NUM_THREADS=1 would serialize host-side adds
                logger.info("data parallel rank %d: torch CPU threads %d -> %d (this host's cores / local ranks)",
                            self.dp.rank, torch.get_num_threads(), threads)
                torch.set_num_threads(threads)
            self._start_from_rank0()
        self.streamer: WeightStreamer | None = None
        self.updater: LayerUpdater | None = None
        # GPU idle time around waits for deferred CPU updates (instrumented): events until the micro-batch's end
        self._update_stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._load_filter = None  # sharded: the optimizer's load_state_dict pre-hook handle
        self._flush_hook = None  # the optimizer's load_state_dict pre-hook that applies pending updates first
        self.device_updater = DeviceUpdater(self)  # GPU-side updates (optimizer_device "gpu")
        self.reuse_slots = True  # Note [slot reuse]: on unless switched off (tests compare both)
        #: run the decoder layers under torch.autocast to this dtype (bf16 compute over fp32 weights); None: off
        self.autocast_dtype: torch.dtype | None = None
        self.schedule: Schedule = None  # type: ignore[assignment]
        self.set_schedule(schedule or fixed_schedule(self.num_layers, self.config.checkpoint_every,
                                                     self.config.activation_tier, self.config.prefetch_depth))
        self.stats = StepStats()
        self._unpack_slot: Slot | None = None
        if self.schedule.resident == "gpu" and schedule is None:  # the fixed rule until a plan says otherwise
            self.set_resident(initial_placement(self.config, self.resident, self.device, self.dp is not None))

    def _start_from_rank0(self) -> None:
        """Every replica starts from rank 0's weights, as DDP does: the resident parts over the world; the streamed
        layers over the world, or, with one host copy per host, into the hosts' copies (their writers; nothing to
        send on one host), after which each host's ranks wait for their writer (`SharedHostWeights.published`)."""
        layers = [t for b in self.store.buffers for t in b.weights.values()]
        resident = [p.data for p in self._resident]
        share = self.host_share
        if share is None:
            self.dp.broadcast_(layers + resident)
            return
        self.dp.broadcast_(resident)
        if share.host.writer_group is not None and share.writes_initial:
            DataParallel(self.device, share.host.writer_group).broadcast_(layers, 0)
        share.published()

    def instrument(self, on: bool = True) -> None:
        """Measure exposed transfer: compute-stream stalls on weight loads (H2D) and gradient copies (D2H), in
        `stats.extra` as exposed_h2d_ms / exposed_d2h_ms after each micro-batch, the GPU idle time while the
        training thread waited for a deferred CPU update as exposed_update_wait_ms, and the weight copies' own
        bandwidth as h2d_weight_gbps (GB/s; CUDA only; adds events)."""
        self.streamer.instrument = self.grads.instrument = on

    @property
    def device_updates(self) -> int:
        """Layer updates run on the compute device (optimizer_device "gpu")."""
        return self.device_updater.count

    # ---- setup -------------------------------------------------------------------------------------------
    def _place_resident(self) -> None:
        """Move everything but the decoder layers to the compute device (tied weights stay tied)."""
        layers = self.base.layers
        self.base.layers = nn.ModuleList()
        try:
            self.model.to(self.device)
        finally:
            self.base.layers = layers

    def set_schedule(self, schedule: Schedule) -> None:
        """Use `schedule` from the next step on (rebuilds weight slots if the prefetch depth changes).

        Raises:
            ValueError: the schedule's layer count differs from the model's.
        """
        if schedule.num_layers != self.num_layers:
            raise ValueError(f"schedule has {schedule.num_layers} layers but the model has {self.num_layers}; "
                             "re-plan for this model (lazytrain-hf plan) or delete the stale schedule file")
        if self.streamer is None or self.streamer.depth != schedule.prefetch_depth:
            # in-flight GPU-side updates write through the old streamer's events. Local only: ranks may switch
            # plans at different steps (sequence-length buckets), so no collective here; stale layers stay stale.
            self._flush_local()
            self.streamer = None
            self.device_updater.staging.clear()  # keyed by slot: the new streamer's slots get their own
            self.streamer = WeightStreamer(self.layers, self.store, self.keys, self.device, schedule.prefetch_depth)
            if self.linear_attention_kernel == TORCH_COMPILE:  # the slots' templates are the modules that run
                for slot in self.streamer.slots:
                    compile_linear_attention(slot.module)
            self.streamer.before_load = self._before_load
            # looked up per call (a test wraps `DeviceUpdater.stage`)
            self.streamer.after_load = lambda slot, layer: self.device_updater.stage(slot, layer)
            self.streamer.before_compute = self._before_compute
            self.streamer.skip_h2d = self.shard.receives if self.shard is not None else None
            self.streamer.host_version = self._host_version
        if schedule.resident != self.resident.placement:
            self.set_resident(schedule.resident)
        self.schedule = schedule
        self._ops = plan_ops(schedule)
        self._segment_end = dict(schedule.segments())  # segment start -> end
        if self.updater is not None:
            # the new plan's memory holds kept gradients and GPU-side updates of its own GPU-updated layers only:
            # the old plan's others go to the host now (pending CPU updates keep overlapping: set_device_layers)
            device = self._device_layers()
            self.grads.materialize_except(device if schedule.keep_grads else set())
            self.updater.apply_on_cpu([i for i in self.updater.device_pending if i not in device])
            self.updater.set_device_layers(device)
        self._set_kept_layers()

    def set_resident(self, placement: str) -> None:
        """Put the embedding and LM head where `placement` says (streaming/resident.py), their optimizer states
        too; later schedules (`set_schedule`) carry their own placement.

        Raises:
            ValueError: the placement cannot run for this model, or a host placement in data parallel.
        """
        if placement != "gpu" and self.dp is not None:
            raise ValueError(f"resident placement {placement!r} is for one process: data-parallel ranks keep the "
                             "embedding and LM head on the GPU (set lazytrain_config.resident_placement='gpu')")
        if placement == self.resident.placement:
            return
        self._flush_local()
        self.resident.apply(placement, self._optimizer)
        if getattr(self, "schedule", None) is not None:
            self.schedule.resident = placement

    def _set_kept_layers(self) -> None:
        """Gradients of GPU-updated layers stay on the device from backward to the update (`Schedule.keep_grads`,
        streaming/grads.py): only with an attached optimizer, whose deferred update consumes them."""
        keep = self.schedule.keep_grads and self.updater is not None
        self.grads.keep_layers = self._device_layers() if keep else set()

    def _device_layers(self) -> set[int]:
        return {i for i, lp in enumerate(self.schedule.layers) if lp.optimizer_device == "gpu" and not self.frozen[i]}

    def _layer_trainables(self) -> list[list[nn.Parameter]]:
        """Per layer, the streamed parameters the optimizer updates there (none in a frozen layer: its trainable
        parameters are resident and updated with the others at `optimizer.step()`)."""
        return [[] if self.frozen[i] else [p for _, p in layer.named_parameters()]
                for i, layer in enumerate(self.layers)]

    # ---- optimizer overlap ---------------------------------------------------------------------------------
    def attach_optimizer(self, optimizer: Any) -> None:
        """Defer `optimizer`'s updates of the streamed layers to a worker that overlaps them with the next forward
        (see streaming/updates.py). The optimizer must provide `set_deferred` / `step_deferred`."""
        if self.updater is not None:
            self.updater.detach()
        layer_params = self._layer_trainables()
        if self._flush_hook is not None:
            self._flush_hook.remove()
        # loading optimizer states: the pending updates land first, as the step that deferred them meant (their
        # snapshots name the param groups the load replaces)
        self._flush_hook = optimizer.register_load_state_dict_pre_hook(lambda opt, sd: self._flush_local())
        if self.shard is None:
            self.updater = LayerUpdater(optimizer, layer_params)
        else:
            self.updater = LayerUpdater(optimizer, layer_params, self.shard.owned, self._sharded_step)
            if self._load_filter is not None:
                self._load_filter.remove()
            self._load_filter = optimizer.register_load_state_dict_pre_hook(self.shard.load_filter(layer_params))
        self.updater.set_device_layers(self._device_layers())
        if hasattr(optimizer, "prepare_states"):
            self.updater.set_prepare(int(self.config.prepared_states_budget or 0))
        self._set_kept_layers()

    def _sharded_step(self) -> None:
        """An optimizer step, before any of this rank's updates starts: every layer is stale until its owner's
        broadcast; a shared host copy first waits for the host's ranks (Note [shared host weights ordering] in
        streaming/shared_host.py)."""
        self.shard.mark_step()
        if self.host_share is not None:
            cuda = self.device.type == "cuda"
            self.host_share.step_boundary([self.streamer.h2d_stream, self.grads.d2h_stream] if cuda else [])

    def _before_load(self, layer: int) -> None:
        if self.updater is None:
            return
        t = time.perf_counter()
        # GPU time lost to this wait: from the end of the compute already queued to the first work queued after it
        # (0 when the training thread ran far enough ahead that the GPU never drained)
        timed = self.streamer.instrument and self.device.type == "cuda" and self.updater.cpu_pending(layer)
        if timed:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
        self.updater.wait(layer)
        if timed:
            after.record()
            self._update_stalls.append((before, after))
        self.updater.wait_s += time.perf_counter() - t

    def flush_updates(self) -> None:
        """Apply every deferred optimizer update now (before weights or optimizer states are read, saved or written
        by other code: Note [slot reuse]).
        Sharded data parallel: also broadcasts every layer updated since its last load from its owner, a
        collective: every rank must call it at the same point (the Trainer callback does, at save / evaluate / end).
        With one shared host copy for the whole world the owners' updates are already in it: a barrier instead."""
        self._flush_local()
        if self.shard is not None:
            one_copy = self.host_share is not None and self.host_share.host.one_host
            self.shard.resolve(self.store, barrier=self.host_share.barrier if one_copy else None)

    def _host_version(self, layer: int) -> tuple[Any, int] | None:
        """Note [slot reuse]: (updater, its host-write count of `layer`), or None where writes are not tracked."""
        up = self.updater
        if not self.reuse_slots or up is None or self.shard is not None:
            return None
        return up, up.host_writes[layer]

    def _flush_local(self) -> None:
        if self.streamer is not None:
            self.streamer.forget()  # host weights may be written next by other code (Note [slot reuse])
        self.device_updater.run_pending()
        if self.streamer is not None and self.device.type == "cuda":
            for ev in self.streamer.host_written.values():  # GPU-side updates copying back to host memory
                ev.synchronize()
        if self.updater is not None:
            self.updater.wait_all()

    @contextlib.contextmanager
    def gathered_optimizer_states(self, optimizer: Any):
        """Inside the block rank 0's `optimizer` holds every layer's states (sharded data parallel; see
        `ShardedUpdates.gathered_states`); a no-op otherwise. Collective: every rank enters it, after
        `flush_updates`."""
        if self.shard is None:
            yield
            return
        layer_params = self._layer_trainables()
        with self.shard.gathered_states(optimizer, layer_params):
            yield

    def _before_compute(self, slot: Slot, layer: int) -> None:
        """Compute is about to use `slot` (current stream, after its weights and staged inputs arrived): run its
        queued GPU-side update and copy the results back, then (sharded) broadcast the layer from its owner."""
        self.device_updater.run_staged(slot)
        if self.shard is None:
            return
        cuda = self.device.type == "cuda"
        done = self.shard.after_load(slot, layer, self.store.buffers[layer].weights,
                                     self.grads.d2h_stream if cuda else None)
        if done is not None:  # the received weights are still being copied into the host store
            self.streamer.host_written[layer] = done
            self.streamer.slot_read[id(slot)] = done

    # ---- parameters and gradients ------------------------------------------------------------------------
    def is_streamed(self, p: torch.Tensor) -> bool:
        return id(p) in self._param_specs

    def grad_source(self, p: torch.Tensor) -> torch.Tensor | None:
        """Accumulated gradient of `p`: the host buffer view for streamed params (a kept device gradient is copied
        there first, except for the GPU-side update that consumes it), else `p.grad`."""
        hit = self._param_specs.get(id(p))
        if hit is None:
            return p.grad
        layer, spec = hit
        pending = self.updater is not None and self.updater.is_pending(layer)  # Note [deferred gradients]
        if not self.grads.has_grad(layer) and not pending:
            return None  # no backward reached this layer in the current window (like p.grad is None)
        if self.grads.is_kept(layer):
            if layer == self.device_updater.staging_layer:  # the GPU-side update reads it where it is
                return self.grads.kept_view(layer, spec.dtype, spec.offset, spec.numel, spec.shape)
            self.grads.materialize(layer)
        return self.store.grad_view(layer, spec)

    def state_alloc(self, p: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
        """Optimizer-state memory for a streamed parameter: exact-size page-locked host memory (`PinnedArena`);
        None for resident parameters (the optimizer's default). For `Hybrid8bitOptimizer.set_state_allocator`."""
        return self.state_arena.alloc(shape, dtype) if id(p) in self._param_specs else None

    def reserve_states(self, optimizer: Any) -> int:
        """Size the state arena to the optimizer's states of the streamed layers this process updates (a sharded
        rank: its own layers), from `optimizer.state_specs()` (Hybrid8bitOptimizer), one exact chunk per dtype:
        locked bytes then equal the planned ones (512 MiB chunks alone locked 2.5 GiB more at Qwen2.5-7B, about
        1.05x). Call after `set_state_allocator(self.state_alloc)`, before the first step or a resume; a later
        `optimizer.load_state_dict` re-reserves for the saved layout (a resume may keep other options than this
        run asked for). An optimizer without `state_specs` is left to the arena's ordinary chunks. Returns the bytes
        reserved."""
        self._optimizer = optimizer
        specs = getattr(optimizer, "state_specs", None)
        if specs is None:
            return 0
        if id(optimizer) not in self._reserve_hooks:
            def before_load(opt: Any, state_dict: dict[str, Any]) -> None:
                self._reserve(opt.state_specs(state_dict))
            self._reserve_hooks[id(optimizer)] = optimizer.register_load_state_dict_pre_hook(before_load)
        return self._reserve(specs())

    def _reserve(self, specs: list[tuple[torch.Tensor, tuple[int, ...], torch.dtype]]) -> int:
        need: dict[torch.dtype, int] = {}
        for p, shape, dtype in specs:
            hit = self._param_specs.get(id(p))
            if hit is None or (self.shard is not None and hit[0] not in self.shard.owned):
                continue  # resident (the optimizer's own memory), or another rank's layer
            need[dtype] = need.get(dtype, 0) + PinnedArena.footprint(shape, dtype)
        self.state_arena.reserve(need)
        return sum(n * dt.itemsize for dt, n in need.items())

    @property
    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked host memory, in bytes.

        "planned" is the sum of the parts, each its exact size: "store" (the streamed layers' weight and gradient
        buffers; weights the host's ranks share count this rank's share, `HostParamStore.weight_share_bytes`),
        "optimizer_states" (the state arena's bytes in use), "grad_staging" (the accumulate path's
        gradient staging, one set per slot), "activations" (the CPU / NVMe tiers' host buffers at their
        high-water mark, Note [stash buffers]) and "resident" (a host-placed embedding / LM head's weights and
        gradient buffers; their optimizer states are pageable). These buffers exist whatever the device; they are page-locked when
        the executor pins (CUDA and `config.pin_memory`), so on a CPU run "planned" is what a CUDA run would lock.
        "registered" is what cudaHostRegister locked in place: the store's and the staging's exact buffers (a shared
        host copy, which every rank of the host registers, by its share), the arena's whole chunks (used bytes plus
        each chunk's unused tail), the activation pool's buffers (all it holds). "host_allocator" is what PyTorch's caching host allocator holds page-locked in this process
        (`pin_memory=True` blocks, power-of-two rounded; active and cached): a buffer `pin_tensor` could not
        register in place lands there, as does anything else in the process that pins. The process locks
        "registered" + "host_allocator"; on a CPU run both are 0.
        """
        parts = {"store": self.store.weight_share_bytes + self.store.grad_bytes,
                 "optimizer_states": self.state_arena.used_bytes,
                 "grad_staging": self.grads.staging_bytes,
                 "activations": self.stash.buffers.high_water_bytes,
                 "resident": self.resident.pinned_bytes}
        registered = (self.store.registered_bytes + self.state_arena.registered_bytes + self.grads.registered_bytes
                      + self.stash.buffers.registered_bytes + self.resident._reg.bytes)
        host_alloc = host_allocator_bytes() if self.device.type == "cuda" else 0
        return {"planned": sum(parts.values()), **parts, "registered": registered, "host_allocator": host_alloc}

    def resident_parameters(self) -> list[nn.Parameter]:
        """Parameters that stay on the compute device (embedding, final norm, lm_head; a tied weight once)."""
        return self._resident

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm (fp32 scalar, on the compute device) of every trainable gradient.

        With one micro-batch in the window the streamed layers' part was accumulated on the device as gradients
        passed (no extra pass); otherwise the fp32 host accumulators are summed.
        """
        self.grads.flush()
        host = {id(p) for p in self.resident.host_parameters()}
        if self.grads.norm_from_device:
            sq = self.grads.sq.clone()
        else:
            done = [i for i in range(self.num_layers) if self.grads.has_grad(i)]
            sq = self.store.grad_sq_sum(done).to(self.device)
        if self.shard is not None:  # each rank holds its owned layers' reduced gradients: sum the ranks' parts
            self.dp.all_reduce_([sq])
        for p in self.resident_parameters():
            if p.grad is not None:
                part = self.resident.grad_sq_norm(p) if id(p) in host else sq_norm(p.grad)
                sq = sq + part.to(sq.device)
        return sq.sqrt().float()

    def _reduce_resident(self) -> None:
        params = [p for p in self.resident_parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # every rank must join every collective
                p.grad = torch.zeros_like(p)
        self.dp.all_reduce_([p.grad for p in params])

    def zero_grad(self) -> None:
        self.grads.zero()
        pending = {i for i in range(self.num_layers) if self.updater is not None and self.updater.is_pending(i)}
        self.grads.drop_stale(pending)
        for p in self.resident_parameters():
            p.grad = None
        self.resident.zero_grad()

    # ---- one micro-batch ---------------------------------------------------------------------------------
    def _capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, backward: bool = True,
                 ) -> tuple[torch.Tensor, list[tuple[tuple, dict]]]:
        """(embedding output [B, T, H], each decoder layer's (args, kwargs)); `backward`: a pass whose embedding
        backward will run (a host embedding keeps its ids for it)."""
        check_packed(self.model.config, attention_mask, position_ids)  # packed rows: streaming/packing.py
        sink: list = []
        attr_names = ("attention_type", "layer_idx", "layer_type")
        stubs = nn.ModuleList(
            Capture(i, sink, i == self.num_layers - 1,
                     {a: getattr(layer, a) for a in attr_names if hasattr(layer, a)})
            for i, layer in enumerate(self.layers))
        layers = self.base.layers
        self.base.layers = stubs
        embeds = self.resident.embed_input(input_ids, keep_ids=backward)  # a host embedding's, looked up there
        ids = dict(input_ids=input_ids) if embeds is None else dict(inputs_embeds=embeds)
        try:
            self.base(**ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        except StopCapture:
            pass
        finally:
            self.base.layers = layers
        if len(sink) != self.num_layers:
            raise RuntimeError(f"captured {len(sink)} of {self.num_layers} decoder-layer calls; the model's forward "
                               "does not call every layer once (unsupported architecture)")
        return sink[0][0], [(a, k) for _, a, k in sink]

    def _run(self, slot: Slot, x: torch.Tensor, call: tuple[tuple, dict], key: tuple[int, int] | None = None
             ) -> torch.Tensor:
        # forward, recompute and re-forward alike (the same autocast, the same dropout masks), so that a recomputed
        # input equals the forward's
        with self._rng.replay(key, self.model.training), \
                torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = slot.module(x, *call[0], **call[1])
        return out[0] if isinstance(out, tuple) else out

    def _row_chunks(self, B: int) -> list[tuple[int, int]]:
        rows = self.schedule.rows_per_pass or self.config.max_rows_per_pass or B
        return [(a, min(a + rows, B)) for a in range(0, B, rows)]

    def _forward(self, slot: Slot, x: torch.Tensor, call: tuple[tuple, dict], layer: int | None = None
                 ) -> torch.Tensor:
        """No-grad layer forward over the micro-batch in row chunks (weights loaded once)."""
        B = x.shape[0]
        chunks = self._row_chunks(B)
        if len(chunks) == 1:
            return self._run(slot, x, call, None if layer is None else (layer, 0))
        return torch.cat([self._run(slot, x[a:b], slice_rows(call, B, a, b), None if layer is None else (layer, a))
                          for a, b in chunks])

    def _forward_retained(self, slot: Slot, h: torch.Tensor, call: tuple[tuple, dict], layer: int) -> list[tuple]:
        """Forward with grad, per row chunk, keeping each chunk's graph: [(x_chunk, y_chunk, rows), ...]."""
        B = h.shape[0]
        out = []
        for a, b in self._row_chunks(B):
            x = h[a:b].detach().requires_grad_()
            with torch.enable_grad(), self._weight_refs(slot):
                y = self._run(slot, x, slice_rows(call, B, a, b), (layer, a))
            out.append((x, y, (a, b)))
        return out

    def _backward(self, slot: Slot, x_full: torch.Tensor, g: torch.Tensor, call: tuple[tuple, dict], layer: int
                  ) -> torch.Tensor:
        """Re-forward with grad and backpropagate `g` per row chunk; returns dL/dx. Weight grads accumulate in the
        slot's grad buffers across chunks."""
        B = x_full.shape[0]
        chunks = self._row_chunks(B)
        gx = None if len(chunks) == 1 else torch.empty_like(x_full)
        for a, b in chunks:
            x = x_full[a:b].detach().requires_grad_()
            with torch.enable_grad():
                y = self._run(slot, x, slice_rows(call, B, a, b), (layer, a))
            torch.autograd.backward(y, g[a:b])
            if gx is None:
                return x.grad
            gx[a:b] = x.grad
        return gx

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor,
                         attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         denominator: float | torch.Tensor | None = None,
                         sync_gradients: bool = True) -> torch.Tensor:
        """Forward and backward of one micro-batch; gradients are ADDED to the host / resident accumulators.

        Args:
            input_ids, labels, attention_mask, position_ids: [B, T] tensors as the HF model takes them.
            denominator: the summed token loss is divided by this (the Trainer's `num_items_in_batch`); None: the
                number of valid shifted labels in this micro-batch (a per-micro-batch mean). With data
                parallelism, gradients are SUMMED over ranks: pass the global token count (or scale by the world).
            sync_gradients: data parallel only: all-reduce the resident parameters' accumulated `.grad` after this
                micro-batch (True on the last micro-batch of an accumulation window, like DDP outside `no_sync`).
                The streamed layers' gradients are reduced every micro-batch as they are produced.

        Returns:
            The micro-batch loss, an fp32 scalar on the compute device (detached).
        """
        targets = shift_labels(labels.to(self.device))
        if denominator is None:
            denominator = targets.ne(-100).sum().clamp(min=1)
        run = self.stream_pass(input_ids, attention_mask, position_ids, sync_gradients)
        h = next(run)
        loss, g = self._head_loss(h, targets, denominator)
        self.resident.head_backward_done()
        del h
        run.send(g)
        next(run, None)
        return loss

    def stream_pass(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    position_ids: torch.Tensor | None = None, sync_gradients: bool = True,
                    ) -> Generator[torch.Tensor | None, torch.Tensor | None, None]:
        """One micro-batch's streamed forward and backward with the head left to the caller, as a generator.

        Protocol (`forward_backward` drives it with the chunked loss; hf/user_loss.py with any autograd loss):
        ``h = next(run)``: the forward; `h` is the last decoder layer's output [B, T, H] (before the final norm),
        detached, on the compute device. ``run.send(g)`` with g = dL/dh: the layers' backward (parameter gradients
        added to the host accumulators); it returns before the embedding's backward. The caller then finishes the
        head's backward (its autograd, then `resident.head_backward_done()`) and calls ``next(run, None)``: the
        embedding's backward, the resident gradients' reduction, the gradient flush and `stats`. A run closed early
        (an exception) leaves work to `abort_microbatch`.
        """
        if self.shard is not None and self.updater is None:
            raise RuntimeError("sharded data-parallel updates (lazytrain_config.dp_updates 'sharded', or 'auto' "
                               "with overlap_optimizer) need the optimizer attached (attach_optimizer; LazyTrainer "
                               "does it): each rank holds only its owned layers' gradients and the owners broadcast "
                               "the updates. Attach it, or set dp_updates='replicated'")
        t0 = time.perf_counter()
        lay = self.schedule.layers
        train = self.model.training
        for s in self.streamer.slots:
            s.module.train(train)
        self.device_updater.run_pending()  # a pass cut short (an exception) left staged updates behind
        self.streamer.invalidate()
        h2d0, loads0 = self.streamer.h2d_bytes, self.streamer.loads
        self._update_stalls.clear()
        self.streamer.copies.clear()
        self.streamer.begin([i for op, i in self._ops if op in ("fwd", "recompute", "bwd")])
        self.stash.d2h_bytes = self.stash.h2d_bytes = 0
        self.grads.begin_microbatch()
        self._rng.clear()
        d2h0 = self.grads.d2h_bytes
        self.resident.start_refresh()  # a host head's weights go up while the forward runs

        with torch.enable_grad():
            h0, calls = self._capture(input_ids.to(self.device),
                                      None if attention_mask is None else attention_mask.to(self.device),
                                      None if position_ids is None else position_ids.to(self.device))
        h = h0.detach()
        retained: dict[int, tuple[list, Slot]] = {}  # layer -> ([(input, output, rows) per row chunk], fwd slot)
        inputs: dict[int, torch.Tensor] = {}
        g: torch.Tensor | None = None
        recomputed = 0
        timer = OpTimer(self.device, self.streamer.instrument, self.num_layers)
        for op, i in self._ops:
            if op == "fwd":
                if lay[i].checkpoint:
                    self.stash.put(i, h, lay[i].tier)
                slot = self.streamer.acquire(i)
                timer.start(op, i)
                if lay[i].retain:
                    parts = self._forward_retained(slot, h, calls[i], i)
                    retained[i] = (parts, slot)
                    h = retained_output(parts)
                else:
                    with torch.no_grad():
                        h = self._forward(slot, h, calls[i], i)
                timer.stop()
                self.streamer.release(slot)
                if i == self.num_layers - 1:
                    self.device_updater.release_staging()  # every GPU-side update ran at its layer's forward load
                    timer.start("head", -1)
                    g = yield h  # the caller's head: dL/dh
                    timer.stop()
                    del h
            elif op == "load":
                inputs = {i: self.stash.get(i)}
                for j in range(i, self._segment_end[i] - 1):  # retained layers hand their outputs over for free
                    if lay[j].retain:
                        inputs[j + 1] = retained_output(retained[j][0])
            elif op == "recompute":
                slot = self.streamer.acquire(i)
                timer.start(op, i)
                with torch.no_grad():
                    inputs[i + 1] = self._forward(slot, inputs[i], calls[i], i)
                timer.stop()
                self.streamer.release(slot)
                recomputed += 1
            else:  # "bwd"
                slot = self.streamer.acquire(i)
                if lay[i].retain:
                    # The graph's AccumulateGrad nodes belong to the forward-time slot's parameters, so the
                    # grads land in that slot's grad buffers; weights are rebuilt from `slot` (Note [retained weights]).
                    parts, grad_slot = retained.pop(i)
                    if not self.frozen[i]:
                        self.grads.prepare(grad_slot)
                    timer.start(op, i)
                    self._unpack_slot = slot
                    gx = torch.empty_like(g) if len(parts) > 1 else None
                    for x, y, (a, b) in parts:
                        torch.autograd.backward(y, g[a:b])
                        if gx is None:
                            gx = x.grad
                        else:
                            gx[a:b] = x.grad
                    self._unpack_slot = None
                    del parts
                    g = gx
                else:
                    grad_slot = slot
                    if not self.frozen[i]:
                        self.grads.prepare(grad_slot)
                    timer.start(op, i)
                    g = self._backward(slot, inputs.pop(i), g, calls[i], i)
                timer.stop()
                if not self.frozen[i]:  # a frozen layer's adapter gradients went to the resident parameters' .grad
                    self.grads.push(grad_slot, i)
                self.streamer.release(slot)
        yield None  # the caller finishes the head's backward
        if h0.requires_grad:  # embedding gradient (and anything else before layer 0); none if those are frozen
            h0.backward(g)
        self.resident.finish(g if self.resident.embed_on_host and self.resident.embed.weight.requires_grad else None)
        if self.dp is not None and sync_gradients:
            self._reduce_resident()
        self.grads.flush()
        self.stash.clear()
        extra = step_extra(self.updater, self.streamer, self.grads, self._update_stalls, self.device, h2d0)
        self.stats = StepStats(op_ms=timer.totals(),
            tokens=int(input_ids.numel()), h2d_weight_bytes=self.streamer.h2d_bytes - h2d0,
            d2h_grad_bytes=self.grads.d2h_bytes - d2h0, act_d2h_bytes=self.stash.d2h_bytes, act_h2d_bytes=self.stash.h2d_bytes,
            weight_loads=self.streamer.loads - loads0, recomputed_layers=recomputed,
            seconds=time.perf_counter() - t0, extra=extra)

    @contextlib.contextmanager
    def _weight_refs(self, slot: Slot):
        """Note [retained weights]: a retained layer's autograd graph must not pin its weight slot (the slot is
        reused by later layers). Saved tensors that live in the slot's weight buffers are packed as
        (dtype, offset, size, stride) and rebuilt in backward from whichever slot then holds the layer."""
        ptr_dtype = {t.untyped_storage().data_ptr(): dt for dt, t in slot.weights.items()}

        def pack(t: torch.Tensor):
            try:
                dt = ptr_dtype.get(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):
                dt = None
            if dt is None:
                return t
            return ("w", dt, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

        def unpack(obj):
            if isinstance(obj, tuple) and obj and obj[0] == "w":
                _, dt, off, size, stride = obj
                return self._unpack_slot.weights[dt].as_strided(size, stride, off)
            return obj

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    # ---- inference ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Streamed forward without grad through the decoder layers: the last layer's output [B, T, H] (before the
        final norm), on the compute device.

        It may run while a `stream_pass` waits for its head's gradient (a reference model's forward inside the loss,
        hf/trl_hooks.py): that pass's weight-access sequence is set aside and its prefetches issued again after
        (`WeightStreamer.aside`); its stash, RNG records (Note [dropout in recompute]: this forward records none),
        retained activations and the embedding's ids for its backward are left as they were."""
        for s in self.streamer.slots:
            s.module.train(self.model.training)
        self.device_updater.run_pending()  # a pass cut short (an exception) left staged updates behind
        with self.streamer.aside():
            self.streamer.invalidate()
            self.streamer.begin(list(range(self.num_layers)))
            h, calls = self._capture(input_ids.to(self.device),
                                     None if attention_mask is None else attention_mask.to(self.device),
                                     None if position_ids is None else position_ids.to(self.device), backward=False)
            for i in range(self.num_layers):
                slot = self.streamer.acquire(i)
                h = self._forward(slot, h, calls[i])
                self.streamer.release(slot)
        return h

    def forward_inference(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                          return_logits: bool = True, denominator: float | torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Streamed forward without grad. Returns (loss or None, [B, T, V] logits or None); the summed token loss
        is divided by `denominator` (default: the valid shifted labels, a mean)."""
        h = self.forward_hidden(input_ids, attention_mask, position_ids)
        loss = None
        if labels is not None:
            targets = shift_labels(labels.to(self.device))
            if denominator is None:
                denominator = targets.ne(-100).sum().clamp(min=1)
            loss, _ = self._head_loss(h, targets, denominator, backward=False)
        logits = (chunked_logits(h, self.base.norm, self.resident.head_module(), self.config.loss_chunk_tokens,
                                 compute_dtype=self.autocast_dtype) if return_logits else None)
        return loss, logits

    def _head_loss(self, h: torch.Tensor, targets: torch.Tensor, denominator: float | torch.Tensor,
                   backward: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final norm, LM head and loss over the last layer's output: over vocabulary slices under
        "host_sliced" (`ResidentParts.sliced_loss`), else `chunked_lm_loss` (its products in the autocast dtype)."""
        if self.resident.head_sliced:
            return self.resident.sliced_loss(h, targets, self.base.norm, denominator, self.config.loss_chunk_tokens,
                                             backward=backward)
        return chunked_lm_loss(h, targets, self.base.norm, self.resident.head_module(), denominator,
                               self.config.loss_chunk_tokens, backward=backward, compute_dtype=self.autocast_dtype)

    def close(self) -> None:
        self.flush_updates()
        self.stash.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no copy may touch memory being unregistered
        self.grads.flush()
        self.grads.release()
        self.stash.release()
        self.store.release()
        self.state_arena.release()

    def abort_microbatch(self) -> None:
        """Clean up after a `forward_backward` cut short by an exception (e.g. CUDA out of memory) and clear the
        accumulation window's gradients, so that the window can run again from its first micro-batch (LazyTrainer's
        out-of-memory recovery, hf/recovery.py).

        The previous optimizer step's deferred updates survive: CPU updates still queued or running keep their host
        gradients (a layer's host gradient is written only after its load waited for its update); device updates not
        yet staged stay pending, with their kept GPU gradients; device updates already staged run now, once. The
        gradients this window pushed (host buffers, this window's kept GPU gradients, the resident `.grad`) are
        cleared as by `zero_grad`. The stash, the update staging copies and the slots' reuse records are dropped (a
        load cut short may leave a slot whose recorded weights are not the ones it holds)."""
        self._unpack_slot = None
        self.device_updater.staging_layer = None
        self.device_updater.run_pending()
        self.device_updater.release_staging()
        if self.streamer is not None:
            self.streamer.forget()
        self.stash.clear()
        for i in range(self.num_layers):  # kept in this window's backward: its load consumed the previous one
            if self.grads.has_grad(i):
                self.grads.drop(i)
        self.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the dropped work finished: its memory is free for the retry
