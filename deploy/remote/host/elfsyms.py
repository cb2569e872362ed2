"""Which C++ symbols a native extension needs from torch, and whether the host's torch has them.

Stdlib only (struct + mmap): runs on fleet hosts, no GPU, nothing imported or loaded. It answers the
question behind SGLang's recurring "undefined symbol: _ZN3c10..." reports (sgl-kernel built for
another torch): read the extension's dynamic symbol table, keep the undefined symbols that torch must
provide, and look each one up in the exports of the torch libraries the dynamic linker would search.

The ELF64 reader takes what `ld.so` uses: DT_NEEDED, DT_SONAME, DT_RUNPATH/RPATH, the dynamic symbol
table (.dynsym/.dynstr) and the GNU symbol-version tables (.gnu.version, .gnu.version_r,
.gnu.version_d). It needs the section header table, which every wheel's shared objects keep.

Which undefined symbols are torch's to provide (`is_torch_symbol`), three cases:
1. an Itanium-mangled C++ name whose outermost scope is one of torch's own top-level namespaces
   (TORCH_NAMESPACES: c10, at, torch, caffe2, c10d). The scope is read from the mangling, not by a
   prefix match: `_ZN3c10...` (nested name), `_ZNK2at...` / `_ZNR5torch...` (const and ref-qualified
   members), `_ZTVN3c10...` / `_ZTIN...` / `_ZTSN...` (vtable, typeinfo, typeinfo name), `_ZThn8_N...` /
   `_ZTv0_n24_N...` (thunks), `_ZGVZN...` / `_ZZN...` (guard variables and statics local to a function
   of that namespace);
2. a mangled C++ name at global scope whose name starts with `THP` (libtorch_python's Python-binding
   API, e.g. THPVariable_Wrap);
3. an unmangled name with one of TORCH_C_PREFIXES: `aoti_torch_` and `torch_` (the stable C ABI
   shim that libtorch_cpu/libtorch_cuda export) and `THP` (libtorch_python's global objects, e.g.
   THPGeneratorClass, which sgl_kernel's infllm_ops imports).
Not torch's: other C symbols (libc, libcudart, libcuda, Python's C API), `std::` names and template
instantiations from libstdc++ even when their arguments are torch types (each object carries its own
weak copies), `__cxxabiv1::`, and the third-party code torch links in statically and happens to
export (fbgemm, gloo, tensorpipe, kineto, onnx_torch, cutlass, mkl ...), which is no API of torch.
Those come from system or CUDA libraries, and whether they resolve there is not this check's question.

Where the linker looks (`search_scope`): `import torch` first loads torch/lib/libtorch_global_deps.so
with RTLD_GLOBAL, then torch._C; an extension such as sgl_kernel's common_ops is dlopen'ed afterwards
with its own DT_NEEDED (libtorch.so, libc10.so, libc10_cuda.so, libtorch_cpu.so, libtorch_cuda.so, ...),
which the linker matches against already loaded objects by name. So the scope for torch's symbols is
the breadth-first DT_NEEDED closure of the extension plus that of libtorch_global_deps.so, restricted
to libraries that exist in torch/lib. A needed torch library that is missing there is reported too.
"""
from __future__ import annotations

import glob
import json
import mmap
import os
import re
import struct
import sys
from collections import deque

__all__ = ["ElfError", "parse_elf", "read_elf", "torch_namespace", "is_torch_symbol", "qualified_name",
           "search_scope", "unresolved", "check_extension", "sgl_kernel_common_ops",
           "torch_linked", "check_site", "sm_name", "startup_inputs", "TORCH_NAMESPACES", "TORCH_C_PREFIXES", "TORCH_LIB_PREFIXES"]

# Torch's own top-level C++ namespaces, as the exports of real torch 2.11.0 and 2.14.1 libraries show them
# (tests/captures/CAPTURES.md), and the prefixes of the unmangled names of its C ABI and Python bindings.
TORCH_NAMESPACES = frozenset({"c10", "at", "torch", "caffe2", "c10d"})
TORCH_C_PREFIXES = ("aoti_torch_", "torch_", "THP")
# torch/lib libraries that are torch's own (not the bundled libgomp).
TORCH_LIB_PREFIXES = ("libc10", "libtorch", "libcaffe2", "libshm")

