"""The streaming executor equals plain HF autograd: every tier, retention choice and prefetch depth (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import load_model
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.planning.schedule import LayerPlan, Schedule
from lazytrain_hf.streaming.executor import StreamingExecutor, plan_ops

from ..conftest import random_batch, rel_err

ARCHS = ["qwen2-tiny", "qwen2-tiny-tied", "qwen3-tiny", "qwen3-tiny-untied", "qwen3.5-tiny"]


def _schedules() -> dict[str, Schedule]:
    P = LayerPlan
    return {
        "fixed-k2-gpu": fixed_schedule(4, 2, "gpu", 1),
        "every-layer-cpu": fixed_schedule(4, 1, "cpu", 2),
        "one-segment-nvme": fixed_schedule(4, 4, "nvme", 3),
        "mixed-tiers-retain": Schedule("milp", [P(True, "cpu"), P(False), P(True, "nvme"), P(False, retain=True)],
                                       prefetch_depth=2),
        "all-retained": Schedule("milp", [P(True, "gpu", retain=True), P(False, retain=True), P(False, retain=True),
                                          P(True, "cpu", retain=True)], prefetch_depth=1),
        "retain-inside-segment": Schedule("milp", [P(True, "gpu"), P(False, retain=True), P(False), P(False)],
                                          prefetch_depth=3),
    }


def _reference(model, ids, mask, labels):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sched_name", list(_schedules()))
def test_loss_and_grads_equal_hf_autograd(arch, sched_name, tmp_path):
    model = load_model(arch, "float32", seed=1)
    ids, mask, labels = random_batch(model.config.vocab_size)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)

    # Chunks that do not divide B*T. Qwen3.5's dt_bias / A_log grads come out of heavy cancellation, so the
    # chunked head's different fp32 summation order alone moves them ~1e-5: there, one chunk here and the
    # chunked head is checked in float64 (test_chunked_head_exact_in_float64).
    chunk = 2048 if arch.startswith("qwen3.5") else 7
    cfg = LazyTrainConfig(loss_chunk_tokens=chunk, nvme_dir=str(tmp_path))
    ex = StreamingExecutor(model, cfg, "cpu", _schedules()[sched_name])
    loss = ex.forward_backward(ids, labels, mask)

    assert rel_err(loss, ref_loss) < 1e-6
    for name, p in model.named_parameters():
        assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, name
    assert not list(tmp_path.iterdir()), "NVMe boundary files must be deleted after the step"


def test_chunked_head_exact_in_float64():
    model = load_model("qwen3.5-tiny", "float64", seed=8)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=9)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=7), "cpu", fixed_schedule(4, 2, "cpu", 2))
    loss = ex.forward_backward(ids, labels, mask)
    assert rel_err(loss, ref_loss) < 1e-6  # ForCausalLMLoss computes the CE in fp32 even for float64 models
    for name, p in model.named_parameters():
        assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-6, name  # host grad buffers are fp32


def test_gradients_accumulate_and_zero():
    model = load_model("qwen3-tiny", "float32", seed=2)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=3)
    ref_model = copy.deepcopy(model)
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu")
    ex.forward_backward(ids, labels, mask, denominator=10.0)
    ex.forward_backward(ids, labels, mask, denominator=10.0)
    ref_model.zero_grad()
    for _ in range(2):
        out = ref_model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=10)
        out.loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert rel_err(ex.grad_source(p), q.grad) < 1e-5, name
    ref_norm = torch.nn.utils.get_total_norm([q.grad for q in ref_model.parameters()])
    assert rel_err(ex.grad_norm(), ref_norm) < 1e-6  # two micro-batches: summed from the host accumulators
    ex.zero_grad()
    assert all(ex.grad_source(p) is None for p in model.parameters() if ex.is_streamed(p))
    ex.forward_backward(ids, labels, mask, denominator=10.0)  # one micro-batch: norm accumulated in flight
    ref_model.zero_grad()
    ref_model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=10).loss.backward()
    ref_norm = torch.nn.utils.get_total_norm([q.grad for q in ref_model.parameters()])
    assert ex.grads.norm_from_device and rel_err(ex.grad_norm(), ref_norm) < 1e-6


def test_bf16_close_to_autograd():
    model = load_model("qwen3-tiny", "bfloat16", seed=4)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=5)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu")
    loss = ex.forward_backward(ids, labels, mask)
    assert rel_err(loss, ref_loss) < 1e-2
    for name, p in model.named_parameters():
        assert rel_err(ex.grad_source(p), ref_grads[name].float()) < 5e-2, name


def test_weights_are_one_copy_in_host_buffers():
    model = load_model("qwen2-tiny", "float32")
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu")
    for i, layer in enumerate(model.model.layers):
        flat = ex.store.buffers[i].weights[torch.float32]
        for p in layer.parameters():
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_slots_are_built_with_their_fields():
    model = load_model("qwen3.5-tiny", "float32")
    ex = StreamingExecutor(model, LazyTrainConfig(prefetch_depth=2), "cpu")
    assert len(ex.streamer.pools) == 2  # linear- and full-attention layers get their own slots
    for slot in ex.streamer.slots:
        assert slot.grads_free is None and slot.layer in range(-1, 4)
        assert isinstance(slot.storage_ptrs, set) and slot.storage_ptrs
        for p in slot.module.parameters():
            assert p.untyped_storage().data_ptr() in slot.storage_ptrs


def test_weight_loads_follow_plan_ops():
    sched = fixed_schedule(8, 4, "gpu", 1)
    ops = plan_ops(sched)
    assert [i for op, i in ops if op == "fwd"] == list(range(8))
    assert [i for op, i in ops if op == "recompute"] == [4, 5, 6, 0, 1, 2]
    assert [i for op, i in ops if op == "bwd"] == list(range(7, -1, -1))


def test_inference_forward_matches_hf():
    model = load_model("qwen3.5-tiny", "float32", seed=6)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=7)
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    ex = StreamingExecutor(model.eval(), LazyTrainConfig(), "cpu")
    loss, logits = ex.forward_inference(ids, mask, labels)
    assert rel_err(loss, out.loss) < 1e-6
    assert rel_err(logits, out.logits) < 1e-5


def _with_dropout(arch: str, p: float = 0.2):
    """A model whose layers draw random numbers in training (attention dropout): Note [dropout in recompute]."""
    model = load_model(arch, "float32", seed=1)
    model.config.attention_dropout = p
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = p
    return model.train()


def _pass_with_a_forward_inside(ex, ids, mask, labels, other):
    """`forward_backward`'s protocol of `stream_pass`, with a no-grad `forward_hidden` of `other` run while the pass
    waits for its head's gradient (as a reference forward inside a loss runs)."""
    from lazytrain_hf.streaming.head import chunked_lm_loss, shift_labels

    targets = shift_labels(labels.to(ex.device))
    run = ex.stream_pass(ids, mask)
    h = next(run)
    inner = ex.forward_hidden(*other)
    loss, g = chunked_lm_loss(h, targets, ex.base.norm, ex.resident.head_module(), targets.ne(-100).sum(),
                              ex.config.loss_chunk_tokens)
    ex.resident.head_backward_done()
    run.send(g)
    next(run, None)
    return loss, inner


