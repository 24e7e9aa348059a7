"""The KV store's folder by default (cloud_verifier.kvstore_choice): a folder per listen address on
the node's tmpfs, found again by a verifier restarted at that address, never shared by two
addresses, none with --port 0, and none (with the reason) where /dev/shm is no tmpfs, too small
or not this user's."""
from __future__ import annotations

import os
import time

import pytest

from cloud_verifier import kvstore_choice
from cloud_verifier.cli import backend_from_args, build_parser
from cloud_verifier.kvstore_choice import MIN_FREE_BYTES, address_folder, choose_store, mount_type

MOUNTINFO = """\
22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
25 22 0:23 / /dev/shm rw,nosuid,nodev - tmpfs tmpfs rw,size=24683784k
26 22 0:24 / /run/my\\040data rw - tmpfs tmpfs rw
27 22 0:25 / /dev/shmother rw - ext4 /dev/sdb rw
"""


def test_the_mount_type_is_that_of_the_longest_mount_point_above_the_path(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text(MOUNTINFO)
    assert mount_type("/dev/shm", str(info)) == "tmpfs"
    assert mount_type("/dev/shm/a/b", str(info)) == "tmpfs"
    assert mount_type("/dev/shmother/x", str(info)) == "ext4"   # a name that starts alike is another mount
    assert mount_type("/run/my data/x", str(info)) == "tmpfs"   # an escaped space in a mount point
    assert mount_type("/home/x", str(info)) == "ext4"           # control: only the root is above it
    assert mount_type("/dev/shm", str(tmp_path / "missing")) is None


def _choose(shm, port=50051, host="127.0.0.1", option=None, **kw):
    args = dict(backend="llama.cpp", batching=True, host=host, port=port, max_bytes=1 << 30, max_age_s=600.0)
    return choose_store(option, **{**args, **kw}, shm=shm)


@pytest.fixture
def tmpfs(tmp_path, monkeypatch):
    """tmp_path standing for /dev/shm, read as a tmpfs."""
    monkeypatch.setattr(kvstore_choice, "mount_type", lambda path: "tmpfs" if path == tmp_path else "ext4")
    return tmp_path


def test_the_default_is_a_private_folder_per_address_found_again_at_the_same_one(tmpfs):
    first = _choose(tmpfs)
    assert first.folder == str(tmpfs / f"hybridspec-kv-{os.getuid()}" / "127.0.0.1_50051")
    assert _choose(tmpfs).folder == first.folder                       # a restart at the same address
    others = {_choose(tmpfs, port=50052).folder, _choose(tmpfs, host="10.0.0.7").folder,
              _choose(tmpfs, host="::1").folder}
    assert first.folder not in others and len(others) == 3             # two verifiers of one node never share
    assert "/" not in os.path.basename(_choose(tmpfs, host="::1").folder)
    assert os.stat(tmpfs / f"hybridspec-kv-{os.getuid()}").st_mode & 0o777 == 0o700
    assert 0 < first.max_bytes <= 1 << 30 and first.folder in first.why


def test_none_by_default_on_port_0_off_elsewhere_and_without_a_tmpfs(tmp_path, tmpfs):
    for choice in (_choose(tmpfs, port=0), _choose(tmpfs, option="off"), _choose(tmpfs, backend="vllm"),
                   _choose(tmpfs, backend="synthetic"), _choose(tmpfs, batching=False),
                   _choose(tmpfs / "not-a-tmpfs")):
        assert choice.folder is None and choice.why.startswith("none")
    assert "--port 0" in _choose(tmpfs, port=0).why
    assert "not a tmpfs" in _choose(tmpfs / "not-a-tmpfs").why
    assert _choose(tmpfs, option=str(tmp_path / "mine")).folder == str(tmp_path / "mine")   # explicit: as given
    with pytest.raises(SystemExit, match="--kv-store is for the llama.cpp backend"):
        _choose(tmpfs, option=str(tmp_path / "mine"), batching=False)


def test_a_small_tmpfs_gets_none_and_a_large_one_keeps_at_most_half_its_free_room(tmpfs, monkeypatch):
    class Vfs:
        f_frsize = 4096
        f_bavail = 0
    monkeypatch.setattr(kvstore_choice.os, "statvfs", lambda path: Vfs)
    Vfs.f_bavail = (64 << 20) // 4096                         # Docker's default /dev/shm
    small = _choose(tmpfs)
    assert small.folder is None and "64 MiB free" in small.why
    Vfs.f_bavail = (MIN_FREE_BYTES + (256 << 20)) // 4096     # 512 MiB: at most 256 MiB of checkpoints
    assert _choose(tmpfs).max_bytes == (MIN_FREE_BYTES + (256 << 20)) // 2
    assert _choose(tmpfs, max_bytes=1 << 20).max_bytes == 1 << 20


def test_a_top_folder_others_may_write_is_not_used(tmpfs):
    top = tmpfs / f"hybridspec-kv-{os.getuid()}"
    top.mkdir(mode=0o777)
    os.chmod(top, 0o777)
    choice = _choose(tmpfs)
    assert choice.folder is None and "not a private folder" in choice.why
    os.chmod(top, 0o700)                                      # control: the same folder, private
    assert _choose(tmpfs).folder is not None


def test_old_checkpoints_of_any_address_are_swept_at_start_and_recent_ones_kept(tmpfs):
    gone = address_folder("127.0.0.1", 7001, tmpfs) / "fp" / "tenant" / "a.kv"
    recent = address_folder("127.0.0.1", 7002, tmpfs) / "fp" / "tenant" / "b.kv"
    gone.parents[3].mkdir(mode=0o700)
    for path in (gone, recent):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
    old = time.time() - 700
    os.utime(gone, (old, old))
    _choose(tmpfs, max_age_s=600.0)
    assert not gone.exists() and recent.exists()


def test_serve_hands_the_default_folder_to_the_llama_backend_and_none_on_port_0(tmpfs, monkeypatch):
    loaded = []
    monkeypatch.setattr("cloud_verifier.backends.load_backend", lambda kind, path, **kw: loaded.append(kw))
    monkeypatch.setattr("llama_runtime.find_model", lambda name: "model.gguf")
    monkeypatch.setattr(kvstore_choice, "SHM", tmpfs)
    for argv in (["--port", "7100"], ["--port", "0"], ["--port", "7100", "--kv-store", "off"]):
        backend_from_args(build_parser().parse_args(["serve", *argv]))
    assert [kw["kv_store"] for kw in loaded] == [str(address_folder("127.0.0.1", 7100, tmpfs)), None, None]
