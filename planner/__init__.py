"""planner: per-GPU memory, strategy and interconnect planning for distributed training (pure core)."""

__version__ = "0.1.0"
