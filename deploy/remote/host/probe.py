"""The facts probe (read-only, never locks, never needs root): raw text of standard tools, parsed on the control
machine by the pure functions in deploy/facts.py (tested on real captures).

Every command runs at the same time under one deadline (`budget` seconds), each in its own process group: a
hung nvidia-smi costs the probe one deadline, is killed with its children, and is reported in `incomplete`
while every other fact still comes back. The venv's distributions are read from its site-packages with
their core metadata (dists.collect: name, version, requirements, wheel tags, and the marker environment; what
`pip check` reads): listing them runs none of the venv's code. Torch is imported only for the two facts that no
metadata holds (CUDA arch list, C++11 ABI), once per torch install, and as root only in a venv trusted_tree()
accepts. The native-extension report (elfsyms.check_site: do sgl_kernel's common_ops for each GPU arch of the
host, and the venv's other torch-linked extensions, resolve against its torch?) is made after nvidia-smi named
the archs, within the same deadline.

What does not change between probes is cached in the agent's private state directory, each keyed by what it
was read from: the distributions by every METADATA file's (path, size, mtime), torch's import facts by its RECORD,
the native report by those metadata files plus the (path, size, mtime) of torch/lib's libraries and of
sgl_kernel's common_ops, and the nvidia-smi banner by the driver. A probe of an unchanged host reads no metadata
file and no ELF file.
"""
import json
import os
import shutil
import sys
import threading
import time
import zlib

from . import dists
from . import venv as venvmod
from .fsutil import Unsafe, atomic_write, free_bytes, read_private
from .proc import Deadline, run, run_all
from .registry import op

PROBE_VERSION = 3
GPU_QUERY = "index,uuid,name,driver_version,memory.total,compute_cap,pci.bus_id,serial"
TORCH_IMPORT = ("import json, torch\n"
                "f = getattr(torch._C, '_cuda_getArchFlags', None)\n"
                "print(json.dumps({'cxx11_abi': bool(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', False)),"
                " 'arch_flags': f() if f else '', 'cuda': torch.version.cuda}))")


def read(path):
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def find_nvcc():
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _fact(r):
    """A command's result in the raw document: None when the program is missing."""
    if r is None or r.get("missing"):
        return None
    return {"rc": -1 if r["rc"] is None else r["rc"], "out": r["out"], "err": r["err"][-4000:]}


def cache_read(state, name, key):
    """The value kept in the private state file `name` when it was stored under `key`, else None."""
    try:
        c = json.loads((read_private(os.path.join(state, name)) or b"{}").decode())
    except (Unsafe, ValueError):
        return None
    return c.get("value") if key is not None and c.get("key") == key else None


def cache_write(state, name, key, value):
    """Keep `value` under `key` (a cache: a write that fails costs the next probe the work again)."""
    try:
        atomic_write(os.path.join(state, name), json.dumps({"key": key, "value": value}).encode())
    except (OSError, Unsafe):
        pass


def collected(site, state):
    """dists.collect() of the venv's site-packages, its distribution list cached by the metadata files' stat."""
    key = "%d\n%s" % (PROBE_VERSION, dists.metadata_key([site]))

    def find(paths):
        found = cache_read(state, "cache-dists.json", key)
        if found is None:
            found = dists.find_distributions(paths)
            cache_write(state, "cache-dists.json", key, found)
        return found
    doc = dists.collect([site], find)
    doc["key"] = "%08x-%d" % (zlib.crc32(key.encode()), len(key))  # identifies the list for the control side
    return doc


def venv_raw(path, state, deadline, import_torch, incomplete, trust=False, known=None):
    """The venv as files: pyvenv.cfg, site-packages, its distributions with their metadata (dists.collect),
    torch's version.py and (once per torch install) the facts only an import of torch gives. `known`: the key
    of the distribution list the caller already holds; when it is this one, the reply leaves the list out
    (the caller's last facts have it: a few hundred distributions' metadata need not travel again)."""
    v = {"path": path, "exists": os.access(venvmod.python(path), os.X_OK)}
    if not v["exists"]:
        return v
    try:
        site = venvmod.site_packages(path)
    except venvmod.VenvError as exc:
        v["error"] = str(exc)
        return v
    v.update(pyvenv_cfg=venvmod.pyvenv_cfg(path), purelib=site, lib_dir=os.path.basename(os.path.dirname(site)))
    if trust:  # may root run it? (a provision asks before it plans to)
        try:
            v["entries_checked"] = venvmod.check_runnable(path)
            v["trust"] = "ok"
        except (Unsafe, venvmod.VenvError) as exc:
            v["trust"] = str(exc)
    v["collected"] = collected(site, state)
    torch = [d for d in v["collected"]["distributions"] if dists.normalize(d.get("name") or "") == "torch"]
    if torch:
        v["torch"] = torch_raw(path, site, torch[0]["path"], state, deadline, import_torch, incomplete,
                               v.get("trust"))
    if known and v["collected"]["key"] == known:
        del v["collected"]["distributions"], v["collected"]["problems"]
        v["collected"]["unchanged"] = True
    return v


