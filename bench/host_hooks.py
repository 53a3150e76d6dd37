"""What a framework's own Python costs the host per training step, in eager kernel launches.

    python bench/host_hooks.py [--steps 40] [--rounds 5] [--write planner/data/host_hooks.json] [--readme README.md]
    python bench/host_hooks.py --from-record planner/data/host_hooks.json --readme README.md

The time model charges the host HOST_SECONDS_PER_KERNEL per eager kernel (planner/time/kernels.py)
and exposes it where a micro-batch's kernels are shorter than their launches. The frameworks add
Python of their own on every step: DeepSpeed ZeRO-3 runs a pre- and post-forward hook on every
nn.Module (deepspeed/runtime/zero/parameter_offload.py _register_deepspeed_module and
partitioned_param_coordinator.py fetch_sub_module / release_sub_module, which fetch, wait for and
release the module's parameters) and the same pair again in backward; ZeRO-1/2 run a Python hook on
every parameter's gradient (stage_1_and_2.py create_gradient_handling_hooks, each calling reduce_ready_partitions_and_remove_grads); FSDP2 runs its
pre/post forward and backward hooks once per fully_shard unit (torch/distributed/fsdp/_fully_shard/
_fsdp_state.py); DDP's reducer hooks are C++.

Measured here on CPU ranks over gloo (two for DeepSpeed, one for FSDP2: WORLD), the seconds inside the
c10d collectives taken out (on a GPU those are NCCL launches, their transfers on another stream): a Llama of L decoder blocks whose tensors
are tiny (hidden 32), so every step is host time. Each framework's step is timed at two depths and
the difference per block, over torch's eager step of the same blocks, is the framework's Python per
block, forward and backward (the optimizer step is untimed: the time model has its own term for it). Each
rank steps the framework's models and torch's in turn, at both depths, so a load on the host falls on all
of them alike. The eager step's own cost per block divided by
the aten ops it dispatches per block (counted with a TorchDispatchMode) is this host's time per
eager op; the framework's cost is written in those ops, so the GPU host's speed, which the model
sets at HOST_SECONDS_PER_KERNEL per op, carries it over (the ratio, not this VM's microseconds, is
what planner/data/host_hooks.json keeps). What a GPU adds to a hook (its streams and events, the NCCL
launches) is not in it: a lower bound, said in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# FSDP1 is not among them: torch 2.13's FullyShardedDataParallel refuses CPU ranks ("FSDP needs a non-CPU
# accelerator device"), so the time model charges it FSDP2's figure per unit, and says so
ARMS = ("zero1", "zero2", "zero3", "fsdp2")
# ranks per framework: DeepSpeed skips the gathers of a world of one, so its arms run two ranks and take the
# sharded path; FSDP2 takes its whole path on one rank too (it gathers and reduce-scatters a world of one), and on
# two its asynchronous gloo transfers run on CPU threads beside the hooks, as no GPU host's do
WORLD = {"zero1": 2, "zero2": 2, "zero3": 2, "fsdp2": 1}
DEPTHS = (2, 26)
# the c10d collectives a framework calls: the time inside them is taken out (on a GPU each is an NCCL
# launch, its transfer on the communication stream; gloo's copies here are CPU work no GPU host does)
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather", "broadcast",
               "_all_gather_base", "_reduce_scatter_base", "reduce_scatter", "all_to_all_single", "barrier")
# nn.Modules of one transformers Llama decoder block (the module, its attention and MLP, four attention
# projections, three MLP projections, the activation, two RMSNorms) and its parameters (seven weights, two norms)
BLOCK_MODULES = 13
BLOCK_PARAMETERS = 9
# what each framework's Python runs once for: ZeRO-3 hooks every module, ZeRO-1/2 every parameter's
# gradient, FSDP2 every fully_shard unit (a block); the per-count figure is the block's over its count
# (a negative difference, the noise of a framework with no hook in that pass, counts as none)
PER = {"zero1": "parameter", "zero2": "parameter", "zero3": "module", "fsdp2": "unit"}
PER_BLOCK = {"module": BLOCK_MODULES, "parameter": BLOCK_PARAMETERS, "unit": 1}


def _worker(arm: str, steps: int, device: str = "cpu") -> dict:
    """One framework on this rank (RANK, WORLD_SIZE, MASTER_PORT from the parent), beside torch's eager
    step, at both DEPTHS: four models stepped in turn, so a load on the host falls on all four alike.
    Each pass is timed by the wall clock (the framework's work on other threads, autograd's and its
    own, counts), the time inside the collectives taken out; the medians over ``steps``. The optimizer
    step runs untimed (its host cost is the time model's optimizer term). ``device`` cuda: one GPU over
    NCCL (bench/gpu_check.py), the host timed as it launches, never waiting for the GPU."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": os.environ["RANK"]})
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    inside = _time_collectives(dist, waits=arm == "fsdp2" and device == "cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if device == "cpu" else "nccl")
    runs = {(kind, layers): _passes(kind, layers, device) for kind in ("torch", arm) for layers in DEPTHS}
    out = {key: {"forward": [], "backward": []} for key in runs}
    for k in range(steps + 10):
        for key, (forward, backward, step) in runs.items():
            inside[0] = 0.0
            start = time.perf_counter()
            loss = forward()
            middle, in_forward = time.perf_counter(), inside[0]
            backward(loss)
            end = time.perf_counter()
            step()
            if k >= 10:
                out[key]["forward"].append(middle - start - in_forward)
                out[key]["backward"].append(end - middle - (inside[0] - in_forward))
    span = DEPTHS[1] - DEPTHS[0]
    result = {f"{kind}_{part}": (statistics.median(out[(kind, DEPTHS[1])][part])
                                 - statistics.median(out[(kind, DEPTHS[0])][part])) / span
              for kind in ("torch", arm) for part in ("forward", "backward")}
    counts = {layers: _ops(runs[("torch", layers)][0]) for layers in DEPTHS}
    result |= {f"{part}_ops": (counts[DEPTHS[1]][part] - counts[DEPTHS[0]][part]) / span
               for part in ("forward", "backward")}
    dist.destroy_process_group()
    return result


def _passes(kind: str, layers: int, device: str = "cpu"):
    """(forward, backward, step) of a Llama of ``layers`` tiny blocks on ``device`` under ``kind``: torch's
    eager module and AdamW, a DeepSpeed ZeRO engine, or FSDP2 with a unit per block."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                         num_hidden_layers=layers, vocab_size=64, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    x = torch.randint(0, 64, (1, 16), device=device)
    if kind.startswith("zero"):
        import deepspeed

        ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": int(kind[4:])},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
        return (lambda: engine(input_ids=x, labels=x).loss), engine.backward, engine.step
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return (lambda: model(input_ids=x, labels=x).loss), (lambda loss: loss.backward()), step


def _ops(forward) -> dict:
    """The aten ops one forward and one backward of a torch model dispatch (a TorchDispatchMode counts them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as fwd:
        loss = forward()
    with Count() as bwd:
        loss.backward()
    return {"forward": fwd.n, "backward": bwd.n}


def _time_collectives(dist, waits: bool) -> list[float]:
    """Wrap the c10d collectives (both names, the module's and torch.distributed's) and, ``waits``, the
    asynchronous ones' wait, so the seconds spent inside them add up in the returned one-element list."""
    import functools

    import torch.distributed.distributed_c10d as c10d

    inside = [0.0]

    def wrapped(f):
        @functools.wraps(f)
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                inside[0] += time.perf_counter() - start
        return call

    for name in COLLECTIVES:
        for module in (c10d, dist):
            if hasattr(module, name):
                setattr(module, name, wrapped(getattr(module, name)))
    # an asynchronous collective's wait (FSDP2 issues its all-gathers and reduce-scatters async_op=True and
    # waits later): on gloo the host blocks there until the CPU has done the transfer, on a GPU the wait
    # only orders the streams
    # (DeepSpeed's own handles do not take a wrapped wait: its ranks abort; its collectives are synchronous)
    if waits:
        import torch

        work = torch._C._distributed_c10d.Work
        work.wait = wrapped(work.wait)
    return inside


def _run(arm: str, steps: int, port: int, device: str = "cpu") -> dict:
    """The framework (and torch beside it) on its WORLD ranks (one on a GPU), each its own process; rank 0's
    figures."""
    world = WORLD[arm] if device == "cpu" else 1
    command = [sys.executable, __file__, "--worker", arm, "--steps", str(steps), "--device", device]
    ranks = [subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(ROOT), "MASTER_PORT": str(port),
                                            "RANK": str(rank), "WORLD_SIZE": str(world)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    try:
        outputs = [rank.communicate(timeout=1800) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    failed = [(k, err) for k, (rank, (_, err)) in enumerate(zip(ranks, outputs)) if rank.returncode]
    if failed:
        raise SystemExit(f"{arm}: rank {failed[0][0]} failed: {failed[0][1].strip().splitlines()[-1:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def measure(steps: int, rounds: int, device: str = "cpu", arms: tuple[str, ...] = ARMS) -> dict:
    """Per block, each framework's forward and backward over torch's eager step of the same blocks, in
    this host's eager ops: each round runs every framework once (beside its own torch models), and the
    median over rounds is kept."""
    per_round = [{arm: _run(arm, steps, 29561 + 3 * i, device) for i, arm in enumerate(arms)} for _ in range(rounds)]

    def median(f):
        return statistics.median(f(r) for r in per_round)

    ops = {part: per_round[0][arms[0]][f"{part}_ops"] for part in ("forward", "backward")}
    # this host's seconds per eager op: the eager block's forward over the ops it dispatches
    op_seconds = median(lambda r: statistics.median(r[arm]["torch_forward"] for arm in arms)) / ops["forward"]
    frameworks = {}
    for arm in arms:
        def rounds_of(part, arm=arm):  # each round's figure, in that round's own eager ops
            return [(r[arm][f"{arm}_{part}"] - r[arm][f"torch_{part}"]) / (r[arm]["torch_forward"] / ops["forward"])
                    for r in per_round]
        extra = {part: statistics.median(rounds_of(part)) for part in ("forward", "backward")}
        per = PER[arm]
        frameworks[arm] = {f"{part}_ops_per_block": round(extra[part], 1) for part in extra} | {
            "per": per, **{f"{part}_ops_per_{per}": round(max(0.0, extra[part]) / PER_BLOCK[per], 2)
                           for part in extra},
            # the rounds' spread: what one measurement of this noisy host is worth
            **{f"{part}_rounds": [round(x, 1) for x in rounds_of(part)] for part in extra}}
    ranks = "CPU ranks over gloo (DeepSpeed on 2, FSDP2 on 1)" if device == "cpu" else "one GPU over NCCL"
    return {"source": (f"bench/host_hooks.py: {ranks}, a Llama "
                       f"of hidden 32 at {DEPTHS[0]} and "
                       f"{DEPTHS[1]} blocks stepped in turn with torch's, wall-clock less the collectives', "
                       f"the median over {rounds} rounds of the median of {steps} steps"),
            "block_modules": BLOCK_MODULES, "block_parameters": BLOCK_PARAMETERS,
            "eager_ops_per_block": ops, "host_seconds_per_eager_op": op_seconds,
            "frameworks": frameworks}


def _with_spread(figures: dict, part: str) -> str:
    """The median per block, and the rounds' least and greatest where the record keeps them."""
    rounds = figures.get(f"{part}_rounds")
    spread = f" ({min(rounds):g} to {max(rounds):g})" if rounds and len(rounds) > 1 else ""
    return f"{figures[f'{part}_ops_per_block']:g}{spread}"


def report(data: dict) -> str:
    lines = ["| framework | forward, eager ops per block (rounds) | backward, eager ops per block (rounds) | charged per | "
             "forward + backward ops each | at 10 µs per op: ms per block |", "| --- | ---: | ---: | --- | ---: | ---: |"]
    for arm, v in data["frameworks"].items():
        per = v["per"]
        ms = (v["forward_ops_per_block"] + v["backward_ops_per_block"]) * 10e-3
        lines.append(f"| {arm} | {_with_spread(v, 'forward')} | {_with_spread(v, 'backward')} | {per} | "
                     f"{v[f'forward_ops_per_{per}']:g} + {v[f'backward_ops_per_{per}']:g} | {ms:.2f} |")
    ops = data["eager_ops_per_block"]
    return ("\n".join(lines) + "\n\n"
            f"Measured by `python bench/host_hooks.py` ({data['source']}): a block's eager forward dispatches "
            f"{ops['forward']:g} aten ops and its backward {ops['backward']:g}; this host ran "
            f"{data['host_seconds_per_eager_op'] * 1e6:.1f} µs per eager op (CPU tensors of 32 features), so each "
            "framework's own Python per block is written in eager ops, and the time model charges it at "
            "HOST_SECONDS_PER_KERNEL per op on the GPU's host (a lower bound: a GPU's hook also records "
            "events, waits on streams and launches the gathers).")


def publish_record(path: Path, readme: str | None) -> int:
    """The README block from a record --write made; 2 and one line where it is missing or not one."""
    from bench.readme import publish

    try:
        data = json.loads(path.read_text())
        text = report(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"--from-record {path}: not a record of bench/host_hooks.py ({exc})", file=sys.stderr)
        return 2
    return publish(text, readme, "host-hooks")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", metavar="ARM", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU over NCCL (bench/gpu_check.py); the record's figures stay CPU ranks'")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", help="write the measurement (JSON) to this path")
    parser.add_argument("--readme", help="replace the host-hooks block of this README")
    parser.add_argument("--from-record", metavar="JSON", help="report a measurement written by --write (no new runs)")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.worker, args.steps, args.device)))
        return 0
    if args.from_record:
        return publish_record(Path(args.from_record), args.readme)
    data = measure(args.steps, args.rounds, args.device)
    if args.write:
        Path(args.write).write_text(json.dumps(data, indent=1) + "\n")
    from bench.readme import publish

    return publish(report(data), args.readme, "host-hooks")


if __name__ == "__main__":
    sys.exit(main())
