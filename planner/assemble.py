"""One Plan from a solution of the 1-D integer program: each layer's strategy with its
reason (planner.reasons) and costs, the input layouts, and the predicted step.
"""

from __future__ import annotations

import math
from dataclasses import replace

from planner.choices import OUTPUT, Choices
from planner.plan import InputPlan, LayerPlan, MeshPlan, Plan, Predicted, SolverReport
from planner.price import step_overhead_s
from planner.problem import Solution
from planner.reasons import lever_fields, of_built, reasons
from planner.volume import communication_bytes
from strategies.cluster import Cluster
from strategies.memory import activation_part, split_name
from strategies.step_memory import (
    loss_held_bytes,
    one_d_layer,
    output_share,
    replaced_bytes,
    reshard_copy_bytes,
    step_held_bytes,
)


def held_beside_layers(choices: Choices, choice, optimizer: str, cluster: Cluster,
                       outputs=()) -> float:
    """What the step holds beyond the per-layer memory the integer program sums
    (strategies.step_memory), for one assignment of the 1-D problem; `outputs`: the
    graph's output nodes, whose loss holds copies of them."""
    ranks = cluster.num_devices
    copies = edge_copies(choices, choice, ranks)
    held = []
    for i, (row, c) in enumerate(zip(choices.layers, choice)):
        acts = activation_part(row.strategies[c], row.layer, row.costs[c], choices.context)
        layer = one_d_layer(split_name(row.strategies[c].name)[0], row.layer.param_bytes,
                            row.strategies[c].model_parallel, ranks, activation_bytes=acts)
        held.append(replace(layer, replaced_bytes=replaced_bytes(
            acts, row.layer.saved_per_output, row.layer.users_saved_per_output,
            copies.get(i, []))))
    loss = loss_held_bytes(output_numel(choices, choice, ranks, outputs))
    return step_held_bytes(held, optimizer, cluster.device.kind, loss_bytes=loss,
                           saved_bytes=reshard_copies(choices, choice, ranks))


def edge_copies(choices: Choices, choice, ranks: int) -> dict[int, list[float]]:
    """{layer: the copy each edge from it makes (reshard_copy_bytes), 0 for an edge to the
    model's outputs (the loss reads the output itself)}."""
    nodes, out = choices.problem.nodes, {}
    for e in choices.problem.edges:
        if nodes[e.dst].name == OUTPUT:
            out.setdefault(e.src, []).append(0.0)
            continue
        src, dst = choices.layers[e.src], choices.layers[e.dst]
        out.setdefault(e.src, []).append(reshard_copy_bytes(
            src.layer.output.nbytes, src.strategies[choice[e.src]].gives,
            dst.strategies[choice[e.dst]].takes, ranks))
    return out


def reshard_copies(choices: Choices, choice, ranks: int) -> float:
    """The copies the layout changes between layers make, kept for backward
    (strategies.step_memory.reshard_copy_bytes)."""
    return sum(sum(c) for c in edge_copies(choices, choice, ranks).values())


def output_numel(choices: Choices, choice, ranks: int, outputs) -> float:
    """Elements of the model's outputs one device holds for the loss (output_share)."""
    outputs = set(outputs)
    return sum(math.prod(row.layer.output.shape) * output_share(row.strategies[c].gives, ranks)
               for row, c in zip(choices.layers, choice) if row.layer.node in outputs)


def assemble(graph, cluster: Cluster, optimizer: str, choices: Choices, solution: Solution,
             budget: float, data_parallel_s: float | None, single_s: float | None,
             seconds: float,
             data_parallel_memory_bytes: float | None = None) -> Plan:
    """The Plan of a 1-D solution: each layer's strategy, its reason and its costs, and the
    prediction (step time = the objective plus the fixed step overhead), with the pure
    data-parallel and one-device step times it is compared against (None: not costed)."""
    problem, choice = choices.problem, list(solution.choice)
    reshard_in = [0.0] * len(problem.nodes)
    reshard_out = [0.0] * len(problem.nodes)
    for e in problem.edges:
        cost = float(e.cost_s[choice[e.src], choice[e.dst]])
        if problem.nodes[e.dst].name == OUTPUT:
            reshard_out[e.src] += cost
        else:
            reshard_in[e.dst] += cost
    weighed = of_built(choices.built, 1, 1)
    why = reasons(weighed, choice)

    layers, inputs = [], []
    for i, row in enumerate(choices.layers):
        strategy, cost, layer = row.strategies[choice[i]], row.costs[choice[i]], row.layer
        if layer.is_input:
            inputs.append(InputPlan(name=layer.node, layout=strategy.gives.value,
                                    shape=list(layer.output.shape),
                                    keyword=layer.node in graph.example_kwargs))
            continue
        layers.append(LayerPlan(
            name=layer.name, node=layer.node, kind=layer.kind,
            output_shape=list(layer.output.shape),
            row_factor=layer.output.row_factor, strategy=split_name(strategy.name)[0],
            input_layout=strategy.takes.value, output_layout=strategy.gives.value,
            model_parallel=strategy.model_parallel, compute_s=cost.compute_s,
            communication_s=cost.communication_s + row.prices[choice[i]].sync_serial_s,
            update_s=cost.update_s,
            reshard_in_s=reshard_in[i] + reshard_out[i], memory_bytes=cost.memory_bytes,
            param_bytes=layer.param_bytes, params=list(layer.params), reason=why[i], inputs=list(layer.inputs),
            **lever_fields(weighed.layers[i], choice[i], cost,
                           choices.built.problem.layers[i], False)))

    compute = sum(l.compute_s for l in layers)
    update = sum(l.update_s for l in layers)
    ranks = cluster.num_devices
    memory = problem.memory_of(choice) + held_beside_layers(choices, choice, optimizer,
                                                            cluster, graph.outputs)
    fixed = step_overhead_s(cluster)
    predicted = Predicted(
        step_time_s=solution.objective_s + fixed, compute_s=compute, other_s=update,
        communication_s=solution.objective_s - compute - update, fixed_s=fixed,
        memory_bytes=[memory] * ranks, memory_limit_bytes=budget,
        communication_bytes=communication_bytes(choices, choice),
        data_parallel_step_time_s=data_parallel_s,
        data_parallel_memory_bytes=data_parallel_memory_bytes,
        single_device_step_time_s=single_s)
    mesh = MeshPlan(shape=[ranks], dim_names=["devices"], device_type=cluster.device.kind,
                    nodes=cluster.nodes, devices_per_node=cluster.devices_per_node)
    report = SolverReport(
        status=solution.status, objective_s=solution.objective_s, bound_s=solution.bound_s,
        seconds=solution.seconds, backend=solution.backend,
        num_variables=solution.num_variables, num_constraints=solution.num_constraints,
        planning_seconds=seconds)
    return Plan(model=graph.model_name, fingerprint=graph.fingerprint,
                global_batch=graph.batch_size, optimizer=optimizer, cluster=cluster,
                mesh=mesh, inputs=inputs, layers=layers, predicted=predicted, solver=report,
                tracer=graph.tracer, outputs=list(graph.outputs))
