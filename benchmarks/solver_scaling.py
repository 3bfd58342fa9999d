"""How the strategy ILP's solve time grows with the number of layers.

Random chains (seeded) of 100, 1,000 and 3,000 layers with 4 strategies each, a resharding
cost on every edge (zero where producer and consumer agree on the layout) and a memory
budget that binds. `--ablation` also solves each chain with one reduction switched off at a
time, and a "mixed" chain where half the layers have a single strategy and a third of the
edges cost nothing, as in real models (norms, activations, layouts that already agree).

    python benchmarks/solver_scaling.py [--ablation]
"""

from __future__ import annotations

import argparse

import numpy as np

from planner.ilp import REDUCTIONS, solve
from planner.problem import Edge, Node, Option, Problem


def random_chain(
    num_nodes: int,
    num_options: int = 4,
    seed: int = 0,
    mixed: bool = False,
    budget_fraction: float | None = 0.3,
) -> Problem:
    """Times 1-100 ms, memory 0.1-4 GB per option, resharding up to 50 ms between unlike
    layouts; the budget lets `budget_fraction` of the way from the smallest-memory plan
    to the largest (None: no budget)."""
    rng = np.random.default_rng(seed)
    nodes = []
    for n in range(num_nodes):
        k = 1 if mixed and rng.random() < 0.5 else num_options
        options = tuple(
            Option(f"s{i}", time_s=float(rng.uniform(1e-3, 1e-1)),
                   memory_bytes=float(rng.uniform(1e8, 4e9)))
            for i in range(k)
        )
        nodes.append(Node(f"layer{n}", options))
    edges = []
    for n in range(num_nodes - 1):
        a, b = len(nodes[n].options), len(nodes[n + 1].options)
        cost = rng.uniform(1e-4, 5e-2, size=(a, b))
        for i in range(min(a, b)):
            cost[i, i] = 0.0  # same layout on both sides: nothing to move
        if mixed and rng.random() < 1 / 3:
            cost[:] = 0.0
        edges.append(Edge(n, n + 1, cost))
    smallest = sum(min(o.memory_bytes for o in node.options) for node in nodes)
    largest = sum(max(o.memory_bytes for o in node.options) for node in nodes)
    if budget_fraction is None:
        return Problem(tuple(nodes), tuple(edges), None)
    budget = smallest + budget_fraction * (largest - smallest)
    return Problem(tuple(nodes), tuple(edges), budget)


def table(rows: list[dict]) -> str:
    header = ("nodes", "variables", "constraints", "seconds", "status", "objective", "bound")
    lines = ["  ".join(f"{h:>11}" for h in header)]
    for r in rows:
        lines.append(
            f"{r['nodes']:>11}  {r['variables']:>11}  {r['constraints']:>11}  "
            f"{r['seconds']:>11.3f}  {r['status']:>11}  "
            f"{r['objective']:>11.6f}  {r['bound']:>11.6f}"
        )
    return "\n".join(lines)


def run(problem: Problem, reductions=REDUCTIONS) -> dict:
    s = solve(problem, time_limit_s=60.0, reductions=reductions)
    return dict(nodes=len(problem.nodes), variables=s.num_variables,
                constraints=s.num_constraints, seconds=s.seconds, status=s.status,
                objective=s.objective_s, bound=s.bound_s, stats=s.stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ablation", action="store_true")
    args = parser.parse_args()

    sizes = (100, 1_000, 3_000)
    print("random chains, 4 strategies per layer, binding memory budget")
    print(table([run(random_chain(n, seed=n)) for n in sizes]))
    print("\nthe same chains without a memory budget")
    print(table([run(random_chain(n, seed=n, budget_fraction=None)) for n in sizes]))

    if args.ablation:
        variants = {"all reductions": REDUCTIONS, "none": frozenset()}
        variants |= {f"all but {name}": REDUCTIONS - {name} for name in sorted(REDUCTIONS)}
        for mixed in (False, True):
            print(f"\nablation, {'mixed' if mixed else 'plain'} chains (seconds / variables)")
            problems = {n: random_chain(n, seed=n, mixed=mixed) for n in sizes}
            print(f"{'':>34}" + "".join(f"{n:>20}" for n in sizes))
            for label, reductions in variants.items():
                cells = []
                for n in sizes:
                    r = run(problems[n], reductions)
                    cells.append(f"{r['seconds']:.3f}s/{r['variables']}")
                print(f"{label:>34}" + "".join(f"{c:>20}" for c in cells))


if __name__ == "__main__":
    main()
