"""Any causal LM transformers can build: the parameters counted on the meta device, the
activations measured by tracing one training step on fake tensors.

The analytic core reads a fixed set of model types (planner/model/architecture.py). For any other,
this adapter builds the model with transformers exactly as the verification backend does, counts
its parameters on the meta device (tied weights once, in registration order, the order DeepSpeed
flattens them in), and runs one forward and backward under ``FakeTensorMode`` (tensors with
shapes and dtypes but no storage, so a 70B model traces on a laptop) inside torch's
``MemTracker`` (torch/distributed/_tools/mem_tracker.py, the tracker torchtitan's memory
estimator uses). The tracker sees every tensor the step allocates and frees, categorised as
parameter, gradient, activation or temporary; a timeline of its live total, with the moments each
decoder block starts its forward and its backward, gives the figures the memory model needs
(catalogue.TracedProfile). The result is fed to the same phase model as an analytic architecture.
"""

from __future__ import annotations

import json
import logging as std_logging
import re
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from planner.model.catalogue import TracedProfile
from planner.errors import PlannerError
from planner.memory.orchestrator import traced_setting

EXTRA = "pip install -e '.[backend]'"
# A trace walks every block in Python (about 0.3-0.5 s per block at 4k tokens on this project's
# 2-core machine); the deepest published LLMs have 61-126 blocks (DeepSeek-V3, Llama-3.1-405B).
MAX_TRACED_LAYERS = 256


def _imports():
    # torchao, which transformers' quantizers import when it is installed, warns on its logger for
    # each compiled extension this machine cannot load (GPU builds on a CPU host), and torch's pytree
    # for each enum torchao registers: not the trace's concern, so kept to errors
    for name in ("torchao", "torch.utils._pytree"):
        std_logging.getLogger(name).setLevel(std_logging.ERROR)
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise PlannerError(f"tracing a model_type without an analytic reader needs the backend extra "
                           f"(torch and transformers): {EXTRA} ({exc.name} is not installed)") from None
    return torch, transformers


@contextmanager
def _quiet(transformers):
    """transformers' config validation warns about token ids outside a small vocabulary and the
    like; the estimate's notes say what matters, so the logs are kept to errors while tracing."""
    logging = transformers.utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    # FakeTensorMode logs the full stack of an op that fails on a config's bad values before it
    # raises; the error is reported once, in one line, by the caller
    fake_log = std_logging.getLogger("torch._subclasses.fake_tensor")
    fake_level = fake_log.level
    fake_log.setLevel(std_logging.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)
        fake_log.setLevel(fake_level)