SHT_DYNAMIC, SHT_DYNSYM = 6, 11
SHT_GNU_VERDEF, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 0x6FFFFFFD, 0x6FFFFFFE, 0x6FFFFFFF
DT_NULL, DT_NEEDED, DT_SONAME, DT_RPATH, DT_RUNPATH = 0, 1, 14, 15, 29
STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE = 1, 2, 10
STV_DEFAULT, STV_PROTECTED = 0, 3
STT_SECTION, STT_FILE = 3, 4
VER_FLG_BASE = 1
VERSYM_HIDDEN = 0x8000

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_DYN = struct.Struct("<qQ")
_VERNEED = struct.Struct("<HHIII")
_VERNAUX = struct.Struct("<IHHII")
_VERDEF = struct.Struct("<HHHHIII")
_VERDAUX = struct.Struct("<II")


class ElfError(ValueError):
    pass


def _cstr(buf, off: int) -> str:
    end = buf.find(b"\0", off)
    if off < 0 or off >= len(buf) or end < 0:
        raise ElfError(f"string offset {off} outside its table")
    return buf[off:end].decode("utf-8", "replace")


def parse_elf(data, symbols: bool = True) -> dict:
    """An ELF64 little-endian shared object (bytes or mmap) -> its dynamic linking facts:

    {"soname", "needed": [...], "runpath": [...], "rpath": [...],
     "undefined": [[name, version or None, weak], ...],  # what it needs from others
     "defined": [[name, version or None], ...]}          # what it exports (global/weak, default or
                                                          # protected visibility, not a hidden version)
    symbols=False reads the dynamic section only (undefined/defined stay empty).
    """
    if len(data) < _EHDR.size or bytes(data[:4]) != b"\x7fELF":
        raise ElfError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ElfError("only ELF64 little-endian objects are read (x86_64, aarch64)")
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, _) = _EHDR.unpack_from(data, 0)
    if shoff == 0:
        raise ElfError("no section header table")
    if shnum == 0:  # extended numbering: the count lives in section 0
        shnum = _SHDR.unpack_from(data, shoff)[5]
    if shentsize != _SHDR.size or shoff + shnum * shentsize > len(data):
        raise ElfError("section header table outside the file")
    secs = [_SHDR.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]

    def body(i):
        s = secs[i]
        off, size = s[4], s[5]
        if off + size > len(data):
            raise ElfError(f"section {i} outside the file")
        return bytes(data[off:off + size])  # a copy: no view may outlive an mmap

    by_type = {}
    for i, s in enumerate(secs):
        by_type.setdefault(s[1], i)
    out = {"soname": None, "needed": [], "runpath": [], "rpath": [], "undefined": [], "defined": []}
    if SHT_DYNAMIC in by_type:
        i = by_type[SHT_DYNAMIC]
        strtab = body(secs[i][6])
        for tag, val in _DYN.iter_unpack(body(i)[: (secs[i][5] // _DYN.size) * _DYN.size]):
            if tag == DT_NULL:
                break
            if tag == DT_NEEDED:
                out["needed"].append(_cstr(strtab, val))
            elif tag == DT_SONAME:
                out["soname"] = _cstr(strtab, val)
            elif tag == DT_RUNPATH:
                out["runpath"] = _cstr(strtab, val).split(":")
            elif tag == DT_RPATH:
                out["rpath"] = _cstr(strtab, val).split(":")
    if SHT_DYNSYM not in by_type or not symbols:
        return out
    si = by_type[SHT_DYNSYM]
    dynstr = body(secs[si][6])
    syms = body(si)
    nsyms = secs[si][5] // _SYM.size
    versym = None
    if SHT_GNU_VERSYM in by_type:
        vb = body(by_type[SHT_GNU_VERSYM])
        versym = struct.unpack_from(f"<{nsyms}H", vb) if len(vb) >= 2 * nsyms else None
    need_names: dict[int, str] = {}
    if SHT_GNU_VERNEED in by_type:
        i = by_type[SHT_GNU_VERNEED]
        vb, vstr = body(i), body(secs[i][6])
        off = 0
        for _ in range(secs[i][7]):  # sh_info: number of entries
            _, cnt, _, aux, nxt = _VERNEED.unpack_from(vb, off)
            a = off + aux
            for _ in range(cnt):
                _, _, other, name, anext = _VERNAUX.unpack_from(vb, a)
                need_names[other] = _cstr(vstr, name)
                if not anext:
                    break
                a += anext
            if not nxt:
                break
            off += nxt
    def_names: dict[int, str] = {}
    if SHT_GNU_VERDEF in by_type:
        i = by_type[SHT_GNU_VERDEF]
        vb, vstr = body(i), body(secs[i][6])
        off = 0
        for _ in range(secs[i][7]):
            _, flags, ndx, _, _, aux, nxt = _VERDEF.unpack_from(vb, off)
            if not flags & VER_FLG_BASE:  # the base entry names the file itself, not a version
                def_names[ndx] = _cstr(vstr, _VERDAUX.unpack_from(vb, off + aux)[0])
            if not nxt:
                break
            off += nxt
    for k, (st_name, info, other, shndx, _, _) in enumerate(_SYM.iter_unpack(syms[: nsyms * _SYM.size])):
        if k == 0 or not st_name:
            continue
        bind, typ = info >> 4, info & 0xF
        if bind not in (STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE) or typ in (STT_SECTION, STT_FILE):
            continue
        vs = versym[k] if versym else 1
        idx = vs & 0x7FFF
        name = _cstr(dynstr, st_name)
        if shndx == 0:
            out["undefined"].append([name, need_names.get(idx) if idx >= 2 else None, bind == STB_WEAK])
        elif other & 3 in (STV_DEFAULT, STV_PROTECTED) and idx != 0 and not vs & VERSYM_HIDDEN:
            out["defined"].append([name, def_names.get(idx) if idx >= 2 else None])
    return out


def read_elf(path: str, symbols: bool = True) -> dict:
    """parse_elf of a file, read through mmap (libtorch_cuda.so is ~0.5 GB; only its tables are touched)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < _EHDR.size:
            raise ElfError(f"{path}: not an ELF file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return parse_elf(mm, symbols)
            except ElfError as exc:
                raise ElfError(f"{path}: {exc}") from None


# ---------------------------------------------------------------- Itanium C++ names

def _number(s: str, i: int) -> tuple[int, int]:
    j = i
    while j < len(s) and s[j].isdigit():
        j += 1
    if j == i:
        raise ValueError
    return int(s[i:j]), j


def _skip_call_offset(s: str, i: int) -> int:
    """<call-offset> ::= h <nv-offset> _ | v <v-offset> _ ; offsets are [n]<number>."""
    kind = s[i]
    i += 1
    for _ in range(1 if kind == "h" else 2 if kind == "v" else 0):
        if s[i] == "n":
            i += 1
        _, i = _number(s, i)
        if s[i] != "_":
            raise ValueError
        i += 1
    if kind not in "hv":
        raise ValueError
    return i


def _outer_scope(s: str, i: int) -> str | None:
    """The outermost scope name of the <name>/<type>/<encoding> at s[i:] (None: not a scoped name)."""
    while True:
        c = s[i]
        if s.startswith(("TV", "TT", "TI", "TS", "GV", "GR", "TH", "TW"), i):
            i += 2                                     # vtable/VTT/typeinfo/name, guards, TLS: of a <name>
        elif s.startswith(("Th", "Tv"), i):
            i = _skip_call_offset(s, i + 1)            # thunks: call offset, then the target <encoding>
        elif s.startswith("Tc", i):
            i = _skip_call_offset(s, _skip_call_offset(s, i + 2))
        elif s.startswith("TC", i):
            i += 2                                     # construction vtable: TC <type> <number> _ <type>
        elif s.startswith(("GTt", "GTn"), i):
            i += 3
        elif c == "Z":
            i += 1                                     # local name: scope of the enclosing function
        elif c == "N":
            i += 1
            while s[i] in "rVK":
                i += 1
            if s[i] in "RO":
                i += 1
            if s.startswith("St", i) or s[i] == "S":
                return "std"                           # ::std or one of its abbreviations (Sa, Ss, ...)
            if s[i] == "L":
                i += 1
            n, j = _number(s, i)
            return s[j:j + n]
        elif s.startswith("St", i) or s.startswith(("Sa", "Sb", "Ss", "Si", "So", "Sd"), i):
            return "std"
        elif c == "L" or c.isdigit():
            return ""                                  # an unscoped (global) name
        else:
            return None


def torch_namespace(symbol: str) -> str | None:
    """The outermost C++ scope of an Itanium-mangled symbol ('' for global scope, 'std', 'c10', ...);
    None for a C symbol or a mangling this reader does not follow. A version suffix (@V) is ignored."""
    s = symbol.split("@", 1)[0]
    if not s.startswith("_Z") or len(s) < 3:
        return None
    try:
        return _outer_scope(s, 2)
    except (ValueError, IndexError):
        return None


def is_torch_symbol(symbol: str) -> bool:
    """Is this a symbol torch must provide? (the three cases of the module docstring)"""
    s = symbol.split("@", 1)[0]
    ns = torch_namespace(s)
    if ns in TORCH_NAMESPACES:
        return True
    if ns == "":                                       # global-scope C++ name: _Z<len><name>...
        i = 3 if s.startswith("_ZL") else 2
        try:
            n, j = _number(s, i)
        except (ValueError, IndexError):
            return False
        return s[j:j + n].startswith("THP")
    return ns is None and not s.startswith("_Z") and s.startswith(TORCH_C_PREFIXES)


_SPECIAL = {"TV": "vtable for ", "TT": "VTT for ", "TI": "typeinfo for ", "TS": "typeinfo name for ",
            "GV": "guard variable for ", "TH": "TLS init function for ", "TW": "TLS wrapper function for "}


def qualified_name(symbol: str) -> str:
    """A readable form of a mangled name for reports: 'c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture',
    'vtable for c10::StorageImpl', 'thunk to at::native::Foo::~Foo' (the source names of its nested name,
    constructors and destructors spelled out; template arguments and parameters left out). The symbol
    itself when it is not a mangled name this reader follows."""
    s = symbol.split("@", 1)[0]
    if not s.startswith("_Z"):
        return symbol
    try:
        i, label, local = 2, "", False
        while True:
            if s[i:i + 2] in _SPECIAL:
                label, i = label + _SPECIAL[s[i:i + 2]], i + 2
            elif s[i:i + 2] in ("Th", "Tv"):
                label, i = label + "thunk to ", _skip_call_offset(s, i + 1)
            elif s[i] == "Z":
                local, i = True, i + 1
            else:
                break
        parts: list[str] = []
        if s[i] == "L":
            i += 1
        if s[i].isdigit():
            n, j = _number(s, i)
            parts.append(s[j:j + n])
        elif s[i] == "N":
            i += 1
            while s[i] in "rVKRO":
                i += 1
            while i < len(s) and s[i] not in "EI":
                c = s[i]
                if c.isdigit():
                    n, j = _number(s, i)
                    parts.append(s[j:j + n])
                    i = j + n
                elif c == "C" and s[i + 1] in "123":
                    parts.append(parts[-1])
                    i += 2
                elif c == "D" and s[i + 1] in "012":
                    parts.append("~" + parts[-1])
                    i += 2
                elif s.startswith("St", i):
                    parts.append("std")
                    i += 2
                elif c in "LB":                        # internal linkage marker, ABI tag
                    i += 1
                    if c == "B":
                        n, j = _number(s, i)
                        i = j + n
                else:
                    break
        if not parts:
            return symbol
        return label + "::".join(parts) + ("::(local)" if local else "")
    except (ValueError, IndexError):
        return symbol


# ---------------------------------------------------------------- resolution

def search_scope(ext_needed: list[str], libs: dict[str, dict], roots: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """Breadth-first DT_NEEDED closure (the dynamic linker's search order) of an extension's needs plus
    `roots` (libraries torch has already loaded globally), over `libs` (file or soname -> parse_elf
    output). Returns (libraries in search order, needed torch libraries that are absent)."""
    order: list[str] = []
    missing: list[str] = []
    seen: set[str] = set()
    loaded: set[int] = set()
    queue = deque(list(roots) + list(ext_needed))
    while queue:
        name = queue.popleft()
        if name in seen:
            continue
        seen.add(name)
        if name not in libs:
            if name.startswith(TORCH_LIB_PREFIXES) and name not in roots:
                missing.append(name)
            continue
        if id(libs[name]) in loaded:                   # the same object under its file name and soname
            continue
        loaded.add(id(libs[name]))
        order.append(name)
        queue.extend(libs[name]["needed"])
    return order, missing


def unresolved(ext: dict, libs: dict[str, dict], roots: tuple[str, ...] = ()) -> dict:
    """The extension's torch symbols that no library in its search scope exports.

    A symbol asked for without a version is satisfied by any default export of that name; one asked
    for with a version (none of torch's are) only by an export of that version. Weak undefined
    symbols are never an error (the linker leaves them null)."""
    order, missing = search_scope(ext["needed"], libs, roots)
    have_any: set[str] = set()
    have_ver: set[tuple[str, str]] = set()
    for name in order:
        for n, v in libs[name]["defined"]:
            have_any.add(n)
            if v:
                have_ver.add((n, v))
    wanted = [(n, v) for n, v, weak in ext["undefined"] if not weak and is_torch_symbol(n)]
    bad = [(n, v) for n, v in wanted if not ((n, v) in have_ver if v else n in have_any)]
    return {"scope": order, "missing_libraries": missing, "torch_undefined": len(wanted),
            "unresolved": [{"symbol": n, "version": v, "name": qualified_name(n)} for n, v in sorted(bad)]}


# ---------------------------------------------------------------- host-side collection

def _torch_lib_files(torch_lib: str) -> list[str]:
    """torch/lib's own shared objects (not the bundled libgomp and the like), sorted."""
    return [p for p in sorted(glob.glob(os.path.join(torch_lib, "*.so*")))
            if os.path.basename(p).startswith(TORCH_LIB_PREFIXES) and os.path.isfile(p)]


def torch_libs(torch_lib: str) -> dict[str, dict]:
    """torch/lib's own shared objects, by file name and by soname (what DT_NEEDED matches)."""
    libs: dict[str, dict] = {}
    for path in _torch_lib_files(torch_lib):
        base = os.path.basename(path)
        try:
            info = read_elf(path)
        except (OSError, ElfError):
            continue
        libs[base] = info
        if info["soname"]:
            libs.setdefault(info["soname"], info)
    return libs


def check_extension(path: str, torch_lib: str, libs: dict[str, dict] | None = None) -> dict:
    """Does the extension at `path` resolve its torch symbols against torch/lib at `torch_lib`?"""
    libs = torch_libs(torch_lib) if libs is None else libs
    ext = read_elf(path)
    roots = ("libtorch_global_deps.so",) if "libtorch_global_deps.so" in libs else ()
    res = unresolved(ext, libs, roots)
    res.update(path=path, needed=ext["needed"], ok=not res["unresolved"] and not res["missing_libraries"])
    return res


def sgl_kernel_common_ops(pkg_dir: str, sm: str | None) -> tuple[str, str | None]:
    """The common_ops file sgl_kernel 0.4.x loads on a GPU of arch `sm` ('sm_90', 'sm_120'; None: no
    GPU), chosen as its load_utils._load_architecture_specific_ops chooses: compute capability 90 ->
    sm90/, anything else (and no GPU) -> sm100/; then the package's top-level common_ops.* (older
    single-variant wheels). Returns (variant, path or None)."""
    variant = "sm90" if sm == "sm_90" else "sm100"
    for pattern in (os.path.join(pkg_dir, variant, "common_ops.*"), os.path.join(pkg_dir, "common_ops.*")):
        compiled = _compiled(pattern)
        if compiled:
            return variant, compiled[0]
    return variant, None


def _compiled(pattern: str) -> list[str]:
    return [f for f in sorted(glob.glob(pattern)) if ".so" in os.path.basename(f)]


def sm_name(compute_cap: str) -> str | None:
    """nvidia-smi's compute capability -> the arch name torch and sgl_kernel use: '9.0' -> 'sm_90',
    '12.0' -> 'sm_120'; None for anything else ('[N/A]', '')."""
    cap = (compute_cap or "").strip()
    major, dot, minor = cap.partition(".")
    return "sm_" + major + minor if dot and major.isdigit() and minor.isdigit() else None


def startup_inputs(site: str) -> list[str]:
    """The files check_site's startup verdict reads, for any GPU arch: torch/lib's own libraries and every
    common_ops of sgl_kernel. With the venv's metadata (what pip changes), what a cache of its report is
    keyed by."""
    sgk = os.path.join(site, "sgl_kernel")
    return (_torch_lib_files(os.path.join(site, "torch", "lib")) + _compiled(os.path.join(sgk, "*", "common_ops.*"))
            + _compiled(os.path.join(sgk, "common_ops.*")))


def torch_linked(site: str, skip=("torch", "nvidia")) -> list[str]:
    """Every shared object under `site` (but torch itself and the nvidia library wheels) whose DT_NEEDED
    names one of torch's libraries: the torch-ABI-linked extensions of the environment."""
    found = []
    for root, dirs, files in os.walk(site):
        if root == site:
            dirs[:] = [d for d in dirs if d not in skip and not d.endswith((".dist-info", ".egg-info"))]
        for f in files:
            if ".so" not in f:
                continue
            p = os.path.join(root, f)
            try:
                needed = read_elf(p, symbols=False)["needed"]
            except (OSError, ElfError):
                continue
            if any(n.startswith(TORCH_LIB_PREFIXES) for n in needed):
                found.append(p)
    return sorted(found)


# Add-ons built once per torch release, of which the loader picks the one for the running torch
# (torch_c_dlpack_ext's libtorch_c_dlpack_addon_torch<MAJ><MIN>-<device>.so, loaded by tvm_ffi):
# the others are never loaded and not judged.
_PER_TORCH = re.compile(r"_torch(\d)(\d+)-[^/]*\.so$")


def _torch_version(site: str) -> tuple[int, int] | None:
    try:
        with open(os.path.join(site, "torch", "version.py")) as fh:
            m = re.search(r"^__version__\s*=\s*['\"](\d+)\.(\d+)", fh.read(), re.M)
    except OSError:
        return None
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_site(site: str, sm: str | None = None, all_linked: bool = True, libs: dict | None = None) -> dict:
    """Host-side collector: the native-extension report of one site-packages for a GPU arch.

    `startup` lists what SGLang loads when it starts (sgl_kernel's common_ops for `sm`); `other` every
    other torch-linked extension found (FA3's flash_ops, torchvision, deep_gemm, torchao, ... loaded
    lazily or by some models only), but per-torch add-ons built for another torch release. Paths are
    relative to `site`. `libs`: torch/lib's objects already read (torch_libs), for a caller checking several archs."""
    torch_lib = os.path.join(site, "torch", "lib")
    out = {"site": site, "sm": sm, "torch_lib": os.path.isdir(torch_lib), "startup": [], "other": [], "errors": []}
    if not out["torch_lib"]:
        return out
    libs = torch_libs(torch_lib) if libs is None else libs
    out["torch_libraries"] = sorted({k for k, v in libs.items() if k == os.path.basename(k)})
    startup = []
    sgk = os.path.join(site, "sgl_kernel")
    if os.path.isdir(sgk):
        variant, ops = sgl_kernel_common_ops(sgk, sm)
        if ops is None:
            out["errors"].append(f"sgl_kernel: no common_ops for {variant}")
        else:
            startup.append(("sgl_kernel.common_ops", variant, ops))
    for role, variant, path in startup:
        try:
            r = check_extension(path, torch_lib, libs)
        except (OSError, ElfError) as exc:
            out["errors"].append(f"{role}: {exc}")
            continue
        r.update(role=role, variant=variant, path=os.path.relpath(path, site))
        out["startup"].append(r)
    if all_linked:
        started = {p for _, _, p in startup}
        tv = _torch_version(site)
        for path in torch_linked(site):
            m = _PER_TORCH.search(path)
            if path in started or (m and tv and (int(m.group(1)), int(m.group(2))) != tv):
                continue
            try:
                r = check_extension(path, torch_lib, libs)
            except (OSError, ElfError) as exc:
                out["errors"].append(f"{path}: {exc}")
                continue
            r["path"] = os.path.relpath(path, site)
            out["other"].append(r)
    return out


def main(argv: list[str]) -> int:
    site = argv[0] if argv else next(p for p in sys.path if p.endswith("site-packages"))
    sm = argv[1] if len(argv) > 1 and argv[1] != "-" else None
    sys.stdout.write(json.dumps(check_site(site, sm)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