def torch_raw(venv, site, di, state, deadline, import_torch, incomplete, trust=None):
    """torch's version.py, and what importing it says (cached per torch install). `trust`: the venv's trust
    verdict when the probe already walked it ("ok" or why not), so root does not walk it twice."""
    base = os.path.join(site, "torch")
    t = {"dir": base}
    vp = read(os.path.join(base, "version.py"))
    if vp is None:
        t["version_py_error"] = "cannot read %s/version.py" % base
    else:
        t["version_py"] = vp
    key = None
    record = os.path.join(di, "RECORD") if di else None
    if record and os.path.exists(record):
        st = os.stat(record)
        key = "%s:%d:%d" % (record, st.st_size, int(st.st_mtime))
    facts = cache_read(state, "cache-torch-import.json", key)
    if facts is not None:
        t.update(imported=facts, imported_from_cache=True)
        return t
    if not import_torch:
        return t
    if os.geteuid() == 0:
        if trust is None:
            try:
                venvmod.check_runnable(venv)
                trust = "ok"
            except (Unsafe, venvmod.VenvError) as exc:
                trust = str(exc)
        if trust != "ok":
            t["import_error"] = "not imported as root: %s" % trust
            incomplete.append({"what": "torch import", "error": t["import_error"]})
            return t
    r = run([venvmod.python(venv), "-I", "-c", TORCH_IMPORT], max(0.1, deadline.left(floor=0.1)),
            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), merge=False)
    if r["rc"] == 0 and r["out"].strip():
        try:
            t["imported"] = json.loads(r["out"].strip().splitlines()[-1])
            t["imported_from_cache"] = False
        except ValueError:
            t["import_error"] = "unparseable: " + r["out"][-300:]
        if key and "imported" in t:
            cache_write(state, "cache-torch-import.json", key, t["imported"])
    else:
        t["import_error"] = (r["err"] or r["out"] or "import failed").strip()[-2000:]
        if r["timed_out"]:
            incomplete.append({"what": "torch import", "error": r["err"].split(";")[0]})
    return t


def gpu_archs(query):
    """The distinct GPU archs ('sm_90') in the nvidia-smi --query-gpu CSV result, in GPU order; [] when it did
    not answer. Only what the native check needs: the control side parses the whole CSV (facts.py)."""
    if not query or query.get("rc") != 0:
        return []
    from .elfsyms import sm_name
    lines = [ln.split(",") for ln in query.get("out", "").strip().splitlines()]
    head = [h.strip().split(" ")[0] for h in lines[0]] if lines else []
    if "compute_cap" not in head:
        return []
    i, out = head.index("compute_cap"), []
    for row in lines[1:]:
        sm = sm_name(row[i]) if len(row) == len(head) else None
        if sm and sm not in out:
            out.append(sm)
    return out


def native_report(site, state, sms, dists_key):
    """elfsyms.check_site for each GPU arch of the host (no GPU named: the arch-less choice sgl_kernel makes
    itself), the venv's other torch-linked extensions with the first; cached by what the reports read."""
    from . import elfsyms
    sms = list(sms) or [None]
    key = "%d\n%s\n%s\n%s" % (PROBE_VERSION, json.dumps(sms), dists_key, "\n".join(
        "%s:%d:%d" % (p, st.st_size, st.st_mtime_ns) for p, st in
        ((p, os.stat(p)) for p in elfsyms.startup_inputs(site))))
    reports = cache_read(state, "cache-native.json", key)
    if reports is None:
        tl = os.path.join(site, "torch", "lib")
        libs = elfsyms.torch_libs(tl) if os.path.isdir(tl) else None  # ~1 GB of symbol tables: read once, not per arch
        reports = [elfsyms.check_site(site, sm, all_linked=(i == 0), libs=libs) for i, sm in enumerate(sms)]
        cache_write(state, "cache-native.json", key, reports)
    return reports


def native_in_time(ctx, v, sms, deadline, incomplete):
    """native_report within the probe's deadline (it may use the margin kept for killing commands, never the
    reply's own): None, listed as incomplete, when it did not finish in time or failed."""
    box = {}

    def check():
        try:
            box["reports"] = native_report(v["purelib"], ctx.state, sms, v["collected"]["key"])
        except Exception as exc:  # an unreadable file is an incomplete fact, not a failed probe
            box["error"] = "%s: %s" % (type(exc).__name__, exc)
    t = threading.Thread(target=check, daemon=True)
    t.start()
    wait = deadline.left(floor=0.0) + 2.0
    t.join(max(0.0, min(wait, ctx.deadline.left(cap=wait + 1.0, floor=0.0) - 1.0)))
    if "reports" in box:
        return box["reports"]
    incomplete.append({"what": "native", "error": box.get("error") or "not checked within the probe's deadline"})
    return None


