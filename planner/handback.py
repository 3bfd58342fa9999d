"""How the model's output (and so the loss's targets) is handed back to the user: split by
rows where the rows split evenly over the group of ranks that computes them, else whole on
every rank of that group.

The group is all devices on the global batch (1-D plans), or a tp group on one microbatch
of one dp replica (3-D plans). Each rank gets its rows only where every rank gets as many:
a rank with no rows has no mean to take, and uneven shares would weigh the per-rank means
wrongly. Otherwise (one sequence per replica and tp 8: an LLM's usual case) the output is
gathered whole, and every rank of the group computes the same loss on the whole of it.
The planner prices that gather on the edge into its sink (planner.search.build)
and the executor makes it (executor.graph_rewrite, executor.batch, executor.step).
"""

from __future__ import annotations

from strategies.layouts import Layout


def output_layout(rows: int, ranks: int) -> Layout:
    """The layout the model's output leaves in when `ranks` ranks compute `rows` rows."""
    return Layout.BATCH if rows % ranks == 0 else Layout.REPLICATE


def sharing_group(plan) -> tuple[int, int]:
    """(rows, ranks) of the group of ranks that computes one set of rows under `plan`."""
    if plan.is_mesh_3d:
        dp, tp = plan.mesh.size("dp"), plan.mesh.size("tp")
        return plan.global_batch // (dp * plan.microbatches), tp
    return plan.global_batch, plan.num_devices


def output_whole(plan) -> bool:
    """Does every rank of its group get the model's whole output (and whole targets)?"""
    return output_layout(*sharing_group(plan)) == Layout.REPLICATE
