"""Profiles carry their sources and published figures; the registry round-trips them; the CLI lists them."""
from __future__ import annotations

import json

import pytest

from netsim import EFFECTS, PROFILES, Link, Profile, effect_from_dict, get_profile
from netsim.cli import main
from netsim.effects import Bandwidth, Delay, Loss

REQUIRED = ["lan", "cable", "lte", "slow4g", "3g", "slow3g", "edge-lossy", "geo-sat", "leo-starlink",
            "wifi-congested", "flaky"]


def test_required_profiles_exist_with_sources():
    for name in REQUIRED:
        profile = get_profile(name)
        assert profile.source and profile.description, name
        assert profile.uplink.effects and profile.downlink.effects, name


@pytest.mark.parametrize("name, rtt_ms, up_kbit_s, down_kbit_s", [
    ("lan", 1, 1_000_000, 1_000_000),
    ("cable", 28, 1000, 5000),             # WPT Cable
    ("lte", 70, 12_000, 12_000),           # WPT LTE
    ("slow4g", 150, 675, 1638.4),          # Lighthouse mobileSlow4G
    ("3g", 300, 700, 700),                 # Lighthouse mobileRegular3G
    ("slow3g", 400, 400, 400),             # DevTools Slow 3G
    ("edge-lossy", 840, 200, 240),         # ATC Edge-Lossy
    ("geo-sat", 600, 2960, 18_750),        # APNIC ~600 ms; Ookla Viasat
    ("leo-starlink", 50, 13_540, 87_250),  # APNIC median 50 ms; Ookla Starlink
])
def test_profiles_match_their_published_figures(name, rtt_ms, up_kbit_s, down_kbit_s):
    profile = get_profile(name)
    assert profile.rtt_ms() == pytest.approx(rtt_ms)
    assert profile.uplink.rate_kbit_s() == pytest.approx(up_kbit_s)
    assert profile.downlink.rate_kbit_s() == pytest.approx(down_kbit_s)


def test_edge_lossy_is_one_percent_each_way():
    profile = get_profile("edge-lossy")
    assert profile.uplink.mean_loss_rate() == pytest.approx(0.01)
    assert profile.downlink.mean_loss_rate() == pytest.approx(0.01)


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(KeyError, match="lte"):
        get_profile("5g-mmwave")


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profiles_round_trip_through_json(name):
    profile = get_profile(name)
    assert Profile.from_dict(json.loads(json.dumps(profile.to_dict()))) == profile


def test_registry_names_every_effect_once():
    assert sorted(EFFECTS) == sorted({"delay", "jitter", "bandwidth", "loss", "ge-loss", "outage", "trace",
                                      "handover"})
    assert effect_from_dict({"kind": "delay", "delay_ms": 5}) == Delay(5)
    with pytest.raises(ValueError, match="unknown effect kind"):
        effect_from_dict({"kind": "teleport"})


def test_settings_are_checked():
    with pytest.raises(ValueError):
        Loss(1.5)
    with pytest.raises(ValueError):
        Bandwidth(0)
    with pytest.raises(ValueError):
        Delay(-1)


def test_link_summaries():
    link = Link((Delay(10), Bandwidth(500), Loss(0.1), Loss(0.1)))
    assert link.mean_delay_ms() == 10
    assert link.rate_kbit_s() == 500
    assert link.mean_loss_rate() == pytest.approx(1 - 0.9 * 0.9)


def test_cli_profiles_table_lists_every_profile(capsys):
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in PROFILES:
        assert name in out
    assert "WebPageTest" in out and "840" in out


def test_cli_profiles_json(capsys):
    assert main(["profiles", "--json"]) == 0
    names = [spec["name"] for spec in json.loads(capsys.readouterr().out)]
    assert names == list(PROFILES)


def test_cli_requires_a_subcommand():
    with pytest.raises(SystemExit):
        main([])
