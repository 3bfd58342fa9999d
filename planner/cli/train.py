"""`hyplan train`: run a saved plan under torchrun, on one box or many.

The verb checks what it can before any process starts (the plan file, the model's
fingerprint against the plan's, the process count against the plan's devices, an existing
checkpoint directory), then runs torchrun's agent in this process (`torch.distributed.run`,
one interpreter fewer to start than a `torchrun` child: ~3 s on 2 cores) with the launch
options passed through, each worker running `python -m planner.cli.worker` (`worker` below):

    hyplan train plan.json examples/mlp.py --steps 100 --checkpoint-dir ckpt --nproc-per-node 2
    # node 0 and node 1 of a two-node job:
    hyplan train plan.json model.py --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint host0:29400 --rdzv-id job1 --max-restarts 3

A model file may define `dataset()` returning a map-style dataset of `(inputs..., target)`
rows; without one, training runs on synthetic rows shaped like the example inputs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

EXIT_FAILED = 1


def read_plan(path: str):
    """The Plan in a JSON file, or a one-line ValueError naming the file and the fix."""
    from planner.plan import Plan, PlanFileError

    try:
        return Plan.load(path)
    except FileNotFoundError:
        raise ValueError(f"plan: file {path!r} not found; write one with "
                         f"`hyplan plan MODEL --devices ... --batch ... --json FILE`") from None
    except UnicodeDecodeError:
        raise PlanFileError(f"plan: {path!r} is not a JSON text file; re-create it with "
                            f"`hyplan plan ... --json FILE`") from None
    except OSError as error:
        raise ValueError(f"plan: cannot read {path!r} ({error.strerror})") from None


def build_for_training(factory, batch: int, seed: int):
    """(model, example_inputs, loss_fn) built on CPU from a fixed seed, the same on every
    rank (each rank then keeps its part under the plan)."""
    import torch

    name = getattr(factory, "__name__", "build")
    torch.manual_seed(seed)
    built = factory(batch, device="cpu")
    if not isinstance(built, (tuple, list)) or len(built) < 3 or not callable(built[2]):
        raise ValueError(f"model: {name}() must return (model, example_inputs, loss_fn) to "
                         f"train; add the loss, e.g. torch.nn.CrossEntropyLoss()")
    model, inputs, loss_fn = built[:3]
    return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,), loss_fn


def check_model(plan, factory) -> None:
    """Refuse a plan made for another model, before any process starts: the executor's
    own check (executor.agree), for fx and export plans alike."""
    from executor.agree import check_model as check_model_matches
    from planner.cli.model_args import build_model

    model, _ = build_model(factory, plan.global_batch, "meta")
    check_model_matches(model, plan)


def check_processes(plan, nnodes: str, nproc_per_node: int) -> None:
    from executor.parallelize import PlanMismatch

    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node: must be at least 1, got {nproc_per_node}")
    try:
        nodes = int(nnodes)
    except ValueError:  # an elastic range "MIN:MAX": the executor checks the final size
        return
    if nodes * nproc_per_node != plan.num_devices:
        c = plan.cluster
        raise PlanMismatch(
            f"world size mismatch: the plan is for {plan.num_devices} devices "
            f"({c.describe()}), --nnodes {nodes} x --nproc-per-node {nproc_per_node} starts "
            f"{nodes * nproc_per_node}; pass --nnodes {c.nodes} --nproc-per-node "
            f"{c.devices_per_node}, or re-plan with --devices {nodes}x{nproc_per_node}x"
            f"{c.device.name if c.device.kind != 'cpu' else 'cpu'}")


def check_checkpoints(plan, directory: str | None) -> None:
    if not directory:
        return
    from executor.checkpoint import check_marker, latest_checkpoint

    found = latest_checkpoint(directory)
    if found:
        check_marker(found[1], plan)


_WORKER_OPTIONS = ("steps", "lr", "checkpoint_dir", "checkpoint_every", "keep", "seed",
                   "log_every", "dataset_size", "drift_threshold")
_WORKER_FLAGS = ("replan", "no_monitor")
_TORCHRUN_OPTIONS = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id",
                     "max_restarts", "master_port")


def torchrun_arguments(args) -> list[str]:
    """The torchrun arguments that run the workers (what follows `torchrun` on a command
    line)."""
    cmd = [f"--nproc-per-node={args.nproc_per_node}"]
    single = str(args.nnodes) == "1" and not args.rdzv_endpoint
    if single and args.master_port is None:
        cmd.append("--standalone")  # a local rendezvous on a free port
    for name in _TORCHRUN_OPTIONS:
        value = getattr(args, name)
        if value is not None and not (single and name == "nnodes"):
            cmd.append(f"--{name.replace('_', '-')}={value}")
    # the worker's own module: `-m planner.cli.train` made runpy warn on every rank that
    # the package had imported it already
    cmd += ["-m", "planner.cli.worker", args.plan, args.model]
    for name in _WORKER_OPTIONS:
        value = getattr(args, name)
        if value is not None:
            cmd.append(f"--{name.replace('_', '-')}={value}")
    cmd += [f"--{name.replace('_', '-')}" for name in _WORKER_FLAGS if getattr(args, name, False)]
    return cmd


def run_train(args) -> int:
    """`hyplan train`: check, then launch torchrun and wait for it."""
    from planner.cli.model_args import load_factory

    plan = read_plan(args.plan)
    if args.steps < 0:
        raise ValueError(f"--steps: must be at least 0, got {args.steps}")
    if args.lr <= 0:
        raise ValueError(f"--lr: the learning rate must be positive, got {args.lr}")
    if args.drift_threshold is not None and args.drift_threshold <= 0:
        raise ValueError(f"--drift-threshold: must be positive (0.15 is 15%), got "
                         f"{args.drift_threshold}")
    if args.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every: must be 0 (only at the end) or more, got "
                         f"{args.checkpoint_every}")
    if args.nproc_per_node is None:
        args.nproc_per_node = plan.cluster.devices_per_node
    check_processes(plan, str(args.nnodes), args.nproc_per_node)
    check_model(plan, load_factory(args.model))
    check_checkpoints(plan, args.checkpoint_dir)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    if plan.mesh.device_type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo CPU runs misbehave when CUDA is visible
    # workers import the user's code and hyplan from where this command runs
    env["PYTHONUNBUFFERED"] = "1"  # progress lines as they happen
    # Workers restarted by --max-restarts must not share the rendezvous store with the
    # first attempt: they would read its stale addresses and fail or hang connecting
    # (pytorch/pytorch#135712; seen here with gloo).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    return _torchrun(torchrun_arguments(args), env)


def _torchrun(arguments: list[str], env: dict[str, str]) -> int:
    """torchrun's agent in this process: it starts, watches and restarts the workers, which
    inherit `env`."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    os.environ.update(env)  # `env` is this process's environment with the launch's additions
    try:
        torchrun(arguments)
    except ChildFailedError:  # torchrun printed which rank failed and how
        print("hyplan: error: training failed; the first failing rank's error is above",
              file=sys.stderr)
        return EXIT_FAILED
    except Exception as error:  # noqa: BLE001 - e.g. a rendezvous that never completed
        print(f"hyplan: error: training failed in torchrun ({type(error).__name__}: "
              f"{error})", file=sys.stderr)
        return EXIT_FAILED
    return 0


