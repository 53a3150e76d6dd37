"""The one schema: request and response of the REST API, the CLI's flags and --json output, the
web form's fields and the verification backend's input.

Field names are the CLI's long flags with ``-`` turned into ``_``. Input models are frozen and
forbid unknown fields; every field's ``description`` is its CLI help, OpenAPI text and form label.
"""

# No `from __future__ import annotations` here: pydantic would compile every field's annotation
# string back into a type when each model is built (~1% of a `planner estimate` process).
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any, Callable, Collection, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, WithJsonSchema,
                      model_validator)
from pydantic_core import core_schema

from planner.model.activations import Attention, Checkpointing
from planner.time.kernels import AttentionKernel
from planner.errors import unknown
from planner.recipes.finetune_fields import check_request_fields
from planner.recipes.losses import FUSED, Loss
from planner.recipes.compile import COMPILE_HELP, Compile
from planner.recipes.fused_kernels import FUSED_KERNELS_HELP, FusedKernel, parse_fused_kernels
from planner.recipes.low_precision import LowPrecision
from planner.memory.moments import PhaseKind
from planner.parallel.dims import PipelineSchedule
from planner.recipes.precision import Optimizer, Precision
from planner.time.profile_name import check_profile_name
from planner.strategies import OffloadDevice, StrategyName

Finetune = Literal["full", "lora", "qlora"]
QuantizeBase = Literal["none", "nf4", "fp4", "int8"]

MAX_GPUS_PER_NODE = 1024
MAX_NODES = 100_000
MAX_TOKENS = 1 << 24  # micro_batch * seq_len beyond 16M tokens per device is not a training step
MAX_GLOBAL_BATCH = 1 << 24  # sequences per optimizer step over all GPUs; PlanRequest.global_batch's bound
MAX_BATCH_FIELD = 1 << 16  # EstimateRequest's micro_batch and gradient_accumulation bound
MAX_PARAMS = 10**14  # 100 trillion parameters: far beyond any model trained


# --- names: every field that names a catalogue entry is checked here, once, for CLI, API and page

def _gpu_names() -> Collection[str]:
    from planner.cluster.gpus import load_gpus  # cached: one YAML parse per process

    return load_gpus().keys()


def _preset_names() -> Collection[str]:
    from planner.cluster.presets import PRESETS

    return PRESETS.keys()


def _fabric_names() -> Collection[str]:
    from planner.cluster.topology import link_rates  # cached

    return link_rates()["fabric"].keys()


@dataclass(frozen=True)
class CatalogueName:
    """Field metadata: the value names an entry of a catalogue (case-insensitive, stored as the
    catalogue spells it). An unknown name is a validation error listing the choices, so the CLI
    (exit 2), the API (422) and the page share one check. ``listed`` puts the names into the JSON
    schema as an enum (the OpenAPI docs and the fuzzer see them); saved profiles change at run
    time, so they are checked but not listed."""

    kind: str
    names: Callable[[], Collection[str]]  # a cached catalogue's keys: checking a name is one look-up
    listed: bool = True

    def choices(self) -> list[str]:
        return sorted(self.names())

    def check(self, value: str) -> str:
        known = self.names()
        if value in known:
            return value
        folded = {name.lower(): name for name in known}
        if value.lower() in folded:
            return folded[value.lower()]
        if not known:
            raise ValueError(f"unknown {self.kind} {value!r}; none exists yet"
                             + ("; save one with `planner calibrate`" if self.kind == "profile" else ""))
        raise ValueError(unknown(self.kind, value, list(known)))

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: Any) -> dict[str, Any]:
        out = handler(schema)
        if self.listed:
            out["enum"] = sorted(self.names())
        return out


GpuName = Annotated[str, Field(max_length=64), CatalogueName("gpu", _gpu_names)]
PresetName = Annotated[str, Field(max_length=64), CatalogueName("topology preset", _preset_names)]
FabricName = Annotated[str, Field(max_length=64), CatalogueName("fabric", _fabric_names)]
# Saved profiles are files: the adapters check the name against them (backend/profiles.py), the
# schema only its length.
ProfileName = Annotated[str, Field(max_length=64)]


def _new_profile_name(value: str) -> str:
    return check_profile_name(value)


NewProfileName = Annotated[str, AfterValidator(_new_profile_name)]  # what `planner calibrate --name` saves
# A catalogue model name, or a Hugging Face Hub id ("org/name", resolved elsewhere). Only the shape
# is checked here: an unknown catalogue name stays a 404 (planner.model.catalogue.catalogue_model).
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _printable_name(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError("a model name cannot contain control characters (newlines, tabs, NUL, ...)")
    return value


ModelName = Annotated[str, Field(min_length=1, max_length=256, json_schema_extra={"pattern": r"^[^\x00-\x1f\x7f]+$"}),
                      AfterValidator(_printable_name)]

_COUNT = re.compile(r"^\s*([0-9](?:_?[0-9])*(?:\.[0-9](?:_?[0-9])*)?(?:[eE][+-]?[0-9]{1,2})?)\s*([kKmMbBtT]?)\s*$")
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_COUNT_FORMS = "write it as 7000000000, 7e9, 7B, 70b, 1.5T or 405_000_000_000"


def parse_count(value: Any) -> Any:
    """A parameter count as people write it: 7e9, 7B, 70b, 1.5T, 125M, 405_000_000_000.
    Suffixes are decimal (k 1e3, M 1e6, B 1e9, T 1e12); the result must be a whole number."""
    return _parse_suffixed(value, "parameter count", "parameters", _COUNT_SUFFIX, _COUNT_FORMS)


# Sequence lengths are named in powers of two ("4k" context = 4,096 tokens, Llama 3.1's "128k" =
# 131,072, its config.json max_position_embeddings): the same parser, binary suffixes.
_TOKEN_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20}
_TOKEN_FORMS = "write it as 4096, 4k (4,096) or 128k (131,072)"


def parse_tokens(value: Any) -> Any:
    """A token count as people write it: 4096, 4k, 32K, 128k (k = 1,024, M = 1,048,576)."""
    return _parse_suffixed(value, "token count", "tokens", _TOKEN_SUFFIX, _TOKEN_FORMS)


def _parse_suffixed(value: Any, what: str, unit: str, suffixes: dict[str, int], forms: str) -> Any:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a {what}; {forms}")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")) or not value.is_integer():
            raise ValueError(f"{value!r} is not a whole number of {unit}; {forms}")
        return int(value)
    if not isinstance(value, str):
        return value  # ints pass; anything else fails int validation with pydantic's own message
    match = _COUNT.match(value)
    if match is None or match.group(2).lower() not in suffixes:
        raise ValueError(f"{value!r} is not a {what}; {forms}")
    try:
        total = Decimal(match.group(1)) * suffixes[match.group(2).lower()]
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a {what}; {forms}") from None
    if total != total.to_integral_value():
        raise ValueError(f"{value!r} is {total} {unit}, not a whole number")
    return int(total)


ParamCount = Annotated[
    int, BeforeValidator(parse_count), Field(gt=0, le=MAX_PARAMS),
    WithJsonSchema({"anyOf": [{"type": "integer", "exclusiveMinimum": 0, "maximum": MAX_PARAMS},
                              {"type": "string", "pattern": _COUNT.pattern}],
                    "description": "a whole number, or 7e9, 7B, 70b, 1.5T, 405_000_000_000"})]
_TOKENS_PATTERN = r"^\s*[0-9](?:_?[0-9])*(?:\.[0-9](?:_?[0-9])*)?\s*[kKmM]?\s*$"
SeqLen = Annotated[
    int, BeforeValidator(parse_tokens), Field(ge=1, le=1 << 22, description="tokens per sequence (4096, 4k, 32k)"),
    WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1, "maximum": 1 << 22},
                              {"type": "string", "pattern": _TOKENS_PATTERN}],
                    "description": "tokens per sequence: a whole number, or 4k (4,096), 32k, 128k (131,072)"})]


# --- numbers the CLI's other commands and the API's verify and runs routes share ---------------

