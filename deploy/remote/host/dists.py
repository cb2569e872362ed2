"""Installed distributions of a Python environment, read straight from their metadata files.

Stdlib only: this runs on fleet hosts (Python 3.10+) inside the managed venv's interpreter, where
`packaging` may be absent. It reads what `pip check` reads and nothing more: each distribution's
name, version, raw `Requires-Dist` lines, `Requires-Python`, `Provides-Extra` and WHEEL tags, plus
the interpreter's marker environment. The control side (deploy/coherence.py) evaluates them with
`packaging`.

Discovery follows importlib.metadata (which pip's default backend uses): every `*.dist-info` and
`*.egg-info` entry of every path entry, in path order; for one normalised name the first found
wins, exactly as pip's `_DistributionFinder` dedups. Only the header block of METADATA/PKG-INFO is
parsed (a long description after the blank line is never read into the parser), so hundreds of
distributions take milliseconds. Not handled, as they are not installed by pip: `.egg` zip/dir
eggs and legacy `.egg-link` files (a develop install's egg-info is still found through the path
entry that its .pth adds).
"""
from __future__ import annotations

import json
import os
import platform
import re
import sys

__all__ = ["normalize", "split_headers", "parse_metadata", "egg_info_requires", "parse_wheel_tags",
           "info_dir_name", "find_distributions", "metadata_key", "marker_environment", "collect"]

_NORMALIZE = re.compile(r"[-_.]+")
_INFO_SUFFIXES = (".dist-info", ".egg-info")
# A METADATA header block is a few KB even for the largest projects; a cap keeps a hostile or
# corrupt file from being read whole.
MAX_HEADER_BYTES = 1 << 20


def normalize(name: str) -> str:
    """PEP 503 name normalisation (what packaging.utils.canonicalize_name does)."""
    return _NORMALIZE.sub("-", name).lower()


def split_headers(text: str) -> str:
    """The header block of a core-metadata file: everything before the first empty line."""
    text = text.replace("\r\n", "\n")
    head, sep, _ = text.partition("\n\n")
    return head + "\n" if sep else text


def parse_metadata(text: str) -> dict:
    """METADATA / PKG-INFO text -> name, version, requires_dist (raw, in file order), requires_python,
    provides_extra. Folded header lines are unfolded by the email parser (as importlib.metadata does);
    each Requires-Dist value is stripped, as pip strips it."""
    import email.parser  # 8 ms of imports: only when metadata is read, not when the probe's cache answers
    msg = email.parser.Parser().parsestr(split_headers(text), headersonly=True)

    def one(key):
        v = msg.get(key)
        return None if v is None else str(v).strip()

    return {"name": one("Name"), "version": one("Version"),
            "requires_dist": [str(v).strip() for v in msg.get_all("Requires-Dist") or []],
            "requires_python": one("Requires-Python"),
            "provides_extra": [str(v).strip() for v in msg.get_all("Provides-Extra") or []]}


def egg_info_requires(text: str | None) -> list[str]:
    """An egg-info `requires.txt` -> Requires-Dist strings, converted the way pip converts them
    (pip's `_iter_egg_info_dependencies`: a `[extra:marker]` section becomes `(marker) and extra == "x"`)."""
    out: list[str] = []
    extra = marker = ""
    for line in (text or "").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            extra, _, marker = line.strip("[]").partition(":")
            continue
        ex = normalize(extra) if extra else ""
        if ex and marker:
            cond = f'({marker}) and extra == "{ex}"'
        elif ex:
            cond = f'extra == "{ex}"'
        else:
            cond = marker
        out.append(f"{line} ; {cond}" if cond else line)
    return out


def parse_wheel_tags(text: str | None) -> list[str]:
    """A dist-info WHEEL file -> its `Tag:` values ('cp311-cp311-manylinux_2_28_x86_64')."""
    return [line.split(":", 1)[1].strip() for line in (text or "").splitlines() if line.startswith("Tag:")]


def info_dir_name(entry: str) -> tuple[str, str | None] | None:
    """A metadata directory's own name and version, as pip reads them before any file: 'Foo_Bar-1.0.dist-info'
    -> ('Foo_Bar', '1.0'); 'foo.egg-info' -> ('foo', None) (an egg-info name carries no trusted version);
    None for an entry that is not a metadata directory. pip takes a distribution's name and version from
    here first and from METADATA only when the directory name lacks them."""
    low = entry.lower()
    if not low.endswith(_INFO_SUFFIXES):
        return None
    stem = entry.rpartition(".")[0]
    if low.endswith(".dist-info"):
        name, sep, version = stem.partition("-")
        return (name, version) if sep else (name, None)
    return stem.split("-", 1)[0], None


