"""`planner verify`: predict, launch, measure every rank, compare, keep the record."""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import platform
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from backend.errors import JobConflict
from backend.launch import Interrupted, gpu_ids, run_probe
from backend.store import RunStore
from backend.supervisor import clean_stale_runs
from planner.model.attention.kinds import kind_of
from planner.model.catalogue import UnsupportedModelTypeError, catalogue_model, model_from_config
from planner.errors import PlannerError
from planner.memory.orchestrator import cpu_rank_bytes, estimate, setup_of
from planner.schema import EstimateRequest
from planner.strategies import strategy

DEFAULT_TOLERANCE = 0.05


def scale_config(config: dict[str, Any], factor: float) -> tuple[dict[str, Any], str]:
    """Shrink a model for a machine too small for it, keeping its family and shape ratios: fewer
    layers, fewer heads of the same width (GQA ratio kept), hidden and MLP width in proportion.
    MoE: fewer experts (never fewer than top-k; whole routing groups), expert widths in proportion;
    MLA: the q/kv LoRA ranks in proportion, the rope/nope/v head widths kept (fewer heads of the
    same width, as for any attention); layer patterns (layer_types, dense-first layers,
    mlp_only_layers, moe_layers, no_rope_layers) cut to the new depth."""
    if not 0 < factor <= 1:
        raise PlannerError(f"--scale must be in (0, 1], got {factor}")
    if factor == 1:
        return config, ""
    from planner.model.architecture import from_hf_config, layer_specs

    a = from_hf_config(config)
    # a kind whose hidden width is not heads x head width (MLA: DeepSeek-V3's 7168 = 128 heads of 56)
    mla = any(not kind_of(spec.attention).hidden_is_heads_by_head_dim for spec in layer_specs(a))
    group = a.num_attention_heads // a.num_key_value_heads
    kv = max(1, round(a.num_key_value_heads * factor))
    heads = kv * group
    # MLA's hidden width is not heads x head width (DeepSeek-V3: 7168 = 128 heads of 56): in proportion
    hidden = round(a.hidden_size * heads / a.num_attention_heads) if mla else heads * a.head_dim
    inner = max(1, round(a.intermediate_size * hidden / a.hidden_size))
    layers = max(1, round(a.num_layers * factor))
    # a multimodal config (gemma3, llama4, mistral3) is scaled inside its text_config, the part
    # the planner models and the backend trains
    outer, config = config, (config.get("text_config") or {}) if "text_config" in config else config
    scaled = dict(config)
    names = {"gpt2": ("n_layer", "n_embd", "n_head", "n_inner")}.get(a.model_type)
    if names:
        scaled.update({names[0]: layers, names[1]: hidden, names[2]: heads, names[3]: inner})
    else:
        scaled.update(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      intermediate_size=inner)
        if "num_key_value_heads" in config or a.num_key_value_heads != a.num_attention_heads:
            scaled["num_key_value_heads"] = kv
        if "head_dim" in config:
            scaled["head_dim"] = a.head_dim
        if a.model_type == "falcon":
            scaled.pop("intermediate_size")
            scaled["ffn_hidden_size"] = inner
    scaled.update(_scaled_widths(config, hidden / a.hidden_size))
    scaled.update(_scaled_layer_pattern(config, layers))
    experts = _scaled_experts(a, config, factor) if a.num_experts > 1 else {}
    scaled.update(experts)
    if config is not outer:
        scaled = dict(outer, text_config=scaled)
    moe = (f", experts {a.num_experts}->{experts[_expert_key(a, config)]} (top-{a.experts_per_token} kept)"
           if experts else "")
    note = (f"scaled by {factor}: {a.num_layers}->{layers} layers, hidden {a.hidden_size}->{hidden}, "
            f"heads {a.num_attention_heads}->{heads} (kv {a.num_key_value_heads}->{kv}), MLP {a.intermediate_size}->{inner}"
            f"{moe}; the prediction is for the scaled model")
    return scaled, note


# Widths that scale with the hidden size: expert and dense MLP widths of the MoE families
# (qwen3_moe/deepseek moe_intermediate_size, llama4's dense intermediate_size_mlp) and MLA's
# latent ranks (q_lora_rank None stays None: DeepSeek-V2-Lite projects q directly).
_WIDTHS = ("moe_intermediate_size", "intermediate_size_mlp", "q_lora_rank", "kv_lora_rank")


