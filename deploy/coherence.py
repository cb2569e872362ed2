"""Coherence before change: is a host's environment whole, and can the plugin run on it?

Pure functions over what the host-side collectors report (deploy/remote/host/dists.py: installed
distributions and the marker environment; deploy/remote/host/elfsyms.py: native extensions against
torch), evaluated with `packaging`. Three verdicts, each a value with human-readable reasons:

- `coherence_verdict`: the environment's unmet requirements, exactly as `pip check` lists them
  (same discovery, same marker and extra handling, same output lines);
- `deploy_verdict`: the installed SGLang is one the plugin supports (capabilities.json) and the pins
  among sglang / sglang-kernel / torch / flashinfer-python are met;
- `native_verdict`: the native extensions SGLang loads at startup resolve against the host's torch.
"""
from __future__ import annotations

import fnmatch
import re

import functools
import json
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.markers import UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags, parse_tag
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

# The distributions whose pins on each other decide whether SGLang can start at all.
CORE = ("sglang", "sglang-kernel", "torch", "flashinfer-python")
# pip's stdlib_pkgs: never reported as unsupported.
STDLIB_PKGS = frozenset({"python", "wsgiref", "argparse"})
CAPABILITIES = Path(__file__).resolve().parents[1] / "overlays/sglang-ddtree/src/sglang_ddtree/capabilities.json"
# Since pip 24.2, pip check takes a distribution's name and version from its .dist-info directory name
# before METADATA, and reports installed wheels whose tags the interpreter does not support.
MODERN_PIP = Version("24.2")


class CoherenceError(ValueError):
    pass


# ---------------------------------------------------------------- pip check

@dataclass(frozen=True)
class Installed:
    """One distribution as pip check sees it."""
    name: str                      # canonical
    version: Version
    requires: tuple[Requirement, ...]


@dataclass(frozen=True)
class Unmet:
    """One unmet requirement: `installed` is None when the dependency is missing."""
    package: str
    version: str
    requirement: str
    dependency: str
    installed: str | None

    @property
    def missing(self) -> bool:
        return self.installed is None

    def pip_line(self) -> str:
        """The line `pip check` prints for it."""
        if self.missing:
            return f"{self.package} {self.version} requires {self.dependency}, which is not installed."
        return (f"{self.package} {self.version} has requirement {self.requirement}, but you have "
                f"{self.dependency} {self.installed}.")


def modern_pip(dists: list[dict]) -> bool:
    """Does the environment's own pip (found among its distributions) follow pip >= 24.2's rules?
    An environment without pip is judged by today's pip."""
    for d in dists:
        if canonicalize_name(d.get("name") or "") == "pip":
            try:
                return Version(d.get("version") or "") >= MODERN_PIP
            except InvalidVersion:
                return True
    return True


def _pip_identity(d: dict, modern: bool = True) -> tuple[str | None, str | None]:
    """Name and version the way pip reads them: pip >= 24.2 from the dist-info directory name first,
    then METADATA; older pips from METADATA."""
    if modern:
        return d.get("dir_name") or d.get("name"), d.get("dir_version") or d.get("version")
    return d.get("name"), d.get("version")


def _evaluate(marker, environment: dict, extra: str) -> bool:
    return marker.evaluate(dict(environment, extra=extra))


@functools.lru_cache(maxsize=1 << 14)
def _dependency(line: str, environment: tuple) -> Requirement | None:
    """A Requires-Dist line as pip's iter_dependencies() keeps it: the requirement when it has no marker or
    its marker is true with extra == "", else None. Cached: a fleet repeats the same lines host after host
    (parsing them is most of a pip check's time); a line that does not parse raises, and is not cached."""
    req = Requirement(line.strip())
    return req if req.marker is None or _evaluate(req.marker, dict(environment), "") else None


def package_set(dists: list[dict], environment: dict, modern: bool | None = None) -> tuple[dict[str, Installed], list[str]]:
    """pip's `create_package_set_from_installed` over collected distributions: first of a name wins;
    each one's requirements filtered as `iter_dependencies()` filters them (no marker, or a marker true
    with extra == ""). A distribution whose version or requirements do not parse is left out and
    reported as a problem, as pip does. `modern`: pip >= 24.2's rules (default: the environment's pip)."""
    modern = modern_pip(dists) if modern is None else modern
    out: dict[str, Installed] = {}
    problems: list[str] = []
    env_key = tuple(sorted((str(k), str(v)) for k, v in environment.items()))
    for d in dists:
        raw, ver = _pip_identity(d, modern)
        if not raw:
            problems.append(f"{d.get('path') or '?'}: no name")
            continue
        name = canonicalize_name(raw)
        if name in out:
            continue
        try:
            version = Version(ver or "")
            reqs = [r for r in (_dependency(str(line), env_key) for line in d.get("requires_dist") or []) if r is not None]
        except (InvalidVersion, InvalidRequirement, UndefinedComparison, UndefinedEnvironmentName, ValueError) as exc:
            problems.append(f"Error parsing dependencies of {name}: {exc}")
            continue
        out[name] = Installed(name, version, tuple(reqs))
    return out, problems


