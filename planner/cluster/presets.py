"""Topology presets for common machines, written as `nvidia-smi topo -m` text and read back by the
same parser as a user's paste, plus each machine's inter-node fabric."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from planner.errors import UnknownNameError, unknown
from planner.cluster.gpus import gpu as lookup_gpu
from planner.cluster.topology import Topology, parse_topology


@dataclass(frozen=True)
class Preset:
    name: str
    gpu: str
    gpus: int
    description: str
    code: Callable[[int, int], str]  # link code between GPU i and GPU j (i != j)
    numa: Callable[[int], int]
    nics_per_node: int
    fabric: str
    source: str
    # The node's system memory (host RAM) where the vendor's datasheet states it for the system, in
    # decimal GB as printed ("2TB" = 2,000 GB: read as 10**9 bytes, the conservative reading, since
    # the OS sees less than the DIMMs hold anyway); None where the machine is a class of servers.
    host_memory_gb: int | None = None
    host_memory_source: str = ""


# Vendor datasheets of the systems the presets stand for (the DGX of each HGX baseboard):
_DGX_A100 = ("NVIDIA DGX A100 datasheet (nvidia-dgx-a100-80gb-datasheet.pdf): DGX A100 640GB, "
             "System Memory 2TB")
_DGX_A100_320 = ("NVIDIA DGX A100 datasheet (nvidia-dgx-a100-datasheet.pdf): DGX A100 320GB, 8x A100 40GB, "
                 "System Memory 1TB")
_DGX_H100 = ("NVIDIA DGX H100 datasheet (nvidia-dgx-h100-datasheet): System Memory 2TB")
_DGX_H200 = ("NVIDIA DGX H200 datasheet (dgx-h200-datasheet): System Memory 2TB; NVIDIA's own MLPerf "
             "Inference v4.1 H200-SXM-141GBx8 system: host_memory_capacity 2 TB, 32x 64GB")
_DGX_B200 = ("NVIDIA DGX B200 datasheet (dgx-b200-datasheet): System Memory 2TB, configurable to 4TB "
             "(the base figure is used)")
# Not stated here: HGX B300 (no system datasheet figure found to cite) and the GB200 NVL72 tray (the
# datasheet's "up to 480GB LPDDR5X" per Grace, two per tray, disagrees with the 1.87 TB per 4-GPU node
# an MLPerf Inference v6.1 GB200-NVL72 system description reports): give --host-memory-gib.


def _all(code: str) -> Callable[[int, int], str]:
    return lambda i, j: code


def _sockets(half: int, inside: str) -> Callable[[int, int], str]:
    return lambda i, j: inside if (i < half) == (j < half) else "SYS"


def _pairs(i: int, j: int, bridge: str = "NV4") -> str:
    if i // 2 == j // 2:
        return bridge
    return "NODE" if (i < 4) == (j < 4) else "SYS"


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("dgx-a100", "a100-80gb", 8, "DGX A100: 8x A100 SXM4 on 6 NVSwitches (NV12 everywhere), 8 HDR NICs",
           _all("NV12"), lambda i: (3, 3, 1, 1, 7, 7, 5, 5)[i], 8, "ib-hdr",
           "tests/fixtures/topologies/dgx_a100_8gpu_10nic.txt; NVIDIA DGX A100 user guide", 2000, _DGX_A100),
    Preset("dgx-a100-320gb", "a100-40gb", 8, "DGX A100 320GB: 8x A100 SXM4 40GB on 6 NVSwitches (NV12 everywhere), "
           "8 HDR NICs", _all("NV12"), lambda i: (3, 3, 1, 1, 7, 7, 5, 5)[i], 8, "ib-hdr",
           "NVIDIA DGX A100 user guide (the 320GB and 640GB systems share the NVSwitch board)", 1000, _DGX_A100_320),
    Preset("hgx-h100", "h100-80gb", 8, "DGX/HGX H100: 8x H100 SXM5 on NVSwitch (NV18), 8 NDR NICs",
           _all("NV18"), lambda i: 0 if i < 4 else 1, 8, "ib-ndr", "NVIDIA DGX H100 user guide", 2000, _DGX_H100),
    Preset("grand-teton-h100", "h100-sxm-96gb", 8, "Meta Grand Teton: 8x H100 SXM 96 GB (500 W) fully connected "
           "by NVLink (NV18), 400 Gb/s RoCE per GPU", _all("NV18"), lambda i: 0 if i < 4 else 1, 8, "roce-400g",
           "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Hardware (\"8 NVIDIA H100 GPUs fully connected "
           "with NVLink\", \"backend RDMA network with 400 Gb/s per GPU\"); RoCE: Gangidi et al. 2024, \"RDMA over "
           "Ethernet for Distributed AI Training at Meta Scale\", SIGCOMM"),
    Preset("hgx-h200", "h200", 8, "HGX H200: 8x H200 SXM on NVSwitch (NV18), 8 NDR NICs",
           _all("NV18"), lambda i: 0 if i < 4 else 1, 8, "ib-ndr", "NVIDIA HGX H200 datasheet", 2000, _DGX_H200),
    Preset("hgx-b200", "b200", 8, "HGX B200: 8x B200 on NVSwitch (NV18, NVLink 5), 8 XDR-class NICs",
           _all("NV18"), lambda i: 0 if i < 4 else 1, 8, "ib-ndr", "NVIDIA HGX B200 datasheet", 2000, _DGX_B200),
    Preset("pcie-8x-rtx4090", "rtx-4090", 8, "8x RTX 4090 on PCIe only, two sockets (SYS across)",
           _sockets(4, "NODE"), lambda i: 0 if i < 4 else 1, 2, "eth-100g",
           "tests/fixtures/topologies/pcie_8x_rtx4090_all_sys_tabs.txt (NVIDIA/go-gpuallocator#17)"),
    Preset("pcie-8x-l40s", "l40s", 8, "8x L40S on PCIe switches (PXB inside a socket, SYS across)",
           _sockets(4, "PXB"), lambda i: 0 if i < 4 else 1, 2, "roce-200g", "typical 2-socket PCIe server"),
    Preset("a6000-nvlink-pairs", "rtx-a6000", 8, "8x RTX A6000 with NVLink bridges in pairs, two sockets",
           _pairs, lambda i: 0 if i < 4 else 1, 2, "ib-hdr",
           "tests/fixtures/topologies/rtx_a6000_8gpu_nvlink_bridge_pairs_2nic.txt (UNIGE HPC forum)"),
    Preset("hgx-b300", "b300", 8, "HGX B300: 8x B300 on NVSwitch (NV18, NVLink 5), 8 ConnectX-8 800G NICs",
           _all("NV18"), lambda i: 0 if i < 4 else 1, 8, "ib-xdr", "NVIDIA HGX B300 datasheet"),
    Preset("gb200-nvl72-tray", "gb200", 4, "GB200 NVL72 compute tray: 4 Blackwell GPUs on the rack's NVLink Switch (NV18)",
           _all("NV18"), lambda i: 0 if i < 2 else 1, 4, "ib-xdr", "NVIDIA GB200 NVL72 datasheet"),
    Preset("h100-nvl-pairs", "h100-nvl", 8, "8x H100 NVL on PCIe Gen5, NVLink-bridged in pairs (NV12), two sockets",
           lambda i, j: _pairs(i, j, "NV12"), lambda i: 0 if i < 4 else 1, 4, "ib-ndr",
           "NVIDIA H100 NVL product brief: pairs joined by three NVLink bridges, 600 GB/s"),
    Preset("pcie-8x-l4", "l4", 8, "8x L4 on PCIe Gen4 switches (PXB inside a socket, SYS across)",
           _sockets(4, "PXB"), lambda i: 0 if i < 4 else 1, 2, "eth-100g", "typical 2-socket PCIe inference server"),
    Preset("workstation-2x-rtx4090", "rtx-4090", 2, "2x RTX 4090 under one host bridge (PHB)",
           _all("PHB"), lambda i: 0, 1, "eth-25g", "typical single-socket workstation"),
]}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise UnknownNameError(unknown("topology preset", name, list(PRESETS)), field="topology") from None


def preset_text(p: Preset) -> str:
    cols = [f"GPU{i}" for i in range(p.gpus)]
    lines = ["\t" + "\t".join(cols + ["CPU Affinity", "NUMA Affinity"])]
    for i in range(p.gpus):
        codes = [" X " if i == j else p.code(i, j) for j in range(p.gpus)]
        lines.append("\t".join([f"GPU{i}"] + codes + ["N/A", str(p.numa(i))]))
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=None)  # a few presets, each parsed once per process (a frozen Topology, shared)
def preset_topology(name: str) -> Topology:
    p = preset(name)
    return parse_topology(preset_text(p), lookup_gpu(p.gpu), source=f"preset {p.name}")


def default_preset_for(gpu_name: str) -> str | None:
    """The preset a bare --gpu implies (the first one built from that GPU)."""
    return next((p.name for p in PRESETS.values() if p.gpu == gpu_name), None)
