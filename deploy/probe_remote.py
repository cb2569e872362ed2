"""Remote fact probe: runs on each host as `python3 -c <this file> <venv>`, stdlib only.

It gathers raw text (nvidia-smi, os-release, glibc, nvcc, the venv's distributions, torch's
version.py) and prints one JSON document. It parses as little as possible: the control machine
turns the raw text into facts with pure functions (deploy/facts.py) tested on real captures.

Torch is never imported in the common case. Two torch facts have no metadata (the CUDA arch list
and, for builds that are not tagged by their wheel, the C++11 ABI), so the first probe after a
torch install imports it once in a subprocess and caches the answer on the host, keyed by the
torch RECORD file's size and mtime.
"""
import json
import os
import platform
import shutil
import subprocess
import sys
import time

PROBE_VERSION = 1
GPU_QUERY = "index,uuid,name,driver_version,memory.total,compute_cap,pci.bus_id,serial"

VENV_SNIPPET = r'''
import json, os, sys, sysconfig, subprocess
try:
    from importlib import metadata
except ImportError:
    metadata = None
out = {"version": sys.version.split()[0], "executable": sys.executable,
       "cache_tag": sys.implementation.cache_tag, "soabi": sysconfig.get_config_var("SOABI"),
       "abiflags": getattr(sys, "abiflags", ""), "purelib": sysconfig.get_paths()["purelib"],
       "prefix": sys.prefix, "base_prefix": sys.base_prefix, "distributions": []}
torch_dist = None
if metadata is not None:
    seen = set()
    for d in metadata.distributions():
        name = d.metadata["Name"]
        if not name or name.lower() in seen:
            continue
        seen.add(name.lower())
        path = getattr(d, "_path", None)
        out["distributions"].append({"name": name, "version": d.version,
                                     "installer": (d.read_text("INSTALLER") or "").strip() or None,
                                     "wheel": d.read_text("WHEEL"), "dist_info": str(path) if path else None})
        if name.lower() == "torch":
            torch_dist = d
if torch_dist is not None:
    base = str(torch_dist.locate_file("torch"))
    t = {"dir": base}
    try:
        with open(os.path.join(base, "version.py")) as fh:
            t["version_py"] = fh.read()
    except OSError as exc:
        t["version_py_error"] = str(exc)
    record = os.path.join(str(torch_dist._path), "RECORD") if hasattr(torch_dist, "_path") else None
    key = None
    if record and os.path.exists(record):
        st = os.stat(record)
        key = "%s:%d:%d" % (record, st.st_size, int(st.st_mtime))
    cache_path = os.path.expanduser("~/.cache/ddtree-deploy/torch-import.json")
    cache = {}
    try:
        with open(cache_path) as fh:
            cache = json.load(fh)
    except (OSError, ValueError):
        pass
    if key and cache.get("key") == key:
        t["imported"] = cache.get("facts")
        t["imported_from_cache"] = True
    elif os.environ.get("DDTREE_PROBE_IMPORT_TORCH", "1") == "1":
        code = ("import json, torch\n"
                "f = getattr(torch._C, '_cuda_getArchFlags', None)\n"
                "print(json.dumps({'cxx11_abi': bool(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', False)),"
                " 'arch_flags': f() if f else '', 'cuda': torch.version.cuda}))")
        try:
            p = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=float(os.environ.get("DDTREE_PROBE_IMPORT_TIMEOUT", "120")),
                               universal_newlines=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
            if p.returncode == 0:
                t["imported"] = json.loads(p.stdout.strip().splitlines()[-1])
                t["imported_from_cache"] = False
                if key:
                    try:
                        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
                        tmp = cache_path + ".tmp"
                        with open(tmp, "w") as fh:
                            json.dump({"key": key, "facts": t["imported"]}, fh)
                        os.replace(tmp, cache_path)
                    except OSError:
                        pass
            else:
                t["import_error"] = (p.stderr or "").strip()[-2000:]
        except Exception as exc:
            t["import_error"] = "%s: %s" % (type(exc).__name__, exc)
    out["torch"] = t
print(json.dumps(out))
'''


def run(argv, timeout=30):
    """Run a command and capture it; a missing binary is a fact, not an error."""
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                           universal_newlines=True)
        return {"rc": p.returncode, "out": p.stdout, "err": p.stderr[-4000:]}
    except FileNotFoundError:
        return None
    except subprocess.TimeoutExpired:
        return {"rc": -1, "out": "", "err": "timed out after %ss" % timeout}


def read(path):
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def find_nvcc():
    for cand in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def disk_free(path):
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
        return {"path": path, "free": st.f_bavail * st.f_frsize}
    except OSError:
        return None


def main():
    t0 = time.time()
    venv = sys.argv[1] if len(sys.argv) > 1 else None
    smi = shutil.which("nvidia-smi")
    nvcc = find_nvcc()
    uname = platform.uname()
    out = {
        "probe_version": PROBE_VERSION,
        "hostname": uname.node,
        "kernel": uname.release,
        "machine": uname.machine,
        "os_release": read("/etc/os-release"),
        "glibc": " ".join(platform.libc_ver()),
        "ldd": (run(["ldd", "--version"]) or {}).get("out", "").splitlines()[:1],
        "system_python": sys.version.split()[0],
        "nvidia_smi_query": run([smi, "--query-gpu=" + GPU_QUERY, "--format=csv"]) if smi else None,
        "nvidia_smi": run([smi]) if smi else None,
        "proc_driver": read("/proc/driver/nvidia/version"),
        "nvcc": run([nvcc, "--version"]) if nvcc else None,
        "venv": None,
        "disk": {},
    }
    if venv:
        py = os.path.join(venv, "bin", "python")
        v = {"path": venv, "exists": os.access(py, os.X_OK)}
        if v["exists"]:
            r = run([py, "-c", VENV_SNIPPET], timeout=300)
            if r and r["rc"] == 0:
                try:
                    v.update(json.loads(r["out"]))
                except ValueError:
                    v["error"] = "unparseable venv output: " + r["out"][-500:]
            else:
                v["error"] = (r or {}).get("err", "venv python failed")
        out["venv"] = v
        out["disk"]["venv"] = disk_free(venv)
    out["disk"]["tmp"] = disk_free("/tmp")
    out["probe_seconds"] = round(time.time() - t0, 3)
    sys.stdout.write(json.dumps(out))


main()
