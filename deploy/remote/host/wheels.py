"""Wheels and installed distributions (PEP 427, PEP 376, PEP 503), stdlib only: names, RECORD, repacking, checks.

Used on the hosts (scan, build, receive, apply) and on the control machine (the wheel cache), one copy.
Every wheel file name is matched whole against WHEEL_NAME before it becomes part of a path; every wheel is
checked member by member against its RECORD before it is cached and again before it is installed.
"""
import base64
import csv
import hashlib
import io
import os
import re

from .dists import normalize, parse_wheel_tags as wheel_tags  # noqa: F401 (one copy: dists, self-contained)
from .fsutil import sha256_file

ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed entry times: the same installed files give the same wheel bytes
# Written by the installer, not part of the wheel (PEP 376, PEP 610, PEP 627).
INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}
# name-version(-build)?-python-abi-platform.whl, each part from the spec's alphabet; nothing else (no '/', no
# leading '.', no whitespace), so a name can never become '../x' or an absolute path.
WHEEL_NAME = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._]*[A-Za-z0-9])?)-(?P<version>[A-Za-z0-9_.!+]+)"
                        r"(?:-(?P<build>[0-9][A-Za-z0-9_.]*))?-(?P<py>[A-Za-z0-9_.]+)-(?P<abi>[A-Za-z0-9_.]+)"
                        r"-(?P<plat>[A-Za-z0-9_.]+)\.whl")
SHA256 = re.compile(r"[0-9a-f]{64}")


class WheelError(ValueError):
    pass


def wheel_name_component(name):
    """Distribution name as a wheel file name spells it (binary distribution format spec)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def parse_wheel_filename(filename):
    """'torch-2.11.0+cu130-cp311-cp311-linux_x86_64.whl' -> ('torch', '2.11.0+cu130'); None for anything that
    is not a wheel name matched whole (a path, '..', whitespace, a missing part)."""
    if not isinstance(filename, str) or len(filename) > 255:
        return None
    m = WHEEL_NAME.fullmatch(filename)
    if not m or ".." in filename.split("-", 1)[0]:
        return None
    return normalize(m.group("name")), m.group("version")


def checked_filename(filename):
    """`filename` when it is a wheel name matched whole; raises WheelError otherwise."""
    if parse_wheel_filename(filename) is None:
        raise WheelError("%r is not a wheel file name" % (filename,))
    return filename


def checked_sha256(sha):
    if not isinstance(sha, str) or not SHA256.fullmatch(sha):
        raise WheelError("%r is not a sha256" % (sha,))
    return sha


def record_hash(data):
    """A file's sha256 in RECORD form: 'sha256=' + urlsafe base64 without padding."""
    return record_digest(hashlib.sha256(data).digest())


def record_digest(digest):
    """A sha256 digest (32 bytes, already computed) in RECORD form. Kept apart from record_hash: a file of exactly
    32 bytes is data to hash, never its own digest (a typeshed stub in jedi 0.20.1 is one)."""
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def parse_record(text):
    """RECORD text -> [(path, hash or '', size or None)]."""
    rows = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        h = row[1] if len(row) > 1 else ""
        size = row[2] if len(row) > 2 else ""
        rows.append((row[0], h, int(size) if size.isdigit() else None))
    return rows


def record_text(rows):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for r in rows:
        w.writerow(r)
    return buf.getvalue()


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
    return checked_filename("%s-%s-%s.whl" % (wheel_name_component(name), version.replace("-", "_"),
                                             compressed_tag(tags)))


def site_pth(path):
    """Is this archive (or RECORD) path a .pth file that site.py would run at every interpreter start?
    Top level of the wheel, or the top of its .data/purelib|platlib."""
    parts = path.split("/")
    if not path.endswith(".pth"):
        return False
    return len(parts) == 1 or (len(parts) == 3 and parts[0].endswith(".data") and parts[1] in ("purelib", "platlib"))


def _safe_member(name):
    return not (name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in name.rstrip("/").split("/")))


