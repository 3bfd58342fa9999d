"""Expert-parallel jobs (Megatron-LM's --expert-model-parallel-size, torchtitan's
expert_parallel_degree) read and priced: the MoE arguments read_megatron takes, the
published MoE Parallel Folding runs (benchmarks/megatron_moe_jobs.py) read as their table
says, every experts layer of an ep job run in its EP group of ep ranks, and an ep hyplan
does not price refused naming the field."""

import os
import sys

import pytest
import torch

import planner
from planner.export import read_megatron
from planner.export.config import JobConfig
from planner.export.megatron import config_fields
from planner.export.torchtitan import JobFileError
from profiler.presets import build_llm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from megatron_moe_jobs import RUNS, build, megatron_flops  # noqa: E402
from moe_zoo import MOE_ZOO  # noqa: E402

MOE_ARGS = ("--tensor-model-parallel-size 2 --expert-model-parallel-size 4 "
            "--expert-tensor-parallel-size 1 --num-experts 8 --moe-router-topk 2 "
            "--moe-grouped-gemm --moe-token-dispatcher-type alltoall "
            "--moe-expert-capacity-factor 1.0 --micro-batch-size 2 --global-batch-size 8 "
            "--seq-length 8 --sequence-parallel --use-distributed-optimizer --bf16")


def test_read_megatron_reads_the_moe_flags():
    """ep, the experts and their top-k are read; the dispatcher, grouped GEMM and capacity
    factor are passed over; written back, the job asks for expert tensor parallel 1."""
    job = read_megatron(MOE_ARGS, 8)
    assert (job.tp, job.dp, job.ep, job.experts, job.router_topk) == (2, 4, 4, 8, 2)
    fields = config_fields(job)
    assert (fields["expert_model_parallel_size"], fields["expert_tensor_parallel_size"],
            fields["num_moe_experts"], fields["moe_router_topk"]) == (4, 1, 8, 2)


@pytest.mark.parametrize("etp, says", [
    ("--expert-tensor-parallel-size 2", "--expert-tensor-parallel-size 2"),
    ("", "not given: Megatron-LM's default"),  # its default is the tensor-parallel size
])
def test_expert_tensor_parallel_other_than_one_is_refused(etp, says):
    args = MOE_ARGS.replace("--expert-tensor-parallel-size 1", etp)
    with pytest.raises(JobFileError, match="--expert-tensor-parallel-size") as error:
        read_megatron(args, 8)
    assert says in str(error.value)


@pytest.mark.parametrize("key, gpus, tp, ep, pp, dp", [
    ("mixtral-8x22b", 128, 2, 8, 8, 8),
    ("qwen2-57b-a14b", 64, 2, 4, 4, 8),
])
def test_the_published_runs_read_as_table_3(key, gpus, tp, ep, pp, dp):
    """Table 3's "MCore w/ Folding" rows: GPUs, TP, EP, PP (CP 1, ETP 1), global batch 256
    of 4,096 tokens; data parallel is what is left."""
    run = RUNS[key]
    job = read_megatron(run.args(), run.gpus)
    assert (job.devices, job.tp, job.ep, job.pp, job.dp, job.cp) == (gpus, tp, ep, pp, dp, 1)
    assert (job.global_batch, job.seq_len, job.precision) == (256, 4096, "bf16-mixed")


@pytest.mark.parametrize("key", list(RUNS))
def test_megatrons_flop_count_is_six_active_params_and_attention(key):
    """The FLOPs the benchmark's MFU counts (Megatron-LM's formula) and hyplan's own
    (6 x active parameters + attention) agree within 1% on both models: the routed
    experts, shared expert and attention are the same terms."""
    _, _, _, shape, config = build(RUNS[key])
    ours = shape.flops_per_token(4096) * 256 * 4096
    assert megatron_flops(config) == pytest.approx(ours, rel=0.01)


def _mixtral(batch: int):
    """The zoo's tiny Mixtral (4 experts, 2 per token) and a batch of `batch` rows."""
    model = MOE_ZOO["mixtral"].make()
    ids = torch.randint(0, 64, (batch, 8), generator=torch.Generator().manual_seed(0))
    return model, (ids,)


@pytest.mark.parametrize("fsdp, pinned", [
    (False, "expert_parallel:ep4"),  # Megatron-LM: replicas, the distributed optimizer
    (True, "expert_parallel:ep4+fsdp"),  # torchtitan: FSDP2 over dp_shard
])
def test_an_ep_job_runs_every_experts_layer_in_its_ep_group(fsdp, pinned):
    """tp 2 x dp 4 on 8 devices, ep 4: each experts layer over 4 ranks (the tp groups of 2
    replicas), its experts replicated over the 2 ranks holding the same ones, or
    FSDP-sharded over them where the job runs FSDP2."""
    model, inputs = _mixtral(8)
    dp = {"dp_shard": 4} if fsdp else {"dp_replicate": 4, "sharded_optimizer": True}
    job = JobConfig(global_batch=8, seq_len=8, tp=2, ep=4, sequence_parallel=True, **dp)
    plan = planner.price_job(model, "8xH100", job, inputs, {"use_cache": False},
                             tracer="blocks", time_limit_s=10, search_time_s=30)
    experts = [l for l in plan.layers if l.kind == "MixtralExperts"]
    assert len(experts) == 2
    assert all(l.strategy + ("+fsdp" if l.dp_shard else "") == pinned for l in experts)
    assert plan.mesh.shape == [1, 4, 2]


@pytest.mark.parametrize("tp, ep, dp", [
    (2, 3, 4),  # not a multiple of tp
    (2, 16, 4),  # more than a stage's dp x tp ranks
    (4, 8, 1),  # a multiple of tp, but dp 1 leaves no replica to carve from
])
def test_an_ep_that_is_no_ep_group_is_refused_naming_the_field(tp, ep, dp):
    job = JobConfig(global_batch=dp * 2, tp=tp, ep=ep, dp_replicate=dp)
    with pytest.raises(ValueError, match="--expert-model-parallel-size"):
        planner.price_job(torch.nn.Linear(4, 4), f"{tp * dp}xH100", job,
                          (torch.zeros(dp * 2, 4),))


def test_an_ep_job_of_a_model_without_experts_is_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=16)
    model, inputs, kwargs = build_llm(config, 4, 8)
    job = JobConfig(global_batch=4, seq_len=8, dp_replicate=4, ep=2)
    with pytest.raises(ValueError, match="has no experts layer"):
        planner.price_job(model, "4xH100", job, inputs, kwargs, tracer="blocks")
