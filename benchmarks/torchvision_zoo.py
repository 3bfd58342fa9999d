"""The torchvision table: each of tests/torchvision_zoo.py's models (torchvision's own
classifiers: AlexNet, VGG-11, ResNet-18, DenseNet-121, MobileNetV3-small, EfficientNet-B0,
ShuffleNetV2 x0.5, RegNetX-400MF, Inception-v3 with its auxiliary classifier, Swin-T) x
plan kind -> largest relative parameter difference from one process after 3 SGD steps,
the strategies the plan used, and pass / fail / refused (with the planner's reason).

Plans and runs as tests/test_zoo.py does (the tests' reference profile in a cache folder of
its own, 2 gloo ranks, spawned, a model's plans in one launch);
tests/test_torchvision.py runs a few rows of it.

    python benchmarks/torchvision_zoo.py [--ranks 2] [--kinds ddp,fsdp,...] [MODEL ...]

Memory (VGG-11: 133 M parameters, 1.06 GB a float64 copy): the plans are made on the model
built on the meta device (tracing and the reference profile read shapes and dtypes only,
the same float64 ones); the single-process reference is trained once, here, and saved,
and each rank maps that file instead of training and holding its own; parameters are
compared a slice at a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# tests first: its torchvision_zoo is the models, this file's namesake in this folder
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from distributed import run_ranks  # noqa: E402
from test_torchvision import compared_with_one_process, save_reference  # noqa: E402
from test_zoo import KINDS, make_plan  # noqa: E402
from torchvision_zoo import TORCHVISION_ZOO  # noqa: E402
from zoo import skeleton  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(TORCHVISION_ZOO))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"plan kinds, comma-separated (default: {','.join(KINDS)})")
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"--kinds: {sorted(unknown)} not among {KINDS}")
    from reference_profile import seed_cache

    work = tempfile.mkdtemp(prefix="hyplan-torchvision-")
    os.environ["HYPLAN_CACHE_DIR"] = work
    seed_cache()  # the prices the tests plan with; this machine's own cache left alone
    started = time.perf_counter()
    print(f"{'model':19s} {'plan':9s} {'result':8s} {'max rel diff':>12s}  strategies / reason")
    counts = {"pass": 0, "FAIL": 0, "refused": 0}
    try:
        for name in args.models:
            for result in rows(name, args.ranks, kinds, work):
                counts[result] += 1
    finally:  # the cache and any reference file (VGG-11's: 1 GB) left by a stopped run
        shutil.rmtree(work, ignore_errors=True)
    print(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['refused']} refused "
          f"up front ({args.ranks} ranks, float64, {time.perf_counter() - started:.0f} s)")


def rows(name: str, ranks: int, kinds=KINDS, work: str | None = None) -> list[str]:
    """Print the model's rows (one launch for its plans, each rank comparing its
    parameters with one process's, trained once here and saved in `work`); returns each
    row's result."""
    started = time.perf_counter()
    entry = TORCHVISION_ZOO[name]
    # one instance for every kind (traced once), on meta: nothing of it allocated
    model = skeleton(entry)
    plans, refused = {}, {}
    for kind in kinds:
        try:
            plans[kind] = make_plan(name, kind, f"{ranks}xcpu", model)
        except ValueError as error:
            refused[kind] = str(error)
    jobs = [(name, kind, plan.to_json()) for kind, plan in plans.items()]
    # a model of more than 512 MB (VGG-11: 1 GB in float64) gets a launch per plan: its
    # ranks' memory goes back to the system between them
    big = sum(p.numel() * p.element_size() for p in model.parameters()) > 2**29
    del model
    references = {}
    if jobs:
        work = work or tempfile.mkdtemp(prefix="hyplan-torchvision-")
        references[name] = save_reference(name, os.path.join(work, f"{name}.pt"))
    results = [{} for _ in range(ranks)]
    for launch in ([[job] for job in jobs] if big else [jobs] if jobs else []):
        for mine, theirs in zip(results, run_ranks(compared_with_one_process, ranks, launch,
                                                   references, forked=False,
                                                   timeout_s=1800)):
            mine.update(theirs)
    if references:
        os.remove(references[name])
    out = []
    for kind in kinds:
        if kind in refused:
            out.append("refused")
            print(f"{name:19s} {kind:9s} {'refused':8s} {'':>12s}  {refused[kind]}")
            continue
        got = [r[(name, kind)] for r in results]
        errors = [g for g in got if isinstance(g, str)]
        strategies = ", ".join(sorted({l.strategy for l in plans[kind].layers}))
        if errors:
            out.append("FAIL")
            print(f"{name:19s} {kind:9s} {'FAIL':8s} {'':>12s}  {errors[0][:200]}")
            continue
        held = {n for g in got for n in g[2]}
        ok = all(g[1] is None for g in got) and held == set(got[0][3])
        out.append("pass" if ok else "FAIL")
        print(f"{name:19s} {kind:9s} {'pass' if ok else 'FAIL':8s} "
              f"{max(g[0] for g in got):12.1e}  {strategies}")
    print(f"{'':19s} ({time.perf_counter() - started:.0f} s)", flush=True)
    return out


if __name__ == "__main__":
    main()
