"""The facts probe (read-only, never locks, never needs root): raw text of standard tools, parsed on the control
machine by the pure functions in deploy/facts.py (tested on real captures).

Every command runs at the same time under one deadline (`budget` seconds), each in its own process group: a
hung nvidia-smi costs the probe one deadline, is killed with its children, and is reported in `incomplete`
while every other fact still comes back. The venv's distributions are read from its site-packages with
their core metadata: listing them runs none of the venv's code. Torch is imported only for the two facts that no
metadata holds (CUDA arch list, C++11 ABI), once per torch install (cached in the agent's state directory), and
as root only in a venv trusted_tree() accepts.
"""
import json
import os
import shutil
import sys
import threading
import time

from . import venv as venvmod
from .fsutil import Unsafe, atomic_write, free_bytes, read_private
from .proc import Deadline, run, run_all
from .registry import op

PROBE_VERSION = 2
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


def venv_raw(path, state, deadline, import_torch, incomplete, trust=False):
    """The venv as files: pyvenv.cfg, site-packages, each distribution's metadata, torch's version.py and
    (once per torch install) the facts only an import of torch gives."""
    v = {"path": path, "exists": os.access(venvmod.python(path), os.X_OK)}
    if not v["exists"]:
        return v
    try:
        site = venvmod.site_packages(path)
    except venvmod.VenvError as exc:
        v["error"] = str(exc)
        return v
    v.update(pyvenv_cfg=venvmod.pyvenv_cfg(path), purelib=site, lib_dir=os.path.basename(os.path.dirname(site)),
             distributions=[])
    if trust:  # may root run it? (a provision asks before it plans to)
        try:
            v["entries_checked"] = venvmod.check_runnable(path)
            v["trust"] = "ok"
        except (Unsafe, venvmod.VenvError) as exc:
            v["trust"] = str(exc)
    torch = None
    for name, d in venvmod.distributions(site):
        di = venvmod.dist_info_path(d)
        v["distributions"].append({"name": d.name, "version": d.version,
                                   "installer": (d.read_text("INSTALLER") or "").strip() or None,
                                   "wheel": d.read_text("WHEEL"), "dist_info": di})
        if name == "torch":
            torch = (d, di)
    if torch is not None:
        v["torch"] = torch_raw(path, torch[0], torch[1], state, deadline, import_torch, incomplete)
    return v


def torch_raw(venv, dist, di, state, deadline, import_torch, incomplete):
    base = str(dist.locate_file("torch"))
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
    cache_path = os.path.join(state, "torch-import.json")
    try:
        cache = json.loads((read_private(cache_path) or b"{}").decode())
    except (Unsafe, ValueError):
        cache = {}
    if key and cache.get("key") == key:
        t.update(imported=cache.get("facts"), imported_from_cache=True)
        return t
    if not import_torch:
        return t
    if os.geteuid() == 0:
        try:
            venvmod.check_runnable(venv)
        except (Unsafe, venvmod.VenvError) as exc:
            t["import_error"] = "not imported as root: %s" % exc
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
            try:
                atomic_write(cache_path, json.dumps({"key": key, "facts": t["imported"]}).encode())
            except OSError:
                pass
    else:
        t["import_error"] = (r["err"] or r["out"] or "import failed").strip()[-2000:]
        if r["timed_out"]:
            incomplete.append({"what": "torch import", "error": r["err"].split(";")[0]})
    return t


def banner_key(smi):
    """What the plain `nvidia-smi` banner (driver and CUDA version) depends on: the binary and the loaded driver."""
    st = os.stat(os.path.realpath(smi))
    return "%s:%d:%d:%s" % (os.path.realpath(smi), st.st_size, int(st.st_mtime),
                            (read("/proc/driver/nvidia/version") or "").strip())


def cached_banner(state, key):
    try:
        c = json.loads((read_private(os.path.join(state, "nvidia-smi-banner.json")) or b"{}").decode())
    except (Unsafe, ValueError):
        return None
    return c.get("out") if c.get("key") == key else None


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
        key = banner_key(smi)
        banner = cached_banner(ctx.state, key)
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
                                         a.get("trust", False))
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
    plain = _fact(res.get("nvidia_smi"))
    if plain is not None and plain["rc"] == 0:
        banner = "\n".join(plain["out"].splitlines()[:6])
        try:
            atomic_write(os.path.join(ctx.state, "nvidia-smi-banner.json"), json.dumps({"key": key, "out": banner})
                         .encode())
        except OSError:
            pass
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
