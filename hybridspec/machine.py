"""What machine a figure or a test run came from: CPU model and the features that change results.

Figures measured here differ between CPU families (llama.cpp's kernels, numpy's SIMD dispatch
picks AVX-512, AVX2 or NEON paths, and float32 results differ in their last bits), and between an
idle and a busy machine. Every benchmark result and every `netsim load` report records
`describe()`, so that a figure travels with the machine that produced it.

Standard library only (numpy is asked, not required): imported by netsim, bench and the test
scripts alike, and it imports nothing of ours.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

# The CPU feature words that decide which kernels llama.cpp and numpy run (x86 and ARM names as
# /proc/cpuinfo spells them). Everything else in the flags line is left out of reports.
KERNEL_FEATURES = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni",
    "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512vbmi",
    "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "asimddp", "i8mm", "bf16", "sve", "sve2",
)


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name ('AMD EPYC', 'Intel(R) Xeon(R) Platinum 8480+', ...)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("model name", "cpu model", "hardware") and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """Every feature word of the first processor in /proc/cpuinfo ('flags' on x86, 'Features' on
    ARM); what scripts/llama_build.py chooses llama.cpp's build from."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return set(value.split())
    return set()


def cpu_features(cpuinfo: str | None = None) -> list[str]:
    """The kernel-relevant features of the first processor, in KERNEL_FEATURES' order."""
    words = cpu_flags(cpuinfo)
    return [f for f in KERNEL_FEATURES if f in words]


def cpu_stall_us() -> float | None:
    """Microseconds, since boot, in which some runnable task waited for a CPU (Linux PSI 'some'
    total); None where the kernel does not report it. The difference over an interval, divided by
    its length, is the share of it the CPU was contended."""
    fields = _psi_some()
    return float(fields["total"]) if fields else None


def numpy_simd() -> dict | None:
    """numpy's SIMD dispatch on this machine: the features it found and uses, and what
    NPY_DISABLE_CPU_FEATURES took away (None without numpy)."""
    try:
        import numpy as np
        from numpy._core._multiarray_umath import __cpu_baseline__, __cpu_dispatch__, __cpu_features__
    except ImportError:
        try:
            import numpy as np
            from numpy.core._multiarray_umath import __cpu_baseline__, __cpu_dispatch__, __cpu_features__
        except ImportError:
            return None
    return {"numpy": np.__version__, "baseline": list(__cpu_baseline__),
            "dispatched": [f for f in __cpu_dispatch__ if __cpu_features__.get(f)],
            "disabled": os.environ.get("NPY_DISABLE_CPU_FEATURES", "")}


def numpy_avx512_features() -> list[str]:
    """numpy's dispatch targets that need AVX-512 and that this CPU runs: what to put in
    NPY_DISABLE_CPU_FEATURES to make this machine run numpy's AVX2 paths (empty where the CPU has
    no AVX-512, or numpy has no such targets)."""
    simd = numpy_simd()
    if simd is None:
        return []
    return [f for f in simd["dispatched"] if f.startswith("AVX512") or f == "X86_V4"]


def _psi_some() -> dict | None:
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    return dict(f.split("=") for f in line.split()[1:])


def cpu_pressure() -> float | None:
    """Share (0-1) of the last 10 s in which some runnable task waited for a CPU (Linux PSI);
    None where the kernel does not report it."""
    fields = _psi_some()
    return float(fields["avg10"]) / 100.0 if fields else None


def describe() -> dict:
    """The machine, for a report: CPU model, architecture, cores, kernel features, numpy's SIMD
    dispatch, and how busy it was when asked."""
    return {
        "cpu_model": cpu_model(),
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "cpu_features": cpu_features(),
        "numpy_simd": numpy_simd(),
        "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "cpu_pressure_10s": cpu_pressure(),
        "python": platform.python_version(),
    }


def summary(machine: dict | None = None) -> str:
    """One line: 'AMD EPYC, x86_64, 2 cores, AVX2 FMA F16C, no AVX-512; numpy X86_V3'."""
    m = describe() if machine is None else machine
    feats = m.get("cpu_features") or []
    shown = [f.upper() for f in feats if f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile",
                                                 "asimd", "asimddp", "sve", "i8mm")]
    if m.get("arch") in ("x86_64", "AMD64") and "avx512f" not in feats:
        shown.append("no AVX-512")
    simd = m.get("numpy_simd") or {}
    numpy_part = ""
    if simd:
        top = simd["dispatched"][-1] if simd.get("dispatched") else (simd.get("baseline") or ["baseline"])[-1]
        numpy_part = f"; numpy {simd['numpy']} up to {top}"
        if simd.get("disabled"):
            numpy_part += f" (disabled: {simd['disabled']})"
    return f"{m.get('cpu_model')}, {m.get('arch')}, {m.get('cores')} cores, {' '.join(shown)}{numpy_part}"


def announce() -> dict:
    """For a benchmark: print the machine's one-line summary and return `describe()`, so that the
    figures that follow (and any file the benchmark writes) carry it."""
    machine = describe()
    print(f"Machine: {summary(machine)}", flush=True)
    return machine


def main() -> None:
    """`python -m hybridspec.machine`: the machine as JSON; `--summary`: one line; `--numpy-avx512`:
    the NPY_DISABLE_CPU_FEATURES value that turns numpy's AVX-512 paths off here."""
    import json
    import sys
    if "--numpy-avx512" in sys.argv:
        print(" ".join(numpy_avx512_features()))
    elif "--summary" in sys.argv:
        print(summary())
    else:
        print(json.dumps(describe(), indent=1))


if __name__ == "__main__":
    main()
