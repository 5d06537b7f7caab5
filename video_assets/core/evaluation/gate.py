"""The promotion gate: a challenger replaces production unless a gated metric drops. Pure."""

from __future__ import annotations

GATED = ("flagged_f1", "macro_f1", "event_f1", "coverage")


def decide(production: dict, challenger: dict, tolerance: float, metrics=GATED) -> tuple[bool, str]:
    """(promote, reason): promote unless some gated metric drops by more than ``tolerance``."""
    lines = [f"{m} {production[m]:.3f} -> {challenger[m]:.3f}" for m in metrics]
    worse = [m for m in metrics if production[m] - challenger[m] > tolerance]
    if worse:
        return False, f"rejected: {', '.join(worse)} dropped by more than {tolerance:g} ({'; '.join(lines)})"
    return True, f"promoted: no metric dropped by more than {tolerance:g} ({'; '.join(lines)})"