def _hf_config(transformers, config: dict[str, Any], name: str):
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    model_type = fields.pop("model_type", None)
    try:
        hf = transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - unknown type, or a value its config class refuses
        raise PlannerError(f"{name}: transformers {transformers.__version__} cannot build model_type "
                           f"{model_type!r} either: {_first_line(exc)}") from None
    hf.use_cache = False  # training: no KV cache (backend/train.py does the same)
    layers = getattr(hf, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > MAX_TRACED_LAYERS:
        raise PlannerError(f"{name}: num_hidden_layers({layers}) is more than a trace walks "
                           f"(limit {MAX_TRACED_LAYERS})")
    return hf


def _build(transformers, hf, attention: str, dtype):
    try:
        return transformers.AutoModelForCausalLM.from_config(hf, attn_implementation=attention, dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - a user's config inside a third-party constructor: any error is theirs
        raise PlannerError(f"model_type {hf.model_type!r}: transformers cannot build it as a causal LM "
                           f"with attention {attention!r}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _blocks(torch, model) -> tuple[str, list]:
    """The decoder blocks: the ModuleList of transformers' block class (``_no_split_modules``,
    FSDP's wrapping unit), else the longest ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    lists = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    typed = [(fqn, m) for fqn, m in lists if type(m[0]).__name__ in names]
    chosen = max(typed or lists, key=lambda pair: len(pair[1]), default=None)
    if chosen is None:
        raise PlannerError(f"{type(model).__name__}: no list of decoder blocks found to trace")
    return chosen[0], list(chosen[1])


@dataclass
class _Count:
    parameters: int
    numels: tuple[int, ...]
    blocks_parameters: int
    layer_parameters: int
    late_parameters: int
    lm_head_elements: int
    block_class: str
    blocks_path: str
    num_layers: int
    experts: str | None = None  # the experts module and transformers' implementation, for MoE
    largest_block_parameters: int = 0  # the biggest block: what FSDP gathers and prefetches as one unit
    tied_head_elements: int = 0  # the LM head's weight when it is the input embedding's (tied)


def count_parameters(config: dict[str, Any], name: str = "model") -> _Count:
    """transformers' own count on the meta device: ``sum(p.numel() for p in model.parameters())``."""
    torch, transformers = _imports()
    with _quiet(transformers):
        hf = _hf_config(transformers, config, name)
        with torch.device("meta"):
            model = _build(transformers, hf, "eager", torch.float32)
    params = list(model.parameters())
    path, blocks = _blocks(torch, model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    head = model.get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    # Parameters used before the first block (token and learned position embeddings): backward
    # produces their gradients last, unless one is the tied LM head's weight.
    first = next(iter(blocks[0].parameters()), None)
    order = [p for p in params]
    before = order[:next((i for i, p in enumerate(order) if p is first), 0)]
    late = sum(p.numel() for p in before if id(p) not in in_blocks and id(p) not in head_ids)
    blocks_total = sum(p.numel() for p in params if id(p) in in_blocks)
    largest = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    embeddings = model.get_input_embeddings()
    tied = (head.weight.numel() if head is not None and embeddings is not None
            and getattr(head, "weight", None) is getattr(embeddings, "weight", False) else 0)
    expert_module = next((type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Experts")), None)
    experts = (f"{expert_module} ({getattr(model.config, '_experts_implementation', None) or 'eager'})"
               if expert_module else None)
    return _Count(parameters=sum(p.numel() for p in params), numels=tuple(p.numel() for p in params),
                  blocks_parameters=blocks_total, layer_parameters=blocks_total // len(blocks),
                  late_parameters=late,
                  lm_head_elements=head.weight.numel() if head is not None else 0,
                  block_class=type(blocks[0]).__name__, blocks_path=path, num_layers=len(blocks),
                  experts=experts, largest_block_parameters=largest, tied_head_elements=tied)


# --- the trace -------------------------------------------------------------------------------

@dataclass
class _Trace:
    saved: int = 0  # live activations when the forward returned
    kept: list[int] = field(default_factory=list)  # per block: what it leaves live until its backward
    loss_transient: int = 0
    layer_transients: list[int] = field(default_factory=list)  # per block, above act at its backward start
    events: int = field(default=0, compare=False)  # the tracker's recorded updates: grows with the sequence only where Python loops over tokens

    def scaled(self, other: "_Trace", s1: int, s2: int, seq_len: int) -> "_Trace":
        """The figures at ``seq_len`` from this trace (at ``s1`` tokens) and ``other`` (at ``s2``),
        each extended along the line through the two, never below what was measured: what a
        per-token loop saves grows linearly with the tokens (one state per step)."""
        def line(a: int, b: int) -> int:
            return max(a, b, b + (b - a) * (seq_len - s2) // (s2 - s1))

        return _Trace(saved=line(self.saved, other.saved), kept=[line(a, b) for a, b in zip(self.kept, other.kept)],
                      loss_transient=line(self.loss_transient, other.loss_transient),
                      layer_transients=[line(a, b) for a, b in zip(self.layer_transients, other.layer_transients)],
                      events=other.events)


def _tracker_class():
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Timeline(MemTracker):
        """MemTracker that also keeps, after every op, the live activation and temporary bytes,
        and where in that timeline each module's forward begins and its backward begins and ends."""

        def __init__(self) -> None:
            super().__init__()
            self.act: list[int] = [0]
            self.tmp: list[int] = [0]
            self.marks: list[tuple[str, str, int]] = []  # (module fqn, state, timeline index)

        def _now(self) -> tuple[int, int]:
            act = sum(snap.get(_MemRefType.ACT, 0) for snap in self._curr_mem_snap.values())
            tmp = sum(snap.get(_MemRefType.TEMP, 0) for snap in self._curr_mem_snap.values())
            return act, tmp

        def _update_peak_stats(self, peak_state) -> None:  # every op: record, skip per-module peaks
            act, tmp = self._now()
            self.act.append(act)
            self.tmp.append(tmp)

        def _mark(self, module, state: str) -> None:
            self._update_peak_stats(None)
            self.marks.append((self._mod_tracker.get_known_fqn(module) or "", state, len(self.act) - 1))

        def _pre_fw_hook(self, module, inputs) -> None:
            super()._pre_fw_hook(module, inputs)
            self._mark(module, "bw-fw" if self._mod_tracker.is_bw else "pre_fw")

        def _pre_bw_hook(self, module, args) -> None:
            super()._pre_bw_hook(module, args)
            if module is not None:
                self._mark(module, "pre_bw")

        def _post_bw_hook(self, module, args) -> None:
            super()._post_bw_hook(module, args)
            if module is not None:
                self._mark(module, "post_bw")

    return Timeline


@contextmanager
def _eager_masks(transformers):
    """transformers looks for packed sequences in the position ids and, on a tensor it cannot read
    (a fake one, as under torch.compile), keeps the packed-sequence mask to be safe
    (masking_utils.find_packed_sequence_indices), which materialises an attention mask and turns
    off SDPA's is_causal and GQA paths. The traced step stands for an eager step on one unpacked
    sequence per row, whose positions are 0..seq_len-1: no packed sequences, as eager finds."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _run(torch, transformers, hf, *, micro_batch: int, seq_len: int, dtype, attention: str,
         checkpointing: bool, blocks_path: str, fake: bool = True) -> _Trace:
    """One training step under the tracker; ``fake=False`` runs it on real CPU tensors (the
    tests check the two agree)."""
    from contextlib import nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode() if fake else nullcontext()
    vocab = getattr(hf, "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise PlannerError(f"model_type {hf.model_type!r}: its config has no vocab_size to draw tokens from")
    with mode:
        model = _build(transformers, hf, attention, dtype)
        tokens = torch.randint(0, vocab, (micro_batch, seq_len))
    tracker = _tracker_class()()
    try:
        if checkpointing:
            with warnings.catch_warnings():  # transformers 5 renames it; backend/train.py calls the same
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        tracker.track_external(model)
        with mode, tracker, _eager_masks(transformers):
            loss = model(input_ids=tokens, labels=tokens).loss  # the training loop's call
            tracker._update_peak_stats(None)
            forward_end = len(tracker.act) - 1
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - the config's own inconsistency, met inside transformers
        raise PlannerError(f"model_type {hf.model_type!r}: one training step of this config fails in "
                           f"transformers {transformers.__version__}: {_first_line(exc)}") from None
    return _measure(tracker, forward_end, blocks_path)


def _measure(t, forward_end: int, blocks_path: str) -> _Trace:
    live = [a + b for a, b in zip(t.act, t.tmp)]
    block = re.compile(r"(?:.*\.)?" + re.escape(blocks_path) + r"\.\d+")  # ModTracker prefixes the root's class

    def is_block(fqn: str) -> bool:
        return block.fullmatch(fqn) is not None

    starts = [(fqn, i) for fqn, state, i in t.marks if state == "pre_fw" and i <= forward_end]
    block_starts = [i for fqn, i in starts if is_block(fqn)]
    if not block_starts:
        raise PlannerError(f"the traced forward never entered the blocks of {blocks_path}: "
                           "this model's layout is not one the tracer can attribute")
    last_fqn = next(fqn for fqn, _ in reversed(starts) if is_block(fqn))
    # the last block ends where the next module of the model's own tree starts; ModTracker also
    # marks what is not in that tree (transformers 5.25's attention runs through an entry named
    # "Func" inside each block), which must not cut the block short
    root = last_fqn.split(".")[0] + "."
    after = next((i for fqn, i in starts if i > block_starts[-1] and fqn.startswith(root) and fqn != last_fqn
                  and not fqn.startswith(last_fqn + ".")), forward_end)
    bounds = block_starts + [after]
    kept = [t.act[bounds[k + 1]] - t.act[bounds[k]] for k in range(len(block_starts))]
    pre_bw = {fqn: i for fqn, state, i in t.marks if state == "pre_bw" and is_block(fqn)}
    post_bw = {fqn: i for fqn, state, i in t.marks if state == "post_bw" and is_block(fqn)}
    saved = t.act[forward_end]
    first_bw = min(pre_bw.values(), default=len(live) - 1)
    loss_transient = max(live[forward_end:first_bw + 1]) - saved
    transients = []
    for fqn, start in pre_bw.items():
        end = post_bw.get(fqn, len(live) - 1)
        transients.append(max(live[start:end + 1]) - t.act[start])
    return _Trace(saved=saved, kept=kept, loss_transient=max(0, loss_transient),
                  layer_transients=transients, events=len(t.act))


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# A family whose forward loops over the tokens in Python (transformers' Mamba without its CUDA
# kernels: MambaMixer.slow_forward steps through the sequence) records more ops the longer the
# sequence: about 0.25 s per token for a 32-block Mamba on this project's 2-core machine, 17
# minutes at 4,096 tokens. Such a trace is run at these two lengths and its figures extended along
# the line through them; a family whose op count does not grow is traced at the full length.
PROBE_TOKENS = (16, 32)


def _stepper(torch, transformers, hf, run: dict, seq_len: int, probe: _Trace, notes: list[str]):
    """A function tracing one step (with or without checkpointing) at ``seq_len``: at the full length
    where the op count does not grow with the tokens, else scaled from the two probe lengths."""
    s1, s2 = PROBE_TOKENS
    if seq_len <= s1:
        return lambda ckpt: probe if not ckpt else _run(torch, transformers, hf, checkpointing=True,
                                                        seq_len=seq_len, **run)
    second = _run(torch, transformers, hf, checkpointing=False, seq_len=min(seq_len, s2), **run)
    if seq_len <= s2:
        return lambda ckpt: second if not ckpt else _run(torch, transformers, hf, checkpointing=True,
                                                         seq_len=seq_len, **run)
    if second.events == probe.events:  # no per-token loop: the full trace costs what the probe did
        return lambda ckpt: _run(torch, transformers, hf, checkpointing=ckpt, seq_len=seq_len, **run)
    notes.append(f"its forward loops over the tokens in Python ({probe.events:,} traced ops at {s1} tokens, "
                 f"{second.events:,} at {s2}): traced at {s1} and {s2} tokens and each figure extended linearly "
                 f"to {seq_len:,} (a full trace would take minutes); a term growing faster than the tokens "
                 "would be missed")

    def scaled(ckpt: bool) -> _Trace:
        if not ckpt:
            return probe.scaled(second, s1, s2, seq_len)
        a, b = (_run(torch, transformers, hf, checkpointing=True, seq_len=s, **run) for s in (s1, s2))
        return a.scaled(b, s1, s2, seq_len)
    return scaled


def trace_profile(config: dict[str, Any], *, micro_batch: int, seq_len: int, compute: str,
                  attention: str, checkpointing: str, name: str = "model",
                  count: _Count | None = None) -> TracedProfile:
    """Count and trace one training step of ``config`` at this setting (see the module doc)."""
    torch, transformers = _imports()
    count = count or count_parameters(config, name)
    dtype = getattr(torch, DTYPES[compute])
    run = dict(micro_batch=micro_batch, dtype=dtype, attention=attention, blocks_path=count.blocks_path)
    notes = []
    with _quiet(transformers):
        hf = _hf_config(transformers, config, name)
        try:
            probe = _run(torch, transformers, hf, checkpointing=False, seq_len=min(seq_len, PROBE_TOKENS[0]), **run)
        except PlannerError:
            if attention != "sdpa":
                raise
            # some families have no SDPA path (transformers raises for attn_implementation="sdpa"):
            # what will run is eager attention, so that is what is traced
            run["attention"] = "eager"
            probe = _run(torch, transformers, hf, checkpointing=False, seq_len=min(seq_len, PROBE_TOKENS[0]), **run)
            notes.append(f"transformers {transformers.__version__} has no SDPA path for model_type "
                         f"{config.get('model_type')!r}: traced with eager attention, which is what will run")
        step_at = _stepper(torch, transformers, hf, run, seq_len, probe, notes)
        plain = step_at(False)
        step = step_at(True) if checkpointing == "full" else plain
    # A block's figures are what its forward leaves live; one that frees more than it keeps (its
    # input saved by nobody) is counted as keeping nothing rather than as giving memory back.
    layer_saved = max(0, *plain.kept)
    recompute = layer_saved if checkpointing == "full" else 0
    layer_transient = max([0] + [x - recompute for x in step.layer_transients])
    assumptions = (
        f"transformers {transformers.__version__} builds it as {count.block_class} x {count.num_layers} "
        f"({count.blocks_path}); one block kept until its backward is the mean over blocks, "
        "the block recomputed under checkpointing the largest",
        f"weights and activations in {compute} (the module cast to the compute dtype, as DeepSpeed's "
        "bf16/fp16 engine runs it); labels are the input ids, loss by transformers' own causal-LM loss",
        f"attention {run['attention']!r} as transformers runs it on CPU kernels: for SDPA the same saved tensors as "
        "CUDA's kernels (output and logsumexp); a dropout > 0 would save a float noise tensor where CUDA saves a bool mask",
        *notes,
        *([f"MoE experts as {count.experts} dispatches them: one row per token and routed expert, "
           "so the bytes do not depend on how the router splits the tokens"] if count.experts else []),
    )
    return TracedProfile(
        model_type=str(config.get("model_type")), parameters=count.parameters, numels=count.numels,
        num_layers=count.num_layers, layer_parameters=count.layer_parameters,
        blocks_parameters=count.blocks_parameters, late_parameters=count.late_parameters,
        lm_head_elements=count.lm_head_elements, largest_block_parameters=count.largest_block_parameters,
        tied_head_elements=count.tied_head_elements, saved_bytes=step.saved,
        layer_saved_bytes=layer_saved, layer_kept_bytes=min(max(0, sum(step.kept) // len(step.kept)),
                                                            step.saved // count.num_layers),
        loss_transient_bytes=step.loss_transient, layer_transient_bytes=layer_transient,
        hidden_state_bytes=micro_batch * seq_len * int(getattr(hf, "hidden_size", 0) or 0) * dtype.itemsize,
        setting=traced_setting(micro_batch, seq_len, compute, attention, checkpointing),
        assumptions=assumptions)


# A server answers the same traced model again and again (a page reload, a client's retry); a
# trace is seconds of Python, its result a few hundred bytes. Keyed by the config's JSON text.
@lru_cache(maxsize=16)
def cached_count(config_json: str, name: str) -> _Count:
    return count_parameters(json.loads(config_json), name)


@lru_cache(maxsize=64)
def cached_trace(config_json: str, name: str, micro_batch: int, seq_len: int, compute: str, attention: str,
                 checkpointing: str) -> TracedProfile:
    return trace_profile(json.loads(config_json), micro_batch=micro_batch, seq_len=seq_len, compute=compute,
                         attention=attention, checkpointing=checkpointing, name=name,
                         count=cached_count(config_json, name))
