"""Byte units. Inside the planner memory is an integer count of bytes; it becomes GiB or GB only
when shown, and the label always says which (GiB = 2**30 bytes, GB = 10**9 bytes)."""

GIB = 2**30
GB = 10**9
MIB = 2**20


def gib(num_bytes: int) -> float:
    return num_bytes / GIB


def gb(num_bytes: int) -> float:
    return num_bytes / GB


def fmt_bytes(num_bytes: int) -> str:
    """'86.9 GB (80.9 GiB)': both units, labelled, for tables and messages."""
    return f"{gb(num_bytes):,.2f} GB ({gib(num_bytes):,.2f} GiB)"


def fmt_gib(num_bytes: int) -> str:
    return f"{gib(num_bytes):,.2f} GiB"