def add_train(commands) -> None:
    """Register `hyplan train` on the top-level subparsers."""
    p = commands.add_parser(
        "train", help="train with a saved plan under torchrun (checkpoints, resume, restarts)",
        description="Run PLAN.json on MODEL under torchrun: each rank builds the model on CPU "
        "from a fixed seed, keeps its part under the plan and trains on its share of each "
        "global batch. Checkpoints (torch.distributed.checkpoint) are written every "
        "--checkpoint-every steps and at the end; a run started again with the same "
        "--checkpoint-dir resumes from the newest complete one, under this plan or another.")
    p.add_argument("plan", metavar="PLAN.json", help="a plan from `hyplan plan ... --json`")
    p.add_argument("model", metavar="MODEL", help="the MODEL the plan was made for")
    p.add_argument("--steps", type=int, default=100, help="global steps to train in all "
                   "(a resumed run continues up to this; default 100)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3); the "
                   "optimizer is the plan's (--optimizer of `hyplan plan`)")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save and resume here (shared by "
                   "all nodes); none: no checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="save every STEPS steps (default 0: only after the last step)")
    p.add_argument("--keep", type=int, default=2, help="complete checkpoints to keep (2)")
    p.add_argument("--seed", type=int, default=0, help="model initialization and data order")
    p.add_argument("--log-every", type=int, default=1, metavar="STEPS",
                   help="print progress every STEPS steps (default 1)")
    p.add_argument("--dataset-size", type=int, help="rows of the synthetic dataset "
                   "(default 64 global batches)")
    loop = p.add_argument_group("closed loop (on by default)")
    loop.add_argument("--drift-threshold", type=float, metavar="FRACTION",
                      help="the first steps are timed per layer; when the measured step is "
                      "off the prediction by more than this (default 0.15), the drift is "
                      "printed by term with the re-planned plan's predicted gain")
    loop.add_argument("--replan", action="store_true",
                      help="on drift, also write the re-planned plan beside PLAN.json "
                      "(PLAN.replanned.json) to resume under")
    loop.add_argument("--no-monitor", action="store_true",
                      help="do not time the first steps against the prediction")
    launch = p.add_argument_group("launch (passed to torchrun)")
    launch.add_argument("--nproc-per-node", type=int, help="processes on this node "
                        "(default: the plan's devices per node)")
    launch.add_argument("--nnodes", default="1", help="nodes in the job (default 1)")
    launch.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous)")
    launch.add_argument("--rdzv-backend", help="rendezvous backend, e.g. c10d")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT every node can reach")
    launch.add_argument("--rdzv-id", help="a job id shared by the nodes")
    launch.add_argument("--max-restarts", type=int, help="restart all workers up to this "
                        "many times after a failure (they resume from the last checkpoint)")
    launch.add_argument("--master-port", type=int, help="static rendezvous port")
    p.set_defaults(run=run_train)


