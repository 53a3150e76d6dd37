"""A framework's phases of one step (``PhasePlan``): the type the frameworks return and the
orchestrator, the allocator replay and the pipeline read, kept below them all (planner/memory/
buffers.py builds it) so that no module imports another for it in a cycle, not even for type checking."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.schema import MemoryItem, Phase


@dataclass
class PhasePlan:
    phases: list[Phase]
    resident_bytes: int
    buffers: list[MemoryItem]
    notes: list[str] = field(default_factory=list)
    resident: list[MemoryItem] = field(default_factory=list)  # what is held between steps
    host_resident_bytes: int = 0
    host_peak_bytes: int = 0
    host_pinned_bytes: int = 0
    nvme_bytes: int = 0

    @classmethod
    def of(cls, phases: list[Phase], resident: list[MemoryItem]) -> PhasePlan:
        """The plan of a framework's ``phases`` over what it holds between steps (``resident``): the
        resident bytes summed, the buffers those of the phases' items that are of component "buffers"."""
        return cls(phases=phases, resident_bytes=sum(i.bytes for i in resident), resident=resident,
                   buffers=[i for p in phases for i in p.items if i.component == "buffers"])