def check_wheel(path, allow_pth=(), name=None):
    """Validate a wheel (PEP 427) member by member: a strict file name; one .dist-info with METADATA, WHEEL
    (Wheel-Version 1.x, Tag lines) and RECORD; every member a safe relative path, listed in RECORD with a
    matching sha256 and size, nothing listed that is absent; no .pth that site.py would run unless its name is
    in `allow_pth` (the ones the installed distribution itself has). `name` is the wheel's file name when `path`
    is a download or staging file with another name. Returns {name, version, tags, files, pth}; raises
    WheelError."""
    import zipfile
    base = name or os.path.basename(path)
    nv = parse_wheel_filename(base)
    if nv is None:
        raise WheelError("%r: not a wheel file name" % base)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise WheelError("%s: not a zip archive (%s)" % (base, exc))
    with zf:
        names = zf.namelist()
        bad = [n for n in names if not _safe_member(n)]
        if bad:
            raise WheelError("%s: member %r is not a safe relative path" % (base, bad[0]))
        if len(set(names)) != len(names):
            raise WheelError("%s: duplicate members" % base)
        dis = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
        if len(dis) != 1:
            raise WheelError("%s: expected one .dist-info directory, found %s" % (base, dis))
        di = dis[0]
        for req in ("METADATA", "WHEEL", "RECORD"):
            if "%s/%s" % (di, req) not in names:
                raise WheelError("%s: %s/%s missing" % (base, di, req))
        wheel = zf.read(di + "/WHEEL").decode("utf-8", "replace")
        if not any(line.strip().startswith("Wheel-Version: 1.") for line in wheel.splitlines()):
            raise WheelError("%s: WHEEL has no Wheel-Version 1.x" % base)
        tags = wheel_tags(wheel)
        if not tags:
            raise WheelError("%s: WHEEL has no Tag lines" % base)
        rows = {p: (h, s) for p, h, s in parse_record(zf.read(di + "/RECORD").decode("utf-8"))}
        pth = []
        for info in zf.infolist():
            n = info.filename
            if n.endswith("/"):
                continue
            if n not in rows:
                raise WheelError("%s: %s is not listed in RECORD" % (base, n))
            if site_pth(n):
                pth.append(n.rsplit("/", 1)[-1])
            if n == di + "/RECORD":
                continue
            h, size = rows[n]
            digest = hashlib.sha256()
            got = 0
            with zf.open(info) as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
                    got += len(block)
            if h != record_digest(digest.digest()) or (size is not None and size != got):
                raise WheelError("%s: %s does not match its RECORD hash/size" % (base, n))
        absent = [p for p in rows if p not in names]
        if absent:
            raise WheelError("%s: RECORD lists absent files %s" % (base, absent[:3]))
        stray = sorted(set(pth) - set(allow_pth))
        if stray:
            raise WheelError("%s: carries %s, a .pth file that would run at every interpreter start"
                             % (base, ", ".join(stray)))
    return {"name": nv[0], "version": nv[1], "tags": tags, "files": len(names), "pth": sorted(pth)}


# ---------------------------------------------------------------- installed distributions

def name_version(dist_info):
    """Name and Version from a distribution's core metadata headers (METADATA, or PKG-INFO of an .egg-info)."""
    name = version = None
    meta = os.path.join(dist_info, "METADATA" if dist_info.endswith(".dist-info") else "PKG-INFO")
    with open(meta, encoding="utf-8", errors="replace") as fh:
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


def read_record(dist_info):
    with open(os.path.join(dist_info, "RECORD"), encoding="utf-8") as fh:
        return parse_record(fh.read())


def dist_files(dist_info, layout):
    """Classify an installed distribution's RECORD rows for repacking.

    Returns (site, rows) where rows are (record_path, abs_path, archive_path or None, expected_hash).
    archive_path None means "written by the installer, not part of a wheel" (pyc, RECORD, INSTALLER,
    console-script wrappers that pip generates from entry_points.txt).
    """
    dist_info = os.path.abspath(dist_info)
    site = os.path.dirname(dist_info)
    di_name = os.path.basename(dist_info)
    name, version = name_version(dist_info)
    data_dir = "%s-%s.data" % (wheel_name_component(name), version)
    ep_scripts = _entry_point_scripts(dist_info)
    rows = []
    for path, h, _size in read_record(dist_info):
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


