"""`--emit` of a pipeline layout: torchtitan's pipeline fields (the planner's stages listed, so the
virtual stages and the split are the predicted ones) and DeepSpeed's pipeline engine (what its
config carries, what it needs in code). Issue 12, "Emit and verify"."""

import json
import tomllib

import pytest

from cli.main import main
from planner.plan.emit import Script, emit_estimate_files
from planner.errors import PlannerError
from planner.parallel.pipeline import stage_bounds
from planner.plan.search import estimate_with_time
from planner.schema import EstimateRequest
from tests.real_runs import LLAMA, QWEN2


def _files(script=None, **fields):
    return emit_estimate_files(estimate_with_time(EstimateRequest(**fields)), script)


def test_torchtitan_toml_carries_the_pipeline_and_its_stages():
    files = _files(model="llama-3.1-8b", strategy="fsdp", gpu="h100-80gb", gpus=8, pp=2, tp=2, micro_batch=1,
                   gradient_accumulation=8, pp_schedule="interleaved", pp_virtual_stages=2)
    config = tomllib.loads(files["torchtitan.toml"])
    p, t = config["parallelism"], config["training"]
    assert (p["pipeline_parallel_degree"], p["pipeline_parallel_schedule"], p["pipeline_parallel_microbatch_size"]) \
        == (2, "Interleaved1F1B", 1)
    # the degrees multiply to the world (the data-parallel ones were read from a shard group that
    # spans the pipeline's ranks: replicate 0 x shard 4, global batch 0)
    assert (p["data_parallel_replicate_degree"], p["data_parallel_shard_degree"], p["tensor_parallel_degree"]) == (1, 2, 2)
    assert t["local_batch_size"] == 8 and t["global_batch_size"] == 1 * 8 * 2
    # 2 virtual stages per rank: 4 stages, the planner's split, embedding first, norm and head last
    parts = p["module_fqns_per_model_part"]
    assert len(parts) == 4
    assert [[int(n.split(".")[1]) for n in part if n.startswith("layers.")] for part in parts] == \
        [list(range(a, b)) for a, b in stage_bounds(32, 4)]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    guide = files["LAUNCH.md"]
    assert "--job.config_file torchtitan.toml" in guide
    assert "--parallelism.pipeline_parallel_degree 2" in guide and "--parallelism.pipeline_parallel_schedule " \
        "Interleaved1F1B" in guide and "--training.local_batch_size 8" in guide
    assert '"norm", "lm_head"]]' in guide  # torchtitan 0.3 names the head lm_head


def test_the_split_is_the_planners_where_torchtitans_default_differs():
    # 5 blocks over 2 stages: the planner (stage_bounds) puts 2 then 3; torchtitan's own split,
    # weighing the embedding and the head as one layer each, would put 3 then 2
    files = _files(model_config=dict(LLAMA, num_hidden_layers=5), strategy="fsdp", gpu="cpu", gpus=2, pp=2,
                   micro_batch=1, seq_len=128, gradient_accumulation=4, precision="fp32")
    parts = tomllib.loads(files["torchtitan.toml"])["parallelism"]["module_fqns_per_model_part"]
    assert parts == [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "layers.4", "norm", "output"]]
    assert "launch.sh" in files  # the planner's trainer runs torch pipelines (planner verify)


def test_a_tied_model_is_told_to_untie_for_torchtitans_pipeline():
    files = _files(model_config=QWEN2, strategy="fsdp", gpu="cpu", gpus=2, pp=2, micro_batch=1, seq_len=128,
                   gradient_accumulation=4, precision="fp32")
    assert "Weight tying is not supported with Pipeline Parallel" in files["LAUNCH.md"]
    assert "Weight tying" not in _files(model_config=LLAMA, strategy="fsdp", gpu="cpu", gpus=2, pp=2, micro_batch=1,
                                        seq_len=128, gradient_accumulation=4, precision="fp32")["LAUNCH.md"]


def test_deepspeed_pipeline_config_and_what_it_needs_in_code():
    fields = dict(model="llama-3.1-8b", strategy="zero1", gpu="h100-80gb", gpus=8, pp=2, micro_batch=2,
                  gradient_accumulation=8, checkpointing="full")
    files = _files(**fields)
    config = json.loads(files["ds_config.json"])
    # PipelineEngine asserts train_batch_size == micro * micro-batches * the data-parallel size of its grid
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 8)
    assert config["train_batch_size"] == 2 * 8 * 4
    assert config["pipeline"] == {"activation_checkpoint_interval": 1}
    # accelerate and the Trainer cannot drive a PipelineModule, and the planner's trainer does not build one
    assert not {"accelerate_config.yaml", "trainer_args.json", "launch.sh", "job.sbatch"} & set(files)
    guide = files["LAUNCH.md"]
    assert "PipelineModule(layers=layers, num_stages=2" in guide and "engine.train_batch(" in guide
    assert "activation_checkpoint_interval=1" in guide
    scripted = _files(Script.parse("train.py --steps 5"), **fields)
    assert "launch.sh" in scripted and "job.sbatch" in scripted
    assert json.loads(_files(**(fields | {"checkpointing": "none"}))["ds_config.json"])["pipeline"] == {
        "activation_checkpoint_interval": 0}


def test_deepspeed_pipeline_with_autotp_is_refused_with_the_reason():
    with pytest.raises(PlannerError, match=r"^pp=2 with tp=2 under strategy zero1: DeepSpeed's pipeline engine") as e:
        _files(model="llama-3.1-8b", strategy="zero1", gpu="h100-80gb", gpus=8, pp=2, tp=2, micro_batch=1,
               gradient_accumulation=8)
    assert e.value.field == "tp"


