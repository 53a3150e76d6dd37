"""The `planner` command: a thin adapter over the pure core.

Flags are generated from the pydantic request schema (one source of truth: a field ``micro_batch``
is ``--micro-batch``, its description is the help). Every error a user can cause ends in one line
on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Iterator

from pydantic import BaseModel, BeforeValidator, TypeAdapter, ValidationError

EXIT_USAGE = 2
QUICK_COMMANDS = ("estimate", "plan", "models", "gpus", "topo")  # answer and exit, holding nothing open
# Fields read from a file by the CLI: the flag names the file, the request holds its content.
FILE_FLAGS = {"model_config_": "--model-file", "ds_config": "--ds-config", "topology_text": "--topology-file"}


class CliError(Exception):
    """A one-line error for the user (exit code 2)."""


def _flag(name: str) -> str:
    return FILE_FLAGS.get(name) or "--" + name.rstrip("_").replace("_", "-")


def _choices(annotation: Any) -> list[str] | None:
    if typing.get_origin(annotation) in (tuple, list):  # a list of names (fused_kernels): text the schema parses
        return None
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if args == [bool]:  # bool | None: unset means the schema's own default, so it is a choice, not a switch
        return ["true", "false"]
    for arg in args:
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
    return None


def _scalar_type(annotation: Any) -> Callable[[str], Any]:
    """int and float flags are converted by argparse; anything else (names, counts such as
    --params 7B) reaches the schema as text and is validated there."""
    args = typing.get_args(annotation) or (annotation,)
    for kind in (int, float):
        if kind in args:
            return kind
    return str


def _catalogue(field: Any) -> Any:
    """The CatalogueName metadata of a field (planner.schema), if it names a catalogue entry."""
    from planner.schema import CatalogueName

    found = [m for m in field.metadata if isinstance(m, CatalogueName)]
    for arg in typing.get_args(field.annotation):
        found += [m for m in getattr(arg, "__metadata__", ()) if isinstance(m, CatalogueName)]
    return found[0] if found else None


def path_arg(text: str) -> str:
    """A path flag: the operating system cannot name a file with a NUL byte in it."""
    if "\x00" in text:
        raise argparse.ArgumentTypeError(f"got {text!r}: a path cannot contain a NUL byte")
    return text


def schema_type(annotation: Any) -> Callable[[str], Any]:
    """An argparse type that validates a flag with a schema type (bounds, finiteness), so the
    CLI refuses what the API refuses, as a one-line usage error (exit 2). The validator is built
    when the flag is given: every command's parser is built for each run, few of its flags are used."""
    adapters: list[TypeAdapter] = []

    def convert(text: str) -> Any:
        if not adapters:
            adapters.append(TypeAdapter(annotation))
        try:
            return adapters[0].validate_python(text)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(
                f"got {text!r}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None

    convert.__name__ = getattr(annotation, "__name__", "value")
    return convert


def add_schema_flags(parser: argparse.ArgumentParser, model: type[BaseModel],
                     skip: tuple[str, ...] = (), list_choices: bool = True) -> None:
    """One flag per schema field; defaults stay in the schema (argparse stores SUPPRESS).
    ``list_choices``: name a catalogue field's choices in its help (reads the catalogues; only
    --help shows it)."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = _flag(name)
        help_text = field.description or ""
        if name in FILE_FLAGS:  # the schema's "(what --model-file reads)" is for the API's readers
            help_text = re.sub(r"\s*\(what --[a-z-]+ reads\)", "", help_text)
            parser.add_argument(flag, dest=name, metavar="PATH", type=path_arg, default=argparse.SUPPRESS,
                                help=f"{help_text} (a file path)")
            continue
        if field.annotation is bool:  # a switch: given is true (the schema's default is false)
            parser.add_argument(flag, dest=name, action="store_true", default=argparse.SUPPRESS, help=help_text)
            continue
        choices = _choices(field.annotation)
        default = field.default if field.default is not None else "none"
        catalogue = _catalogue(field)
        if catalogue is not None and catalogue.listed and list_choices:
            help_text += f"; one of {', '.join(sorted(catalogue.choices()))}"
        # a description that says its own default ("(default 8, PEFT's)") is not given a second one
        said = re.search(r"\bdefault\b", help_text) is not None
        kwargs: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS,
                                      help=help_text if said else f"{help_text} (default: {default})")
        if choices:
            kwargs["choices"] = choices
            if all(type(c) is int for c in choices):  # a literal of numbers (--fsdp-version 1)
                kwargs["type"] = int
        elif any(isinstance(m, BeforeValidator) for m in field.metadata):
            kwargs["type"] = str  # a number people write with a suffix (--seq-len 4k): the schema parses the text
        else:
            kwargs["type"] = _scalar_type(field.annotation)
        parser.add_argument(flag, **kwargs)


def _read_file_flag(name: str, path: str) -> Any:
    from planner.model.catalogue import MAX_MODEL_FILE_BYTES, UnsupportedModelTypeError, model_from_file

    if name == "model_config_":
        try:
            resolved = model_from_file(path)  # validates and names the file in every error
        except UnsupportedModelTypeError as exc:  # read, but only a trace can say more (estimate)
            return {"name": exc.name, "source": path, "config": exc.config}
        return {"name": resolved.name, "config": resolved.config}
    if name == "topology_text":
        return read_topology_text(path)
    text = read_text_file(f"{FILE_FLAGS[name]} {path}", path, MAX_MODEL_FILE_BYTES,
                          f"more than {MAX_MODEL_FILE_BYTES} bytes, too large for a DeepSpeed config")
    from planner.model.catalogue import parse_json_text

    return parse_json_text(text, f"{FILE_FLAGS[name]} {path}", field=name)


def request_from_args(args: argparse.Namespace, model: type[BaseModel]) -> BaseModel:
    values = from_files_fields(getattr(args, "from_files", None), args, model)
    values |= {k: v for k, v in vars(args).items() if k in model.model_fields}
    for name in FILE_FLAGS:
        if name in values:
            values[name] = _read_file_flag(name, values[name])
    if "model_config_" in values:
        values.pop("model", None)
        values["model_config"] = values.pop("model_config_")
    elif "model" in values:
        values.pop("model_config", None)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise CliError(validation_message(exc)) from None


def validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "__root__"]
    field = loc[0].rstrip("_") if loc else ""
    message = first.get("msg", "invalid").removeprefix("Value error, ")
    if not field:
        return message
    value = first.get("input")
    shown = "" if isinstance(value, dict) else f" got {value!r}:"
    return f"{_flag(field)}:{shown} {message}"


def error_message(exc: Exception) -> str:
    """A core error as the CLI shows it: with the rejected value, as ``--flag: got VALUE: why`` (the
    flag rendered from the field the error names), as a schema error is shown; otherwise its
    message, which already quotes field and value."""
    from planner.errors import NO_VALUE

    field, value = getattr(exc, "field", None), getattr(exc, "value", NO_VALUE)
    if field and value is not NO_VALUE:
        top = field.split(".")[0]
        return f"{_flag(top + '_' if top == 'model_config' else top)}: got {value!r}: {exc}"
    return str(exc)


def read_topology_text(path: str) -> str:
    from planner.cluster.topology import MAX_TOPOLOGY_BYTES

    too_large = f"larger than {MAX_TOPOLOGY_BYTES} bytes; not nvidia-smi topo -m output"
    if path != "-":
        return read_text_file(f"--topology-file {path}", path, MAX_TOPOLOGY_BYTES, too_large)
    try:
        text = sys.stdin.read(MAX_TOPOLOGY_BYTES + 1)
    except OSError as exc:
        raise CliError(f"--topology-file {path}: cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise CliError(f"--topology-file {path}: not a text file") from None
    if len(text.encode()) > MAX_TOPOLOGY_BYTES:
        raise CliError(f"--topology-file {path}: {too_large}")
    return text


def read_text_file(label: str, path: str, limit: int, too_large: str) -> str:
    """A file's text, at most ``limit`` bytes read (planner/model/catalogue.py read_bounded_text: a
    pipe or /dev/zero is never read to its end); every way it cannot be read is one line naming
    ``label`` (the flag and the file), ``too_large`` saying what a larger file cannot be."""
    from planner.errors import PlannerError
    from planner.model.catalogue import read_text_or_refuse

    try:
        return read_text_or_refuse(path, limit, label, too_large)
    except PlannerError as exc:  # a CliError: callers that skip a PlannerError must not skip this
        raise CliError(str(exc)) from None


# --- commands --------------------------------------------------------------------------------

def cmd_models(args: argparse.Namespace) -> int:
    from planner.model.catalogue import as_loaded, catalogue_model, load_catalogue

    rows = []
    for name, entry in load_catalogue().items():
        resolved = as_loaded(catalogue_model(name))  # what an estimate counts by default (the loader's build)
        rows.append({"name": name, "family": entry.family, "parameters": resolved.parameters,
                     "aliases": list(entry.all_aliases), "source": entry.source, "config": entry.config})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<18} {'family':<9} {'parameters':>17}  also answers to")
    for row in rows:
        print(f"{row['name']:<18} {row['family']:<9} {row['parameters']:>17,}  {', '.join(row['aliases'])}")
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    from planner.cluster.gpus import load_gpus

    gpus = [g.model_dump() | {"memory_bytes": g.memory_bytes} for g in load_gpus().values()]
    if args.json:
        print(json.dumps(gpus, indent=2))
        return 0
    print(f"{'name':<11} {'memory (GiB)':>12} {'bf16 TFLOP/s':>13}  {'NVLink':<15} vendor name")
    for g in gpus:
        print(f"{g['name']:<11} {g['memory_bytes'] / 2**30:>12.1f} {g['peak_tflops'].get('bf16', 0):>13.1f}  "
              f"{g['nvlink']:<15} {g['vendor_name']}")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from backend.anymodel import estimate_any
    from planner.schema import EstimateRequest

    if args.emit is not None:
        _check_output_path(args.emit, "--emit", "dir")
    request = request_from_args(args, EstimateRequest)
    script = _script(args)
    result = estimate_any(request)  # Hub ids, and tracing for a model_type without a reader
    if args.emit is not None:
        from cli.files import write_files
        from planner.plan.emit import emit_estimate_files

        written = write_files(args.emit, emit_estimate_files(result, script))
        _report_emitted(written)
        if not result.fits and result.device_capacity_bytes:
            print(f"planner: note: predicted peak {result.per_device.peak_bytes / 2**30:.2f} GiB does not fit "
                  f"{result.device_capacity_bytes / 2**30:.2f} GiB of {result.gpu}; the files are written as asked",
                  file=sys.stderr)
        if result.host.fits is False:
            print(f"planner: note: offload holds {result.host.peak_bytes / 2**30:.2f} GiB of host RAM per node, more "
                  f"than the node's {result.host.capacity_bytes / 2**30:.2f} GiB; the files are written as asked",
                  file=sys.stderr)
    if args.json:
        print(result.model_dump_json(indent=2, by_alias=True))
    else:
        from cli.render import estimate_table

        print(estimate_table(result))
    return 0


MAX_JOB_FILE_BYTES = 1 << 20


def _job_files(paths: list[str]) -> list[dict[str, str]]:
    return [{"name": path, "text": read_text_file(path, path, MAX_JOB_FILE_BYTES,
                                                  f"more than {MAX_JOB_FILE_BYTES} bytes; not a training config")}
            for path in paths]


def _sets(pairs: list[str] | None) -> dict[str, Any] | None:
    """--set KEY=VALUE: a dotted key of the first file; the value read as YAML (4, true, full)."""
    import yaml

    out = {}
    for pair in pairs or []:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise CliError(f"--set {pair!r}: write KEY=VALUE (activation_checkpoint.mode=full)")
        out[key] = yaml.safe_load(value)
    return out or None


def check_body(args: argparse.Namespace):
    from planner.schema import CheckRequest

    values = {"files": _job_files(args.files), "overrides": _sets(args.set)}
    for name in ("gpu", "gpus", "nodes", "model", "seq_len", "tokens", "dataset_tokens"):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    try:
        return CheckRequest.model_validate(values)
    except ValidationError as exc:
        raise CliError(validation_message(exc)) from None


def cmd_check(args: argparse.Namespace) -> int:
    from backend.anymodel import estimate_any
    from planner.check import check, job_request

    if args.emit is not None:
        _check_output_path(args.emit, "--emit", "dir")
    body = check_body(args)
    result = check(body, estimate_any)
    if args.emit is not None:
        from planner.jobfiles.write import emit

        from planner.errors import PlannerError

        job, request = job_request(body)
        fields = request.model_dump()
        label, change, texts = "unchanged", {}, None
        for candidate in result.changes:  # the first change the job's own formats can hold
            try:
                texts = emit(job, candidate.fields, fields)
            except PlannerError:
                continue
            label, change = candidate.change, candidate.fields
            break
        texts = texts if change else emit(job, {}, fields)
        os.makedirs(args.emit, exist_ok=True)
        for name, text in texts.items():
            target = os.path.join(args.emit, os.path.basename(name))
            with open(target, "w") as handle:
                handle.write(text)
            print(f"planner: wrote {target} ({label})", file=sys.stderr)
    if args.json:
        print(result.model_dump_json(indent=2, by_alias=True))
        return 0
    gib = 2**30
    print(f"files: {', '.join(f'{n} ({k})' for n, k in result.formats)}")
    # a job refused on its reserved peak (the allocator's cache, CUDA context, NCCL) says so: its live
    # peak alone would read as fitting
    reserved = f", reserved {result.reserved_peak_bytes / gib:.2f} GiB" if not result.fits \
        and result.peak_bytes <= result.device_capacity_bytes else ""
    print(f"fits: {'yes' if result.fits else 'NO'}  peak {result.peak_bytes / gib:.2f} GiB{reserved} of "
          f"{result.device_capacity_bytes / gib:.2f} GiB at {result.peak_phase}")
    if result.step_seconds is not None:
        wall = f"{result.wall_seconds / 3600:.2f} h for {result.steps} steps ({result.length_source})" \
            if result.wall_seconds is not None else "wall time unknown (give --tokens)"
        print(f"step {result.step_seconds:.3f} s; {wall}")
    for change in result.changes:
        step = f"{change.step_seconds:.3f} s/step" if change.step_seconds is not None else "-"
        wall = f", {change.wall_seconds / 3600:.2f} h" if change.wall_seconds is not None else ""
        print(f"  {'fits' if change.fits else 'no  '}  {change.change}: peak {change.peak_bytes / gib:.2f} GiB, "
              f"{step}{wall}")
    for key in result.unknown_keys:
        print(f"unknown key (not read): {key}")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def from_files_fields(paths: list[str] | None, args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """--from FILE...: the request fields the job files set (flags given beside them win)."""
    if not paths:
        return {}
    from planner.jobfiles.job import read_job

    gpus = getattr(args, "gpus", 8)
    nodes = getattr(args, "nodes", 1)
    job = read_job([(f["name"], f["text"]) for f in _job_files(paths)], gpus * nodes)
    fields = {k: v for k, v in job.fields.items() if not k.startswith("_")}
    if fields.get("fsdp_version") == 1 and "fsdp_version" not in model.model_fields:
        # a plan searches and writes FSDP2 layouts (its fsdp candidates are fully_shard's)
        print("note: the job files describe FSDP1 (fsdp_version 1); the plan searches and writes FSDP2 layouts "
              "(fsdp_version 2)", file=sys.stderr)
    if "global_batch" in model.model_fields:  # a plan searches the layout for the job's global batch
        replicas = gpus * nodes // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1))
        fields["global_batch"] = fields.get("micro_batch", 1) * fields.get("gradient_accumulation", 1) * replicas
    return {k: v for k, v in fields.items() if k in model.model_fields or k == "model_config"}


def one_line(text: str) -> str:
    """A message that stays one line on any terminal: control characters and line or paragraph
    separators a user typed into a value (\\r, \\x1e, \\u2028, ...) are shown escaped."""
    import unicodedata

    return "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Zl", "Zp")
                   else c for c in text)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not the whole usage text."""

    def error(self, message: str) -> typing.NoReturn:
        print(one_line(f"{self.prog}: error: {message}"), file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _check_name(annotation: Any, value: str, flag: str) -> str:
    """A name flag outside the request schemas, checked by the schema's own name type."""
    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError as exc:
        raise CliError(f"{flag}: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def _check_output_path(path: str, flag: str, kind: str) -> None:
    """Refuse an output path that cannot be written as asked, before any work is done. A file is
    replaced by renaming a new one over it, which must not replace a device such as /dev/null."""
    if not path.strip():
        raise CliError(f"{flag}: got {path!r}: give a path to write to")
    if "\x00" in path:
        raise CliError(f"{flag}: got {path!r}: a path cannot contain a NUL byte")
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # written fresh (a missing parent directory is created, or refused, when writing)
    except OSError as exc:  # a name too long, a path through a file, no permission
        raise CliError(f"{flag} {path}: cannot be written ({exc.strerror})") from None
    if kind == "dir" and not stat.S_ISDIR(mode):
        raise CliError(f"{flag} {path}: exists and is not a directory")
    if kind == "file" and not stat.S_ISREG(mode):
        raise CliError(f"{flag} {path}: not a regular file; give a file name to write the picture to")


def cmd_topo(args: argparse.Namespace) -> int:
    from planner.errors import PlannerError
    from planner.cluster.gpus import gpu as lookup_gpu
    from planner.cluster.presets import PRESETS, preset_topology
    from planner.schema import GpuName, PresetName, _gpu_names
    from planner.cluster.topology import parse_topology

    if args.list:
        for p in PRESETS.values():
            print(f"{p.name:<24} {p.gpus} x {p.gpu:<10} {p.description}")
        return 0
    if args.preset is not None:
        name = _check_name(PresetName, args.preset, "--preset")
        if args.gpu is not None and _check_name(GpuName, args.gpu, "--gpu") != PRESETS[name].gpu:
            raise CliError(f"--gpu {args.gpu}: preset {name} is built from {PRESETS[name].gpu}; drop --gpu")
        topo = preset_topology(name)
    else:
        if args.gpu is None:  # a link code (NV4, NV12, ...) means a different rate on each GPU generation
            raise CliError("--gpu is required with --file or stdin: the output does not name the GPU model, and "
                           f"what a link code means depends on it; choose from {', '.join(sorted(_gpu_names()))}")
        gpu_type = lookup_gpu(_check_name(GpuName, args.gpu, "--gpu"))
        if args.file is None and sys.stdin.isatty():
            raise CliError("give --file F, --preset NAME, or pipe `nvidia-smi topo -m` into stdin")
        text = read_topology_text(args.file or "-")
        topo = parse_topology(text, gpu_type, source=args.file or "stdin")
    if args.svg is not None:
        _check_output_path(args.svg, "--svg", "file")
        from cli.files import write_files
        from planner.render import topology_svg

        target = Path(args.svg)
        try:
            write_files(target.parent, {target.name: topology_svg(topo)})
        except PlannerError as exc:  # write_files speaks of --emit, its usual caller
            raise CliError(f"--svg {args.svg}: {str(exc).split(': ', 1)[-1]}") from None
    if args.json:
        print(topo.model_dump_json(indent=2))
        return 0
    from cli.render import topology_table

    print(topology_table(topo))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from backend.anymodel import plan_any
    from planner.schema import PlanRequest

    if args.emit is not None:
        _check_output_path(args.emit, "--emit", "dir")
    elif args.pick is not None:
        raise CliError(f"--pick {args.pick}: needs --emit DIR (it chooses the candidate that is written)")
    request = request_from_args(args, PlanRequest)
    script = _script(args)
    result = plan_any(request)  # Hub ids read through huggingface_hub
    if args.emit is not None:
        if not result.candidates:
            raise CliError("no candidate to emit")
        pick = result.recommended if args.pick is None else _pick(result, args.pick)
        if pick is None:
            raise CliError("nothing fits, so nothing is emitted; see the rejected reasons")
        from cli.files import write_files
        from planner.plan.emit import emit_files

        written = write_files(args.emit, emit_files(request, pick, script))
        _report_emitted(written)
    if args.json:
        print(result.model_dump_json(indent=2, by_alias=True))
    else:
        from cli.render import plan_table

        print(plan_table(result))
    return 0


def _report_emitted(written: list[Path]) -> None:
    print(f"wrote {', '.join(str(p) for p in written)}; see LAUNCH.md", file=sys.stderr)
    if not any(p.name == "launch.sh" for p in written):
        guide = next(p for p in written if p.name == "LAUNCH.md").read_text()
        reason = next(line for line in guide.splitlines() if line.startswith("No launch.sh"))
        print(f"planner: note: {reason}", file=sys.stderr)


def _script(args: argparse.Namespace):
    """--script 'path/to/train.py ARGS': the user's training script in the emitted launch files."""
    if args.script is None:
        return None
    if not args.emit:
        raise CliError("--script names the training script of the emitted launch files: give --emit DIR too")
    from planner.plan.emit import Script

    return Script.parse(args.script)


def _add_emit_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--emit", type=path_arg, metavar="DIR", help=f"write launch files for {what}: launch.sh (deepspeed or "
                        "torchrun), job.sbatch (Slurm), the DeepSpeed JSON, an accelerate config, HF Trainer "
                        "arguments, plan.json; LAUNCH.md says how to run them")
    parser.add_argument("--script", metavar="'PATH ARGS'", help="with --emit: the training script the launch files "
                        "run, with its arguments (default: the planner's own trainer, python -m backend.worker)")


def _progress_printer():
    tty = sys.stderr.isatty()

    def show(step: int, total: int) -> None:
        if tty:
            filled = int(30 * step / total)
            sys.stderr.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] step {step}/{total}")
            if step == total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(f"  step {step}/{total} done\n")
        sys.stderr.flush()

    return show


def cmd_verify(args: argparse.Namespace) -> int:
    from planner.schema import EstimateRequest

    if args.plan:
        given = [k for k in vars(args) if k in EstimateRequest.model_fields]
        if given:
            raise CliError(f"--plan FILE already says what to run; drop --{given[0].rstrip('_').replace('_', '-')}")
        request = _request_from_plan(args.plan)
    else:
        request = request_from_args(args, EstimateRequest)
    from backend.profiles import profile_for

    profile_for(request)  # a profile it names must exist, as for estimate
    try:
        from backend.verify import verify
    except ImportError as exc:
        raise CliError(f"planner verify needs the backend extra (pip install -e '.[backend]'): {exc}") from None
    if args.hostfile:
        try:  # DeepSpeed's runner would only warn and run on this host alone
            with open(args.hostfile, "rb"):
                pass
        except OSError as exc:
            raise CliError(f"--hostfile {args.hostfile}: cannot be read ({exc.strerror})") from None
    print(f"planner: launching {request.strategy} on {request.world_size} x {request.gpu} ...", file=sys.stderr)
    with _stop_on_signals() as received:
        try:
            record = verify(request, steps=args.steps, warmup_steps=args.warmup, scale=args.scale,
                            timeout_seconds=args.timeout, tolerance=args.tolerance / 100, db=args.db,
                            hostfile=args.hostfile, on_progress=_progress_printer())
        except KeyboardInterrupt:
            print("planner: interrupted; every rank was ended and the run is recorded as interrupted",
                  file=sys.stderr)
            return 128 + received[0] if received else 130
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        from cli.render import verify_table

        print(verify_table(record))
    if record["status"] == "interrupted":
        print("planner: interrupted; every rank was ended and the run is recorded as interrupted", file=sys.stderr)
        return 128 + received[0] if received else 130
    return 0 if record["status"] == "ok" else 1


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[list[int]]:
    """While a verify runs, SIGTERM and SIGHUP end it as Ctrl-C does: every rank ended, the run
    recorded as interrupted, exit 128 + the signal. A repeated signal does not cut that cleanup short
    (the run's supervisor would still finish it if this process were killed). The caller's own
    handlers come back afterwards: `main([...])` called from Python (a test, a notebook) must not
    leave a handler that raises into whatever the caller does next. Off the main thread Python
    cannot install handlers; there a signal keeps its caller's meaning."""
    import signal
    import threading

    from backend.launch import Interrupted

    received: list[int] = []

    def stop(signum, _frame):
        if not received:
            received.append(signum)
            raise Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


MAX_PLAN_FILE_BYTES = 4 << 20  # an emitted plan.json (the chosen layout and its estimate request) is a few KiB


def _request_from_plan(path: str):
    from planner.model.catalogue import parse_json_text
    from planner.schema import EstimateRequest

    text = read_text_file(f"--plan {path}", path, MAX_PLAN_FILE_BYTES,
                          f"more than {MAX_PLAN_FILE_BYTES} bytes; not a plan.json written by `planner plan --emit`")
    data = parse_json_text(text, f"--plan {path}")
    if not isinstance(data, dict) or not isinstance(data.get("estimate_request"), dict):
        raise CliError(f"--plan {path}: not a plan.json written by `planner plan --emit` (no estimate_request)")
    try:
        return EstimateRequest.model_validate(data["estimate_request"])
    except ValidationError as exc:
        raise CliError(f"--plan {path}: {validation_message(exc)}") from None


def cmd_runs(args: argparse.Namespace) -> int:
    try:
        from backend.store import RunStore
    except ImportError as exc:
        raise CliError(f"planner runs needs the backend extra: {exc}") from None
    store = RunStore(args.db)
    if args.show is not None:
        run = store.get(args.show)
        if args.json:
            print(json.dumps(run, indent=2))
        else:
            from cli.render import verify_table

            print(verify_table(run["record"]))
        return 0
    rows = store.list(args.limit)
    if not store.exists:  # reading creates nothing
        print(f"planner: no runs recorded yet ({store.path} does not exist)", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'id':>4} {'status':<12} {'model':<22} {'strategy':<12} {'ranks':>5} {'pred peak MB':>13} {'meas peak MB':>13}")
    for r in rows:
        pred = f"{r['predicted_peak_bytes'] / 1e6:,.1f}" if r["predicted_peak_bytes"] else "-"
        meas = f"{r['measured_peak_bytes'] / 1e6:,.1f}" if r["measured_peak_bytes"] else "-"
        print(f"{r['id']:>4} {r['status']:<12} {r['model'][:22]:<22} {r['strategy']:<12} {r['world_size']:>5} {pred:>13} {meas:>13}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from planner.time.profiles import fit_profile

    try:
        from backend.profiles import save_profile
        from backend.store import RunStore
    except ImportError as exc:
        raise CliError(f"planner calibrate reads verify runs and needs the backend extra: {exc}") from None
    store = RunStore(args.db)
    runs = [(row["id"], store.get(row["id"])["record"]) for row in store.list(10_000) if row["status"] == "ok"]
    profile = fit_profile(args.name, runs, args.gpu)
    path = save_profile(profile)
    if args.json:
        print(profile.model_dump_json(indent=2))
        return 0
    print(f"profile {profile.name} for {profile.gpu}: compute scale {profile.compute_scale:.4f} (x every kernel "
          f"rate of the time model) from {len(profile.runs)} runs (saved to {path})")
    for r in profile.residuals:
        print(f"  run {r.run_id:>4}: measured {r.measured_step_seconds:.3f} s, fitted {r.predicted_step_seconds:.3f} s "
              f"({r.error_pct:+.1f}%)")
    print(f"link efficiency {profile.link_efficiency:.4f} from {len(profile.communication_residuals)} runs "
          "with timed collectives" + "".join(f"; {kind} {value:.4f}" for kind, value in profile.link_efficiencies.items()))
    for r in profile.communication_residuals:
        print(f"  run {r.run_id:>4}: collectives measured {r.measured_seconds:.4f} s, fitted "
              f"{r.predicted_seconds:.4f} s ({r.error_pct:+.1f}%)")
    print(f"note: {profile.note}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from web.app import create_app
    except ImportError as exc:
        raise CliError(f"planner serve needs the web extra (pip install -e '.[web]'): {exc}") from None
    from backend.store import RunStore

    from web.auth import TokenFileError, configured_token

    try:
        configured_token()  # a token file that gives no token: refuse to start (exit 2), not serve open
    except TokenFileError as exc:
        raise CliError(str(exc)) from None
    RunStore(args.db).mark_interrupted()  # a database that is not ours or is corrupt: exit 2 with the reason
    uvicorn.run(create_app(args.db, public_runs=args.public_runs or None), host=args.host, port=args.port,
                log_level="info")
    return 0


def _pick(result, index: int):
    if not 1 <= index <= len(result.candidates):
        raise CliError(f"--pick {index}: choose 1..{len(result.candidates)} (the candidate's rank)")
    return result.candidates[index - 1]


class _OnlyCommand:
    """The subcommands of a run, where only the command being run is built: the others' parsers
    and flags are needed only to list them (--help, a mistyped command), ~1% of a `planner
    estimate` process. ``only`` None builds them all."""

    def __init__(self, action: Any, only: str | None):
        self.action, self.only, self.built = action, only, False

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if self.only not in (None, name):
            return _NOT_RUN
        self.built = True
        return self.action.add_parser(name, **kwargs)


class _NotRun:
    """What a command not being run is given its flags on: nothing."""

    def add_argument(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_defaults(self, **kwargs: Any) -> None:
        pass


_NOT_RUN = _NotRun()


def build_parser(only: str | None = None, list_choices: bool = True) -> argparse.ArgumentParser:
    """The whole command line; ``only``: build this command alone (the one being run; the whole
    line when it names no command), ``list_choices``: name the catalogues' entries in the help
    (for --help)."""
    from planner.schema import (MAX_RUNS_LISTED, MAX_TIMEOUT_SECONDS, RANK, EstimateRequest, GpuName, ModelScale,
                                NewProfileName,
                                PlanRequest, Port, RunIdNumber, RunsLimit, TimeoutSeconds, TolerancePercent,
                                VerifySteps, WarmupSteps)

    parser = OneLineParser(prog="planner", description=(
        "How many bytes every GPU holds under each distributed strategy, and which one to use."))
    sub = _OnlyCommand(parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                             parser_class=OneLineParser), only)
    models = sub.add_parser("models", help="list the model catalogue")
    models.add_argument("--json", action="store_true", help="print a JSON list")
    models.set_defaults(handler=cmd_models)
    gpus = sub.add_parser("gpus", help="list the GPU catalogue")
    gpus.add_argument("--json", action="store_true", help="print a JSON list")
    gpus.set_defaults(handler=cmd_gpus)
    est = sub.add_parser("estimate", help="per-device memory of one configuration")
    if only in (None, "estimate"):
        add_schema_flags(est, EstimateRequest, list_choices=list_choices)
    _add_emit_flags(est, "this configuration")
    est.add_argument("--json", action="store_true", help="print the result as one JSON object")
    est.add_argument("--from", dest="from_files", nargs="+", type=path_arg, metavar="FILE",
                     help="read the job from its config files (as `planner check`); flags given win")
    est.set_defaults(handler=cmd_estimate)
    chk = sub.add_parser("check", help="read a job's own config files (torchtitan, accelerate, HF Trainer/TRL, "
                         "Axolotl, LLaMA-Factory, DeepSpeed): fits, peak, step and wall time, what to change")
    chk.add_argument("files", nargs="+", type=path_arg, metavar="FILE", help="the job's config files")
    chk.add_argument("--gpu", type=schema_type(GpuName), help="device type (default: h100-80gb)")
    chk.add_argument("--gpus", type=int, help="GPUs per node (default: 8)")
    chk.add_argument("--nodes", type=int, help="nodes (default: 1)")
    chk.add_argument("--model", help="the model, where the files do not name it")
    chk.add_argument("--seq-len", dest="seq_len", type=int, help="tokens per sequence, where the files do not say it")
    chk.add_argument("--tokens", type=int, help="tokens the job trains on (its length)")
    chk.add_argument("--dataset-tokens", dest="dataset_tokens", type=int,
                     help="tokens in one epoch of the dataset (with a file's epochs)")
    chk.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a dotted key of the first file")
    chk.add_argument("--emit", type=path_arg, metavar="DIR", help="write the files back, with the first change applied")
    chk.add_argument("--json", action="store_true", help="print the result as one JSON object")
    chk.set_defaults(handler=cmd_check)
    topo = sub.add_parser("topo", help="parse `nvidia-smi topo -m` (a file or stdin) or show a preset")
    topo.add_argument("--file", type=path_arg, help="a file with `nvidia-smi topo -m` output (default: stdin)")
    topo.add_argument("--preset", help="a preset machine instead (see --list)")
    topo.add_argument("--list", action="store_true", help="list the presets")
    topo.add_argument("--gpu", help="GPU type, which decides what each link code means; required with --file or "
                                     "stdin (see `planner gpus`), implied by --preset")
    topo.add_argument("--svg", type=path_arg, metavar="FILE", help="write a picture of the topology")
    topo.add_argument("--json", action="store_true", help="print the parsed topology as JSON")
    topo.set_defaults(handler=cmd_topo)
    pl = sub.add_parser("plan", help="rank every strategy x micro-batch x checkpointing x offload that fits")
    if only in (None, "plan"):
        add_schema_flags(pl, PlanRequest, list_choices=list_choices)
    _add_emit_flags(pl, "the recommended candidate (or --pick N)")
    pl.add_argument("--pick", type=schema_type(RANK), help="emit the candidate of this rank instead of the recommended one")
    pl.add_argument("--json", action="store_true", help="print the result as one JSON object")
    pl.add_argument("--from", dest="from_files", nargs="+", type=path_arg, metavar="FILE",
                     help="read the job from its config files (as `planner check`); flags given win")
    pl.set_defaults(handler=cmd_plan)
    ver = sub.add_parser("verify", help="launch the configuration through deepspeed, measure every rank, compare")
    if only in (None, "verify"):
        add_schema_flags(ver, EstimateRequest, list_choices=list_choices)
    ver.add_argument("--plan", type=path_arg, metavar="FILE", help="run the candidate of a plan.json written by `planner plan --emit`")
    ver.add_argument("--steps", type=schema_type(VerifySteps), default=3, help="measured steps, 1-100 (default: 3)")
    ver.add_argument("--warmup", type=schema_type(WarmupSteps), default=1,
                     help="warm-up steps before measuring, 0-20 (default: 1)")
    ver.add_argument("--scale", type=schema_type(ModelScale), default=1.0,
                     help="shrink the model by this factor (0, 1] to fit the machine")
    ver.add_argument("--timeout", type=schema_type(TimeoutSeconds),
                     help=f"seconds before the run is ended, (0, {MAX_TIMEOUT_SECONDS}] (default: sized to the run)")
    ver.add_argument("--tolerance", type=schema_type(TolerancePercent), default=5.0,
                     help="verdict tolerance in percent, (0, 100] (default: 5)")
    ver.add_argument("--db", type=path_arg, help="runs database (default: the user's data directory)")
    ver.add_argument("--hostfile", type=path_arg, help="deepspeed hostfile for multi-node runs")
    ver.add_argument("--json", action="store_true", help="print the record as one JSON object")
    ver.add_argument("--from", dest="from_files", nargs="+", type=path_arg, metavar="FILE",
                     help="read the job from its config files (as `planner check`); flags given win")
    ver.set_defaults(handler=cmd_verify)
    cal = sub.add_parser("calibrate", help="fit efficiency constants from stored verify runs into a named profile")
    cal.add_argument("--name", required=True, type=schema_type(NewProfileName),
                     help="profile name, used later with --profile (1-64 letters, digits, '.', '_' or '-')")
    cal.add_argument("--gpu", type=schema_type(GpuName), help="only runs on this GPU type")
    cal.add_argument("--db", type=path_arg, help="runs database (default: the user's data directory)")
    cal.add_argument("--json", action="store_true", help="print the profile as JSON")
    cal.set_defaults(handler=cmd_calibrate)
    serve = sub.add_parser("serve", help="serve the REST API (/v1, /docs) and the web page (/)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=schema_type(Port), default=8000, help="port, 0-65535 (default: 8000)")
    serve.add_argument("--db", type=path_arg, help="runs database (default: the user's data directory)")
    serve.add_argument("--public-runs", action="store_true",
                       help="serve run records (GET /v1/runs) without the token even when one is configured "
                            "(default: PLANNER_PUBLIC_RUNS=1, else behind the token)")
    serve.set_defaults(handler=cmd_serve)
    runs = sub.add_parser("runs", help="list past verify runs, or show one")
    runs.add_argument("show", nargs="?", type=schema_type(RunIdNumber), metavar="ID", help="show this run")
    runs.add_argument("--db", type=path_arg, help="runs database (default: the user's data directory)")
    runs.add_argument("--limit", type=schema_type(RunsLimit), default=100,
                      help=f"most recent runs to list, 1-{MAX_RUNS_LISTED} (default: 100)")
    runs.add_argument("--json", action="store_true", help="print JSON")
    runs.set_defaults(handler=cmd_runs)
    if not sub.built:  # not a command: argparse's refusal lists them all
        return build_parser(None, list_choices)
    return parser


def main(argv: list[str] | None = None) -> int:
    from planner.errors import PlannerError

    from_command_line = argv is None  # the `planner` process itself, not a caller in Python (tests)
    if from_command_line:
        gc.disable()  # start-up allocates ~10^6 objects (schema, catalogues, numpy) and frees none in cycles
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the command being run gets its schema flags, and the catalogues are read for the help
    # text only when help is asked for: ~30 ms of a `planner estimate` process otherwise.
    wants_help = any(a in ("-h", "--help") for a in argv)
    parser = build_parser(only=argv[0] if argv and not wants_help else None, list_choices=wants_help)
    if argv[:2] and argv[0] == "runs" and len(argv) > 1 and argv[1] == "show":
        argv = ["runs"] + argv[2:]  # `planner runs show ID` reads as `planner runs ID`
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return int(exc.code or 0) and EXIT_USAGE
    if from_command_line and args.command not in QUICK_COMMANDS:
        gc.enable()  # a server, a run or a fit lives long: collect as usual
    try:
        return args.handler(args)
    except (PlannerError, CliError) as exc:
        print(one_line(f"planner: error: {error_message(exc)}"), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    finally:
        if from_command_line and args.command in QUICK_COMMANDS:
            # The process exits next. Frozen, the objects pydantic and numpy allocated are skipped by
            # the collections of the interpreter's exit, ~30 ms of a ~250 ms `planner estimate` here
            # (bench/speed.py). These commands hold no resource past their return (files are written
            # with `with`; the standard streams are flushed at exit as before).
            gc.freeze()


if __name__ == "__main__":
    sys.exit(main())
