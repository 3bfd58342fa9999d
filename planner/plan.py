"""The Plan: what to run where, what it is predicted to cost, and how sure the solver is.

A Plan is data (pydantic), so it can be saved, read by other tools and checked before
anything runs. Field names under `layers`, `mesh`, `predicted` and `solver` are a stable
interface: tools outside hyplan read them. Bump SCHEMA_VERSION when they change.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from strategies.cluster import Cluster

SCHEMA_VERSION = 1

# Plan.explain() is public API, but the words live in the report (planner/report/explain.py),
# which sits above the planner: it reads the baselines' labels, and the planner never imports
# the report. A record at the bottom importing it would close a cycle through the whole
# planner. So the report hands its renderer down when it is imported, and `planner`'s
# __init__ imports the report: any Plan, made here or read from JSON, finds it. A hook, not
# a function-local import, so that the module graph says what depends on what.
_explainer: "Callable[[Plan], str] | None" = None


def set_explainer(render: "Callable[[Plan], str]") -> None:
    """Install the function `Plan.explain()` renders with (planner.report.explain does, on
    import)."""
    global _explainer
    _explainer = render


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LayerPlan(_Data):
    """One layer's decision and its predicted cost per device per step."""

    name: str = Field(description="module path (e.g. 'classifier.1'), or the fx node name")
    node: str = Field(description="the torch.fx node name the executor matches")
    kind: str = Field(description="module class or function name")
    output_shape: list[int] = Field(description="global shape of the layer's output")
    row_factor: int | None = Field(None, description="how dim 0 of the output holds the "
                                   "batch: 1 the batch, k batch x k merged, 0 no batch, "
                                   "None not known (profiler.graph.TensorMeta.row_factor)")
    strategy: str
    input_layout: str
    output_layout: str
    model_parallel: bool = False
    compute_s: float
    communication_s: float = Field(description="collectives the layer issues itself")
    update_s: float = 0.0
    reshard_in_s: float = Field(0.0, description="layout changes on the edges into it")
    memory_bytes: float
    param_bytes: int = Field(description="bytes of the parameters it owns (a parameter "
                             "several layers read is owned by the first)")
    params: list[str] = Field(default_factory=list, description="names of the parameters "
                              "it reads (model.named_parameters()), its module's or bare ones")
    reason: str = ""
    inputs: list[str] = Field(default_factory=list, description="fx node names it reads")
    stage: int = Field(0, description="the pipeline stage that runs it (0 without a pipeline)")
    recompute: bool = Field(False, description="activation checkpointing: keeps its input, "
                            "recomputes its activations in backward")
    saved_bytes: float = Field(0.0, description="memory its levers (fsdp, recompute) save "
                               "per device against plain data parallelism or its split")
    lever_s: float = Field(0.0, description="time its levers cost per step")
    recompute_s: float = Field(0.0, description="of lever_s: the extra forward of recompute")
    recompute_saved_bytes: float = Field(0.0, description="of saved_bytes: by recompute")
    dp_shard: bool = Field(False, description="3-D plans: FSDP2 fully_shard of its module "
                           "over the dp group (weights, gradients, optimizer state 1/dp), "
                           "beside its strategy over the tp group")
    hsdp: bool = Field(False, description="with dp_shard: HSDP, sharded over the dp ranks "
                       "of one node (mesh.dp_shard_ranks) and replicated across nodes")

    @property
    def shards_weights(self) -> bool:
        """Its weights FSDP2-sharded beside its strategy: over the dp group (`dp_shard`, a
        3-D or cp plan of the search) or over its group (a "+fsdp" strategy, the cp
        baseline's)."""
        return self.dp_shard or self.strategy.endswith("+fsdp")


class InputPlan(_Data):
    """A model input: `batch` means each rank passes its rows, `replicate` all of them."""

    name: str
    layout: str
    shape: list[int]
    keyword: bool = Field(False, description="passed by keyword (example_kwargs: a padding "
                          "mask `attention_mask=`): executor.train_step splits it from "
                          "forward_kwargs as this layout says")