def pip_check(dists: list[dict], environment: dict, modern: bool | None = None) -> tuple[list[Unmet], list[str]]:
    """`pip check`'s missing and conflicting requirements, in its order (all missing first, then all
    conflicts; per package sorted as pip sorts them), and the metadata problems."""
    pkgs, problems = package_set(dists, environment, modern)
    return _unmet(pkgs, environment), problems


def _unmet(pkgs: dict[str, Installed], environment: dict) -> list[Unmet]:
    """pip check's verdict over a package set made by package_set."""
    missing: list[Unmet] = []
    conflicting: list[Unmet] = []
    for name, det in pkgs.items():
        miss, conf = set(), set()
        for req in det.requires:
            dep = canonicalize_name(req.name)
            if dep not in pkgs:
                if req.marker is None or _evaluate(req.marker, environment, ""):
                    miss.add((dep, req))
                continue
            have = pkgs[dep].version
            if not req.specifier.contains(have, prereleases=True):
                conf.add((dep, have, req))
        for dep, req in sorted(miss, key=str):
            missing.append(Unmet(name, str(det.version), str(req), dep, None))
        for dep, have, req in sorted(conf, key=str):
            conflicting.append(Unmet(name, str(det.version), str(req), dep, str(have)))
    return missing + conflicting


def supported_tags(python_version: str, machine: str = "x86_64", glibc: str | None = None) -> list[Tag]:
    """The wheel tags a CPython `python_version` on Linux `machine` with `glibc` accepts, in preference
    order (what packaging.tags.sys_tags gives on that host; pip's get_supported)."""
    v = Version(python_version)
    pyv = (v.major, v.minor)
    platforms: list[str] = []
    if glibc:
        g = Version(glibc)
        legacy = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
        floor = 17 if machine not in ("x86_64", "i686") else 5
        for minor in range(g.minor, floor - 1, -1):
            platforms.append(f"manylinux_{g.major}_{minor}_{machine}")
            if (g.major, minor) in legacy and (machine in ("x86_64", "i686") or (g.major, minor) == (2, 17)):
                platforms.append(f"{legacy[(g.major, minor)]}_{machine}")
    platforms.append(f"linux_{machine}")
    interp = f"cp{pyv[0]}{pyv[1]}"
    return list(cpython_tags(pyv, abis=[interp], platforms=platforms)) + \
        list(compatible_tags(pyv, interpreter=interp, platforms=platforms))


def unsupported(dists: list[dict], tags: list[Tag], prefix: str | None = None) -> list[tuple[str, str]]:
    """pip check's "X is not supported on this platform": distributions (local to `prefix`, as pip takes
    them from a venv) whose WHEEL tags the interpreter accepts none of. No WHEEL file: not judged."""
    supported = frozenset(tags)
    out = []
    for d in dists:
        raw, ver = _pip_identity(d, True)
        if not raw or canonicalize_name(raw) in STDLIB_PKGS or not d.get("wheel_tags"):
            continue
        if prefix and not str(d.get("path") or "").startswith(prefix.rstrip("/") + "/"):
            continue
        wheel = frozenset(t for tag in d["wheel_tags"] for t in parse_tag(tag))
        if wheel.isdisjoint(supported):
            out.append((d.get("name") or raw, ver))
    return out


def pip_check_lines(dists: list[dict], environment: dict, tags: list[Tag] | None = None,
                    prefix: str | None = None, modern: bool | None = None) -> list[str]:
    """What the environment's `pip check` prints on stdout (its last line when all is well included).
    Unsupported wheels are judged when `tags` are given and the pip is >= 24.2 (older ones do not)."""
    modern = modern_pip(dists) if modern is None else modern
    unmet, problems = pip_check(dists, environment, modern)
    lines = [u.pip_line() for u in unmet]
    bad_tags = unsupported(dists, tags, prefix) if tags is not None and modern else []
    lines += [f"{n} {v} is not supported on this platform" for n, v in bad_tags]
    if not lines and not problems:
        lines.append("No broken requirements found.")
    return lines