def _hash_and_size(path):
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            n += len(block)
    return record_digest(h.digest()), n


def verify_record(dist_info, layout):
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


def installed_pth(dist_info):
    """The .pth files an installed distribution's RECORD lists at the top of site-packages."""
    return sorted(p.rsplit("/", 1)[-1] for p, _h, _s in read_record(dist_info) if site_pth(p))


def _script_bytes(data):
    """An installed script's shebang back to the '#!python' a wheel carries (pip rewrites it)."""
    if data.startswith(b"#!"):
        nl = data.find(b"\n")
        first = data[:nl if nl >= 0 else len(data)]
        if b"python" in first:
            return b"#!python" + data[len(first):]
    return data


def repack(dist_info, out_dir, layout, compression=8):  # 8: zipfile.ZIP_DEFLATED
    """Rebuild a wheel from an installed distribution (PEP 427 layout, PEP 376 RECORD).

    The files are read as they are now, so a file changed by hand lands in the wheel with its new hash
    (the caller reports such drift from verify_record). Entries are sorted, timestamps fixed and
    dist-info written last, so the same installed files always give byte-identical wheels.
    Returns {path, filename, sha256, size, drift, name, version}.
    """
    import zipfile
    dist_info = os.path.abspath(dist_info)
    di_name = os.path.basename(dist_info)
    name, version = name_version(dist_info)
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
    final = os.path.join(out_dir, filename)
    tmp = final + ".tmp%d" % os.getpid()
    record_rows = []
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as raw, \
                zipfile.ZipFile(raw, "w", compression=compression, compresslevel=1 if compression else None) as zf:
            for arc, absp, h, path in entries:
                with open(absp, "rb") as fh:
                    data = fh.read()
                script = "/scripts/" in arc and arc.split("/", 1)[0].endswith(".data")
                if script:
                    data = _script_bytes(data)
                rh = record_hash(data)  # once per file: these are torch's and CUDA's GBs
                if h and not script and rh != h:
                    drift.append({"path": path, "problem": "modified"})
                mode = os.stat(absp).st_mode & 0o777
                zi = zipfile.ZipInfo(arc, ZIP_EPOCH)
                zi.external_attr = (0o100000 | (mode | 0o644)) << 16
                zi.compress_type = compression
                zf.writestr(zi, data)
                record_rows.append((arc, rh, str(len(data))))
            rec_arc = di_name + "/RECORD"
            zi = zipfile.ZipInfo(rec_arc, ZIP_EPOCH)
            zi.external_attr = 0o100644 << 16
            zi.compress_type = compression
            zf.writestr(zi, record_text(record_rows + [(rec_arc, "", "")]).encode())
        os.replace(tmp, final)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return {"path": final, "filename": filename, "sha256": sha256_file(final), "size": os.path.getsize(final),
            "drift": drift, "name": normalize(name), "version": version}


def wheel_matches_installed(whl, dist_info, allow_pth=None):
    """Is `whl` exactly the wheel this distribution was installed from? The wheel must pass check_wheel (every
    member hashed against its RECORD: a changed file fails), and every file of it outside .data (which the
    installer rewrites) must be installed with the same hash: an extra file -- a .pth above all -- fails."""
    if allow_pth is None:
        allow_pth = installed_pth(dist_info)
    try:
        check_wheel(whl, allow_pth)
    except WheelError:
        return False
    import zipfile
    installed = {p: h for p, h, _s in read_record(dist_info) if h}
    with zipfile.ZipFile(whl) as zf:
        (rec,) = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        rows = parse_record(zf.read(rec).decode("utf-8"))
    checked = 0
    for path, h, _s in rows:
        if path == rec or path.split("/", 1)[0].endswith(".data"):
            continue
        if not h or installed.get(path) != h:
            return False
        checked += 1
    return checked > 0


def top_level_modules(dist_info):
    """Importable top-level modules of an installed distribution (for the smoke import)."""
    site = os.path.dirname(os.path.abspath(dist_info))
    mods = set()
    for p, _h, _s in read_record(dist_info):
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