class MeshPlan(_Data):
    """The device mesh. A 1-D plan has one dim, "devices": a group of all devices, which each
    layer uses data- or model-parallel. A 3-D plan has dims ("pp", "dp", "tp"): pipeline
    stages, data-parallel replicas of each stage, and the tensor-parallel group inside
    which each layer picks its strategy; global rank = (pp_index * dp + dp_index) * tp +
    tp_index, so tp groups are consecutive ranks (inside a node when tp fits in one)."""

    shape: list[int]
    dim_names: list[str]
    device_type: str
    nodes: int
    devices_per_node: int
    groups: dict[str, list[list[int]]] = Field(
        default_factory=dict,
        description="per dim name, the global ranks of each of its groups (3-D plans)")
    group_links: dict[str, str] = Field(
        default_factory=dict,
        description="per dim name, the link its groups use ('NVLink 3', 'HDR InfiniBand')")
    dp_shard_ranks: int = Field(1, description="HSDP layers: the dp dim splits into "
                                "(dp_replicate = dp / this, dp_shard = this), the dp ranks "
                                "of one node; 1 when no layer uses HSDP")

    def size(self, dim: str) -> int:
        """The mesh's extent along `dim` (1 when the mesh has no such dim)."""
        return self.shape[self.dim_names.index(dim)] if dim in self.dim_names else 1


class ContextParallelPlan(_Data):
    """A context-parallel plan (the "cp" baseline, planner.context_plan): its degree, how
    its weights are held, and why this degree won. The mesh is ("dp", "cp")."""

    degree: int = Field(ge=1, description="cp: ranks that split every sequence (1: none, "
                        "every sequence whole on a device)")
    sharded: bool = Field(False, description="weights FSDP2-sharded over cp x dp (else "
                          "replicated, DDP over the whole mesh)")
    why: str = Field("", description="its step time beside the other degrees' and "
                     "weight modes' (or their memory where they do not fit)")


class MemoryBreakdown(_Data):
    """Memory of one device at its peak, in bytes, by what holds it."""

    parameters_bytes: float = 0.0
    gradients_bytes: float = 0.0
    optimizer_state_bytes: float = 0.0
    activations_bytes: float = Field(
        0.0, description="kept for backward, all microbatches in flight")
    microbatches_in_flight: int = Field(
        1, description="forwards whose activations are kept at once")

    @property
    def total_bytes(self) -> float:
        return (self.parameters_bytes + self.gradients_bytes + self.optimizer_state_bytes
                + self.activations_bytes)


class StagePlan(_Data):
    """One pipeline stage: a contiguous run of layers (topological order) on its devices."""

    index: int
    pipeline_rank: int | None = Field(None, description="the pipeline rank that runs it "
                                      "(the index itself with one chunk per rank)")
    layers: list[str] = Field(description="layer names, in order")
    modules: list[str] = Field(description="top-level module paths (or fx nodes) cut as one")
    ranks: list[int] = Field(description="global ranks that run this stage (its dp x tp devices)")
    microbatch_s: float = Field(description="forward + backward of one microbatch, with its "
                                "collectives and the point-to-point transfers at its cuts")
    send_s: float = Field(0.0, description="point-to-point time per microbatch at its cuts")
    compute_s: float | None = Field(None, description="of microbatch_s, the compute: its "
                                    "layers', longer by a split backward (zero-bubble "
                                    "schedules), and a prologue rerun on later stages (None "
                                    "in plans saved before it was kept)")
    step_s: float = Field(description="once per step: gradient sync over dp + optimizer")
    memory: MemoryBreakdown


