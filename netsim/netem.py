"""Optional kernel backend: apply a profile with Linux `tc netem`, where the kernel has it.

Kernel netem is the reference a networking reader trusts (per-packet, real TCP recovery),
but it needs root and the sch_netem module; on the machines this project was built on, `tc`
answers "Specified qdisc kind is unknown". `netem_available()` probes for it in a throwaway
network namespace, so the host's interfaces are never touched. The usual topology puts the
qdiscs on a router namespace's two egress interfaces, one per direction (reference notes,
section 1.1); `apply_profile` takes those two interface names.

Only delay, jitter, bandwidth and loss translate. Outages, traces and handovers have no netem
equivalent here and are refused, and netem drops the lost packets for real instead of
modelling the stall, so results can be compared, not expected to match.
"""
from __future__ import annotations

import os
import shutil
import subprocess

from .effects import Bandwidth, Delay, GilbertElliottLoss, Jitter, Loss
from .link import Link
from .profiles import Profile

_PROBE = "ip link set lo up && tc qdisc add dev lo root netem delay 1ms"


def netem_available() -> tuple[bool, str]:
    """(available, reason): whether `tc qdisc add ... netem` works in a new network namespace."""
    if os.geteuid() != 0:
        return False, "netem needs root (CAP_NET_ADMIN)"
    for tool in ("tc", "ip", "unshare"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` is not installed"
    try:
        probe = subprocess.run(["unshare", "--net", "sh", "-c", _PROBE],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"could not run the netem probe: {exc}"
    if probe.returncode != 0:
        return False, f"tc netem failed in a scratch namespace: {probe.stderr.strip() or probe.returncode}"
    return True, "tc netem works"


def netem_args(link: Link) -> list[str]:
    """The `netem ...` arguments that express a link (after `tc qdisc add dev X root`)."""
    delay_ms, jitter, rate_kbit_s, loss = 0.0, None, None, None
    for effect in link.effects:
        if isinstance(effect, Delay):
            delay_ms += effect.delay_ms
        elif isinstance(effect, Jitter):
            jitter = effect
        elif isinstance(effect, Bandwidth):
            rate_kbit_s = effect.rate_kbit_s
        elif isinstance(effect, (Loss, GilbertElliottLoss)):
            loss = effect
        else:
            raise ValueError(f"netem has no equivalent for the {effect.kind!r} effect")
    args = ["netem", "delay", f"{delay_ms + (jitter.jitter_ms if jitter else 0.0):g}ms"]
    if jitter is not None and jitter.jitter_ms > 0:
        # Our jitter is mean jitter_ms over [0, 2·jitter_ms]; netem's is centred on the delay.
        if jitter.distribution == "uniform":
            args += [f"{jitter.jitter_ms:g}ms"]
        else:
            args += [f"{jitter.jitter_ms / 2:g}ms", "distribution", "normal"]
    if isinstance(loss, Loss) and loss.loss_rate > 0:
        args += ["loss", "random", f"{loss.loss_rate * 100:g}%"]
    elif isinstance(loss, GilbertElliottLoss):
        args += ["loss", "gemodel", f"{loss.p_good_to_bad * 100:g}%", f"{loss.p_bad_to_good * 100:g}%",
                 f"{loss.loss_in_bad * 100:g}%", f"{loss.loss_in_good * 100:g}%"]
    if rate_kbit_s is not None:
        # Pairing jitter with rate keeps netem from reordering (reference notes, section 1.1).
        args += ["rate", f"{rate_kbit_s:g}kbit"]
    # The default 1000-packet limit overflows silently at large delay x rate.
    args += ["limit", "100000"]
    return args


def apply_profile(profile: Profile, uplink_dev: str, downlink_dev: str, netns: str | None = None) -> None:
    """Install the profile as root netem qdiscs: uplink on `uplink_dev`, downlink on `downlink_dev`.

    The devices are the egress interfaces toward the server and toward the client (in a
    router namespace `netns` if given). Raises CalledProcessError if `tc` refuses.
    """
    prefix = ["ip", "netns", "exec", netns] if netns else []
    for dev, link in ((uplink_dev, profile.uplink), (downlink_dev, profile.downlink)):
        subprocess.run(prefix + ["tc", "qdisc", "replace", "dev", dev, "root", *netem_args(link)],
                       check=True, capture_output=True, text=True)
