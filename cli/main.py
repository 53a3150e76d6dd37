"""The `planner` command: a thin adapter over the pure core.

Flags are generated from the pydantic request schema (one source of truth: a field ``micro_batch``
is ``--micro-batch``, its description is the help). Every error a user can cause ends in one line
on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import typing
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

EXIT_USAGE = 2
# Fields read from a file by the CLI: the flag names the file, the request holds its content.
FILE_FLAGS = {"model_config_": "--model-file", "ds_config": "--ds-config"}


class CliError(Exception):
    """A one-line error for the user (exit code 2)."""


def _flag(name: str) -> str:
    return FILE_FLAGS.get(name) or "--" + name.rstrip("_").replace("_", "-")


def _choices(annotation: Any) -> list[str] | None:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    for arg in args:
        if typing.get_origin(arg) is typing.Literal:
            return list(typing.get_args(arg))
    return None


def _scalar_type(annotation: Any) -> Callable[[str], Any]:
    args = typing.get_args(annotation) or (annotation,)
    for kind in (int, float):
        if kind in args:
            return kind
    return str


def add_schema_flags(parser: argparse.ArgumentParser, model: type[BaseModel],
                     skip: tuple[str, ...] = ()) -> None:
    """One flag per schema field; defaults stay in the schema (argparse stores SUPPRESS)."""
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        flag = _flag(name)
        help_text = field.description or ""
        if name in FILE_FLAGS:
            parser.add_argument(flag, dest=name, metavar="PATH", default=argparse.SUPPRESS,
                                help=f"{help_text} (a file path)")
            continue
        choices = _choices(field.annotation)
        default = field.default if field.default is not None else "none"
        kwargs: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS,
                                      help=f"{help_text} (default: {default})")
        if choices:
            kwargs["choices"] = choices
        else:
            kwargs["type"] = _scalar_type(field.annotation)
        parser.add_argument(flag, **kwargs)


def _read_file_flag(name: str, path: str) -> Any:
    from planner.catalogue import MAX_MODEL_FILE_BYTES, model_from_file

    if name == "model_config_":
        resolved = model_from_file(path)  # validates and names the file in every error
        return {"name": resolved.name, "config": resolved.config}
    file = Path(path)
    try:
        if file.stat().st_size > MAX_MODEL_FILE_BYTES:
            raise CliError(f"{FILE_FLAGS[name]} {path}: too large for a DeepSpeed config")
        text = file.read_text()
    except OSError as exc:
        raise CliError(f"{FILE_FLAGS[name]} {path}: cannot be read ({exc.strerror})") from None
    from planner.catalogue import parse_json_text

    return parse_json_text(text, f"{FILE_FLAGS[name]} {path}")


def request_from_args(args: argparse.Namespace, model: type[BaseModel]) -> BaseModel:
    values = {k: v for k, v in vars(args).items() if k in model.model_fields}
    for name in FILE_FLAGS:
        if name in values:
            values[name] = _read_file_flag(name, values[name])
    if "model_config_" in values:
        values["model_config"] = values.pop("model_config_")
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


# --- commands --------------------------------------------------------------------------------

def cmd_models(args: argparse.Namespace) -> int:
    from planner.catalogue import catalogue_model, load_catalogue

    rows = []
    for name, entry in load_catalogue().items():
        resolved = catalogue_model(name)
        rows.append({"name": name, "family": entry.family, "parameters": resolved.parameters,
                     "source": entry.source, "config": entry.config})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'name':<18} {'family':<9} {'parameters':>17}")
    for row in rows:
        print(f"{row['name']:<18} {row['family']:<9} {row['parameters']:>17,}")
    return 0


def cmd_gpus(args: argparse.Namespace) -> int:
    from planner.gpus import load_gpus

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
    from planner.memory import estimate
    from planner.schema import EstimateRequest

    request = request_from_args(args, EstimateRequest)
    result = estimate(request)
    if args.json:
        print(result.model_dump_json(indent=2, by_alias=True))
    else:
        from cli.render import estimate_table

        print(estimate_table(result))
    return 0


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2), not the whole usage text."""

    def error(self, message: str) -> typing.NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from planner.schema import EstimateRequest

    parser = OneLineParser(prog="planner", description=(
        "How many bytes every GPU holds under each distributed strategy, and which one to use."))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=OneLineParser)
    models = sub.add_parser("models", help="list the model catalogue")
    models.add_argument("--json", action="store_true", help="print a JSON list")
    models.set_defaults(handler=cmd_models)
    gpus = sub.add_parser("gpus", help="list the GPU catalogue")
    gpus.add_argument("--json", action="store_true", help="print a JSON list")
    gpus.set_defaults(handler=cmd_gpus)
    est = sub.add_parser("estimate", help="per-device memory of one configuration")
    add_schema_flags(est, EstimateRequest)
    est.add_argument("--json", action="store_true", help="print the result as one JSON object")
    est.set_defaults(handler=cmd_estimate)
    return parser


def main(argv: list[str] | None = None) -> int:
    from planner.errors import PlannerError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return int(exc.code or 0) and EXIT_USAGE
    try:
        return args.handler(args)
    except (PlannerError, CliError) as exc:
        print(f"planner: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("planner: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
