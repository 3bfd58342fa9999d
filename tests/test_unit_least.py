"""planner.pipeline.unit_least: the exact min-sum of a unit's layers and edges, by brute force on
random instances, and the per-unit figure it gives the stage bounds: never above what any
assignment pays, never below the separate minima, with recomputed blocks whole."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from planner.pipeline.stages import LayerOptions, StageProblem
from planner.pipeline.unit_least import min_sum, unit_least_s
from test_pipeline_search import _random_problem


def _brute_min_sum(unary, pairs):
    return min(sum(unary[i][x[i]] for i in range(len(unary)))
               + sum(c[x[s], x[d]] for s, d, c in pairs)
               for x in itertools.product(*(range(len(a)) for a in unary)))


@pytest.mark.parametrize("seed", range(40))
def test_min_sum_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    unary = [rng.uniform(0, 1, int(rng.integers(1, 5))) for _ in range(n)]
    pairs = []
    for _ in range(int(rng.integers(0, 2 * n + 1))):
        s, d = (int(v) for v in rng.integers(0, n, 2))
        if s == d:
            continue
        c = rng.uniform(0, 1, (len(unary[s]), len(unary[d])))
        c[rng.random(c.shape) < 0.2] = np.inf  # barred pairs
        pairs.append((s, d, c))
    assert min_sum(unary, pairs) == pytest.approx(_brute_min_sum(unary, pairs), rel=1e-12)


def test_min_sum_gives_up_past_its_limit():
    unary = [np.zeros(4) for _ in range(4)]
    clique = [(s, d, np.ones((4, 4))) for s, d in itertools.combinations(range(4), 2)]
    assert min_sum(unary, clique, limit=4 ** 4) == pytest.approx(6.0)
    assert min_sum(unary, clique, limit=4 ** 3) is None


def _assignment_s(problem, choice):
    """Per unit: what `choice` pays, its layers' times and the edges into them."""
    out = np.zeros(len(problem.units))
    for i, layer in enumerate(problem.layers):
        out[layer.unit] += layer.microbatch_s[choice[i]]
    for e in problem.edges:
        out[problem.layers[e.dst].unit] += np.asarray(e.cost_s)[choice[e.src], choice[e.dst]]
    return out


def _choices(problem):
    return itertools.product(*(range(len(l.strategies)) for l in problem.layers))


@pytest.mark.parametrize("seed", range(12))
def test_between_the_separate_minima_and_every_assignment(seed):
    rng = np.random.default_rng(300 + seed)
    problem = _random_problem(rng, units=3, layers=6)
    joint = unit_least_s(problem)
    tables = problem.tables
    assert np.all(joint >= tables.layer_least_s + tables.edge_least_s - 1e-12)
    paid = np.array([_assignment_s(problem, c) for c in _choices(problem)])
    assert np.all(paid >= joint[None] - 1e-12)  # unit by unit, for every assignment
    # with one unit it is the exact least of the whole
    one = replace(problem, layers=tuple(replace(l, unit=0) for l in problem.layers),
                  units=("all",), cut_s=(0.0,))
    assert unit_least_s(one)[0] == pytest.approx(paid.sum(axis=1).min(), rel=1e-12)


def test_a_recomputed_block_is_priced_whole():
    """Two layers, each least recomputed for one and plain for the other: the separate
    minima take both leasts, the block cannot, and the joint least says so."""
    flags = np.array([False, True])
    a = LayerOptions("a", 0, ("s", "s+r"), np.array([1.0, 0.5]), np.zeros(2), np.ones(2),
                     np.ones(2), recomputed=flags)
    b = LayerOptions("b", 0, ("s", "s+r"), np.array([0.5, 1.0]), np.zeros(2), np.ones(2),
                     np.ones(2), recomputed=flags)
    problem = StageProblem((a, b), (), ("block",), (0.0,))
    assert problem.tables.layer_least_s[0] == pytest.approx(1.0)
    assert unit_least_s(problem)[0] == pytest.approx(1.5)
    assert problem.tables.unit_least_s[0] == pytest.approx(1.5)


def test_repeated_units_are_solved_once(monkeypatch):
    import planner.pipeline.unit_least as module

    calls = []
    real = module.min_sum
    monkeypatch.setattr(module, "min_sum", lambda *a, **k: calls.append(1) or real(*a, **k))
    layer = lambda i, u: LayerOptions(f"l{i}", u, ("x", "y"), np.array([1.0, 2.0]),
                                      np.zeros(2), np.ones(2), np.ones(2))
    layers = tuple(layer(2 * u + k, u) for u in range(8) for k in range(2))
    swap = np.array([[1.0, 0.5], [0.5, 1.0]])
    from planner.problem import Edge
    edges = tuple(Edge(i - 1, i, swap) for i in range(1, 16))
    problem = StageProblem(layers, edges, tuple(f"u{u}" for u in range(8)), (0.0,) * 8)
    joint = unit_least_s(problem)
    # a unit's least: both layers "x", 1 + 1 + 1 on the edge between them (or one "y":
    # 1 + 2 + 0.5); the edge into a later unit's first layer adds its least, 0.5
    assert joint == pytest.approx([3.0] + [3.5] * 7)
    assert len(calls) == 2  # the first unit (no edge in) and the seven alike
