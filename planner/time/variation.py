"""The slowest GPU sets a synchronous step's pace.

GPUs of one SKU do not compute at one speed: each die has its own voltage-frequency-temperature
curve and its own cooling, so under the power limit each settles at its own clock. Bekman
(stas00/ml-engineering 744d01e, compute/accelerator/README.md, "Not all accelerators are created equal",
lines 405-417) has seen 5% and higher differences between the GPUs of one 8-GPU node, a "5%+ MAMF
spread" that factory binning does not remove; across whole clusters of same-SKU GPUs Sinha
et al. measured 8% average performance variation, outliers up to 1.5x slower than the median
(SC22, "Not All GPUs Are Created Equal", arXiv 2208.11035; V100 and MI60 clusters).

A data-parallel, sharded, tensor- or pipeline-parallel step meets at every collective (FSDP's and
ZeRO-3's gathers each layer, DDP's bucketed all-reduce, the pipeline's sends), so every rank waits for
the slowest, and since a GPU's clock is its own for the whole run the slowest is the same GPU each
time: the step's clock-bound kernels (GEMMs and attention, which run at the SM clock; memory-bound
kernels run at the HBM's fixed clock) take the slowest of the world's GPUs' time. The catalogue's
matmul rates are one GPU's (a median one in expectation); the world's GPUs are modelled as
independent draws of a normal spread around it whose expected range over eight GPUs is the 5% above,
so the slowest of N runs its clock-bound work SPEED_SIGMA x E[max of N standard normals] longer:
about 2.5% on one node of 8, 4.5% on 128 GPUs, 6% on 4,096. The lower figure (one node's) is used:
cluster operators drain the outliers Sinha et al. found.
"""

from __future__ import annotations

import math
from functools import lru_cache

# the spread (fastest over slowest, less one) of one 8-GPU node's MAMF (Bekman, module docstring: "5%+")
NODE_SPREAD = 0.05
NODE_GPUS = 8


@lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: the integral of x n phi(x) Phi(x)^(n-1) over the reals
    (0 for one; 0.5642 for 2, 1.4236 for 8, 3.0439 for 512), by the midpoint rule."""
    if n <= 1:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(-9000, 9000):
        x = (i + 0.5) * step
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        total += x * n * math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) * cdf ** (n - 1)
    return total * step


# the per-GPU speed's standard deviation, relative: the node's spread is the expected range of its GPUs
SPEED_SIGMA = NODE_SPREAD / (2.0 * expected_max_normal(NODE_GPUS))


@lru_cache(maxsize=1024)
def slowest_share(world: int) -> float:
    """How much longer the slowest of ``world`` GPUs runs clock-bound work than the catalogue's GPU."""
    return SPEED_SIGMA * expected_max_normal(max(1, int(world)))


SOURCE = ("every rank waits for the slowest GPU at the step's collectives: same-SKU GPUs' matmul rates spread 5% "
          "over one 8-GPU node (Bekman, ml-engineering compute/accelerator/README.md 'Not all accelerators are created equal'), a normal "
          "spread of {sigma:.2%}; the slowest of {world:,} GPUs runs the GEMMs and attention {share:.2%} longer "
          "(planner/time/variation.py; published spreads, not measured here: one GPU cannot show it)")


@lru_cache(maxsize=1024)
def source(world: int) -> str:
    return SOURCE.format(sigma=SPEED_SIGMA, world=world, share=slowest_share(world))
