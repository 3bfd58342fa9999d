"""Fidelity: the cost model's predicted step time against the step time measured when the
plan runs for real, for several models and every plan kind, on 2 and 4 gloo processes.

Models: the MLP of examples/mlp.py (batch 32), the FC-heavy CNN of benchmarks/fc_heavy_cnn.py
(batch 32), a small all-convolutional-ish CNN (batch 32), a tiny GPT from examples/gpt.py
(2 layers, width 128, 4 heads, 64 tokens, vocabulary 512; batch 8), and two Hugging Face
models traced by torch.export, random init: GPT-2 and Llama (2 layers, width 128, 4 heads,
Llama with 2 key-value heads and a 512-wide MLP; 64 tokens, vocabulary 512; batch 8). Plan kinds:
pure data parallel (`planner.baseline(..., "ddp")`), pure model parallel (`"tensor"`,
Megatron-style), sharded data parallel (`"fsdp"`, FSDP2 on every layer), pipeline stages
(`"pipeline"`, run through `executor.train_step`; fx-traced models only) and hyplan's chosen hybrid
(`planner.optimize`), all planned as a user plans: `--devices Nxcpu`, priced with the
profile hyplan makes on first use (the quick calibration, into a fresh cache directory
unless --cache-dir or --profile is given; its seconds are reported), all run by `executor.parallelize` in one loop: SGD (lr 0.01, foreach=False), the model's
loss, 4 warm-up steps, then --steps timed steps. Plans that are the same plan (hyplan's
choice is often one of the baselines) are one program: they are run once and share the
figure, so that a difference between them is never noise.
Each model is planned and then run in a launch of its own, as a user's job holds one
model; --runs runs go over its cases in turn, so a slow spell hits different cases in
different runs; a case's figure is the slowest
rank's median over all its timed steps of all runs (single steps of one plan vary by
-30%..+60% here: gloo wake-ups, the scheduler, the other rank), and "spread" is the range of
its per-run medians over that figure (the run-to-run spread). The ranks keep freed memory (profiler.allocator)
as layer timing does.

Beside each figure: the CPU (in cores) that processes other than the ranks used during the
round, from /proc/stat less the ranks' own CPU time; each case reports its round with the
most such load; and "host", how much slower this machine ran a fixed op (`_probe_s`: a
Linear's forward and backward, one process alone, by CPU time) during the runs than while
the model's layers were timed for its plans. This VM's speed drifts by tens of percent
over minutes, and a plan priced in one spell and run in another carries that drift into
its error: the column says how much of an error is the machine's. "replan": how far a
second planning of the model (minutes later, every layer timed afresh) moved the same
plan's prediction: one planning prices a plan at the speed of its few seconds of layer
timing, and this is that share of an error, case by case. With P processes on a
2-core machine anything else running skews the timing; rerun on an idle machine for final
figures.

    python benchmarks/fidelity.py [--procs 2 4] [--runs 3] [--steps 8] [--no-replan]
                                  [--cache-dir DIR | --profile FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import executor  # noqa: E402
import planner  # noqa: E402
from planner.baseline import baseline  # noqa: E402
from profiler.launch import RanksOtherLoad, run_ranks, wait_for_quiet  # noqa: E402
from profiler.profile import forget_layer_times  # noqa: E402
from profiler.machine import threads as thread_count  # noqa: E402

WARMUP, LR = 4, 0.01


# --- the models: (model, inputs, targets, loss) from a seed -----------------------------------

def _mlp(batch):
    from examples.mlp import MLP

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return (MLP(), torch.randn(batch, 1024, generator=g),
            torch.randint(0, 1000, (batch,), generator=g), F.cross_entropy)


def _fc_cnn(batch):
    from fc_heavy_cnn import build_model, make_batch

    x, y = make_batch(batch)
    return build_model(), x, y, F.cross_entropy


def _small_cnn(batch):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10))
    g = torch.Generator().manual_seed(1)
    return (model, torch.randn(batch, 3, 32, 32, generator=g),
            torch.randint(0, 10, (batch,), generator=g), F.cross_entropy)


def _gpt(batch):
    from examples.gpt import GPT, NextTokenLoss

    class TinyGPT(GPT):
        """examples/gpt.py's GPT with the position embedding expanded to the batch before the
        add: the planner's layouts assume dim 0 of every input of a row-wise op is the
        batch, and a broadcast (seq, width) operand would be sliced by rows (a known gap)."""

        def forward(self, ids):
            tokens = self.wte(ids)
            x = tokens + self.wpe(self.positions).expand_as(tokens)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    torch.manual_seed(0)
    model = TinyGPT(layers=2, width=128, heads=4, seq=64, vocab=512)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (batch, 64), generator=g)
    targets = torch.randint(0, 512, (batch, 64), generator=g)
    return model, ids, targets, NextTokenLoss()


def _hf_lm(config_name: str, model_name: str, **config):
    """A Hugging Face causal LM from its config (random init, dropout off, no cache: what
    tests/zoo.py builds, at a width whose step takes tens of ms here), traced by
    torch.export; 64 tokens, vocabulary 512, next-token loss on the logits."""
    def build(batch):
        import transformers

        cfg = getattr(transformers, config_name)(vocab_size=512, bos_token_id=0,
                                                 eos_token_id=0, **config)
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
            if hasattr(cfg, key):
                setattr(cfg, key, 0.0)
        cfg.use_cache = False
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(cfg).train()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 512, (batch, 64), generator=g)
        targets = torch.randint(0, 512, (batch, 64), generator=g)

        def loss(output, target):
            # the model's output object, or a pipeline's last stage's logits tensor
            logits = getattr(output, "logits", output)
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())

        return model, ids, targets, loss
    return build


MODELS = {"mlp": (_mlp, 32), "fc_cnn": (_fc_cnn, 32), "small_cnn": (_small_cnn, 32),
          "gpt_tiny": (_gpt, 8),
          "hf_gpt2": (_hf_lm("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=128,
                             n_head=4, n_positions=128), 8),
          "hf_llama": (_hf_lm("LlamaConfig", "LlamaForCausalLM", hidden_size=128,
                              intermediate_size=512, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=128, pad_token_id=0), 8)}


def _leaves(model_key: str) -> tuple:
    """Modules kept whole. The attention splits its qkv output into a tuple, which the
    planner does not track layouts through yet (a known gap): it runs as one layer."""
    if model_key == "gpt_tiny":
        from examples.gpt import CausalSelfAttention

        return (CausalSelfAttention,)
    return ()
BASELINE_KINDS = ("ddp", "tensor", "fsdp")  # hyplan's plan is compared with the fastest


# --- inside each rank ----------------------------------------------------------------------

class _NothingToUpdate:
    """The optimizer of a rank that holds no parameters (torch's refuse an empty list)."""

    def zero_grad(self):
        pass

    def step(self):
        pass


class Case:
    """One plan of one model, parallelized on this rank, ready to time."""

    def __init__(self, model_key: str, plan_json: str):
        plan = planner.Plan.from_json(plan_json)
        build, batch = MODELS[model_key]
        model, x, y, self.loss_fn = build(batch)
        self.plan = plan
        self.model = executor.parallelize(model, plan, leaf_modules=_leaves(model_key))
        # a pipelined plan's schedule owns forward and backward: executor.train_step runs
        # it on the global batch; the rest run the user's own loop on this rank's rows
        self.x, self.y = (x, y) if plan.is_mesh_3d else executor.shard_batch(plan, (x, y))
        params = list(self.model.parameters())
        # a pipeline stage of parameter-free layers has nothing to update on its ranks
        self.opt = (torch.optim.SGD(params, lr=LR, foreach=False) if params
                    else _NothingToUpdate())

    def step(self):
        if self.plan.is_mesh_3d:
            executor.train_step(self.model, self.plan, (self.x, self.y), self.loss_fn,
                                self.opt)
            return
        loss = self.loss_fn(self.model(self.x), self.y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def timed(self, steps: int) -> tuple[list[float], float]:
        """(seconds per step, cores other processes used meanwhile)."""
        for _ in range(WARMUP):
            self.step()
        dist.barrier()
        times = []
        with RanksOtherLoad() as other:  # the ranks' gather on leaving: after the steps
            for _ in range(steps):
                t0 = time.perf_counter()
                self.step()
                times.append(time.perf_counter() - t0)
        return times, other.cores


def _probe_s() -> float:
    """CPU seconds of a fixed op in this process (median of 9): a 1024-wide Linear's
    forward and backward on 64 rows, the speed of this machine now (one thread)."""
    from profiler.profile import median_time

    torch.manual_seed(0)
    linear = nn.Linear(1024, 1024)
    x = torch.randn(64, 1024)
    with thread_count(1):
        return median_time(lambda: linear(x.detach().requires_grad_(True)).sum().backward(),
                           9, budget_s=0.0, clock=time.process_time)


def _probe_alone() -> float:
    """`_probe_s` on rank 0 with the other ranks idle in a barrier (as a layer is timed
    for a plan: one process on the machine)."""
    dist.barrier()
    seconds = _probe_s() if dist.get_rank() == 0 else 0.0
    dist.barrier()
    return seconds


def _wait_for_quiet(max_wait_s: float) -> None:
    """Rank 0 waits for other load to pause (profiler.launch.wait_for_quiet); all go."""
    if dist.get_rank() == 0 and max_wait_s > 0:
        wait_for_quiet(max_wait_s)
    dist.barrier()


def _rank(rank: int, world: int, cases: list[tuple[str, str, str]], steps: int,
          rounds: int, max_wait_s: float) -> dict:
    """{"cases": [case][round] -> (step times, other CPU), "probe": [`_probe_alone`
    before each round and after the last]}. Rounds go over all cases in turn, so a burst
    of load elsewhere on the machine hits different cases in different rounds."""
    built = [Case(model_key, plan_json) for _, model_key, plan_json in cases]
    out: list[list] = [[] for _ in built]
    probes = []
    for _ in range(rounds):
        probes.append(_probe_alone())
        for i, case in enumerate(built):
            _wait_for_quiet(max_wait_s)
            out[i].append(case.timed(steps))
    probes.append(_probe_alone())
    return {"cases": out, "probe": probes}


# --- the parent ------------------------------------------------------------------------------

def plans_for(model_key: str, cluster) -> dict[str, planner.Plan]:
    build, batch = MODELS[model_key]
    model, x, _, _ = build(batch)
    leaves = _leaves(model_key)
    out = {kind: baseline(model, cluster, kind, (x,), optimizer="sgd", leaf_modules=leaves)
           for kind in BASELINE_KINDS}
    try:  # pipeline stages (pp >= 2, no tensor parallelism): where the model can be cut
        out["pipeline"] = baseline(model, cluster, "pipeline", (x,), optimizer="sgd",
                                   leaf_modules=leaves)
    except (ValueError, planner.PlanDoesNotFit) as error:
        print(f"{model_key}: no pipeline plan ({error})")
    out["hyplan"] = planner.optimize(model, cluster, example_inputs=(x,), optimizer="sgd",
                                     leaf_modules=leaves)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="plan on this profile from `hyplan calibrate --out` "
                        "(default: as a user does, `Nxcpu` with the profile made on first use)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="hyplan's cache directory to plan with (default: a fresh one, so "
                        "that first use calibrates as it does for a new user)")
    parser.add_argument("--procs", "--worlds", dest="worlds", type=int, nargs="+",
                        default=[2, 4], help="gloo processes (2, 4 or both)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per case and run")
    parser.add_argument("--runs", "--rounds", dest="rounds", type=int, default=3,
                        help="runs over all cases; a case's figure is the median of all its "
                        "steps, its spread the range of its per-run medians")
    parser.add_argument("--wait", type=float, default=10.0,
                        help="seconds to wait, before each case, for other load to pause")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--replan", action=argparse.BooleanOptionalAction, default=True,
                        help="plan each model a second time, its layers timed afresh, and "
                        "report how far that moved each plan's prediction (the machine's "
                        "share of an error: one planning is one window of its speed)")
    args = parser.parse_args()

    import tempfile

    from strategies import parse_devices

    started = time.perf_counter()
    os.environ["HYPLAN_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="hyplan-cache-")
    print(f"hyplan cache: {os.environ['HYPLAN_CACHE_DIR']}")

    rows = []
    for world in args.worlds:
        began = time.perf_counter()
        cluster = parse_devices(f"{world}x{args.profile}" if args.profile else f"{world}xcpu")
        first = time.perf_counter() - began
        began = time.perf_counter()
        parse_devices(f"{world}x{args.profile}" if args.profile else f"{world}xcpu")
        print(f"{world} processes: priced with {cluster.source}; first use {first:.1f} s, "
              f"then {time.perf_counter() - began:.3f} s")
        for model_key in args.models:
            rows += _plan_and_run(model_key, cluster, world, args)
    _report(rows, args, time.perf_counter() - started)


def _plan_and_run(model_key: str, cluster, world: int, args) -> list[dict]:
    """One model, as a user has it: its plans made (layers timed on this machine), then
    run right after in a launch of their own, every plan in turn for --runs rounds (one
    launch per model, not one for all six: a job holds one model, and the machine's
    speed has less time to drift between a model's planning and its runs)."""
    wait_for_quiet(args.wait)  # layers are timed while planning
    before = _probe_s()
    plans = plans_for(model_key, cluster)
    planned = (before + _probe_s()) / 2
    again = _plan_again(model_key, cluster, args.wait) if args.replan else {}
    cases, runs, run_of = [], [], {}
    for kind, plan in plans.items():
        program = _program(plan)
        if program not in run_of:  # the same plan twice is one program: run once
            run_of[program] = len(runs)
            runs.append((kind, model_key, plan.to_json()))
        cases.append((kind, plan, run_of[program]))
    ranks = run_ranks(_rank, world, runs, args.steps, args.rounds, args.wait, timeout_s=3600)
    results = [r["cases"] for r in ranks]
    probe = statistics.median(ranks[0]["probe"])
    print(f"{world} processes, {model_key}: the probe ran {planned * 1e3:.2f} ms while "
          f"planning, {probe * 1e3:.2f} ms in the runs (before each and after the last: "
          + ", ".join(f"{p * 1e3:.2f}" for p in ranks[0]["probe"]) + " ms)")
    rows = []
    for kind, plan, i in cases:
        # every timed step of every round, pooled: a rank's median over them, the slowest
        # rank's figure (a step ends when the last rank is done)
        measured = max(statistics.median([t for rnd in r[i] for t in rnd[0]])
                       for r in results)
        per_round = [max(statistics.median(r[i][k][0]) for r in results)
                     for k in range(args.rounds)]
        second = again.get(kind)
        replan = (second.predicted.step_time_s / plan.predicted.step_time_s - 1
                  if second is not None and _program(second) == _program(plan) else None)
        rows.append(dict(world=world, model=model_key, kind=kind, measured=measured,
                         predicted=plan.predicted.step_time_s, replan=replan,
                         other=max(r[i][k][1] for r in results for k in range(args.rounds)),
                         spread=(max(per_round) - min(per_round)) / measured,
                         strategies=_summary(plan), run=i, host=probe / planned))
    return rows


def _plan_again(model_key: str, cluster, max_wait_s: float) -> dict[str, planner.Plan]:
    """The model's plans made once more, as a second user's process would: a fresh model,
    every layer timed again (the timing caches emptied), minutes after the first."""
    forget_layer_times()
    wait_for_quiet(max_wait_s)
    return plans_for(model_key, cluster)


def _program(plan: planner.Plan) -> tuple:
    """What the executor runs: the mesh and pipeline, each layer's strategy and recompute
    flag, each input's layout."""
    return (tuple(plan.mesh.shape), plan.pipeline and plan.pipeline.model_dump_json(),
            tuple((l.name, l.strategy, l.recompute) for l in plan.layers),
            tuple((i.name, i.layout) for i in plan.inputs))


def _summary(plan: planner.Plan) -> str:
    if plan.pipeline is not None:
        return f"pp{plan.mesh.shape[0]} dp{plan.mesh.shape[1]} m{plan.pipeline.microbatches}"
    weighted = [l for l in plan.layers if l.param_bytes]
    mp = sum(l.model_parallel for l in weighted)
    dp = sum(l.strategy == "data_parallel" for l in weighted)
    fsdp = sum(l.strategy == "fsdp" for l in weighted)
    return f"{dp} DP / {mp} MP" + (f" / {fsdp} FS" if fsdp else "")


def _cores(other: float | None) -> str:
    return "" if other is None else f"{other:>7.2f} cores"


def _report(rows: list[dict], args, seconds: float) -> None:
    print(f"\n{'P':>2} {'model':<10} {'plan':<7} {'weights':<12}{'predicted':>11}"
          f"{'replan':>8}{'measured':>11}{'spread':>8}{'error':>8}{'host':>7}{'other CPU':>11}")
    for r in rows:
        r["error"] = (r["predicted"] - r["measured"]) / r["measured"]
        replan = "" if r.get("replan") is None else f"{r['replan'] * 100:+.0f}%"
        print(f"{r['world']:>2} {r['model']:<10} {r['kind']:<7} {r['strategies']:<12}"
              f"{r['predicted'] * 1e3:>8.1f} ms{replan:>8}{r['measured'] * 1e3:>8.1f} ms"
              f"{r['spread'] * 100:>7.0f}%"
              f"{r['error'] * 100:>+7.0f}%{r['host']:>6.2f}x" + _cores(r["other"]))
    for world in args.worlds:
        errors = [abs(r["error"]) for r in rows if r["world"] == world]
        worst = max((r for r in rows if r["world"] == world), key=lambda r: abs(r["error"]))
        hosts = [r["host"] for r in rows if r["world"] == world]
        print(f"\n{world} processes: median |error| {statistics.median(errors) * 100:.0f}%, "
              f"worst {abs(worst['error']) * 100:.0f}% ({worst['model']} {worst['kind']}); "
              f"the machine ran {min(hosts):.2f}-{max(hosts):.2f}x as slow in the runs as "
              f"while planning (host)")
        moved = [abs(r["replan"]) for r in rows
                 if r["world"] == world and r.get("replan") is not None]
        if moved:
            print(f"  planned again, the same plans' predictions moved by median "
                  f"{statistics.median(moved) * 100:.0f}%, up to {max(moved) * 100:.0f}% "
                  f"({len(moved)} plans; a plan the second planning changed is left out)")
        for model in args.models:
            by = {r["kind"]: r for r in rows if r["world"] == world and r["model"] == model}
            best_kind = min(BASELINE_KINDS, key=lambda k: by[k]["measured"])
            ours, best = by["hyplan"]["measured"], by[best_kind]["measured"]
            same = [k for k in BASELINE_KINDS if by[k]["run"] == by["hyplan"]["run"]]
            print(f"  {model:<10} hyplan {ours * 1e3:6.1f} ms vs fastest baseline "
                  f"({best_kind}) {best * 1e3:6.1f} ms: {ours / best:.2f}x its time; "
                  f"DDP / hyplan {by['ddp']['measured'] / ours:.2f}x"
                  + (f" (hyplan's plan is the {same[0]} plan, run once)" if same else ""))
    others = [r["other"] for r in rows if r["other"] is not None]
    if others:
        print(f"\nother processes used up to {max(others):.2f} cores during a case "
              f"(median {statistics.median(others):.2f})"
              + ("; timings disturbed, rerun on an idle machine" if max(others) > 0.1 else ""))
    print(f"benchmark took {seconds:.0f} s")


if __name__ == "__main__":
    main()