@pytest.mark.parametrize("placement", ["gpu", "host_embedding", "host"])
@pytest.mark.parametrize("sched_name", list(_schedules()))
def test_a_forward_inside_a_pass_leaves_its_gradients_as_without_it(sched_name, placement, tmp_path):
    """Its weight loads, RNG draws and embedding lookup do not reach the waiting pass: the stash, the retained
    layers' graphs, the recorded dropout states, the prefetched weights and a host embedding's ids stay the pass's."""
    check_forward_inside_a_pass(sched_name, placement, tmp_path, "cpu")


def check_forward_inside_a_pass(sched_name, placement, tmp_path, device, tol=1e-6):
    """`test_a_forward_inside_a_pass_leaves_its_gradients_as_without_it` on `device`."""
    model = _with_dropout("qwen3-tiny-untied")
    ids, mask, labels = random_batch(model.config.vocab_size, seed=3)
    other_ids, other_mask, _ = random_batch(model.config.vocab_size, B=1, T=17, seed=4)  # fewer rows: buffers reused
    grads = []
    for inside in (False, True):
        m = copy.deepcopy(model)
        sched = copy.deepcopy(_schedules()[sched_name])
        sched.resident = placement
        ex = StreamingExecutor(m, LazyTrainConfig(loss_chunk_tokens=7, nvme_dir=str(tmp_path)), device, sched)
        torch.manual_seed(0)
        if inside:
            loss, inner = _pass_with_a_forward_inside(ex, ids, mask, labels, (other_ids, other_mask))
            assert inner.shape == (1, 17, model.config.hidden_size)
        else:
            loss = ex.forward_backward(ids, labels, mask)
        grads.append((loss.cpu(), {n: ex.grad_source(p).to("cpu", copy=True) for n, p in m.named_parameters()}))
    (loss, want), (got_loss, got) = grads
    assert rel_err(got_loss, loss) < tol
    for name, g in want.items():
        assert rel_err(got[name], g) < tol, name


