"""Named link profiles, each with the source of its figures.

A profile is two links, uplink (client -> server: the edge device sending to the cloud
verifier) and downlink (server -> client). Delays are one-way; the RTT shown is the sum of
both directions' mean delays. Figures taken from a source say so in `source`; figures that
are our own choice (most jitter and loss: the browser presets specify none) say so in `note`.
Several presets share a lineage (ATC 3G-Average = WPT 3GSlow; Lighthouse mobileSlow4G = WPT
3GFast), so each profile cites one.

Rates are in kbit/s (1000 bits/s) of payload. The reference notes behind these numbers are
shared/reference/network-emulation-anchors.md, section 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .effects import Bandwidth, Delay, GilbertElliottLoss, Handover, Jitter, Loss, Outage, Trace
from .link import Link


@dataclass(frozen=True)
class Profile:
    name: str
    uplink: Link      # client -> server (edge -> cloud)
    downlink: Link    # server -> client (cloud -> edge)
    description: str = ""
    source: str = ""  # where the figures come from
    note: str = ""    # what is our own assumption, and caveats

    def rtt_ms(self) -> float:
        """Mean round trip without queueing or loss (ms)."""
        return self.uplink.mean_delay_ms() + self.downlink.mean_delay_ms()

    def expected_rtt_ms(self, request_bytes: int = 64, reply_bytes: int = 64) -> float:
        """Mean round trip of a lone request and its reply (ms): what a ping client should read.

        Adds to rtt_ms() the two messages' transmission times and their expected loss stalls
        (3g: 300 ms becomes ~306 ms for 64-byte pings; 0.5% loss each way, stalls of RTT + 200 ms).
        """
        rtt_ms = self.rtt_ms()
        return (self.uplink.expected_delay_ms(request_bytes, rtt_ms)
                + self.downlink.expected_delay_ms(reply_bytes, rtt_ms))

    def without(self, *kinds: str) -> Profile:
        """The profile with the effects of the named kinds left out of both links."""
        return Profile(self.name, self.uplink.without(*kinds), self.downlink.without(*kinds), self.description,
                       self.source, self.note)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "source": self.source,
                "note": self.note, "uplink": self.uplink.to_list(), "downlink": self.downlink.to_list()}

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> Profile:
        return cls(name=spec["name"], uplink=Link.from_list(spec["uplink"]),
                   downlink=Link.from_list(spec["downlink"]), description=spec.get("description", ""),
                   source=spec.get("source", ""), note=spec.get("note", ""))


def _link(*effects) -> Link:
    return Link(tuple(effects))


def _both(*effects) -> tuple[Link, Link]:
    return _link(*effects), _link(*effects)


_PROFILES: list[Profile] = [
    Profile(
        "lan",
        *_both(Delay(0.5), Bandwidth(1_000_000)),
        description="Control: one LAN hop, 1 ms RTT, 1 Gbit/s, no loss.",
        source="none (control)",
        note="Our assumption; a baseline to subtract the proxy's own overhead.",
    ),
    Profile(
        "cable",
        uplink=_link(Delay(13.5), Jitter(0.5), Bandwidth(1000)),
        downlink=_link(Delay(13.5), Jitter(0.5), Bandwidth(5000)),
        description="Cable broadband: 28 ms RTT, 5 Mbit/s down, 1 Mbit/s up.",
        source="WebPageTest connectivity.ini.sample 'Cable' (28 ms RTT, 5000/1000 kbit/s)",
        note="Jitter (mean 0.5 ms each way) is our assumption; WPT has none.",
    ),
    Profile(
        "lte",
        *_both(Delay(25), Jitter(10, "normal"), Bandwidth(12_000), Loss(0.001)),
        description="LTE: 70 ms RTT, 12 Mbit/s each way, 0.1% loss.",
        source="WebPageTest connectivity.ini.sample 'LTE' (70 ms RTT, 12000/12000 kbit/s)",
        note="Jitter (normal, mean 10 ms each way, part of the 70 ms) and 0.1% loss are our assumption.",
    ),
    Profile(
        "slow4g",
        uplink=_link(Delay(60), Jitter(15, "normal"), Bandwidth(675)),
        downlink=_link(Delay(60), Jitter(15, "normal"), Bandwidth(1638.4)),
        description="Slow 4G (= fast 3G): 150 ms RTT, 1.6 Mbit/s down, 675 kbit/s up.",
        source="Lighthouse core/config/constants.js mobileSlow4G (rttMs 150, throughputKbps 1638.4, "
               "upload 750*0.9 = 675 kbit/s); = WPT '3GFast'",
        note="Jitter (normal, mean 15 ms each way, part of the 150 ms) is our assumption; "
             "Lighthouse specifies no loss.",
    ),
    Profile(
        "3g",
        *_both(Delay(120), Jitter(30, "normal"), Bandwidth(700), Loss(0.005)),
        description="Regular 3G: 300 ms RTT, 700 kbit/s each way, 0.5% loss.",
        source="Lighthouse core/config/constants.js mobileRegular3G (rttMs 300, throughputKbps 700)",
        note="Jitter (normal, mean 30 ms each way, part of the 300 ms) and 0.5% loss are our assumption.",
    ),
    Profile(
        "slow3g",
        *_both(Delay(200), Bandwidth(400), Loss(0.01)),
        description="Slow 3G: 400 ms RTT, 400 kbit/s each way, 1% loss.",
        source="DevTools 'Slow 3G' (Puppeteer PredefinedNetworkConditions.ts: 400 ms, 500 kbps*0.8); "
               "= WPT '3G_EM'",
        note="1% loss is our assumption, in the range of ATC's lossy profiles and comcast's table.",
    ),
    Profile(
        "edge-lossy",
        uplink=_link(Delay(440), Bandwidth(200), Loss(0.01)),
        downlink=_link(Delay(400), Bandwidth(240), Loss(0.01)),
        description="EDGE, lossy: 840 ms RTT, 240 kbit/s down, 200 kbit/s up, 1% loss each way.",
        source="Facebook ATC utils/profiles/Edge-Lossy.json (up 440 ms/200 kbit/1%, down 400 ms/240 kbit/1%)",
    ),
    Profile(
        "geo-sat",
        uplink=_link(Delay(295), Jitter(5), Bandwidth(2960), Loss(0.002)),
        downlink=_link(Delay(295), Jitter(5), Bandwidth(18_750), Loss(0.002)),
        description="Geostationary satellite: ~600 ms RTT, 18.75 Mbit/s down, 2.96 Mbit/s up.",
        source="RTT: G. Huston, APNIC blog 2022-05 (>=477 ms by physics, ~600 ms typical); rates: "
               "Ookla Q3-2021 Viasat medians via Free State Foundation; loss: comcast 'Satellite' row (0.2%)",
        note="Jitter (mean 5 ms each way) is our assumption; comcast's figures are crowd-sourced.",
    ),
    Profile(
        "leo-starlink",
        uplink=_link(Delay(18), Jitter(2, "normal"), Handover(15.0, 100.0, 0.5, 10.0), Bandwidth(13_540)),
        downlink=_link(Delay(18), Jitter(2, "normal"), Handover(15.0, 100.0, 0.5, 10.0), Bandwidth(87_250)),
        description="LEO (Starlink): ~50 ms RTT, 87 Mbit/s down, 13.5 Mbit/s up, loss bursts and "
                    "delay steps at the 15 s reconfigurations.",
        source="RTT: APNIC blog 2022-11-28 (median ~50 ms, RIPE Atlas); rates: Ookla Q3-2021 medians "
               "(87.25/13.54 Mbit/s); 15 s handovers with bursts 'up to 50%': APNIC 2022-11-28, "
               "Mohan et al. arXiv 2310.09242",
        note="Burst length (100 ms), step size (U(0,10) ms one-way) and jitter are our assumption.",
    ),
    Profile(
        "wifi-congested",
        *_both(Delay(5), Jitter(10, "normal"),
               Bandwidth(30_000), GilbertElliottLoss(0.01, 0.3, loss_in_bad=0.5, loss_in_good=0.005)),
        description="Congested Wi-Fi: ~30 ms RTT, 30 Mbit/s, ~2% bursty loss.",
        source="Rate: comcast 'WIFI (good)' row (30000 kbit/s); shape: str0m-netem wifi_congested "
               "(Gilbert-Elliott bursts)",
        note="Delay, jitter and the loss chain (p=0.01, r=0.3, 50% in bad, 0.5% in good: ~2.1% mean) "
             "are our assumption; MSR-TR-2009-108's ~10% Wi-Fi loss is likely MAC frames before retries.",
    ),
    Profile(
        "flaky",
        *_both(Delay(25), Jitter(10, "normal"), Bandwidth(12_000), Loss(0.001),
               Outage(mean_up_s=30.0, mean_down_s=2.0, mode="stall")),
        description="LTE with outages: the lte profile plus on/off outages (mean 30 s up, 2 s down) "
                    "that stall the link.",
        source="Outage model: Mahimahi mm-onoff (exponential on/off); base link: WebPageTest 'LTE'",
        note="The on/off means are our assumption (ATC models an outage as 'No Connectivity', 1 kbit/s).",
    ),
    Profile(
        "cellular-trace",
        uplink=_link(Delay(35), Trace("synthetic-cellular.up")),
        downlink=_link(Delay(35), Trace("synthetic-cellular.down")),
        description="Trace-driven cellular link: 70 ms RTT, rate varying per the bundled synthetic traces.",
        source="Trace format: Mahimahi mm-link; delay: WebPageTest 'LTE' (70 ms RTT)",
        note="The traces are synthetic (netsim/tracegen.py, seed 1/2), not measurements.",
    ),
]

PROFILES: dict[str, Profile] = {profile.name: profile for profile in _PROFILES}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