# ---------------------------------------------------------------- verdicts

@dataclass(frozen=True)
class Verdict:
    """A yes/no with its reasons: `reasons` refuse, `warnings` are shown and do not refuse."""
    check: str
    ok: bool
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    details: dict = field(default_factory=dict, compare=False)

    def summary(self) -> str:
        if self.ok:
            return f"{self.check}: ok" + (f" ({len(self.warnings)} warning(s))" if self.warnings else "")
        return f"{self.check}: " + "; ".join(self.reasons)

    def as_dict(self) -> dict:
        return asdict(self)


def coherence_verdict(dists: list[dict], environment: dict, tags: list[Tag] | None = None,
                      prefix: str | None = None) -> Verdict:
    """Is the environment pip-check clean? Each reason is the line pip check would print."""
    modern = modern_pip(dists)
    unmet, problems = pip_check(dists, environment, modern)
    reasons = [u.pip_line() for u in unmet]
    if tags is not None and modern:
        reasons += [f"{n} {v} is not supported on this platform" for n, v in unsupported(dists, tags, prefix)]
    reasons += problems
    return Verdict("pip-check", not reasons, tuple(reasons),
                   details={"unmet": [asdict(u) for u in unmet], "distributions": len(dists)})


def load_capabilities(source: str | Path | None = None) -> dict:
    """The plugin's capabilities.json: from a file, a plugin source tree or an sglang-ddtree wheel
    (default: this repository's plugin)."""
    p = Path(source) if source else CAPABILITIES
    try:
        if p.suffix == ".whl":
            with zipfile.ZipFile(p) as z:
                return json.loads(z.read("sglang_ddtree/capabilities.json"))
        if p.is_dir():
            p = p / "src/sglang_ddtree/capabilities.json"
        return json.loads(p.read_text())
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as exc:
        raise CoherenceError(f"{p}: cannot read the plugin's capabilities.json: {exc}") from None


def supported_sglang_versions(caps: dict) -> tuple[str, ...]:
    """The SGLang versions a capabilities document declares. Accepts the list form
    ("sglang_versions": ["0.5.23"]) and per-version forms ({"0.5.17": {...}} or [{"version": ...}])."""
    v = caps.get("sglang_versions", caps.get("sglang"))
    if isinstance(v, dict):
        v = v.get("versions", v)
    if isinstance(v, dict):
        out = list(v)
    elif isinstance(v, list):
        out = [x if isinstance(x, str) else (x.get("version") or x.get("sglang")) for x in v]
    else:
        out = []
    if not out or not all(isinstance(x, str) and x for x in out):
        raise CoherenceError(f"capabilities.json declares no SGLang versions: {v!r}")
    return tuple(out)


def deploy_verdict(dists: list[dict], environment: dict, caps: dict) -> Verdict:
    """May the plugin be deployed onto this environment? Refused when SGLang is missing or a version the
    plugin does not support (the plugin compares the metadata version string, so this does), or when a
    pin among sglang / sglang-kernel / torch / flashinfer-python is unmet. Other unmet requirements are
    warnings."""
    supported = supported_sglang_versions(caps)
    pkgs, problems = package_set(dists, environment)
    reasons: list[str] = []
    meta_version = {canonicalize_name(d.get("name") or ""): d.get("version") for d in dists if d.get("name")}
    sglang = pkgs.get("sglang")
    if sglang is None:
        reasons.append("SGLang is not installed")
    else:
        have = meta_version.get("sglang") or str(sglang.version)
        if have not in supported:
            reasons.append(f"SGLang {have} is not supported by the plugin (supported: {', '.join(supported)})")
    unmet = _unmet(pkgs, environment)  # the package set made above, not a second one
    core = [u for u in unmet if u.package in CORE and u.dependency in CORE]
    for u in core:
        if u.missing:
            reasons.append(f"{u.package} {u.version} requires {u.requirement}, which is not installed")
        else:
            reasons.append(f"{u.package} {u.version} requires {u.requirement}, found {u.dependency} {u.installed}")
    others = [u for u in unmet if u not in core]
    warnings = [f"{len(others)} other unmet requirement(s), e.g. {others[0].pip_line()}"] if others else []
    warnings += problems
    return Verdict("deploy", not reasons, tuple(reasons), tuple(warnings),
                   details={"sglang": meta_version.get("sglang"), "supported": list(supported),
                            "core": {n: str(pkgs[n].version) if n in pkgs else None for n in CORE}})


