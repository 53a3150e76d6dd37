"""The GPU catalogue (data/gpus.yaml): capacity, peak throughput, CUDA context overhead."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.cluster import cuda_context
from planner.datafile import load_data_yaml
from planner.errors import PlannerError, UnknownNameError, unknown
from planner.recipes.precision import Recipe
from planner.units import MIB

GPU_PATH = Path(__file__).parents[1] / "data" / "gpus.yaml"


class Gpu(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    vendor_name: str
    vendor: Literal["nvidia", "amd", "none"] = Field("nvidia", description="who makes it (none: CPU ranks)")
    memory_mib: int = Field(ge=0)
    peak_tflops: dict[str, float] = Field(description="dense (no sparsity) peak per dtype: bf16, fp16, fp8, tf32, fp32")
    mamf_tflops: dict[str, float] = Field(
        {}, description="measured maximum achievable dense matmul TFLOP/s per dtype (Bekman's MAMF table); "
        "the time model's matmul rate")
    mamf_k: dict[str, int] = Field(
        {}, description="K of the shape each MAMF was measured at (the table's best MxNxK), per dtype")
    sustained_tflops: dict[str, float] = Field(
        {}, description="measured sustainable dense matmul TFLOP/s per dtype under the board's power limit "
        "(Bekman's MSMF); the ceiling every GEMM of a training step runs under")
    sms: int | None = Field(None, gt=0, description="streaming multiprocessors (AMD: compute units), for GEMM waves")
    memory_bandwidth_gbps: float | None = Field(
        None, gt=0, description="peak device-memory bandwidth, GB/s (datasheet); none for CPU ranks")
    bf16: bool
    nvlink: str = Field(description="NVLink generation (a row of links.yaml), or none")
    pcie: str = Field(description="PCIe generation of the host link (a row of links.yaml)")
    links: str = Field("", description="the GPU's links as its datasheet states them")
    cuda_context_mib: int = Field(ge=0)
    time_model_caveats: tuple[str, ...] = Field(
        (), description="what the time model cannot say for this GPU (shown in estimate and plan notes)")
    source: str

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def cuda_context_bytes(self) -> int:
        """The context outside torch's allocator: this envelope, raised to the largest published
        context of the GPU's architecture (data/cuda_context.yaml)."""
        return cuda_context.context_mib(self.name, self.cuda_context_mib) * MIB

    @property
    def blas_workspace_bytes(self) -> int:
        """cuBLAS/cuBLASLt (hipBLAS/hipBLASLt) workspaces, allocated through torch's caching allocator."""
        return sum(cuda_context.blas_workspaces(self.name))

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"


@lru_cache(maxsize=1)
def load_gpus() -> dict[str, Gpu]:
    data = load_data_yaml(GPU_PATH)
    gpus = [Gpu.model_validate(entry) for entry in data["gpus"]]
    return {g.name: g for g in gpus}


def gpu(name: str) -> Gpu:
    gpus = load_gpus()
    found = gpus.get(name) or gpus.get(name.lower())
    if found is None:
        raise UnknownNameError(unknown("gpu", name, list(gpus)), field="gpu")
    return found


def check_precision(g: Gpu, precision: str, recipe: Recipe) -> None:
    """Refuse precision ``precision`` (decoded: ``recipe``) on a GPU without its compute dtype."""
    if recipe.compute == "bf16" and not g.bf16:
        raise PlannerError(f"precision {precision} needs bfloat16, which {g.name} ({g.vendor_name}) does not support; "
                           "use fp16-mixed or fp32", field="precision")
