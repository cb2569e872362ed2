"""Remote provisioning agent: runs on a host as `VENV/bin/python -c <this file> COMMAND JSON`, stdlib only.

One invocation is one SSH round trip. Commands:

  scan      on the reference: for each named distribution, its RECORD check (drift), installed size,
            wheel tags, and the original wheel if a wheelhouse or pip's wheel cache still holds it
            (matched by the hashes in its RECORD), or a wheel rebuilt earlier from the same RECORD.
  build     on the reference: rebuild a valid PEP 427 wheel from an installed distribution's RECORD.
  stage     on a target: which wheels (by sha256) are staged already, and partial uploads.
  finalize  on a target: check the sha256 of uploaded `.part` files and rename the good ones.
  apply     on a target: back up the distributions about to change (as wheels rebuilt from their
            RECORD), run pip offline, smoke-import; on any failure restore the backup.
  undo      on a target: restore a provision's backup.

The same module is imported on the control machine (deploy.provision.wheels, .overlay) for its pure
helpers: pip argument lists, wheel file names, RECORD parsing and repacking. Nothing runs on import.
"""
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile

STAGE_ROOT = "/var/tmp/ddtree-provision"
ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed entry times: the same installed files give the same wheel bytes
# Written by the installer, not part of the wheel (PEP 376, PEP 610, PEP 627).
INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}
CHUNK = 1 << 20


# ---------------------------------------------------------------- pure helpers (imported on control)

def normalize(name):
    """PEP 503 canonical name ('Flash_Infer.python' -> 'flash-infer-python')."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name_component(name):
    """Distribution name as a wheel file name spells it (binary distribution format spec)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def record_hash(data_or_digest):
    """sha256 in RECORD form: 'sha256=' + urlsafe base64 without padding."""
    digest = data_or_digest if isinstance(data_or_digest, bytes) and len(data_or_digest) == 32 else None
    if digest is None:
        digest = hashlib.sha256(data_or_digest).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def parse_record(text):
    """RECORD text -> [(path, hash or '', size or None)]."""
    rows = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        path = row[0]
        h = row[1] if len(row) > 1 else ""
        size = row[2] if len(row) > 2 else ""
        rows.append((path, h, int(size) if size.isdigit() else None))
    return rows


def wheel_tags(wheel_text):
    return [line.split(":", 1)[1].strip() for line in (wheel_text or "").splitlines() if line.startswith("Tag:")]


def compressed_tag(tags):
    """['cp311-cp311-manylinux_2_27_x86_64', 'cp311-cp311-manylinux_2_28_x86_64'] ->
    'cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64' (the file name's tag triple)."""
    parts = [t.split("-") for t in tags if t.count("-") == 2]
    if not parts:
        raise ValueError("no valid Tag lines in WHEEL")
    out = []
    for i in range(3):
        seen = []
        for p in parts:
            for x in p[i].split("."):
                if x not in seen:
                    seen.append(x)
        out.append(".".join(seen))
    return "-".join(out)


def wheel_filename(name, version, tags):
    return "%s-%s-%s.whl" % (wheel_name_component(name), version.replace("-", "_"), compressed_tag(tags))


def parse_wheel_filename(filename):
    """'torch-2.11.0+cu130-cp311-cp311-linux_x86_64.whl' -> ('torch', '2.11.0+cu130') or None."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    return normalize(parts[0]), parts[1]


def pip_install_argv(python, wheels):
    """The one pip command that installs staged wheels: offline, exact files, nothing else
    (--isolated: no pip.conf or PIP_* settings of the host, such as a constraint file, can interfere)."""
    return [python, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps", "--force-reinstall",
            "--disable-pip-version-check", "--no-input", "--no-cache-dir"] + list(wheels)


def pip_uninstall_argv(python, names):
    return [python, "-m", "pip", "uninstall", "--isolated", "--yes", "--disable-pip-version-check", "--no-input"] + list(names)


def smoke_argv(python, modules, cuda_init=False):
    code = ("import importlib, json, sys\n"
            "mods = json.loads(sys.argv[1])\n"
            "for m in mods:\n"
            "    importlib.import_module(m)\n")
    if cuda_init:
        code += "import torch\ntorch.cuda.init()\nprint('cuda devices', torch.cuda.device_count())\n"
    code += "print('imported', len(mods), 'modules')\n"
    return [python, "-c", code, json.dumps(sorted(modules))]


# ---------------------------------------------------------------- installed distributions

def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _hash_and_size(path):
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
            n += len(block)
    return record_hash(h.digest()), n


def find_dist(name, paths=None):
    """The installed distribution called `name` (canonical) in this interpreter's environment."""
    from importlib import metadata
    want = normalize(name)
    for d in metadata.distributions(path=paths) if paths else metadata.distributions():
        n = d.metadata["Name"]
        if n and normalize(n) == want:
            return d
    return None


