"""A verify record as text: predicted beside measured, per device and per rank, the collectives
and the verdict. Shown by `planner verify` / `planner runs ID` and by the web page's run view."""

from __future__ import annotations


def _error(predicted: int, measured: int) -> str:
    """The prediction's error against a measurement, as shown (MB to two decimals): "n/a" when the
    measurement shows as 0.00 MB, where a percentage of it says nothing (0 against 0 is not -100%)."""
    if abs(measured) < 5_000:
        return "     n/a"
    return f"{100 * (predicted - measured) / measured:>+7.2f}%"


def _component_rows(components: dict) -> list[str]:
    """Resident by component under the resident total (measured: the engine's own tensors)."""
    rows = []
    for name, c in components.items():
        if c["predicted"] or c["measured"]:
            error = _error(c["predicted"], c["measured"]) if c["error_pct"] is not None else "     n/a"
            measured = f"{c['measured'] / 1e6:>14,.2f}" if c["error_pct"] is not None or c["measured"] else f"{'-':>14}"
            rows.append(f"    {name.replace('_', ' '):<26} {c['predicted'] / 1e6:>14,.2f} {measured} {error}")
    return rows


def verify_table(record: dict) -> str:
    pred = record.get("predicted_rank") or record["prediction"]["per_device"]
    measured = record.get("measured") or {}
    lines = [f"run {record.get('id', '?')}: {record['status']} - {record.get('message', '')}"]
    if record.get("scaled"):
        lines.append(f"note: {record['scaled']}")
    ranks = [r for r in measured.get("ranks", []) if r.get("status") == "ok"]
    if ranks:
        lines += ["", f"  {'per device (worst rank)':<28} {'predicted MB':>14} {'measured MB':>14} {'error':>8}"]
        for key, label in (("resident_bytes", "resident between steps"), ("peak_bytes", "peak")):
            p, m = pred[key], measured[key]
            lines.append(f"  {label:<28} {p / 1e6:>14,.2f} {m / 1e6:>14,.2f} {_error(p, m)}")
            if key == "resident_bytes":
                lines += _component_rows((record.get("errors") or {}).get("resident_components") or {})
        for r in measured.get("ranks", []):
            if r.get("status") == "ok":
                lines.append(f"  rank {r['rank']}: peak {r['peak_bytes'] / 1e6:,.2f} MB, resident "
                             f"{r['resident_bytes'] / 1e6:,.2f} MB, step {r['step_seconds']:.3f} s")
        comm = record.get("communication") or {}
        if comm.get("measured_rank0"):
            lines.append("  collectives per step, rank 0 (payload MB): " + ", ".join(
                f"{name} {v['calls']}x {v['bytes'] / 1e6:,.2f}" for name, v in comm["measured_rank0"].items()))
            lines.append(f"  collective payload per step: measured {comm['measured_bytes_per_step'] / 1e6:,.2f} MB, "
                         f"time model {comm['modelled_bytes_per_step'] / 1e6:,.2f} MB ("
                         + ", ".join(m["what"] for m in comm["modelled"]) + ")")
        e = record.get("errors") or {}
        verdict = "WITHIN" if e.get("within_tolerance") else "OUTSIDE"
        lines.append(f"verdict: {verdict} the {100 * record.get('tolerance', 0.05):.0f}% tolerance")
    else:
        for r in measured.get("ranks", []):
            lines.append(f"  rank {r.get('rank')}: {r.get('status')} {r.get('error', '')[:200]}")
    return "\n".join(lines)