class PipelinePlan(_Data):
    """How the pipeline runs: schedule, microbatches, stages and the idle time it costs."""

    schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble",
                      "ZBVZeroBubble", "DualPipeV"]
    chunks: int = Field(1, gt=0, description="stages (virtual stages) per pipeline rank: "
                        "looped r, r + pp, ... or V-shaped r, 2pp - 1 - r")
    why: str = Field("", description="why this schedule: its bubble and memory beside the "
                     "others' at this mesh")
    microbatches: int = Field(gt=0)
    microbatch_rows: int = Field(gt=0, description="rows per microbatch per dp replica")
    bubble_fraction: float = Field(description="the slowest stage's idle share of the "
                                   "pipelined part of the step: (pp - 1) / (microbatches + "
                                   "pp - 1) when stages are balanced")
    stages: list[StagePlan]
    forward_share: float = Field(1 / 3, gt=0, lt=1, description="the forward's share of a "
                                 "stage's per-microbatch time, measured on the model "
                                 "(a third by FLOPs): how the schedule's timeline splits it")


class CandidateReport(_Data):
    """A mesh shape the search looked at: its best plan's step time, or why it lost unsolved."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    schedule: str
    chunks: int = 1
    cp: int = Field(1, description="context parallel degree (each sequence over cp ranks)")
    outcome: Literal["best", "solved", "pruned_by_bound", "does_not_fit", "dominated",
                     "infeasible", "time_limit", "skipped"]
    step_time_s: float | None = Field(None, description="solved: the optimum for this shape")
    bound_s: float | None = Field(None, description="a lower bound on its step time")
    note: str = ""


class SearchReport(_Data):
    """The 3-D search: how many candidates (mesh shape x microbatches x schedule) there were,
    how many were solved and how many pruned, and the best per mesh shape."""

    candidates: int
    solved: int
    pruned: int
    seconds: float
    best_per_shape: list[CandidateReport] = Field(default_factory=list)


class BaselinePredicted(_Data):
    """A hand-written plan (DDP, FSDP, tensor parallel) priced by the same cost model as the
    plan it sits beside. One that does not fit the devices' memory cannot run, so it is
    reported by what it needs, never as a speed to beat."""

    step_time_s: float
    communication_s: float | None = None
    communication_bytes: float | None = Field(
        None, description="bytes each device sends per step (collectives and layout changes)")
    memory_bytes: float | None = Field(None, description="per device, the largest; None in "
                                       "plans saved before it was recorded")
    fits: bool | None = Field(None, description="memory_bytes within the plan's "
                              "memory_limit_bytes; None: not recorded")


class Predicted(_Data):
    step_time_s: float
    compute_s: float
    communication_s: float
    other_s: float = Field(description="the optimizer's update")
    fixed_s: float = Field(0.0, description="per-step cost of the distributed engine itself, "
                           "the same for every plan (hyplan calibrate measures it)")
    memory_bytes: list[float] = Field(description="one entry per device")
    memory_limit_bytes: float
    data_parallel_step_time_s: float | None = None
    data_parallel_memory_bytes: float | None = Field(
        None, description="pure data parallelism's memory per device (None: not recorded)")
    single_device_step_time_s: float | None = None
    bubble_s: float = Field(0.0, description="pipeline idle time in the step (3-D plans)")
    memory_breakdown: list[MemoryBreakdown] | None = Field(
        None, description="one entry per device (rank order): parameters, gradients, "
        "optimizer state, activations (3-D plans)")
    communication_bytes: float | None = Field(
        None, description="bytes each device sends per step (1-D plans)")
    # each hand-written baseline ("ddp", "tensor", "fsdp"), same cost model
    baselines: dict[str, BaselinePredicted] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _step_times_of_old_files(cls, data):
        """Plans saved before `baselines` kept only each baseline's step time."""
        if isinstance(data, dict) and "baseline_step_time_s" in data:
            data = dict(data)
            old = data.pop("baseline_step_time_s") or {}
            data.setdefault("baselines", {k: {"step_time_s": t} for k, t in old.items()})
        return data

    @property
    def baseline_step_time_s(self) -> dict[str, float]:
        """{kind: predicted step time} of each baseline, fitting or not."""
        return {kind: b.step_time_s for kind, b in self.baselines.items()}

    @property
    def data_parallel_fits(self) -> bool | None:
        """Whether pure data parallelism fits memory_limit_bytes (None: not recorded)."""
        m = self.data_parallel_memory_bytes
        return None if m is None else m <= self.memory_limit_bytes

    @property
    def speedup_over_data_parallel(self) -> float | None:
        """None where data parallelism does not fit: a plan that cannot run is no rival."""
        t = self.data_parallel_step_time_s
        return t / self.step_time_s if t and self.data_parallel_fits is not False else None

    @property
    def speedup_over_single_device(self) -> float | None:
        t = self.single_device_step_time_s
        return t / self.step_time_s if t else None


