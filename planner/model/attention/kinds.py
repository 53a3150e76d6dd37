"""Attention kinds: what differs between them is asked of the kind (``kind_of(spec)``), never
tested by its name. Each kind is a module owning its arithmetic (planner/model/attention/base.py: the
interface and the GQA family; planner/model/attention/mla.py); adding a kind is its module and one entry
here.
"""

from __future__ import annotations

from typing import Any

from planner.model.attention.base import GQA_FAMILY, AttentionKind
from planner.model.attention.mla import MLA

KINDS: dict[str, AttentionKind] = {name: kind for kind in (GQA_FAMILY, MLA) for name in kind.names}


def kind_of(spec: Any) -> AttentionKind:
    """The kind of an AttentionSpec (planner/model/layers.py)."""
    return KINDS[spec.kind]
