"""Reading the shipped data files (data/gpus.yaml, links.yaml, models.yaml).

PyYAML's pure-Python loader takes 4-16 ms per file here (gpus.yaml and links.yaml are read by
every `planner estimate`); libyaml's C loader (``yaml.CSafeLoader``, present in PyYAML's binary
wheels) builds the same objects, with the same SafeConstructor and resolver, about 8x faster
(tests/test_speed.py compares the two on every shipped file). Text a user supplies is still read by ``yaml.safe_load``, whose
error messages the CLI and API show.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # PyYAML built without libyaml: the same, slower


def load_data_yaml(path: Path) -> Any:
    """A shipped YAML file's content (it parses: tests load every one)."""
    return yaml.load(path.read_bytes(), Loader=_LOADER)