def native_verdict(report: dict | list[dict]) -> Verdict:
    """From elfsyms.check_site's report (or the probe's list of them, one per GPU arch of the host): refused
    when an extension SGLang loads at startup has torch symbols that the host's torch does not export (or
    needs a torch library that is absent), or when sgl_kernel has no common_ops for the GPU arch. Other
    torch-linked extensions that do not resolve (loaded lazily, by some backends or models) are warnings."""
    reports = report if isinstance(report, list) else [report]
    reasons: list[str] = []
    warnings: list[str] = []
    checked: list[str] = []

    def add(out: list[str], line: str) -> None:
        if line not in out:  # the same lazy extension, seen from the report of each arch
            out.append(line)

    def describe(r: dict) -> str:
        what = r.get("role") or r["path"]
        if r.get("variant"):
            what += f" ({r['variant']})"
        bits = []
        if r.get("missing_libraries"):
            bits.append("needs " + ", ".join(r["missing_libraries"]) + ", absent from torch/lib")
        if r.get("unresolved"):
            names = [f"{u['symbol']} ({u['name']})" if u["name"] != u["symbol"] else u["symbol"]
                     for u in r["unresolved"]]
            bits.append(f"{len(names)} of its {r['torch_undefined']} torch symbols are not exported by the "
                        f"host's torch: " + ", ".join(names))
        return f"{what} ({r['path']}): " + "; ".join(bits)

    for rep in reports:
        if not rep.get("torch_lib"):
            add(warnings, "torch is not installed: no native extension to check")
            continue
        for r in rep.get("startup", []):
            checked.append(r["path"])
            if not r.get("ok"):
                add(reasons, describe(r))
            if rep.get("sm") is None:
                add(warnings, f"no GPU arch from nvidia-smi: checked the {r.get('role')} that loads without a "
                              f"GPU ({r.get('variant')})")
        for line in rep.get("errors", []):
            add(reasons, line)
        for r in rep.get("other", []):
            if not r.get("ok"):
                add(warnings, describe(r))
    sms = [rep.get("sm") for rep in reports]
    return Verdict("native", not reasons, tuple(reasons), tuple(warnings),
                   details={"sm": sms[0] if len(sms) == 1 else sms, "checked": checked})


def host_verdicts(collected: dict, native: dict | list | None, caps: dict,
                  tags: list[Tag] | None = None) -> list[Verdict]:
    """Every verdict for one host, from what its collectors printed: `collected` is
    dists.collect()'s document, `native` elfsyms.check_site()'s (or the probe's list of them; None: not
    gathered). Returns [pip-check, deploy, native]: `fab inventory` flags the first and the last; the
    deploy preflight refuses on the deploy and native verdicts and shows the pip-check one."""
    dists, env = collected["distributions"], collected["environment"]
    out = [coherence_verdict(dists, env, tags, _prefix(collected)), deploy_verdict(dists, env, caps)]
    if native is not None:
        out.append(native_verdict(native))
    return out


def _prefix(collected: dict) -> str | None:
    """The environment's prefix (pip check judges the platform tags of what is installed under it)."""
    return next((p.split("/lib/python", 1)[0] for p in collected.get("paths", []) if p.endswith("site-packages")),
                None)


# ---------------------------------------------------------------- facts and plans

def venv_environment(environment: dict, python: str | None) -> dict:
    """The marker environment of the venv's own interpreter: the collector ran under the host's python3
    (the agent's), the venv may run another Python; the rest (platform, machine, OS) is the host's."""
    if not python:
        return dict(environment)
    try:
        v = Version(python)
    except InvalidVersion:
        return dict(environment)
    full = ".".join(str(x) for x in (v.release + (0, 0))[:3])
    out = dict(environment, python_version=f"{v.major}.{v.minor}", python_full_version=full)
    if out.get("implementation_name") == "cpython":
        out["implementation_version"] = full
    return out


def facts_coherence(venv: dict | None, machine: str | None, glibc: str | None) -> dict | None:
    """What a host's facts carry about its coherence, from the probe's collected distributions and native
    reports (venv facts as deploy/facts.py builds them): {"ok", "pip_check", "native", "reasons"} with each
    verdict as a dict (native None when its check did not run), or None when the distributions were not read.
    `fab inventory` flags a host whose "ok" is False; provision blocks on an incoherent reference."""
    collected = (venv or {}).get("collected")
    if not collected:
        return None
    env = venv_environment(collected.get("environment") or {}, venv.get("python"))
    tags = None
    if venv.get("python") and machine:
        try:
            tags = supported_tags(venv["python"], machine, glibc)
        except InvalidVersion:
            tags = None
    pip = coherence_verdict(collected["distributions"], env, tags, _prefix(collected))
    native = native_verdict(venv["native"]) if venv.get("native") is not None else None
    reasons = [f"pip check: {r}" for r in pip.reasons] + [f"native: {r}" for r in (native.reasons if native else ())]
    return {"ok": pip.ok and (native is None or native.ok), "pip_check": pip.as_dict(),
            "native": native.as_dict() if native else None, "reasons": reasons}


