"""Elementwise helpers that take a float or a numpy array alike, so the time model's formulas are
written once: the plan search evaluates them on an array of micro-batch options, a single estimate
on plain floats. numpy is imported only when an array is given, so `planner estimate` never loads
it (about a quarter of that process's start-up; bench/speed.py).
"""

from __future__ import annotations

from typing import Any


def is_array(x: Any) -> bool:
    return hasattr(x, "shape")


def maximum(a: Any, b: Any) -> Any:
    if is_array(a) or is_array(b):
        import numpy as np

        return np.maximum(a, b)
    return max(a, b)


def minimum(a: Any, b: Any) -> Any:
    if is_array(a) or is_array(b):
        import numpy as np

        return np.minimum(a, b)
    return min(a, b)


def where(condition: Any, yes: Any, no: Any) -> Any:
    if is_array(condition) or is_array(yes) or is_array(no):
        import numpy as np

        return np.where(condition, yes, no)
    return yes if condition else no


def as_float(x: Any) -> Any:
    """An array as float64, anything else as a float."""
    if is_array(x):
        import numpy as np

        return np.asarray(x, dtype=np.float64)
    return float(x)


def zeros_like(x: Any) -> Any:
    if is_array(x):
        import numpy as np

        return np.zeros_like(x, dtype=np.float64)
    return 0.0


def full_like(x: Any, value: Any) -> Any:
    """``value`` in the shape of ``x`` (an array of it, or the value itself for a float)."""
    if is_array(x):
        import numpy as np

        return np.full(x.shape, value)
    return value


def smallest(x: Any) -> float:
    return float(x.min()) if is_array(x) else float(x)


def item(x: Any, k: int) -> Any:
    """Option k of an array, or the float itself (one option)."""
    return x[k] if is_array(x) else x
