"""FSDP2's "returned a view tensor" warning: silenced where the traced graph writes nothing
in place into the view, kept where it does (executor/view_outputs.py)."""

import warnings

import torch
from torch import nn

import executor
import planner
from distributed import run_ranks
from executor.view_outputs import (silence_safe_view_warnings, view_safety,
                                   written_in_place)
from profiler.trace import fx_trace


class Viewed(nn.Linear):
    """A Linear whose output is returned as a view (as Hugging Face's Conv1D does)."""

    def __init__(self):
        super().__init__(8, 8)

    def forward(self, x):
        return super().forward(x).view(x.shape[0], 2, 4)


class Model(nn.Module):
    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.first, self.second = Viewed(), nn.Linear(8, 4)

    def forward(self, x):
        y = self.first(x)
        if self.in_place:
            y.transpose(1, 2).mul_(2.0)  # through a view of the view
        else:
            y = y * 2.0
        return self.second(y.flatten(1))


def _graph(in_place: bool):
    return fx_trace(Model(in_place), leaf_modules=(Viewed,))


def test_in_place_writes_through_views_are_found():
    for in_place in (False, True):
        gm = _graph(in_place)
        node = next(n for n in gm.graph.nodes if n.op == "call_module" and n.target == "first")
        assert written_in_place(node, gm) == in_place
    relu = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    gm = torch.fx.symbolic_trace(relu)
    assert written_in_place(next(n for n in gm.graph.nodes if n.target == "0"), gm)
    # methods by name: in place ones end in "_" or are the in-place operators' dunders
    for method, in_place in (("add_", True), ("__iadd__", True), ("__setitem__", True),
                             ("add", False), ("__add__", False), ("__init__", False)):
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.call_method(method, (x, x))
        assert written_in_place(x, None) == in_place, method


def test_a_class_is_silenced_only_when_every_instance_is_safe():
    with warnings.catch_warnings():
        safe = view_safety(_graph(False), ["first"])
        assert silence_safe_view_warnings(safe) == {"Viewed"}
        assert silence_safe_view_warnings(view_safety(_graph(True), ["first"])) == set()
        # a pipeline's chunks on one rank: one unsafe instance keeps the class's warning
        assert silence_safe_view_warnings(view_safety(_graph(True), ["first"], safe)) == set()


def _view_warnings(rank, world, in_place, plan_json):
    plan = planner.Plan.from_json(plan_json)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = executor.parallelize(Model(in_place), plan, leaf_modules=(Viewed,))
        x, = executor.shard_batch(plan, (torch.randn(4, 8),))
        model(x)  # FSDP2 warns after forward (a backward through the in-place view may fail)
    return sum("returned a view tensor" in str(w.message) for w in caught)


def test_fsdp_warns_of_a_view_only_where_the_graph_writes_into_it():
    for in_place in (False, True):
        plan = planner.baseline(Model(in_place), "2xcpu", "fsdp", (torch.randn(4, 8),),
                                leaf_modules=(Viewed,), measure=False)
        assert any(l.strategy == "fsdp" and l.name == "first" for l in plan.layers)
        counts = run_ranks(_view_warnings, 2, in_place, plan.to_json())
        assert all((count > 0) == in_place for count in counts), (in_place, counts)
