"""Megatron-LM's command-line arguments, written from a plan and read into a JobConfig.

`to_megatron(plan)` writes the parallel, recompute, precision and batch arguments of
`pretrain_gpt.py` (the model's own size arguments are the user's); `config_fields(job)`
gives the same values under the field names of megatron-core's `ModelParallelConfig` and
`TransformerConfig`, which the arguments become inside Megatron-LM
(`megatron/training/arguments.py: core_transformer_config_from_args`).
`read_megatron(args, devices)` reads an argument string into a JobConfig.

    args = to_megatron(plan).text   # "--tensor-model-parallel-size 8 --sequence-parallel ..."
"""

from __future__ import annotations

import argparse
import shlex

from planner.export.config import Departure, Expressed, JobConfig, express
from planner.export.torchtitan import Exported, JobFileError
from planner.plan import Plan

# field of megatron-core's config -> its Megatron-LM flag, where the two names differ
_FLAG = {"virtual_pipeline_model_parallel_size": None,  # written per stage, below
         "bf16": "--bf16", "fp16": "--fp16", "num_moe_experts": "--num-experts"}
# Megatron-LM's mixture-of-experts arguments read and passed over, and why: hyplan prices
# what the model's traced experts layer does (strategies.experts), uniform routing (each
# expert its tokens·k/E share: a capacity factor of 1 drops none of it, dropless runs
# have imbalance hyplan does not price), one all-to-all dispatch
MOE_IGNORED = {
    "--moe-grouped-gemm": "the experts' matmuls priced as the traced layer's, not per kernel",
    "--moe-token-dispatcher-type": "dispatch priced as all-to-all whatever the dispatcher",
    "--moe-expert-capacity-factor": "routing priced uniform (no expert over its capacity)",
    "--moe-pad-expert-input-to-capacity": "routing priced uniform",
    "--moe-token-drop-policy": "routing priced uniform",
    "--moe-router-load-balancing-type": "the auxiliary loss's FLOPs are not priced",
    "--moe-aux-loss-coeff": "a loss weight: no bearing on the step",
    "--moe-ffn-hidden-size": "a model size (the built model's experts give it)",
    "--moe-shared-expert-intermediate-size": "a model size (the built model gives it)",
}


