"""The error summary every published-throughput bench prints: how many predictions fall within 15% of the
published figure, the median |error| and the median signed error of a list of relative errors."""

from __future__ import annotations

import statistics

WITHIN = 0.15  # the bound: a prediction within 15% of the published figure


def error_summary(errors: list[float], share: bool = False, span: bool = False) -> str:
    """``share``: the within-count's percentage beside it; ``span``: the smallest and largest error after. An
    empty list is "-"."""
    if not errors:
        return "-"
    within = sum(abs(e) <= WITHIN for e in errors)
    count = f"{within}/{len(errors)}" + (f" ({within / len(errors):.0%})" if share else "")
    text = (f"{count} within 15%, median |error| {statistics.median(abs(e) for e in errors):.1%}, "
            f"median signed {statistics.median(errors):+.1%}")
    return text + (f", range {min(errors):+.1%} to {max(errors):+.1%}" if span else "")
