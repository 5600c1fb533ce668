"""hyspec.gpu.graphs.StepGraphs on the CPU, with torch.cuda's graph API replaced by fakes:
a capture leaves the owner's state as it was, a key is captured once and replayed after,
and a failed capture warns once and runs every step eagerly from then on."""
import contextlib

import pytest
import torch

from hyspec.gpu.graphs import GraphFallbackWarning, StepGraphs


class FakeGraph:
    def __init__(self):
        self.body = None
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.body()


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream / graph calls as no-ops; a capture records the body it ran."""
    recording = {}

    class Stream:
        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(g):
        recording["graph"] = g
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    return recording


def test_capture_restores_state_and_replays(fake_cuda):
    state = torch.zeros(3)
    graphs = StepGraphs(True, torch.device("cpu"), lambda: [state])
    calls = []

    def body():
        calls.append(1)
        state.add_(1)

    graphs.ensure(("step",), body)
    assert state.tolist() == [0, 0, 0]  # warm-up and capture undone
    assert len(calls) == 2 and ("step",) in graphs.graphs
    fake_cuda["graph"].body = body  # what the graph would replay
    graphs.run(("step",), body)
    graphs.run(("step",), body)
    assert state.tolist() == [2, 2, 2] and graphs.graphs[("step",)].replays == 2 and graphs.active


def test_failed_capture_falls_back_once(fake_cuda, capsys):
    state = torch.zeros(2)
    graphs = StepGraphs(True, torch.device("cpu"), lambda: [state])
    captured = []

    def body():
        state.add_(1)
        if fake_cuda.get("graph") is not None and not captured:
            captured.append(1)
            raise RuntimeError("out of resource")

    with pytest.warns(GraphFallbackWarning, match="running eagerly from now on"):
        graphs.run(("step",), body)
    assert graphs.failed and not graphs.active and not graphs.graphs
    assert state.tolist() == [1, 1]  # state put back, then the step ran eagerly once
    assert "CUDA-graph capture of ('step',) failed" in capsys.readouterr().err
    graphs.run(("step",), body)  # eager, no second warning
    assert state.tolist() == [2, 2]


def test_disabled_runs_eagerly():
    state = torch.zeros(1)
    graphs = StepGraphs(False, torch.device("cpu"), lambda: [state])
    graphs.ensure(("step",), lambda: state.add_(1))
    graphs.run(("step",), lambda: state.add_(1))
    assert state.tolist() == [1] and not graphs.graphs
