"""GradSink on the CPU: push into the host buffers, fp32 accumulation across micro-batches, the squared norm,
kept gradients (materialize / drop / drop_stale), zero, and the data-parallel reductions with a fake group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lazytrain_hf.streaming.grads import GradSink
from lazytrain_hf.streaming.host_store import HostParamStore
from lazytrain_hf.streaming.shard import ShardedUpdates
from lazytrain_hf.streaming.weights import WeightStreamer

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _setup(n: int = 3, dtype: torch.dtype = BF16, grad_dtype: str = "fp32", dp=None, shard=None):
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 4).to(dtype) for _ in range(n)])
    store = HostParamStore(layers, grad_dtype=grad_dtype)
    ws = WeightStreamer(layers, store, [("a",)] * n, CPU, 1)
    return store, ws.slots[0], GradSink(store, CPU, dp=dp, shard=shard)


def _fill(slot, seed: int) -> torch.Tensor:
    """Random gradients into the slot's flat buffer; a copy of them."""
    g = torch.Generator().manual_seed(seed)
    (buf,) = slot.grads.values()
    buf.copy_(torch.randn(buf.numel(), generator=g))
    return buf.clone()


def _sq(*ts: torch.Tensor) -> torch.Tensor:
    return sum(t.double().square().sum() for t in ts)


def test_push_converts_then_accumulates_in_fp32():
    store, slot, sink = _setup()
    host = store.buffers[1].grads[BF16]
    assert host.dtype == torch.float32
    assert not sink.has_grad(1)
    sink.begin_microbatch()
    g1 = _fill(slot, 1)
    sink.push(slot, 1)
    sink.flush()
    assert sink.has_grad(1) and not sink.has_grad(0)
    assert torch.equal(host, g1.float())
    assert sink.norm_from_device
    torch.testing.assert_close(sink.sq, _sq(g1), rtol=1e-6, atol=0)  # reduced in fp32
    sink.begin_microbatch()
    g2 = _fill(slot, 2)
    sink.push(slot, 1)
    sink.flush()
    assert torch.equal(host, g1.float() + g2.float())  # fp32 sum, not a bf16 one
    assert not torch.equal(host, (g1 + g2).float())
    assert not sink.norm_from_device
    torch.testing.assert_close(sink.sq, _sq(g1, g2), rtol=1e-6, atol=0)  # reduced in fp32
    assert sink.d2h_bytes == 2 * g1.numel() * g1.element_size()


def test_param_dtype_host_grads():
    store, slot, sink = _setup(grad_dtype="param")
    sink.begin_microbatch()
    g = _fill(slot, 3)
    sink.push(slot, 0)
    sink.flush()
    assert store.buffers[0].grads[BF16].dtype == BF16
    assert torch.equal(store.buffers[0].grads[BF16], g)


def test_zero_starts_a_new_window_and_the_first_push_overwrites():
    store, slot, sink = _setup()
    sink.begin_microbatch()
    _fill(slot, 1)
    sink.push(slot, 0)
    sink.zero()
    assert not sink.has_grad(0)
    assert sink.sq.item() == 0.0 and sink.microbatches == 0
    sink.begin_microbatch()
    g = _fill(slot, 2)
    sink.push(slot, 0)
    sink.flush()
    assert torch.equal(store.buffers[0].grads[BF16], g.float())  # overwritten, no memset needed
    torch.testing.assert_close(sink.sq, _sq(g), rtol=1e-6, atol=0)  # reduced in fp32


def test_prepare_zeroes_the_slot_grads():
    store, slot, sink = _setup()
    _fill(slot, 1)
    sink.prepare(slot)
    assert all(torch.count_nonzero(g) == 0 for g in slot.grads.values())


def _kept_setup():
    store, slot, sink = _setup()
    sink.keep_layers = {0, 1}
    sink.begin_microbatch()
    for b in store.buffers:
        b.grads[BF16].fill_(float("nan"))  # anything read from here before `materialize` would show
    return store, slot, sink


