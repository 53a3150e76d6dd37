"""Hardware resolution: the wiring of a node (pasted `nvidia-smi topo -m`, a preset, or the PCIe
host bridge assumed for a GPU type without one), the inter-node fabric and NICs, and the
efficiencies a calibration profile fitted for that wiring. The time model (steptime.py) and the
plan search (plan.py) both start here."""

from __future__ import annotations

from typing import Protocol

from planner.time import collectives as timing
from planner.errors import PlannerError
from planner.cluster.gpus import Gpu
from planner.cluster.presets import default_preset_for, preset, preset_topology
from planner.cluster.topology import GpuRow, Topology, link_between, parse_topology

DEFAULT_FABRIC, DEFAULT_NICS = "ib-hdr", 1


class TopologyFields(Protocol):
    """The fields of an estimate or plan request that name the wiring."""

    gpus: int
    topology: str | None
    topology_text: str | None
    fabric: str | None
    nics_per_node: int | None


def one_host_bridge(gpus: int, g: Gpu) -> Topology:
    """The topology assumed for a GPU type without a preset: every pair of GPUs over PCIe through
    one host bridge (nvidia-smi's PHB), no NVLink, no NICs. Built directly: it is what parsing the
    matching `nvidia-smi topo -m` text gives, but that text's size limit is for pastes, and a large
    --gpus (its matrix grows as gpus squared) is no paste."""
    link = link_between(0, 1, "PHB", g)  # every pair the same link
    return Topology(gpus=[GpuRow(index=i, cpu_affinity=None, numa_node=None) for i in range(gpus)], nics=[],
                    matrix=[["X" if i == j else "PHB" for j in range(gpus)] for i in range(gpus)],
                    links=[link.model_copy(update={"a": i, "b": j}) for i in range(gpus) for j in range(i + 1, gpus)],
                    nvlink_groups=[[i] for i in range(gpus)], gpu_type=g.name,
                    source=f"assumed: {gpus} GPUs under one PCIe host bridge")


def topology_of(req: "TopologyFields", g: Gpu) -> tuple[Topology, str, int]:
    """The node's wiring (a pasted `nvidia-smi topo -m`, a preset, or one PCIe host bridge for a
    GPU type without a preset), the inter-node fabric's name and the NICs per node, with the
    request's own fabric and NIC count winning over the preset's."""
    fabric, nics = DEFAULT_FABRIC, DEFAULT_NICS
    if req.topology_text is not None:
        topo = parse_topology(req.topology_text, g, source="pasted nvidia-smi topo -m")
    else:
        name = req.topology or default_preset_for(g.name)
        if name is None:
            topo = one_host_bridge(req.gpus, g)
        else:
            p = preset(name)
            if p.gpu != g.name:
                raise PlannerError(f"topology preset {name} is built from {p.gpu}, but gpu is {g.name}",
                                   field="topology")
            topo, fabric, nics = preset_topology(name), p.fabric, p.nics_per_node
    if len(topo.gpus) < req.gpus:
        raise PlannerError(f"gpus({req.gpus}) exceeds the {len(topo.gpus)} GPUs of the topology ({topo.source})",
                           field="gpus")
    return topo, req.fabric or fabric, req.nics_per_node or nics


def profile_efficiencies(profile_name: str | None, gpu_name: str, topo: Topology, gpus: int,
                         compute_efficiency: float | None, link_efficiency: float,
                         profile=None) -> tuple[float | None, float]:
    """(compute efficiency, link efficiency): without a profile the given ones; with one, the given
    compute efficiency (the override) or else the profile's (None in a profile of kernel rates), and the link efficiency fitted for the kind of this topology's ring bottleneck
    where its runs measured that kind, else its overall one.

    ``profile``: the Profile the request names (``profile_name``), read by the adapter
    (backend/profiles.py): the core reads no files and no environment."""
    if profile_name is None:
        return compute_efficiency, link_efficiency
    if profile is None or profile.name.lower() != profile_name.lower():
        raise PlannerError(f"profile {profile_name!r} is named but not given: the core reads no profile files; "
                           "read it with backend.profiles.profile_for(request) and pass it", field="profile",
                           value=profile_name)
    if profile.gpu != gpu_name:
        raise PlannerError(f"profile {profile.name} was fitted on {profile.gpu}, but gpu is {gpu_name}",
                           field="profile")
    ring, _, _ = timing.node_ring(topo, gpus)
    kind = timing.ring_bottleneck_kind(topo, ring)
    compute = profile.compute_efficiency if compute_efficiency is None else compute_efficiency
    return compute, profile.link_efficiencies.get(kind, profile.link_efficiency)


def profile_compute_scale(profile_name: str | None, profile=None) -> float:
    """The kernel-rate factor a calibration profile measured (1 without a profile, and for a
    profile saved before planner/time/kernels.py, which holds a compute efficiency instead)."""
    if profile_name is None or profile is None:
        return 1.0
    return profile.compute_scale