def config_fields(job: JobConfig) -> dict[str, object]:
    """The job as megatron-core's ModelParallelConfig / TransformerConfig fields."""
    fields: dict[str, object] = {
        "tensor_model_parallel_size": job.tp,
        "pipeline_model_parallel_size": job.pp,
        "context_parallel_size": job.cp,
        "expert_model_parallel_size": job.ep,
        "sequence_parallel": job.tp > 1 and job.sequence_parallel,
        "bf16": job.precision == "bf16-mixed",
        "fp16": job.precision == "fp16-mixed",
    }
    if job.ep > 1:  # hyplan's EP groups hold whole experts (its default: tp)
        fields["expert_tensor_parallel_size"] = 1
    if job.experts:
        fields["num_moe_experts"] = job.experts
    if job.router_topk:
        fields["moe_router_topk"] = job.router_topk
    if job.pp > 1 and job.chunks > 1:
        fields["virtual_pipeline_model_parallel_size"] = job.chunks
    if job.num_layers:
        fields["num_layers"] = job.num_layers
    if job.recompute == "full":
        fields["recompute_granularity"] = "full"
        per_stage = job.num_layers // job.pp if job.num_layers else 0
        if job.recompute_every > 1 and per_stage:
            fields["recompute_method"] = "block"  # the first n blocks of each stage
            fields["recompute_num_layers"] = max(1, per_stage // job.recompute_every)
        else:
            fields["recompute_method"] = "uniform"
            fields["recompute_num_layers"] = 1
    elif job.recompute == "selective":
        fields["recompute_granularity"] = "selective"
    return fields


def _departures(job: JobConfig) -> list[Departure]:
    out = []
    if job.pp > 1 and job.schedule not in ("1F1B", "Interleaved1F1B"):
        nearest = "interleaved 1F1B" if job.chunks > 1 else "1F1B"
        out.append(Departure(("pipeline",), (
            f"scheduled {job.schedule}, which Megatron-LM's pipeline does not run: the "
            f"export runs {nearest}")))
    if job.dp_replicate > 1 and job.dp_shard > 1:
        out.append(Departure(("all",), (
            "sharded inside a node and replicated across nodes (HSDP): Megatron-LM's "
            "FSDP2 shards over the whole data-parallel group")))
    if job.recompute == "full" and job.recompute_every > 1 and job.num_layers % job.pp:
        out.append(Departure(("recompute",), "blocks not divisible among the stages"))
    stages = job.pp * job.chunks
    if job.pp > 1 and job.num_layers and job.num_layers % stages:
        # megatron/training/arguments.py asserts num_layers % pp == 0 (and per virtual
        # stage) unless a layout or uneven first/last stages are given
        out.append(Departure(("pipeline",), (
            f"{job.num_layers} blocks over {stages} pipeline stages, which Megatron-LM splits "
            f"only evenly from these arguments (it stops: 'Number of layers should be "
            f"divisible by the pipeline-model-parallel size'): give it the plan's stages with "
            f"--pipeline-model-parallel-layout, or --decoder-first-pipeline-num-layers / "
            f"--decoder-last-pipeline-num-layers")))
    return out


def arguments(job: JobConfig) -> list[str]:
    """Megatron-LM's arguments for the job (config_fields, then batch and optimizer)."""
    out: list[str] = []
    for name, value in config_fields(job).items():
        if name == "virtual_pipeline_model_parallel_size":
            if job.num_layers:
                out += ["--num-layers-per-virtual-pipeline-stage",
                        str(job.num_layers // (job.pp * job.chunks))]
            continue
        flag = _FLAG.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, str(value)]
    out += ["--micro-batch-size", str(job.microbatch_rows),
            "--global-batch-size", str(job.global_batch)]
    if job.seq_len:
        out += ["--seq-length", str(job.seq_len)]
    if job.dp > 1:
        out += ["--use-distributed-optimizer"]
    if job.fsdp:
        out += ["--use-torch-fsdp2"]
    if job.float8:
        out += ["--fp8-format", "hybrid", "--fp8-recipe", job.float8]
    if job.async_tp:
        out += ["--tp-comm-overlap"]
    return out


def to_megatron(plan: Plan | Expressed) -> Exported:
    """Megatron-LM's arguments that run `plan` as nearly as it can, one string."""
    expressed = plan if isinstance(plan, Expressed) else express(plan)
    job = expressed.job
    departures = expressed.departures + tuple(_departures(job))
    return Exported(shlex.join(arguments(job)), job, departures)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron", add_help=False)
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size", "--expert-model-parallel-size",
                 "--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size",
                 "--recompute-num-layers", "--micro-batch-size", "--global-batch-size",
                 "--seq-length", "--num-layers", "--activations-checkpoint-num-layers",
                 "--num-experts", "--moe-router-topk", "--expert-tensor-parallel-size"):
        p.add_argument(flag, type=int)
    for flag in ("--recompute-granularity", "--recompute-method", "--fp8-format",
                 "--fp8-recipe", "--activations-checkpoint-method"):
        p.add_argument(flag)
    for flag in ("--sequence-parallel", "--bf16", "--fp16", "--use-distributed-optimizer",
                 "--use-torch-fsdp2", "--tp-comm-overlap", "--recompute-activations",
                 "--checkpoint-activations"):
        p.add_argument(flag, action="store_true")
    return p


def _recompute(a, pp: int) -> tuple[str, int]:
    """(mode, every) of the recompute arguments: today's `--recompute-granularity` /
    `--recompute-method` / `--recompute-num-layers`, or the 2021 spelling the SC21 paper's
    scripts use (Megatron-LM 6985e58, megatron/arguments.py: `--activations-checkpoint-method
    uniform|block` with `--activations-checkpoint-num-layers`, `--checkpoint-activations`
    read as uniform), which became the full granularity: every block recomputed, or with
    "block" the first n of each stage."""
    method, layers = a.recompute_method, a.recompute_num_layers
    full = a.recompute_granularity == "full"
    if a.activations_checkpoint_method or a.checkpoint_activations:
        full = True
        method = a.activations_checkpoint_method or "uniform"
        layers = a.activations_checkpoint_num_layers or 1
    if full:
        if method == "block" and a.num_layers and layers:
            return "full", max(1, (a.num_layers // pp) // layers)
        return "full", 1
    if a.recompute_granularity == "selective" or a.recompute_activations:
        return "selective", 1
    return "none", 1


def _refuse_expert_tensor_parallel(a, tp: int, ep: int) -> None:
    """Expert parallelism hyplan prices holds each expert whole on one rank: Megatron-Core's
    --expert-tensor-parallel-size 1, whose default is the tensor-parallel size (megatron
    arguments.py), so an EP job over tp > 1 must say 1."""
    etp = a.expert_tensor_parallel_size or tp
    if ep > 1 and etp != 1:
        given = ("" if a.expert_tensor_parallel_size else
                 f" (not given: Megatron-LM's default, --tensor-model-parallel-size {tp})")
        raise JobFileError(f"megatron: --expert-tensor-parallel-size {etp}{given} with "
                           f"--expert-model-parallel-size {ep}: hyplan prices expert "
                           f"parallelism with each expert whole on one rank; pass "
                           f"--expert-tensor-parallel-size 1")


def read_megatron(args: str | list[str], devices: int) -> JobConfig:
    """Megatron-LM's arguments (one string or a list) on `devices` GPUs as a JobConfig;
    arguments that do not bear on parallelism (model size, data, learning rate) are
    passed over, and so are the mixture-of-experts ones in MOE_IGNORED (why, there):
    --expert-model-parallel-size is read (EP carved out of dp x tp, planner.price_job),
    --expert-tensor-parallel-size must be 1 where it is, and --num-experts and
    --moe-router-topk are kept for price_job to check against the model."""
    words = shlex.split(args) if isinstance(args, str) else list(args)
    a, _ = _parser().parse_known_args(words)
    tp = a.tensor_model_parallel_size or 1
    pp = a.pipeline_model_parallel_size or 1
    cp = a.context_parallel_size or 1
    if devices % (tp * pp * cp):
        raise JobFileError(f"megatron: {devices} GPUs do not split into tensor {tp} x "
                           f"pipeline {pp} x context {cp}; fix a size or --devices")
    dp = devices // (tp * pp * cp)
    rows = a.micro_batch_size or 1
    global_batch = a.global_batch_size or rows * dp
    if global_batch % (rows * dp):
        raise JobFileError(f"megatron: --global-batch-size {global_batch} is not a multiple "
                           f"of --micro-batch-size {rows} x data-parallel size {dp}")
    chunks = a.virtual_pipeline_model_parallel_size or 1
    if a.num_layers_per_virtual_pipeline_stage:
        if not a.num_layers:
            raise JobFileError("megatron: --num-layers-per-virtual-pipeline-stage needs "
                               "--num-layers to count the virtual stages")
        chunks = a.num_layers // (pp * a.num_layers_per_virtual_pipeline_stage)
    ep = a.expert_model_parallel_size or 1
    _refuse_expert_tensor_parallel(a, tp, ep)
    recompute, every = _recompute(a, pp)
    precision = "bf16-mixed" if a.bf16 else "fp16-mixed" if a.fp16 else "fp32"
    return JobConfig(global_batch=global_batch, seq_len=a.seq_length or 0,
                     dp_shard=dp if a.use_torch_fsdp2 else 1,
                     dp_replicate=1 if a.use_torch_fsdp2 else dp, tp=tp, pp=pp, cp=cp,
                     ep=ep, experts=a.num_experts or 0, router_topk=a.moe_router_topk or 0,
                     schedule="Interleaved1F1B" if chunks > 1 else "1F1B",
                     microbatches=global_batch // (rows * dp), chunks=chunks,
                     recompute=recompute, recompute_every=every,
                     num_layers=a.num_layers or 0, sequence_parallel=a.sequence_parallel,
                     precision=precision, float8=(
                         "rowwise" if a.fp8_recipe in ("blockwise", "mxfp8") else "tensorwise")
                     if a.fp8_format else "", async_tp=a.tp_comm_overlap,
                     sharded_optimizer=a.use_distributed_optimizer)