def test_kept_gradient_stays_off_the_host_until_materialized():
    store, slot, sink = _kept_setup()
    g = _fill(slot, 1)
    sink.push(slot, 0)
    _fill(slot, 9)  # the slot's buffers are reused for the next layer: the kept copy must not follow
    sink.flush()
    assert sink.is_kept(0) and sink.has_grad(0)
    assert torch.isnan(store.buffers[0].grads[BF16]).all()
    assert sink.d2h_bytes == 0
    assert sink.kept_bytes == g.numel() * g.element_size()
    spec = store.buffers[0].specs[0]
    view = sink.kept_view(0, BF16, spec.offset, spec.numel, torch.Size(spec.shape))
    assert torch.equal(view, g[spec.offset:spec.offset + spec.numel].view(spec.shape))
    torch.testing.assert_close(sink.sq, _sq(g), rtol=1e-6, atol=0)  # reduced in fp32
    sink.materialize(0)
    assert not sink.is_kept(0) and sink.kept_bytes == 0
    assert torch.equal(store.buffers[0].grads[BF16], g.float())
    sink.materialize(0)  # no-op once materialized
    assert torch.equal(store.buffers[0].grads[BF16], g.float())


def test_drop_and_drop_stale_forget_without_writing_the_host():
    store, slot, sink = _kept_setup()
    for layer in (0, 1):
        _fill(slot, layer)
        sink.push(slot, layer)
    sink.drop(0)
    assert not sink.is_kept(0) and sink.is_kept(1)
    sink.drop_stale({1})
    assert sink.is_kept(1)
    sink.drop_stale(set())
    assert not sink.is_kept(1) and sink.kept_bytes == 0
    assert torch.isnan(store.buffers[0].grads[BF16]).all() and torch.isnan(store.buffers[1].grads[BF16]).all()


def test_second_microbatch_materializes_then_accumulates():
    store, slot, sink = _kept_setup()
    g1 = _fill(slot, 1)
    sink.push(slot, 0)
    sink.begin_microbatch()  # accumulation: the kept gradient goes to the host first
    assert not sink.is_kept(0)
    assert torch.equal(store.buffers[0].grads[BF16], g1.float())
    g2 = _fill(slot, 2)
    sink.push(slot, 0)
    sink.flush()
    assert not sink.is_kept(0)
    assert torch.equal(store.buffers[0].grads[BF16], g1.float() + g2.float())


def test_not_kept_after_the_first_microbatch_or_outside_keep_layers():
    store, slot, sink = _kept_setup()
    sink.keep_layers = {1}
    g = _fill(slot, 1)
    sink.push(slot, 0)
    sink.flush()
    assert not sink.is_kept(0)
    assert torch.equal(store.buffers[0].grads[BF16], g.float())


class _FakeDP:
    """A two-rank group seen from `rank`: the other rank contributes `other` times this rank's gradient."""

    def __init__(self, rank: int, other: float = 2.0) -> None:
        self.rank, self.world, self.other, self.async_device = rank, 2, other, False
        self.calls: list[tuple] = []

    def all_reduce_(self, tensors):
        self.calls.append(("all_reduce",))
        for t in tensors:
            t.mul_(1 + self.other)

    def reduce_(self, tensors, dst):
        self.calls.append(("reduce", dst))
        if dst == self.rank:
            for t in tensors:
                t.mul_(1 + self.other)


def test_data_parallel_sums_before_the_host_copy_and_the_norm():
    dp = _FakeDP(0)
    store, slot, sink = _setup(dp=dp)
    sink.begin_microbatch()
    g = _fill(slot, 1)
    sink.push(slot, 2)
    sink.flush()
    assert dp.calls == [("all_reduce",)]
    assert torch.equal(store.buffers[2].grads[BF16], (g * 3).float())
    torch.testing.assert_close(sink.sq, _sq(g * 3), rtol=1e-6, atol=0)  # reduced in fp32


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_reduces_to_the_owner_only(rank):
    dp = _FakeDP(rank)
    shard = ShardedUpdates(dp, 3)
    store, slot, sink = _setup(dp=dp, shard=shard)
    before = {i: store.buffers[i].grads[BF16].clone() for i in range(3)}
    sink.begin_microbatch()
    pushed = {}
    for layer in range(3):
        pushed[layer] = _fill(slot, layer)
        sink.push(slot, layer)
    sink.flush()
    assert dp.calls == [("reduce", layer % 2) for layer in range(3)]
    mine = [i for i in range(3) if i % 2 == rank]
    for layer in range(3):
        host = store.buffers[layer].grads[BF16]
        if layer in mine:
            assert sink.has_grad(layer) and torch.equal(host, (pushed[layer] * 3).float())
        else:  # another rank's layer: no host copy, no gradient reported
            assert not sink.has_grad(layer) and torch.equal(host.view(torch.int32), before[layer].view(torch.int32))
    torch.testing.assert_close(sink.sq, _sq(*[pushed[i] * 3 for i in mine]), rtol=1e-6, atol=0)  # reduced in fp32