def installed_versions(names, paths=None):
    from importlib import metadata
    want = {normalize(n) for n in names}
    out = {n: None for n in want}
    for d in metadata.distributions(path=paths) if paths else metadata.distributions():
        n = d.metadata["Name"]
        if n and normalize(n) in want and out[normalize(n)] is None:
            out[normalize(n)] = d.version
    return out


def _layout():
    import sysconfig
    p = sysconfig.get_paths()
    return {"purelib": p["purelib"], "platlib": p["platlib"], "scripts": p["scripts"],
            "headers": p.get("include"), "data": p["data"]}


def dist_files(dist_info, layout=None):
    """Classify an installed distribution's RECORD rows for repacking.

    Returns (site, rows) where rows are (record_path, abs_path, archive_path or None, expected_hash).
    archive_path None means "written by the installer, not part of a wheel" (pyc, RECORD, INSTALLER,
    console-script wrappers that pip generates from entry_points.txt).
    """
    layout = layout or _layout()
    dist_info = os.path.abspath(dist_info)
    site = os.path.dirname(dist_info)
    di_name = os.path.basename(dist_info)
    with open(os.path.join(dist_info, "RECORD"), encoding="utf-8") as fh:
        record = parse_record(fh.read())
    name, version = _name_version(dist_info)
    data_dir = "%s-%s.data" % (wheel_name_component(name), version)
    ep_scripts = _entry_point_scripts(dist_info)
    rows = []
    for path, h, _size in record:
        absp = os.path.normpath(path if os.path.isabs(path) else os.path.join(site, path))
        rel = os.path.relpath(absp, site)
        arc = None
        if not rel.startswith(".." + os.sep):
            parts = rel.split(os.sep)
            if "__pycache__" in parts or rel.endswith((".pyc", ".pyo")):
                arc = None
            elif parts[0] == di_name and len(parts) == 2 and parts[1] in INSTALLER_FILES:
                arc = None
            else:
                arc = rel.replace(os.sep, "/")
        else:
            for scheme in ("scripts", "headers", "data"):
                base = layout.get(scheme)
                if base and (absp + os.sep).startswith(os.path.normpath(base) + os.sep):
                    sub = os.path.relpath(absp, base).replace(os.sep, "/")
                    if scheme == "scripts" and os.path.basename(absp) in ep_scripts:
                        arc = None  # pip regenerates console/gui script wrappers from entry_points.txt
                    elif scheme == "headers":
                        arc = "%s/headers/%s" % (data_dir, sub.split("/", 1)[-1] if "/" in sub else sub)
                    else:
                        arc = "%s/%s/%s" % (data_dir, scheme, sub)
                    break
            else:
                raise ValueError("%s: RECORD path %s lies outside the environment" % (di_name, path))
        rows.append((path, absp, arc, h))
    return site, rows


