"""hybridspec.machine: what a report says of the machine, from /proc/cpuinfo as each CPU family
writes it (literal excerpts)."""
from __future__ import annotations

from hybridspec import machine

AMD_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu sse4_2 avx f16c fma avx2 bmi2 sha_ni
"""
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni avx512_bf16 avx512vbmi amx_tile amx_int8 amx_bf16
"""
ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm asimddp i8mm bf16
CPU implementer\t: 0x41
"""


def test_cpu_model_and_kernel_features_per_family():
    assert machine.cpu_model(AMD_AVX2) == "AMD EPYC"
    assert machine.cpu_features(AMD_AVX2) == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert machine.cpu_model(SAPPHIRE_RAPIDS) == "Intel(R) Xeon(R) Platinum 8480+"
    assert {"avx512f", "avx512_bf16", "amx_tile"} <= set(machine.cpu_features(SAPPHIRE_RAPIDS))
    assert machine.cpu_features(ARM) == ["asimd", "asimddp", "i8mm", "bf16"]


def test_summary_says_when_there_is_no_avx512():
    base = {"cpu_model": "AMD EPYC", "arch": "x86_64", "cores": 2, "numpy_simd": None}
    assert "no AVX-512" in machine.summary({**base, "cpu_features": machine.cpu_features(AMD_AVX2)})
    spr = machine.summary({**base, "cpu_model": "Xeon", "cpu_features": machine.cpu_features(SAPPHIRE_RAPIDS)})
    assert "AVX512F" in spr and "no AVX-512" not in spr
    arm = machine.summary({**base, "arch": "aarch64", "cpu_features": machine.cpu_features(ARM)})
    assert "ASIMD" in arm and "AVX" not in arm


def test_describe_this_machine():
    m = machine.describe()
    assert m["cores"] and m["arch"] and m["cpu_model"]
    simd = m["numpy_simd"]
    assert simd is not None and simd["numpy"]
    # What --numpy-avx2 would turn off is a subset of what numpy runs here, and only AVX-512 targets.
    off = machine.numpy_avx512_features()
    assert set(off) <= set(simd["dispatched"]) and all(f.startswith("AVX512") or f == "X86_V4" for f in off)
