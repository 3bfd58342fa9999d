"""Which layers a gradient flows back into (ModelGraph.carries_gradient), and what that
saves: a float made from buffers alone (a rotary cos/sin table, a sinusoidal position
table) has no backward, so handing it whole to data-parallel layers costs nothing, where
it used to be priced an all-reduce of its gradient in every block."""

from __future__ import annotations

import torch
from torch import nn

from planner.choices import layer_choices
from planner.profiled import profiled_graph


class BufferPositions(nn.Module):
    """x -> Linear, plus a sin table computed from a buffer (no parameter upstream)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, width))

    def forward(self, x):  # x: [batch, seq, width]
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        table = torch.sin(positions.unsqueeze(-1) * self.freq)
        return self.lin(x) + table


def test_a_table_from_buffers_carries_no_gradient_and_its_edge_costs_nothing():
    graph, cluster = profiled_graph(BufferPositions(), "2xcpu", (torch.randn(4, 4, 16),),
                                    measure=False)
    by_name = {layer.name: layer for layer in graph.layers}
    table = by_name["sin"]
    assert not graph.carries_gradient(table.node)
    assert graph.carries_gradient(by_name["lin"].node)
    assert not graph.carries_gradient(by_name["x"].node)  # a model input

    choices = layer_choices(graph, cluster, "sgd", None)
    names = [row.layer.name for row in choices.layers]
    add = names.index("add")
    into_add = next(e for e in choices.problem.edges
                    if names[e.src] == "sin" and e.dst == add)
    dp = [s.name for s in choices.layers[add].strategies].index("data_parallel")
    # the table is whole on every rank; a data-parallel add reads it as it is
    assert into_add.cost_s[:, dp].min() == 0.0


def test_llama_rotary_tables_cost_no_gradient_all_reduce_under_data_parallel():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 8))
    graph, cluster = profiled_graph(model, "2xcpu", (ids,), {"use_cache": False},
                                    measure=False)
    choices = layer_choices(graph, cluster, "sgd", None)
    rows = choices.layers
    attn = next(i for i, r in enumerate(rows) if r.layer.name == "model.layers.0.self_attn")
    dp = [s.name for s in rows[attn].strategies].index("data_parallel")
    tables = [e for e in choices.problem.edges if e.dst == attn
              and not graph.carries_gradient(rows[e.src].layer.node)
              and rows[e.src].layer.output.dtype.startswith("float")]
    assert tables, "the rotary cos/sin tables reach the attention"
    for edge in tables:
        assert edge.cost_s[:, dp].min() == 0.0, rows[edge.src].layer.name