class SolverReport(_Data):
    """How sure the plan is: "optimal" (proven for the cost model), "feasible" (the best
    found, with a bound below it: a search's budget ran out) or "interrupted" (Ctrl-C)."""

    status: str
    objective_s: float
    bound_s: float
    seconds: float
    backend: str
    num_variables: int = 0
    num_constraints: int = 0
    planning_seconds: float = 0.0
    note: str = Field("", description="why the status is not 'optimal', and how to prove it")

    @property
    def gap(self) -> float:
        """How much faster than the objective a plan could still be: (objective - bound) /
        objective, 0 where proven."""
        if self.objective_s <= 0:
            return 0.0
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


class PlanFileError(ValueError):
    """A plan file that cannot be read: not JSON, another schema, or a bad field."""


EVERY_BLOCK = "*"  # Plan.recompute_blocks of a plan file that checkpointed every block


class Plan(_Data):
    schema_version: Literal[1] = SCHEMA_VERSION
    model: str
    fingerprint: str = Field(description="of the traced model; the executor checks it")
    global_batch: int = Field(gt=0)
    optimizer: str
    cluster: Cluster
    mesh: MeshPlan
    inputs: list[InputPlan]
    layers: list[LayerPlan]
    predicted: Predicted
    solver: SolverReport
    outputs: list[str] = Field(default_factory=list, description="nodes the model returns")
    tracer: str = Field("fx", description="fx: the executor rewrites the fx graph; export: "
                        "it applies strategies by module path on the module itself")
    pipeline: PipelinePlan | None = Field(None, description="None: no pipeline stages")
    microbatches: int = Field(1, gt=0, description="microbatches per step: the pipeline's, "
                              "or gradient accumulation without one (3-D plans)")
    search: SearchReport | None = Field(None, description="the 3-D search (3-D plans)")
    recompute_blocks: list[str] = Field(
        default_factory=list, description="3-D plans of a decoder: the transformer blocks "
        "(module paths) that run under activation checkpointing (keep their input, run their "
        "forward again in backward); [\"*\"]: every block (plans that stored true)")
    mesh_choice: str = Field("", description="optimize(mesh='auto'): which mesh won and why")
    standard_choice: str = Field("", description="optimize(prefer_standard=...): a standard "
                                 "plan kept in place of a barely faster optimum, and why")
    context_parallel: ContextParallelPlan | None = Field(
        None, description="None: no context parallelism; else its degree (mesh dims dp, "
        "cp) and weight mode, run by executor.context_parallel")
    precision: str = Field("", description="bf16-mixed, fp16-mixed or fp32: what the plan "
                           "was priced for and the executor runs (strategies.precision); "
                           "always the cluster's")

    @model_validator(mode="before")
    @classmethod
    def _record_precision(cls, data):
        """The precision is the cluster's, written out at the top for readers. A plan file
        from before precisions existed (its cluster names none) was priced in fp32."""
        if not isinstance(data, dict) or "cluster" not in data:
            return data
        cluster = data["cluster"]
        if isinstance(cluster, Cluster):
            name = cluster.training_precision.name
            cluster = cluster.at_precision(name)
        elif isinstance(cluster, dict):
            name = cluster.get("precision") or "fp32"
            cluster = {**cluster, "precision": name}
        else:
            return data
        if data.get("precision") not in (None, "", name):
            raise ValueError(f"precision {data['precision']!r} is not the cluster's {name!r}")
        return {**data, "cluster": cluster, "precision": name}

    @field_validator("recompute_blocks", mode="before")
    @classmethod
    def _every_block_as_before(cls, value):
        """A plan file from before the solve chose blocks stored a bool: true was every
        block."""
        if isinstance(value, bool):
            return [EVERY_BLOCK] if value else []
        return value

    def recomputes_block(self, path: str) -> bool:
        """Does the block at module `path` run under activation checkpointing?"""
        return path in self.recompute_blocks or EVERY_BLOCK in self.recompute_blocks

    @property
    def training_precision(self):
        """The strategies.precision.Precision the plan trains in."""
        return self.cluster.training_precision

    @model_validator(mode="after")
    def _one_strategy_per_parameter(self) -> "Plan":
        """A parameter several layers read is one unit: its readers run one strategy (and,
        in a pipeline, one stage), or its placement and gradient sync would disagree. A
        torch.export plan's tied embedding and head may lie on the first and last stage,
        each holding a copy (executor.hf_stages sums their gradients, as Megatron-LM)."""
        ends = {0, len(self.pipeline.stages) - 1} if self.pipeline else set()
        seen: dict[str, LayerPlan] = {}
        for layer in self.layers:
            for name in layer.params:
                first = seen.setdefault(name, layer)
                copies = self.tracer == "export" and {first.stage, layer.stage} == ends
                if first.strategy != layer.strategy or (first.stage != layer.stage
                                                        and not copies):
                    raise ValueError(
                        f"layers {first.name!r} ({first.strategy}, stage {first.stage}) and "
                        f"{layer.name!r} ({layer.strategy}, stage {layer.stage}) share "
                        f"parameter {name!r} but not a strategy and stage; re-plan with "
                        f"this hyplan")
        return self

    @property
    def num_devices(self) -> int:
        return self.cluster.num_devices

    @property
    def positional_inputs(self) -> list[InputPlan]:
        """The inputs a batch's leading entries are, in order (keyword ones come last in a
        traced graph and are handed in forward_kwargs)."""
        return [i for i in self.inputs if not i.keyword]

    @property
    def is_mesh_3d(self) -> bool:
        """Made by the 3-D search (mesh dims pp, dp, tp): run with executor.train_step."""
        return self.mesh.dim_names == ["pp", "dp", "tp"]

    def layer(self, name: str) -> LayerPlan:
        for layer in self.layers:
            if layer.name == name or layer.node == name:
                return layer
        raise KeyError(f"no layer {name!r} in the plan; layers: {[l.name for l in self.layers]}")

    def explain(self) -> str:
        """The dry run in words and a table: nothing executes (planner.report.explain,
        installed by `set_explainer`)."""
        if _explainer is None:
            raise RuntimeError("Plan.explain: no report installed; import planner (whose "
                               "__init__ imports planner.report) before calling it")
        return _explainer(self)

    # --- files ------------------------------------------------------------------------

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanFileError(f"plan: not valid JSON ({error}); re-create it with "
                                f"`hyplan plan ... --json FILE`") from None
        if isinstance(data, dict) and data.get("schema_version") not in (None, SCHEMA_VERSION):
            raise PlanFileError(f"plan: schema_version {data.get('schema_version')!r} is not "
                                f"{SCHEMA_VERSION}; re-create the plan with this hyplan")
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "(top level)"
            raise PlanFileError(f"plan: field {field!r}: {first['msg']}; re-create the plan "
                                f"with `hyplan plan ... --json FILE`") from None

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON, atomically (a crash never leaves half a file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())
