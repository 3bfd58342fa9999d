"""The pipeline machinery of the 3-D search: one mesh shape's stage problem and how it is
solved and bounded. `stages` (the problem, evaluate, quick plans, solve_stages, the bounds)
with its solvers (`stage_dp` and `stage_intervals`, dynamic programs; `stage_mip`, the
integer program), its bounds (`stage_loads`, `stage_paths`, `unit_least`), the schedules'
simulation (`schedules`), whole-block recompute (`block_recompute`) and what a rank holds
in its step (`stage_held`). planner.search drives it over the shapes; planner.plan3d turns
its answer into a Plan.
"""