def test_schedule_layer_count_mismatch_is_clear():
    model = load_model("qwen3-tiny", "float32")
    with pytest.raises(ValueError, match="schedule has 3 layers but the model has 4"):
        StreamingExecutor(model, LazyTrainConfig(), "cpu", fixed_schedule(3, 1))


def test_unsupported_architecture_is_clear():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="does not support model_type='gpt2'"):
        StreamingExecutor(model, LazyTrainConfig(), "cpu")


@pytest.mark.parametrize("arch", ["qwen2-tiny", "qwen3.5-tiny"])
@pytest.mark.parametrize("sched_name", ["fixed-k2-gpu", "mixed-tiers-retain", "all-retained"])
def test_row_chunked_passes_equal_autograd(arch, sched_name, tmp_path):
    """max_rows_per_pass: each layer runs over the micro-batch in row chunks (3 rows as 2 + 1)."""
    model = load_model(arch, "float32", seed=11)
    ids, mask, labels = random_batch(model.config.vocab_size, B=3, seed=12)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    cfg = LazyTrainConfig(max_rows_per_pass=2, nvme_dir=str(tmp_path))
    ex = StreamingExecutor(model, cfg, "cpu", _schedules()[sched_name])
    loss = ex.forward_backward(ids, labels, mask)
    assert rel_err(loss, ref_loss) < 1e-6
    for name, p in model.named_parameters():
        assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, name


def test_the_schedules_rows_per_pass_is_what_the_executor_runs(monkeypatch):
    """A plan's `rows_per_pass` (the planner's choice) overrides `max_rows_per_pass`: 3 rows as 1 + 1 + 1."""
    model = load_model("qwen3.5-tiny", "float32", seed=13)
    ids, mask, labels = random_batch(model.config.vocab_size, B=3, seed=14)
    ref_loss, ref_grads = _reference(copy.deepcopy(model), ids, mask, labels)
    sched = copy.deepcopy(_schedules()["fixed-k2-gpu"])
    sched.rows_per_pass = 1
    ex = StreamingExecutor(model, LazyTrainConfig(max_rows_per_pass=2), "cpu", sched)
    rows = []
    run = StreamingExecutor._run
    monkeypatch.setattr(StreamingExecutor, "_run", lambda self, slot, x, call, key=None: rows.append(x.shape[0]) or
                        run(self, slot, x, call, key))
    loss = ex.forward_backward(ids, labels, mask)
    assert set(rows) == {1}
    assert rel_err(loss, ref_loss) < 1e-6
    for name, p in model.named_parameters():
        assert rel_err(ex.grad_source(p), ref_grads[name]) < 1e-5, name


def test_schedule_recompute_count_matches_executor_ops():
    for sched in _schedules().values():
        assert sched.recomputed_layers() == sum(op == "recompute" for op, _ in plan_ops(sched))


def test_pinned_arena_exact_sizes_first_fit_and_threads():
    import threading

    from lazytrain_hf.streaming.host_store import PinnedArena

    arena = PinnedArena(pin=False, chunk_bytes=4096)
    a = arena.alloc((10, 3), torch.float32)
    b = arena.alloc((5,), torch.uint8)  # its own pool: one dtype per storage (torch.save requires it)
    c = arena.alloc((500,), torch.float32)  # 2000 B: fits the float32 chunk after a
    big = arena.alloc((3000,), torch.float32)  # 12000 B: a chunk of its own size
    assert a.shape == (10, 3) and a.dtype == torch.float32 and b.dtype == torch.uint8 and c.numel() == 500
    assert all(t.data_ptr() % 64 == 0 for t in (a, b, c, big))
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    assert arena.used_bytes == 120 + 5 + 2000 + 12000 and arena.reserved_bytes == 4096 * 2 + 12032  # 64-B rounded
    a.fill_(1.0), b.fill_(7), c.fill_(2.0)
    assert float(a.sum()) == 30 and int(b.sum()) == 35 and float(c.sum()) == 1000  # no overlap
    out = []

    def work():
        out.extend(arena.alloc((16,), torch.float32) for _ in range(100))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({t.data_ptr() for t in out}) == 400  # every allocation distinct


