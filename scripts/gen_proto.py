#!/usr/bin/env python3
"""Regenerate (or check) the committed protobuf code.

Why a pinned old generator: gencode from grpcio-tools 1.62.x (protobuf 4.25.1) has no runtime
version check and imports on protobuf 4.25 through 7.x, so we can declare a wide runtime range
and never force a protobuf upgrade on a training image. Newer generators embed a check that
refuses older runtimes.

Usage (in an environment with ``grpcio-tools==1.62.3``, e.g. ``tox -e proto``)::

    python scripts/gen_proto.py           # rewrite the generated files
    python scripts/gen_proto.py --check   # exit 1 if the committed files are stale
"""

from __future__ import annotations

import argparse
import filecmp
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = "grpcio-tools==1.62.3"

# (proto root, proto file relative to it, output dir, generate grpc stubs?)
TARGETS = [
    (ROOT / "proto", "nicswitch_agent/_pb/recover.proto", ROOT / "src", False),
    (ROOT / "tests/interop/upstream", "recover.proto", ROOT / "tests/interop/upstream", True),
]
STAMP = ROOT / "src/nicswitch_agent/_pb/_stamp.py"


def proto_sha256() -> str:
    return hashlib.sha256((ROOT / "proto/nicswitch_agent/_pb/recover.proto").read_bytes()).hexdigest()


def stamp_text() -> str:
    return (
        '"""Which .proto the committed gencode was made from (checked by tests/test_proto.py)."""\n\n'
        f'PROTO_SHA256 = "{proto_sha256()}"\n'
        f'GENERATOR = "{GENERATOR}"\n'
    )


def outputs(proto: str, grpc: bool) -> list[str]:
    stem = proto[: -len(".proto")]
    names = [f"{stem}_pb2.py", f"{stem}_pb2.pyi"]
    if grpc:
        names.append(f"{stem}_pb2_grpc.py")
    return names


def generate(out_root: Path) -> None:
    from grpc_tools import protoc  # type: ignore[import-untyped]

    for include, proto, out, grpc in TARGETS:
        dest = out_root / out.relative_to(ROOT)
        dest.mkdir(parents=True, exist_ok=True)
        args = ["protoc", f"-I{include}", f"--python_out={dest}", f"--pyi_out={dest}"]
        if grpc:
            args.append(f"--grpc_python_out={dest}")
        args.append(str(include / proto))
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed for {proto}")
    stamp = out_root / STAMP.relative_to(ROOT)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(stamp_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    opts = parser.parse_args()
    if not opts.check:
        generate(ROOT)
        print("regenerated; commit the changes")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for _, proto, out, grpc in TARGETS:
            for name in outputs(proto, grpc):
                committed = out / name
                fresh = Path(tmp) / out.relative_to(ROOT) / name
                if not committed.exists() or not filecmp.cmp(committed, fresh, shallow=False):
                    stale.append(str(committed.relative_to(ROOT)))
        if STAMP.read_text() != stamp_text():
            stale.append(str(STAMP.relative_to(ROOT)))
        shutil.rmtree(tmp, ignore_errors=True)
    if stale:
        print("stale generated files (run scripts/gen_proto.py):", *stale, sep="\n  ")
        return 1
    print("generated files are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