def banner_key(smi):
    """What the plain `nvidia-smi` banner (driver and CUDA version) depends on: the binary and the loaded driver."""
    st = os.stat(os.path.realpath(smi))
    return "%s:%d:%d:%s" % (os.path.realpath(smi), st.st_size, int(st.st_mtime),
                            (read("/proc/driver/nvidia/version") or "").strip())


def staged_listing(state):
    """Wheels staged (by sha256) in the private provision directory, and partial uploads."""
    staged, parts = {}, {}
    inc = os.path.join(state, "provision", "incoming")
    if os.path.isdir(inc) and not os.path.islink(inc):
        for sha in os.listdir(inc):
            d = os.path.join(inc, sha)
            if os.path.islink(d) or not os.path.isdir(d):
                continue
            for f in os.listdir(d):
                st = os.lstat(os.path.join(d, f))
                if not (st.st_mode & 0o170000 == 0o100000):
                    continue
                if f.endswith(".whl"):
                    staged[sha] = {"filename": f, "size": st.st_size}
                elif f.endswith(".whl.part"):
                    parts[sha] = {"filename": f[:-5], "size": st.st_size}
    return {"staged": staged, "parts": parts, "free": (free_bytes(state) or {}).get("free")}


@op("facts.probe")
def probe(ctx, a):
    t0 = time.time()
    budget = float(a.get("budget") or 10.0)
    # the commands' deadline ends early enough to kill them and still answer within the call's own deadline
    deadline = Deadline(min(budget, max(0.5, ctx.deadline.left(cap=budget + 3, floor=0.5) - 3)))
    smi, nvcc = shutil.which("nvidia-smi"), find_nvcc()
    jobs = {}
    banner = key = None
    if smi:
        jobs["nvidia_smi_query"] = [smi, "--query-gpu=" + GPU_QUERY, "--format=csv"]
        jobs["nvidia_smi_topo"] = [smi, "topo", "-m"]  # the GPUs' interconnect (a TP group's P2P)
        key = banner_key(smi)
        banner = cache_read(ctx.state, "cache-nvidia-smi-banner.json", key)
        if banner is None:  # the banner only changes with the driver or nvidia-smi itself: asked once per driver
            jobs["nvidia_smi"] = [smi]
    if nvcc:
        jobs["nvcc"] = [nvcc, "--version"]
    incomplete = []
    venv_out = {}
    venv = a.get("venv")
    vt = None
    if venv:
        def gather_venv():
            try:
                venv_out["v"] = venv_raw(venv, ctx.state, deadline, a.get("import_torch", True), incomplete,
                                         a.get("trust", False), a.get("known_dists"))
            except Exception as exc:  # a broken venv is a fact, not a failed probe
                venv_out["v"] = {"path": venv, "exists": True, "error": "%s: %s" % (type(exc).__name__, exc)}
        vt = threading.Thread(target=gather_venv, daemon=True)
        vt.start()
    res = run_all(jobs, deadline)
    if vt is not None:
        vt.join(deadline.left(floor=0.0) + 3)
        if vt.is_alive():
            incomplete.append({"what": "venv", "error": "not read within %.0fs" % budget})
    for what in jobs:  # in a fixed order
        r = res[what]
        if r.get("timed_out"):
            incomplete.append({"what": what, "error": r["err"].split(";")[0]})
    v = venv_out.get("v") if vt is not None and not vt.is_alive() else None
    if v and v.get("collected"):
        v["native"] = native_in_time(ctx, v, gpu_archs(res.get("nvidia_smi_query")), deadline, incomplete)
    plain = _fact(res.get("nvidia_smi"))
    if plain is not None and plain["rc"] == 0:
        banner = "\n".join(plain["out"].splitlines()[:6])
        cache_write(ctx.state, "cache-nvidia-smi-banner.json", key, banner)
    elif banner is not None:
        plain = {"rc": 0, "out": banner, "err": "", "cached": True}
    uname = os.uname()
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        glibc = ""
    out = {
        "probe_version": PROBE_VERSION,
        "hostname": uname.nodename, "kernel": uname.release, "machine": uname.machine,
        "os_release": read("/etc/os-release"),
        "glibc": glibc,
        "ldd": [],
        "system_python": sys.version.split()[0],
        "nvidia_smi_query": _fact(res.get("nvidia_smi_query")) if smi else None,
        "nvidia_smi": plain if smi else None,
        "nvidia_smi_topo": _fact(res.get("nvidia_smi_topo")) if smi else None,
        "proc_driver": read("/proc/driver/nvidia/version"),
        "nvcc": _fact(res.get("nvcc")) if nvcc else None,
        "venv": venv_out.get("v") if venv else None,
        "disk": {"tmp": free_bytes("/tmp")},
        "incomplete": incomplete,
        "budget": budget,
    }
    if venv:
        out["disk"]["venv"] = free_bytes(venv)
    if a.get("staged"):
        out["stage"] = staged_listing(ctx.state)
    out["probe_seconds"] = round(time.time() - t0, 3)
    return out