def test_streamed_optimizer_states_live_in_the_arena():
    """The executor hands the optimizer exact-size memory for streamed layers' states (pinned under CUDA)."""
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    model = load_model("qwen3-tiny", "float32", seed=2)
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu")
    opt = Hybrid8bitOptimizer(list(model.parameters()), lr=1e-3, min_8bit_size=256, master_weights="fp32")
    opt.set_grad_source(ex.grad_source)
    opt.set_state_allocator(ex.state_alloc)
    ids, mask, labels = random_batch(model.config.vocab_size)
    ex.forward_backward(ids, labels, mask)
    opt.step()
    streamed = [p for p in model.parameters() if ex.is_streamed(p)]
    state_bytes = sum(v.numel() * v.element_size() for p in streamed for v in opt.state[p].values()
                      if torch.is_tensor(v))
    assert ex.state_arena.used_bytes == state_bytes > 0
    chunks = [(c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in ex.state_arena.chunks()]
    for p in streamed:
        for v in opt.state[p].values():
            if torch.is_tensor(v):
                assert any(lo <= v.data_ptr() < hi for lo, hi in chunks)
    resident = [p for p in model.parameters() if not ex.is_streamed(p)]
    assert all(not any(lo <= opt.state[p]["state1"].data_ptr() < hi for lo, hi in chunks) for p in resident)
    assert ex.pinned_bytes["planned"] >= ex.state_arena.used_bytes


def run_with_slow_cpu_updates(device: str, sleep_s: float, monkeypatch,
                              microbatches: int = 1) -> tuple[dict[str, float], int, int]:
    """Two steps of a tiny model whose every layer updates in the CPU worker, each layer's update slowed by
    `sleep_s`, step 2 with `microbatches` gradient-accumulation micro-batches: (stats.extra after step 2's last
    micro-batch; its first waited for step 1's updates; layer count; streamed params). Step 1 reports no worker
    run (none came before it)."""
    import time

    from lazytrain_hf.optim import Hybrid8bitOptimizer

    model = load_model("qwen3-tiny", "float32", seed=6)
    L = model.config.num_hidden_layers
    ex = StreamingExecutor(model, LazyTrainConfig(), device, fixed_schedule(L, 2, "gpu", 1), host_grad_dtype="param")
    opt = Hybrid8bitOptimizer(list(model.parameters()), lr=1e-3, state_dtype="fp32", master_weights="none")
    opt.set_grad_source(ex.grad_source)
    ex.attach_optimizer(opt)
    if device == "cuda":
        ex.instrument()
    slow = opt.step_deferred

    def step_deferred(params, snapshot):
        time.sleep(sleep_s)
        return slow(params, snapshot)

    monkeypatch.setattr(opt, "step_deferred", step_deferred)
    for step in range(2):
        ids, mask, labels = random_batch(model.config.vocab_size, seed=step)
        ex.zero_grad()
        for _ in range(microbatches if step else 1):
            ex.forward_backward(ids, labels, mask)
        if step == 0:
            assert "cpu_update_ms" not in ex.stats.extra
        opt.clip_grad_norm(1.0, ex.grad_norm())
        opt.step()
    x, streamed = dict(ex.stats.extra), sum(p.numel() for layer in ex.layers for p in layer.parameters())
    ex.close()
    return x, L, streamed


def test_kept_gradients_with_accumulation_and_reads_equal_host_gradients():
    """Kept gradients (`Schedule.keep_grads`) under gradient accumulation (the second micro-batch moves them to
    the host, which sums) and read through `grad_source` between backward and step (copied out first): the
    gradients read and the weights after 3 steps equal those of the same schedule without keeping, bit for bit."""
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    base = load_model("qwen3-tiny", "float32", seed=7)
    L = base.config.num_hidden_layers
    lays = [LayerPlan(checkpoint=True, optimizer_device="gpu" if i in (0, 2) else "cpu") for i in range(L)]
    weights, grads = {}, {}
    for keep in (False, True):
        model = copy.deepcopy(base)
        ex = StreamingExecutor(model, LazyTrainConfig(), "cpu", Schedule("milp", lays, keep_grads=keep))
        opt = Hybrid8bitOptimizer(list(model.parameters()), lr=1e-3, min_8bit_size=256, master_weights="fp32")
        opt.set_grad_source(ex.grad_source)
        ex.attach_optimizer(opt)
        grads[keep] = []
        for step in range(3):
            ex.zero_grad()
            for mb in range(2 if step == 1 else 1):
                ids, mask, labels = random_batch(model.config.vocab_size, seed=20 + 2 * step + mb)
                ex.forward_backward(ids, labels, mask)
            if step == 2:  # a read between backward and step: layer 0's kept gradient goes to the host first
                assert ex.grads.is_kept(0) == keep
                grads[keep] = [ex.grad_source(p).clone() for p in ex.layers[0].parameters()]
                assert not ex.grads.is_kept(0) and ex.grads.is_kept(2) == keep
            opt.clip_grad_norm(1.0, ex.grad_norm())
            opt.step()
        ex.flush_updates()
        weights[keep] = [p.detach().clone() for p in model.parameters()]
        ex.close()
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True])) and grads[True]
    assert all(torch.equal(a, b) for a, b in zip(weights[False], weights[True]))


