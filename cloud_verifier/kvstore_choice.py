"""Which folder `cloud-verifier serve` keeps its session KV checkpoints in (`--kv-store`).

Given a folder (`--kv-store DIR`) it is that one; `--kv-store off`: none. Otherwise, the default:
a folder of this verifier's own on the node's tmpfs,

    /dev/shm/hybridspec-kv-<uid>/<host>_<port>/

when /dev/shm is a tmpfs (read from the mount table, not assumed), this user may write there, and
it has room (at least MIN_FREE_BYTES free; the store then keeps at most half of what is free, and
never more than `--kv-store-bytes`). Keyed by the listen address, so that a verifier restarted at
the same address finds its checkpoints again, while two verifiers on one node (two ports) never
share a folder. `--port 0` gets none: the port is chosen when the socket binds, and a restart would
not come back at it (tests run on port 0, so a test never restores another's cells). The default
is for the llama.cpp backend with `--batching on` only (its shared KV cache is what is
checkpointed); elsewhere there is none, and the start-up log says why.

Standard library only: the CLI decides this before a model loads.
"""
from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path
from typing import NamedTuple

SHM = Path("/dev/shm")
MIN_FREE_BYTES = 256 << 20   # below that (Docker's default /dev/shm is 64 MiB) a few sessions would fill it


class StoreChoice(NamedTuple):
    folder: str | None     # where checkpoints go; None: no KV store
    max_bytes: int         # the most bytes of checkpoints kept there
    why: str               # for the start-up log: which folder and why, or why none


def address_folder(host: str, port: int, shm: Path = SHM) -> Path:
    """The default folder of the verifier listening on host:port (whether or not it is used)."""
    safe_host = re.sub(r"[^A-Za-z0-9.-]", "_", host) or "_"
    return shm / f"hybridspec-kv-{os.getuid()}" / f"{safe_host}_{port}"


def mount_type(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The file system type of the mount that holds `path` (the longest mount point above it), or
    None when the mount table cannot be read (not Linux)."""
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), "", None
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, line.split(" - ", 1)[1].split()[0]
    return kind


def choose_store(option: str | None, *, backend: str, batching: bool, host: str, port: int, max_bytes: int,
                 max_age_s: float, shm: Path | None = None) -> StoreChoice:
    """The KV store folder for these serve options. An explicit folder that cannot work here is
    refused (SystemExit); the default that cannot is simply none, with the reason."""
    shm = SHM if shm is None else shm
    if option == "off":
        return StoreChoice(None, max_bytes, "none (--kv-store off)")
    if option:
        if backend != "llama.cpp" or not batching:
            raise SystemExit("cloud-verifier: --kv-store is for the llama.cpp backend with --batching on (its shared "
                             "KV cache is what is checkpointed)")
        return StoreChoice(option, max_bytes, f"{option} (--kv-store)")
    if backend != "llama.cpp" or not batching:
        return StoreChoice(None, max_bytes, "none (it is for the llama.cpp backend with --batching on)")
    if port == 0:
        return StoreChoice(None, max_bytes, "none by default with --port 0 (a restart would not come back at that "
                                            "address); give --port, or --kv-store DIR")
    kind = mount_type(shm)
    if kind != "tmpfs":
        return StoreChoice(None, max_bytes, f"none: {shm} is not a tmpfs here ("
                                            f"{'no mount table' if kind is None else kind}); give --kv-store DIR")
    try:
        st = os.statvfs(shm)
    except OSError as e:
        return StoreChoice(None, max_bytes, f"none: {shm} cannot be read ({e}); give --kv-store DIR")
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        return StoreChoice(None, max_bytes, f"none: {shm} has {free >> 20} MiB free, under {MIN_FREE_BYTES >> 20} "
                                            "MiB (a container's default: give it a larger /dev/shm)")
    folder = address_folder(host, port, shm)
    problem = _own_private_folder(folder.parent)
    if problem:
        return StoreChoice(None, max_bytes, f"none: {problem}; give --kv-store DIR")
    _sweep_old(folder.parent, max_age_s)
    budget = min(max_bytes, free // 2)
    return StoreChoice(str(folder), budget, f"{folder} (the default: {shm} is a tmpfs with {free >> 20} MiB free; "
                                            f"at most {budget >> 20} MiB of checkpoints)")


def _own_private_folder(top: Path) -> str | None:
    """Make `top` (mode 0700) or check that it is this user's, private, and not a link: another
    user who could write there could plant cells. None when fine, else what is wrong."""
    try:
        top.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(top)
    except OSError as e:
        return f"{top} cannot be made ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return f"{top} is not a private folder of this user"
    if not os.access(top, os.W_OK | os.X_OK):
        return f"{top} is not writable"
    return None


def _sweep_old(top: Path, max_age_s: float) -> None:
    """Delete checkpoints under `top` not written for `max_age_s` (the session TTL), in every
    address's folder: those of a verifier that never came back would hold tmpfs memory until the
    node restarts. A live verifier rewrites its sessions' files every few seconds."""
    now = time.time()
    for path in top.glob("*/*/*/*"):   # <address>/<fingerprint>/<tenant>/<file>
        try:
            if path.is_file() and now - path.stat().st_mtime > max_age_s:
                path.unlink()
        except OSError:
            continue