def _name_version(dist_info):
    name = version = None
    with open(os.path.join(dist_info, "METADATA"), encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith("Name:") and name is None:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("Version:") and version is None:
                version = line.split(":", 1)[1].strip()
            elif not line.strip():
                break
    return name, version


def _entry_point_scripts(dist_info):
    names = set()
    try:
        with open(os.path.join(dist_info, "entry_points.txt"), encoding="utf-8") as fh:
            section = None
            for line in fh:
                line = line.strip()
                if line.startswith("["):
                    section = line.strip("[]").strip()
                elif "=" in line and section in ("console_scripts", "gui_scripts"):
                    names.add(line.split("=", 1)[0].strip())
    except OSError:
        pass
    return names


def verify_record(dist_info, layout=None):
    """Drift check: every RECORD row with a hash against the file on disk.
    Returns (drift list of {path, problem}, installed bytes)."""
    _site, rows = dist_files(dist_info, layout)
    drift, total = [], 0
    for path, absp, _arc, h in rows:
        if not h:
            continue
        try:
            actual, size = _hash_and_size(absp)
        except FileNotFoundError:
            drift.append({"path": path, "problem": "missing"})
            continue
        total += size
        if actual != h:
            drift.append({"path": path, "problem": "modified"})
    return drift, total


def _script_bytes(data):
    """An installed script's shebang back to the '#!python' a wheel carries (pip rewrites it)."""
    if data.startswith(b"#!"):
        nl = data.find(b"\n")
        first = data[:nl if nl >= 0 else len(data)]
        if b"python" in first:
            return b"#!python" + data[len(first):]
    return data


def repack(dist_info, out_dir, compression=zipfile.ZIP_DEFLATED, layout=None):
    """Rebuild a wheel from an installed distribution (PEP 427 layout, PEP 376 RECORD).

    The files are read as they are now, so a file changed by hand lands in the wheel with its new hash
    (the caller reports such drift from verify_record). Entries are sorted, timestamps fixed and
    dist-info written last, so the same installed files always give byte-identical wheels.
    Returns {path, filename, sha256, size, drift}.
    """
    dist_info = os.path.abspath(dist_info)
    di_name = os.path.basename(dist_info)
    name, version = _name_version(dist_info)
    with open(os.path.join(dist_info, "WHEEL"), encoding="utf-8") as fh:
        tags = wheel_tags(fh.read())
    filename = wheel_filename(name, version, tags)
    _site, rows = dist_files(dist_info, layout)
    entries, drift = [], []
    for path, absp, arc, h in rows:
        if arc is None:
            continue
        if not os.path.exists(absp):
            drift.append({"path": path, "problem": "missing"})
            continue
        entries.append((arc, absp, h, path))
    entries.sort(key=lambda e: (e[0].startswith(di_name + "/"), e[0]))
    os.makedirs(out_dir, exist_ok=True)
    final = os.path.join(out_dir, filename)
    tmp = final + ".tmp%d" % os.getpid()
    record_rows = []
    try:
        with zipfile.ZipFile(tmp, "w", compression=compression, compresslevel=1 if compression else None) as zf:
            for arc, absp, h, path in entries:
                with open(absp, "rb") as fh:
                    data = fh.read()
                if "/scripts/" in arc and arc.split("/", 1)[0].endswith(".data"):
                    data = _script_bytes(data)
                elif h and record_hash(data) != h:
                    drift.append({"path": path, "problem": "modified"})
                mode = os.stat(absp).st_mode & 0o777
                zi = zipfile.ZipInfo(arc, ZIP_EPOCH)
                zi.external_attr = (0o100000 | (mode | 0o644)) << 16
                zi.compress_type = compression
                zf.writestr(zi, data)
                record_rows.append((arc, record_hash(data), str(len(data))))
            rec_arc = di_name + "/RECORD"
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            for r in record_rows:
                w.writerow(r)
            w.writerow((rec_arc, "", ""))
            zi = zipfile.ZipInfo(rec_arc, ZIP_EPOCH)
            zi.external_attr = 0o100644 << 16
            zi.compress_type = compression
            zf.writestr(zi, buf.getvalue().encode())
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {"path": final, "filename": filename, "sha256": sha256_file(final), "size": os.path.getsize(final),
            "drift": drift, "name": normalize(name), "version": version}


def wheel_matches_installed(whl, dist_info, layout=None):
    """Is `whl` the wheel this distribution was installed from? Every hashed file of the wheel's
    RECORD (outside .data, which the installer rewrites) must appear in the installed RECORD with the
    same hash."""
    with open(os.path.join(dist_info, "RECORD"), encoding="utf-8") as fh:
        installed = {p: h for p, h, _s in parse_record(fh.read()) if h}
    with zipfile.ZipFile(whl) as zf:
        recs = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        if len(recs) != 1:
            return False
        rows = parse_record(zf.read(recs[0]).decode("utf-8"))
    checked = 0
    for path, h, _s in rows:
        if not h or path.split("/", 1)[0].endswith(".data"):
            continue
        if installed.get(path) != h:
            return False
        checked += 1
    return checked > 0


def top_level_modules(dist_info):
    """Importable top-level modules of an installed distribution (for the smoke import)."""
    site = os.path.dirname(os.path.abspath(dist_info))
    with open(os.path.join(dist_info, "RECORD"), encoding="utf-8") as fh:
        paths = [p for p, _h, _s in parse_record(fh.read())]
    mods = set()
    for p in paths:
        if p.startswith("..") or os.path.isabs(p):
            continue
        parts = p.split("/")
        if parts[0].endswith((".dist-info", ".data")) or "__pycache__" in parts:
            continue
        if len(parts) == 1:
            if p.endswith(".py"):
                mods.add(p[:-3])
            elif p.endswith(".so"):
                mods.add(p.split(".", 1)[0])
            continue
        top = parts[0]
        if os.path.exists(os.path.join(site, top, "__init__.py")):
            mods.add(top)
        elif len(parts) > 2 and os.path.exists(os.path.join(site, top, parts[1], "__init__.py")):
            mods.add(top + "." + parts[1])  # namespace package such as nvidia.cublas
    return sorted(m for m in mods if re.match(r"^[A-Za-z_][\w.]*$", m))


# ---------------------------------------------------------------- commands

def _dist_info_path(d):
    p = getattr(d, "_path", None)
    return str(p) if p is not None else None


def _candidate_wheels(dirs):
    out = []
    for base in dirs:
        base = os.path.expanduser(base)
        if not os.path.isdir(base):
            continue
        for root, _dirs, files in os.walk(base):
            for f in files:
                if f.endswith(".whl"):
                    out.append(os.path.join(root, f))
    return out


def _installed(p, out):
    """(name, dist, dist-info path) of each wanted distribution; records 'not installed' in `out`."""
    for want in p["dists"]:
        name = normalize(want["name"])
        d = find_dist(name)
        if d is None:
            out[name] = {"error": "not installed"}
            continue
        yield want, name, d, _dist_info_path(d)


def cmd_scan(p):
    layout = _layout()
    dirs = list(p.get("wheelhouse") or []) + [os.path.expanduser("~/.cache/pip/wheels")]
    candidates = _candidate_wheels(dirs)
    built_dir = p.get("built_dir") or os.path.join(STAGE_ROOT, "built")
    out = {}
    for want, name, d, di in _installed(p, out):
        info = {"version": d.version, "dist_info": di}
        if want.get("version") and d.version != want["version"]:
            info["error"] = "installed version %s, expected %s" % (d.version, want["version"])
        drift, size = verify_record(di, layout)
        info.update(drift=drift, installed_bytes=size, tags=wheel_tags(d.read_text("WHEEL")))
        info["record_sha256"] = sha256_file(os.path.join(di, "RECORD"))
        source = None
        if not drift:
            for whl in candidates:
                nv = parse_wheel_filename(os.path.basename(whl))
                if nv and nv[0] == name and nv[1] == d.version:
                    try:
                        if wheel_matches_installed(whl, di):
                            source = {"kind": "original", "path": whl, "sha256": sha256_file(whl),
                                      "size": os.path.getsize(whl), "filename": os.path.basename(whl)}
                            break
                    except (OSError, zipfile.BadZipFile, ValueError):
                        continue
        if source is None:
            bdir = os.path.join(built_dir, info["record_sha256"])
            meta = os.path.join(bdir, "built.json")
            try:
                with open(meta) as fh:
                    b = json.load(fh)
                whl = os.path.join(bdir, b["filename"])
                if not drift and os.path.getsize(whl) == b["size"]:
                    source = {"kind": "rebuilt", "path": whl, "sha256": b["sha256"], "size": b["size"],
                              "filename": b["filename"]}
            except (OSError, ValueError, KeyError):
                pass
        info["source"] = source
        out[name] = info
    return {"dists": out}


def cmd_build(p):
    built_dir = p.get("built_dir") or os.path.join(STAGE_ROOT, "built")
    out = {}
    for _want, name, _d, di in _installed(p, out):
        key = sha256_file(os.path.join(di, "RECORD"))
        bdir = os.path.join(built_dir, key)
        r = repack(di, bdir)
        r["kind"] = "rebuilt"
        if not r["drift"]:  # drifted builds are not reusable by RECORD key
            with open(os.path.join(bdir, "built.json"), "w") as fh:
                json.dump({"filename": r["filename"], "sha256": r["sha256"], "size": r["size"]}, fh)
        out[name] = r
    return {"dists": out}


def _incoming(root):
    return os.path.join(root, "incoming")


def cmd_stage(p):
    root = p.get("root") or STAGE_ROOT
    staged, parts = {}, {}
    inc = _incoming(root)
    if os.path.isdir(inc):
        for sha in os.listdir(inc):
            d = os.path.join(inc, sha)
            if not os.path.isdir(d):
                continue
            for f in os.listdir(d):
                fp = os.path.join(d, f)
                if f.endswith(".whl"):
                    staged[sha] = {"filename": f, "size": os.path.getsize(fp)}
                elif f.endswith(".whl.part"):
                    parts[sha] = {"filename": f[:-5], "size": os.path.getsize(fp)}
    st = os.statvfs(root if os.path.isdir(root) else "/var/tmp")
    return {"staged": staged, "parts": parts, "free": st.f_bavail * st.f_frsize}


def cmd_finalize(p):
    """Uploaded `.part` files: sha256 checked, good ones renamed into place, bad ones deleted."""
    root = p.get("root") or STAGE_ROOT
    out = {}
    for w in p["wheels"]:
        d = os.path.join(_incoming(root), w["sha256"])
        final = os.path.join(d, w["filename"])
        part = final + ".part"
        if os.path.exists(final) and sha256_file(final) == w["sha256"]:
            out[w["sha256"]] = "ok"
            continue
        if not os.path.exists(part):
            out[w["sha256"]] = "absent"
            continue
        if sha256_file(part) == w["sha256"]:
            os.replace(part, final)
            out[w["sha256"]] = "ok"
        else:
            os.unlink(part)
            out[w["sha256"]] = "bad-hash"
    return {"wheels": out}


def _run(argv, timeout=3600):
    t0 = time.time()
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True,
                       timeout=timeout)
    return {"argv": argv[:3] + (["..."] if len(argv) > 3 else []), "rc": p.returncode,
            "output": p.stdout[-6000:], "seconds": round(time.time() - t0, 2)}