def test_waits_for_slow_cpu_updates_are_counted(monkeypatch):
    """The next forward blocks on a layer whose deferred CPU update is still running: stats.extra counts the
    training thread's wait (optimizer_wait_ms) and the worker's wall time and parameters for the step
    (cpu_update_ms / cpu_update_params), which calibration turns into a measured CPU update rate."""
    x, L, streamed = run_with_slow_cpu_updates("cpu", 0.03, monkeypatch, microbatches=2)
    assert x["cpu_update_params"] == streamed
    # layer 0 alone waits ~30 ms, in the first micro-batch: the count is per optimizer step (the second adds ~0)
    assert x["cpu_update_ms"] >= 30.0 * L and x["optimizer_wait_ms"] > 10.0


@pytest.mark.parametrize("placed, retain, keep", [((0, 1, 3), (), False), ((0, 1, 3), (), True),
                                                  ((0, 1, 3), (1, 2), True), ((0, 1, 2, 3), (0, 1, 2, 3), False),
                                                  ((0, 1, 2, 3), (0, 1, 2, 3), True)])
def test_device_placed_updates_equal_host_updates_on_cpu(placed, retain, keep):
    """The GPU-side update path (schedule optimizer_device "gpu": staged at the layer's load, run at its first
    compute access, copied back; Note [GPU-side update ordering]) with retained layers, a CPU-tier boundary and
    row chunks, run on the CPU: bit-identical to updating every layer in the host worker, over 4 steps with
    clipping; its staging copies are freed at the end of each forward. With `keep_grads` the placed layers'
    gradients never reach the host (kept on the device from backward to the update; the last step's are
    materialized for the host update at the flush)."""
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    L = base.config.num_hidden_layers
    weights, norms = {}, {}
    for dev_layers, retained in (((), ()), (placed, retain)):
        lays = [LayerPlan(checkpoint=i % 2 == 0, tier="cpu" if i == 2 else "gpu", retain=i in retained,
                          optimizer_device="gpu" if i in dev_layers else "cpu") for i in range(L)]
        model = copy.deepcopy(base)
        ex = StreamingExecutor(model, LazyTrainConfig(max_rows_per_pass=1), "cpu",
                               Schedule("milp", lays, keep_grads=keep), host_grad_dtype="param")
        opt = Hybrid8bitOptimizer(list(model.parameters()), lr=1e-3, weight_decay=0.1, min_8bit_size=256,
                                  block_size=256, master_weights="kahan")
        opt.set_grad_source(ex.grad_source)
        opt.set_state_allocator(ex.state_alloc)
        ex.attach_optimizer(opt)
        norms[dev_layers] = []
        for step in range(4):
            ids, mask, labels = random_batch(model.config.vocab_size, seed=10 + step)
            ex.zero_grad()
            d2h = ex.grads.d2h_bytes
            ex.forward_backward(ids, labels, mask)
            assert not ex.device_updater.staging and not ex.device_updater.launches  # staged copies freed once forward ran the updates
            grad_bytes = [sum(t.numel() * t.element_size() for t in ex.store.buffers[i].grads.values())
                          for i in range(L)]
            kept = keep and bool(dev_layers)
            assert ex.grads.kept_bytes == (sum(grad_bytes[i] for i in dev_layers) if kept else 0)
            assert ex.grads.d2h_bytes - d2h == sum(grad_bytes) - (ex.grads.kept_bytes if kept else 0)
            if step and not dev_layers:  # the last step's host-worker updates were timed, and the wait on them
                assert ex.stats.extra["cpu_update_ms"] > 0 and "optimizer_wait_ms" in ex.stats.extra
            n = ex.grad_norm()
            norms[dev_layers].append(float(n))
            opt.clip_grad_norm(0.5, n)
            opt.step()
        ex.flush_updates()
        assert ex.grads.kept_bytes == 0  # read by the host updates of the flush
        assert ex.device_updates == 3 * len(dev_layers)  # steps 1-3 met a next load; step 4 flushed on the host
        weights[dev_layers] = {n: p.detach().clone() for n, p in model.named_parameters()}
        ex.close()
    assert norms[()] == norms[placed]
    for name, w in weights[()].items():
        assert torch.equal(weights[placed][name], w), name


