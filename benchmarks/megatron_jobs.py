"""Megatron-LM's published GPT runs, imported from their own arguments, priced by hyplan,
and hyplan's own plan for each job beside them, exported to torchtitan TOML and Megatron-LM
arguments.

    PYTHONPATH=$PWD python benchmarks/megatron_jobs.py [--jobs 1.7b,18b,...]
        [--variants eager,fused,untied] [--no-own]

Each row is the command line Megatron-LM ran (`pretrain_gpt.py` arguments), read by
planner.export.read_megatron and priced by planner.price_job (the 3-D search restricted to
the job's shape, the same price list as hyplan's own plans); the model is a GPT built on
meta from the same arguments (--num-layers, --hidden-size, --num-attention-heads,
--seq-length) through profiler.presets.build_llm.

Source (NVIDIA/Megatron-LM): the SC21 paper's Table 1 (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473),
published in the README's "Training Speed and Scalability" from 50a4b5f (2021-04-08) to
fd5cfec (2024-07-12) as images/cases_april2021.png, with the scripts that ran it,
examples/academic_paper_scripts/sc21/ (read at f2e5db4; the README there names Megatron-LM
6985e58 as the code): run_table_1.sh gives each row's TP, PP, MBS, GBS, layers, hidden,
heads, DDP and extra arguments; CONFIG.sh the rest (seq 2048, --fp16). The table (A100
80 GB, Selene, 8 a node; vocabulary 51,200, sequence 2,048, the README's text):

    | Model | hidden | layers | params (B) | model-parallel | GPUs | batch | TFLOP/s/GPU | % peak |
    | 1.7B  |  2304  |   24   |    1.7     |       1        |   32 |   512 |    137      |  44%   |
    | 3.6B  |  3072  |   30   |    3.6     |       2        |   64 |   512 |    138      |  44%   |
    | 7.5B  |  4096  |   36   |    7.5     |       4        |  128 |   512 |    142      |  46%   |
    | 18B   |  6144  |   40   |   18.4     |       8        |  256 |  1024 |    135      |  43%   |
    | 39B   |  8192  |   48   |   39.1     |      16        |  512 |  1536 |    138      |  44%   |
    | 76B   | 10240  |   60   |   76.1     |      32        | 1024 |  1792 |    140      |  45%   |
    | 145B  | 12288  |   80   |  145.6     |      64        | 1536 |  2304 |    148      |  47%   |
    | 310B  | 16384  |   96   |  310.1     |     128        | 1920 |  2160 |    155      |  50%   |
    | 530B  | 20480  |  105   |  529.6     |     280        | 2520 |  2520 |    163      |  52%   |
    | 1T    | 25600  |  128   | 1008.0     |     512        | 3072 |  3072 |    163      |  52%   |

Its TFLOP/s count the paper's way (section 5.1): F = 96 B s l h^2 (1 + s/6h + V/16lh) per
iteration, which includes the recomputed forward pass (every run here recomputes every
block: `--activations-checkpoint-method uniform`, Megatron-LM 6985e58's full
recomputation); peak is the A100's 312 TFLOP/s (fp16). hyplan's figure is the same F over
its predicted step time; tokens/s/GPU beside it.

The model: Hugging Face's GPT-2 block at Megatron's sizes (pre-LayerNorm, GELU MLP of 4h,
learned positions, biases, input embedding tied to the output layer, as Megatron's GPT of
2021), vocabulary 51,200 (the README's), its attention "eager" (the score matrix written out,
scaled, masked, softmaxed, dropped out and multiplied by V, as Megatron-LM's attention of
2021; no flash attention then). Its FLOPs are the formula's: the formula leaves out the
biases, layer norms and softmax (well under 1%). What differs, and what each variant
(VARIANTS) prices of it: Megatron fuses bias+GELU, scale+mask+softmax and bias+dropout+add,
and runs apex's fused LayerNorm, by default ("fused": hyplan's compile lever, the same
element-wise and normalization fusion); Megatron splits its tied embedding and output
layer by vocabulary over tp, where hyplan keeps a tied pair whole, replicated over tp
(planner.ties.TIED_STRATEGIES) ("untied": an untied pair, which hyplan splits, stands for
it, with a second table's memory and gradient that Megatron does not have).

Not priced as written, and said per row: hyplan's executor runs a torch.export graph
tensor parallel only on microbatches whose rows tp does not divide (3.6B, 7.5B, 18B are
priced with more, smaller microbatches, the same rows a step), and offers 2 or 4 virtual
stages per rank, not the 3 of the 76B and 530B rows (priced at both). Full recompute
(`uniform`, one layer a unit) is priced as price_job prices it: every block recomputed.

The H100 table that replaced it in the README (images/model_table.png, f2e5db4, 2024-07-15:
1.7B-462B on up to 6,144 H100, MFU 41-48%) gives TP, PP, DP and the batch but not the
micro-batch size, virtual pipeline or recompute its runs used, nor their scripts: its rows
are not imported here (any argument written for them would be a guess, not theirs).
"""

