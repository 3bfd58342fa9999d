"""A training job's parallel configuration as torchtitan and Megatron-LM write it: a few
integers and switches for the whole model, where a hyplan Plan decides per layer.

`express(plan)` reads a Plan into a `JobConfig` and says where the plan goes beyond what
those frameworks express (`Departure`: which layers, why): they apply one tensor-parallel
recipe to every block, one data-parallel wrapping (FSDP2 `fully_shard` of every block, or
DDP) and one activation-checkpointing mode, so a per-layer hybrid (data-parallel
convolutions beside a model-parallel classifier; blocks with different strategies) has no
spelling there. The JobConfig is then the nearest configuration they run, and
`planner.price_job` prices it with the same price list as the plan (the 3-D search
restricted to the job's shape, as planner.baseline's "fsdp_tp").

The writers (planner.export.torchtitan, planner.export.megatron) and readers of job files
go through JobConfig both ways, so an exported job read back is the same JobConfig.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace

from planner import dp_shard
from planner.plan import EVERY_BLOCK, LayerPlan, Plan
from strategies.experts import parse_name
from strategies.memory import split_name

# hyplan's pipeline schedules, named as torch.distributed.pipelining (and so torchtitan's
# `pipeline_parallel_schedule`) names them
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")
RECOMPUTE_MODES = ("none", "selective", "full")
FLOAT8_RECIPES = ("", "tensorwise", "rowwise")
PRECISIONS = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16", "fp32": "float32"}

# a transformer block's module path: "model.layers.3", "transformer.h.11", "blocks.0"
_BLOCK = re.compile(r"^((?:.*\.)?(?:layers|h|blocks|block|layer))\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class JobConfig:
    """One job's parallelism, batch and levers, in the degrees both frameworks take.

    dp = dp_replicate x dp_shard (torchtitan's data_parallel_replicate_degree x
    data_parallel_shard_degree; dp_shard > 1 is FSDP2 over it, dp_replicate > 1 with it
    HSDP, alone DDP); devices = dp x cp x tp x pp. `microbatches` per step per replica
    (the pipeline's, or gradient accumulation without one), `chunks` virtual stages per
    pipeline rank. `recompute`: torchtitan's activation-checkpoint mode; with "full",
    every `recompute_every`-th block (1: every block). `compile`, `float8` and
    `async_tp` are the levers the frameworks turn (planner.price_job prices eager execution
    and says so where a job turns them)."""

    global_batch: int
    seq_len: int = 0  # 0: not a sequence model (the plan's input has no sequence dim)
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1F1B"
    microbatches: int = 1
    chunks: int = 1
    recompute: str = "none"
    recompute_every: int = 1
    num_layers: int = 0  # transformer blocks (0: none found)
    sequence_parallel: bool = False
    precision: str = "bf16-mixed"
    compile: bool = False
    float8: str = ""
    async_tp: bool = False
    # Megatron-LM's --use-distributed-optimizer: the optimizer state sharded over dp (its
    # ZeRO-1); without it, a job over dp replicas beside tp is plain DDP
    sharded_optimizer: bool = False
    # the routed experts of each MoE layer and how many a token is sent to, as the job's
    # arguments give them (Megatron-LM's --num-experts, --moe-router-topk; 0: not given):
    # they describe the model, so planner.price_job checks them against it
    experts: int = 0
    router_topk: int = 0

    def __post_init__(self):
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "cp", "ep", "microbatches",
                     "chunks", "global_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"job: {name} must be at least 1, got {getattr(self, name)}")
        for value, known, what in ((self.schedule, SCHEDULES, "pipeline schedule"),
                                   (self.recompute, RECOMPUTE_MODES, "activation checkpoint mode"),
                                   (self.float8, FLOAT8_RECIPES, "float8 recipe"),
                                   (self.precision, PRECISIONS, "precision")):
            if value not in known:
                raise ValueError(f"job: {what} {value!r} is not one hyplan prices; known: "
                                 f"{', '.join(k or 'none' for k in known)}")
        if self.global_batch % (self.dp * self.microbatches):
            raise ValueError(f"job: global batch {self.global_batch} does not split into "
                             f"{self.dp} data-parallel replicas x {self.microbatches} "
                             f"microbatches; change the batch or the microbatch size")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def local_batch(self) -> int:
        """Rows per data-parallel replica per step (all its microbatches)."""
        return self.global_batch // self.dp

    @property
    def microbatch_rows(self) -> int:
        return self.global_batch // (self.dp * self.microbatches)

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in (("dp_replicate", self.dp_replicate),
                                          ("dp_shard", self.dp_shard), ("cp", self.cp),
                                          ("tp", self.tp), ("pp", self.pp), ("ep", self.ep))
                 if v > 1] or ["1 device"]
        text = " x ".join(parts)
        if self.pp > 1:
            text += f", {self.schedule} ({self.chunks} per rank)"
        text += (f", {self.microbatches} microbatch(es) of {self.microbatch_rows}, "
                 f"recompute {self.recompute}")
        levers = [n for n, on in (("compile", self.compile), (f"float8 {self.float8}",
                                                                 bool(self.float8)),
                                  ("async TP", self.async_tp)) if on]
        return text + (f", {' + '.join(levers)}" if levers else "")


@dataclass(frozen=True)
class Departure:
    """Where a plan goes beyond what the frameworks express: these layers, and why."""

    layers: tuple[str, ...]
    why: str

    def __str__(self) -> str:
        shown = ", ".join(self.layers[:6]) + (f" and {len(self.layers) - 6} more"
                                              if len(self.layers) > 6 else "")
        return f"{self.why}: {shown}"


@dataclass(frozen=True)
class Expressed:
    """A plan read as a JobConfig: exact where `departures` is empty, else the nearest
    configuration the frameworks run, and why each layer in a departure differs."""

    job: JobConfig
    departures: tuple[Departure, ...] = field(default_factory=tuple)

    @property
    def exact(self) -> bool:
        return not self.departures


def block_of(name: str) -> str | None:
    """The transformer block a layer belongs to (module path), None outside blocks."""
    match = _BLOCK.match(name)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def _weighted(plan: Plan) -> list[LayerPlan]:
    return [l for l in plan.layers if l.param_bytes > 0]


def _is_norm(layer: LayerPlan) -> bool:
    return "norm" in layer.kind.lower()


def seq_len_of(plan: Plan) -> int:
    """The sequence length of a plan's token input (batch x seq), 0 where there is none.
    Its layout is any the plan gives it: split by rows over dp, and over tp replicated
    (whole rows on every tp rank) or split by tokens (sequence). Token ids feed an
    embedding: a model without one (an MLP's batch x features) has no sequence."""
    if not any(layer.kind == "Embedding" for layer in plan.layers):
        return 0
    for item in plan.positional_inputs:
        if len(item.shape) == 2 and item.shape[0] == plan.global_batch:
            return item.shape[1]
    return 0


def express(plan: Plan, seq_len: int | None = None) -> Expressed:
    """The JobConfig a Plan runs as under torchtitan or Megatron-LM, with the departures
    where the plan chooses per layer what they choose for the whole model."""
    blocks = sorted({b for l in plan.layers if (b := block_of(l.name))},
                    key=lambda b: int(b.rsplit(".", 1)[1]))
    seq = seq_len_of(plan) if seq_len is None else seq_len
    if plan.is_mesh_3d:
        job, departures = _express_3d(plan)
    elif plan.context_parallel is not None:
        job, departures = _express_cp(plan)
    else:
        job, departures = _express_1d(plan)
    recompute, every, more = _recompute(plan, blocks)
    # the kernel levers the plan was priced with (its cluster's: a plan searched beside a
    # job that turns them, planner.report.compare_job), which the frameworks then turn
    levers = plan.cluster.levers
    job = replace(job, seq_len=seq, num_layers=len(blocks), recompute=recompute,
                  recompute_every=every, precision=plan.precision or "fp32",
                  compile=levers.compile, float8=levers.float8 or "",
                  async_tp=levers.async_tp and job.tp > 1)
    return Expressed(job, tuple(departures + more))


def _express_1d(plan: Plan) -> tuple[JobConfig, list[Departure]]:
    """A 1-D plan's one group of N devices: data parallel (DDP, or FSDP where its layers
    are sharded) or tensor parallel over all of them. Layers with weights that split
    otherwise than the majority (by bytes) are a per-layer hybrid."""
    n = plan.num_devices
    weighted = _weighted(plan)

    def kind(layer: LayerPlan) -> str:
        base = split_name(layer.strategy)[0]
        if base == "fsdp":
            return "fsdp"
        if layer.model_parallel:
            return "tp"
        return "ddp" if base == "data_parallel" else "whole"

    weight = Counter()
    for layer in weighted:
        weight[kind(layer)] += layer.param_bytes
    majority = weight.most_common(1)[0][0] if weight else "ddp"
    if majority == "whole":
        majority = "ddp"
    departures = []
    others = [l for l in weighted if kind(l) != majority and not _is_norm(l)]
    if others and n > 1:
        by_kind: dict[str, list[str]] = {}
        for layer in others:
            by_kind.setdefault(kind(layer), []).append(layer.name)
        words = {"ddp": "run data parallel", "fsdp": "run sharded (FSDP)",
                 "tp": "run tensor parallel", "whole": "run whole on every device"}
        for k, names in by_kind.items():
            departures.append(Departure(tuple(names), (
                f"{words[k]} where most weights {words[majority][4:]}: torchtitan and "
                f"Megatron-LM apply one split to every layer (per-layer hybrid); the export "
                f"runs them as the majority does")))
    degrees = {"ddp": {"dp_replicate": n}, "fsdp": {"dp_shard": n}, "tp": {"tp": n}}
    job = JobConfig(global_batch=plan.global_batch, microbatches=plan.microbatches,
                    sequence_parallel=majority == "tp" and _any_sequence_parallel(plan),
                    **(degrees[majority] if n > 1 else {}))
    return job, departures


def _express_cp(plan: Plan) -> tuple[JobConfig, list[Departure]]:
    """A context-parallel plan's (dp, cp) mesh: each sequence over cp ranks
    (torchtitan's context_parallel_degree, Megatron-LM's --context-parallel-size) and the
    weights as most of them (by bytes) are held, FSDP over dp or replicated; torchtitan
    shards them over dp_shard x cp whenever cp > 1, and the frameworks hold every layer
    alike, so layers held otherwise are departures."""
    cp = plan.context_parallel.degree
    dp = plan.num_devices // cp
    weighted = _weighted(plan)
    sharded = {l.name for l in weighted if l.shards_weights}
    by_bytes = sum(l.param_bytes for l in weighted if l.name in sharded)
    fsdp = 2 * by_bytes >= sum(l.param_bytes for l in weighted)
    others = [l.name for l in weighted
              if (l.name in sharded) != fsdp and not _is_norm(l)]
    departures = []
    if others:
        held, most = (("replicated", "sharded (FSDP)") if fsdp
                      else ("sharded (FSDP)", "replicated"))
        departures.append(Departure(tuple(others), (
            f"weights {held} where most are {most}: torchtitan and Megatron-LM hold every "
            f"layer alike (torchtitan shards over dp_shard x cp whenever cp > 1); the export "
            f"holds them as the majority does")))
    job = JobConfig(global_batch=plan.global_batch, microbatches=plan.microbatches, cp=cp,
                    **({"dp_shard": dp} if fsdp else {"dp_replicate": dp}))
    return job, departures


def _any_sequence_parallel(plan: Plan) -> bool:
    return any(split_name(l.strategy)[0] == "sequence_parallel" for l in plan.layers)


def _express_3d(plan: Plan) -> tuple[JobConfig, list[Departure]]:
    """A 3-D plan's (pp, dp, tp) mesh: FSDP2 over dp where its layers are sharded (HSDP by
    node where they are so), torchtitan's tensor-parallel recipe over tp."""
    pp, dp, tp = (plan.mesh.size(d) for d in ("pp", "dp", "tp"))
    weighted = _weighted(plan)
    departures = []
    sharded = [l for l in weighted if l.dp_shard]
    hsdp = [l for l in sharded if l.hsdp]
    dp_replicate, dp_shard_degree = dp, 1
    if dp > 1 and sharded:
        if hsdp and len(hsdp) * 2 >= len(sharded):
            dp_shard_degree = plan.mesh.dp_shard_ranks
            dp_replicate = dp // dp_shard_degree
        else:
            dp_replicate, dp_shard_degree = 1, dp
        odd = [l.name for l in weighted if l not in sharded or (l.hsdp != bool(hsdp)
                                                                and len(hsdp) * 2 >= len(sharded))]
        if odd:
            departures.append(Departure(tuple(odd), (
                "sharded over dp otherwise than the other layers (FSDP, HSDP or replicated "
                "per layer): torchtitan applies fully_shard to every block and the rest "
                "of the model alike; the export shards them all")))
    elif dp > 1 and (tp > 1 or pp > 1):
        departures.append(Departure(tuple(l.name for l in weighted[:1]), (
            "replicated over dp beside tp or pp (DDP on a multi-dimensional mesh): "
            "torchtitan runs DDP on one-dimensional meshes only; the export shards over "
            "dp (FSDP)")))
        dp_replicate, dp_shard_degree = 1, dp
    if tp > 1:
        whole = [l.name for l in weighted if not l.model_parallel and not _is_norm(l)
                 and split_name(l.strategy)[0] not in dp_shard.SUMMED_OVER_TP]
        if whole:
            departures.append(Departure(tuple(whole), (
                "run whole on each tensor-parallel rank where torchtitan's recipe and "
                "Megatron-LM split every block's Linear (column then row) and the "
                "embedding and head by vocabulary: the export splits them")))
    ep, odd = _expert_degree(weighted, tp)
    if odd:
        departures.append(Departure(tuple(odd), (
            f"experts split over another EP degree than most MoE layers' ({ep}): "
            f"torchtitan and Megatron-LM set one for the model; the export uses {ep}")))
    schedule = plan.pipeline.schedule if plan.pipeline else "1F1B"
    chunks = plan.pipeline.chunks if plan.pipeline else 1
    job = JobConfig(global_batch=plan.global_batch, dp_replicate=dp_replicate,
                    dp_shard=dp_shard_degree, tp=tp, pp=pp, ep=ep, schedule=schedule,
                    microbatches=plan.microbatches, chunks=chunks,
                    sequence_parallel=tp > 1 and _any_sequence_parallel(plan))
    return job, departures


def _expert_degree(weighted: list[LayerPlan], tp: int) -> tuple[int, list[str]]:
    """(the EP degree most of a 3-D plan's experts layers run, 1 where none is expert
    parallel; the experts layers run otherwise). "expert_parallel" is EP over the tp
    group, "expert_parallel:epK" over K ranks carved out of dp x tp
    (planner.expert_degrees)."""
    degree = {l.name: (parsed[0] or tp) for l in weighted
              if (parsed := parse_name(l.strategy)) is not None}
    if not degree:
        return 1, []
    ep = Counter(degree.values()).most_common(1)[0][0]
    return ep, [name for name, k in degree.items() if k != ep]


def _recompute(plan: Plan, blocks: list[str]) -> tuple[str, int, list[Departure]]:
    """torchtitan's activation-checkpoint mode for the plan's checkpointed blocks: none,
    or full on every n-th block (the frameworks' spelling of "some of them": torchtitan's
    integer selective_ac_option, Megatron's --recompute-num-layers)."""
    chosen = plan.recompute_blocks
    layers = [l.name for l in plan.layers if l.recompute]
    if EVERY_BLOCK in chosen or (blocks and set(blocks) <= set(chosen)):
        return "full", 1, []
    if chosen:
        every = max(1, round(len(blocks) / len(chosen))) if blocks else 1
        if blocks and sorted(chosen) != [b for i, b in enumerate(blocks) if i % every == 0]:
            return "full", every, [Departure(tuple(chosen), (
                f"checkpointed ({len(chosen)} of {len(blocks)} blocks) where the frameworks "
                f"checkpoint every n-th block: the export checkpoints every {every}"))]
        return "full", every, []
    if layers:  # a 1-D plan's per-layer recompute
        return "full", 1, [Departure(tuple(layers), (
            "checkpointed one by one, not by block: the frameworks checkpoint whole "
            "blocks; the export checkpoints every block"))]
    return "none", 1, []
