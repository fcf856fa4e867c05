"""WeightStreamer on the CPU: slots per layer structure, prefetch order, out-of-order errors, hooks, and slot reuse
through `host_version` (Note [slot reuse] in streaming/executor.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lazytrain_hf.streaming.host_store import HostParamStore
from lazytrain_hf.streaming.weights import WeightStreamer

CPU = torch.device("cpu")


def _layers(n: int = 4, mixed: bool = True) -> tuple[nn.ModuleList, list[tuple]]:
    """n layers; with `mixed`, odd layers have another structure (a bias-free projection) and key."""
    torch.manual_seed(0)
    layers, keys = [], []
    for i in range(n):
        odd = mixed and i % 2 == 1
        layers.append(nn.Linear(4, 3, bias=False) if odd else nn.Linear(4, 4))
        keys.append(("b",) if odd else ("a",))
    return nn.ModuleList(layers), keys


def _streamer(n: int = 4, depth: int = 1, mixed: bool = True):
    layers, keys = _layers(n, mixed)
    store = HostParamStore(layers)
    return layers, store, WeightStreamer(layers, store, keys, CPU, depth)


def _host_bytes(store: HostParamStore, layer: int) -> int:
    return sum(t.numel() * t.element_size() for t in store.buffers[layer].weights.values())


@pytest.mark.parametrize("depth", [1, 2])
def test_slots_per_structure_and_device_bytes(depth):
    layers, store, ws = _streamer(depth=depth)
    assert sorted(ws.pools) == [("a",), ("b",)]
    assert all(len(pool) == depth + 1 for pool in ws.pools.values())
    assert len(ws.slots) == 2 * (depth + 1)
    per_slot = {("a",): 2 * _host_bytes(store, 0), ("b",): 2 * _host_bytes(store, 1)}  # weights + grads
    assert ws.device_bytes == sum(per_slot[k] * (depth + 1) for k in per_slot)


def test_slot_parameters_and_grads_view_the_flat_buffers():
    layers, store, ws = _streamer()
    for slot in ws.slots:
        (w,) = slot.weights.values()
        (g,) = slot.grads.values()
        for p in slot.module.parameters():
            assert p.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
            assert p.grad.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
        assert slot.storage_ptrs == {w.untyped_storage().data_ptr()}
        assert slot.layer == -1


def test_acquire_loads_the_layer_weights():
    layers, store, ws = _streamer()
    x = torch.randn(5, 4)
    ws.begin(list(range(4)))
    for i in range(4):
        slot = ws.acquire(i)
        assert slot.layer == i
        for (name, p), (_, q) in zip(slot.module.named_parameters(), layers[i].named_parameters()):
            assert torch.equal(p, q), name
        torch.testing.assert_close(slot.module(x), layers[i](x), rtol=0, atol=0)
        ws.release(slot)
    assert ws.loads == 4
    assert ws.h2d_bytes == sum(_host_bytes(store, i) for i in range(4))


@pytest.mark.parametrize("depth, loads", [(1, [0, 1, 2, 3, 4, 2, 1, 0]), (2, [0, 1, 2, 3, 4, 1, 0])])
def test_forward_then_reverse_keeps_the_last_layers(depth, loads):
    # depth + 1 slots: the reverse pass finds the forward's last depth + 1 layers still loaded
    layers, store, ws = _streamer(n=5, depth=depth, mixed=False)
    loaded = []
    ws.before_load = loaded.append
    _pass(ws, [0, 1, 2, 3, 4, 4, 3, 2, 1, 0])
    assert loaded == loads
    assert ws.loads == len(loads)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_prefetch_runs_depth_ahead(depth):
    layers, store, ws = _streamer(n=6, depth=depth, mixed=False)
    loaded = []
    ws.before_load = loaded.append
    ws.begin(list(range(6)))
    assert loaded == list(range(depth))
    for i in range(6):
        ws.release(ws.acquire(i))
        assert loaded == list(range(min(i + depth + 1, 6)))


def test_prefetch_issues_one_ahead():
    layers, store, ws = _streamer(n=4, depth=1, mixed=False)
    loaded = []
    ws.before_load = loaded.append
    ws.begin([0, 1, 2, 3])
    assert loaded == [0]
    ws.acquire(0)
    assert loaded == [0, 1]
    ws.acquire(1)
    assert loaded == [0, 1, 2]
    ws.acquire(2)
    ws.acquire(3)
    assert loaded == [0, 1, 2, 3]


def test_repeated_layer_is_not_reloaded():
    layers, store, ws = _streamer(n=3, depth=1, mixed=False)
    loaded = []
    ws.before_load = loaded.append
    ws.begin([0, 1, 2, 2, 1, 0])
    for i in [0, 1, 2, 2, 1, 0]:
        ws.release(ws.acquire(i))
    # two slots: 2 is held through its repeat and 1 beside it; only 0 (evicted by 2's load) comes again
    assert loaded == [0, 1, 2, 0]


def test_acquire_out_of_order_raises():
    layers, store, ws = _streamer()
    ws.begin([0, 1, 2])
    with pytest.raises(RuntimeError, match="out of order"):
        ws.acquire(1)
    ws.acquire(0)
    ws.acquire(1)
    ws.acquire(2)
    with pytest.raises(RuntimeError, match="out of order"):
        ws.acquire(0)  # past the end of the sequence


def test_hooks_see_slot_and_layer():
    layers, store, ws = _streamer()
    after, before_compute = [], []
    ws.after_load = lambda slot, layer: after.append((slot.layer, layer, slot.weights[torch.float32].clone()))
    ws.before_compute = lambda slot, layer: before_compute.append((slot.layer, layer))
    ws.begin([0, 1])
    ws.acquire(0)
    ws.acquire(1)
    # after_load runs once the weights are copied, before the slot is marked as holding the layer
    assert [(a, b) for a, b, _ in after] == [(-1, 0), (-1, 1)]
    assert torch.equal(after[0][2], store.buffers[0].weights[torch.float32])
    assert before_compute == [(0, 0), (1, 1)]


def test_skip_h2d_leaves_the_slot_unwritten():
    layers, store, ws = _streamer(n=2, mixed=False)
    ws.skip_h2d = lambda layer: layer == 1
    for slot in ws.slots:
        slot.weights[torch.float32].fill_(7.0)
    ws.begin([0, 1])
    s0 = ws.acquire(0)
    s1 = ws.acquire(1)
    assert torch.equal(s0.weights[torch.float32], store.buffers[0].weights[torch.float32])
    assert torch.all(s1.weights[torch.float32] == 7.0)
    assert ws.h2d_bytes == _host_bytes(store, 0)
    assert ws.loads == 2


def _pass(ws, seq):
    """Run `seq`; the weights each access saw (fp32 buffer copies)."""
    ws.begin(seq)
    seen = []
    for i in seq:
        s = ws.acquire(i)
        seen.append(s.weights[torch.float32].clone())
        ws.release(s)
    return seen


def test_slot_reuse_by_host_version():
    layers, store, ws = _streamer(n=3, depth=1, mixed=False)
    version = [0, 0, 0]
    ws.host_version = lambda layer: version[layer]
    _pass(ws, [0, 1, 2, 2, 1, 0])  # ends with 1 and 0 in the two slots
    held = {s.layer for s in ws.slots}
    assert held == {0, 1}
    # host weights change behind the streamer's back without a version change for layer 0, with one for layer 1
    old0 = store.buffers[0].weights[torch.float32].clone()
    for i in (0, 1):
        store.buffers[i].weights[torch.float32].add_(1.0)
    version[1] += 1
    ws.invalidate()
    assert {s.held for s in ws.slots} == {0, -1}
    assert all(s.layer == -1 for s in ws.slots)
    bytes_before = ws.h2d_bytes
    seen = _pass(ws, [0, 1, 2])
    # layer 0: reused without a copy (still the old weights); layer 1 and 2: copied
    assert torch.equal(seen[0], old0)
    assert torch.equal(seen[1], store.buffers[1].weights[torch.float32])
    assert ws.h2d_bytes - bytes_before == _host_bytes(store, 1) + _host_bytes(store, 2)


def test_invalidate_without_host_version_reuses_nothing():
    layers, store, ws = _streamer(n=2, depth=1, mixed=False)
    _pass(ws, [0, 1])
    ws.host_version = lambda layer: None  # versions recorded as None at load: not tracked
    ws.invalidate()
    assert all(s.held == -1 and s.layer == -1 for s in ws.slots)
    before = ws.h2d_bytes
    _pass(ws, [0, 1])
    assert ws.h2d_bytes - before == _host_bytes(store, 0) + _host_bytes(store, 1)


def test_forget_drops_every_version():
    layers, store, ws = _streamer(n=2, depth=1, mixed=False)
    ws.host_version = lambda layer: 0
    _pass(ws, [0, 1])
    ws.forget()
    ws.invalidate()
    assert all(s.held == -1 for s in ws.slots)
    store.buffers[0].weights[torch.float32].mul_(2.0)
    seen = _pass(ws, [0, 1])
    assert torch.equal(seen[0], store.buffers[0].weights[torch.float32])
