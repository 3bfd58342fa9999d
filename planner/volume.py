"""How many bytes each device sends in one step of a 1-D plan: the volume beside the time.

Time depends on the link a collective crosses; volume does not, so it is what shows two
plans' communication side by side on any cluster (FSDP sends 1.5x DDP's bytes: two
all-gathers of the weights and a reduce-scatter of the gradients, against one all-reduce,
which is a reduce-scatter and an all-gather). Every figure is the b(P)·n of the same ring
formulas that price the time (strategies.collectives.collective_bytes), so bytes and
seconds come from one price list.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.choices import Choices
from planner.price import batch_free_takes
from strategies.edges import reshard_bytes
from strategies.layouts import Layout


def communication_bytes(choices: Choices, choice: Sequence[int]) -> float:
    """Bytes one device sends per step under `choice` (an option index per node of
    `choices.problem`): each chosen strategy's own collectives, plus the layout changes on
    the edges between layers and into the output (which the user gets split by rows)."""
    rows, ctx = choices.layers, choices.context
    sent = sum(row.costs[choice[i]].notes.get("communication_bytes", 0.0)
               for i, row in enumerate(rows))
    for edge in choices.problem.edges:
        producer = rows[edge.src]
        gives = producer.strategies[choice[edge.src]].gives
        if edge.dst == len(rows):  # the output sink
            takes = Layout.BATCH
        else:
            wanted = rows[edge.dst].strategies[choice[edge.dst]].takes
            takes = batch_free_takes(producer.layer, wanted, ctx.batch)
        sent += reshard_bytes(gives, takes, producer.layer.output.nbytes, ctx.ranks,
                              backward=producer.carries_gradient)
    return sent