def _attached(model, plan, config=None, lr=1e-3, weight_decay=0.1):
    """A CPU StreamingExecutor for `model` under `plan` (bf16 host gradients) with a Hybrid8bitOptimizer (8-bit
    states from 256 elements, Kahan) attached as LazyTrainer does: (executor, optimizer)."""
    from lazytrain_hf.optim import Hybrid8bitOptimizer

    ex = StreamingExecutor(model, config or LazyTrainConfig(), "cpu", plan, host_grad_dtype="param")
    opt = Hybrid8bitOptimizer(list(model.parameters()), lr=lr, weight_decay=weight_decay, min_8bit_size=256,
                              master_weights="kahan")
    opt.set_grad_source(ex.grad_source)
    opt.set_state_allocator(ex.state_alloc)
    ex.attach_optimizer(opt)
    return ex, opt


def _final_weights(ex, model):
    """Flush the deferred updates, close the executor, return the model's weights (name -> tensor)."""
    ex.flush_updates()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    ex.close()
    return out


def _prepared_runs(plans, budgets, check):
    """Trains a copy of tiny Qwen2 (bf16, Kahan, clipping) for len(plans) steps per prepared-states budget, step k
    under plans[k] (`set_schedule`); `check(ex, opt, budget, step)` runs after each step's backward. Returns the
    weights per budget."""

    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    weights = {}
    for budget in budgets:
        model = copy.deepcopy(base)
        ex, opt = _attached(model, plans[0], LazyTrainConfig(prepared_states_budget=budget))
        for step, plan in enumerate(plans):
            ex.set_schedule(plan)
            ids, mask, labels = random_batch(model.config.vocab_size, seed=30 + step)
            ex.zero_grad()
            ex.forward_backward(ids, labels, mask)
            check(ex, opt, budget, step)
            opt.clip_grad_norm(0.5, ex.grad_norm())
            opt.step()
        ex.flush_updates()
        weights[budget] = {n: p.detach().clone() for n, p in model.named_parameters()}
        ex.close()
    return weights


def _layer_prep_bytes(layer: int = 1) -> int:
    return 8 * sum(p.numel() for p in load_model("qwen2-tiny", "bfloat16", seed=6).model.layers[layer].parameters())


@pytest.mark.parametrize("budget_layers", [1, 99])
def test_prepared_moments_equal_unprepared_updates(budget_layers):
    """The update worker prepares the next step's CPU-updated layers' moments after each step
    (`LazyTrainConfig.prepared_states_budget`, streaming/updates.py) within a byte budget (1 layer, or all):
    with GPU-placed layers and clipping, 4 steps give bit-identical weights to a run with the budget 0; the
    prepared layers are the first CPU-updated ones, their updates are timed apart, and the preparation shows in
    stats.extra."""
    L = load_model("qwen2-tiny", "bfloat16", seed=6).config.num_hidden_layers
    lays = [LayerPlan(checkpoint=True, optimizer_device="gpu" if i == 0 else "cpu") for i in range(L)]
    want = list(range(1, min(L, 1 + budget_layers)))

    def check(ex, opt, budget, step):
        assert ex.updater.prepare_layers() == (want if budget else [])
        x = ex.stats.extra
        if budget and step >= 2:  # step 0's update prepared step 1's: timed in step 1, seen at step 2's end
            eight_bit = sum(p.numel() for i in want for p in ex.layers[i].parameters() if opt.state[p]
                            and opt.state[p]["state1"].dtype == torch.uint8)
            assert x["prepare_params"] == eight_bit > 0 and x["prepare_complete"] == 1.0
            assert x["cpu_update_prepared_params"] == sum(p.numel() for i in want for p in ex.layers[i].parameters())
        elif not budget:
            assert "prepare_ms" not in x and x.get("cpu_update_prepared_params", 0.0) == 0.0

    plans = [Schedule("milp", lays, keep_grads=True)] * 4
    ref, got = _prepared_runs(plans, (0, budget_layers * _layer_prep_bytes()), check).values()
    for name, w in ref.items():
        assert torch.equal(got[name], w), name


