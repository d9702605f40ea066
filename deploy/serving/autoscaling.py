"""The cells' autoscaling policy: as many cells as their open requests over
`target_requests_per_cell`.

Requests do not pass through Serve (the ingress submits them to the cells' schedulers), so Serve's
own count of ongoing calls does not see them: each `Cell` replica reports its scheduler's open
requests instead (`record_autoscaling_stats`, as `open_requests`). Serve applies the config's
delays, factors and replica bounds around this policy. Serve's controller imports this module: it
imports nothing else.
"""

from __future__ import annotations

from typing import Any


def open_requests(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Serve's `AutoscalingContext` -> the number of cells wanted (before delays and bounds)."""
    per_cell = (ctx.aggregated_metrics or {}).get("open_requests", {})
    if ctx.current_num_replicas == 0 or not per_cell:  # (no report yet: keep what is wanted)
        return ctx.target_num_replicas, {}
    return sum(per_cell.values()) / ctx.config.get_target_ongoing_requests(), {}
