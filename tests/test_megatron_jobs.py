"""Megatron-LM's published GPT runs (the SC21 paper's Table 1, benchmarks/megatron_jobs.py)
read from their own arguments, and hyplan's plan for such a job written back as Megatron-LM
arguments that megatron-core's own config classes accept."""

import os
import sys

import pytest
import torch

import planner
from planner.export import express, read_megatron, to_megatron
from planner.export.megatron import config_fields

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from megatron_jobs import ROWS, build_gpt, sc21_flops


@pytest.mark.parametrize("key", list(ROWS))
def test_each_published_row_reads_as_its_degrees(key):
    """run_table_1.sh's TP, PP, MBS, GBS and virtual stages, on NNODES x 8 GPUs: data
    parallel is what is left (DDP: the 2021 runs had no distributed optimizer), every
    block recomputed (`--activations-checkpoint-method uniform`), fp16."""
    row = ROWS[key]
    job = read_megatron(row.args, row.gpus)
    dp = row.gpus // (row.tp * row.pp)
    vp = row.extra.split("--num-layers-per-virtual-pipeline-stage")
    chunks = row.layers // (row.pp * int(vp[1])) if len(vp) > 1 else 1
    assert (job.tp, job.pp, job.dp_replicate, job.dp_shard) == (row.tp, row.pp, dp, 1)
    assert (job.microbatch_rows, job.global_batch, job.chunks) == (row.mbs, row.gbs, chunks)
    assert job.schedule == ("Interleaved1F1B" if chunks > 1 else "1F1B")
    assert (job.recompute, job.recompute_every, job.precision) == ("full", 1, "fp16-mixed")
    assert (job.seq_len, job.num_layers, job.devices) == (2048, row.layers, row.gpus)


def test_the_145b_row_in_numbers():
    """One row spelled out: 1,536 GPUs = 8 x 8 x 24; 80 layers in 8 stages of 2 virtual
    stages of 5; 2,304 rows in microbatches of 2 over 24 replicas: 48 per step."""
    job = read_megatron(ROWS["145b"].args, 1536)
    assert (job.tp, job.pp, job.dp, job.chunks, job.microbatches) == (8, 8, 24, 2, 48)


@pytest.mark.parametrize("args, every", [
    ("--checkpoint-activations", 1),  # 6985e58: read as uniform
    ("--activations-checkpoint-method uniform --activations-checkpoint-num-layers 4", 1),
    ("--activations-checkpoint-method block --activations-checkpoint-num-layers 2", 4),
    ("--recompute-granularity full --recompute-method uniform", 1),
])
def test_the_2021_recompute_spelling_reads_as_full_recompute(args, every):
    job = read_megatron(f"{args} --num-layers 16 --pipeline-model-parallel-size 2 "
                        f"--global-batch-size 8", 8)
    assert (job.recompute, job.recompute_every) == ("full", every)


def test_no_recompute_argument_is_no_recompute():
    assert read_megatron("--num-layers 16 --global-batch-size 8", 8).recompute == "none"


@pytest.mark.parametrize("key, billions", [("1.7b", 1.7), ("7.5b", 7.5)])
def test_the_model_built_from_the_arguments_has_the_tables_size(key, billions):
    """GPT-2's block at the row's sizes, vocabulary 51,200, tied: the table's parameter
    count (to its one decimal)."""
    model, (ids,), _, seq = build_gpt(ROWS[key].args, 1)
    params = sum(p.numel() for p in model.parameters())
    assert params / 1e9 == pytest.approx(billions, abs=0.05)
    assert (ids.shape, seq) == (torch.Size([1, 2048]), 2048)


def test_the_papers_flops_give_its_training_time():
    """96 B s l h^2 (1 + s/6h + V/16lh) at the table's TFLOP/s per GPU: the 1T row's
    aggregate 502.0 PFLOP/s over 3,072 GPUs, and 450 B tokens in the paper's "about 84
    days" (section 5.1)."""
    row = ROWS["1t"]
    assert row.published_tflops * row.gpus / 1e3 == pytest.approx(502.0, rel=0.01)
    step = sc21_flops(row.gbs, 2048, row.layers, row.hidden) / (row.published_tflops * 1e12
                                                                * row.gpus)
    days = 450e9 / (row.gbs * 2048) * step / 86400
    assert days == pytest.approx(84, rel=0.03)


