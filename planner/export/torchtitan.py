"""torchtitan job files, written from a plan and read into a JobConfig.

`to_torchtitan(plan)` writes the TOML job file torchtitan's `ConfigManager` reads
(`--job.config_file job.toml`: torchtitan 0.1 to 0.2.x; 0.3 moved to Python config
registries with the same section and field names as command-line overrides, which
`overrides()` writes). `read_torchtitan(text)` reads such a file, in today's sections or in
those of the published December 2024 jobs (`[training] batch_size`, the degrees under
`[training]` and `[experimental]`, `[float8]`), into a planner.export.config.JobConfig.

    toml_text = to_torchtitan(plan).text
    job = read_torchtitan(Path("llama3_70b.toml").read_text(), devices=256)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace

from planner.export.config import (
    PRECISIONS,
    SCHEDULES,
    Departure,
    Expressed,
    JobConfig,
    express,
)
from planner.plan import Plan


@dataclass(frozen=True)
class Exported:
    """A written job file (or argument list) and what it could not say exactly."""

    text: str
    job: JobConfig
    departures: tuple[Departure, ...]

    def notes(self) -> str:
        """The departures as comment lines ("" where the export is exact)."""
        return "".join(f"# {d}\n" for d in self.departures)


def sections(job: JobConfig) -> dict[str, dict]:
    """The job's values by torchtitan section and field (torchtitan.config.JobConfig)."""
    training = {"local_batch_size": job.local_batch // (1 if job.pp > 1 else job.microbatches),
                "global_batch_size": job.global_batch,
                "mixed_precision_param": ("float32" if job.precision == "fp32"
                                          else "bfloat16")}
    if job.seq_len:
        training["seq_len"] = job.seq_len
    parallelism = {"data_parallel_replicate_degree": job.dp_replicate,
                   "data_parallel_shard_degree": job.dp_shard,
                   "tensor_parallel_degree": job.tp,
                   "enable_async_tensor_parallel": job.async_tp,
                   "pipeline_parallel_degree": job.pp,
                   "context_parallel_degree": job.cp,
                   "expert_parallel_degree": job.ep}
    if job.pp > 1:
        parallelism["pipeline_parallel_schedule"] = job.schedule
        parallelism["pipeline_parallel_microbatch_size"] = job.microbatch_rows
        if job.num_layers and job.num_layers % (job.pp * job.chunks) == 0:
            parallelism["pipeline_parallel_layers_per_stage"] = (
                job.num_layers // (job.pp * job.chunks))
    checkpoint = {"mode": job.recompute}
    if job.recompute == "full" and job.recompute_every > 1:
        # torchtitan checkpoints every n-th block in "selective" mode with an integer option
        checkpoint = {"mode": "selective", "selective_ac_option": str(job.recompute_every)}
    elif job.recompute == "selective":
        checkpoint["selective_ac_option"] = "op"
    out = {"training": training, "parallelism": parallelism,
           "activation_checkpoint": checkpoint,
           "compile": {"enable": job.compile, "components": ["model", "loss"]}}
    if job.float8:
        out["model"] = {"converters": ["quantize.linear.float8"]}
        out["quantize.linear.float8"] = {"recipe_name": job.float8,
                                         "enable_fsdp_float8_all_gather": job.fsdp
                                         and job.float8 == "tensorwise"}
    return out


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"no TOML spelling for {v!r}")


def toml_text(tables: dict[str, dict]) -> str:
    """A TOML document of flat tables (the values torchtitan's job files hold)."""
    lines = []
    for name, values in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_value(v)}" for key, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def _torchtitan_departures(job: JobConfig) -> list[Departure]:
    """What torchtitan's fields cannot say of a JobConfig that planner.export.config could."""
    out = []
    if job.precision == "fp16-mixed":
        out.append(Departure(("all",), "trained in fp16 mixed precision, which torchtitan's "
                             "FSDP policy does not offer: the export uses bfloat16"))
    return out


