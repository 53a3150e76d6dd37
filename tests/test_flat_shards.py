"""FSDP1's flat shards and the original parameters a rank's optimizer steps (planner/time/flat_shards.py)."""

import pytest

from planner.model.architecture import block_numels, from_hf_config, parameter_numels
from planner.schema import EstimateRequest
from planner.time import flat_shards
from planner.time.step import estimate_with_time

GPT2_350M = {"model_type": "gpt2", "n_embd": 1024, "n_head": 16, "n_layer": 24, "n_inner": 4096, "n_positions": 2048,
             "vocab_size": 50368, "tie_word_embeddings": True, "activation_function": "gelu"}


@pytest.mark.parametrize("numels,world,align,counts", [
    ([6, 2], 4, 1, [1, 1, 1, 1]),  # chunks of 2: the first parameter over three ranks, the second alone
    ([1, 1, 6], 2, 1, [3, 1]),  # the small parameters and the large one's start share the first chunk
    ([4, 4], 3, 1, [1, 2, 1]),  # chunks of ceil(8 / 3) = 3
    ([3], 4, 1, [1, 1, 1, 0]),  # torch.chunk: fewer chunks than ranks, the last rank empty
    ([1, 4], 2, 4, [1, 1]),  # the second parameter aligned to 4: [0, 1) and [4, 8) in chunks of 4
    ([5, 0, 3], 1, 1, [2]),  # one rank steps every non-empty parameter
])
def test_each_rank_meets_the_parameters_its_chunk_overlaps(numels, world, align, counts):
    assert flat_shards.per_rank(numels, world, align) == counts


def test_one_rank_steps_every_parameter_and_more_ranks_step_fewer():
    a = from_hf_config(GPT2_350M)
    every = len(parameter_numels(a))
    assert flat_shards.stepped_tensors(a, 1, 2) == every
    stepped = [flat_shards.stepped_tensors(a, n, 2) for n in (2, 8, 128, 512)]
    assert all(s < every for s in stepped) and stepped == sorted(stepped, reverse=True)
    # at least one parameter per unit (24 blocks and the root) on the busiest rank
    assert stepped[-1] >= 25
    # the root and the blocks hold every parameter once
    assert sum(flat_shards.root_numels(a)) + sum(sum(b) for b in block_numels(a)) == sum(parameter_numels(a))


def _optimizer_seconds(fsdp_version: int, nodes: int) -> float:
    request = EstimateRequest(model_config=GPT2_350M, gpu="a100-40gb", gpus=8, nodes=nodes, strategy="fsdp",
                              seq_len=2048, micro_batch=8, precision="bf16-mixed", optimizer="adamw-single-tensor",
                              fsdp_version=fsdp_version)
    return {t.name: t.seconds for t in estimate_with_time(request).time.terms}["optimizer step"]


def test_fsdp1_launches_the_single_tensor_step_for_the_parameters_its_shard_meets():
    # the 350M's shard on 128 GPUs is small: its single-tensor AdamW is host-bound, one launch set per tensor
    fsdp2, fsdp1 = _optimizer_seconds(2, 16), _optimizer_seconds(1, 16)
    a = from_hf_config(GPT2_350M)
    ratio = flat_shards.stepped_tensors(a, 128, 2) / len(parameter_numels(a))
    assert fsdp1 == pytest.approx(fsdp2 * ratio)
