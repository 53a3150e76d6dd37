"""Megatron-LM's command-line arguments for a pipeline layout (issue 25), as Megatron-LM d98e8a6
(2026-08-22) reads them: megatron/training/arguments.py, whose parallel and recompute flags come
from ModelParallelConfig / TransformerConfig fields (ArgumentGroupFactory: a field foo_bar is
--foo-bar).

- ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, ``--context-parallel-size``,
  ``--expert-model-parallel-size``, ``--sequence-parallel`` (model_parallel_config.py).
- Uneven stages: ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``
  (arguments.py; transformer_block.py get_num_layers_to_build: the other stages share the rest
  evenly, which planner/parallel/pipeline.py check_split requires too). With virtual stages Megatron counts
  them per pipeline rank (over its chunks), the planner per stage: not written then.
- ``--num-virtual-stages-per-pipeline-rank`` (interleaved), ``--micro-batch-size``,
  ``--global-batch-size`` (micro-batch x accumulation x data-parallel ranks), ``--seq-length``.
- Data parallelism under a pipeline: Megatron's distributed optimizer (``--use-distributed-optimizer``:
  the optimizer states sharded over the data-parallel ranks, ZeRO-1); its FSDP2 path refuses
  pipelines (arguments.py: "--use-torch-fsdp2 is not supported with pipeline parallelism"), so a
  planner layout that shards parameters has no Megatron twin: the file says which ZeRO stage it is.
- Full recomputation: ``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1`` (every block checkpointed, as the planner's "full").
"""

from __future__ import annotations


def megatron_arguments(*, tp: int, pp: int, cp: int, ep: int, sequence_parallel: bool, virtual_stages: int,
                       first_stage_layers: int | None, last_stage_layers: int | None, micro_batch: int,
                       gradient_accumulation: int, data_parallel: int, seq_len: int, num_layers: int,
                       compute: str, checkpointing: str, shards_optimizer: bool) -> list[str]:
    """The arguments, one flag (with its value) per item."""
    args = [f"--num-layers {num_layers}", f"--tensor-model-parallel-size {tp}",
            f"--pipeline-model-parallel-size {pp}"]
    if virtual_stages > 1:
        args.append(f"--num-virtual-stages-per-pipeline-rank {virtual_stages}")
    elif first_stage_layers is not None or last_stage_layers is not None:
        args += ([f"--decoder-first-pipeline-num-layers {first_stage_layers}"] if first_stage_layers else []) + \
            ([f"--decoder-last-pipeline-num-layers {last_stage_layers}"] if last_stage_layers else [])
    if cp > 1:
        args.append(f"--context-parallel-size {cp}")
    if ep > 1:
        args.append(f"--expert-model-parallel-size {ep}")
    if tp > 1 and sequence_parallel:
        args.append("--sequence-parallel")
    args += [f"--micro-batch-size {micro_batch}",
             f"--global-batch-size {micro_batch * gradient_accumulation * data_parallel}", f"--seq-length {seq_len}"]
    if shards_optimizer and data_parallel > 1:
        args.append("--use-distributed-optimizer")
    if checkpointing == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    if compute in ("bf16", "fp16"):
        args.append(f"--{compute}")
    return args


def megatron_file(args: list[str], note: str) -> str:
    """megatron_args.txt: a comment saying what the arguments are, then one flag per line."""
    return "# " + note + "\n" + " \\\n".join(args) + "\n"
