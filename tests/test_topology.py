"""`nvidia-smi topo -m` parsing on real published outputs, the link model, presets and pictures."""

from pathlib import Path

import pytest

from planner.errors import PlannerError
from planner.cluster.gpus import gpu
from planner.cluster.presets import PRESETS, preset_topology
from planner.render import topology_svg
from planner.cluster.topology import parse_topology

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "topologies"


def read(path: Path) -> str:
    if not path.exists():
        pytest.fail(f"{path} is missing (tests/fixtures/topologies ships with the repo)")
    return path.read_text()


def test_dgx_a100_nvswitch_with_ten_nics():
    t = parse_topology(read(FIXTURES / "dgx_a100_8gpu_10nic.txt"), gpu("a100-80gb"))
    assert len(t.gpus) == 8 and len(t.nics) == 10
    assert all(code == "NV12" for i, row in enumerate(t.matrix) for j, code in enumerate(row) if i != j)
    assert t.nvlink_groups == [list(range(8))]
    assert t.gpus[0].cpu_affinity == "48-63,176-191" and t.gpus[0].numa_node == 3
    assert t.nics[0].device == "mlx5_0" and t.nics[0].nearest_gpus == [0, 1]
    link = t.links[0]
    assert link.nominal_bandwidth_gbps == 12 * 25.0  # 12 NVLink3 links x 25 GB/s per direction
    assert link.bandwidth_gbps < link.nominal_bandwidth_gbps


def test_a6000_bridge_pairs_and_two_sockets():
    t = parse_topology(read(FIXTURES / "rtx_a6000_8gpu_nvlink_bridge_pairs_2nic.txt"), gpu("rtx-a6000"))
    assert t.nvlink_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.matrix[0][1] == "NV4" and t.matrix[0][2] == "NODE" and t.matrix[0][4] == "SYS"
    assert [g.numa_node for g in t.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    bw = {(k.a, k.b): k.bandwidth_gbps for k in t.links}
    assert bw[(0, 1)] > bw[(0, 2)] > bw[(0, 4)]
    # NV4 on GA102 bridges is not NV4 between A100s
    a100 = parse_topology(read(FIXTURES / "rtx_a6000_8gpu_nvlink_bridge_pairs_2nic.txt"), gpu("a100-80gb"))
    assert {(k.a, k.b): k.bandwidth_gbps for k in a100.links}[(0, 1)] > bw[(0, 1)]


def test_pcie_tabs_with_empty_fields():
    t = parse_topology(read(FIXTURES / "pcie_8x_rtx4090_all_sys_tabs.txt"), gpu("rtx-4090"))
    assert len(t.gpus) == 8 and len(t.nics) == 2
    assert t.nvlink_groups == [[i] for i in range(8)]
    assert t.gpus[4].cpu_affinity == "56-111,168-223" and t.gpus[4].numa_node == 1


def test_two_gpu_phb_workstation():
    t = parse_topology(read(FIXTURES / "rtx5090_2gpu_phb_tabs.txt"), gpu("rtx-4090"))
    assert t.matrix == [["X", "PHB"], ["PHB", "X"]] and t.gpus[1].numa_node == 0 and t.nics == []


def test_rtx4090_box_all_sys_with_empty_fields():
    # 8x RTX 4090, tab-separated with an empty field before GPU NUMA ID (NVIDIA/go-gpuallocator issue #17)
    t = parse_topology(read(FIXTURES / "rtx4090_8gpu_all_sys_2nic_tabs.txt"), gpu("rtx-4090"))
    assert all(code == "SYS" for i, row in enumerate(t.matrix) for j, code in enumerate(row) if i != j)
    assert [n.name for n in t.nics] == ["NIC0", "NIC1"] and t.nics[0].nearest_gpus == [6]
    assert t.gpus[4].numa_node == 1 and t.gpus[3].cpu_affinity == "0-55,112-167"
    assert t.nvlink_groups == [[i] for i in range(8)]
    assert max(k.bandwidth_gbps for k in t.links) < 64  # every ring crosses the sockets


def test_old_mlx5_labels_and_no_numa_column():
    # header shape of NVIDIA/nccl-tests issue #78 (DGX-2 era): NICs as mlx5_N columns, CPU Affinity only
    text = ("        GPU0    GPU1    mlx5_0  mlx5_1  CPU Affinity\n"
            "GPU0     X      NV6     PIX     PXB     0-23,48-71\n"
            "GPU1    NV6      X      PXB     PIX     0-23,48-71\n"
            "mlx5_0  PIX     PXB      X      PIX\n"
            "mlx5_1  PXB     PIX     PIX      X\n\nLegend:\n  X    = Self\n")
    t = parse_topology(text, gpu("v100-32gb"))
    assert [n.name for n in t.nics] == ["mlx5_0", "mlx5_1"] and t.nics[0].device == "mlx5_0"
    assert t.gpus[0].numa_node is None and t.gpus[0].cpu_affinity == "0-23,48-71"
    assert t.links[0].kind == "nvlink2"


@pytest.mark.parametrize("text,message", [
    ("hello world\n", "no header line with GPU0"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \tWHAT\nBOGUS\tX\n", "line 4: expected a GPU/NIC row label, got 'BOGUS'"),
    ("\tGPU0\tGPU1\nGPU0\t X \tQQ\nGPU1\tQQ\t X \n", "line 2: unknown link code 'QQ'"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\n", "no row for GPU1"),
    ("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tSYS\t X \n", "GPU0-GPU1 is NV4 but GPU1-GPU0 is SYS"),
    ("\tGPU0\tGPU1\nGPU0\t X \nGPU1\tSYS\t X \n", "line 2: row GPU0 has 1 link codes for 2 columns"),
])
def test_malformed_text_names_the_line(text, message):
    with pytest.raises(PlannerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_topology(text, gpu("a100-80gb"))


def test_nvlink_code_on_a_gpu_without_nvlink_is_refused():
    with pytest.raises(PlannerError, match="rtx-4090 has no NVLink"):
        parse_topology("\tGPU0\tGPU1\nGPU0\t X \tNV4\nGPU1\tNV4\t X \n", gpu("rtx-4090"))


def test_oversized_text_is_refused():
    with pytest.raises(PlannerError, match="more than nvidia-smi prints"):
        parse_topology("x" * (70 * 1024), gpu("a100-80gb"))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_parse_and_render(name):
    t = preset_topology(name)
    assert len(t.gpus) == PRESETS[name].gpus and t.links
    svg = topology_svg(t)
    assert svg.startswith("<svg") and svg.count("<circle") == len(t.gpus) and "GB/s" in svg
