"""The device memory outside the step's tensors, by GPU architecture (data/cuda_context.yaml): the
CUDA/ROCm context and the BLAS workspaces torch allocates through its caching allocator."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from planner.datafile import load_data_yaml
from planner.units import MIB

CONTEXT_PATH = Path(__file__).parents[1] / "data" / "cuda_context.yaml"


@dataclass(frozen=True)
class Architecture:
    name: str
    sm: str  # compute capability ("9.0"), or the ROCm target ("gfx942")
    measured_mib: tuple[int, ...]  # published lazy-loading contexts
    sources: tuple[str, ...]


@lru_cache(maxsize=1)
def _catalogue() -> tuple[dict, dict[str, Architecture]]:
    data = load_data_yaml(CONTEXT_PATH)
    by_gpu: dict[str, Architecture] = {}
    for row in data["architectures"]:
        arch = Architecture(row["name"], str(row["sm"]), tuple(m["mib"] for m in row["measured"]),
                            tuple(m["source"] for m in row["measured"]))
        for name in row["gpus"]:
            by_gpu[name] = arch
    return data, by_gpu


def architecture(gpu_name: str) -> Architecture | None:
    return _catalogue()[1].get(gpu_name)


def context_mib(gpu_name: str, envelope_mib: int) -> int:
    """The context a training process holds on this GPU: gpus.yaml's envelope, raised to the largest
    published lazy-loading context of the GPU's architecture."""
    arch = architecture(gpu_name)
    return max((envelope_mib,) + (arch.measured_mib if arch else ()))


def eager_extra_bytes() -> int:
    """What CUDA_MODULE_LOADING=EAGER adds (every kernel image loaded with its library)."""
    return _catalogue()[0]["eager_extra_mib"] * MIB


def blas_workspaces(gpu_name: str) -> tuple[int, ...]:
    """The BLAS workspaces a training process allocates through the caching allocator on this GPU,
    one (BLAS, BLASLt) pair per thread that runs matmuls (CublasHandlePool.cpp, data/cuda_context.yaml).
    Empty for a GPU the catalogue does not place (CPU ranks)."""
    data, by_gpu = _catalogue()
    arch = by_gpu.get(gpu_name)
    if arch is None:
        return ()
    w = data["workspaces"]
    if arch.sm.startswith("gfx"):  # ROCm: "128MiB for gfx94x/gfx95x"; hipBLASLt's pool is separate
        pair = (w["rocm_gfx94_bytes"] if arch.sm.startswith(("gfx94", "gfx95")) else w["rocm_default_bytes"],
                w["hipblaslt_bytes"])
    else:
        pair = (w["cuda_sm90_bytes"] if arch.sm == "9.0" else w["cuda_default_bytes"], w["cublaslt_bytes"])
    return pair * data["threads_running_matmuls"]


def nvls_capable(gpu_name: str) -> bool:
    """NVSwitch multicast (NVLS) on this GPU type's NVLink systems (data/cuda_context.yaml nvls_gpus)."""
    return gpu_name in _catalogue()[0]["nvls_gpus"]