TINY = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --fp16 --activations-checkpoint-method uniform")


@pytest.fixture(scope="module")
def tiny_plan():
    """hyplan's plan for a published row's kind of job, shrunk to run here: a 4-block GPT
    (the benchmark's builder) on 4 A100."""
    model, inputs, kwargs, _ = build_gpt(TINY, 16)
    return planner.optimize(model, "4xA100-80GB", inputs, kwargs, mesh="auto",
                            tracer="blocks", precision="fp16-mixed", time_limit_s=10)


def test_hyplans_plan_exports_to_arguments_megatron_core_accepts(tiny_plan):
    """hyplan's plan as Megatron-LM arguments: read back to the same job, and its values
    accepted by megatron-core's TransformerConfig (its validation of tp, pp, virtual stages,
    sequence parallel and recompute) at the model's sizes."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import TransformerConfig

    expressed = express(tiny_plan)
    exported = to_megatron(expressed)
    back = read_megatron(exported.text, tiny_plan.num_devices)
    job = expressed.job
    assert (back.tp, back.pp, back.dp, back.chunks, back.microbatches, back.global_batch) == (
        job.tp, job.pp, job.dp, job.chunks, job.microbatches, job.global_batch)
    fields = config_fields(job)
    TransformerConfig(hidden_size=64, num_attention_heads=4, params_dtype=torch.float16,
                      pipeline_dtype=torch.float16, **fields)


# the 145B row's kind of job (tp, pp, 2 virtual stages per rank, microbatches of 1 row,
# full recompute, fp16, DDP), shrunk to a 4-block GPT on 8 devices
SHRUNK = ("--activations-checkpoint-method uniform --tensor-model-parallel-size 2 "
          "--pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 "
          "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --DDP-impl local "
          "--seq-length 32 --max-position-embeddings 32 --fp16 "
          "--num-layers-per-virtual-pipeline-stage 1")


def test_a_published_kind_of_job_priced_and_exported_is_the_same_job():
    """Import, price, export: the priced plan runs the job's mesh and schedule, and its
    Megatron-LM arguments read back to the job's degrees and pass megatron-core's
    TransformerConfig."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import TransformerConfig

    job = read_megatron(SHRUNK, 8)
    assert (job.tp, job.pp, job.dp, job.chunks, job.microbatches) == (2, 2, 2, 2, 8)
    model, inputs, kwargs, _ = build_gpt(SHRUNK, job.global_batch)
    plan = planner.price_job(model, "8xA100-80GB", job, inputs, kwargs, tracer="blocks",
                             time_limit_s=10)
    assert plan.mesh.shape == [2, 2, 2] and plan.microbatches == 8
    assert (plan.pipeline.schedule, plan.pipeline.chunks) == ("Interleaved1F1B", 2)
    back = read_megatron(to_megatron(plan).text, 8)
    assert (back.tp, back.pp, back.dp, back.chunks, back.microbatches, back.recompute) == (
        2, 2, 2, 2, 8, express(plan).job.recompute)
    TransformerConfig(hidden_size=64, num_attention_heads=4, params_dtype=torch.float16,
                      pipeline_dtype=torch.float16, **config_fields(back))


@pytest.mark.parametrize("layers, pp, chunks, departs", [
    (105, 63, 1, True),  # hyplan's 530B plan: 105 blocks over 63 stages
    (128, 6, 1, True),  # its 1T plan
    (96, 24, 1, False),
    (96, 16, 2, False),
    (60, 4, 2, True),  # 7.5 blocks a virtual stage
])
def test_blocks_megatron_cannot_split_evenly_are_a_departure(layers, pp, chunks, departs):
    """Megatron-LM asserts the blocks divide among the (virtual) stages unless told a
    layout: an export with stages it cannot split evenly says so."""
    from planner.export.config import Expressed, JobConfig
    job = JobConfig(global_batch=pp * 4, pp=pp, chunks=chunks, microbatches=pp * 4,
                    schedule="Interleaved1F1B" if chunks > 1 else "1F1B", num_layers=layers)
    exported = to_megatron(Expressed(job))
    assert any("--pipeline-model-parallel-layout" in d.why for d in exported.departures) == departs
