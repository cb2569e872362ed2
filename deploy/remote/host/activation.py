"""Activating a release as one transaction: the plugin wheel in the venv, the file overlays, the router's venv,
the unit file with the per-GPU drop-ins (unitfiles.py), the `current` switch and the units' enablement switch
together, or every step already done is undone (ActivationFailed says what could not be)."""
import os
import shutil
import time

from . import venv as venvmod
from .fsutil import Unsafe, atomic_write, describe, sha256_file, trusted_dir, trusted_tree
from .registry import Failure
from .releasedir import FILE_MODE, current_release, link, manifest_of, verify_release
from .secretcheck import check_secrets
from .unitfiles import put_systemd, systemd_files
from .wheels import WheelError, check_wheel, normalize


class ActivationFailed(Exception):
    def __init__(self, release, step, error, undo_errors):
        self.release, self.step, self.error, self.undo_errors = release, step, error, undo_errors
        Exception.__init__(self, "activating %s failed at %s: %s; %s" % (
            release, step, error, "every step done was undone" if not undo_errors
            else "UNDO INCOMPLETE: " + "; ".join(undo_errors)))


def plugin_version(venv, dist):
    try:
        return venvmod.installed_versions(venvmod.site_packages(venv), [dist]).get(normalize(dist))
    except venvmod.VenvError:
        return None


def overlay_check(venv, overlays):
    """Each overlay: installed version matches and the target file is the original (or already patched)."""
    out = []
    if not overlays:
        return out
    sp = venvmod.site_packages(venv)
    versions = venvmod.installed_versions(sp, [o["package"] for o in overlays])
    for o in overlays:
        path = os.path.join(sp, o["path"])
        have = versions.get(normalize(o["package"]))
        sha = sha256_file(path, follow=False) if os.path.isfile(path) and not os.path.islink(path) else None
        ok = have == o["version"] and sha in (o["sha256"], o["new_sha256"])
        why = ""
        if have != o["version"]:
            why = "%s is %s on the host, the overlay is for %s" % (o["package"], have, o["version"])
        elif sha not in (o["sha256"], o["new_sha256"]):
            why = "%s has sha256 %s, the overlay expects %s" % (o["path"], sha, o["sha256"])
        out.append({"path": o["path"], "ok": ok, "why": why, "state": "patched" if sha == o["new_sha256"] else "orig"})
    return out


