"""The GPUs people rent: each with its datasheet's memory, dense TFLOP/s and links, usable in
estimate and plan, and what the time model cannot say for it in the notes."""

import pytest

from planner.cluster.gpus import load_gpus
from planner.plan.search import plan
from planner.time.step import estimate_with_time
from planner.cluster.presets import PRESETS, default_preset_for
from planner.schema import EstimateRequest, PlanRequest

NEW = ["h100-pcie", "h100-nvl", "h100-sxm-96gb", "gh200", "b300", "gb200", "l4", "a10g", "rtx-5090", "mi300x"]


@pytest.mark.parametrize("name", NEW)
def test_new_gpus_have_datasheet_fields(name):
    g = load_gpus()[name]
    assert g.memory_bytes > 20 * 2**30 and g.source.startswith("https://")
    assert g.peak_tflops["bf16"] > 0 and g.peak_tflops["fp32"] > 0 and g.links
    if name != "a10g":  # Ampere GA102 has no FP8 tensor cores
        assert g.peak_tflops["fp8"] == pytest.approx(2 * g.peak_tflops["bf16"], rel=0.01)


def test_dense_figures_are_half_the_sparse_datasheet_ones():
    gpus = load_gpus()
    # H100 datasheet (with sparsity): PCIe BF16 1,513, NVL 1,671; MI300X datasheet: BF16 dense 1,307.4
    assert gpus["h100-pcie"].peak_tflops["bf16"] * 2 == pytest.approx(1513, abs=1)
    assert gpus["h100-nvl"].peak_tflops["bf16"] * 2 == pytest.approx(1671, abs=1)
    assert gpus["mi300x"].peak_tflops["bf16"] == 1307.4 and gpus["mi300x"].memory_mib == 192 * 1024


@pytest.mark.parametrize("name", NEW)
def test_each_new_gpu_works_in_estimate_and_plan(name):
    preset = default_preset_for(name)
    gpus = PRESETS[preset].gpus if preset else 8
    result = estimate_with_time(EstimateRequest(model="llama-3.2-1b", strategy="zero3", gpus=gpus, gpu=name,
                                                seq_len=2048))
    assert result.time is not None and result.time.step_seconds > 0
    assert result.device_capacity_bytes == load_gpus()[name].memory_bytes
    planned = plan(PlanRequest(model="llama-3.2-1b", gpu=name, gpus=gpus, nodes=2, seq_len=2048,
                               global_batch=16 * gpus))
    assert planned.recommended is not None


def test_amd_and_superchips_are_flagged_in_estimate_and_plan_notes():
    est = estimate_with_time(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="mi300x"))
    flagged = [n for n in est.notes if n.startswith("time model: mi300x (AMD)")]
    assert flagged and "no Infinity Fabric (xGMI) link model" in flagged[0] and "RCCL" in flagged[0]
    assert load_gpus()["mi300x"].vendor == "amd"
    planned = plan(PlanRequest(model="llama-3-8b", gpu="mi300x", gpus=8, seq_len=4096, global_batch=64))
    assert any(n.startswith("time model: mi300x (AMD)") for n in planned.notes)
    tray = plan(PlanRequest(model="llama-3-8b", gpu="gb200", gpus=4, nodes=2, seq_len=4096, global_batch=64))
    assert any("NVL72 carries it over NVLink" in n for n in tray.notes)
    assert not any(n.startswith("time model:") for n in plan(
        PlanRequest(model="llama-3-8b", gpu="h100-80gb", gpus=8, seq_len=4096, global_batch=64)).notes)


def test_the_grand_teton_h100_is_torchtitans_published_board():
    """torchtitan benchmarks/llama3_h100_202412_torchtitan.md: 96 GB HBM2e at 2.4 TB/s, 500 W, NVLink inside
    the host, 400 Gb/s RDMA per GPU; its unpublished peak read at the H100 NVL's, said in the notes."""
    from planner.cluster.presets import preset_topology

    g = load_gpus()["h100-sxm-96gb"]
    assert (g.memory_bandwidth_gbps, g.peak_tflops["bf16"], g.sms) == (2400.0, load_gpus()["h100-nvl"].peak_tflops["bf16"], 132)
    assert default_preset_for("h100-sxm-96gb") == "grand-teton-h100"
    p = PRESETS["grand-teton-h100"]
    assert (p.nics_per_node, p.fabric) == (8, "roce-400g")
    assert preset_topology("grand-teton-h100").links[0].kind == "nvlink4"
    est = estimate_with_time(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-sxm-96gb"))
    assert any(n.startswith("time model: h100-sxm-96gb: its peak at 500 W is unpublished") for n in est.notes)
    # the same run on the 700 W, 3.35 TB/s board is faster
    sxm = estimate_with_time(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-80gb"))
    assert sxm.time.step_seconds < est.time.step_seconds


def test_links_of_the_new_presets():
    from planner.cluster.presets import preset_topology

    b300 = preset_topology("hgx-b300")
    assert b300.links[0].kind == "nvlink5" and b300.links[0].nominal_bandwidth_gbps == 900.0
    nvl = preset_topology("h100-nvl-pairs")
    assert nvl.nvlink_groups == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert nvl.links[0].nominal_bandwidth_gbps == 300.0  # NV12 x 25 GB/s per direction: 600 GB/s bidirectional
    from planner.cluster.topology import link_between

    assert link_between(0, 1, "PIX", load_gpus()["b300"]).kind.startswith("pcie-gen6")


def test_compute_terms_scale_with_the_measured_rates():
    """planner/time/kernels.py: matmuls run at the GPU's measured MAMF, elementwise work at its memory
    bandwidth. H100 SXM and H200 share the MAMF (794.5 TFLOP/s, "H200 is the same") and the 132
    SMs; their memory bandwidths are 3,350 and 4,800 GB/s, so the elementwise term of the H200 is
    3350/4800 of the H100's, and both are Hopper, whose K loop is measured (XLA's sm_90 table:
    planner/time/kernels.py HOPPER_K_PIPELINE); their sustained ceilings differ (703.7 and 744.5 TFLOP/s,
    gpus.yaml sustained_tflops), so the H100's matmuls take longer, by at most the ceilings' ratio. A GPU without
    a MAMF measurement (RTX 5090) runs its matmuls at the H100's measured fraction of its own peak."""
    def terms(gpu):
        r = estimate_with_time(EstimateRequest(model="llama-3-8b", strategy="zero3", gpus=1, gpu=gpu, seq_len=4096))
        return {t.name: t.seconds for t in r.time.terms}

    h100, h200 = terms("h100-80gb"), terms("h200")
    assert h200["matmul"] < h100["matmul"] <= h200["matmul"] * 744.5 / 703.7 * (1 + 1e-9)
    assert h200["elementwise and loss"] / h100["elementwise and loss"] == pytest.approx(3350 / 4800, rel=1e-9)
    from planner.time.kernels import UNMEASURED_MATMUL_FRACTION, rates

    assert rates(load_gpus()["rtx-5090"], "bf16").matmul_flops == pytest.approx(
        209.5e12 * UNMEASURED_MATMUL_FRACTION, rel=1e-9)
    assert rates(load_gpus()["b300"], "bf16").matmul_flops == 1769.0e12


def test_vendors():
    gpus = load_gpus()
    assert gpus["cpu"].vendor == "none" and gpus["mi300x"].vendor == "amd"
    assert {g.vendor for n, g in gpus.items() if n not in ("cpu", "mi300x")} == {"nvidia"}
