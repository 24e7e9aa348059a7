"""The optional kernel-netem backend: argument translation always; the kernel check only where netem exists."""
from __future__ import annotations

import subprocess

import pytest

from netsim import get_profile
from netsim.netem import apply_profile, netem_args, netem_available

AVAILABLE, REASON = netem_available()


def test_netem_args_for_a_profile():
    assert netem_args(get_profile("3g").uplink) == [
        "netem", "delay", "150ms", "15ms", "distribution", "normal",
        "loss", "random", "0.5%", "rate", "700kbit", "limit", "100000"]
    assert netem_args(get_profile("edge-lossy").downlink) == [
        "netem", "delay", "400ms", "loss", "random", "1%", "rate", "240kbit", "limit", "100000"]


@pytest.mark.parametrize("name", ["flaky", "cellular-trace", "leo-starlink"])
def test_netem_refuses_effects_it_cannot_express(name):
    with pytest.raises(ValueError, match="no equivalent"):
        netem_args(get_profile(name).uplink)


def test_availability_probe_gives_a_reason():
    assert isinstance(REASON, str) and REASON


@pytest.mark.netns
@pytest.mark.skipif(not AVAILABLE, reason=f"kernel netem unavailable: {REASON}")
def test_apply_profile_in_a_scratch_namespace():
    netns = "netsim-test"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", netns, "ip", "link", "add", "a0", "type", "veth", "peer", "name", "b0"],
                       check=True)
        apply_profile(get_profile("3g"), "a0", "b0", netns=netns)
        shown = subprocess.run(["ip", "netns", "exec", netns, "tc", "qdisc", "show", "dev", "a0"],
                               check=True, capture_output=True, text=True).stdout
        assert "netem" in shown and "delay 150ms" in shown
    finally:
        subprocess.run(["ip", "netns", "delete", netns], check=False)
