"""What the wiring between nodes does to a plan: the same model and nodes on five fabrics.

    python bench/wiring.py [--readme README.md]

Plans Llama-3-8B on 2 nodes of 8 H100s (global batch 256 x 4096 tokens) with each fabric, and
estimates Llama-3-70B under FSDP (micro-batch 1, full checkpointing) on 1, 2 and 4 nodes over
InfiniBand NDR and 25 GbE, and plans Llama-3-70B on 4 nodes over 25 GbE, printing the time model's figures as Markdown. Every number is computed
here by planner.plan.search; nothing is typed in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from planner.plan.search import plan  # noqa: E402
from planner.time.step import estimate_with_time  # noqa: E402
from planner.schema import EstimateRequest, PlanRequest  # noqa: E402

FABRICS = [("ib-ndr", 8), ("ib-ndr", 1), ("roce-200g", 1), ("eth-100g", 1), ("eth-25g", 1)]
PLAN = dict(model="llama-3-8b", gpu="h100-80gb", gpus=8, nodes=2, seq_len=4096, global_batch=256)


def _label(c) -> str:
    return f"{c.strategy}/{c.hsdp_shard_size}" if c.hsdp_shard_size else c.strategy


def plan_rows() -> list[str]:
    rows = ["| fabric x NICs per node | GB/s per GPU across nodes | recommended | step s | exposed comm s "
            "| best FSDP: step s, comm s | fewer nodes do better |",
            "|---|---:|---|---:|---:|---:|---|"]
    for fabric, nics in FABRICS:
        r = plan(PlanRequest(fabric=fabric, nics_per_node=nics, **PLAN))
        best = r.recommended
        fsdp = next(c for c in r.candidates if c.strategy == "fsdp" and c.fits)
        fewer = f"--nodes {r.faster_on_fewer_nodes}" if r.faster_on_fewer_nodes else "no"
        rows.append(f"| {fabric} x {nics} | {r.topology.inter_node_gbps_per_gpu:.2f} | {_label(best)} "
                    f"(mb {best.micro_batch}, ckpt {best.checkpointing}, offload {best.offload_optimizer}/"
                    f"{best.offload_params}) | {best.step_seconds:.2f} | {best.exposed_communication_seconds:.2f} "
                    f"| {fsdp.step_seconds:.2f}, {fsdp.communication_seconds:.2f} | {fewer} |")
    return rows


def estimate_rows() -> list[str]:
    rows = ["| Llama-3-70B FSDP, 8 H100s per node | 1 node | 2 nodes | 4 nodes |", "|---|---:|---:|---:|"]
    for fabric, nics in (("ib-ndr", 8), ("eth-25g", 1)):
        cells = []
        for nodes in (1, 2, 4):
            t = estimate_with_time(EstimateRequest(model="llama-3-70b", strategy="fsdp", gpu="h100-80gb", gpus=8,
                                                   nodes=nodes, seq_len=4096, micro_batch=1, checkpointing="full",
                                                   fabric=fabric, nics_per_node=nics)).time
            cells.append(f"{t.communication_seconds:.2f} s comm, {t.step_seconds:.2f} s step")
        rows.append(f"| {fabric} x {nics} | " + " | ".join(cells) + " |")
    return rows


def fewer_nodes_line() -> str:
    r = plan(PlanRequest(model="llama-3-70b", gpu="h100-80gb", gpus=8, nodes=4, seq_len=4096, global_batch=256,
                         fabric="eth-25g", nics_per_node=1))
    best = r.recommended
    note = next((n for n in r.notes if n.startswith("fewer nodes do better")), "no smaller node count does better")
    return (f"Llama-3-70B planned on 4 nodes over eth-25g x 1 (global batch 256): recommended {_label(best)} at "
            f"{best.step_seconds:.1f} s per step; {note}.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", help="replace the wiring block of this README")
    args = parser.parse_args()
    text = "\n".join(plan_rows() + [""] + estimate_rows() + ["", fewer_nodes_line()] + [
        "", "`python bench/wiring.py`: Llama-3-8B planned on 2 nodes of 8 H100s (global batch 256 x 4096 tokens) "
            "per fabric; Llama-3-70B FSDP estimated per micro-batch (1 x 4096 tokens, full checkpointing). "
            "Achieved rates are data/links.yaml's nominal x efficiency."])
    from bench.readme import publish

    return publish(text, args.readme, "wiring")


if __name__ == "__main__":
    sys.exit(main())