def activate(h, spec):
    """Make spec["release"] active: plugin wheel, overlays, unit file and per-GPU drop-ins, `current`,
    enablement -- or nothing."""
    target = spec["release"]
    man = manifest_of(h.root, target)
    if not man:
        raise Failure("no-release", "release %s is not on this host" % target)
    prev = current_release(h.root)
    pman = manifest_of(h.root, prev) if prev and prev != target else None
    # every check before the first change
    verify_release(h.root, target, man)
    try:
        trusted_tree(h.venv)
        check_secrets(h.a.get("secrets_file"))
    except Unsafe as exc:
        raise Failure("unsafe", "refusing to activate %s: %s; nothing changed" % (target, exc))
    sp = venvmod.site_packages(h.venv) if (man["overlays"] or (pman and pman["overlays"])) else None
    want = dict((o["path"], o) for o in man["overlays"])
    undo, done, step = [], [], "checks"
    t0 = time.monotonic()
    try:
        step = "plugin"
        h.run(spec["commands"]["install_plugin"], "pip install")
        undo.append(("plugin", lambda: h.run(spec["commands"]["undo_plugin"], "restore plugin")))
        done.append(step)
        step = "overlays"
        saved = {}

        def put_file(path, data):
            if path not in saved:
                saved[path] = open(path, "rb").read() if os.path.isfile(path) else None
            atomic_write(path, data, FILE_MODE)
        undo.append(("overlays", lambda: [atomic_write(p, d, FILE_MODE) for p, d in saved.items()
                                          if d is not None]))
        for o in (pman or {}).get("overlays", []):
            if o["path"] not in want:
                orig = os.path.join(h.root, prev, "overlays", "orig", o["path"])
                if os.path.isfile(orig):
                    put_file(os.path.join(sp, o["path"]), open(orig, "rb").read())
        bad = [c for c in overlay_check(h.venv, man["overlays"]) if not c["ok"]]
        if bad:
            raise RuntimeError("file overlay guard: " + "; ".join(c["why"] for c in bad))
        tdir = os.path.join(h.root, target)
        for o in man["overlays"]:
            target_file = os.path.join(sp, o["path"])
            orig = os.path.join(tdir, "overlays", "orig", o["path"])
            if not os.path.exists(orig):
                src = None
                if sha256_file(target_file) == o["sha256"]:
                    src = target_file
                elif pman:  # already patched by the previous release: its copy is the original
                    porig = os.path.join(h.root, prev, "overlays", "orig", o["path"])
                    src = porig if os.path.isfile(porig) else None
                if src:
                    os.makedirs(os.path.dirname(orig), 0o755, exist_ok=True)
                    atomic_write(orig, open(src, "rb").read(), FILE_MODE)
            put_file(target_file, open(os.path.join(tdir, "overlays", "new", o["path"]), "rb").read())
        done.append(step)
        step = "router-venv"
        rv = spec.get("router_venv")
        if rv and not os.path.isdir(rv["path"]):
            build_router_venv(h, rv, target)
            undo.append(("router-venv", lambda: shutil.rmtree(rv["path"], ignore_errors=True)))
            done.append(step)
        step = "unit"  # the template unit and the per-GPU drop-ins switch together, with one daemon-reload
        put_systemd(h, systemd_files(h, tdir, man, spec), undo, spec["commands"]["daemon_reload"])
        done.append(step)
        step = "current"
        link(h.root, target)
        undo.append(("current", lambda: link(h.root, prev)))
        done.append(step)
        step = "enable"
        for key in ("enable", "disable"):
            if spec["commands"].get(key):
                h.run(spec["commands"][key], "systemctl " + key)
        done.append(step)
    except Failure:
        raise
    except Exception as exc:
        errors = []
        for name, fn in reversed(undo):
            try:
                fn()
            except Exception as uexc:  # keep undoing the rest; say what could not be undone
                errors.append("%s: %s: %s" % (name, type(uexc).__name__, uexc))
        raise ActivationFailed(target, step, describe(exc), errors)
    return {"previous": prev, "current": target, "steps": done, "seconds": round(time.monotonic() - t0, 2)}


def build_router_venv(h, rv, rid):
    """The router's own venv from the wheel the release carries, built beside its final path and renamed
    into place: there is a whole venv at rv["path"] or none."""
    base = os.path.join(h.sdir, "router")
    path, tmp = rv["path"], rv["path"] + ".tmp"
    if os.path.dirname(path) != base or not os.path.basename(path).startswith("sglang-router-") or \
            rv["commands"]["venv"][-1] != tmp:
        raise RuntimeError("refusing router venv path %r (must be in %s)" % (path, base))
    wheel = os.path.join(h.root, rid, rv["wheel"])
    if not os.path.isfile(wheel):
        raise RuntimeError("the host has no router venv %s and release %s does not carry its wheel; deploy "
                           "again (the plan sends the wheel to a host that lacks it)" % (path, rid))
    try:
        check_wheel(wheel)
    except WheelError as exc:
        raise RuntimeError("router wheel refused: %s" % exc)
    if sha256_file(wheel) != rv["sha256"]:
        raise RuntimeError("router wheel %s does not have the pinned sha256" % rv["wheel"])
    trusted_dir(base, create=True)
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    try:
        h.run(rv["commands"]["venv"], "router venv", timeout=300)
        h.run(rv["commands"]["install"], "router pip install", timeout=600)
        os.rename(tmp, path)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