MAX_TIMEOUT_SECONDS = 86_400  # a verify run is a few steps; a day is beyond any of them
MAX_RUNS_LISTED = 10_000
VerifySteps = Annotated[int, Field(ge=1, le=100, description="measured steps")]
WarmupSteps = Annotated[int, Field(ge=0, le=20, description="warm-up steps before measuring")]
# nan would disable the timeout (every comparison with it is false) and 0 or less ends the run at
# once, so the timeout is a finite number of seconds above zero.
TimeoutSeconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_SECONDS, allow_inf_nan=False,
                                        description="seconds before the run is ended")]
ModelScale = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False, description="model shrink factor")]
TolerancePercent = Annotated[float, Field(gt=0, le=100, allow_inf_nan=False, description="tolerance in percent")]
# A run id is a SQLite rowid: a positive 64-bit integer (https://www.sqlite.org/lang_createtable.html#rowid).
RunIdNumber = Annotated[int, Field(ge=1, le=2**63 - 1, description="a run's id")]
RunsLimit = Annotated[int, Field(ge=1, le=MAX_RUNS_LISTED, description="most recent runs to list")]
RANK = Annotated[int, Field(ge=1, le=1 << 31, description="a candidate's rank in a plan")]
Port = Annotated[int, Field(ge=0, le=65_535, description="TCP port")]
# The one set of defaults of `estimate` and `plan` (and so of the API, the page and the CLI flags
# generated from these models): a node of 8 H100 SXM GPUs, 4,096-token sequences (Llama 3's
# pre-training length, Llama 3 paper Sec. 3.4). The same question asked of both gets the same cluster.
DEFAULT_GPU = "h100-80gb"
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_SEQ_LEN = 4096
FABRIC_HELP = "inter-node fabric (ib-hdr, ib-ndr, roce-200g, eth-100g, ...); default: the topology preset's"
NICS_HELP = "NICs per node for inter-node traffic; default: the topology preset's"


# The parallel degrees both requests take (EstimateRequest and PlanRequest), written once.
PipelineDegree = Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE * MAX_NODES,
                                      description="pipeline-parallel degree (stages)")]
ContextDegree = Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE * MAX_NODES, description="context-parallel degree")]
ExpertDegree = Annotated[int, Field(ge=1, le=MAX_GPUS_PER_NODE * MAX_NODES,
                                    description="expert-parallel degree; borrows its ranks from the data-parallel "
                                    "shards and cp")]
ScheduleField = Annotated[PipelineSchedule, Field(description="pipeline schedule (with pp > 1)")]
VirtualStages = Annotated[int, Field(ge=1, le=1024, description="pipeline stages per rank (multi-stage schedules; 2 for zbv and dualpipev)")]
# Uneven pipeline stages (issue 25): Megatron's --decoder-first/last-pipeline-num-layers; torchtitan
# takes the resulting split as module_fqns_per_model_part (planner/parallel/pipeline.py stage_bounds)
FirstStageLayers = Annotated[int | None, Field(ge=1, le=1 << 16, description=(
    "blocks on the first pipeline stage (it also holds the embedding); the other stages share the rest evenly. "
    "Default: an even split (a plan takes the best uneven one where pp does not divide the blocks)"))]
LastStageLayers = Annotated[int | None, Field(ge=1, le=1 << 16, description=(
    "blocks on the last pipeline stage (it also holds the final norm and the LM head); the other stages share "
    "the rest evenly"))]
SequenceParallelField = Annotated[bool | None, Field(
    description="shard the tensor-parallel region's activations over tp (default: on when tp > 1)")]
# Async TP (issue 22): the sequence-parallel all-gathers and reduce-scatters cut into tp pieces, each
# piece's transfer (NVLink P2P copies into a symmetric-memory workspace) beside the matmul of the
# piece before it: torch's micro-pipeline TP (torch 2.13 _inductor/fx_passes/micro_pipeline_tp.py,
# distributed/_symmetric_memory/__init__.py), which torchtitan turns on with compile.enable_async_tensor_parallel
# (torchtitan b5bcd76 config/configs.py CompileConfig: it requires compile), and Megatron's --tp-comm-overlap
# (which asserts --sequence-parallel), the same decomposition through Transformer Engine's userbuffers
AsyncTpField = Annotated[bool, Field(
    description="async TP: each sequence-parallel all-gather and reduce-scatter pipelined with the matmul beside it "
                "(torchtitan compile.enable_async_tensor_parallel, Megatron --tp-comm-overlap); needs tp > 1 within "
                "a node and sequence parallelism; step time and its symmetric-memory workspace modelled, unverified")]
# Flash attention's varlen path over a padded batch: each layer gathers the unpadded q, k and v by the
# batch's padding mask and scatters the output back, finding the indices with host synchronisations
# (torch.nonzero's output size, max_seqlen's .item()): flash-attn's bert_padding.unpad_input per tensor
# (llm-foundry 5e85bd6 llmfoundry/models/layers/attention.py flash_attn_fn, MPT's attn_impl flash, which
# unpads even an all-ones mask) or transformers' _upad_input once per layer (transformers 5.25
# modeling_flash_attention_utils.py _flash_attention_forward, given an attention_mask): planner/time/kernels.py
AttentionUnpad = Literal["none", "flash-attn", "transformers"]
AttentionUnpadField = Annotated[AttentionUnpad, Field(
    description="flash attention's varlen path over a padded batch, for the step time: flash-attn (bert_padding's "
                "unpad_input for q, k and v: MPT's attn_impl flash), transformers (its _upad_input, when the batch "
                "carries an attention_mask); each layer's gathers and scatter at the memory bandwidth and its host "
                "synchronisations; none: the padded kernel (the default)")]
# Whose tensor-parallel layout tp > 1 realises: torchtitan's apply_tp (vocab-parallel loss, sequence
# parallelism), or the model class's own plan as transformers 5.25 applies it under
# from_pretrained(tp_plan="auto") (configuration's base_model_tp_plan, the head's colwise_gather_output:
# whole logits on every rank, HF's loss); planner/parallel/hf_plan.py
TpPlan = Literal["torchtitan", "transformers"]
TpPlanField = Annotated[TpPlan, Field(
    description="tensor-parallel layout: torchtitan's, or transformers' own tp_plan (from_pretrained(tp_plan=\"auto\"): "
                "whole logits gathered on every rank)")]
# FSDP2's MixedPrecisionPolicy.reduce_dtype (torch/distributed/fsdp/_fully_shard/_fsdp_api.py): the
# recipe's 16-bit compute dtype, as accelerate's FSDP2 plugin (utils/dataclasses.py set_mixed_precision:
# param_dtype = reduce_dtype = dtype) and the planner's trainer set it, or fp32, torchtitan's only
# training.mixed_precision_reduce (torchtitan 0.3 config/configs.py; 9dec370 config_manager.py:389)
ReduceDtype = Literal["compute", "fp32"]
SHARDING_STRATEGIES = ("fsdp", "fsdp-grad-op", "hsdp")
ReduceDtypeField = Annotated[ReduceDtype, Field(
    description="dtype FSDP2 reduces gradients in: compute (the recipe's 16-bit dtype, as accelerate and the "
    "planner's trainer) or fp32 (torchtitan's mixed_precision_reduce); fsdp, fsdp-grad-op and hsdp only")]

# Which torch FSDP wraps the model: FSDP2 (fully_shard, what the planner writes and launches) or FSDP1
# (FullyShardedDataParallel: accelerate's and axolotl's default fsdp_version 1, composer, fms-fsdp),
# whose flat parameters are gathered in place and whose gradients are cast and reduced on its own stream
def _version_text(value: Any) -> Any:
    """A version a form or a file writes as text ("1") is the number; a boolean is no version."""
    if isinstance(value, bool):
        raise ValueError(f"fsdp_version must be 1 or 2, got {value!r}")
    return int(value) if isinstance(value, str) and value.strip() in ("1", "2") else value


FsdpVersionField = Annotated[Literal[1, 2], BeforeValidator(_version_text), Field(
    description="torch FSDP the job runs: 2 (fully_shard, the default) or 1 (FullyShardedDataParallel, "
    "estimated with FSDP2's per-unit memory model; its step has no copies on the compute stream); fsdp, "
    "fsdp-grad-op and hsdp only")]


