"""Link profiles between a board and the cache box (bandwidth, round-trip time).

Pure data and arithmetic here; the shaping of real traffic builds on these profiles.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkProfile:
    bandwidth_mbps: float  # megabits per second
    rtt_ms: float
    label: str = ""

    @property
    def bytes_per_second(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    def transfer_ms(self, size_bytes: float, round_trips: int = 1) -> float:
        """Time to move ``size_bytes`` over this link, plus its round trips."""
        return round_trips * self.rtt_ms + size_bytes / self.bytes_per_second * 1000.0


# The paper's Wi-Fi 4 link moved a 2.25 MB entry in 0.86 s: about 2.6 MB/s (20.9 Mbit/s).
LINK_PRESETS: dict[str, LinkProfile | None] = {
    "none": None,
    "wifi4": LinkProfile(20.9, 4.0, "Wi-Fi 4, as in the paper (2.25 MB in 0.86 s)"),
    "fast-ethernet": LinkProfile(94.0, 0.5, "Fast Ethernet"),
    "gigabit": LinkProfile(940.0, 0.2, "Gigabit Ethernet"),
}


def rtt_only(link: LinkProfile | None) -> LinkProfile | None:
    """What a board's sockets still emulate when the kernel shapes its link: the round trip alone."""
    if link is None or link.rtt_ms <= 0:
        return None
    return LinkProfile(
        float("inf"),
        link.rtt_ms,
        f"kernel-shaped {link.bandwidth_mbps:g} Mbit/s; {link.rtt_ms:g} ms RTT added per round trip",
    )
