"""Pinned-memory accounting: exact-size reusable host buffers for the activation tiers, and `pinned_bytes` parts
that add up (CPU: the same buffers exist unpinned, so every accounting path runs here)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from lazytrain_hf.config import LazyTrainConfig
from lazytrain_hf.models import load_model
from lazytrain_hf.optim import Hybrid8bitOptimizer
from lazytrain_hf.planning.fixed import fixed_schedule
from lazytrain_hf.planning.schedule import LayerPlan, Schedule
from lazytrain_hf.streaming import host_store
from lazytrain_hf.streaming.executor import StreamingExecutor
from lazytrain_hf.streaming.host_store import HostBufferPool
from lazytrain_hf.streaming.nvme import ALIGN, padded
from lazytrain_hf.streaming.tiers import ActivationStash

from ..conftest import random_batch, rel_err

CPU = torch.device("cpu")
PARTS = ("store", "optimizer_states", "grad_staging", "activations", "resident")


@pytest.fixture
def fake_pin(monkeypatch):
    """cudaHostRegister stand-in: every tensor 'registers' in place; records registrations and unregistrations."""
    log = {"registered": [], "unregistered": []}

    def pin(t):
        log["registered"].append(t.data_ptr())
        return t, True

    def unreg(ts):
        log["unregistered"].extend(t.data_ptr() for t in ts)
        ts.clear()

    monkeypatch.setattr(host_store, "pin_tensor", pin)
    monkeypatch.setattr(host_store, "unregister", unreg)
    return log


def test_pool_exact_aligned_reuse_best_fit_and_counters():
    pool = HostBufferPool(pin=False)
    a = pool.acquire(10_000)
    assert a.dtype == torch.uint8 and a.numel() == 10_000 and a.data_ptr() % ALIGN == 0
    b = pool.acquire(3 * ALIGN)
    assert pool.in_use_bytes == pool.high_water_bytes == pool.held_bytes == 10_000 + 3 * ALIGN
    pool.release(a)
    pool.release(b)
    assert pool.in_use_bytes == 0 and pool.high_water_bytes == 10_000 + 3 * ALIGN
    assert pool.acquire(3 * ALIGN) is b  # the smallest free buffer that fits
    assert pool.acquire(5_000) is a
    assert pool.allocations == 2
    with pytest.raises(ValueError, match="did not hand out"):
        pool.release(torch.empty(8, dtype=torch.uint8))


def test_pool_drops_smaller_free_buffers_when_it_must_grow(fake_pin):
    pool = HostBufferPool(pin=True)
    small = [pool.acquire(ALIGN) for _ in range(3)]
    assert pool.registered_bytes == pool.held_bytes == 3 * ALIGN
    ptrs = [s.data_ptr() for s in small]
    for s in small[:2]:
        pool.release(s)
    big = pool.acquire(2 * ALIGN)  # nothing free fits: the two free small buffers go (unregistered first)
    assert sorted(fake_pin["unregistered"]) == sorted(ptrs[:2])
    assert pool.held_bytes == pool.registered_bytes == ALIGN + 2 * ALIGN  # the in-use small one stays
    pool.release(big)
    pool.release(small[2])
    pool.trim()
    assert pool.held_bytes == pool.registered_bytes == 0
    pool.release_all()


def test_pool_release_all_unregisters_everything(fake_pin):
    pool = HostBufferPool(pin=True)
    bufs = [pool.acquire(n) for n in (100, ALIGN, 3 * ALIGN + 1)]
    pool.release(bufs[0])
    pool.release_all()
    assert sorted(fake_pin["unregistered"]) == sorted(b.data_ptr() for b in bufs)
    assert pool.registered_bytes == 0


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_stash_reuses_buffers_across_steps(tier, tmp_path):
    stash = ActivationStash(CPU, str(tmp_path))
    g = torch.Generator().manual_seed(0)
    allocs, held = [], []
    for width in (600, 1200, 600, 600):  # a step with larger boundaries (dynamic padding), then smaller again
        hs = {i: torch.randn(2, 5, width, generator=g) for i in (0, 2, 3)}
        for i, h in hs.items():
            stash.put(i, h, tier)
            stash.flush()  # deterministic buffer counts: each write ends before the next put
        for i in sorted(hs, reverse=True):
            assert torch.equal(stash.get(i), hs[i])
        stash.clear()
        assert stash.buffers.in_use_bytes == 0
        allocs.append(stash.buffers.allocations)
        held.append(stash.buffers.held_bytes)
    assert allocs[1] > allocs[0]  # the larger step could not reuse the smaller buffers: they were dropped
    assert held[1] == 3 * padded(2 * 5 * 1200 * 4)
    assert allocs[3] == allocs[2] == allocs[1] and held[3] == held[2] == held[1]  # no growth afterwards
    assert not list(tmp_path.iterdir())


def test_stash_buffer_sizes_are_padded_boundary_bytes(tmp_path):
    stash = ActivationStash(CPU, str(tmp_path))
    h = torch.randn(2, 3, 5)  # 120 bytes
    for step in range(2):
        stash.put(0, h, "cpu")
        stash.put(1, h, "cpu")
        stash.put(2, h, "nvme")
        stash.flush()  # the NVMe write buffer went back: the read below reuses it
        for i in (2, 1, 0):
            assert torch.equal(stash.get(i), h)
        stash.clear()
        assert stash.buffers.allocations == 3, step
    assert stash.buffers.high_water_bytes == stash.buffers.held_bytes == 3 * padded(120)


def _schedules() -> dict[str, Schedule]:
    P = LayerPlan
    return {"every-layer-cpu": fixed_schedule(4, 1, "cpu", 2),
            "mixed-tiers-retain": Schedule("milp", [P(True, "cpu"), P(False), P(True, "nvme"), P(False, retain=True)],
                                           prefetch_depth=2),
            "one-segment-nvme": fixed_schedule(4, 4, "nvme", 3)}


@pytest.mark.parametrize("sched_name", list(_schedules()))
def test_executor_two_steps_reuse_buffers_and_stay_exact(sched_name, tmp_path):
    model = load_model("qwen3-tiny", "float32", seed=1)
    ids, mask, labels = random_batch(model.config.vocab_size)
    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    ex = StreamingExecutor(model, LazyTrainConfig(loss_chunk_tokens=7, nvme_dir=str(tmp_path)), "cpu",
                           _schedules()[sched_name])
    counts = []
    for _ in range(2):
        ex.zero_grad()
        loss = ex.forward_backward(ids, labels, mask)
        counts.append((ex.stash.buffers.allocations, ex.stash.buffers.held_bytes))
        assert rel_err(loss, out.loss.detach()) < 1e-6
        for name, p in model.named_parameters():
            assert rel_err(ex.grad_source(p), dict(ref.named_parameters())[name].grad) < 1e-5, name
    assert counts[0] == counts[1] and counts[0][0] > 0  # the second step allocated nothing
    assert ex.stash.buffers.in_use_bytes == 0
    assert not list(tmp_path.iterdir())


def _arena_run(schedule):
    """A tiny model on a CPU executor whose optimizer takes its states from the executor's arena."""
    model = load_model("qwen3-tiny", "float32", seed=2)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=3)
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu", schedule)
    opt = Hybrid8bitOptimizer(model.parameters(), lr=1e-3, block_size=64)
    opt.set_state_allocator(ex.state_alloc)
    opt.set_grad_source(ex.grad_source)
    return model, (ids, labels, mask), ex, opt


