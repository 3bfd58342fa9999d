"""Exported jobs load in the frameworks' own config code: torchtitan's ConfigManager reads
the TOML (torchtitan 0.2.2, --no-deps; its package __init__ imports triton kernels, so the
config subpackage is imported under a bare package module), megatron-core's
TransformerConfig validates the Megatron values."""

import functools
import importlib.util
import sys
import types
from dataclasses import replace

import pytest
import torch

import planner
from planner.export import JobConfig, express, read_megatron, read_torchtitan
from planner.export.megatron import arguments, config_fields
from planner.export.torchtitan import sections, toml_text
from tests.models import deep_mlp, mlp

JOBS = [JobConfig(global_batch=16, seq_len=8192, dp_shard=8, recompute="full", sequence_parallel=False),
        JobConfig(global_batch=256, seq_len=8192, dp_shard=32, tp=8, sequence_parallel=True,
                  recompute="full", num_layers=80),
        JobConfig(global_batch=256, seq_len=8192, dp_shard=8, tp=8, pp=8, chunks=2,
                  schedule="Interleaved1F1B", microbatches=32, num_layers=128,
                  recompute="full", sequence_parallel=True)]


def _torchtitan_config():
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None:
            pytest.skip("torchtitan not installed (pip install --no-deps torchtitan==0.2.2 tyro)")
        pkg = types.ModuleType("torchtitan")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = pkg
    from torchtitan.config import ConfigManager
    return ConfigManager


@pytest.mark.parametrize("job", JOBS)
def test_torchtitan_reads_the_exported_toml(job, tmp_path):
    ConfigManager = _torchtitan_config()
    path = tmp_path / "job.toml"
    path.write_text(toml_text(sections(job)))
    parsed = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert parsed.parallelism.data_parallel_shard_degree == job.dp_shard
    assert parsed.parallelism.tensor_parallel_degree == job.tp
    assert parsed.parallelism.pipeline_parallel_degree == job.pp
    assert parsed.training.global_batch_size == job.global_batch
    # a torchtitan job names its model by flavor, not by block count: that comes from the model
    back = read_torchtitan(path.read_text(), devices=job.devices)
    assert replace(back, num_layers=job.num_layers) == job


@pytest.mark.parametrize("job", JOBS)
def test_megatron_core_accepts_the_exported_values(job):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer import TransformerConfig
    fields = config_fields(job)
    fields.setdefault("num_layers", 8 * job.pp)
    TransformerConfig(hidden_size=64, num_attention_heads=8, params_dtype=torch.bfloat16,
                      pipeline_dtype=torch.bfloat16, **fields)
    back = read_megatron(arguments(job), job.devices)
    assert (back.tp, back.pp, back.dp, back.chunks, back.microbatches) == (
        job.tp, job.pp, job.dp, job.chunks, job.microbatches)


# --- planner.price_job: a job priced as the plan it runs -------------------------------------

def _x():
    return (torch.randn(64, 16),)


def test_price_job_runs_the_jobs_degrees_with_fsdp_pinned():
    """FSDP 2 x TP 4: the priced plan's mesh is the job's, every layer with weights is
    sharded over dp, and each Linear runs one of its tensor-parallel splits (the recipe)."""
    job = JobConfig(global_batch=64, dp_shard=2, tp=4, microbatches=2, precision="fp32")
    plan = planner.price_job(mlp(), "2x4xA100", job, _x(), measure=False)
    assert plan.mesh.shape == [1, 2, 4] and plan.microbatches == 2 and plan.pipeline is None
    weighted = [l for l in plan.layers if l.param_bytes]
    assert weighted and all(l.dp_shard and not l.hsdp for l in weighted)
    assert express(plan).job.describe() == job.describe()


@pytest.mark.parametrize("kind", ["fsdp_tp", "ddp", "fsdp"])
def test_pricing_an_expressed_plan_gives_its_step_time(kind):
    """A plan hyplan's frameworks can run as written (a baseline: one split for every layer)
    read into a JobConfig and priced back costs what the plan costs: one price list. The
    1-D DDP and FSDP plans come back from the 3-D search of shape 1 x N x 1."""
    plan = planner.baseline(mlp(), "2x4xA100", kind, _x(), measure=False)
    job = express(plan).job
    priced = planner.price_job(mlp(), "2x4xA100", job, _x(), measure=False)
    assert priced.mesh.shape == [1, job.dp, job.tp]
    assert priced.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


def test_pricing_a_pipeline_plan_with_a_per_layer_shard_comes_close():
    """The pipeline baseline shards some layers over dp and replicates others (a departure
    express names); the job shards them all, so its price differs by those layers' sync
    alone: within 0.1%, not equal."""
    plan = planner.baseline(deep_mlp(), "4xA100", "pipeline", _x(), measure=False)
    expressed = express(plan)
    priced = planner.price_job(deep_mlp(), "4xA100", expressed.job, _x(), measure=False)
    assert priced.pipeline is not None and priced.mesh.shape == plan.mesh.shape
    assert priced.pipeline.schedule == plan.pipeline.schedule
    assert priced.predicted.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-3)


