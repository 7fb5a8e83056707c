"""The device-graph wrapper of the speculative worker's forwards on CUDA / NPU (device_graph.py),
run against its CPU emulation (`device_graph.Emulated`: a replay reads the captured inputs,
rewrites the captured outputs in place and runs no Python). The oracle is the function called
directly. A function shaped like the worker's forwards: tensor inputs that change every call, an
object read by identity (the plan), a list it appends deferred writes to, a dict it leaves streams
in. Broken variants (inputs not copied in, appends and sets not redone, outputs not cloned) are
caught. The worker's real forwards through it: tests/unit/test_spec_graphs.py."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang_dsv4_ascend import device_graph as dg


@dataclass
class Write:
    layer: int
    rows: torch.Tensor
    parts: dict


def forward(x, plan, pending, aux):
    y = x * plan.w + 1
    pending.append(Write(0, y * 3, {"gate": y - 1}))
    aux["streams"] = y[:, :1] * 2
    aux["layer_streams"] = {7: y + 7}
    return y.sum(0)


def _calls(fn, n=5, rows=4, seed=0):
    """n calls with fresh inputs -> every call's (output, pending, aux), kept as returned."""
    g = torch.Generator().manual_seed(seed)
    plan = SimpleNamespace(w=torch.randn(rows, 3, generator=g))
    out = []
    for _ in range(n):
        plan.w.copy_(torch.randn(rows, 3, generator=g))  # refreshed in place, as PlanBuffers does
        x, pending, aux = torch.randn(rows, 3, generator=g), [], {"layer_ids": (1, 2)}
        out.append((fn(x, plan, pending, aux), pending, aux))
    return out


def _same(a, b) -> bool:
    ta, tb = dg.flat(a), dg.flat(b)
    return len(ta) == len(tb) > 0 and all(torch.equal(x, y) for x, y in zip(ta, tb))


def test_replays_equal_the_function_and_redo_its_appends_and_sets():
    """Five calls of one signature: one capture, then replays whose output, appended writes and
    streams are the function's own for that call's inputs, each call's results intact after the
    later ones. A new shape is a new graph; the aux's layer ids are part of the signature, what a
    call leaves there is not."""
    want = _calls(forward)
    graphs = dg.DeviceGraphs(forward, dg.emulated_api())
    got = _calls(graphs)
    assert len(graphs.captured) == 1
    for (o, p, a), (wo, wp, wa) in zip(got, want):
        assert len(p) == 1 and set(a) == {"layer_ids", "streams", "layer_streams"}
        assert _same(o, wo) and _same(p, wp) and _same(a, wa)
    _calls(graphs, n=2, rows=6)
    assert len(graphs.captured) == 2
    g = torch.Generator().manual_seed(3)
    plan = SimpleNamespace(w=torch.randn(4, 3, generator=g))
    graphs(torch.randn(4, 3, generator=g), plan, [], {"layer_ids": (1, 2), "streams": torch.zeros(1)})
    assert len(graphs.captured) == 3  # another plan object: captured against it
    graphs(torch.randn(4, 3, generator=g), plan, [], {"layer_ids": (1, 2), "streams": torch.zeros(1)})
    assert len(graphs.captured) == 3


def test_only_appending_to_a_list_is_replayable():
    def pops(x, pending):
        pending.pop()
        return x + 1

    with pytest.raises(ValueError, match="only append"):
        dg.DeviceGraphs(pops, dg.emulated_api())(torch.zeros(2), [1])


@pytest.mark.parametrize("broken", ["inputs_not_copied", "effects_not_redone", "outputs_not_cloned"])
def test_broken_replays_are_caught(broken, monkeypatch):
    real_replay = dg.Captured.replay

    def replay(self, args):
        if broken == "inputs_not_copied":
            self.graph.replay()
            for i, kind, val in self.effects:
                (args[i].extend if kind == "list" else args[i].update)(dg._clone(val))
            return dg._clone(self.out)
        if broken == "effects_not_redone":
            self.effects = []
            return real_replay(self, args)
        self.graph.replay()
        for i, kind, val in self.effects:
            (args[i].extend if kind == "list" else args[i].update)(val)
        return self.out

    monkeypatch.setattr(dg.Captured, "replay", replay)
    want = _calls(forward)
    got = _calls(dg.DeviceGraphs(forward, dg.emulated_api()))
    assert not all(_same(g, w) for g, w in zip(got, want))


def test_the_device_apis_are_chosen_once_in_device_py(monkeypatch):
    """device.capture_graph: torch.compile on CPU, the wrapper over torch.cuda's graph API on CUDA
    (torch.npu's on NPU, the same calls); never run on either device here."""
    from sglang_dsv4_ascend import device

    monkeypatch.setattr(device, "device_family", lambda: "cuda")
    made = device.capture_graph(forward)
    assert isinstance(made, dg.DeviceGraphs) and "unverified" in device.graph_kind()
    monkeypatch.setattr(device, "device_family", lambda: "cpu")
    assert not isinstance(device.capture_graph(forward), dg.DeviceGraphs)