def _read(path: str, limit: int | None = None) -> str | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read(limit) if limit else fh.read()
    except OSError:
        return None
    return data.decode("utf-8", "replace")


def _read_info(info: str) -> dict | None:
    """One metadata directory (or an egg-info PKG-INFO file) -> the distribution's record."""
    is_egg = info.lower().endswith(".egg-info")
    if os.path.isdir(info):
        text = _read(os.path.join(info, "PKG-INFO" if is_egg else "METADATA"), MAX_HEADER_BYTES)
    elif is_egg:  # old distutils: the .egg-info entry is the PKG-INFO file itself
        text = _read(info, MAX_HEADER_BYTES)
    else:
        return None
    if text is None:
        return None
    meta = parse_metadata(text)
    if is_egg and not meta["requires_dist"] and os.path.isdir(info):
        meta["requires_dist"] = egg_info_requires(_read(os.path.join(info, "requires.txt")))
    meta["path"] = info
    meta["kind"] = "egg-info" if is_egg else "dist-info"
    meta["wheel_tags"] = [] if is_egg else parse_wheel_tags(_read(os.path.join(info, "WHEEL"), 1 << 16))
    return meta


def find_distributions(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """Every distribution on `paths` (a sys.path), first found wins per normalised name.

    Returns (distributions, problems): a metadata directory without a readable Name or Version is a
    problem (pip skips it with a warning), not a distribution. A directory listing is taken in the
    order os.listdir gives it, as importlib.metadata takes it.
    """
    found: dict[str, dict] = {}
    problems: list[dict] = []
    for location in paths:
        if not location:
            location = "."
        if not os.path.isdir(location) or location.lower().endswith(".whl"):
            continue
        try:
            entries = os.listdir(location)
        except OSError:
            continue
        for entry in entries:
            from_dir = info_dir_name(entry)
            if from_dir is None:
                continue
            dir_name, dir_version = from_dir
            path = os.path.join(location, entry)
            if dir_name and normalize(dir_name) in found:  # pip's finder dedups before reading metadata
                continue
            rec = _read_info(path)
            if rec is None:
                problems.append({"path": path, "error": "unreadable metadata"})
                continue
            rec["dir_name"], rec["dir_version"] = dir_name or None, dir_version or None
            name = rec["dir_name"] or rec["name"]
            if not name:
                problems.append({"path": path, "error": "no Name in metadata"})
                continue
            if normalize(name) in found:
                continue
            if not (rec["dir_version"] or rec["version"]):
                problems.append({"path": path, "error": "no Version in metadata"})
                continue
            found[normalize(name)] = rec
    return list(found.values()), problems


def metadata_key(paths: list[str]) -> str:
    """What find_distributions(paths) depends on, as one string: each metadata entry's METADATA (PKG-INFO)
    path, size and mtime in nanoseconds, in listing order. An install, upgrade or removal by pip changes it
    (pip writes a fresh METADATA every time), so a cache of find_distributions keyed by it stays true; a
    file edited in place that keeps its size and mtime is not seen."""
    parts = []
    for location in paths:
        location = location or "."
        try:
            entries = os.listdir(location)
        except OSError:
            continue
        for entry in entries:
            if info_dir_name(entry) is None:
                continue
            path = os.path.join(location, entry)
            for meta in (os.path.join(path, "METADATA"), os.path.join(path, "PKG-INFO"), path):
                try:
                    st = os.stat(meta)
                except OSError:
                    continue
                parts.append("%s:%d:%d" % (meta, st.st_size, st.st_mtime_ns))
                break
            else:
                parts.append(path + ":-")
    return "\n".join(parts)


def _full_version(info) -> str:
    version = f"{info.major}.{info.minor}.{info.micro}"
    if info.releaselevel != "final":
        version += info.releaselevel[0] + str(info.serial)
    return version


def marker_environment() -> dict:
    """PEP 508 marker variables of this interpreter (what packaging.markers.default_environment gives)."""
    return {
        "implementation_name": sys.implementation.name,
        "implementation_version": _full_version(sys.implementation.version),
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "platform_python_implementation": platform.python_implementation(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    }


def collect(paths: list[str] | None = None, find=find_distributions) -> dict:
    """The distributions this interpreter sees (default: its sys.path, as `pip check` run by it sees
    them), its marker environment, and any unreadable metadata. `find(paths)` gives (distributions,
    problems): find_distributions, or a cache of it (the facts probe's, keyed by the metadata files)."""
    paths = list(sys.path if paths is None else paths)
    dists, problems = find(paths)
    return {"python": platform.python_version(), "environment": marker_environment(), "paths": paths,
            "distributions": dists, "problems": problems}


def main(argv: list[str]) -> int:
    sys.stdout.write(json.dumps(collect(argv or None)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