from __future__ import annotations

import argparse
import shlex
import time
from dataclasses import dataclass, replace

import planner
from planner.export import express, read_megatron, to_megatron, to_torchtitan
from profiler.presets import build_llm
from strategies.kernel_levers import Levers
from strategies.parse import parse_devices
from torchtitan_jobs import describe as describe_plan
from torchtitan_jobs import fits

A100_PEAK = 312e12  # fp16 dense tensor-core FLOP/s, the paper's "theoretical peak"
VOCAB = 51200  # README: "All models use a vocabulary size of 51,200"
GPUS_PER_NODE = 8  # Selene: DGX A100, 8 GPUs a node


@dataclass(frozen=True)
class Row:
    """One row of run_table_1.sh, and the table's published TFLOP/s per GPU."""

    key: str
    tp: int
    pp: int
    mbs: int
    gbs: int
    layers: int
    hidden: int
    heads: int
    ddp: str
    nodes: int
    extra: str
    published_tflops: float

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE

    @property
    def devices(self) -> str:
        return f"{self.nodes}x{GPUS_PER_NODE}xA100-80GB"

    @property
    def args(self) -> str:
        """The row's command line as CONFIG.sh writes MEGATRON_PARAMS (data, tokenizer,
        learning-rate and logging arguments left out: they do not bear on the step)."""
        return (f"{self.extra} --tensor-model-parallel-size {self.tp} "
                f"--pipeline-model-parallel-size {self.pp} --micro-batch-size {self.mbs} "
                f"--global-batch-size {self.gbs} --num-layers {self.layers} "
                f"--hidden-size {self.hidden} --num-attention-heads {self.heads} "
                f"--DDP-impl {self.ddp} --seq-length 2048 --max-position-embeddings 2048 "
                f"--fp16 --loss-scale 8192").strip()


UNIFORM = "--activations-checkpoint-method uniform"
# run_table_1.sh at f2e5db4, in its order: (TP, PP, MBS, GBS, NLS, HS, NAH, DDP, NNODES,
# MEGATRON_EXTRA_PARAMS), then the table's TFLOP/s per GPU
ROWS = {r.key: r for r in [
    Row("1.7b", 1, 1, 16, 512, 24, 2304, 24, "torch", 4, UNIFORM, 137),
    Row("3.6b", 2, 1, 16, 512, 30, 3072, 32, "torch", 8, UNIFORM, 138),
    Row("7.5b", 4, 1, 16, 512, 36, 4096, 32, "torch", 16, UNIFORM, 142),
    Row("18b", 8, 1, 8, 1024, 40, 6144, 48, "torch", 32, UNIFORM, 135),
    Row("39b", 8, 2, 4, 1536, 48, 8192, 64, "local", 64, UNIFORM, 138),
    Row("76b", 8, 4, 2, 1792, 60, 10240, 80, "local", 128,
        UNIFORM + " --num-layers-per-virtual-pipeline-stage 5", 140),
    Row("145b", 8, 8, 2, 2304, 80, 12288, 96, "local", 192,
        UNIFORM + " --num-layers-per-virtual-pipeline-stage 5", 148),
    Row("310b", 8, 16, 1, 2160, 96, 16384, 128, "local", 240,
        UNIFORM + " --num-layers-per-virtual-pipeline-stage 3", 155),
    Row("530b", 8, 35, 1, 2520, 105, 20480, 128, "local", 315,
        UNIFORM + " --num-layers-per-virtual-pipeline-stage 1", 163),
    Row("1t", 8, 64, 1, 3072, 128, 25600, 160, "local", 384, UNIFORM, 163),
]}


def model_args(args: str) -> argparse.Namespace:
    """The model's sizes from the same command line (read_megatron passes over them)."""
    p = argparse.ArgumentParser(add_help=False)
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length",
                 "--max-position-embeddings"):
        p.add_argument(flag, type=int)
    return p.parse_known_args(shlex.split(args))[0]


