"""The frameworks that realise the data-parallel part of a layout, one module per version, behind
one small interface, chosen by a registry keyed by name and version.

A strategy name (planner/strategies.py) is the user's shorthand: it names a framework and the
variant of it (ZeRO stage, FSDP sharding). Everything a framework allocates, sends and accepts
is answered by its module: its memory phases, collectives per step, offload rules, the overlap of
its communication with compute, what the rest of the code would otherwise read off its name, and
what launches it (its package's launch.py: the Launcher). A later DeepSpeed is a new module beside
deepspeed/v0_19.py, registered, and one import line here.
"""

from planner.frameworks.base import (Buckets, Collective, Framework, Traffic, check_sharded_offload, check_version,
                                     framework, framework_of, register, version_field, version_for)
from planner.frameworks.deepspeed import v0_19 as deepspeed_0_19  # each registers itself
from planner.frameworks.torch import v2 as torch_2

__all__ = ["Buckets", "Collective", "Framework", "Traffic", "check_sharded_offload", "check_version", "deepspeed_0_19",
           "framework", "framework_of", "register", "torch_2", "version_field",
           "version_for"]
