"""What every rank of a verify run is told: the typed job `backend.launch` writes as job.json and
`backend.worker` reads back, validated, before any heavy import.

The rank's trainer (backend/train.py) reads it as the plain mapping ``VerifyJob.for_rank()`` gives,
with the JSON's key names (``model_config`` included).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.parallel.dims import PipelineSchedule
from planner.recipes.optimizers import OptimizerName as Optimizer


class TorchSettings(BaseModel):
    """How a rank wraps the model for a torch strategy (backend/train.py torch_engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["single", "ddp", "fsdp", "fsdp-grad-op", "hsdp"]
    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] | None = Field(
        description="FSDP2's sharding, None for DDP")
    wrapped: bool = Field(True, description="False for strategy single: the bare module, no DDP")
    compute_dtype: Literal["bf16", "fp16"] | None = Field(description="autocast / FSDP2 param dtype; None: fp32")
    pure_16bit: bool = Field(description="weights kept in the 16-bit dtype (bf16-pure), no fp32 master")
    reduce_dtype: Literal["compute", "fp32"] = Field("compute", description="FSDP2's reduce_dtype: the compute "
                                                     "dtype, or fp32 (the request's reduce_dtype)")
    optimizer: Optimizer
    optimizer_in_backward: bool = Field(False, description="each parameter steps in its post-accumulate-grad hook")
    offload: bool = Field(description="FSDP2 CPUOffloadPolicy (parameters and gradients on the host)")
    replicas: int = Field(ge=1, description="HSDP replica groups (1 otherwise)")
    shard_size: int = Field(ge=1, description="ranks per shard group")
    defer_gradient_sync: bool = Field(False, description="FSDP2 reduce-scatters in the last micro-batch only "
                                      "(set_requires_gradient_sync(False) before the others: the Trainer's no_sync)")


class FinetuneSettings(BaseModel):
    """The adapters and the base's storage a LoRA/QLoRA rank builds (backend/finetune.py), as
    backend/launch.py finetune_job resolves them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int = Field(ge=1)
    alpha: float
    dropout: float = Field(ge=0, lt=1)
    quantize: Literal["none", "nf4", "fp4", "int8"]
    double_quant: bool = Field(True, description="4-bit: bitsandbytes' compress_statistics (double quantization)")
    targets: list[str] | str = Field(description="PEFT target_modules: module names, or the string \"all-linear\"")
    modules_to_save: list[str] | None = None
    compute_dtype: Literal["bf16", "fp16"] | None
    base_dtype: Literal["bf16", "fp16"] | None


class PipelineSettings(BaseModel):
    """How a pipeline-parallel rank splits and schedules the model (backend/train_pipeline.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pp: int = Field(ge=2)
    dp: int = Field(ge=1)
    schedule: PipelineSchedule
    virtual_stages: int = Field(ge=1)
    first_stage_layers: int | None = Field(None, ge=1, description="uneven split: the first stage's blocks")
    last_stage_layers: int | None = Field(None, ge=1, description="uneven split: the last stage's blocks")
    # FSDP2 over dp > 1, or no wrapper: DDP under the pipelining schedules fails in its reducer on
    # the second micro-batch ("params_.size() == rebuilt_param_indices_.size() INTERNAL ASSERT
    # FAILED", c10d/reducer.cpp, torch 2.13); torchtitan composes PP with FSDP2 / HSDP only
    dp_strategy: Literal["fsdp", "none"]
    compute_dtype: Literal["bf16", "fp16"] | None
    reduce_dtype: Literal["compute", "fp32"] = Field("compute", description="FSDP2's reduce_dtype over dp")
    optimizer: Literal["adamw", "sgd", "sgd-momentum"]
    tp: int = Field(1, ge=1, description="tensor-parallel ranks per stage (innermost on the (pp, dp, tp) mesh)")
    sequence_parallel: bool = Field(False, description="with tp > 1: SequenceParallel norms, sequence-sharded stream")


class ParallelSettings(BaseModel):
    """How a tensor- or context-parallel rank lays out its mesh (backend/train_parallel.py):
    (dp_replicate, dp_shard, cp, tp), tp innermost, as torchtitan orders them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp_replicate: int = Field(1, ge=1, description="HSDP's replicas (strategy hsdp with cp): FSDP2 on a 2-D mesh "
                                                   "(dp_replicate, dp_shard x cp)")
    dp_shard: int = Field(ge=1)
    tp: int = Field(ge=1)
    sequence_parallel: bool
    cp: int = Field(1, ge=1, description="context parallelism: torch's ring attention (backend/context_parallel.py)")
    tp_plan: Literal["torchtitan", "transformers"] = Field(
        "torchtitan", description="torchtitan's apply_tp (train_parallel.py), or the model's own plan loaded by "
                                  "from_pretrained(tp_plan=\"auto\") (hf_tensor_parallel.py)")

    @model_validator(mode="after")
    def _some_model_parallelism(self) -> ParallelSettings:
        if self.tp == 1 and self.cp == 1:
            raise ValueError("parallel settings need tp > 1 or cp > 1")
        return self


class ExpertSettings(BaseModel):
    """How an expert-parallel rank shards the routed experts (backend/train_experts.py): an
    (efsdp, ep) mesh, ep innermost, the rest of the model FSDP2 over every rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ep: int = Field(ge=2, description="ranks each MoE block's routed experts are split over")


# The settings each framework's engine is built from (backend/rank.py engine_for): at least one
# of the fields, and how a refusal names them
ENGINE_SETTINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "deepspeed": (("ds_config",), "ds_config"), "torch": (("torch", "pipeline"), "torch or pipeline settings")}


