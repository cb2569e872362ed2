"""The unit files an activation installs: the release's template unit, the router's unit and each GPU's drop-in
(DeviceAllow for its own GPU), written into lstat-checked root directories with one daemon-reload, and put back
byte for byte when the activation is undone."""
import glob
import os

from .fsutil import atomic_write, check_path
from .releasedir import FILE_MODE
from .routerunit import ROUTER_UNIT


def systemd_files(h, tdir, man, spec):
    """{path: bytes, or None to remove}: the release's template unit, each service's per-GPU drop-in
    (DeviceAllow for its own GPU) and the removal of our drop-ins of instances the release has none for."""
    prefix = h.unit_file.split("@", 1)[0] + "@"
    want = {os.path.join(h.unit_dir, h.unit_file):
            open(os.path.join(tdir, "systemd", h.unit_file), "rb").read()}
    r = man.get("router") or {}
    if r.get("enabled"):
        if r.get("unit") != ROUTER_UNIT:
            raise RuntimeError("release %s: refusing router unit %r" % (man.get("release"), r.get("unit")))
        want[os.path.join(h.unit_dir, ROUTER_UNIT)] = open(os.path.join(tdir, "systemd", ROUTER_UNIT), "rb").read()
    name = spec.get("dropin_name")
    for inst, s in sorted(man.get("services", {}).items()):
        rel = s.get("dropin")
        if not rel:
            continue
        base = os.path.basename(rel)
        if rel != "%s%s.service.d/%s" % (prefix, inst, base) or base != (name or base) \
                or not base.endswith(".conf") or "/" in inst or inst in ("", ".", ".."):
            raise RuntimeError("release %s: refusing drop-in path %r of %s" % (man.get("release"), rel, inst))
        want[os.path.join(h.unit_dir, rel)] = open(os.path.join(tdir, "systemd", rel), "rb").read()
    if name:
        for old in glob.glob(os.path.join(glob.escape(h.unit_dir), glob.escape(prefix) + "*.service.d",
                                          glob.escape(name))):
            want.setdefault(old, None)
    return want


def put_systemd(h, want, undo, reload_argv):
    """Write (or, for None, remove) each file of `want` that differs, into lstat-checked root directories;
    one daemon-reload when anything changed. The undo puts every old file back and reloads again."""
    saved = {}

    def current(path):
        return open(path, "rb").read() if os.path.isfile(path) and not os.path.islink(path) else None

    def put(path, data):
        if data is None:
            if os.path.lexists(path):
                os.unlink(path)
            try:
                os.rmdir(os.path.dirname(path))  # a drop-in directory left empty
            except OSError:
                pass
        else:
            check_path(os.path.dirname(path), create=True)
            atomic_write(path, data, FILE_MODE)

    def restore():
        for path, old in saved.items():
            if old is None and current(path) is None:
                continue  # never written (or not ours): nothing to undo
            put(path, old)
        h.run(reload_argv, "daemon-reload")
    for path, data in sorted(want.items(), key=lambda kv: (kv[1] is not None, kv[0])):
        old = current(path)
        if old == data:
            continue
        if not saved:
            undo.append(("unit", restore))
        saved[path] = old
        put(path, data)
    if saved:
        h.run(reload_argv, "daemon-reload")
    return sorted(saved)
