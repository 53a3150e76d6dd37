"""The evidence behind modelling torch's Muon under FSDP2 (planner/recipes/optimizers.py
_muon_dtensor_temporaries, _muon_dtensor_collectives): on two CPU ranks torch 2.13's Muon steps FSDP2's
DTensor shards and DTensor's redistributions inside _zeropower_via_newtonschulz make the update the whole
matrix's, not each shard's, through the collectives the model charges. Rounding is taken out of the
comparison by running torch's iteration in fp64 instead of bf16."""

from __future__ import annotations

import pytest

from planner.model.shapes import TensorShape
from planner.recipes.optimizers import OPTIMIZERS
from tests.ports import free_port

SHAPES = ((96, 64), (48, 96))  # rows > columns (transposed inside the iteration) and rows <= columns


def _newton_schulz_fp64(grad, coefficients, steps, eps):
    """torch 2.13 optim/_muon.py _zeropower_via_newtonschulz with the iterate in fp64, not bf16."""
    import torch

    a, b, c = coefficients
    x = grad.double()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist
    import torch.optim._muon as muon
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    muon._zeropower_via_newtonschulz = _newton_schulz_fp64
    torch.set_default_dtype(torch.float64)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        def build():
            torch.manual_seed(0)
            return torch.nn.Sequential(*(torch.nn.Linear(n, m, bias=False) for m, n in SHAPES))

        x = torch.randn(8, SHAPES[0][1], generator=torch.Generator().manual_seed(1))
        whole = build()
        before = [p.detach().clone() for p in whole.parameters()]
        whole(x).square().sum().backward()
        grads = [p.grad.detach().clone() for p in whole.parameters()]
        torch.optim.Muon(list(whole.parameters()), lr=0.1).step()
        sharded = build()
        for layer in sharded:
            fully_shard(layer)
        fully_shard(sharded)
        sharded(x).square().sum().backward()
        optimizer = torch.optim.Muon(list(sharded.parameters()), lr=0.1)
        comms = CommDebugMode()
        with comms:
            optimizer.step()
        out = []
        for p, q, p0, g in zip(sharded.parameters(), whole.parameters(), before, grads):
            step_sharded, step_whole = p.full_tensor() - p0, q.detach() - p0
            # the first step's Nesterov update from a zero buffer (momentum 0.95), each shard apart
            update = g.lerp(0.05 * g, 0.95)
            lr = muon._adjust_lr(0.1, None, g.shape)
            shard_local = -lr * torch.cat([_newton_schulz_fp64(s, (muon.DEFAULT_A, muon.DEFAULT_B, muon.DEFAULT_C),
                                                               5, 1e-7) for s in update.chunk(world, dim=0)])
            out.append((((step_sharded - step_whole).norm() / step_whole.norm()).item(),
                        ((step_sharded - shard_local).norm() / shard_local.norm()).item()))
        results[rank] = (out, {str(k).split(".")[-1]: v for k, v in comms.get_comm_counts().items()})
    finally:
        dist.destroy_process_group()


def _rank_zeros_result(rank_fn, *args):
    """Run rank_fn(rank, world, port, *args, results) on 2 spawned ranks over a free local port; rank 0's entry."""
    import torch.multiprocessing as mp

    port = free_port()
    results = mp.Manager().dict()
    mp.spawn(rank_fn, args=(2, port, *args, results), nprocs=2, join=True)
    return results[0]


@pytest.mark.deepspeed
def test_torchs_muon_on_fsdp2_shards_orthogonalises_whole_matrices_through_dtensor_collectives():
    pytest.importorskip("torch")
    errors, comms = _rank_zeros_result(_rank)
    for to_whole, to_shard_local in errors:
        assert to_whole < 1e-9  # the whole matrix's update
        assert to_shard_local > 0.2  # not Newton-Schulz on each shard
    # the collectives inside the iteration (_muon_dtensor_collectives, and the norm's all-reduce): the
    # 48x96 matrix (rows <= columns) 3 all-gathers per iteration (X.T, the Gram, X) and the norm's
    # all-reduce; the 96x64 one (rows > columns, a Partial Gram) 2 all-reduces per iteration and the norm's
    assert comms.get("all_gather_into_tensor", 0) == 3 * 5 and comms.get("all_reduce", 0) == 1 + 2 * 5 + 1
    modelled = [what for m, n in SHAPES for what, _, _ in
                OPTIMIZERS["muon"].dtensor_collectives(TensorShape((m // 2, n)), 2)]
    assert sum("all-gather" in w for w in modelled) == 15 and sum("all-reduce" in w for w in modelled) == 10


def _deepspeed_rank(rank: int, world: int, port: int, stage: int, results) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(n, m, bias=False) for m, n in SHAPES))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
              "zero_allow_untested_optimizer": True}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.Muon(list(model.parameters())),
                                                   config=config)
    stepped = [tuple(p.shape) for g in optimizer.optimizer.param_groups for p in g["params"]]
    engine.backward(engine(torch.randn(4, SHAPES[0][1])).square().sum())
    try:
        engine.step()
        results[rank] = (stepped, "")
    except ValueError as exc:
        results[rank] = (stepped, str(exc))


@pytest.mark.deepspeed
def test_deepspeed_hands_a_client_muon_flat_partitions_it_refuses():
    """ZeRO-2 (as ZeRO-1 and 3, checked by hand): the flat fp32 partition, one 1-D tensor per rank."""
    pytest.importorskip("deepspeed")
    stepped, error = _rank_zeros_result(_deepspeed_rank, 2)
    assert stepped == [(sum(m * n for m, n in SHAPES) // 2,)] and error == "Param gradient must be a 2D matrix"