def test_price_job_refuses_a_degree_it_cannot_price_by_name():
    job = JobConfig(global_batch=64, dp_shard=2, cp=2)
    with pytest.raises(ValueError, match="price_job: cp 2 .* not priced"):
        planner.price_job(mlp(), "4xA100", job, _x(), measure=False)


def test_price_job_refuses_expert_parallelism_of_a_model_without_experts():
    """ep is priced (tests/test_megatron_moe_jobs.py) where the model has experts layers:
    an MLP has none, and the field is named."""
    job = JobConfig(global_batch=64, dp_shard=4, ep=2)
    with pytest.raises(ValueError, match="--expert-model-parallel-size.*no experts layer"):
        planner.price_job(mlp(), "4xA100", job, _x(), measure=False)


def test_price_job_names_a_batch_or_device_count_that_does_not_match():
    with pytest.raises(ValueError, match="global batch is 32"):
        planner.price_job(mlp(), "4xA100", JobConfig(global_batch=32, dp_shard=4), _x(),
                          measure=False)
    with pytest.raises(ValueError, match="multiply to 2 devices"):
        planner.price_job(mlp(), "4xA100", JobConfig(global_batch=64, dp_shard=2), _x(),
                          measure=False)


def test_a_job_that_does_not_fit_is_priced_and_says_so():
    job = JobConfig(global_batch=64, dp_replicate=4, precision="fp32")
    plan = planner.price_job(mlp(), "4xA100", job, _x(), measure=False,
                             memory_limit_bytes=1e3)
    assert plan.predicted.memory_limit_bytes == 1e3
    assert max(plan.predicted.memory_bytes) > 1e3 and plan.predicted.step_time_s > 0


@functools.cache
def _tiny_meta_llama():
    """A 2-block Llama built on meta and a batch of 8 sequences of 16 token ids for it: one
    instance for the file's tests, traced once (planner.profiled keeps traces per model)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return model, torch.zeros(8, 16, dtype=torch.long, device="meta")


def test_price_job_carries_the_pipeline_schedule_and_microbatches_of_a_decoder():
    """A tiny Llama (torch.export, cut at its blocks) priced as FSDP 2 x PP 2, interleaved
    1F1B with 2 stages per rank and 4 microbatches: the plan runs that schedule, and its
    full activation checkpointing recomputes every block (as torchtitan's "full" mode does,
    though memory does not need it here); "selective" recomputes only what memory needs."""
    model, ids = _tiny_meta_llama()
    job = JobConfig(global_batch=8, seq_len=16, dp_shard=2, pp=2, chunks=2, microbatches=4,
                    schedule="Interleaved1F1B", recompute="full", num_layers=2)
    plan = planner.price_job(model, "4xA100", job, (ids,), {"use_cache": False})
    assert plan.mesh.shape == [2, 2, 1] and plan.microbatches == 4
    assert (plan.pipeline.schedule, plan.pipeline.chunks) == ("Interleaved1F1B", 2)
    assert "'full' priced as every block recomputed" in plan.solver.note
    assert plan.recompute_blocks and sorted(plan.recompute_blocks) == sorted(
        f"model.layers.{i}" for i in range(2)), plan.recompute_blocks
    assert "dp_shard 2 x pp 2, Interleaved1F1B (2 per rank)" in plan.mesh_choice
    selective = planner.price_job(model, "4xA100", replace(job, recompute="selective"), (ids,),
                                  {"use_cache": False})
    assert "where memory needs it" in selective.solver.note and not selective.recompute_blocks
    assert selective.predicted.step_time_s < plan.predicted.step_time_s
    assert express(plan).job.seq_len == 16


def test_price_job_prices_torchtitans_tp_sequence_parallel_with_its_levers():
    """A tiny Llama priced as torchtitan runs FSDP 2 x TP 2 (read_torchtitan sets
    sequence_parallel over tp) with compile: the norms and residual adds run on their
    tokens (as torchtitan's apply_tp), microbatches whose rows tp divides are priced (its
    DTensor hooks take any rows), the levers are on the plan's cluster and named; without
    sequence parallelism the same job is refused those rows, as hyplan's executor is."""
    model, ids = _tiny_meta_llama()
    job = JobConfig(global_batch=8, seq_len=16, dp_shard=2, tp=2, recompute="full",
                    num_layers=2, sequence_parallel=True, compile=True)
    plan = planner.price_job(model, "4xH100", job, (ids,), {"use_cache": False})
    levers = plan.cluster.levers
    assert levers.compile and levers.sequence_parallel and not levers.async_tp
    assert "kernel levers priced: torch.compile + sequence parallel + loss parallel" \
        in plan.solver.note
    assert express(plan).job.compile  # the levers it was priced with, handed back
    norms = [l for l in plan.layers if l.name.endswith("layernorm")]
    assert norms and all(l.strategy.startswith("sequence_parallel") for l in norms)
    with pytest.raises(ValueError, match="tensor_parallel_degree 2 with microbatches of 4"):
        planner.price_job(model, "4xH100", replace(job, sequence_parallel=False), (ids,),
                          {"use_cache": False})