def build_gpt(args: str, batch: int, attention: str = "eager", tied: bool = True):
    """(model, inputs, kwargs, seq): Megatron's GPT of these arguments on meta, as GPT-2's
    block (module docstring: what differs). `attention`: transformers' implementation;
    "eager" materializes the score matrix as Megatron-LM's attention of 2021 did."""
    from transformers import GPT2Config

    m = model_args(args)
    config = GPT2Config(n_layer=m.num_layers, n_embd=m.hidden_size,
                        n_head=m.num_attention_heads, n_positions=m.max_position_embeddings,
                        vocab_size=VOCAB, tie_word_embeddings=tied,
                        attn_implementation=attention)
    model, inputs, kwargs = build_llm(config, batch, m.seq_length)
    return model, inputs, kwargs, m.seq_length


def sc21_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int = VOCAB) -> float:
    """FLOPs of one iteration as the SC21 paper counts them (section 5.1, with the
    recomputed forward pass): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    return 96 * batch * seq * layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def tflops_per_gpu(row: Row, step_s: float) -> float:
    return sc21_flops(row.gbs, 2048, row.layers, row.hidden) / step_s / row.gpus / 1e12


def tokens_per_gpu(row: Row, step_s: float) -> float:
    return row.gbs * 2048 / step_s / row.gpus


def describe(plan, row: Row) -> str:
    """torchtitan_jobs' line for a priced plan, its throughput as the paper counts it."""
    step_s = plan.predicted.step_time_s
    return describe_plan(plan, 2048, f"{tflops_per_gpu(row, step_s):.0f} TFLOP/s/GPU as the "
                         f"paper counts, {tokens_per_gpu(row, step_s):,.0f} tokens/s/GPU")


def row_line(row: Row, plan, label: str) -> str:
    """One table line: the published figure, hyplan's, and the error (hyplan's throughput
    over the published, minus one)."""
    step = plan.predicted.step_time_s
    published = published_step(row)
    shown = f"{tflops_per_gpu(row, step):.0f} ({tokens_per_gpu(row, step):,.0f})" + (
        "" if fits(plan) else ", does not fit as priced")
    return (f"  | {row.key} | {label} | {row.published_tflops:.0f} "
            f"({tokens_per_gpu(row, published):,.0f}) | {shown} | "
            f"{published / step - 1:+.1%} |")


def published_step(row: Row) -> float:
    """The step time the table's TFLOP/s per GPU stands for."""
    return sc21_flops(row.gbs, 2048, row.layers, row.hidden) / (
        row.published_tflops * 1e12 * row.gpus)


def differs(job, config) -> str:
    """What of `job` is not `config` (microbatches, virtual stages), in words."""
    what = []
    if job.microbatches != config.microbatches:
        what.append(f"{job.microbatches} microbatches of {job.microbatch_rows} (the job: "
                    f"{config.microbatches} of {config.microbatch_rows})")
    if job.chunks != config.chunks:
        what.append(f"{job.chunks} virtual stages per rank (the job: {config.chunks})")
    return " and ".join(what)


def price_nearest(config, row: Row, built, devices):
    """[(price_job's plan, the job priced, what differs from the job)]: the job itself, or
    the nearest hyplan runs: the fewest more, smaller microbatches where it does not run
    the job's (tensor parallelism on rows tp divides: planner.search.tp_whole_rows), and
    where the job's virtual stages per rank are not ones it offers (2 or 4:
    planner.pipeline.schedules.chunks_allowed), each it does offer (the job's 3 lies
    between them)."""
    model, inputs, kwargs, _ = built
    local = config.global_batch // config.dp
    out, first = [], None
    for v in [config.chunks] if config.chunks in (1, 2, 4) else [2, 4]:
        for m in range(config.microbatches, local + 1):
            if local % m:
                continue
            job = replace(config, microbatches=m, chunks=v)
            try:
                plan = planner.price_job(model, devices, job, inputs, kwargs, tracer="blocks")
            except ValueError as error:
                first = first or error
                continue
            out.append((plan, job, differs(job, config)))
            break
    if not out:
        raise ValueError(f"no job near {config.describe()} runs in hyplan: {first}")
    return out


# the variants priced: (label, what it stands for, compile lever, tied embedding)
VARIANTS = {
    "eager": ("as written", "GPT-2's modules kernel by kernel", False, True),
    "fused": ("fused", "Megatron's default fused kernels, priced as the compile lever",
              True, True),
    "untied": ("fused, vocab-parallel head", ("the same, and the output layer and "
               "embedding split by vocabulary over tp as Megatron's tied pair is (hyplan "
               "keeps a tied pair whole: an untied pair stands for it)"), True, False),
}


