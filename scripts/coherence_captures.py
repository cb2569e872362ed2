#!/usr/bin/env python3
"""Make the coherence captures in tests/captures from real registry data (tests/captures/CAPTURES.md
gives the exact commands that produced the inputs).

  closure: pip `--report` JSON files (from `pip install --dry-run --ignore-installed --report ...`)
           -> each distribution's name, version, Requires-Dist, Requires-Python, Provides-Extra and
              wheel file name (everything else of the report, descriptions included, is dropped).
  abi:     unpacked real sglang-kernel and torch wheels -> for each sglang-kernel common_ops variant its
           DT_NEEDED and the undefined symbols torch must provide (deploy/remote/host/elfsyms.py's rule),
           and for each torch its libraries' DT_NEEDED/SONAME and which of those symbols each exports.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploy.remote.host import elfsyms  # noqa: E402


def _dist(item: dict) -> dict:
    m = item["metadata"]
    return {"name": m["name"], "version": m["version"], "requires_dist": m.get("requires_dist") or [],
            "requires_python": m.get("requires_python"), "provides_extra": m.get("provides_extra") or [],
            "metadata_version": m.get("metadata_version"),
            "wheel": item["download_info"]["url"].rsplit("/", 1)[-1]}


def closure(args) -> dict:
    main = json.loads(Path(args.report).read_text())
    out = {"schema": 1, "requested": args.requested, "pip_version": main["pip_version"],
           "environment": main["environment"],
           "distributions": sorted((_dist(i) for i in main["install"]), key=lambda d: d["name"].lower()),
           "alternates": []}
    for extra in args.alternate:
        for i in json.loads(Path(extra).read_text())["install"]:
            out["alternates"].append(_dist(i))
    return out


def _parse_pairs(values: list[str]) -> dict[str, Path]:
    out = {}
    for v in values:
        key, _, path = v.partition("=")
        out[key] = Path(path)
    return out


def abi(args) -> dict:
    kernels = _parse_pairs(args.kernel)
    torches = _parse_pairs(args.torch)
    out = {"schema": 1, "rule": "elfsyms.is_torch_symbol", "sglang_kernel": {}, "torch": {}}
    wanted: set[str] = set()
    for version, root in kernels.items():
        variants = {}
        for variant in ("sm90", "sm100"):
            so = next((root / "sgl_kernel" / variant).glob("common_ops.*.so"))
            info = elfsyms.read_elf(str(so))
            undef = sorted({n for n, v, weak in info["undefined"] if not weak and elfsyms.is_torch_symbol(n)})
            assert all(v is None for n, v, _ in info["undefined"] if n in undef), "torch symbols are unversioned"
            wanted.update(undef)
            variants[variant] = {"path": str(so.relative_to(root)), "needed": info["needed"],
                                 "torch_undefined": undef,
                                 "undefined_total": len(info["undefined"])}
        out["sglang_kernel"][version] = variants
    for version, root in torches.items():
        lib = root / "torch" / "lib"
        libs = {}
        for so in sorted(lib.glob("*.so*")):
            if not so.name.startswith(elfsyms.TORCH_LIB_PREFIXES):
                continue
            info = elfsyms.read_elf(str(so))
            names = {n for n, v in info["defined"]}
            libs[so.name] = {"soname": info["soname"],
                             "needed": [n for n in info["needed"] if n.startswith(elfsyms.TORCH_LIB_PREFIXES)],
                             "exports_total": len(names),
                             "exports": sorted(names & wanted)}
        vp = (root / "torch" / "version.py").read_text()
        out["torch"][version] = {"version_py": vp, "libraries": libs}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("closure")
    c.add_argument("report")
    c.add_argument("--requested", required=True)
    c.add_argument("--alternate", action="append", default=[], help="a --no-deps report of one more dist")
    c.add_argument("-o", "--output", required=True)
    a = sub.add_parser("abi")
    a.add_argument("--kernel", action="append", default=[], help="VERSION=unpacked sglang-kernel wheel dir")
    a.add_argument("--torch", action="append", default=[], help="VERSION=unpacked torch wheel dir")
    a.add_argument("-o", "--output", required=True)
    args = ap.parse_args(argv)
    data = closure(args) if args.cmd == "closure" else abi(args)
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if args.output.endswith(".gz"):
        # mtime=0: the same input gives the same bytes
        with open(args.output, "wb") as fh, gzip.GzipFile(fileobj=fh, mode="wb", mtime=0, filename="") as gz:
            gz.write(text.encode())
    else:
        Path(args.output).write_text(text)
    print(f"{args.output}: {os.path.getsize(args.output)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
