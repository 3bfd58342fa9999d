"""A 1-D problem solved within memory as the step holds it: the solve every 1-D plan makes
(planner.optimize's, the "cp" baseline's per degree), and what a step needs at least
where nothing fits (PlanDoesNotFit's figure).
"""

from __future__ import annotations

from dataclasses import replace

from planner.choices import Choices
from planner.ilp import solve
from planner.pipeline.stage_held import peak_bytes
from planner.pipeline.stages import StageSolution
from planner.problem import Infeasible, Solution
from planner.profiled import GB, PlanDoesNotFit
from planner.ties import expand, merge_ties
from strategies.cluster import Cluster


def solve_within_memory(choices: Choices, budget: float, time_limit_s: float,
                         optimizer: str, cluster: Cluster, outputs=()
                         ) -> tuple[Solution, StageSolution, list[float]]:
    """The optimum whose memory, as the step holds it (planner.pipeline.stage_held.
    peak_bytes: the per-layer sum the integer program sees and what the step holds beside
    it), fits the budget, with it as the one stage and that peak (which one_d_plan reads
    rather than compute again). The second part depends on the assignment (DDP's buckets,
    the largest FSDP layer), so where a solution's exceeds what the program left, the
    program is solved again with the budget lowered by it: a plan never promises to fit
    what does not."""
    problem = choices.problem
    try:
        for _ in range(4):
            solution = solve(problem, time_limit_s)
            staged, peak = staged_peak(choices, solution, cluster, optimizer, outputs)
            if peak[0] <= budget:
                return solution, staged, peak
            held = peak[0] - problem.memory_of(solution.choice)
            problem = replace(problem, memory_budget_bytes=budget - held)
        raise Infeasible("the step's buffers leave no assignment within memory",
                         family="memory")
    except Infeasible as error:
        if error.family != "memory":
            raise
        need = least_need_bytes(choices, cluster, optimizer, outputs)
        raise PlanDoesNotFit(
            f"plan does not fit: needs at least {need / GB:.1f} GB on each of "
            f"{choices.context.ranks} devices, has {budget / GB:.1f} GB; add devices, "
            f"lower the batch, use a lighter optimizer (optimizer='sgd'), or raise "
            f"memory_limit_bytes"
        ) from None


def staged_peak(choices: Choices, solution: Solution, cluster: Cluster, optimizer: str,
                 outputs=()) -> tuple[StageSolution, list[float]]:
    """`solution` as the one stage of the 1-D problem and the memory its step holds at its
    peak (planner.pipeline.stage_held.peak_bytes), by the rule every plan's memory reads."""
    staged = choices.staged(solution)
    return staged, peak_bytes(choices.built, staged, choices.shape, cluster, optimizer,
                              set(outputs))


def least_need_bytes(choices: Choices, cluster: Cluster, optimizer: str, outputs=()) -> float:
    """What a step of the 1-D problem needs at least per device by our own rule: the
    least-memory assignment (each tie group on one strategy) with what the step holds
    beside its layers (DDP's buckets, the loss, optimizer temporaries), so a
    PlanDoesNotFit's figure is one a plan could meet."""
    problem = choices.problem
    merged, picks = merge_ties(problem)
    least = tuple(min(range(len(node.options)), key=lambda k: node.options[k].memory_bytes)
                  for node in merged.nodes)
    choice = expand(least, picks, len(problem.nodes))
    solution = Solution(choice, problem.cost_of(choice), 0.0, "feasible", 0.0, "least memory")
    return staged_peak(choices, solution, cluster, optimizer, outputs)[1][0]