def price(row: Row, variants: list[str], own: bool) -> None:
    """One published row: imported, priced beside its figure in each variant (VARIANTS):
    as written, and with Megatron's fused kernels, which its defaults turn on (6985e58
    arguments.py: --masked-softmax-fusion, --bias-gelu-fusion, --bias-dropout-fusion;
    apex's fused LayerNorm), priced as hyplan's torch.compile lever, which fuses the same
    element-wise and normalization work (strategies.fusion); then hyplan's own plan."""
    config = read_megatron(row.args, row.gpus)
    print(f"== {row.key}: GPT {row.layers} x {row.hidden} ({row.heads} heads) on "
          f"{row.devices}")
    print(f"  arguments: {row.args}")
    print(f"  imported: {config.describe()}; global batch {config.global_batch}, seq "
          f"{config.seq_len}, {config.precision}")
    published = published_step(row)
    print(f"  published: {row.published_tflops:.0f} TFLOP/s/GPU as the paper counts, "
          f"{row.published_tflops * 1e12 / A100_PEAK:.0%} of peak: a step of "
          f"{published:.2f} s, {tokens_per_gpu(row, published):,.0f} tokens/s/GPU")
    lines, models, fused = [], {}, None
    for key in variants:
        label, means, compile_, tied = VARIANTS[key]
        if tied not in models:
            models.clear()  # one big model on meta at a time
            models[tied] = build_gpt(row.args, config.global_batch, tied=tied)
        started = time.perf_counter()
        for plan, job, what in price_nearest(replace(config, compile=compile_), row,
                                             models[tied], row.devices):
            shown = label + (f" ({job.chunks} per rank)" if what and job.chunks !=
                             config.chunks else "")
            print(f"  {shown}: {means}; priced in {time.perf_counter() - started:.1f} s"
                  + (f"; not as written: priced with {what}" if what else ""))
            print(f"    {describe(plan, row)}")
            print(f"    solver: {plan.solver.status}, gap {plan.solver.gap:.2%}; "
                  f"{plan.solver.note}")
            lines.append(row_line(row, plan, shown))
            if key == "fused":
                fused = fused or (plan, job)
    print("  | job | priced | published TFLOP/s/GPU (tokens/s/GPU) | hyplan | error |")
    print("\n".join(lines))
    if own:
        own_plan(row, models.get(True) or build_gpt(row.args, config.global_batch),
                 config, fused)
    print()


def own_plan(row: Row, built, config, job) -> None:
    """hyplan's plan for the same model, devices and batch (with the fused kernels'
    lever, as the job's fused price), exported both ways."""
    model, inputs, kwargs, _ = built
    cluster = parse_devices(row.devices)
    cluster = cluster.model_copy(update={"levers": Levers(compile=True)})
    started = time.perf_counter()
    plan = planner.optimize(model, cluster, inputs, kwargs, mesh="auto", tracer="blocks",
                            precision=config.precision)
    print(f"  hyplan's plan (planned in {time.perf_counter() - started:.1f} s, fused):")
    expressed = express(plan)
    # a job that does not fit is no rival in speed: what it needs, never a ratio
    beside = ("no fused price of the job to compare" if job is None else
              f"{job[0].predicted.step_time_s / plan.predicted.step_time_s:.2f}x the fused "
              f"job's throughput" if fits(job[0]) else "the job does not fit: no ratio")
    print(f"    {expressed.job.describe()}: {describe(plan, row)}; {beside}; solver "
          f"{plan.solver.status}, gap {plan.solver.gap:.2%}")
    for d in expressed.departures:
        print(f"    departs: {d}")
    print("    torchtitan TOML:")
    print("\n".join("      " + line for line in to_torchtitan(expressed).text.splitlines()
                    if line))
    megatron = to_megatron(expressed)
    print(f"    Megatron-LM: {megatron.text}")
    for d in megatron.departures[len(expressed.departures):]:
        print(f"    Megatron-LM departs: {d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(ROWS), help="comma-separated: "
                        + ", ".join(ROWS))
    parser.add_argument("--variants", default="eager,fused,untied", help="comma-separated: "
                        + ", ".join(f"{k} ({v[1]})" for k, v in VARIANTS.items()))
    parser.add_argument("--no-own", action="store_true", help="price the published jobs "
                        "only, without hyplan's own plan for each")
    args = parser.parse_args()
    for key in args.jobs.split(","):
        price(ROWS[key], args.variants.split(","), not args.no_own)


if __name__ == "__main__":
    main()
