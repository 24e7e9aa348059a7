"""The generated stubs must match proto/ (scripts/gen_protos.py --check)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stubs_match_the_proto():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr


def test_every_proto_field_has_a_comment():
    lines = (ROOT / "proto" / "hybridspec" / "v1" / "verifier.proto").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        s = line.strip()
        is_field = s.endswith(";") and "=" in s and not s.startswith(("syntax", "package", "option", "//"))
        if is_field and "//" not in s and not lines[i - 1].strip().startswith("//"):
            # enum values and fields documented on the line before or at the end of the line
            missing.append(f"{i + 1}: {s}")
    assert not missing, "fields without a comment:\n" + "\n".join(missing)