def test_prepared_buffers_stay_within_budget_when_the_plan_moves_layers():
    """A re-plan or another bucket's plan moves layers between CPU and GPU updates every 2 steps (0 -> 1 -> 2 -> 0
    GPU-updated layers): the prepared buffers held never exceed the budget (one layer's; buffers of layers no longer
    prepared are freed), and the weights equal a run without preparation bit for bit (found by a fresh-user review:
    the buffers of layers left behind were kept)."""
    L = load_model("qwen2-tiny", "bfloat16", seed=6).config.num_hidden_layers
    plans = [Schedule("milp", [LayerPlan(checkpoint=True, optimizer_device="gpu" if i < k else "cpu")
                               for i in range(L)]) for k in (0, 0, 1, 1, 2, 2, 0, 0)]

    def check(ex, opt, budget, step):
        if ex.updater._thread is not None:  # the last step's updates and preparation done (not stopped)
            ex.updater._thread.join()
        assert opt.prepared_bytes() <= budget, (step, opt.prepared_bytes(), budget)

    ref, got = _prepared_runs(plans, (0, _layer_prep_bytes()), check).values()
    for name, w in ref.items():
        assert torch.equal(got[name], w), name


@pytest.mark.parametrize("depth", [1, 2])
def test_slot_reuse_at_the_step_boundary_equals_reloading(depth):
    """Note [slot reuse]: the next pass takes the weights backward left in the slots without the H2D copy where
    they still equal the host copy (every slot between micro-batches of one step; after a step only GPU-updated
    layers, whose update then runs on the reused slot). Bit-identical weights to reloading every layer, over steps
    with gradient accumulation, GPU-placed and CPU-updated layers, a flush and an evaluation between steps, and a
    schedule change; fewer H2D bytes exactly where reuse applies."""

    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    L = base.config.num_hidden_layers
    layer_bytes = [sum(t.numel() * t.element_size() for t in layer.parameters()) for layer in base.model.layers]
    plans = [Schedule("milp", [LayerPlan(checkpoint=True, optimizer_device="gpu" if i in gpu else "cpu")
                               for i in range(L)], prefetch_depth=depth) for gpu in ({0, 1}, {0, 1}, {0, 2})]
    weights, h2d = {}, {}
    for reuse in (False, True):
        model = copy.deepcopy(base)
        ex, opt = _attached(model, plans[0])
        ex.reuse_slots = reuse
        h2d[reuse] = []
        for step in range(6):
            if step == 4:
                ex.set_schedule(plans[2])  # layer 1 leaves the GPU set: its pending update runs on the host now
            ex.zero_grad()
            for mb in range(2 if step in (1, 3) else 1):
                ids, mask, labels = random_batch(model.config.vocab_size, seed=50 + 2 * step + mb)
                ex.forward_backward(ids, labels, mask)
                h2d[reuse].append(ex.stats.h2d_weight_bytes)
            opt.clip_grad_norm(0.5, ex.grad_norm())
            opt.step()
            if step == 2:  # save / evaluate: the flush may apply updates on the host, then an evaluation pass
                ex.flush_updates()
                ex.forward_inference(*random_batch(model.config.vocab_size, seed=99)[:1])
        ex.flush_updates()
        weights[reuse] = {n: p.detach().clone() for n, p in model.named_parameters()}
        ex.close()
    for name, w in weights[False].items():
        assert torch.equal(weights[True][name], w), name
    # the last backward leaves layers depth..0 in the slots; a step reuses the GPU-updated ones among them, a
    # second micro-batch all of them; nothing after the flush or the evaluation; after a schedule change the
    # layers that stay GPU-updated (layer 1 leaves the set, so its update runs on the host and it reloads)
    tail = set(range(depth + 1))
    gpu_tail = sum(layer_bytes[i] for i in tail & {0, 1})
    want = [0,                                       # step 0: first pass
            gpu_tail, sum(layer_bytes[i] for i in tail),  # step 1: after a step; 2nd micro-batch
            gpu_tail,                                # step 2
            0, sum(layer_bytes[i] for i in tail),    # step 3: after the flush + evaluation; 2nd micro-batch
            sum(layer_bytes[i] for i in tail & {0}),  # step 4: schedule change
            sum(layer_bytes[i] for i in tail & {0, 2})]  # step 5
    saved = [a - b for a, b in zip(h2d[False], h2d[True], strict=True)]
    assert saved == want, saved


