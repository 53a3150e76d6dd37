"""The one schema: request and response of the REST API, the CLI's flags and --json output, the
web form's fields and the verification backend's input.

Field names are the CLI's long flags with ``-`` turned into ``_``. Input models are frozen and
forbid unknown fields; every field's ``description`` is its CLI help, OpenAPI text and form label.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.activations import Attention, Checkpointing
from planner.precision import Optimizer, Precision
from planner.strategies import OffloadDevice, StrategyName

MAX_GPUS_PER_NODE = 1024
MAX_NODES = 100_000
MAX_TOKENS = 1 << 24  # micro_batch * seq_len beyond 16M tokens per device is not a training step
# The one set of defaults of `estimate` and `plan` (and so of the API, the page and the CLI flags
# generated from these models): a node of 8 H100 SXM GPUs, 4,096-token sequences (Llama 3's
# pre-training length, Llama 3 paper Sec. 3.4). The same question asked of both gets the same cluster.
DEFAULT_GPU = "h100-80gb"
DEFAULT_GPUS_PER_NODE = 8
DEFAULT_SEQ_LEN = 4096
FABRIC_HELP = "inter-node fabric (ib-hdr, ib-ndr, roce-200g, eth-100g, ...); default: the topology preset's"
NICS_HELP = "NICs per node for inter-node traffic; default: the topology preset's"


class EstimateRequest(BaseModel):
    """What to estimate: a model, a strategy and the cluster it runs on."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), populate_by_name=True)

    model: str | None = Field(None, description="catalogue model name (see `planner models`)",
                              examples=["mistral-7b-v0.1"])
    model_config_: dict[str, Any] | None = Field(
        None, alias="model_config",
        description="a Hugging Face config.json as an object (what --model-file reads)")
    params: int | None = Field(None, gt=0, le=10**14,
                               description="a raw parameter count, when only model states are wanted")
    strategy: StrategyName = Field("zero3", description="distributed strategy")
    gpus: int = Field(DEFAULT_GPUS_PER_NODE, ge=1, le=MAX_GPUS_PER_NODE, description="GPUs (or CPU ranks) per node")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="number of nodes")
    gpu: str = Field(DEFAULT_GPU, description="device type (see `planner gpus`), or cpu")
    device_memory_gib: float | None = Field(
        None, gt=0, le=1 << 20, description="override the device's capacity in GiB (needed for --gpu cpu to judge fit)")
    precision: Precision = Field("bf16-mixed", description="precision recipe")
    optimizer: Optimizer = Field("adamw", description="optimizer")
    micro_batch: int = Field(1, ge=1, le=1 << 16, description="sequences per device per micro-step")
    seq_len: int = Field(DEFAULT_SEQ_LEN, ge=1, le=1 << 22, description="tokens per sequence")
    gradient_accumulation: int = Field(1, ge=1, le=1 << 16, description="micro-steps per optimizer step")
    checkpointing: Checkpointing = Field("none", description="activation checkpointing")
    attention: Attention = Field("sdpa", description="attention implementation (sdpa = flash/memory-efficient)")
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
    topology: str | None = Field(None, description="topology preset for the time model; default: the preset of --gpu")
    topology_text: str | None = Field(None, max_length=64 * 1024,
                                      description="pasted `nvidia-smi topo -m` output (what --topology-file reads)")
    fabric: str | None = Field(None, description=FABRIC_HELP)
    nics_per_node: int | None = Field(None, ge=1, le=64, description=NICS_HELP)
    profile: str | None = Field(None, description="calibration profile saved by `planner calibrate`")

    @model_validator(mode="after")
    def _one_model(self) -> "EstimateRequest":
        given = [name for name, value in (("model", self.model), ("model_config", self.model_config_),
                                          ("params", self.params)) if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of model, model_config (--model-file) or params; got {given or 'none'}")
        if self.micro_batch * self.seq_len > MAX_TOKENS:
            raise ValueError(f"micro_batch({self.micro_batch}) * seq_len({self.seq_len}) = "
                             f"{self.micro_batch * self.seq_len} tokens exceeds {MAX_TOKENS} per device")
        return self

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes


class MemoryItem(BaseModel):
    """One named term of the estimate, with where it comes from."""

    name: str
    bytes: int
    component: Literal["parameters", "gradients", "optimizer_states", "activations", "buffers", "framework"]
    source: str = ""


class Phase(BaseModel):
    """What is live on a device at one moment of a step; the peak is the largest phase."""

    name: str
    bytes: int
    items: list[MemoryItem]


class PerDevice(BaseModel):
    parameters_bytes: int = Field(description="weights held between steps (textbook, sharded as the strategy does)")
    gradients_bytes: int = Field(description="gradients in the training dtype (textbook, sharded as the strategy does)")
    optimizer_states_bytes: int = Field(description="fp32 master weights and optimizer moments")
    activations_bytes: int | None = Field(description="saved activations at the peak; null when unknown (--params)")
    buffers_bytes: int = Field(description="framework buffers beyond the textbook states, at the peak")
    framework_bytes: int = Field(description="CUDA context and allocator overhead")
    resident_bytes: int = Field(description="held between steps")
    peak_bytes: int = Field(description="highest live total during a step")
    peak_phase: str = Field(description="the moment of the step the peak occurs in")


class HostMemory(BaseModel):
    resident_bytes: int = Field(description="host RAM held by offload per node")
    peak_bytes: int = Field(description="highest host RAM per node during a step")
    pinned_bytes: int = Field(description="of which page-locked")


class ModelSummary(BaseModel):
    name: str
    source: str
    parameters: int
    architecture: dict[str, Any] | None


class TimeEstimate(BaseModel):
    """One step on the modelled interconnect (planner/timing.py)."""

    step_seconds: float
    compute_seconds: float
    communication_seconds: float
    exposed_communication_seconds: float
    offload_seconds: float
    tokens_per_second: float = Field(description="over all GPUs")
    mfu: float = Field(description="model FLOPs utilization (no recomputation counted)")
    ring_bandwidth_gbps: float | None = Field(description="slowest link of the ring, GB/s; null on one GPU (no ring)")
    topology: str


class EstimateResult(BaseModel):
    """The answer to `planner estimate`; field names are the public contract (tests freeze them)."""

    parameters: int
    model: ModelSummary
    strategy: str
    world_size: int
    dp_size: int
    shard_size: int
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
    time: TimeEstimate | None = Field(None, description="the time model; null for --params or cpu ranks")


# --- planning --------------------------------------------------------------------------------

Objective = Literal["time", "cost", "memory"]


class PlanRequest(BaseModel):
    """What to plan: a model, the cluster and its wiring, the batch to reach."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=(), populate_by_name=True)

    model: str | None = Field(None, description="catalogue model name", examples=["llama-3-8b"])
    model_config_: dict[str, Any] | None = Field(None, alias="model_config",
                                                 description="a Hugging Face config.json as an object")
    gpu: str = Field(DEFAULT_GPU, description="device type (see `planner gpus`)")
    gpus: int = Field(DEFAULT_GPUS_PER_NODE, ge=1, le=MAX_GPUS_PER_NODE, description="GPUs per node")
    nodes: int = Field(1, ge=1, le=MAX_NODES, description="number of nodes")
    topology: str | None = Field(None, description="topology preset (see `planner topo --list`); default: the preset of --gpu")
    topology_text: str | None = Field(None, max_length=64 * 1024,
                                      description="pasted `nvidia-smi topo -m` output (what --topology-file reads)")
    fabric: str | None = Field(None, description=FABRIC_HELP)
    nics_per_node: int | None = Field(None, ge=1, le=64, description=NICS_HELP)
    seq_len: int = Field(DEFAULT_SEQ_LEN, ge=1, le=1 << 22, description="tokens per sequence")
    global_batch: int = Field(256, ge=1, le=1 << 24, description="sequences per optimizer step, over all GPUs")
    objective: Objective = Field("time", description="rank by step time, by GPU-hours per token, or by memory")
    precision: Precision = Field("bf16-mixed", description="precision recipe")
    optimizer: Optimizer = Field("adamw", description="optimizer")
    attention: Attention = Field("sdpa", description="attention implementation")
    headroom: float = Field(0.05, ge=0.0, lt=0.9, description="fraction of device memory kept free")
    compute_efficiency: float = Field(0.45, gt=0.0, le=1.0, description="achievable fraction of peak TFLOP/s")
    link_efficiency: float = Field(1.0, gt=0.0, le=4.0,
                                   description="achieved fraction of the modelled (realistic) link bandwidths")
    profile: str | None = Field(None, description="calibration profile saved by `planner calibrate` (sets the efficiencies)")

    @model_validator(mode="after")
    def _one_model(self) -> "PlanRequest":
        given = [n for n, v in (("model", self.model), ("model_config", self.model_config_)) if v is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of model or model_config (--model-file); got {given or 'none'}")
        if self.topology is not None and self.topology_text is not None:
            raise ValueError("give --topology or --topology-file, not both")
        return self


class Candidate(BaseModel):
    strategy: str
    micro_batch: int
    gradient_accumulation: int
    checkpointing: str
    offload_optimizer: str
    offload_params: str
    hsdp_shard_size: int | None = Field(None, description="hsdp: GPUs per shard group; null for other strategies")
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


class TopologySummary(BaseModel):
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
    recommended: Candidate | None
    candidates: list[Candidate]
    candidates_evaluated: int
    min_gpus: dict[str, int | None] = Field(description="smallest total GPU count each strategy trains on (micro-batch 1)")
    max_micro_batch: dict[str, int | None] = Field(description="largest micro-batch that fits, per strategy")
    faster_on_fewer_nodes: int | None = Field(
        None, description="a smaller node count whose best option beats every option on all the nodes (the fabric "
                          "cannot carry the traffic of spanning them); null when none")
    topology: TopologySummary
    notes: list[str]
    request: PlanRequest