def test_cli_emit_writes_the_pipeline_files(tmp_path, capsys):
    code = main(["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--gpus", "8", "--pp", "4",
                 "--gradient-accumulation", "8", "--emit", str(tmp_path)])
    assert code == 0
    p = tomllib.loads((tmp_path / "torchtitan.toml").read_text())["parallelism"]
    assert p["pipeline_parallel_degree"] == 4 and p["pipeline_parallel_schedule"] == "1F1B"
    assert p["data_parallel_shard_degree"] * p["data_parallel_replicate_degree"] == 2
    assert len(p["module_fqns_per_model_part"]) == 4


def test_uneven_split_is_emitted_for_torchtitan_and_megatron(tmp_path):
    """The Llama 3 405B layout (TP8 x PP16, 7/8x14/7 blocks): torchtitan's stage lists carry the
    split, Megatron's arguments name it (--decoder-first/last-pipeline-num-layers, d98e8a6)."""
    import tomllib

    from planner.plan.emit import emit_estimate_files
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    req = EstimateRequest(model="llama-3.1-405b", gpu="h100-80gb", gpus=8, nodes=128, strategy="fsdp", tp=8, pp=16,
                          pp_first_stage_layers=7, pp_last_stage_layers=7, gradient_accumulation=16, seq_len=8192,
                          checkpointing="full")
    files = emit_estimate_files(estimate(req))
    parts = tomllib.loads(files["torchtitan.toml"])["parallelism"]["module_fqns_per_model_part"]
    assert [sum(1 for n in p if n.startswith("layers.")) for p in parts] == [7] + [8] * 14 + [7]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]
    args = files["megatron_args.txt"]
    for flag in ("--tensor-model-parallel-size 8", "--pipeline-model-parallel-size 16",
                 "--decoder-first-pipeline-num-layers 7", "--decoder-last-pipeline-num-layers 7",
                 "--micro-batch-size 1", "--global-batch-size 128", "--use-distributed-optimizer"):
        assert flag in args
    assert "ZeRO-1" in args.splitlines()[0]  # FSDP has no Megatron twin under a pipeline
    plain = emit_estimate_files(estimate(EstimateRequest(model="llama-3.1-8b", gpu="h100-80gb", gpus=8,
                                                         strategy="fsdp", tp=2)))
    assert "megatron_args.txt" not in plain  # pipeline layouts only


@pytest.mark.parametrize("schedule,name", [("zbv", "ZBVZeroBubble"), ("interleaved-zb", "InterleavedZeroBubble"),
                                           ("dualpipev", "DualPipeV"), ("looped-bfs", "LoopedBFS")])
def test_zero_bubble_and_looped_schedules_are_emitted_by_torchtitans_name(schedule, name):
    # issue 25: torchtitan takes torch's schedule names (schedules.py get_schedule_class); Megatron-LM
    # has no such schedule: its arguments say which one they run instead, and why the peak differs
    files = _files(model="llama-3.1-8b", strategy="fsdp", gpu="h100-80gb", gpus=8, pp=2, tp=2, micro_batch=1,
                   gradient_accumulation=8, pp_schedule=schedule, pp_virtual_stages=2)
    p = tomllib.loads(files["torchtitan.toml"])["parallelism"]
    assert p["pipeline_parallel_schedule"] == name and len(p["module_fqns_per_model_part"]) == 4
    assert f"Megatron-LM has no schedule like torch's Schedule{name} (pp_schedule {schedule}): these arguments run " \
           "its interleaved 1F1B instead" in files["megatron_args.txt"]
    assert "--num-virtual-stages-per-pipeline-rank 2" in files["megatron_args.txt"]


def test_torchtitan_toml_with_a_zero_bubble_schedule_reads_back():
    from pathlib import Path

    from planner.jobfiles.job import read_job

    # torchtitan's llama3_8b.toml with a ZBV pipeline: without pipeline_parallel_layers_per_stage
    # torchtitan runs a multi-stage schedule at 2 stages per rank (pipeline_parallel.py b5bcd76)
    text = (Path(__file__).parent / "fixtures" / "jobfiles" / "torchtitan" / "llama3_8b.toml").read_text()
    text = text.replace("local_batch_size = 1", "local_batch_size = 4").replace(
        "pipeline_parallel_degree = 1", 'pipeline_parallel_degree = 2\npipeline_parallel_schedule = "ZBVZeroBubble"\n'
        "pipeline_parallel_microbatch_size = 1")
    fields = read_job([("llama3_8b.toml", text)], 8).fields
    assert (fields["pp_schedule"], fields["pp_virtual_stages"], fields["gradient_accumulation"]) == ("zbv", 2, 4)


def test_split_backward_schedules_refuse_what_they_do_not_model():
    from planner.memory.orchestrator import estimate
    from tests.real_runs import QWEN3_MOE

    with pytest.raises(PlannerError, match=r"pp_schedule zbv splits the backward into input and weight gradients; "
                                           r"the split's held gradients are modelled for dense blocks") as e:
        estimate(EstimateRequest(model_config=QWEN3_MOE, strategy="fsdp", gpu="cpu", gpus=2, pp=2, micro_batch=1,
                                 seq_len=128, gradient_accumulation=4, precision="fp32", pp_schedule="zbv",
                                 pp_virtual_stages=2))
    assert e.value.field == "pp_schedule"
