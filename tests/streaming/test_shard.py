"""ShardedUpdates with a fake two-rank group: ownership, stale layers, the load-time broadcast and copy-back,
resolve, the optimizer-load filter and gathered states. The real collectives are in tests/hf/test_ddp.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lazytrain_hf.streaming.host_store import HostParamStore
from lazytrain_hf.streaming.shard import ShardedUpdates
from lazytrain_hf.streaming.weights import WeightStreamer

CPU = torch.device("cpu")


class _FakeDP:
    """Rank `rank` of `world`; a broadcast writes `source(src, i)` into the i-th tensor (the owner's values)."""

    def __init__(self, rank: int, world: int = 2) -> None:
        self.rank, self.world = rank, world
        self.log: list[tuple] = []
        self.objects: dict[int, list] = {}  # src -> what its broadcast_object_ delivers
        self.tensors: dict[int, list[torch.Tensor]] = {}  # src -> the values its broadcast_ delivers, in order

    @staticmethod
    def source(src: int, i: int, like: torch.Tensor) -> torch.Tensor:
        return torch.full_like(like, 10.0 * (src + 1) + i)

    def broadcast_device_(self, tensors, src):
        self.log.append(("device", src))
        if self.rank != src:
            for i, t in enumerate(tensors):
                t.copy_(self.source(src, i, t))

    def broadcast_(self, tensors, src=0):
        self.log.append(("host", src))
        if self.rank != src:
            queue = self.tensors.get(src)
            for i, t in enumerate(tensors):
                t.copy_(queue.pop(0) if queue else self.source(src, i, t))

    def broadcast_object_(self, objects, src):
        self.log.append(("object", src))
        if self.rank != src:
            objects[:] = self.objects[src]


def test_round_robin_ownership():
    for world in (2, 3):
        owned = [ShardedUpdates(_FakeDP(r, world), 7).owned for r in range(world)]
        assert owned == [{i for i in range(7) if i % world == r} for r in range(world)]
        assert set().union(*owned) == set(range(7))


@pytest.mark.parametrize("rank", [0, 1])
def test_receives_only_stale_foreign_layers(rank):
    sh = ShardedUpdates(_FakeDP(rank), 4)
    assert not any(sh.receives(i) for i in range(4))
    sh.mark_step()
    assert sh.stale == {0, 1, 2, 3}
    assert [sh.receives(i) for i in range(4)] == [i % 2 != rank for i in range(4)]


def _slot_and_store():
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
    store = HostParamStore(layers)
    ws = WeightStreamer(layers, store, [("a",)] * 2, CPU, 1)
    return store, ws.slots[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_after_load_broadcasts_stale_layers_and_copies_back_on_non_owners(rank):
    dp = _FakeDP(rank)
    sh = ShardedUpdates(dp, 2)
    store, slot = _slot_and_store()
    host = store.buffers[1].weights
    before = {dt: t.clone() for dt, t in host.items()}
    assert sh.after_load(slot, 1, host, None) is None and dp.log == [] and sh.broadcasts == 0  # not stale
    sh.mark_step()
    assert sh.after_load(slot, 1, host, None) is None
    assert dp.log == [("device", 1)] and sh.broadcasts == 1 and 1 not in sh.stale
    for i, (dt, t) in enumerate(host.items()):
        if rank == 1:  # the owner keeps its own host weights
            assert torch.equal(t, before[dt])
        else:  # the non-owner received the owner's slot and wrote it to its host store
            assert torch.equal(slot.weights[dt], dp.source(1, i, t))
            assert torch.equal(t, slot.weights[dt])
    sh.after_load(slot, 1, host, None)
    assert sh.broadcasts == 1  # once per step


def test_resolve_broadcasts_stale_layers_in_order_from_their_owners():
    dp = _FakeDP(0, world=3)
    sh = ShardedUpdates(dp, 5)
    store = HostParamStore(nn.ModuleList([nn.Linear(2, 2) for _ in range(5)]))
    sh.mark_step()
    sh.stale -= {2}
    sh.resolve(store)
    assert dp.log == [("host", 0), ("host", 1), ("host", 0), ("host", 1)]
    assert sh.stale == set()
    (w,) = store.buffers[4].weights.values()
    assert torch.equal(w, dp.source(1, 0, w))


def _optimizer(layer_params):
    opt = torch.optim.SGD([p for ps in layer_params for p in ps], lr=0.1, momentum=0.9)
    for ps in layer_params:
        for p in ps:
            p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_load_filter_keeps_only_owned_states():
    layer_params = [[nn.Parameter(torch.randn(2)), nn.Parameter(torch.randn(3))] for _ in range(3)]
    opt = _optimizer(layer_params)
    sd = opt.state_dict()
    sh = ShardedUpdates(_FakeDP(1), 3)
    out = sh.load_filter(layer_params)(opt, sd)
    assert sorted(out["state"]) == [2, 3]  # layer 1's two parameters
    assert out["param_groups"] == sd["param_groups"]
    assert len(sd["state"]) == 6  # the input is left as it was


def test_gathered_states_on_rank_0_holds_foreign_states_inside_the_block_only():
    layer_params = [[nn.Parameter(torch.randn(2))] for _ in range(2)]
    opt = _optimizer(layer_params)
    p1 = layer_params[1][0]
    owner_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p1].items()}
    opt.state.pop(p1)  # rank 0 does not own layer 1: no states of its own
    dp = _FakeDP(0)
    dp.objects[1] = [[{k: (tuple(v.shape), v.dtype) if torch.is_tensor(v) else v for k, v in owner_state.items()}]]
    dp.tensors[1] = [v for v in owner_state.values() if torch.is_tensor(v)]
    sh = ShardedUpdates(dp, 2)
    with sh.gathered_states(opt, layer_params):
        got = opt.state[p1]
        assert got.keys() == owner_state.keys()
        for k, v in owner_state.items():
            assert torch.equal(got[k], v) if torch.is_tensor(v) else got[k] == v
    assert p1 not in opt.state and layer_params[0][0] in opt.state
    assert dp.log == [("object", 1), ("host", 1)]