# --- the worker: what each torchrun process runs ------------------------------------------

def worker(argv: Sequence[str] | None = None) -> int:
    import importlib

    import torch
    import torch.distributed as dist

    from executor import train
    from executor.data import synthetic_dataset
    from planner.cli.model_args import forward_kwargs, load_factory
    from profiler.allocator import keep_freed_memory

    p = argparse.ArgumentParser(prog="planner.cli.worker")
    p.add_argument("plan")
    p.add_argument("model")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--dataset-size", type=int)
    p.add_argument("--drift-threshold", type=float, default=0.15)
    p.add_argument("--replan", action="store_true")
    p.add_argument("--no-monitor", action="store_true")
    args = p.parse_args(argv)

    plan = read_plan(args.plan)
    factory = load_factory(args.model)
    cuda = plan.mesh.device_type == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
        keep_freed_memory()  # before gloo's threads start: one heap for all (profiler.allocator)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        model, inputs, loss_fn = build_for_training(factory, plan.global_batch, args.seed)
        kwargs = forward_kwargs(factory)
        make_data = getattr(importlib.import_module(factory.__module__), "dataset", None)
        dataset = (make_data() if callable(make_data) else synthetic_dataset(
            model, inputs, loss_fn, args.dataset_size or 64 * plan.global_batch, args.seed,
            forward_kwargs=kwargs))
        train(model, plan, dataset, loss_fn, steps=args.steps, lr=args.lr,
              checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
              keep=args.keep, seed=args.seed, log_every=args.log_every,
              forward_kwargs=kwargs, report=print,
              monitor=not args.no_monitor, drift_threshold=args.drift_threshold,
              on_drift=lambda drift: replanned(drift, factory, args))
        # every rank done before any tears its group down: a rank that left early while
        # rank 0 still re-planned or wrote once aborted in gloo's teardown ("terminate
        # called without an active exception") under load
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def replanned(drift, factory, args) -> list[str]:
    """Rank 0, when the first steps strayed: the plan re-solved on the figures this run
    measured, and what it would gain; with --replan, that plan written beside PLAN.json."""
    from pathlib import Path

    model, inputs, _ = build_for_training(factory, drift.plan.global_batch, args.seed)
    try:
        new, line = drift.replan_report(model, inputs)
    except Exception as error:  # noqa: BLE001 - a failed re-plan must not stop training
        return [f"hyplan: could not re-plan on the measured figures ({error})"]
    if not args.replan:
        return [line, "hyplan: pass --replan to write that plan and resume under it"]
    path = Path(args.plan).with_suffix(".replanned.json")
    new.save(path)
    resume = (f" --checkpoint-dir {args.checkpoint_dir}" if args.checkpoint_dir else "")
    return [line, f"hyplan: re-planned plan written to {path}; continue under it with "
            f"`hyplan train {path} {args.model}{resume}`"]

