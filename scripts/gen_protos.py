#!/usr/bin/env python3
"""Generate the Python stubs in spec_core/proto/ from proto/ (the single source of truth).

    python scripts/gen_protos.py            # write the stubs
    python scripts/gen_protos.py --check    # exit 1 if the committed stubs drift from the .proto
"""
from __future__ import annotations

import argparse
import difflib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO = "hybridspec/v1/verifier.proto"
OUT = ROOT / "spec_core" / "proto"
FILES = ("verifier_pb2.py", "verifier_pb2.pyi", "verifier_pb2_grpc.py")


def generate(out_dir: Path) -> dict[str, str]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", PROTO]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        gen = Path(tmp) / "hybridspec" / "v1"
        texts = {}
        for name in FILES:
            text = (gen / name).read_text()
            # protoc writes imports relative to the proto root; the stubs live in spec_core.proto.
            text = text.replace("from hybridspec.v1 import verifier_pb2", "from spec_core.proto import verifier_pb2")
            texts[name] = text
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    texts = generate(OUT)
    if args.check:
        drift = False
        for name, text in texts.items():
            current = (OUT / name).read_text() if (OUT / name).exists() else ""
            if current != text:
                drift = True
                sys.stdout.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                           f"committed/{name}", f"generated/{name}"))
        if drift:
            print("stubs drift from proto/: run python scripts/gen_protos.py", file=sys.stderr)
        return 1 if drift else 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (OUT / name).write_text(text)
    print(f"wrote {', '.join(FILES)} to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