def _scaled_widths(config: dict[str, Any], ratio: float) -> dict[str, int]:
    return {name: max(1, round(config[name] * ratio)) for name in _WIDTHS
            if isinstance(config.get(name), int) and not isinstance(config.get(name), bool)}


def _scaled_layer_pattern(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """Per-layer fields cut to the first ``layers`` layers, so that the scaled config keeps the
    family's pattern (sliding/full, dense-first, NoPE every n-th) and transformers accepts it."""
    out: dict[str, Any] = {}
    for name in ("layer_types", "no_rope_layers"):  # one entry per layer
        if isinstance(config.get(name), list):
            out[name] = config[name][:layers]
    for name in ("mlp_only_layers", "moe_layers"):  # layer indices
        if isinstance(config.get(name), list):
            out[name] = [i for i in config[name] if isinstance(i, int) and i < layers]
    if isinstance(config.get("max_window_layers"), int):
        out["max_window_layers"] = min(config["max_window_layers"], layers)
    dense_first = config.get("first_k_dense_replace")
    if isinstance(dense_first, int) and dense_first > 0:
        # DeepSeek's dense layers first: as many as fit, but at least one MoE layer stays
        out["first_k_dense_replace"] = min(dense_first, max(0, layers - 1))
    return out


def _expert_key(a, config: dict[str, Any]) -> str:
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if name in config:
            return name
    return {"qwen3_moe": "num_experts"}.get(a.model_type,
                                            "n_routed_experts" if a.model_type.startswith("deepseek") else
                                            "num_local_experts")


def _scaled_experts(a, config: dict[str, Any], factor: float) -> dict[str, int]:
    """Fewer routed experts, never fewer than top-k. DeepSeek's group-limited routing needs whole
    groups of at least two experts (its per-group top-2 score, modeling_deepseek_v3.py
    DeepseekV3TopkRouter.get_topk_indices) and enough experts in the kept groups for top-k."""
    k = a.experts_per_token
    experts = max(k, round(a.num_experts * factor))
    out = {_expert_key(a, config): experts}
    groups, kept = config.get("n_group"), config.get("topk_group")
    if a.model_type == "deepseek_v3" and groups is None:
        groups, kept = 8, 4  # DeepseekV3Config's defaults: always group-limited
    if isinstance(groups, int) and groups > 1 and isinstance(kept, int):
        groups = min(groups, max(1, experts // 2))
        kept = min(kept, groups)
        per_group = max(2, -(-experts // groups), -(-k // kept))
        out.update({_expert_key(a, config): per_group * groups, "n_group": groups, "topk_group": kept})
    return out


LOCK_DIR = Path("/tmp/planner-locks")  # one per host; PLANNER_LOCK_DIR moves it (for tests only)


def lock_dir() -> Path:
    return Path(os.environ.get("PLANNER_LOCK_DIR") or LOCK_DIR)


def run_registry() -> Path:
    """Where each run's supervisor registers itself while it lives (backend.supervisor)."""
    return lock_dir() / "runs"


def device_names(request: EstimateRequest) -> list[str]:
    """The devices this host's share of the run uses: 'cpu', or one name per CUDA device, in
    CUDA_VISIBLE_DEVICES's own terms: the ones the launcher really starts the ranks on
    (backend.launch.gpu_ids, which launcher_command passes to deepspeed as --include)."""
    if request.gpu == "cpu":
        return ["cpu"]
    framework = strategy(request.strategy).framework
    return ["cuda-" + re.sub(r"[^A-Za-z0-9._-]", "_", d) for d in gpu_ids(request, framework)]


@contextmanager
def device_lock(request: EstimateRequest) -> Iterator[tuple[int, ...]]:
    """One verify run at a time per device on this host, whichever database records it: an flock
    per device in lock_dir(). Yields the locked file descriptors; backend.launch hands them to the
    run's supervisor, which holds them (same open file description, so the same lock) until the
    last process of the run is gone, even after this process has ended. Never LOCK_UN here: that
    would release the supervisor's hold too."""
    directory = lock_dir()
    try:
        for shared in (directory, run_registry()):
            shared.mkdir(parents=True, exist_ok=True)
            if shared.stat().st_uid == os.getuid():
                shared.chmod(0o1777)  # every user of the host locks here; only owners remove (sticky)
    except OSError as exc:
        raise PlannerError(f"device locks: cannot use {directory} ({exc.strerror})") from None
    fds: list[int] = []
    try:
        for name in device_names(request):
            path = directory / f"{name}.lock"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as exc:
                raise PlannerError(f"device lock {path}: cannot be opened ({exc.strerror})") from None
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                raise JobConflict(f"another planner verify is running on the same devices ({name}, pid {holder}); "
                                  f"wait for it to finish (lock {path})", field="gpu") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield tuple(fds)
    finally:
        for fd in fds:
            os.close(fd)


def environment() -> dict[str, Any]:
    versions = {}
    for package in ("torch", "deepspeed", "transformers", "planner"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"versions": versions, "python": platform.python_version(), "host": platform.node(),
            "platform": platform.platform()}


def _components(prediction, rank: dict) -> dict[str, dict[str, Any]]:
    """Resident bytes by component, predicted (the estimate's "between steps" phase) and measured
    on rank 0 (backend/train.py resident_by_category: the engine's own tensors; whatever they do
    not reach is framework buffers). Informational: the verdict is on the totals."""
    from planner.memory.orchestrator import resident_by_component

    measured = rank.get("by_category_resident") or {}
    measured_by = {"parameters": measured.get("parameters", 0), "gradients": measured.get("gradients", 0),
                   "optimizer_states": measured.get("master_weights", 0) + measured.get("optimizer_states", 0),
                   "buffers": measured.get("buffers", 0)}
    rows = {name: {"predicted": value, "measured": measured_by[name], "error_pct": _pct(value, measured_by[name])}
            for name, value in resident_by_component(prediction).items()}
    if prediction.gpu == "cpu" and prediction.host.resident_bytes:
        # on CPU ranks the offloaded states are in the same RAM, so the measured categories above
        # include them; the prediction keeps them apart, as host memory
        share = prediction.host.resident_bytes // max(1, prediction.request.gpus)
        rows["host_offload_share"] = {"predicted": share, "measured": 0, "error_pct": None}
    return rows


def _communication(request: EstimateRequest, ranks: list[dict]) -> dict:
    """Collective payload per step: measured on rank 0 (one counted step after the measured ones)
    next to what the time model sends."""
    from planner.time.step import collective_volumes

    measured = ranks[0].get("collectives") or {}
    modelled = collective_volumes(request)
    return {"measured_rank0": measured,
            "measured_bytes_per_step": sum(v["bytes"] for v in measured.values()),
            "modelled": modelled,
            "modelled_bytes_per_step": sum(v["bytes_per_step"] for v in modelled)}


def check_devices(request: EstimateRequest) -> None:
    """Refuse, before anything is launched or recorded, a GPU run on a machine without the GPUs
    (this node's share: --gpus; other nodes are the hostfile's business). CPU ranks need none."""
    if request.gpu == "cpu":
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < request.gpus:
        raise PlannerError(f"gpu {request.gpu}: this machine has {found} CUDA device(s), the run needs gpus({request.gpus}); "
                           "verify on CPU ranks with --gpu cpu, or run where the GPUs are")


def _pct(predicted: int, measured: int | None) -> float | None:
    return None if not measured else 100.0 * (predicted - measured) / measured


def verify(request: EstimateRequest, *, steps: int = 3, warmup_steps: int = 1, scale: float = 1.0,
           timeout_seconds: float | None = None, tolerance: float = DEFAULT_TOLERANCE, db: str | None = None,
           hostfile: str | None = None, on_progress: Callable[[int, int], None] | None = None,
           work_dir: str | None = None, cancel=None, on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
    if not 1 <= steps <= 1000 or not 0 <= warmup_steps <= 100:
        raise PlannerError(f"steps must be 1..1000 and warmup 0..100, got steps {steps}, warmup {warmup_steps}")
    # estimate's defaults describe a cluster to plan for (8 x h100-80gb); a launch must say what
    # this machine runs, or `verify --gpu cpu` would start 8 ranks and a GPU run be compared with
    # another GPU's prediction.
    missing = [name for name in ("gpu", "gpus") if name not in request.model_fields_set]
    if missing:
        raise PlannerError(f"verify launches real ranks: give {' and '.join('--' + m for m in missing)} "
                           "(the devices of this machine to run on, e.g. --gpu cpu --gpus 2)")
    scale_note = ""
    if scale != 1.0:
        base = catalogue_model(request.model) if request.model else model_from_config(request.model_config_)
        if base.config is None:
            raise PlannerError("--scale needs an architecture (--model or --model-file)")
        scaled, scale_note = scale_config(base.config, scale)
        request = request.model_copy(update={"model": None, "model_config_": {"name": f"{base.name}-scaled", "config": scaled}})
    try:
        prediction = estimate(request)
    except UnsupportedModelTypeError as exc:
        raise PlannerError(f"{exc.name}: model_type {exc.config.get('model_type')!r} is estimated by tracing only; "
                           "verify trains the families the core reads analytically (see `planner models`)") from None
    if prediction.host.fits is False:  # the ranks' offload would exhaust the node's RAM: refused, not launched
        over = next(n for n in prediction.notes if n.startswith("host RAM does NOT fit"))
        raise PlannerError(f"{over}; verify does not launch a run that exceeds the node's host RAM "
                           "(less offload, more nodes, or the node's real RAM in --host-memory-gib)")
    check_devices(request)
    store = RunStore(db, create=True)
    store.mark_interrupted()  # only runs whose owner process is gone
    record: dict[str, Any] = {
        "status": "running", "message": "", "model": prediction.model.name, "scaled": scale_note or None,
        "request": request.model_dump(by_alias=True), "prediction": prediction.model_dump(by_alias=True),
        "measured": None, "errors": None, "tolerance": tolerance, "environment": environment(),
        "steps": steps, "warmup_steps": warmup_steps,
    }
    run_id = store.start(record)
    record["id"] = run_id
    if on_start is not None:
        on_start(run_id)
    timeout = timeout_seconds or (180.0 + 60.0 * (steps + warmup_steps) * max(1, request.gradient_accumulation))
    out_dir = Path(work_dir) if work_dir else None
    try:
        with device_lock(request) as lock_fds:
            out_dir = out_dir or Path(tempfile.mkdtemp(prefix=f"planner-run{run_id}-"))  # not for a refused run
            clean_stale_runs(run_registry())  # segments of a run whose supervisor was killed
            result = run_probe(request, out_dir=out_dir, steps=steps, warmup_steps=warmup_steps,
                               timeout_seconds=timeout, hostfile=hostfile, on_progress=on_progress,
                               cancel=cancel, lock_fds=lock_fds, db=str(store.path), run_id=run_id,
                               registry=run_registry(), setup=setup_of(prediction))
    except PlannerError as exc:
        record.update(status="refused", message=str(exc))
        store.finish(run_id, record)
        raise
    except KeyboardInterrupt as exc:
        why = str(exc) if isinstance(exc, Interrupted) else "Ctrl-C"
        record.update(status="interrupted", message=f"interrupted ({why}) before the ranks started",
                      work_dir=str(out_dir) if out_dir else None)
        store.finish(run_id, record)
        raise
    progress = out_dir / "progress0.txt"
    completed = len(progress.read_text().splitlines()) if progress.exists() else 0
    record.update(status=result.status, message=result.message, log_tail=result.log_tail[-4000:],
                  wall_seconds=result.seconds, work_dir=str(out_dir), steps_completed=completed)
    if result.status != "ok":
        record["message"] += f" (after {completed} of {steps + warmup_steps} steps)"
    ok_ranks = [r for r in result.ranks if r.get("status") == "ok"]
    if ok_ranks:
        peak = max(r["peak_bytes"] for r in ok_ranks)
        resident = max(r["resident_bytes"] for r in ok_ranks)
        seconds = max(r["step_seconds"] for r in ok_ranks)
        record["measured"] = {"peak_bytes": peak, "resident_bytes": resident, "step_seconds": seconds,
                              "tokens_per_second": min(r["tokens_per_second"] for r in ok_ranks) * request.world_size,
                              "ranks": result.ranks}
        predicted_peak, predicted_resident = (cpu_rank_bytes(prediction, request.gpus) if request.gpu == "cpu"
                                              else (prediction.per_device.peak_bytes, prediction.per_device.resident_bytes))
        # on CPU ranks the host is the same RAM: what offload moves there is the rank's too
        record["predicted_rank"] = {"peak_bytes": predicted_peak, "resident_bytes": predicted_resident}
        errors = {"peak_pct": _pct(predicted_peak, peak), "resident_pct": _pct(predicted_resident, resident)}
        errors["within_tolerance"] = all(abs(v) <= 100 * tolerance for v in errors.values() if v is not None)
        errors["resident_components"] = _components(prediction, ok_ranks[0])
        record["errors"] = errors
        record["communication"] = _communication(request, ok_ranks)
    else:
        record["measured"] = {"ranks": result.ranks}
        if result.status == "oom":
            fits = "would fit" if prediction.fits else "would not fit"
            record["message"] += (f"; the prediction said the peak ({prediction.per_device.peak_bytes:,} bytes) "
                                  f"{fits} on {request.gpu}")
    store.finish(run_id, record)
    return record
