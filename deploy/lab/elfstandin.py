"""LAB STAND-INS for torch's and sgl_kernel's shared objects, built from real captured symbol lists.

The lab has no GPU and no multi-GB wheels, but the deploy's native-extension check
(deploy/remote/host/elfsyms.py) reads real ELF files. So the lab's torch carries, under torch/lib,
shared objects with the real libraries' names, SONAMEs and torch-internal DT_NEEDED edges that define
(export) exactly the symbols the captured real torch 2.11.0 libraries export among those sgl_kernel
needs; and the lab's sgl_kernel carries sm90/ and sm100/ common_ops.abi3.so that import (undefined,
through data relocations the dynamic linker must resolve at load time, so even a lazy dlopen fails on
a missing one) exactly the torch symbols the real sglang-kernel's common_ops imports. The symbol lists
come from tests/captures/sgl-kernel-torch-abi.json (how it was made: tests/captures/CAPTURES.md).

They contain no code beyond a `ret` per function: loading them proves symbol resolution, nothing else.
Built with binutils (`as`, `ld`); no compiler needed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ABI_CAPTURE = ROOT / "tests" / "captures" / "sgl-kernel-torch-abi.json"
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_.$]*$")
_LIBNAME = re.compile(r"^lib[A-Za-z0-9_.+-]+\.so(\.[0-9]+)*$")


# A program (`python3 -c DLOPEN_CHECK TORCH_LIB EXTENSION`) that asks the real dynamic linker: it loads
# torch/lib's libraries globally, as `import torch` has them loaded, then the extension with RTLD_NOW,
# as Python imports one; prints LOADED or the linker's error ("... undefined symbol: NAME").
DLOPEN_CHECK = r"""
import ctypes, os, sys
lib, ext = sys.argv[1], sys.argv[2]
for n in ("libc10.so", "libtorch_cpu.so", "libc10_cuda.so", "libtorch_nvshmem.so", "libtorch_cuda.so", "libtorch.so"):
    ctypes.CDLL(os.path.join(lib, n), mode=ctypes.RTLD_GLOBAL)
try:
    ctypes.CDLL(ext, mode=os.RTLD_NOW)
    print("LOADED")
except OSError as exc:
    print(exc)
"""


class StandinError(RuntimeError):
    pass


def load_abi_capture(path: Path = ABI_CAPTURE) -> dict:
    return json.loads(Path(path).read_text())


def asm_source(defines: list[str], imports: list[str], note: str) -> str:
    """GNU as source of a stand-in: one global `ret` function (or zeroed object, for vtables,
    typeinfo and guard variables) per defined symbol, and a writable table of absolute addresses of
    every imported symbol (R_X86_64_64 dynamic relocations: resolved when the object is loaded)."""
    for s in list(defines) + list(imports):
        if not _SYMBOL.match(s):
            raise StandinError(f"not a plain symbol name: {s!r}")
    out = [f"# {note}", "\t.text"]
    objects = [s for s in defines if s.startswith(("_ZTV", "_ZTI", "_ZTS", "_ZTT", "_ZGV"))]
    for s in defines:
        if s in objects:
            continue
        out += [f"\t.globl {s}", f"\t.type {s}, @function", f"{s}:", "\tret", f"\t.size {s}, .-{s}"]
    if objects:
        out.append("\t.data")
        for s in objects:
            out += [f"\t.globl {s}", f"\t.type {s}, @object", "\t.balign 8", f"{s}:", "\t.quad 0",
                    f"\t.size {s}, 8"]
    if imports:
        out += ["\t.data", "\t.balign 8", "ddtree_lab_imports:"]
        out += [f"\t.quad {s}" for s in imports]
    out.append('\t.section .note.GNU-stack,"",@progbits')
    return "\n".join(out) + "\n"


def _tools() -> tuple[str, str]:
    as_, ld = shutil.which("as"), shutil.which("ld")
    if not as_ or not ld:
        raise StandinError("the lab's ELF stand-ins need binutils (as, ld): apt-get install binutils")
    return as_, ld


def build_shared(out: Path, soname: str | None, defines: list[str], imports: list[str], needed: list[Path],
                 note: str) -> Path:
    """Assemble and link one stand-in shared object at `out` (x86_64); no SONAME when `soname` is None
    (a Python extension has none)."""
    as_, ld = _tools()
    if soname is not None and not _LIBNAME.match(soname):
        raise StandinError(f"not a library name: {soname!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, obj = Path(tmp) / "s.s", Path(tmp) / "s.o"
        src.write_text(asm_source(defines, imports, note))
        for argv in ([as_, "--64", "-o", str(obj), str(src)],
                     [ld, "-shared", "-m", "elf_x86_64", "--hash-style=gnu",
                      *(["-soname", soname] if soname else []), "--no-as-needed",
                      "-o", str(out), str(obj), *[str(p) for p in needed]]):
            p = subprocess.run(argv, capture_output=True, text=True)
            if p.returncode != 0:
                raise StandinError(f"{Path(argv[0]).name} failed for {out.name}: {p.stderr.strip()[-800:]}")
    return out


def _order(libs: dict[str, dict]) -> list[str]:
    """Libraries in an order where each one's torch-internal DT_NEEDED are built before it."""
    done: list[str] = []
    pending = dict(libs)
    while pending:
        ready = [n for n, l in pending.items() if all(d in done or d not in libs for d in l["needed"])]
        if not ready:
            raise StandinError(f"DT_NEEDED cycle among {sorted(pending)}")
        for n in sorted(ready):
            done.append(n)
            del pending[n]
    return done


def build_torch_lib(out_dir: Path, torch_entry: dict, version: str) -> dict[str, Path]:
    """torch/lib stand-ins for one captured torch: each library with its SONAME, its torch-internal
    DT_NEEDED (linked in order), and exactly its captured exports."""
    libs = torch_entry["libraries"]
    built: dict[str, Path] = {}
    for name in _order(libs):
        lib = libs[name]
        built[name] = build_shared(out_dir / name, lib["soname"] or name, lib["exports"], [],
                                   [built[d] for d in lib["needed"] if d in built],
                                   f"LAB STAND-IN for torch {version} {name}: defines the captured exports only")
    return built


def build_common_ops(out: Path, variant_entry: dict, torch_lib: Path, version: str, variant: str) -> Path:
    """sgl_kernel/<variant>/common_ops.abi3.so stand-in: imports exactly the captured torch symbols of the
    real sglang-kernel `version`, DT_NEEDED on the same torch libraries as the real one."""
    needed = [torch_lib / n for n in variant_entry["needed"] if (torch_lib / n).exists()]
    return build_shared(out, None, [], variant_entry["torch_undefined"], needed,
                        f"LAB STAND-IN for sglang-kernel {version} {variant}/common_ops: imports its captured "
                        f"torch symbols only")