def _lock(root):
    import fcntl
    os.makedirs(root, exist_ok=True)
    fh = open(os.path.join(root, "lock"), "w")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise RuntimeError("another provision holds %s/lock on this host" % root)
    return fh


def _backup(root, pid, python, names, layout):
    """Keep the current versions of `names` as wheels (rebuilt from their RECORD, stored uncompressed)."""
    bdir = os.path.join(root, "backups", pid)
    os.makedirs(bdir, exist_ok=True)
    before = installed_versions(names)
    wheels = {}
    for n in sorted(names):
        if before.get(n) is None:
            continue
        d = find_dist(n)
        r = repack(_dist_info_path(d), bdir, compression=zipfile.ZIP_STORED, layout=layout)
        wheels[n] = {"filename": r["filename"], "sha256": r["sha256"], "size": r["size"], "drift": r["drift"]}
    manifest = {"id": pid, "created": time.time(), "python": python, "before": before, "wheels": wheels,
                "status": "backed-up"}
    _write_manifest(bdir, manifest)
    return bdir, manifest


def _write_manifest(bdir, manifest):
    tmp = os.path.join(bdir, "manifest.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(bdir, "manifest.json"))


def _restore(bdir, manifest, steps):
    """Bring every distribution in the manifest back to its `before` version."""
    python = manifest["python"]
    before = manifest["before"]
    now = installed_versions(before)
    remove = sorted(n for n, v in before.items() if v is None and now.get(n) is not None)
    if remove:
        steps.append(dict(_run(pip_uninstall_argv(python, remove)), step="restore-uninstall"))
    reinstall = sorted(n for n, v in before.items() if v is not None and now.get(n) != v)
    # pip rolls a failed distribution back to its old files; check that rather than trust it
    for n, v in sorted(before.items()):
        if v is None or n in reinstall or now.get(n) != v:
            continue
        d = find_dist(n)
        drift, _size = verify_record(_dist_info_path(d)) if d is not None else ([1], 0)
        if drift and not manifest["wheels"][n].get("drift"):
            reinstall.append(n)
    if reinstall:
        wheels = [os.path.join(bdir, manifest["wheels"][n]["filename"]) for n in reinstall]
        for w, n in zip(wheels, reinstall):
            if sha256_file(w) != manifest["wheels"][n]["sha256"]:
                raise RuntimeError("backup wheel %s fails its sha256 check" % w)
        steps.append(dict(_run(pip_install_argv(python, wheels)), step="restore-install"))
    after = installed_versions(before)
    wrong = {n: (before[n], after[n]) for n in before if after[n] != before[n]}
    return wrong


def cmd_apply(p):
    """Backup, install, remove extras, smoke-import; restore the backup on any failure."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a dropped SSH session must not stop us half-way
    root = p.get("root") or STAGE_ROOT
    lock = _lock(root)
    layout = _layout()
    python = p["python"]
    names = sorted({normalize(w["name"]) for w in p["install"]} | {normalize(n) for n in p.get("remove", [])})
    steps = []
    result = {"id": p["id"], "steps": steps, "ok": False}
    for w in p["install"]:
        path = os.path.join(_incoming(root), w["sha256"], w["filename"])
        if not os.path.exists(path) or sha256_file(path) != w["sha256"]:
            result["error"] = "staged wheel %s is missing or fails its sha256 check; nothing changed" % w["filename"]
            return result
    bdir, manifest = _backup(root, p["id"], python, names, layout)
    manifest["plan"] = {"install": [w["filename"] for w in p["install"]], "remove": p.get("remove", [])}
    result["backup"] = bdir
    failure = None
    try:
        if p["install"]:
            r = dict(_run(p["pip_install"]), step="install")
            steps.append(r)
            if r["rc"] != 0:
                failure = "pip install failed (exit %d)" % r["rc"]
        if failure is None and p.get("remove"):
            r = dict(_run(p["pip_uninstall"]), step="remove-extra")
            steps.append(r)
            if r["rc"] != 0:
                failure = "pip uninstall failed (exit %d)" % r["rc"]
        if failure is None:
            now = installed_versions(names)
            want = dict((normalize(w["name"]), w["version"]) for w in p["install"])
            want.update((normalize(n), None) for n in p.get("remove", []))
            off = {n: (v, now.get(n)) for n, v in want.items() if now.get(n) != v}
            if off:
                failure = "after pip, versions differ from the plan: %s" % off
        if failure is None and p.get("smoke", True):
            mods = set()
            for w in p["install"]:
                d = find_dist(w["name"])
                if d is not None:
                    mods.update(top_level_modules(_dist_info_path(d)))
            result["smoke_modules"] = sorted(mods)
            if mods:
                cuda = bool(p.get("cuda_init")) and "torch" in mods and os.path.exists("/dev/nvidiactl")
                r = dict(_run(smoke_argv(python, mods, cuda), timeout=600), step="smoke", cuda_init=cuda)
                steps.append(r)
                if r["rc"] != 0:
                    failure = "smoke import failed (exit %d)" % r["rc"]
    except Exception as exc:  # restore below, whatever went wrong
        failure = "%s: %s" % (type(exc).__name__, exc)
    if failure is None:
        manifest["status"] = "applied"
        manifest["after"] = installed_versions(names)
        _write_manifest(bdir, manifest)
        result["ok"] = True
        result["after"] = manifest["after"]
        lock.close()
        return result
    result["error"] = failure
    wrong = _restore(bdir, manifest, steps)
    manifest["status"] = "restored-after-failure" if not wrong else "restore-incomplete"
    _write_manifest(bdir, manifest)
    result["restored"] = not wrong
    if wrong:
        result["restore_error"] = "still differs after restore: %s" % wrong
    lock.close()
    return result


def _backups(root):
    base = os.path.join(root, "backups")
    out = []
    if os.path.isdir(base):
        for pid in sorted(os.listdir(base)):
            try:
                with open(os.path.join(base, pid, "manifest.json")) as fh:
                    out.append(json.load(fh))
            except (OSError, ValueError):
                continue
    out.sort(key=lambda m: m.get("created", 0))
    return out


def cmd_undo(p):
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    root = p.get("root") or STAGE_ROOT
    lock = _lock(root)
    ms = [m for m in _backups(root) if m.get("status") == "applied" and (not p.get("id") or m["id"] == p["id"])]
    if not ms:
        lock.close()
        return {"ok": False, "error": "no applied provision to undo under %s/backups" % root}
    m = ms[-1]
    bdir = os.path.join(root, "backups", m["id"])
    steps = []
    wrong = _restore(bdir, m, steps)
    m["status"] = "undone" if not wrong else "undo-incomplete"
    m["undone_at"] = time.time()
    _write_manifest(bdir, m)
    lock.close()
    return {"ok": not wrong, "id": m["id"], "before": m["before"], "steps": steps,
            "error": ("still differs after undo: %s" % wrong) if wrong else None}


def cmd_backups(p):
    return {"backups": _backups(p.get("root") or STAGE_ROOT)}


COMMANDS = {"scan": cmd_scan, "build": cmd_build, "stage": cmd_stage, "finalize": cmd_finalize,
            "apply": cmd_apply, "undo": cmd_undo, "backups": cmd_backups}


def main(argv):
    cmd, payload = argv[1], json.loads(argv[2]) if len(argv) > 2 else {}
    try:
        out = COMMANDS[cmd](payload)
    except Exception as exc:
        out = {"ok": False, "error": "%s: %s" % (type(exc).__name__, exc), "agent_exception": True}
    sys.stdout.write("\n@@AGENT@@" + json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
    main(sys.argv)
