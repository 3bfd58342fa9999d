"""The one SCIP setup every integer program of the planner is solved with.

Both MIPs (one stage's strategies, `planner.ilp`; the stage cut, `planner.pipeline.stages`) need
the same settings, for reasons found against brute force (tests/test_ilp.py keeps the
instances): a feasibility tolerance fine enough for memory rows scaled to coefficients
<= 1, and no probing in presolve. A MIP that built its own solver without them would
answer differently from the other on the same numbers.
"""

from __future__ import annotations

import math

from ortools.linear_solver import pywraplp

FEASIBILITY_TOL = 1e-9  # SCIP's numerics/feastol, in the scaled memory units of planner.ilp


def time_unit_s(times) -> float:
    """The time unit a program is written in: the largest of `times` (finite ones), so
    that every coefficient is at most 1 and none of the small ones falls below SCIP's
    1e-9, which it drops (both MIPs divide their times by it)."""
    largest = max((abs(float(t)) for t in times if math.isfinite(t)), default=0.0)
    return largest if largest > 0.0 else 1.0


def mip_solver(relative_gap: float | None = None) -> tuple[pywraplp.Solver, str]:
    """(solver, backend name): SCIP with the planner's settings, or CBC where OR-Tools was
    built without SCIP. `relative_gap`: SCIP's limits/gap, for a MIP that stops at a gap
    (a caller may instead pass RELATIVE_MIP_GAP to Solve)."""
    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is not None:
        # The memory row is scaled to coefficients ≤ 1; the default 1e-6 would let it
        # overflow by a millionth of the largest per-layer memory spread.
        # Probing in presolve is off: SCIP 10.0.0 presolve then cut off the optimum of
        # small instances whose optimum fills the budget exactly (23 of 16,000 random
        # instances, against brute force; tests/test_ilp.py keeps such instances), and
        # without it 1,000-layer chains solve as fast or faster.
        # One string: a second SetSolverSpecificParametersAsString replaces the first.
        # misc/catchctrlc off: Ctrl-C reaches Python when the solve returns, so the 3-D
        # search stops there and hands back its best plan (planner.search).
        settings = (f"numerics/feastol = {FEASIBILITY_TOL}\n"
                    "propagating/probing/maxprerounds = 0\nmisc/catchctrlc = FALSE\n")
        if relative_gap is not None:
            settings += f"limits/gap = {relative_gap}\n"
        accepted = solver.SetSolverSpecificParametersAsString(settings)
        assert accepted, "SCIP refused a parameter name; check the SCIP version"
        return solver, "SCIP"
    solver = pywraplp.Solver.CreateSolver("CBC")
    if solver is None:
        raise RuntimeError("OR-Tools has neither SCIP nor CBC; reinstall ortools")
    return solver, "CBC"