def test_a_plan_over_tp_keeps_its_sequence_length_and_an_mlp_has_none():
    """Over tp the token input is replicated (whole rows per tp rank), not "batch": its
    sequence is still the job's seq_len. An MLP's batch x features input is no sequence."""
    plan = planner.baseline(mlp(), "2x4xA100", "fsdp_tp", _x(), measure=False)
    assert plan.inputs[0].layout != "batch" and express(plan).job.seq_len == 0


def test_a_december_2024_torchtitan_file_splits_the_local_batch_per_pipeline_rank():
    """torchtitan's files of that time keep the degrees under [training] and
    [experimental]; torchtitan then (9dec370) split each local batch into
    pipeline_parallel_degree microbatches, interleaved or not."""
    text = ("[training]\nbatch_size = 32\nseq_len = 8192\ndata_parallel_shard_degree = -1\n"
            "tensor_parallel_degree = 8\n[experimental]\npipeline_parallel_degree = 8\n"
            "pipeline_parallel_schedule = 'Interleaved1F1B'\n")
    job = read_torchtitan(text, devices=512)
    assert (job.dp_shard, job.tp, job.pp, job.chunks) == (8, 8, 8, 2)
    assert (job.global_batch, job.microbatches, job.microbatch_rows) == (256, 8, 4)


def test_a_job_over_tp_keeps_no_copies_inside_recomputed_blocks_and_a_loss_shard():
    """torchtitan's FSDP 2 x TP 2 with full checkpointing: the layout changes inside a
    recomputed block (the all-gathered input of its column-parallel Linears) are made again
    in backward, not kept, so a plan holds only the copies outside blocks; and its loss
    reads each rank's vocabulary shard (loss parallel), 1/tp of the logits a rank holds."""
    from planner.pipeline import stage_held
    from planner.profiled import profiled_graph
    from planner.search import Shape, search
    from strategies.kernel_levers import Levers
    from strategies.parse import parse_devices
    model, ids = _tiny_meta_llama()
    levers = Levers(sequence_parallel=True, loss_parallel=True)
    devices = parse_devices("4xH100").model_copy(update={"levers": levers})
    graph, cluster = profiled_graph(model, devices, (ids,), {"use_cache": False},
                                    tracer="blocks")
    saved = {}
    for every in (False, True):
        shape = Shape(1, 2, 2, 1, "1F1B", recompute=True, recompute_all=every)
        found = search(graph, cluster, "adam", None, only=[shape], time_limit_s=10)
        built, choice = found.built, found.best.solution.choice
        stage = [0] * len(built.problem.layers)
        saved[every] = stage_held._reshard_copies(built, choice, stage, [0], shape, [1])[0][0]
        inside = [e for e in built.problem.edges if e.dst < len(built.layers)
                  and stage_held._recomputed(built.problem.layers[e.dst], choice[e.dst])]
        assert bool(inside) == every
        shares = dict(stage_held._outputs(built, choice, set(graph.outputs), 2, True))
        assert list(shares.values()) == [0.5]  # the head's vocabulary shard, not the whole
    assert 0 < saved[True] < saved[False]


def test_a_megatron_job_without_its_distributed_optimizer_is_priced_as_ddp():
    """Megatron-LM's replicas beside tp are plain DDP unless --use-distributed-optimizer
    shards the optimizer state: without it no layer is priced FSDP-sharded over dp."""
    model, ids = _tiny_meta_llama()
    args = ("--tensor-model-parallel-size 2 --micro-batch-size 4 --global-batch-size 8 "
            "--seq-length 16 --sequence-parallel --bf16 --num-layers 2")
    plain = read_megatron(args, devices=4)
    assert not plain.sharded_optimizer
    assert read_megatron(args + " --use-distributed-optimizer", devices=4).sharded_optimizer
    kw = {"example_kwargs": {"use_cache": False}}
    held = max(planner.price_job(model, "4xH100", plain, (ids,), **kw).predicted.memory_bytes)
    # below what DDP holds: the distributed optimizer's job may shard weights to fit there
    tight = dict(kw, memory_limit_bytes=0.9 * held)
    sharded = planner.price_job(model, "4xH100", replace(plain, sharded_optimizer=True),
                                (ids,), **tight)
    assert any(l.dp_shard for l in sharded.layers)
    ddp = planner.price_job(model, "4xH100", plain, (ids,), **tight)
    assert not any(l.dp_shard for l in ddp.layers)