def test_pinned_bytes_parts_add_up_on_cpu():
    model, (ids, labels, mask), ex, opt = _arena_run(fixed_schedule(4, 1, "cpu", 2))
    before = ex.pinned_bytes
    assert before["activations"] == before["optimizer_states"] == 0
    for _ in range(2):
        ex.zero_grad()
        ex.forward_backward(ids, labels, mask)
        opt.step()
    pb = ex.pinned_bytes
    assert pb["planned"] == sum(pb[k] for k in PARTS)
    assert pb["store"] == ex.store.param_bytes + ex.store.grad_bytes
    assert pb["optimizer_states"] == ex.state_arena.used_bytes > 0
    assert pb["grad_staging"] == 0  # the CPU path adds into the host buffers directly
    boundary = ids.numel() * model.config.hidden_size * 4
    assert pb["activations"] == 4 * padded(boundary)  # every layer's input on the CPU tier, all alive at once
    assert pb["registered"] == pb["host_allocator"] == 0  # nothing is page-locked on a CPU run
    ex.close()


def test_every_in_place_registration_owns_its_pages(monkeypatch):
    """cudaHostRegister locks whole pages: two registrations sharing a page fail (cudaErrorHostMemoryAlreadyRegistered,
    which then resurfaces at the next kernel launch: every GPU test after it failed on the H200). Every buffer the
    store, the state arena and the activation pool register must start on a page and own its pages."""
    seen: list[torch.Tensor] = []

    def pin(t):
        seen.append(t)
        return t, True

    monkeypatch.setattr(host_store, "pin_tensor", pin)
    model = load_model("qwen3.5-tiny", "float32", seed=4)  # mixed layer structures, several dtypes' buffers
    store = host_store.HostParamStore(model.model.layers, pin=True)
    arena = host_store.PinnedArena(pin=True, chunk_bytes=3000)  # chunk smaller than a page: many small chunks
    for n in (1, 7, 700, 5000):
        arena.alloc((n,), torch.float32)
        arena.alloc((n,), torch.uint8)
    pool = HostBufferPool(pin=True)
    for n in (1, 511, 4097):
        pool.acquire(n)
    assert len(seen) > 10
    pages: set[int] = set()
    for t in seen:
        start, nbytes = t.data_ptr(), t.numel() * t.element_size()
        assert start % ALIGN == 0
        own = set(range(start // ALIGN, (start + nbytes - 1) // ALIGN + 1))
        assert not own & pages, "two registrations share a page"
        pages |= own
    store.release()
    arena.release()


@pytest.mark.parametrize("rc", [0, 712])
def test_pin_tensor_registers_only_page_exclusive_memory_and_checks_the_return_code(monkeypatch, rc):
    """A tensor that may share its pages is copied, never registered; an aligned one is registered and counts as
    locked exactly when cudaHostRegister returns 0; a failed registration clears CUDA's last error and falls back to an aligned pinned copy."""
    from lazytrain_hf.streaming import nvme

    registers, copies, cleared = [], [], []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the CUDA runtime's name
            registers.append(ptr)
            return rc

    monkeypatch.setattr(torch.cuda, "cudart", FakeCudart)
    monkeypatch.setattr(host_store, "aligned_empty", lambda n, pin=False: copies.append(pin) or nvme.aligned_empty(n))
    monkeypatch.setattr(host_store, "_clear_cuda_error", lambda: cleared.append(1))
    t = torch.arange(101, dtype=torch.float32)[1:]
    assert t.data_ptr() % ALIGN
    out, in_place = host_store.pin_tensor(t)
    assert not in_place and not registers and copies == [True] and torch.equal(out, t)
    assert out.data_ptr() % ALIGN == 0
    page = host_store.page_exclusive_empty(100, torch.float32).copy_(t)
    copies.clear()
    out, in_place = host_store.pin_tensor(page)
    assert registers == [page.data_ptr()]
    if rc == 0:
        assert in_place and out is page and not copies and not cleared
    else:
        assert not in_place and copies == [True] and cleared == [1] and torch.equal(out, t)


def test_optimizer_checkpoint_is_compact_with_arena_states(tmp_path):
    """States carved from the executor's 512 MiB arena chunks are views; torch.save writes a view's whole storage, so
    a tiny model's optimizer.pt was 1.15 GB. The state dict copies them out compactly and still loads back."""
    _, (ids, labels, mask), ex, opt = _arena_run(fixed_schedule(4, 1, "gpu", 1))
    ex.zero_grad()
    ex.forward_backward(ids, labels, mask)
    opt.step()
    states = sum(opt.state_bytes().values())
    assert ex.state_arena.reserved_bytes > 100 * states  # the arena's chunks dwarf a tiny model's states
    path = tmp_path / "optimizer.pt"
    torch.save(opt.state_dict(), path)
    assert path.stat().st_size < 2 * states + 2**20
    before = {k: v.clone() for k, v in opt.state[next(iter(opt.state))].items() if torch.is_tensor(v)}
    opt.load_state_dict(torch.load(path, weights_only=True))
    after = opt.state[next(iter(opt.state))]
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    ex.close()


def test_arena_reserve_makes_one_exact_chunk():
    arena = host_store.PinnedArena(pin=False, chunk_bytes=4096)
    shapes = [(100,), (7, 3), (1000,), (64,)]
    total = sum(arena.footprint(s, torch.bfloat16) for s in shapes)
    assert total == 128 + 32 + 1024 + 64  # each rounded up to 64 bytes (32 bf16 elements)
    arena.reserve({torch.bfloat16: total, torch.uint8: 0})
    out = [arena.alloc(s, torch.bfloat16) for s in reversed(shapes)]  # any order fills it
    assert len(arena.chunks()) == 1 and arena.reserved_bytes == 2 * total
    assert arena.used_bytes == 2 * sum(t.numel() for t in out)
    arena.alloc((5,), torch.bfloat16)  # beyond the reservation: an ordinary chunk
    assert len(arena.chunks()) == 2 and arena.reserved_bytes == 2 * total + 4096


@pytest.mark.parametrize("master", ["kahan", "fp32"])
def test_state_specs_are_what_the_first_step_allocates(master):
    model = load_model("qwen3-tiny", "bfloat16", seed=2)
    opt = Hybrid8bitOptimizer(model.parameters(), lr=1e-3, block_size=64, min_8bit_size=300, master_weights=master)
    specs = opt.state_specs()
    kinds = {(dt, len(shape)) for _, shape, dt in specs}  # 8-bit codes, absmax, fp32 moments, master / Kahan
    assert {torch.uint8, torch.float32} <= {dt for dt, _ in kinds}
    assert (torch.bfloat16 if master == "kahan" else torch.float32) in {dt for dt, _ in kinds}
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    got = [(p, tuple(v.shape), v.dtype) for p in model.parameters() for v in opt.state[p].values() if torch.is_tensor(v)]
    assert sorted((id(p), s, str(d)) for p, s, d in got) == sorted((id(p), s, str(d)) for p, s, d in specs)
    assert opt.state_specs() == []  # every parameter has its states now


def test_reserved_states_lock_exactly_what_they_use():
    """Locked <= 1.05x planned. The arena's 512 MiB chunks locked 2.5 GiB beyond the states at Qwen2.5-7B
    (tails the large tensors do not fit, and each dtype's last chunk); `reserve_states` sizes one chunk per dtype to
    the optimizer's states of the streamed layers, so the arena reserves what it hands out (plus 64-byte rounding)."""
    _, (ids, labels, mask), ex, opt = _arena_run(fixed_schedule(4, 1, "gpu", 1))
    reserved = ex.reserve_states(opt)
    streamed = [(s, dt) for p, s, dt in opt.state_specs() if ex.is_streamed(p)]
    assert reserved == sum(host_store.PinnedArena.footprint(s, dt) * dt.itemsize for s, dt in streamed)
    for _ in range(2):
        ex.zero_grad()
        ex.forward_backward(ids, labels, mask)
        opt.step()
    arena = ex.state_arena
    assert arena.reserved_bytes == reserved and len(arena.chunks()) == len({dt for _, dt in streamed})
    assert arena.used_bytes <= arena.reserved_bytes <= arena.used_bytes + 64 * len(streamed)
    ex.close()
    # a sharded rank reserves its own layers' states only
    _, _, ex2, opt2 = _arena_run(fixed_schedule(4, 1, "gpu", 1))
    ex2.shard = type("Shard", (), {"owned": {0}})()
    layer0 = sum(host_store.PinnedArena.footprint(s, dt) * dt.itemsize for p, s, dt in opt2.state_specs()
                 if ex2.is_streamed(p) and ex2._param_specs[id(p)][0] == 0)
    assert ex2.reserve_states(opt2) == layer0 > 0
    ex2.shard = None
    ex2.close()


def test_a_resume_reserves_for_the_saved_layout():
    """A resume keeps the saved layout (here Kahan buffers, while this run asks for fp32 master weights): the load
    re-reserves for the states it restores, so nothing is reserved for the layout this run asked for (an fp32
    chunk for 7B master weights would have locked ~26 GiB for a few hundred MB of absmax)."""
    _, (ids, labels, mask), ex, opt = _arena_run(fixed_schedule(4, 1, "gpu", 1))
    ex.reserve_states(opt)
    ex.zero_grad()
    ex.forward_backward(ids, labels, mask)
    opt.step()
    saved = opt.state_dict()
    ex.close()
    model, _, ex2, _ = _arena_run(fixed_schedule(4, 1, "gpu", 1))
    model.to(torch.bfloat16)  # bf16 params: "fp32" master weights asked for, the saved states have none
    opt2 = Hybrid8bitOptimizer(model.parameters(), lr=1e-3, block_size=64, master_weights="fp32")
    opt2.set_state_allocator(ex2.state_alloc)
    asked = ex2.reserve_states(opt2)
    opt2.load_state_dict(saved)
    arena = ex2.state_arena
    streamed = [(s, dt) for p, s, dt in opt2.state_specs(saved) if ex2.is_streamed(p)]
    assert arena.used_bytes == sum(math.prod(s) * dt.itemsize for s, dt in streamed) > 0
    assert arena.used_bytes <= arena.reserved_bytes <= arena.used_bytes + 64 * len(streamed) < asked
    assert not arena._next  # every reservation taken
    ex2.close()


def test_state_specs_of_a_state_dict_cover_parameters_it_holds_no_state_for():
    """accelerate reloads a fresh optimizer's own empty state when it wraps it: the specs of that load are this
    run's layout (not nothing), so the executor's reservation survives it."""
    _, _, ex, opt = _arena_run(fixed_schedule(4, 1, "gpu", 1))
    assert opt.state_specs(opt.state_dict()) == opt.state_specs() != []
    reserved = ex.reserve_states(opt)
    opt.load_state_dict(opt.state_dict())  # what AcceleratedOptimizer.__init__ does
    assert sum(n * dt.itemsize for dt, n in ex.state_arena._next.items()) == reserved
    ex.close()


@pytest.mark.parametrize("placement", ["host", "host_embedding"])
def test_host_resident_parts_counted_exact_and_states_pageable(placement, monkeypatch):
    """A host-placed embedding / LM head: its weights, gradient buffers and the lookup's [B, T, H] staging buffer
    are the "resident" part at their exact sizes (registered in place when pinning: here a stand-in registers
    them), and its optimizer states come from no pinned allocation (the caching host allocator rounds to powers of
    two)."""
    registered = []
    monkeypatch.setattr(host_store, "pin_tensor", lambda t: (registered.append(t.numel() * t.element_size()) or t, True))
    model = load_model("qwen3-tiny-untied", "float32", seed=2)
    ids, mask, labels = random_batch(model.config.vocab_size, seed=3)
    sched = fixed_schedule(model.config.num_hidden_layers, 2)
    sched.resident = placement
    ex = StreamingExecutor(model, LazyTrainConfig(), "cpu", sched)
    ex.resident.pin = True  # page-locking as a CUDA run does, through the stand-in
    ex.resident.apply("gpu")
    assert ex.pinned_bytes["resident"] == 0  # moved back out of the host pages
    ex.resident.apply(placement)
    pinned_empty = []
    real_empty = torch.empty

    def empty(*a, **kw):
        if kw.get("pin_memory"):
            pinned_empty.append(a)
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    opt = Hybrid8bitOptimizer(model.parameters(), lr=1e-3, block_size=64)
    opt.set_state_allocator(ex.state_alloc)
    opt.set_grad_source(ex.grad_source)
    ex.forward_backward(ids, labels, mask)
    opt.step()
    host = ex.resident.host_parameters()
    emb = model.get_input_embeddings().weight
    want = sum(2 * p.numel() * p.element_size() for p in host) + ids.numel() * emb.shape[1] * emb.element_size()
    assert host and ex.pinned_bytes["resident"] == want == ex.resident._reg.bytes
    assert sum(registered) >= want
    assert all(opt.state[p]["exp_avg"].device.type == "cpu" for p in host if "exp_avg" in opt.state[p])
    assert not pinned_empty
    ex.close()
