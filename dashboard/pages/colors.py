"""One colour per device, the same on every chart and page (and for live updates): chosen by
the device's registration order, so it never changes when other devices come and go."""

from __future__ import annotations

# Plotly's default qualitative palette (D3's category10): distinct on light and dark backgrounds.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def device_color(device) -> str:
    """The colour of ``device`` (a Device: by its primary key, i.e. registration order)."""
    return PALETTE[(max(int(device.pk or 1), 1) - 1) % len(PALETTE)]


def device_colors(devices) -> dict[str, str]:
    return {device.name: device_color(device) for device in devices}
