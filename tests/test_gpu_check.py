"""bench/gpu_check.py's CPU-side logic (it needs a GPU to run; none was lent when it was written):
its sequences simulate as tests/test_allocator.py derived them, the calibration file it writes is
the one planner/memory/reserved.py reads, and a calibrated GPU's terms reach the estimate."""

import json

from bench import gpu_check
from planner.memory import reserved
from planner.memory.orchestrator import estimate
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
               "context": {"used_after_first_matmul_bytes": 700 * MIB, "allocated_after_first_matmul_bytes": 4 * MIB},
               "nccl_bytes_per_communicator": 300 * MIB,
               "runs": [{"status": "ok", "measured_reserved_peak_bytes": 1}, {"status": "failed"}]}
    path = tmp_path / "allocator_calibration.json"
    path.write_text(json.dumps(gpu_check.calibration(results, "h200", "2.13.0")))
    loaded = reserved.load_calibration(path)
    assert loaded["h200"]["cuda_context_bytes"] == 696 * MIB and len(loaded["h200"]["runs"]) == 1
    monkeypatch.setattr(reserved, "_CALIBRATION", loaded)
    e = estimate(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h200"))
    assert e.per_device.cuda_context_bytes == 696 * MIB and e.per_device.nccl_bytes == 300 * MIB
    assert e.allocator.measured
    # NCCL_BUFFSIZE given: the measured default no longer applies, NCCL's constants do
    e = estimate(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h200", nccl_buffsize_bytes=MIB))
    assert e.per_device.nccl_bytes == reserved.nccl_communicator_bytes(MIB)


def test_a_file_of_another_format_is_ignored(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"format": 2, "gpus": {"h200": {}}}))
    assert reserved.load_calibration(path) == {} and reserved.load_calibration(tmp_path / "absent.json") == {}