def uses_deepspeed(job: dict[str, Any]) -> bool:
    """The rank builds DeepSpeed's engine: the job carries its ds_config, which only a DeepSpeed
    job does (Framework.worker_settings; VerifyJob requires it there)."""
    return job.get("ds_config") is not None


class VerifyJob(BaseModel):
    """One verify run, as every rank receives it."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    hf_config: dict[str, Any] = Field(alias="model_config", description="the Hugging Face config the rank builds")
    attn_implementation: Literal["sdpa", "eager"]
    checkpointing: Literal["none", "full", "selective-op", "selective-attention"]
    checkpointing_every: int | None = Field(None, ge=1, description="full checkpointing of every N-th block")
    loss: Literal["hf", "chunked", "chunked-in-forward", "vocab-parallel", "liger-fused", "cce"] = Field(
        "hf", description="the loss implementation (backend/losses.py)")
    low_precision: Literal["none", "float8-tensorwise", "float8-rowwise", "mxfp8"] = Field(
        "none", description="torchao's low-precision linears (backend/low_precision.py); GPU only")
    fused_kernels: tuple[Literal["rms_norm", "rope", "swiglu"], ...] = Field(
        (), description="Liger's block kernels patched into the model (backend/fused_kernels.py); GPU only")
    float8_all_gather: bool = Field(False, description="FSDP2 gathers the float8 weights in fp8 (torchao's "
                                    "enable_fsdp_float8_all_gather); GPU only")
    loss_chunks: int = Field(1, ge=1, description="loss=chunked or chunked-in-forward: chunks of the sequence")
    micro_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    gradient_accumulation: int = Field(ge=1)
    steps: int = Field(ge=1)
    warmup_steps: int = Field(ge=0)
    device: Literal["cpu", "cuda"]
    dist_backend: Literal["gloo", "nccl"] | None = Field(description="None: the framework's default (NCCL)")
    out_dir: str = Field(description="where each rank writes rank<N>.json and its progress")
    seed: int = 0
    keeps_outputs: bool = Field(False, description="the loop keeps the model's outputs through backward, as "
                                "accelerate's examples (planner/recipes/loop.py); default: freed once .loss is taken")
    train_metrics: int = Field(0, ge=0, description="cross-entropy metrics on each micro-batch's kept logits after "
                               "its backward, as composer's train metrics (planner/recipes/loop.py); needs keeps_outputs")
    metric_autocast: Literal["bf16", "fp16"] | None = Field(None, description="the autocast the metrics run under "
                                                            "(composer's precision context; None: the logits' dtype)")
    vision: bool = Field(False, description="a multimodal config: build the whole conditional-generation class "
                         "(vision tower included) and feed it text, as the planner counted it; false: its text decoder")
    activation_offload: bool = Field(False, description="forward and loss under torch.autograd.graph.save_on_cpu("
                                     "pin_memory=True): every saved tensor packed to host memory")
    framework: Literal["deepspeed", "torch"]
    ds_config: dict[str, Any] | None = Field(None, description="the DeepSpeed JSON (framework deepspeed)")
    torch: TorchSettings | None = Field(None, description="the torch wrapping (framework torch)")
    predicted_peak_bytes: int | None = Field(None, description="shown beside the measurement (--plan runs)")
    trace_peak: bool = Field(False, description="record every allocation of the last step (backend/train.py)")
    trace_stacks: bool = Field(True, description="with trace_peak: Python stacks per allocation (large)")
    finetune: FinetuneSettings | None = Field(None, description="LoRA/QLoRA adapters on a frozen base")
    pipeline: PipelineSettings | None = Field(None, description="pipeline stages and schedule (torch pipelining)")
    parallel: ParallelSettings | None = Field(None, description="tensor and/or context parallelism x FSDP2 (DTensor)")
    experts: ExpertSettings | None = Field(None, description="expert parallelism x FSDP2 (all-to-all dispatch)")
    vocab_size: int | None = Field(None, ge=1, description="the pipeline's last stage sizes its loss with it")

    @model_validator(mode="after")
    def _framework_settings(self) -> VerifyJob:
        fields, named = ENGINE_SETTINGS[self.framework]
        if all(getattr(self, f) is None for f in fields):
            raise ValueError(f"framework {self.framework} needs {named}")
        if self.experts is not None and (self.torch is None or self.torch.sharding is None):
            raise ValueError("experts (expert parallelism) needs torch FSDP2 settings")
        return self

    def for_rank(self) -> dict[str, Any]:
        """The mapping backend/train.py reads (JSON key names)."""
        return self.model_dump(by_alias=True)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, indent=1)
