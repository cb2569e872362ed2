"""A managed venv as files: its layout, its installed distributions (the .dist-info / .egg-info directories of
its site-packages and their core metadata headers, read directly: the agent never runs the venv's own
interpreter to list them, and skips importlib.metadata's 45 ms of imports on every probe), and whether root
may run it.

The agent runs under the host's system python3; the venv may be another Python version. Only pip and the smoke
import run the venv's python, as root, and only after trusted_tree() found nothing another user could write.
"""
import glob
import os

from .fsutil import Unsafe, trusted_tree  # noqa: F401 (Unsafe: what check_runnable raises)
from . import dists
from .dists import normalize


class VenvError(RuntimeError):
    pass


def python(venv):
    return os.path.join(venv, "bin", "python")


def pyvenv_cfg(venv):
    try:
        with open(os.path.join(venv, "pyvenv.cfg"), encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def lib_dirs(venv):
    """'python3.11' (or 'python3.13t') for each lib/python3*/site-packages, newest last."""
    found = sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages")),
                   key=lambda p: [int(x) if x.isdigit() else 0 for x in os.path.basename(os.path.dirname(p))
                                  .replace("python", "").rstrip("t").split(".")])
    return [os.path.basename(os.path.dirname(p)) for p in found]


def site_packages(venv):
    dirs = lib_dirs(venv)
    if not dirs:
        raise VenvError("%s: no lib/python3*/site-packages" % venv)
    return os.path.join(venv, "lib", dirs[-1], "site-packages")


def layout(venv):
    """Where pip puts each scheme for this venv (posix_prefix with the venv as prefix)."""
    sp = site_packages(venv)
    lib = os.path.basename(os.path.dirname(sp))
    return {"purelib": sp, "platlib": sp, "scripts": os.path.join(venv, "bin"), "data": venv,
            "headers": os.path.join(venv, "include", "site", lib)}


class Dist(object):
    """One installed distribution: its metadata directory, name and version."""

    def __init__(self, path, name, version):
        self.path, self.name, self.version = path, name, version

    def read_text(self, filename):
        try:
            with open(os.path.join(self.path, filename), encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return None


def index(site):
    """{canonical name: Dist} of what is installed in `site`, by the facts probe's own reader
    (dists.find_distributions) and named and versioned as the control side's facts name them (METADATA
    first: facts.raw_distributions), so a provision step sees the versions its plan was made from. One
    directory scan: build it once per step, not per name."""
    found, _problems = dists.find_distributions([site])
    return dict((normalize(r["name"] or r["dir_name"]),
                 Dist(r["path"], r["name"] or r["dir_name"], r["version"] or r["dir_version"])) for r in found)


def find_dist(site, name):
    return index(site).get(normalize(name))


def installed_versions(site, names, installed=None):
    """{canonical name: installed version or None} for `names` (`installed`: an index() already made)."""
    installed = index(site) if installed is None else installed
    return dict((normalize(n), getattr(installed.get(normalize(n)), "version", None)) for n in names)


def check_runnable(venv):
    """Raise Unsafe unless root may run this venv's python (see fsutil.trusted_tree)."""
    if not os.path.exists(python(venv)):
        raise VenvError("%s has no bin/python" % venv)
    return trusted_tree(venv)

