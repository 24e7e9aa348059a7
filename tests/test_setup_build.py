"""scripts/llama_build.py: CPU features in, llama.cpp flags out; the smoke test's rebuild path.

The flag choice decides whether the README's first command works on a machine at all (an
AVX-512 build dies with SIGILL on an AVX2-only EPYC, a native build in the AMX kernels on a
Sapphire Rapids VM), so each CPU family we know is a literal case here.
"""
from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("llama_build", ROOT / "scripts" / "llama_build.py")
lb = importlib.util.module_from_spec(_spec)
sys.modules["llama_build"] = lb
_spec.loader.exec_module(lb)

# /proc/cpuinfo flag words of the machines we meet (trimmed to what matters, order as Linux prints).
V3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx avx2 fma f16c bmi1 bmi2 aes pclmulqdq"
AMD_EPYC_AVX2 = V3 + " sse4a abm"                                  # Zen 2/3 VMs: no AVX-512
AVX512 = " avx512f avx512dq avx512cd avx512bw avx512vl"
AMD_EPYC_ZEN4 = V3 + AVX512 + " avx512ifma avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni"
INTEL_SPR = V3 + AVX512 + " avx512_bf16 avx512vbmi avx512_vnni avx_vnni amx_bf16 amx_tile amx_int8"
OLD_SSE42 = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt"
ARM = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"


def flags(plan) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in plan.cmake_args)


