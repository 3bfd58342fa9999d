"""Random feasible plans drawn from the planner's own options, for fuzzing the executor.

A plan is drawn by solving the model's real integer program (its options, ties between
layers that share a parameter, layout changes the executor cannot make) under a random
objective: random option times and random finite edge costs, with the same infinite
(forbidden) edges. The solver's answer is then a plan the planner could have returned,
chosen by chance; it is assembled with the real costs like any other plan. Whatever the
planner may offer, the executor must run, and its result must equal one process.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from planner.choices import layer_choices
from planner.ilp import solve
from planner.plan3d import one_d_plan
from planner.profiled import profiled_graph
from planner.plan import Plan


def random_plans(model, devices: str, inputs, count: int, seed: int,
                 optimizer: str = "sgd", kwargs: dict | None = None) -> list[Plan]:
    """`count` random feasible plans of `model` on `devices` (duplicates dropped);
    `kwargs`: its keyword inputs."""
    started = time.perf_counter()
    graph, cluster = profiled_graph(model, devices, inputs, kwargs, measure=False)
    choices = layer_choices(graph, cluster, optimizer, None)
    problem = choices.problem
    rng = np.random.default_rng(seed)
    plans, seen = [], set()
    for _ in range(count):
        nodes = tuple(replace(n, options=tuple(replace(o, time_s=float(rng.uniform(0, 1)))
                                               for o in n.options)) for n in problem.nodes)
        edges = tuple(replace(e, cost_s=np.where(np.isfinite(e.cost_s),
                                                 rng.uniform(0, 0.2, np.shape(e.cost_s)),
                                                 np.inf)) for e in problem.edges)
        drawn = solve(replace(problem, nodes=nodes, edges=edges), time_limit_s=30)
        if drawn.choice in seen:
            continue
        seen.add(drawn.choice)
        real = replace(drawn, objective_s=problem.cost_of(drawn.choice),
                       bound_s=problem.cost_of(drawn.choice))
        plans.append(one_d_plan(graph, cluster, optimizer, choices, real,
                                cluster.device.memory_bytes, None, None,
                                time.perf_counter() - started))
    return plans
