"""Interconnect topology: parse `nvidia-smi topo -m`, model each GPU pair's link, group NVLink islands.

A link code alone does not give a bandwidth: ``NV4`` between RTX A6000s (GA102 bridges) is not
``NV4`` between A100s. Rates come from data/links.yaml per link generation, nominal and realistic,
each with its source; the GPU's generation (gpus.yaml) picks the row.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from planner.datafile import load_data_yaml
from planner.errors import PlannerError
from planner.cluster.gpus import Gpu

LINKS_PATH = Path(__file__).parents[1] / "data" / "links.yaml"
TOPOLOGY_FIELD = "topology_text"  # the request field that carries a pasted `nvidia-smi topo -m`
MAX_TOPOLOGY_BYTES = 64 * 1024  # nvidia-smi topo -m for 16 GPUs and 16 NICs is ~6 KiB
CODES = ("X", "SYS", "NODE", "PHB", "PXB", "PIX", "NV")
_DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\d+_\d+|mlx5_\d+)$")
_NV = re.compile(r"^NV(\d+)$")


class GpuRow(BaseModel):
    index: int
    cpu_affinity: str | None = Field(description="CPU cores local to the GPU, as printed")
    numa_node: int | None = Field(description="NUMA node of the GPU; null when N/A or absent")


class Nic(BaseModel):
    name: str = Field(description="column label (NIC0, or an old mlx5_N label)")
    device: str | None = Field(description="device from the NIC Legend (mlx5_0), when given")
    nearest_gpus: list[int] = Field(
        description="GPUs at the NIC's closest PCIe distance (PIX, then PXB, PHB, NODE; none if all are SYS)")


class Link(BaseModel):
    a: int
    b: int
    code: str = Field(description="the link code exactly as printed (NV12, SYS, PXB, ...)")
    kind: str = Field(description="the modelled link type (nvlink4, pcie-gen4, socket, ...)")
    bandwidth_gbps: float = Field(description="realistic unidirectional bandwidth, GB/s (bytes)")
    nominal_bandwidth_gbps: float = Field(description="nominal unidirectional bandwidth, GB/s (bytes)")
    latency_us: float = Field(description="one-hop latency, microseconds")


class Topology(BaseModel):
    model_config = ConfigDict(frozen=True)

    gpus: list[GpuRow]
    nics: list[Nic]
    matrix: list[list[str]] = Field(description="GPU x GPU link codes exactly as printed")
    links: list[Link] = Field(description="every GPU pair with its modelled link")
    nvlink_groups: list[list[int]] = Field(description="GPUs joined by NVLink (connected components)")
    gpu_type: str
    source: str


# --- parsing ---------------------------------------------------------------------------------

def _split(line: str) -> list[str]:
    """nvidia-smi separates columns with tabs; posted copies often turn them into runs of spaces.
    Header names ("CPU Affinity") contain single spaces, so split on tabs or 2+ spaces."""
    if "\t" in line:
        return [cell.strip() for cell in line.split("\t")]
    return [cell.strip() for cell in re.split(r" {2,}", line.strip())]


def _header(lines: list[str]) -> tuple[int, list[str], list[str]]:
    for number, line in enumerate(lines):
        cells = [c for c in _split(line) if c]
        if cells and cells[0] == "GPU0" and not _is_data_row(cells):
            devices = [c for c in cells if _DEVICE.match(c)]
            extra = [c for c in cells if not _DEVICE.match(c)]
            return number, devices, extra
    raise PlannerError("topology: no header line with GPU0 ... found; paste the output of `nvidia-smi topo -m`",
                       field=TOPOLOGY_FIELD)


def _is_data_row(cells: list[str]) -> bool:
    """The GPU0 data row, not the header: its second cell is a link code (X, SYS, NV12, ...)."""
    return len(cells) > 1 and (cells[1] in CODES or _NV.match(cells[1]) is not None)


def _check_code(code: str, line_no: int, line: str) -> str:
    if code in CODES[:-1] or _NV.match(code):
        return code
    raise PlannerError(f"topology line {line_no}: unknown link code {code!r} in {line.strip()[:80]!r}",
                       field=TOPOLOGY_FIELD)


def _parse_rows(lines: list[str], start: int, devices: list[str], extra: list[str]):
    rows: dict[str, tuple[list[str], list[str]]] = {}
    for offset, line in enumerate(lines[start + 1:], start=start + 2):
        stripped = line.strip()
        if not stripped:
            if rows:
                break
            continue
        if stripped.startswith("Legend"):
            break
        cells = _split(line)
        label = cells[0]
        if not _DEVICE.match(label):
            raise PlannerError(f"topology line {offset}: expected a GPU/NIC row label, got {label!r}",
                               field=TOPOLOGY_FIELD)
        values = cells[1:]
        codes = [c for c in values[:len(devices)]]
        if len(codes) < len(devices) or any(c == "" for c in codes):
            # space-aligned rows lose empty cells; tab rows keep them: both give codes first
            codes = [c for c in values if c][:len(devices)]
        if len(codes) < len(devices):
            raise PlannerError(f"topology line {offset}: row {label} has {len(codes)} link codes for "
                               f"{len(devices)} columns", field=TOPOLOGY_FIELD)
        rest = [c for c in values[len(devices):]]
        for code in codes:
            _check_code(code, offset, line)
        rows[label] = (codes, rest)
    return rows


def _nic_legend(lines: list[str]) -> dict[str, str]:
    legend: dict[str, str] = {}
    inside = False
    for line in lines:
        if line.strip().startswith("NIC Legend"):
            inside = True
            continue
        if inside:
            match = re.match(r"^\s*(NIC\d+)\s*:\s*(\S+)\s*$", line)
            if match:
                legend[match.group(1)] = match.group(2)
            elif line.strip():
                break
    return legend


def _affinity(rest: list[str], extra: list[str]) -> tuple[str | None, int | None]:
    values = [v for v in rest if v != ""]
    named = dict(zip(extra, values))
    cpu = named.get("CPU Affinity")
    numa = named.get("NUMA Affinity")
    numa_node = int(numa) if numa is not None and numa.isdigit() else None
    return (cpu if cpu not in (None, "N/A") else None), numa_node


# nvidia-smi's PCIe distances, nearest first (its Legend: PIX one switch, PXB several, PHB the host
# bridge, NODE within a NUMA node); SYS crosses the inter-socket link and is nobody's "nearest".
PCIE_DISTANCE = ("PIX", "PXB", "PHB", "NODE")


def parse_topology(text: str, gpu: Gpu, source: str = "nvidia-smi topo -m") -> Topology:
    if len(text.encode()) > MAX_TOPOLOGY_BYTES:
        raise PlannerError(f"topology: {len(text.encode())} bytes is more than nvidia-smi prints "
                           f"(limit {MAX_TOPOLOGY_BYTES})", field=TOPOLOGY_FIELD)
    lines = text.replace("\r\n", "\n").split("\n")
    start, devices, extra = _header(lines)
    rows = _parse_rows(lines, start, devices, extra)
    gpu_labels = [d for d in devices if d.startswith("GPU")]
    if [f"GPU{i}" for i in range(len(gpu_labels))] != gpu_labels:
        raise PlannerError(f"topology line {start + 1}: GPU columns are not GPU0..GPU{len(gpu_labels) - 1}",
                           field=TOPOLOGY_FIELD)
    missing = [d for d in gpu_labels if d not in rows]
    if missing:
        raise PlannerError(f"topology: no row for {missing[0]}", field=TOPOLOGY_FIELD)
    index = {d: i for i, d in enumerate(devices)}
    matrix = [[rows[g][0][index[h]] for h in gpu_labels] for g in gpu_labels]
    for i, row in enumerate(matrix):
        if row[i] != "X":
            raise PlannerError(f"topology: GPU{i}'s own entry is {row[i]!r}, expected X", field=TOPOLOGY_FIELD)
        for j, code in enumerate(row):
            if matrix[j][i] != code:
                raise PlannerError(f"topology: GPU{i}-GPU{j} is {code} but GPU{j}-GPU{i} is {matrix[j][i]}",
                                   field=TOPOLOGY_FIELD)
    gpus = [GpuRow(index=i, cpu_affinity=a, numa_node=n)
            for i, (a, n) in enumerate(_affinity(rows[g][1], extra) for g in gpu_labels)]
    legend = _nic_legend(lines)
    nics = []
    for d in devices:
        if d.startswith("GPU"):
            continue
        codes = [rows[g][0][index[d]] for g in gpu_labels]
        best = next((c for c in PCIE_DISTANCE if c in codes), None)
        near = [i for i, c in enumerate(codes) if c == best]
        nics.append(Nic(name=d, device=legend.get(d, d if d.startswith("mlx") else None), nearest_gpus=near))
    links = [link_between(i, j, matrix[i][j], gpu) for i in range(len(matrix)) for j in range(i + 1, len(matrix))]
    return Topology(gpus=gpus, nics=nics, matrix=matrix, links=links, nvlink_groups=_nvlink_groups(matrix),
                    gpu_type=gpu.name, source=source)


def _nvlink_groups(matrix: list[list[str]]) -> list[list[int]]:
    seen: set[int] = set()
    groups = []
    for start in range(len(matrix)):
        if start in seen:
            continue
        stack, group = [start], []
        seen.add(start)
        while stack:
            node = stack.pop()
            group.append(node)
            for other, code in enumerate(matrix[node]):
                if _NV.match(code) and other not in seen:
                    seen.add(other)
                    stack.append(other)
        groups.append(sorted(group))
    return groups


# --- link rates ------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def link_rates() -> dict:
    return load_data_yaml(LINKS_PATH)


def link_between(a: int, b: int, code: str, gpu: Gpu) -> Link:
    rates = link_rates()
    nv = _NV.match(code)
    if nv:
        generation = gpu.nvlink
        if generation == "none" or generation not in rates["nvlink"]:
            raise PlannerError(f"topology: GPU{a}-GPU{b} is {code}, but {gpu.name} has no NVLink", field=TOPOLOGY_FIELD)
        row = rates["nvlink"][generation]
        count = int(nv.group(1))
        return Link(a=a, b=b, code=code, kind=generation,
                    nominal_bandwidth_gbps=count * row["per_link_gbps"],
                    bandwidth_gbps=count * row["per_link_gbps"] * row["efficiency"], latency_us=row["latency_us"])
    pcie = rates["pcie"].get(gpu.pcie, rates["pcie"]["gen4"])
    hop = rates["pcie_paths"][code]
    nominal = pcie["x16_gbps"] * hop["bandwidth_factor"]
    return Link(a=a, b=b, code=code, kind=f"pcie-{gpu.pcie}" + (f" {hop['kind']}" if hop["kind"] else ""),
                nominal_bandwidth_gbps=round(nominal, 3),
                bandwidth_gbps=round(nominal * pcie["efficiency"], 3),
                latency_us=pcie["latency_us"] + hop["extra_latency_us"])