# the caching allocator's and NCCL's settings (issue 24), the same on estimate and plan
AllocConfField = Annotated[str | None, Field(
    max_length=500, description="PYTORCH_CUDA_ALLOC_CONF the job runs with (expandable_segments, "
    "max_split_size_mb, garbage_collection_threshold, roundup_power2_divisions); default: torch's defaults")]
NcclBuffsizeField = Annotated[int | None, Field(
    ge=65_536, le=1 << 32, description="NCCL_BUFFSIZE (the Simple protocol's buffer per channel and "
    "connection); default NCCL's 4 MiB")]

# the optimizer (planner/recipes/optimizers.py, one entry each), the same on estimate and plan
OptimizerField = Annotated[Optimizer, Field(
    description="optimizer: adamw (torch; foreach on CUDA), adamw-single-tensor (torch's AdamW(foreach=False), "
    "composer's DecoupledAdamW: one parameter at a time), adamw-8bit / adamw-paged-8bit (bitsandbytes), adamw-torchao-8bit / "
    "adamw-torchao-4bit (torchao low-bit states), adafactor (torch, factored second moment), lion (bitsandbytes, "
    "32-bit), sgd (no state), sgd-momentum, muon (torch Muon on 2-D hidden weights, AdamW for the rest)")]
OptimizerInBackwardField = Annotated[bool, Field(
    description="step each parameter in its post-accumulate-grad hook during backward (torchtune's "
    "optimizer_in_bwd): gradients never all exist at once; needs gradient_accumulation 1")]
GradientClippingField = Annotated[bool, Field(
    description="clip the gradients by their global norm before each optimizer step (composer's gradient_clipping "
    "algorithm, torch's clip_grad_norm_, DeepSpeed's gradient_clipping): the step time charges reading this rank's "
    "gradients for the norm and scaling them in place")]


# the recipe's fields (issue 21), shared by EstimateRequest and PlanRequest (the plan is asked with the recipe)
LossField = Annotated[Loss, Field(
    description="loss implementation: hf (transformers' cross-entropy on the whole logits), chunked (torchtune's "
    "chunked output loss), chunked-in-forward (torchtitan's ChunkedLossWrapper: each chunk's backward in the forward), "
    "liger-fused (Liger's fused linear cross-entropy), cce (Cut Cross-Entropy), flash-attn "
    "(flash-attn's cross-entropy on the compute-dtype logits: llm-foundry's fused_crossentropy), vocab-parallel "
    "(tp's loss_parallel)")]
LossChunksField = Annotated[int | None, Field(ge=1, le=1 << 16, description="loss=chunked or chunked-in-forward: "
                                              "chunks (default 8, torchtune's and torchtitan's)")]
CheckpointingEveryField = Annotated[int | None, Field(
    ge=1, le=1 << 16, description="with checkpointing full: checkpoint every N-th block only (transformers' "
    "every_n_layers: blocks 0, N, 2N, ...)")]
LowPrecisionField = Annotated[LowPrecision, Field(
    description="low-precision linears: none, float8-tensorwise / float8-rowwise (torchao Float8Linear), mxfp8 / "
    "nvfp4 (Blackwell), te-fp8 (Transformer Engine); GPU only, modelled from the libraries' source")]
Float8AllGatherField = Annotated[bool, Field(
    description="FSDP2 all-gathers the float8 linears' weights in fp8 (torchao Float8LinearConfig("
    "enable_fsdp_float8_all_gather=True), torchtitan float8.enable_fsdp_float8_all_gather): 1 byte per converted "
    "weight element gathered instead of 2; needs low_precision float8-tensorwise and a sharded torch strategy")]
CompileField = Annotated[Compile, Field(description=COMPILE_HELP)]
# planner/recipes/fused_kernels.py: a tuple (hashable, for the activation memos), written as "rms_norm,rope" on the
# CLI and the form (a BeforeValidator: the CLI passes the text to the schema)
FusedKernelsField = Annotated[tuple[FusedKernel, ...], BeforeValidator(parse_fused_kernels),
                              Field(description=FUSED_KERNELS_HELP)]
KeepsOutputsField = Annotated[bool, Field(
    description="the script keeps the model's outputs through backward (accelerate's `outputs = model(**batch); "
    "accelerator.backward(outputs.loss)`): their logits stay live; default: the Trainer's loop, which frees them")]
# Metrics the training loop computes on every micro-batch's logits after its backward: composer's trainer
# (0.14-0.17 trainer.py _train_microbatch -> _eval_train_metrics, under torch.no_grad and its precision context)
# updates each of the model's train metrics on the outputs it kept; llm-foundry's MPT and HF causal LMs train with
# two, LanguageCrossEntropy and LanguagePerplexity, each a torch cross-entropy over all the logits (composer
# metrics/nlp.py; llm-foundry modeling_mpt.py ComposerMPTCausalLM train_metrics, `use_train_metrics` false from
# October 2023 turns them off). planner/recipes/loop.py models their memory, planner/time/kernels.py their time.
TrainMetricsField = Annotated[int, Field(
    ge=0, le=8, description="cross-entropy metrics the loop evaluates on each micro-batch's logits after its backward "
    "(composer's train metrics: llm-foundry's models run 2, LanguageCrossEntropy and LanguagePerplexity; 0 with "
    "use_train_metrics false); needs keeps_outputs, as composer keeps the outputs they read; default 0")]
# The training loop's gradient sync under accumulation: transformers 5.25's Trainer (and TRL, axolotl and
# LLaMA-Factory on it) enters accelerator.no_sync on every micro-batch but the last (trainer.py: sync_context, unless
# accelerator_config's gradient_accumulation_kwargs sync_each_batch), as accelerate's accumulate() does; under FSDP2
# that is set_requires_gradient_sync(False), under FSDP1 FullyShardedDataParallel.no_sync (accelerate 1.16
# accelerator.py no_sync): every unit keeps its unsharded gradient until the last micro-batch reduce-scatters it.
# torchtitan syncs every micro-batch (the default).
DeferGradientSyncField = Annotated[bool, Field(
    description="the loop skips the gradient sync on every micro-batch but the last (the HF Trainer's and "
    "accelerate's no_sync): under FSDP each rank keeps the whole model's unsharded gradients between micro-batches "
    "and reduce-scatters once per step; default: every micro-batch reduce-scatters (torchtitan). DDP is modelled "
    "with no_sync either way (torch's documented accumulation)")]
DoubleQuantField = Annotated[bool | None, Field(
    description="bitsandbytes 4-bit double quantization (bnb_4bit_use_double_quant); default on for nf4/fp4, as the "
    "QLoRA recipe")]