def test_amd_avx2_only_gets_x86_64_v3_and_no_avx512():
    plan = lb.choose_build("x86_64", set(AMD_EPYC_AVX2.split()))
    f = flags(plan)
    assert plan.tag == "x86-64-v3"
    assert f["GGML_NATIVE"] == "OFF"
    assert all(f[k] == "ON" for k in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2", "GGML_AVX"))
    assert all(v == "OFF" for k, v in f.items() if "AVX512" in k or "AMX" in k)


def test_sapphire_rapids_gets_avx512_but_never_amx():
    plan = lb.choose_build("x86_64", set(INTEL_SPR.split()))
    f = flags(plan)
    assert f["GGML_AVX512"] == "ON" and f["GGML_AVX512_VNNI"] == "ON" and f["GGML_AVX512_BF16"] == "ON"
    assert f["GGML_AVX_VNNI"] == "ON"
    assert f["GGML_AMX_TILE"] == f["GGML_AMX_INT8"] == f["GGML_AMX_BF16"] == "OFF"
    assert f["GGML_NATIVE"] == "OFF"
    assert "AMX" in plan.why  # the log says it was seen and left out


def test_zen4_gets_its_avx512_variants():
    f = flags(lb.choose_build("x86_64", set(AMD_EPYC_ZEN4.split())))
    assert f["GGML_AVX512"] == f["GGML_AVX512_VBMI"] == f["GGML_AVX512_VNNI"] == f["GGML_AVX512_BF16"] == "ON"
    assert f["GGML_AVX_VNNI"] == "OFF"  # Zen 4 has AVX512-VNNI but not the VEX-coded AVX-VNNI


def test_incomplete_avx512_is_not_used():
    # avx512f alone (some hypervisors mask BW/VL): ggml's AVX512 path would need them
    f = flags(lb.choose_build("x86_64", set((V3 + " avx512f").split())))
    assert f["GGML_AVX512"] == "OFF"


def test_without_avx2_the_build_drops_to_sse42():
    plan = lb.choose_build("x86_64", set(OLD_SSE42.split()))
    f = flags(plan)
    assert plan.tag == "x86-64-v2" and plan.baseline
    assert f["GGML_SSE42"] == "ON" and f["GGML_AVX"] == "OFF" and f["GGML_AVX2"] == "OFF"


def test_arm_uses_llamacpp_defaults_and_its_features_key_the_wheel():
    plan = lb.choose_build("aarch64", set(ARM.split()))
    assert plan.arch == "aarch64" and plan.cmake_args == ()
    assert not any("AVX" in a for a in plan.cmake_args)
    other = lb.choose_build("arm64", set((ARM + " i8mm sve").split()))
    assert other.arch == "aarch64"
    assert other.key != plan.key  # a native ARM build is only reused on an ARM CPU with the same features
    assert lb.baseline_build("aarch64", set()).cmake_args == ("-DGGML_NATIVE=OFF",)


def test_each_flag_set_has_its_own_wheel_folder():
    keys = {lb.choose_build("x86_64", set(s.split())).wheel_dir
            for s in (AMD_EPYC_AVX2, AMD_EPYC_ZEN4, INTEL_SPR, OLD_SSE42)}
    assert len(keys) == 4


def test_cpuinfo_is_parsed_for_x86_and_arm():
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma\nbugs\t\t: sysret_ss_attrs\n"
    assert lb.read_cpu_features(x86) == {"fpu", "avx2", "fma"}
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd asimddp\nCPU implementer\t: 0x41\n"
    assert lb.read_cpu_features(arm) == {"fp", "asimd", "asimddp"}


def test_plan_cli_takes_features_as_input():
    out = lb.main  # the CLI is what a person runs: plan --arch --features prints JSON
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert out(["plan", "--arch", "x86_64", "--features", AMD_EPYC_AVX2]) == 0
    plan = json.loads(buf.getvalue())
    assert plan["tag"] == "x86-64-v3" and "-DGGML_AVX512=OFF" in plan["cmake_args"]


# ---- the smoke test and the rebuild path -------------------------------------------------------


def _fake_python(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "fakepython"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_smoke_test_tells_sigill_from_other_crashes(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    assert lb.smoke_test(_fake_python(tmp_path, "kill -ILL $$"), model)[0] == "sigill"
    assert lb.smoke_test(_fake_python(tmp_path, "echo boom >&2; exit 3"), model)[0] == "crash"
    ok = _fake_python(tmp_path, 'echo \'{"ok": true, "decode_tok_s": 50.0}\'')
    assert lb.smoke_test(ok, model) == ("ok", {"ok": True, "decode_tok_s": 50.0})


class FakeSteps:
    """Build/install/smoke stand-ins: a library 'runs' unless its plan is in `dies`."""

    def __init__(self, dies: set[str], status: str = "sigill"):
        self.dies, self.status = dies, status
        self.built: list[str] = []
        self.installed: list[Path] = []

    def build(self, py, plan, dest):
        dest.mkdir(parents=True, exist_ok=True)
        whl = dest / "llama_cpp_python-0.3.36-cp311-cp311-linux_x86_64.whl"
        whl.write_text(plan.tag)
        self.built.append(plan.tag)
        return whl

    def install(self, py, wheel):
        self.installed.append(wheel)

    def smoke(self, py, model):
        tag = self.installed[-1].read_text() if self.installed else None
        return (self.status, {}) if tag in self.dies else ("ok", {"decode_tok_s": 1.0})


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(lb, "CACHE_ROOT", tmp_path / "wheels")
    venv = tmp_path / "venv"
    venv.mkdir()
    return venv


def test_a_library_that_dies_with_sigill_is_replaced_by_the_baseline(cache, capsys):
    feats = set(INTEL_SPR.split())
    plan = lb.choose_build("x86_64", feats)
    steps = FakeSteps(dies={plan.tag})
    out = lb.ensure(cache, plan, lambda: None, feats, build=steps.build, install=steps.install, smoke=steps.smoke)
    assert steps.built == [plan.tag, "x86-64-v3"]
    assert out.rebuilt_at_baseline and out.plan.tag == "x86-64-v3"
    assert steps.installed[-1].read_text() == "x86-64-v3"  # what stays installed is the one that runs
    assert not plan.wheel_dir.exists()  # the crashing wheel is never offered again on this machine
    assert json.loads((cache / lb.STAMP_NAME).read_text())["tag"] == "x86-64-v3"
    err = capsys.readouterr().err
    assert "rebuilding at the x86-64-v3 baseline without any cache" in err
    assert len([line for line in err.splitlines() if "rebuilding" in line]) == 1  # one line, as promised


def test_a_good_cached_wheel_is_reused_and_an_installed_one_only_checked(cache):
    feats = set(AMD_EPYC_AVX2.split())
    plan = lb.choose_build("x86_64", feats)
    steps = FakeSteps(dies=set())
    lb.ensure(cache, plan, lambda: None, feats, build=steps.build, install=steps.install, smoke=steps.smoke)
    assert steps.built == ["x86-64-v3"]
    (cache / lb.STAMP_NAME).unlink()  # a fresh venv on the same machine: the wheel is reused, not rebuilt
    lb.ensure(cache, plan, lambda: None, feats, build=steps.build, install=steps.install, smoke=steps.smoke)
    assert steps.built == ["x86-64-v3"] and len(steps.installed) == 2
    lb.ensure(cache, plan, lambda: None, feats, build=steps.build, install=steps.install, smoke=steps.smoke)
    assert len(steps.installed) == 2  # stamp matches and the smoke test passes: nothing to do


def test_an_installed_library_that_stops_working_is_replaced(cache):
    feats = set(AMD_EPYC_ZEN4.split())
    plan = lb.choose_build("x86_64", feats)
    steps = FakeSteps(dies=set())
    lb.ensure(cache, plan, lambda: None, feats, build=steps.build, install=steps.install, smoke=steps.smoke)
    steps.dies = {plan.tag}  # e.g. the venv was copied to another machine
    out = lb.ensure(cache, plan, lambda: None, feats, build=steps.build, install=steps.install, smoke=steps.smoke)
    assert out.rebuilt_at_baseline and steps.installed[-1].read_text() == "x86-64-v3"


def test_set_up_never_ends_with_a_library_that_crashes(cache):
    feats = set(AMD_EPYC_AVX2.split())
    plan = lb.choose_build("x86_64", feats)
    steps = FakeSteps(dies={"x86-64-v3"})
    with pytest.raises(lb.SetupError, match="What to do"):
        lb.ensure(cache, plan, lambda: None, feats, build=steps.build, install=steps.install, smoke=steps.smoke)
    assert not (cache / lb.STAMP_NAME).exists()


def test_this_venv_holds_the_build_chosen_for_this_cpu():
    """The environment running these tests went through the same set-up."""
    stamp = Path(sys.prefix) / lb.STAMP_NAME
    if not stamp.exists():
        pytest.skip(f"{sys.prefix} was not made by scripts/setup.sh")
    got = json.loads(stamp.read_text())
    want, _ = lb.this_machine_plan()
    assert got["key"] in (want.key, lb.baseline_build(want.arch, lb.read_cpu_features()).key)
    assert got["smoke"]["ok"] is True


def test_setup_scripts_hard_code_no_instruction_set():
    for script in ("setup.sh", "setup_vllm.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert "GGML_AVX512=ON" not in text and "GGML_NATIVE=ON" not in text and "march=native" not in text
        assert "llama_build.py ensure" in text  # one place decides the flags for both environments
    assert os.access(ROOT / "scripts" / "llama_build.py", os.R_OK)


def test_two_set_ups_at_once_build_the_wheel_once(cache, tmp_path):
    """A second set-up on the same machine (another venv or clone) waits for the first build."""
    import threading
    import time as _time
    feats = set(AMD_EPYC_AVX2.split())
    plan = lb.choose_build("x86_64", feats)
    steps = FakeSteps(dies=set())
    slow_build = steps.build

    def build(py, p, dest):
        _time.sleep(0.5)
        return slow_build(py, p, dest)

    venvs = [tmp_path / "v1", tmp_path / "v2"]
    threads = []
    for v in venvs:
        v.mkdir()
        threads.append(threading.Thread(target=lb.ensure, args=(v, plan, lambda: None, feats),
                                        kwargs=dict(build=build, install=steps.install, smoke=steps.smoke)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert steps.built == ["x86-64-v3"] and len(steps.installed) == 2
