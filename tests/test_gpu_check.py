"""bench/gpu_check.py's CPU-side logic (it needs a GPU to run; none was lent when it was written):
its sequences simulate as tests/test_allocator.py derived them, the calibration file it writes is
the one planner/memory/reserved.py reads, and a calibrated GPU's terms reach the estimate."""

import math
import json

import pytest

from bench import gpu_check
from planner.errors import PlannerError
from planner.memory import reserved
from planner.memory.orchestrator import estimate
from planner.model.catalogue import catalogue_model
from planner.schema import EstimateRequest

MIB = 2**20


def test_it_imports_and_its_sequences_simulate_as_derived_by_hand():
    sims = {name: gpu_check.simulated(events, "") for name, events in gpu_check.SEQUENCES}
    assert sims["fragmentation"]["simulated_reserved_peak_bytes"] == 170 * MIB
    assert sims["separate streams"]["simulated_reserved_peak_bytes"] == 100 * MIB
    assert sims["medium 20 MiB segments"]["simulated_segments"] == 2
    expandable = gpu_check.simulated(dict(gpu_check.SEQUENCES)["best fit and split"], "expandable_segments:True")
    assert expandable["simulated_segments"] == 1


def test_the_step_events_are_the_ones_the_estimate_replays():
    request = EstimateRequest(model="llama-3-8b", strategy="ddp", gpus=1, gpu="h200", seq_len=1024)
    events = gpu_check.step_events(request)
    assert gpu_check.simulated(events, "")["simulated_reserved_peak_bytes"] == estimate(request).allocator.reserved_peak_bytes


def test_peaks_read_torchs_flat_memory_stats():
    stats = {"allocated_bytes.all.peak": 10, "active_bytes.all.peak": 12, "reserved_bytes.all.peak": 20}
    assert gpu_check.peaks(stats) == {"measured_allocated_peak_bytes": 10, "measured_active_peak_bytes": 12,
                                      "measured_reserved_peak_bytes": 20}


def test_the_calibration_file_is_read_by_the_planner(tmp_path, monkeypatch):
    results = {"device": "NVIDIA H200", "driver": "570.1", "cuda": "12.8",
               "context": {"used_after_first_matmul_bytes": 700 * MIB, "allocated_after_first_matmul_bytes": 2 * MIB,
                           "reserved_after_first_matmul_bytes": 4 * MIB, "module_loading": "LAZY"},
               "nccl_bytes_per_communicator": 300 * MIB,
               "runs": [{"status": "ok", "measured_reserved_peak_bytes": 1}, {"status": "failed"}]}
    path = tmp_path / "allocator_calibration.json"
    path.write_text(json.dumps(gpu_check.calibration(results, "h200", "2.13.0")))
    loaded = reserved.load_calibration(path)
    assert loaded["h200"]["cuda_context_bytes"] == 696 * MIB and len(loaded["h200"]["runs"]) == 1
    monkeypatch.setattr(reserved, "_CALIBRATION", loaded)
    e = estimate(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h200"))
    nvls = 16 * 2 * MIB * 8  # NVLS's buffers on the H200's NVSwitch, beside the measured ring buffers
    assert e.per_device.cuda_context_bytes == 696 * MIB and e.per_device.nccl_bytes == 300 * MIB + nvls
    assert e.allocator.measured
    # NCCL_BUFFSIZE given: the measured default no longer applies, NCCL's constants do
    e = estimate(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h200", nccl_buffsize_bytes=MIB))
    assert e.per_device.nccl_bytes == reserved.nccl_communicator_bytes(MIB) + nvls


def test_a_file_of_another_format_is_ignored(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": 2, "gpus": {"h200": {}}}))
    assert reserved.load_calibration(path) == {} and reserved.load_calibration(tmp_path / "absent.json") == {}


def test_every_grid_run_is_a_request_the_planner_answers_on_the_gpu():
    """What main() launches on the device: each grid row under both allocator settings, every one
    estimated (with its allocator replay) before any GPU is touched; the int8 rows are CUDA's
    MatMul8bitLt, which the CPU runs cannot measure."""
    config = dict(catalogue_model("llama-3-8b").config, num_hidden_layers=2)
    runs = gpu_check.grid_requests(config, "h200")
    assert len(runs) == 2 * (2 * len(gpu_check.GRID) + len(gpu_check.RECIPE_GRID))
    assert {conf for *_, conf, _ in runs} == set(gpu_check.ALLOC_CONFS)
    int8 = [r for *_, r in runs if r.quantize_base == "int8"]
    assert int8 and all(r.strategy == "single" for r in int8)
    for strategy, row, conf, request in runs:
        if request.low_precision in ("mxfp8", "nvfp4"):  # block-scaled fp8/fp4: Blackwell only; main() skips it
            with pytest.raises(PlannerError) as refused:
                estimate(request)
            assert refused.value.field == "low_precision" and "h200" in str(refused.value).lower()
            continue
        result = estimate(request)
        assert result.allocator is not None and result.allocator.alloc_conf == conf
        assert result.per_device.peak_bytes < result.device_capacity_bytes, (strategy, row)
def test_the_activation_offload_rows_are_estimated_with_their_split():
    """The offloading rows (the device side the CPU runs cannot see) estimate with host bytes and a
    host-link term on the GPU the check runs on."""
    from planner.memory.orchestrator import activation_offload_bytes, setup_of
    from planner.time.step import estimate_with_time

    rows = [(seq, micro, fields) for seq, micro, fields in gpu_check.RECIPE_GRID if fields.get("activation_offload")]
    assert len(rows) == 2
    config = dict(gpu_check.catalogue_model("llama-3-8b").config, num_hidden_layers=2)
    for seq, micro, fields in rows:
        request = EstimateRequest(model_config=config, strategy="single", gpus=1, gpu="h200", precision="bf16-mixed",
                                  micro_batch=micro, seq_len=seq, **fields)
        result = estimate(request)
        assert activation_offload_bytes(setup_of(result)) > 0 and result.host.pinned_bytes > 0
        assert estimate_with_time(request).time.offload_seconds > 0


def test_the_calibrations_replay_shortfall_is_the_current_models_and_every_gpu_estimate_holds_it_back():
    """planner/data/allocator_calibration.json's replay_shortfall is what bench/gpu_report.py computes
    from the measured runs under today's model (a change to the replayed stream must rewrite it:
    `python bench/gpu_report.py --calibration planner/data/allocator_calibration.json`), and a GPU
    estimate's reserved peak is the replay's plus that fraction of it, plus context and NCCL."""
    import json

    from bench import gpu_report
    from planner.memory import reserved
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    shipped = json.loads(reserved.CALIBRATION_PATH.read_text())["replay_shortfall"]
    assert shipped == gpu_report.replay_shortfall(gpu_report.load(gpu_report.DEFAULT_RESULTS))
    assert shipped["fraction"] == reserved.REPLAY_SHORTFALL > 0
    e = estimate(EstimateRequest(model="llama-3.2-1b", gpu="h100-80gb", gpus=8, strategy="fsdp", seq_len=2048))
    a, d = e.allocator, e.per_device
    assert a.replay_shortfall_bytes == math.ceil(reserved.REPLAY_SHORTFALL * a.reserved_peak_bytes)
    assert d.reserved_peak_bytes == a.reserved_peak_bytes + a.replay_shortfall_bytes + d.cuda_context_bytes + d.nccl_bytes