def accepted_unmet(c: dict | None, patterns) -> tuple[list[str], list[str]]:
    """A host's coherence reasons split by the inventory's `accept_unmet` patterns (fnmatch, canonical names):
    (reasons that still stand, pip check lines the operator accepts). An unmet requirement is accepted when its
    dependency's name matches: a requirement of SGLang's closure whose feature the fleet does not use (a model
    family's extra, an attention backend it does not run) and that the reference therefore lacks on purpose."""
    if not c:
        return [], []
    pats = [re.sub(r"[-_.]+", "-", p).lower() for p in patterns or ()]
    ok_lines = set()
    for u in ((c.get("pip_check") or {}).get("details") or {}).get("unmet") or ():
        dep = canonicalize_name(u.get("dependency") or "")
        if any(fnmatch.fnmatchcase(dep, p) for p in pats):
            ok_lines.add("pip check: " + Unmet(**u).pip_line())
    reasons = list(c.get("reasons") or ())
    return [r for r in reasons if r not in ok_lines], [r for r in reasons if r in ok_lines]


def tree_graph_refusal(venv: dict | None, caps: dict, graph_services: list) -> list[str]:
    """Tree-verify services rendered with decode CUDA graphs need an SGLang whose plugin adapter captures the
    target's verify graph with the tree mask (``per_version[V].tree_verify_cuda_graphs`` in the plugin's
    capabilities.json); with another the server refuses to start, so the plan refuses the host first."""
    if not graph_services:
        return []
    dists = ((venv or {}).get("collected") or {}).get("distributions") or []
    have = next((d.get("version") for d in dists if canonicalize_name(d.get("name") or "") == "sglang"), None)
    per = (caps.get("per_version") or {}) if isinstance(caps, dict) else {}
    if have is None or not isinstance(per.get(have), dict) or per[have].get("tree_verify_cuda_graphs") is True:
        return []  # no SGLang / an unsupported one: deploy_refusals says so
    gpus = ", ".join(s.instance for s in graph_services)
    return [f"coherence: tree-verify under decode CUDA graphs ({gpus}) is not supported by the plugin with SGLang "
            f"{have} (capabilities.json: tree_verify_cuda_graphs is false); set cuda_graphs: false for these "
            "services, or run an SGLang whose adapter captures the tree mask "
            f"({', '.join(v for v, d in sorted(per.items()) if isinstance(d, dict) and d.get('tree_verify_cuda_graphs'))})"]


def deploy_refusals(venv: dict | None, caps: dict) -> tuple[list[str], list[str]]:
    """(refusals, warnings) of the deploy preflight for one host, from fresh venv facts (deploy/facts.py)
    and the capabilities of the plugin being deployed: the SGLang version the plugin must support, the pins
    among sglang / sglang-kernel / torch / flashinfer-python, and the native extensions SGLang loads at
    startup against the host's torch. Facts that could not be read refuse too (never assumed fine)."""
    collected = (venv or {}).get("collected")
    if not (venv or {}).get("exists"):
        return [f"coherence: the venv {(venv or {}).get('path') or '?'} does not exist"], []
    if not collected:
        return ["coherence: the venv's distributions were not read: " + ((venv or {}).get("error") or
                                                                         "no answer within the probe's deadline")], []
    try:
        supported_sglang_versions(caps)
    except CoherenceError as exc:
        return [f"coherence: {exc}"], []
    env = venv_environment(collected.get("environment") or {}, venv.get("python"))
    deploy = deploy_verdict(collected["distributions"], env, caps)
    refusals = [f"coherence: {r}" for r in deploy.reasons]
    warnings = [f"coherence: {w}" for w in deploy.warnings]
    if venv.get("native") is None:
        refusals.append("native: the native-extension check did not run (incomplete facts: see fab inventory)")
    else:
        native = native_verdict(venv["native"])
        refusals += [f"native: {r}" for r in native.reasons]
        warnings += [f"native: {w}" for w in native.warnings]
    return refusals, warnings