def test_slot_reuse_after_two_steps_without_a_pass_reloads():
    """Note [slot reuse]: a second `optimizer.step()` with no pass since the first applies the first step's pending
    GPU-side updates on the host (`LayerUpdater.wait_all`); the slots backward left still hold the weights before
    them, so the next pass must reload those layers. Bit-identical to reloading every layer."""

    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    L = base.config.num_hidden_layers
    plan = Schedule("milp", [LayerPlan(checkpoint=True, optimizer_device="gpu") for _ in range(L)])
    weights = {}
    for reuse in (False, True):
        model = copy.deepcopy(base)
        ex, opt = _attached(model, plan, lr=1e-2, weight_decay=0.0)  # Kahan (fp32 master weights would overwrite
        ex.reuse_slots = reuse                                           # a stale slot)
        ex.forward_backward(*(lambda i, m, y: (i, y, m))(*random_batch(model.config.vocab_size, seed=1)))
        opt.step()
        opt.step()  # no pass in between: the first step's GPU-side updates land on the host here
        ex.zero_grad()
        ex.forward_backward(*(lambda i, m, y: (i, y, m))(*random_batch(model.config.vocab_size, seed=2)))
        opt.step()
        weights[reuse] = _final_weights(ex, model)
    for name, w in weights[False].items():
        assert torch.equal(weights[True][name], w), name


def test_loading_optimizer_states_applies_pending_updates_first():
    """`optimizer.load_state_dict` with deferred updates still pending (GPU-placed and CPU layers) applies them
    first, as a flush would (before, their snapshots named the replaced param groups: KeyError at the next load):
    bit-identical to flushing before the load, and training goes on."""

    base = load_model("qwen2-tiny", "bfloat16", seed=6)
    L = base.config.num_hidden_layers
    plan = Schedule("milp", [LayerPlan(checkpoint=True, optimizer_device="gpu" if i < 2 else "cpu")
                             for i in range(L)])
    weights = {}
    for load in (False, True):
        model = copy.deepcopy(base)
        ex, opt = _attached(model, plan, lr=1e-2, weight_decay=0.0)
        ids, mask, labels = random_batch(model.config.vocab_size, seed=3)
        ex.forward_backward(ids, labels, mask)
        opt.step()
        assert ex.updater.device_pending  # layers 0 and 1 wait for their next load
        for i in range(2, L):  # the worker's CPU updates done: the states read next are not mid-update
            ex.updater.wait(i)
        sd = opt.state_dict()  # e.g. a checkpoint's states, taken while updates were pending
        if not load:
            ex.flush_updates()  # the reference: apply them, then load
        opt.load_state_dict(sd)  # (load: the pre-hook applies them on the host first)
        assert not ex.updater.device_pending
        ex.zero_grad()
        ids, mask, labels = random_batch(model.config.vocab_size, seed=4)
        ex.forward_backward(ids, labels, mask)
        opt.step()
        weights[load] = _final_weights(ex, model)
    for name, w in weights[False].items():
        assert torch.equal(weights[True][name], w), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_instrumented_steps_time_every_op_on_the_gpu(device):
    """`StepStats.op_ms` (streaming/stats.py OpTimer): on an instrumented CUDA run, GPU time per op and layer for
    exactly the ops the plan runs (every layer's forward and backward, the re-forwards of `plan_ops`, the head),
    summing to less than the step's wall time; off the GPU it stays empty."""
    model = load_model("qwen3-tiny", "float32", seed=2)
    L = model.config.num_hidden_layers
    sched = Schedule("t", [LayerPlan(i % 3 == 0, "gpu", i == L - 1) for i in range(L)])
    ex = StreamingExecutor(model, LazyTrainConfig(), device, sched)
    ex.instrument()
    ids, mask, labels = random_batch(model.config.vocab_size)
    ex.forward_backward(ids, labels, mask)
    if device == "cpu":
        assert ex.stats.op_ms == {}
        return
    m = ex.stats.op_ms
    assert set(m) == {"fwd", "recompute", "bwd", "head"}
    assert all(t > 0 for t in m["fwd"] + m["bwd"] + m["head"])
    rebuilt = {i for op, i in plan_ops(sched) if op == "recompute"}
    assert rebuilt and {i for i, t in enumerate(m["recompute"]) if t > 0} == rebuilt
    assert sum(sum(v) for v in m.values()) < ex.stats.seconds * 1e3
    ex.close()