def to_torchtitan(plan: Plan | Expressed, *, description: str = "") -> Exported:
    """The torchtitan job file (TOML) that runs `plan` as nearly as torchtitan can, with
    what it could not say (planner.export.config.Departure) as comments at the top."""
    expressed = plan if isinstance(plan, Expressed) else express(plan)
    job = expressed.job
    departures = expressed.departures + tuple(_torchtitan_departures(job))
    head = {"job": {"description": description or (
        f"hyplan plan of {plan.model}" if isinstance(plan, Plan) else "hyplan plan")}}
    body = toml_text({**head, **sections(job)})
    exported = Exported("", job, departures)
    header = ("# written by `hyplan export --to torchtitan`; "
              + ("exact" if not departures else "the nearest configuration torchtitan "
                 "runs: the plan differs in") + "\n")
    return replace(exported, text=header + exported.notes() + body)


def overrides(job: JobConfig) -> list[str]:
    """The same values as torchtitan 0.3's command-line overrides (--section.field value)."""
    out = []
    for section, values in sections(job).items():
        for key, v in values.items():
            if isinstance(v, list):
                v = ",".join(v)
            out += [f"--{section}.{key}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out


# --- reading -----------------------------------------------------------------------------


class JobFileError(ValueError):
    """A job file or argument list hyplan cannot read, with the field and the fix."""


def read_torchtitan(text: str, devices: int | None = None, *,
                    overrides: dict[str, object] | None = None) -> JobConfig:
    """A torchtitan job file as a JobConfig. `devices`: the world size, which fills a
    degree of -1 (torchtitan's "the rest"); `overrides` {"section.field": value} as on
    torchtitan's command line (the published runs change a field or two of the file)."""
    data = _job_tables(text, overrides)
    training = data.get("training", {})
    parallel = {**training, **data.get("experimental", {}), **data.get("parallelism", {})}
    degrees = _degrees(parallel, devices)
    schedule, chunks = _schedule(data, parallel, degrees["pp"])
    # files of [experimental] days (no [parallelism]) split the local batch into
    # pipeline_parallel_microbatches, by default the pipeline degree (torchtitan 9dec370,
    # pipelining_utils.build_pipeline_schedule; from 2025-01-07, 90567fc, pp x stages per rank)
    count = degrees["pp"] if "parallelism" not in data else None
    global_batch, microbatches = _batching(training, parallel, degrees, count)
    recompute, every = _recompute(data)
    compile_ = data.get("compile", {})
    compiled = bool(compile_.get("enable", training.get("compile", False))
                    if isinstance(compile_, dict) else compile_)
    dtype = str(training.get("mixed_precision_param", "bfloat16"))
    precision = {v: k for k, v in PRECISIONS.items()}.get(dtype, "bf16-mixed")
    return JobConfig(global_batch=global_batch, seq_len=int(training.get("seq_len", 0)),
                     schedule=schedule, microbatches=microbatches, chunks=chunks,
                     recompute=recompute, recompute_every=every, precision=precision,
                     # torchtitan runs its norms sequence parallel wherever tp > 1
                     sequence_parallel=degrees["tp"] > 1,
                     compile=compiled, float8=_float8(data),
                     async_tp=bool(parallel.get("enable_async_tensor_parallel", False)),
                     **degrees)


def _job_tables(text: str, overrides: dict[str, object] | None) -> dict:
    """The job file's tables, with `overrides` ("section.field": value) written over them."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise JobFileError(f"torchtitan job: not TOML ({error})") from None
    for key, value in (overrides or {}).items():
        *path, last = key.split(".")
        table = data
        for part in path:
            table = table.setdefault(part, {})
        table[last] = value
    return data


def _degrees(parallel: dict, devices: int | None) -> dict[str, int]:
    """Each parallel degree, a data_parallel_shard_degree of -1 filled from `devices`,
    checked to multiply to `devices` where given."""
    degrees = {k: int(parallel.get(f, 1)) for k, f in (
        ("dp_replicate", "data_parallel_replicate_degree"),
        ("dp_shard", "data_parallel_shard_degree"), ("tp", "tensor_parallel_degree"),
        ("pp", "pipeline_parallel_degree"), ("cp", "context_parallel_degree"),
        ("ep", "expert_parallel_degree"))}
    known = 1
    for k, v in degrees.items():
        if v > 0 and k != "ep":  # ep borrows from dp_shard x cp (x tp) in torchtitan
            known *= v
    if degrees["dp_shard"] == -1:
        if devices is None or devices % known:
            raise JobFileError(f"torchtitan job: data_parallel_shard_degree = -1 takes the "
                               f"rest of the devices; pass the world size (devices=, a "
                               f"multiple of {known}), got {devices}")
        degrees["dp_shard"] = devices // known
    elif devices is not None and known != devices:
        raise JobFileError(f"torchtitan job: its degrees multiply to {known} devices, not "
                           f"the {devices} given; fix a degree or --devices")
    return degrees


def _batching(training: dict, parallel: dict, degrees: dict[str, int],
              default_count: int | None = None) -> tuple[int, int]:
    """(global batch, microbatches per step): gradient accumulation, and the pipeline's
    microbatches of each local batch (pipeline_parallel_microbatch_size rows each, or the
    old pipeline_parallel_microbatches of them, by default `default_count` where given), as
    microbatches."""
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    local = int(training.get("local_batch_size", training.get("batch_size", 8)))
    global_batch = int(training.get("global_batch_size", -1))
    if global_batch <= 0:
        global_batch = local * dp
    if global_batch % (local * dp):
        raise JobFileError(f"torchtitan job: global_batch_size {global_batch} is not a "
                           f"multiple of local_batch_size {local} x data-parallel degree {dp}")
    accumulation = global_batch // (local * dp)
    if degrees["pp"] <= 1:
        return global_batch, accumulation
    count = parallel.get("pipeline_parallel_microbatches") or default_count
    if count and "pipeline_parallel_microbatch_size" not in parallel:
        if local % int(count):
            raise JobFileError(f"torchtitan job: local_batch_size {local} does not split into "
                               f"{count} pipeline microbatches (by default one per pipeline "
                               f"rank); set pipeline_parallel_microbatches")
        return global_batch, int(count) * accumulation
    rows = int(parallel.get("pipeline_parallel_microbatch_size", 1))
    if local % rows:
        raise JobFileError(f"torchtitan job: local_batch_size {local} does not split into "
                           f"microbatches of pipeline_parallel_microbatch_size {rows}")
    return global_batch, local // rows * accumulation


def _schedule(data: dict, parallel: dict, pp: int) -> tuple[str, int]:
    """(pipeline schedule, model chunks per stage): 2 chunks for a multi-chunk schedule
    unless the file's layers per stage say otherwise."""
    schedule = str(parallel.get("pipeline_parallel_schedule", "1F1B"))
    if schedule not in SCHEDULES:
        raise JobFileError(f"torchtitan job: pipeline_parallel_schedule {schedule!r} is not "
                           f"one hyplan prices; known: {', '.join(SCHEDULES)}")
    chunks = 1
    if pp > 1 and (schedule.startswith("Interleaved") or schedule in (
            "ZBVZeroBubble", "DualPipeV")):
        per_stage = parallel.get("pipeline_parallel_layers_per_stage")
        layers = _layers(data)
        chunks = (max(1, layers // (int(per_stage) * pp)) if per_stage and layers
                  else 2)
    return schedule, chunks


def _recompute(data: dict) -> tuple[str, int]:
    """(recompute mode, every n-th block) from [activation_checkpoint]."""
    ac = data.get("activation_checkpoint", {})
    mode = str(ac.get("mode", "selective"))
    option = str(ac.get("selective_ac_option", "2"))
    recompute, every = mode, 1
    if mode == "selective" and option.isdigit():  # every n-th block, whole
        recompute, every = "full", max(1, int(option))
    elif mode == "memory_budget":
        recompute = "selective"
    return recompute, every


def _float8(data: dict) -> str:
    """The float8 recipe where the file enables float8 Linears, in the old [float8] or the
    new [quantize.linear.float8] and model converters; "" where it does not."""
    old = data.get("float8", {})
    new = data.get("quantize", {}).get("linear", {}).get("float8", {})
    converters = data.get("model", {}).get("converters", [])
    if isinstance(converters, str):
        converters = converters.split(",")
    if old.get("enable_float8_linear") or "float8" in converters or any(
            "float8" in c for c in converters):
        return str(new.get("recipe_name") or old.get("recipe_name") or "tensorwise")
    return ""


def _layers(data: dict) -> int:
    """Blocks named in the file, where it says (torchtitan's flavors do not: 0)."""
    return int(data.get("model", {}).get("n_layers", 0) or 0)