class EstimateRequest(BaseModel):
    """What to estimate: a model, a strategy and the cluster it runs on."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), populate_by_name=True)

    model: ModelName | None = Field(None, description="catalogue model name or alias (see `planner models`), or a "
                                    "Hugging Face Hub id org/name whose config.json is read", examples=["mistral-7b-v0.1"])
    model_config_: dict[str, Any] | None = Field(
        None, alias="model_config",
        description="a Hugging Face config.json as an object (what --model-file reads)")
    params: ParamCount | None = Field(
        None, description="a raw parameter count (7e9, 7B, 1.5T, 405_000_000_000), when only model states are wanted")
    strategy: StrategyName = Field("zero3", description="distributed strategy (default zero3; single, no sharding "
                                   "framework, when the world is one device)")
    framework_version: str | None = Field(
        None, max_length=32, pattern=r"^[0-9][0-9A-Za-z.+-]*$",
        description="version of the strategy's framework to model, e.g. 0.19 or 0.19.8 for DeepSpeed, 2.13 for torch "
                    "(default: the newest modelled; an unmodelled one is refused with the choices)")
    gpus: int = Field(DEFAULT_GPUS_PER_NODE, ge=1, le=MAX_GPUS_PER_NODE, description="GPUs (or CPU ranks) per node")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="number of nodes")
    gpu: GpuName = Field(DEFAULT_GPU, description="device type (see `planner gpus`), or cpu")
    device_memory_gib: float | None = Field(
        None, gt=0, le=1 << 20, description="override the device's capacity in GiB (needed for --gpu cpu to judge fit)")
    host_memory_gib: float | None = Field(
        None, gt=0, le=1 << 24, description="host RAM of one node in GiB, checked against what offload keeps there "
        "(the sum over the node's ranks); default: the topology preset's system memory from its datasheet")
    alloc_conf: AllocConfField = None
    nccl_buffsize_bytes: NcclBuffsizeField = None
    precision: Precision = Field("bf16-mixed", description="precision recipe")
    optimizer: OptimizerField = "adamw"
    optimizer_in_backward: OptimizerInBackwardField = False
    gradient_clipping: GradientClippingField = False
    micro_batch: int = Field(1, ge=1, le=MAX_BATCH_FIELD, description="sequences per device per micro-step")
    seq_len: SeqLen = DEFAULT_SEQ_LEN
    gradient_accumulation: int = Field(1, ge=1, le=MAX_BATCH_FIELD, description="micro-steps per optimizer step")
    checkpointing: Checkpointing = Field("none", description="activation checkpointing: none, full, selective-op "
                                         "(torchtitan's per-op SAC), selective-attention (Megatron's core-attention "
                                         "recompute)")
    loss: LossField = "hf"
    loss_chunks: LossChunksField = None
    checkpointing_every: CheckpointingEveryField = None
    low_precision: LowPrecisionField = "none"
    float8_all_gather: Float8AllGatherField = False
    attention: Attention = Field("sdpa", description="attention implementation (sdpa = flash/memory-efficient)")
    attention_unpad: AttentionUnpadField = "none"
    attention_kernel: AttentionKernel = Field(
        "flash-attention-2", description="the flash kernel's generation, for the step time only: torch>=2.2 SDPA "
        "and flash-attn 2.x run FlashAttention-2; flash-attn 1.x runs FlashAttention-1; flash-attention-triton: "
        "FlashAttention's Triton kernel (MPT's attn_impl triton; it has no published rates and is timed at "
        "FlashAttention-1's, which its own header says it runs slightly slower than); flash-attention-3 (flash-attn's "
        "Hopper build, transformers' flash_attention_3) and cudnn (cuDNN fused attention: torch's SDPA runs it first on "
        "H100/H200 when its cuDNN is newer than 9.15.0) are measured on H100 only (FlashAttention-3 paper)")
    offload_optimizer: OffloadDevice = Field("none", description="where optimizer states live")
    offload_params: OffloadDevice = Field("none", description="where parameters live (zero3 / fsdp)")
    hsdp_shard_size: int | None = Field(
        None, ge=2, le=MAX_GPUS_PER_NODE * MAX_NODES,
        description="hsdp: GPUs per shard group, consecutive ranks (default: one node's GPUs); divides the world size")
    ds_config: dict[str, Any] | None = Field(None, description="a DeepSpeed JSON config (what --ds-config reads)")
    reduce_bucket_size: int | None = Field(None, ge=1, le=10**12, description="DeepSpeed reduce_bucket_size (elements)")
    allgather_bucket_size: int | None = Field(None, ge=1, le=10**12, description="DeepSpeed allgather_bucket_size (elements)")
    prefetch_bucket_size: int | None = Field(None, ge=0, le=10**12, description="DeepSpeed stage3_prefetch_bucket_size (elements)")
    param_persistence_threshold: int | None = Field(
        None, ge=0, le=10**12, description="DeepSpeed stage3_param_persistence_threshold (elements)")
    max_live_parameters: int | None = Field(None, ge=0, le=10**13, description="DeepSpeed stage3_max_live_parameters (elements)")
    max_reuse_distance: int | None = Field(None, ge=0, le=10**13, description="DeepSpeed stage3_max_reuse_distance (elements)")
    tp: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE, description="tensor-parallel degree")
    pp: PipelineDegree = 1
    cp: ContextDegree = 1
    ep: ExpertDegree = 1
    pp_schedule: ScheduleField = "1f1b"
    pp_virtual_stages: VirtualStages = 1
    pp_first_stage_layers: FirstStageLayers = None
    pp_last_stage_layers: LastStageLayers = None
    sequence_parallel: SequenceParallelField = None
    tp_plan: TpPlanField = "torchtitan"
    async_tp: AsyncTpField = False
    reduce_dtype: ReduceDtypeField = "compute"
    fsdp_version: FsdpVersionField = 2
    topology: PresetName | None = Field(None, description="topology preset for the time model; default: the preset of --gpu")
    topology_text: str | None = Field(None, max_length=64 * 1024,
                                      description="pasted `nvidia-smi topo -m` output (what --topology-file reads)")
    fabric: FabricName | None = Field(None, description=FABRIC_HELP)
    nics_per_node: int | None = Field(None, ge=1, le=64, description=NICS_HELP)
    profile: ProfileName | None = Field(None, description="calibration profile saved by `planner calibrate`")
    include_vision: bool = Field(
        False, description="multimodal configs: count the vision tower and projector even where "
        "AutoModelForCausalLM builds the text decoder (llama4: the script loads Llama4ForConditionalGeneration, "
        "AutoModelForImageTextToText); gemma3 and mistral3 count them by default")
    text_only: bool = Field(
        False, description="multimodal configs (gemma3, mistral3): count the text decoder only, for a script that "
        "loads it (Gemma3ForCausalLM); default: what the loader builds (AutoModelForCausalLM on gemma3 builds "
        "Gemma3ForConditionalGeneration, vision tower included)")
    # the recipe as it is run (issue 21): the training loop (planner/recipes/loop.py)
    keeps_outputs: KeepsOutputsField = False
    train_metrics: TrainMetricsField = 0
    defer_gradient_sync: DeferGradientSyncField = False
    compile: CompileField = "none"
    fused_kernels: FusedKernelsField = ()
    activation_offload: bool = Field(False, description="the tensors saved for backward wait in pinned host "
                                     "memory (TRL/Axolotl activation_offloading, torchtune enable_activation_"
                                     "offloading: OffloadActivations); device, host RAM and host-link time modelled")
    # LoRA / QLoRA (planner/recipes/finetune.py): defaults are PEFT 0.21's LoraConfig defaults
    finetune: Finetune = Field("full", description="full fine-tuning, LoRA adapters on a frozen 16-bit base, "
                               "or QLoRA (a frozen base quantized by bitsandbytes, nf4 with double quantization)")
    lora_rank: int | None = Field(None, ge=1, le=65_536, description="LoRA rank r (default 8, PEFT's)")
    lora_alpha: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False,
                                     description="LoRA alpha (default 8, PEFT's); no memory effect, kept for the emitted config")
    lora_targets: str | None = Field(None, min_length=1, max_length=512, pattern=r"^[A-Za-z0-9_.,\- ]+$",
                                     description="modules given adapters: PEFT names (q_proj,v_proj,...) or all-linear "
                                     "(every linear but the LM head); default: PEFT's for the model type")
    lora_dropout: float | None = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False,
                                       description="dropout on each adapter's input (default 0, PEFT's)")
    quantize_base: QuantizeBase | None = Field(None, description="storage of the frozen base's linears: none, "
                                               "nf4/fp4 (bitsandbytes 4-bit) or int8 (LLM.int8); default nf4 for qlora")
    train_embeddings: bool = Field(False, description="also train the input embeddings and LM head in full "
                                   "(PEFT modules_to_save)")
    double_quant: DoubleQuantField = None

    @model_validator(mode="before")
    @classmethod
    def _strategy_from_ds_config(cls, data: Any) -> Any:
        """A DeepSpeed config names its ZeRO stage: without --strategy, that stage is the strategy
        (as its precision, batch and buckets are read from it); an explicit strategy must agree.
        Without either, one GPU on one node is strategy single (no sharding framework)."""
        if isinstance(data, dict) and "strategy" not in data and data.get("ds_config") is None \
                and data.get("gpus") == 1 and data.get("nodes", 1) == 1:
            data = {**data, "strategy": "single"}  # one device: no sharding framework (issue 21)
        if isinstance(data, dict) and "strategy" not in data and isinstance(data.get("ds_config"), dict):
            zero = data["ds_config"].get("zero_optimization")
            stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
            if type(stage) is int and 0 <= stage <= 3:
                data = {**data, "strategy": f"zero{stage}"}
        return data

    @model_validator(mode="after")
    def _one_model(self) -> "EstimateRequest":
        given = [name for name, value in (("model", self.model), ("model_config", self.model_config_),
                                          ("params", self.params)) if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of model, model_config (--model-file) or params; got {given or 'none'}")
        problem = batch_error(self, self.micro_batch, self.gradient_accumulation)
        if problem:
            raise ValueError(problem)
        if self.topology is not None and self.topology_text is not None:
            raise ValueError("give --topology or --topology-file, not both")
        if self.checkpointing_every is not None and self.checkpointing != "full":
            raise ValueError(f"checkpointing_every={self.checkpointing_every} applies to checkpointing=full, not "
                             f"checkpointing={self.checkpointing}")
        if self.reduce_dtype != "compute" and self.strategy not in SHARDING_STRATEGIES:
            raise ValueError(f"reduce_dtype={self.reduce_dtype} is FSDP2's MixedPrecisionPolicy.reduce_dtype: it applies "
                             f"to {', '.join(SHARDING_STRATEGIES)}, not strategy {self.strategy}")
        problem = (fsdp1_error(self) or async_tp_error(self) or defer_sync_error(self) or unpad_error(self)
                   or train_metrics_error(self))
        if problem:
            raise ValueError(problem)
        check_request_fields(self)
        return self

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes


def fsdp1_error(request: "EstimateRequest") -> str | None:
    """What FSDP1 (fsdp_version 1) cannot run here, None when nothing: it wraps a data-parallel model
    only (torchtitan composes TP, PP and CP with FSDP2's fully_shard), gathers no float8 weights
    (FSDP2's float8 all-gather) and keeps flat parameters, not the whole matrices Muon steps."""
    if request.fsdp_version == 2:
        return None
    if request.strategy not in SHARDING_STRATEGIES:
        return (f"fsdp_version=1 is torch FSDP1 (FullyShardedDataParallel): it applies to "
                f"{', '.join(SHARDING_STRATEGIES)}, not strategy {request.strategy}")
    degrees = [f"{name}={getattr(request, name)}" for name in ("tp", "pp", "cp", "ep") if getattr(request, name) > 1]
    if degrees:
        return (f"fsdp_version=1 with {', '.join(degrees)}: the model-parallel layouts compose with FSDP2 "
                "(torchtitan's fully_shard); use fsdp_version 2")
    if request.float8_all_gather:
        return "fsdp_version=1 with float8_all_gather: gathering float8 weights is FSDP2's; use fsdp_version 2"
    if request.optimizer == "muon":
        return ("fsdp_version=1 with optimizer muon: FSDP1's flat parameters hold no whole matrices for its "
                "Newton-Schulz step; use fsdp_version 2")
    return None


def defer_sync_error(request: "EstimateRequest | PlanRequest") -> str | None:
    """What a deferred gradient sync cannot mean here, None when nothing (or when it is off): it is torch's
    (DDP's and FSDP's no_sync; the HF Trainer keeps every micro-batch's sync under DeepSpeed, whose engine
    accumulates its own way: transformers 5.25 trainer.py sync_context), and a pipeline already reduces once per
    step (torch's schedules run their micro-batches with the sync off but the last)."""
    if not request.defer_gradient_sync:
        return None
    strategy = getattr(request, "strategy", None)  # a plan searches its strategies: its torch ones defer
    if strategy is not None and strategy not in ("ddp",) + SHARDING_STRATEGIES:
        return (f"defer_gradient_sync=true with strategy {strategy}: the skipped sync is torch DDP's and FSDP's "
                "no_sync; the Trainer syncs every micro-batch under DeepSpeed, whose engine accumulates itself")
    if request.pp > 1:
        return (f"defer_gradient_sync=true with pp={request.pp}: a pipeline schedule already reduces the gradients "
                "once per step")
    return None


def async_tp_error(request: "EstimateRequest | PlanRequest", searched: bool = False) -> str | None:
    """What async TP cannot run here, None when nothing (or when it is off): it pipelines the
    sequence-parallel all-gathers and reduce-scatters of a tensor-parallel group through a CUDA
    symmetric-memory workspace that the group's GPUs map over NVLink (torch 2.13
    distributed/_symmetric_memory/__init__.py get_symm_mem_workspace: empty_strided_p2p on the group),
    so it needs tp > 1, the group inside a node, sequence parallelism (Megatron's --tp-comm-overlap asserts
    it; torchtitan's plan is sequence-parallel) and a GPU. DeepSpeed's AutoTP has no sequence
    parallelism: refused where the framework is known (parallel/tensor.py tensor_parallel_fields).
    ``searched``: a plan that chooses the TP degree (tp not given): its TP candidates run async TP."""
    if not request.async_tp:
        return None
    if request.tp == 1 and not searched:
        return "async_tp=true with tp=1: async TP overlaps the tensor-parallel collectives; give tp > 1"
    if request.tp_plan != "torchtitan":
        return (f"async_tp=true with tp_plan={request.tp_plan}: transformers' plan gathers whole activations with no "
                "sequence parallelism, which async TP pipelines; use tp_plan torchtitan")
    if request.sequence_parallel is False:
        return ("async_tp=true with sequence_parallel=false: async TP pipelines the sequence-parallel all-gathers "
                "and reduce-scatters with their matmuls (Megatron's --tp-comm-overlap asserts --sequence-parallel)")
    if request.tp > request.gpus:
        return (f"async_tp=true with tp({request.tp}) > gpus({request.gpus}) per node: its symmetric-memory workspace "
                "is mapped over a node's NVLink; keep the tensor-parallel group inside a node")
    if request.gpu == "cpu":
        return "async_tp=true with gpu cpu: symmetric memory is CUDA's (NVLink peer-to-peer); CPU ranks cannot run it"
    return None


# the kernels with a varlen entry point: flash-attn 1.x flash_attn_unpadded_func, 2.x flash_attn_varlen_func, the
# Hopper build's flash_attn_varlen_func; FlashAttention's Triton kernel and torch's SDPA backends take padded batches
VARLEN_KERNELS = ("flash-attention-1", "flash-attention-2", "flash-attention-3")


def unpad_error(request: "EstimateRequest | PlanRequest") -> str | None:
    """What the varlen path cannot run here, None when nothing (or when it is off)."""
    if request.attention_unpad == "none":
        return None
    if request.attention == "eager":
        return (f"attention_unpad={request.attention_unpad} with attention=eager: unpadding feeds flash attention's "
                "varlen kernel; eager attention masks the padded scores")
    if request.attention_kernel not in VARLEN_KERNELS:
        return (f"attention_unpad={request.attention_unpad} with attention_kernel={request.attention_kernel}: it has no "
                f"varlen entry point; {', '.join(VARLEN_KERNELS)} have")
    return None


def train_metrics_error(request: "EstimateRequest | PlanRequest") -> str | None:
    """What the loop's train metrics cannot read here, None when nothing (or when there are none): they read
    the logits of the outputs the loop kept (composer keeps ``state.outputs`` through backward), which a fused
    loss never makes (Liger's and CCE's forwards return none) and torchtitan's chunked loss lets go chunk by chunk."""
    if not request.train_metrics:
        return None
    if not request.keeps_outputs:
        return (f"train_metrics={request.train_metrics} reads the logits of the outputs the loop keeps through "
                "backward (composer's state.outputs): set keeps_outputs")
    if request.loss in (*FUSED, "chunked-in-forward"):
        return (f"train_metrics={request.train_metrics} with loss={request.loss}: that loss returns no logits for "
                "the metrics to read")
    if request.loss == "chunked":
        return (f"train_metrics={request.train_metrics} with loss=chunked: torchtune's chunked output returns the "
                "logits as a list of chunks, which composer's metrics (one logits tensor, viewed as tokens x "
                "vocabulary) do not read")
    return None


def batch_error(request: "EstimateRequest", micro_batch: int, gradient_accumulation: int) -> str | None:
    """What EstimateRequest's validation refuses of ``request`` with these batch fields (tokens per
    device, sequences per step), None when nothing: its one check that reads them beside their bounds
    (MAX_BATCH_FIELD), which the plan's search also asks of a request's copies (settings.py)."""
    if micro_batch * request.seq_len > MAX_TOKENS:
        return (f"micro_batch({micro_batch}) * seq_len({request.seq_len}) = {micro_batch * request.seq_len} tokens "
                f"exceeds {MAX_TOKENS} per device")
    # the ranks of a tensor-, context- or pipeline-parallel group train one data-parallel rank's sequences
    model_parallel = request.tp * request.cp * request.pp
    replicas = max(1, request.gpus * request.nodes // model_parallel)
    sequences = micro_batch * gradient_accumulation * replicas
    if sequences > MAX_GLOBAL_BATCH:
        ranks = f"gpus({request.gpus}) * nodes({request.nodes})" + (
            f" / (tp({request.tp}) * cp({request.cp}) * pp({request.pp}))" if model_parallel > 1 else "")
        return (f"micro_batch({micro_batch}) * gradient_accumulation({gradient_accumulation}) * {ranks} = "
                f"{sequences} sequences per optimizer step exceeds the global batch bound {MAX_GLOBAL_BATCH}")
    return None


class ParallelDegrees(BaseModel):
    """The layout's degrees (planner/parallel/dims.py ParallelDims): world = dp_replicate * dp_shard * cp * tp * pp;
    ep borrows from dp_shard * cp."""

    dp_replicate: int = Field(description="data-parallel replicas (DDP, ZeRO-0, HSDP across shard groups)")
    dp_shard: int = Field(description="data-parallel shard group size (ZeRO-1..3, FSDP, HSDP within a group)")
    tp: int = Field(description="tensor-parallel degree")
    pp: int = Field(description="pipeline-parallel degree")
    cp: int = Field(description="context-parallel degree")
    ep: int = Field(description="expert-parallel degree")


class MemoryItem(BaseModel):
    """One named term of the estimate, with where it comes from."""

    name: str
    bytes: int
    component: Literal["parameters", "frozen_weights", "gradients", "optimizer_states", "activations", "buffers",
                       "framework"]
    source: str = ""
    # The stream the tensors are allocated on (planner/memory/reserved.py replays them through the caching
    # allocator, whose pools are per stream); not part of the JSON output.
    stream: str = Field("default", exclude=True)


class Phase(BaseModel):
    """What is live on a device at one moment of a step; the peak is the largest phase."""

    name: str
    bytes: int
    items: list[MemoryItem]
    # The moment's kind (planner/memory/moments.py), what code identifies a phase by; the name is for
    # display. Not part of the JSON output (the public fields stay as they were).
    kind: PhaseKind | None = Field(None, exclude=True)


class PeakRows(BaseModel):
    """The peak by component: every item live at the peak (planner/memory/moments.py) counted once, so the
    rows add up to peak_bytes exactly (what the CLI's per-device table shows)."""

    parameters_bytes: int = Field(description="trained weights live at the peak (with LoRA: the adapters), "
                                  "including gathered or cast copies the model tags as parameters")
    gradients_bytes: int = Field(description="gradients live at the peak")
    optimizer_states_bytes: int = Field(description="fp32 master weights and optimizer moments on the device")
    frozen_weights_bytes: int = Field(description="LoRA/QLoRA: the frozen base on the device")
    activations_bytes: int = Field(description="saved activations and backward transients the model tags as such "
                                   "(0 when unknown: --params)")
    buffers_bytes: int = Field(description="everything else live at the peak: buckets, gathered units, "
                               "temporaries, reduce and flat buffers")
    framework_bytes: int = Field(description="CUDA context and allocator overhead")


class PerDevice(BaseModel):
    parameters_bytes: int = Field(description="weights held between steps (textbook, sharded as the strategy does)")
    gradients_bytes: int = Field(description="gradients in the training dtype (textbook, sharded as the strategy does)")
    optimizer_states_bytes: int = Field(description="fp32 master weights and optimizer moments")
    frozen_weights_bytes: int = Field(0, description="LoRA/QLoRA: the frozen base in its storage type (16-bit, or "
                                      "bitsandbytes nf4/fp4/int8 with its constants), sharded as the strategy does")
    activations_bytes: int | None = Field(description="saved activations at the peak; null when unknown (--params)")
    buffers_bytes: int = Field(description="framework buffers at the peak: all that is live there beyond the "
                               "states and activations (at_peak.buffers_bytes)")
    framework_bytes: int = Field(description="CUDA context and allocator overhead")
    resident_bytes: int = Field(description="held between steps")
    peak_bytes: int = Field(description="highest live total during a step")
    peak_phase: str = Field(description="the moment of the step the peak occurs in")
    at_peak: PeakRows | None = Field(None, description="the peak by component; the rows add up to peak_bytes")
    # issue 24: what the caching allocator reserves (planner/memory/reserved.py, simulated until measured)
    reserved_peak_bytes: int = Field(description="highest reserved total: the caching allocator's reserved peak "
                                     "replaying the step's allocations (simulated), + cuda_context_bytes + nccl_bytes; for a plan candidate "
                                     "not replayed and for cpu ranks: peak_bytes + nccl_bytes")
    cuda_context_bytes: int = Field(description="CUDA context and library workspaces (gpus.yaml, calibratable)")
    nccl_bytes: int = Field(description="NCCL's buffers, summed over this rank's communicators, and under async TP "
                            "its symmetric-memory workspace (both outside the caching allocator)")


class HostMemory(BaseModel):
    resident_bytes: int = Field(description="host RAM held by offload per node")
    peak_bytes: int = Field(description="highest host RAM per node during a step")
    pinned_bytes: int = Field(description="of which page-locked")
    capacity_bytes: int | None = Field(
        None, description="the node's host RAM (host_memory_gib, or the topology preset's datasheet); null: unknown")
    fits: bool | None = Field(None, description="peak_bytes within capacity_bytes; null when nothing is offloaded "
                              "or the capacity is unknown")


class ModelSummary(BaseModel):
    name: str
    source: str
    parameters: int
    architecture: dict[str, Any] | None


class TimeTerm(BaseModel):
    """One part of the step time: what it is, its seconds per optimizer step and where its rate comes from."""

    name: str
    seconds: float
    source: str


class TimeEstimate(BaseModel):
    """One step on the modelled interconnect (planner/time/collectives.py, planner/time/kernels.py)."""

    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    offload_seconds: float
    tokens_per_second: float = Field(description="over all GPUs")
    mfu: float = Field(description="model FLOPs utilization (no recomputation counted)")
    hfu: float = Field(0.0, description="hardware FLOPs utilization: the FLOPs the GPU runs (recomputation and "
                       "FlashAttention's causal saving included) over its peak; below MFU without recomputation, as "
                       "MFU counts attention without the causal mask (PaLM's and llm-foundry's convention)")
    terms: list[TimeTerm] = Field([], description="the step's parts (compute terms are per GPU, serial), each with "
                                  "the source of its rate: estimated from published kernel measurements, a "
                                  "calibration profile, or the compute_efficiency override")
    ring_bandwidth_gbps: float | None = Field(description="slowest link of the ring, GB/s; null on one GPU (no ring)")
    topology: str


class AllocatorSummary(BaseModel):
    """The step replayed through torch 2.13's caching allocator (planner/memory/allocator.py): simulated."""

    alloc_conf: str = Field(description="the PYTORCH_CUDA_ALLOC_CONF assumed ('' for torch's defaults)")
    allocated_peak_bytes: int = Field(description="allocated peak (blocks, 512-byte rounded)")
    active_peak_bytes: int
    reserved_peak_bytes: int = Field(description="the allocator's reserved peak (without context or NCCL)")
    segments_peak: int
    other_reserved_peak_bytes: int = Field(description="the reserved peak with expandable_segments switched")
    other_alloc_conf: str = Field(description="the setting other_reserved_peak_bytes assumes")
    communicators: list[str] = Field(description="the NCCL communicators counted in nccl_bytes")
    measured: bool = Field(False, description="true once a GPU has measured this configuration (bench/gpu_check.py)")
    replay_shortfall_bytes: int = Field(0, description="held back beyond reserved_peak_bytes for the transients the "
                                        "replayed stream leaves out: the largest shortfall measured on a GPU "
                                        "(planner/data/allocator_calibration.json replay_shortfall); in "
                                        "per_device.reserved_peak_bytes and the fit")


class EstimateResult(BaseModel):
    """The answer to `planner estimate`; field names are the public contract (tests freeze them)."""

    parameters: int
    trainable_parameters: int = Field(description="parameters that get gradients and optimizer states (all of them "
                                      "for full fine-tuning; the adapters, and embeddings if trained, for LoRA)")
    model: ModelSummary
    strategy: str
    world_size: int
    dp_size: int
    shard_size: int
    parallel: ParallelDegrees
    gpu: str
    per_device: PerDevice
    host: HostMemory
    nvme_bytes: int
    device_capacity_bytes: int
    fits: bool
    headroom_bytes: int
    phases: list[Phase]
    buffers: list[MemoryItem]
    notes: list[str]
    request: EstimateRequest
    allocator: AllocatorSummary | None = Field(None, description="the caching allocator's simulated replay of the "
                                               "step; null for cpu ranks")
    time: TimeEstimate | None = Field(None, description="the time model; null for --params or cpu ranks")
    # the resolved Setup (planner/setup.py) the result was computed from, so the time model and the
    # launch files read it instead of resolving the request again; never serialised (planner/memory/orchestrator.py setup_of)
    _setup: Any = PrivateAttr(default=None)


# --- planning --------------------------------------------------------------------------------

Objective = Literal["time", "cost", "memory"]


class PlanRequest(BaseModel):
    """What to plan: a model, the cluster and its wiring, the batch to reach."""

    # defer_build: its validator is built by the first plan (or schema) that needs it, not by every
    # `planner estimate` that imports this module (tests/test_startup.py).
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), populate_by_name=True,
                              defer_build=True)

    model: ModelName | None = Field(None, description="catalogue model name or alias, or a Hugging Face Hub id org/name",
                                    examples=["llama-3-8b"])
    model_config_: dict[str, Any] | None = Field(None, alias="model_config",
                                                 description="a Hugging Face config.json as an object")
    gpu: GpuName = Field(DEFAULT_GPU, description="device type (see `planner gpus`)")
    gpus: int = Field(DEFAULT_GPUS_PER_NODE, ge=1, le=MAX_GPUS_PER_NODE, description="GPUs per node")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="number of nodes")
    topology: PresetName | None = Field(None, description="topology preset (see `planner topo --list`); default: the preset of --gpu")
    topology_text: str | None = Field(None, max_length=64 * 1024,
                                      description="pasted `nvidia-smi topo -m` output (what --topology-file reads)")
    fabric: FabricName | None = Field(None, description=FABRIC_HELP)
    nics_per_node: int | None = Field(None, ge=1, le=64, description=NICS_HELP)
    host_memory_gib: float | None = Field(
        None, gt=0, le=1 << 24, description="host RAM of one node in GiB, checked against what offload keeps there "
        "(the sum over the node's ranks); default: the topology preset's system memory from its datasheet")
    alloc_conf: AllocConfField = None
    nccl_buffsize_bytes: NcclBuffsizeField = None
    framework_version: str | None = Field(
        None, max_length=32, pattern=r"^[0-9][0-9A-Za-z.+-]*$",
        description="version of a framework to model, e.g. 0.19 or 0.19.8 for DeepSpeed, 2.13 for torch: that "
                    "framework's candidates are estimated at it, the others' at their newest modelled version; an "
                    "unmodelled one is refused with the choices")
    tp: int = Field(1, ge=1, le=MAX_GPUS_PER_NODE, description="tensor-parallel degree (fixed; the search keeps it)")
    pp: PipelineDegree = 1
    cp: ContextDegree = 1
    ep: ExpertDegree = 1
    pp_schedule: ScheduleField = "1f1b"
    pp_virtual_stages: VirtualStages = 1
    pp_first_stage_layers: FirstStageLayers = None
    pp_last_stage_layers: LastStageLayers = None
    sequence_parallel: SequenceParallelField = None
    tp_plan: TpPlanField = "torchtitan"
    async_tp: AsyncTpField = False  # the tp > 1 candidates with sequence parallelism run it
    reduce_dtype: ReduceDtypeField = "compute"  # the fsdp / hsdp candidates reduce in it
    seq_len: SeqLen = DEFAULT_SEQ_LEN
    global_batch: int = Field(256, ge=1, le=1 << 24, description="sequences per optimizer step, over all GPUs")
    objective: Objective = Field("time", description="rank by step time, by GPU-hours per token, or by memory")
    precision: Precision = Field("bf16-mixed", description="precision recipe")
    optimizer: OptimizerField = "adamw"
    optimizer_in_backward: OptimizerInBackwardField = False
    gradient_clipping: GradientClippingField = False
    attention: Attention = Field("sdpa", description="attention implementation")
    attention_kernel: AttentionKernel = Field("flash-attention-2", description="the flash kernel's generation (step time)")
    attention_unpad: AttentionUnpadField = "none"
    headroom: float = Field(0.05, ge=0.0, lt=0.9, description="fraction of device memory kept free")
    compute_efficiency: float | None = Field(
        None, gt=0.0, le=1.0, description="override: run all compute at this fraction of peak TFLOP/s (off by "
        "default: each kernel at its measured rate, planner/time/kernels.py)")
    link_efficiency: float = Field(1.0, gt=0.0, le=4.0,
                                   description="achieved fraction of the modelled (realistic) link bandwidths")
    profile: ProfileName | None = Field(None, description="calibration profile saved by `planner calibrate` (sets the efficiencies)")
    include_vision: bool = Field(
        False, description="multimodal configs: count the vision tower and projector even where "
        "AutoModelForCausalLM builds the text decoder (llama4: the script loads Llama4ForConditionalGeneration, "
        "AutoModelForImageTextToText); gemma3 and mistral3 count them by default")
    text_only: bool = Field(
        False, description="multimodal configs (gemma3, mistral3): count the text decoder only, for a script that "
        "loads it (Gemma3ForCausalLM); default: what the loader builds (AutoModelForCausalLM on gemma3 builds "
        "Gemma3ForConditionalGeneration, vision tower included)")
    activation_offload: bool = Field(False, description="every candidate keeps the tensors saved for backward in "
                                     "pinned host memory (TRL/Axolotl activation_offloading, torchtune "
                                     "enable_activation_offloading)")
    finetune: Literal["full", "lora", "qlora", "auto"] = Field(
        "full", description="full fine-tuning, LoRA, QLoRA, or auto: weigh all three and say what each costs")
    lora_rank: int | None = Field(None, ge=1, le=65_536, description="LoRA rank r (default 8, PEFT's)")
    lora_targets: str | None = Field(None, min_length=1, max_length=512, pattern=r"^[A-Za-z0-9_.,\- ]+$",
                                     description="modules given adapters (PEFT names or all-linear)")
    lora_dropout: float | None = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False,
                                       description="dropout on each adapter's input (default 0)")
    # the rest of estimate's LoRA fields, carried into every candidate and the emitted configs
    lora_alpha: float | None = Field(None, gt=0, le=1e6, allow_inf_nan=False,
                                     description="LoRA alpha (default 8, PEFT's); no memory effect, kept for the emitted config")
    quantize_base: QuantizeBase | None = Field(None, description="storage of the QLoRA base's linears: nf4/fp4 "
                                               "(bitsandbytes 4-bit) or int8 (LLM.int8); default nf4; finetune qlora or auto")
    train_embeddings: bool = Field(False, description="also train the input embeddings and LM head in full "
                                   "(PEFT modules_to_save)")
    double_quant: DoubleQuantField = None
    # the recipe (issue 21): every candidate is estimated and timed with it
    checkpointing: Checkpointing | None = Field(
        None, description="activation checkpointing of every candidate: none, full, selective-op, "
        "selective-attention (default: the search weighs none and full)")
    checkpointing_every: CheckpointingEveryField = None
    keeps_outputs: KeepsOutputsField = False
    train_metrics: TrainMetricsField = 0
    defer_gradient_sync: DeferGradientSyncField = False
    compile: CompileField = "none"
    fused_kernels: FusedKernelsField = ()
    loss: LossField = "hf"
    loss_chunks: LossChunksField = None
    low_precision: LowPrecisionField = "none"
    float8_all_gather: Float8AllGatherField = False

    @model_validator(mode="after")
    def _one_model(self) -> "PlanRequest":
        given = [n for n, v in (("model", self.model), ("model_config", self.model_config_)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of model or model_config (--model-file); got {given or 'none'}")
        if self.topology is not None and self.topology_text is not None:
            raise ValueError("give --topology or --topology-file, not both")
        if self.finetune == "full":
            for name in ("lora_rank", "lora_targets", "lora_dropout", "lora_alpha", "quantize_base", "train_embeddings",
                         "double_quant"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(f"{name}={getattr(self, name)} applies to finetune lora, qlora or auto, "
                                     "not finetune=full")
        if self.double_quant is not None and (self.finetune == "lora" or self.quantize_base == "int8"):
            raise ValueError(f"double_quant={self.double_quant} is bitsandbytes' 4-bit option "
                             "(bnb_4bit_use_double_quant): it needs finetune qlora or auto with quantize_base nf4 or fp4")
        if self.finetune == "lora" and self.quantize_base not in (None, "none"):
            raise ValueError(f"quantize_base={self.quantize_base} with finetune=lora: a quantized base is "
                             "finetune=qlora")
        if self.quantize_base == "none" and self.finetune in ("qlora", "auto"):
            raise ValueError(f"quantize_base=none with finetune={self.finetune}: QLoRA quantizes the base")
        if self.checkpointing_every is not None and self.checkpointing != "full":
            raise ValueError(f"checkpointing_every={self.checkpointing_every} applies to checkpointing=full, not "
                             f"checkpointing={self.checkpointing}")
        problem = (async_tp_error(self, searched="tp" not in self.model_fields_set) or defer_sync_error(self)
                   or unpad_error(self) or train_metrics_error(self))
        if problem:
            raise ValueError(problem)
        return self


class Candidate(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built by the first plan

    strategy: str
    finetune: str = Field("full", description="full, lora or qlora")
    micro_batch: int
    gradient_accumulation: int
    checkpointing: str
    offload_optimizer: str
    offload_params: str
    hsdp_shard_size: int | None = Field(None, description="hsdp: GPUs per shard group; null for other strategies")
    parallel: ParallelDegrees
    pp_first_stage_layers: int | None = Field(None, description="an uneven pipeline's first stage's blocks; null when even")
    pp_last_stage_layers: int | None = Field(None, description="an uneven pipeline's last stage's blocks; null when even")
    pp_schedule: str | None = Field(None, description="a pipeline's schedule; null without pp")
    pp_virtual_stages: int | None = Field(None, description="a pipeline's stages per rank; null without pp")
    fits: bool
    per_device: PerDevice
    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    offload_seconds: float
    tokens_per_second: float
    mfu: float
    rejected_reason: str | None
    host: HostMemory | None = Field(None, description="host RAM per node this option holds when it offloads "
                                    "(the sum over the node's ranks) and whether the node has it; null: no offload")


class TopologySummary(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built by the first plan

    source: str
    gpu_type: str
    gpus_per_node: int
    nodes: int
    nvlink_groups: list[list[int]]
    ring: list[int]
    ring_bandwidth_gbps: float | None = Field(
        description="slowest link of the best ring over the node's GPUs, GB/s; null on one GPU (no ring)")
    inter_node_gbps_per_gpu: float | None = Field(description="fabric bandwidth per GPU across nodes, GB/s")


class PlanResult(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built by the first plan

    recommended: Candidate | None
    candidates: list[Candidate]
    candidates_evaluated: int
    min_gpus: dict[str, int | None] = Field(description="smallest total GPU count each strategy trains on (micro-batch 1)")
    max_micro_batch: dict[str, int | None] = Field(description="largest micro-batch that fits, per strategy "
                                                   "(on a GPU: its reserved peak, simulated, within the device)")
    max_seq_len: int | None = Field(None, description="longest sequence the recommended layout trains at micro-batch 1 "
                                    "with full checkpointing (its strategy, offload and tp/cp degrees; on a GPU: its "
                                    "reserved peak, simulated, within the device); null when nothing fits")
    faster_on_fewer_nodes: int | None = Field(
        None, description="a smaller node count whose best option beats every option on all the nodes (the fabric "
                          "cannot carry the traffic of spanning them); null when none")
    families: list[Candidate] = Field(default_factory=list, description=(
        "the best option of each layout family the plan searched (dp, dp x tp, dp x pp, dp x tp x pp, with cp or "
        "ep): fitting ones by the objective, then the closest to fitting"))
    winner_reason: str = Field("", description="why the recommendation won, against the best of each other family")
    topology: TopologySummary
    notes: list[str]
    request: PlanRequest


# --- job files in (issue 23): `planner check FILE...` and POST /v1/check ----------------------

MAX_JOB_FILE_CHARS = 1 << 20


class JobFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    name: str = Field(min_length=1, max_length=256, description="the file's name (its suffix picks the parser; "
                      "a DeepSpeed JSON is matched to the file that names it by this name)")
    text: str = Field(max_length=MAX_JOB_FILE_CHARS, description="the file's text")


class CheckRequest(BaseModel):
    """A job as its own files say it, and the cluster it asks for."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    files: list[JobFile] = Field(min_length=1, max_length=8, description="torchtitan TOML or launch line, "
                                 "accelerate YAML, TrainingArguments / TRL SFTConfig, Axolotl, LLaMA-Factory, "
                                 "DeepSpeed JSON, a model config.json")
    gpu: GpuName = Field(DEFAULT_GPU, description="device type (see `planner gpus`)")
    gpus: int = Field(DEFAULT_GPUS_PER_NODE, ge=1, le=MAX_GPUS_PER_NODE, description="GPUs per node")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="number of nodes")
    model: ModelName | None = Field(None, description="the model, where the files do not name it (TrainingArguments)")
    seq_len: int | None = Field(None, ge=1, le=1 << 22, description="tokens per sequence, where the files do not "
                                "say it (TrainingArguments leave it to the script)")
    tokens: int | None = Field(None, ge=1, le=10**16, description="tokens the job trains on (its length, instead of "
                               "the files' steps or epochs)")
    dataset_tokens: int | None = Field(None, ge=1, le=10**16, description="tokens in one epoch of the dataset "
                                       "(with a file's epochs)")
    overrides: dict[str, Any] | None = Field(None, description="dotted keys of the first file to override "
                                       "(activation_checkpoint.mode: full)")


class CheckChange(BaseModel):
    model_config = ConfigDict(defer_build=True)

    change: str = Field(description="what to change, in the job's own terms")
    fields: dict[str, Any] = Field(description="the request fields it changes")
    fits: bool
    peak_bytes: int
    peak_phase: str
    step_seconds: float | None
    wall_seconds: float | None


class CheckResult(BaseModel):
    model_config = ConfigDict(defer_build=True)

    formats: list[list[str]] = Field(description="[file, format] of each file read")
    fits: bool
    peak_bytes: int
    peak_phase: str = Field(description="the moment of the step the peak occurs in")
    reserved_peak_bytes: int = Field(description="what fits is judged on: the caching allocator's reserved peak "
                                     "with the CUDA context and NCCL's buffers (per_device.reserved_peak_bytes)")
    device_capacity_bytes: int
    step_seconds: float | None
    steps: int | None = Field(description="optimizer steps of the whole job; null when its length is unknown")
    wall_seconds: float | None = Field(description="steps x step time: a scheduler's time limit")
    length_source: str = Field(description="where the length came from")
    changes: list[CheckChange] = Field(description="the smallest changes that make it fit, or run faster")
    unknown_keys: list[str] = Field(description="keys no table of their format knows: listed, not read")
    origin: dict[str, str] = Field(description="request field -> file:line key it came from")
    notes: list[str]
    request: EstimateRequest = Field(description="the job as this schema reads it")
