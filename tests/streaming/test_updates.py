"""LayerUpdater with a recording fake optimizer: layer-0-first deferral on the worker, wait, device layers,
ownership, host_writes counting and error propagation."""

from __future__ import annotations

import threading

import pytest
import torch

from lazytrain_hf.streaming.updates import LayerUpdater


class _FakeOptimizer:
    """Records `step_deferred` per layer (found by parameter identity); `gate[i]` blocks layer i's update."""

    def __init__(self, layer_params: list[list[torch.Tensor]]) -> None:
        self.layer_of = {id(p): i for i, ps in enumerate(layer_params) for p in ps}
        self.calls: list[tuple[int, object, str]] = []
        self.gate: dict[int, threading.Event] = {}
        self.fail: int | None = None
        self.deferred = None
        self.on_step = None

    def set_deferred(self, params, on_step=None):
        self.deferred, self.on_step = params, on_step

    def step_deferred(self, params, snapshot):
        i = self.layer_of[id(params[0])]
        if i in self.gate:
            assert self.gate[i].wait(10)
        if i == self.fail:
            raise ValueError("boom")
        for p in params:
            p.add_(1.0)  # the host weights this update writes
        self.calls.append((i, snapshot, threading.current_thread().name))


def _updater(n: int = 4, **kw):
    params = [[torch.zeros(3), torch.zeros(2)] for _ in range(n)]
    opt = _FakeOptimizer(params)
    return params, opt, LayerUpdater(opt, params, **kw)


def test_registers_every_layer_parameter_and_detaches():
    params, opt, up = _updater()
    assert [id(p) for p in opt.deferred] == [id(p) for ps in params for p in ps]
    up.detach()
    assert opt.deferred is None


def test_step_runs_every_layer_on_the_worker_layer_0_first():
    params, opt, up = _updater()
    snap = {"lr": 0.1}
    opt.on_step(snap)
    up.wait_all()
    assert [c[0] for c in opt.calls] == [0, 1, 2, 3]
    assert all(c[1] is snap and c[2] == "lazytrain-updates" for c in opt.calls)
    assert up.host_writes == [1, 1, 1, 1]
    assert all(torch.equal(p, torch.ones_like(p)) for ps in params for p in ps)
    assert up.last_run_params == 4 * 5
    assert not any(up.is_pending(i) for i in range(4))


def test_wait_blocks_until_the_layer_is_updated():
    params, opt, up = _updater(n=3)
    opt.gate[1] = threading.Event()
    opt.on_step({})
    up.wait(0)
    assert torch.equal(params[0][0], torch.ones(3))
    assert up.cpu_pending(1) and up.is_pending(1) and up.is_pending(2)
    assert torch.equal(params[1][0], torch.zeros(3))
    assert up.host_writes == [1, 1, 1]  # counted when the step starts, before the worker writes
    opt.gate[1].set()
    up.wait(2)
    assert not up.cpu_pending(1) and torch.equal(params[2][0], torch.ones(3))
    up.wait_all()


def test_device_layers_wait_for_their_load_then_fall_back_to_the_cpu():
    params, opt, up = _updater()
    up.set_device_layers({1, 3})
    snap = {"step": 1}
    opt.on_step(snap)
    up.wait(2)
    assert [c[0] for c in opt.calls] == [0, 2]
    assert up.take_device(1) is snap and up.take_device(0) is None
    assert up.is_pending(1) and not up.cpu_pending(1)  # its host gradient stays readable
    assert up.host_writes == [1, 0, 1, 0]  # a GPU-side update is not a host write
    up.device_done(1)
    assert not up.is_pending(1)
    up.wait_all()  # layer 3 was never loaded: applied on the CPU, in the training thread
    assert [c[0] for c in opt.calls] == [0, 2, 3]
    assert opt.calls[-1][1] is snap and opt.calls[-1][2] == threading.current_thread().name
    assert up.host_writes == [1, 0, 1, 1]
    assert up.device_pending == {}


def test_changing_device_layers_keeps_pending_updates_where_their_step_put_them():
    """A new device set applies from the next step: layer 0 (GPU-updated when its step started) keeps its snapshot
    for its next load, layer 1's CPU update runs in the worker while the training thread goes on (no wait), and the
    next step updates layer 0 on the CPU and defers layer 1 to its load. With prepared moments the set change
    waits for every update first (the prepared layers follow the set)."""
    params, opt, up = _updater(n=2)
    up.set_device_layers({0})
    opt.gate[1] = threading.Event()  # layer 1's CPU update blocks until released
    snap = {"s": 1}
    opt.on_step(snap)
    up.set_device_layers({0})  # unchanged: stays pending
    up.set_device_layers({1})  # returns while layer 1's update is still running
    assert up.cpu_pending(1) and up.take_device(0) is snap and up.device_layers == {1}
    opt.gate[1].set()
    up.wait(1)
    up.device_done(0)  # the executor ran it at the layer's load
    opt.on_step({"s": 2})
    up.wait_all()
    # layer 0's first update ran on the "GPU" (device_done); wait_all applied layer 1's deferred one on the CPU
    assert [(c[0], c[1]["s"]) for c in opt.calls] == [(1, 1), (0, 2), (1, 2)] and up.take_device(1) is None
    params, opt, up = _updater(n=2)
    opt.prepare_states = lambda params, threads=None, stop=None: 0  # (the fake prepares nothing)
    up.set_device_layers({0})
    up.set_prepare(1 << 20)
    opt.on_step({})
    up.set_device_layers({1})
    assert up.take_device(0) is None and sorted(c[0] for c in opt.calls) == [0, 1]


def test_owned_layers_only_and_on_step_first():
    events = []
    params = [[torch.zeros(2)] for _ in range(4)]
    opt = _FakeOptimizer(params)
    up = LayerUpdater(opt, params, owned={1, 3}, on_step=lambda: events.append(len(opt.calls)))
    opt.on_step({})
    up.wait_all()
    assert events == [0]
    assert [c[0] for c in opt.calls] == [1, 3]
    assert up.host_writes == [0, 1, 0, 1]


def test_a_second_step_waits_for_the_first():
    params, opt, up = _updater(n=2)
    opt.on_step({"s": 1})
    opt.on_step({"s": 2})
    up.wait_all()
    assert [(c[0], c[1]["s"]) for c in opt.calls] == [(0, 1), (1, 1), (0, 2), (1, 2)]
    assert up.host_writes == [2, 2]


def test_worker_error_surfaces_in_wait():
    params, opt, up = _updater(n=3)
    opt.fail = 1
    opt.on_step({})
    with pytest.raises(RuntimeError, match="deferred optimizer update failed") as info:
        up.wait(2)
    assert isinstance(info.value.__cause__, ValueError)
    up.wait_all()  # the error is reported once
