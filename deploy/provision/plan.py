"""The provision plan: pure functions from facts (and the reference's wheel scan) to a printable plan.

Desired state is the reference host's installed distributions, restricted to the inventory's
`managed` patterns. Every managed distribution on a target is classified as

  sync                 same version, same local build tag
  missing              on the reference, not on the target              -> install
  other-version        another public version                          -> install
  local-tag-mismatch   same public version, other local tag (+cu128 vs
                       +cu130): a different build, an ABI mismatch     -> install
  extra                on the target only                              -> remove

Blockers refuse the whole host before anything changes; warnings are shown and do not refuse. An incoherent
reference (its facts' pip-check or native verdict fails) blocks every target: its wheels would carry the breakage.
The reference's smoke import of the modules to install (from its scan) is part of the plan: a module that fails
there is a warning, and the target is held to what imports there (`reference_smoke`, judged by the agent).
Every version and tag comparison goes through `packaging`.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import asdict, dataclass, field

from packaging.tags import compatible_tags, cpython_tags, parse_tag
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..remote.host.importsmoke import listed
from ..remote.host.wheels import SHA256, parse_wheel_filename
from . import drivers

STATUSES = ("sync", "missing", "other-version", "local-tag-mismatch", "extra")
ACTION = {"sync": None, "missing": "install", "other-version": "install", "local-tag-mismatch": "install",
          "extra": "remove"}
DISK_MARGIN = 1.10  # pip unpacks next to what it replaces; keep 10% slack


@dataclass
class Item:
    name: str
    status: str
    reference: str | None
    target: str | None
    detail: str = ""

    @property
    def action(self) -> str | None:
        return ACTION[self.status]


@dataclass
class Finding:
    code: str
    message: str


@dataclass
class Plan:
    host: str
    reference: str
    items: list[Item]
    blockers: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)
    sources: dict = field(default_factory=dict)   # name -> {kind, sha256, size, filename, staged, drift}
    disk: dict = field(default_factory=dict)
    staged_shas: list = field(default_factory=list)  # wheels (sha256) the target holds already
    stage: dict = field(default_factory=dict)        # the target's staging listing (staged, partial uploads)
    reference_smoke: dict = field(default_factory=dict)  # module -> None (imports on the reference) or its error

    @property
    def changes(self) -> list[Item]:
        return [i for i in self.items if i.action]

    @property
    def installs(self) -> list[Item]:
        return [i for i in self.items if i.action == "install"]

    @property
    def removals(self) -> list[Item]:
        return [i for i in self.items if i.action == "remove"]

    @property
    def empty(self) -> bool:
        return not self.changes

    @property
    def blocked(self) -> bool:
        return bool(self.blockers)

    def transfer_bytes(self) -> int:
        """Bytes still to send to the target (wheels not staged there yet)."""
        return sum(s.get("size") or 0 for n, s in self.sources.items()
                   if not s.get("staged") and n in {i.name for i in self.installs})

    def to_json(self) -> dict:
        return {"host": self.host, "reference": self.reference, "empty": self.empty, "blocked": self.blocked,
                "items": [dict(asdict(i), action=i.action) for i in self.items],
                "blockers": [asdict(b) for b in self.blockers], "warnings": [asdict(w) for w in self.warnings],
                "sources": self.sources, "disk": self.disk, "transfer_bytes": self.transfer_bytes(),
                "reference_smoke": self.reference_smoke}


# ---------------------------------------------------------------- classification

def managed(dists: dict[str, str], patterns: list[str]) -> dict[str, str]:
    """The distributions whose canonical name matches one of the (fnmatch) patterns."""
    pats = [re.sub(r"[-_.]+", "-", p).lower() for p in patterns]  # canonical form, wildcards kept
    return {canonicalize_name(n): v for n, v in dists.items()
            if any(fnmatch.fnmatchcase(canonicalize_name(n), p) for p in pats)}


def classify_one(ref: str | None, tgt: str | None) -> str:
    if ref is None:
        return "extra"
    if tgt is None:
        return "missing"
    try:
        r, t = Version(ref), Version(tgt)
    except InvalidVersion:
        return "sync" if ref == tgt else "other-version"
    if r == t:
        return "sync"
    if r.public == t.public and r.local != t.local:
        return "local-tag-mismatch"
    return "other-version"


def build_versions(facts: dict) -> dict[str, str]:
    """Versions with the build tag that the metadata may lack: PyPI's default torch wheel says plain
    `2.11.0` in its METADATA while torch/version.py says `2.11.0+cu130` (seen on the real H200)."""
    meta = (facts.get("venv") or {}).get("distributions") or {}
    full = (facts.get("torch") or {}).get("version")
    out = {}
    if full and meta.get("torch"):
        try:
            if Version(full).public == Version(meta["torch"]).public and Version(meta["torch"]).local is None:
                out["torch"] = full
        except InvalidVersion:
            pass
    return out


def classify(ref_dists: dict[str, str], tgt_dists: dict[str, str], patterns: list[str],
             ref_builds: dict[str, str] | None = None, tgt_builds: dict[str, str] | None = None) -> list[Item]:
    """Classify each managed distribution. `*_builds` give build-tagged versions (build_versions) used to
    compare builds; the items keep the metadata versions, which are what pip installs and reports."""
    ref, tgt = managed(ref_dists, patterns), managed(tgt_dists, patterns)
    ref_builds, tgt_builds = ref_builds or {}, tgt_builds or {}
    items = []
    for name in sorted(set(ref) | set(tgt)):
        rv = ref_builds.get(name, ref.get(name)) if name in ref else None
        tv = tgt_builds.get(name, tgt.get(name)) if name in tgt else None
        status = classify_one(rv, tv)
        detail = ""
        if status == "local-tag-mismatch":
            rl, tl = Version(rv).local, Version(tv).local
            detail = f"ABI mismatch: build +{tl or '(none)'} where the reference runs +{rl or '(none)'}"
        elif status == "other-version":
            detail = "older" if _lt(tgt[name], ref[name]) else "newer than the reference"
        items.append(Item(name, status, ref.get(name), tgt.get(name), detail))
    return items


def _lt(a: str, b: str) -> bool:
    try:
        return Version(a) < Version(b)
    except InvalidVersion:
        return False


# ---------------------------------------------------------------- blockers

def _abi_ok(tags: list[str], py_version: str, abi: str) -> bool:
    v = Version(py_version)
    pyv = (v.major, v.minor)
    supported = {(t.interpreter, t.abi) for t in cpython_tags(pyv, abis=[abi], platforms=["any"])}
    supported |= {(t.interpreter, t.abi) for t in compatible_tags(pyv, interpreter=abi.split("-")[0],
                                                                  platforms=["any"])}
    return any((t.interpreter, t.abi) in supported for tag in tags for t in parse_tag(tag))


LEGACY_MANYLINUX = {"manylinux1": "2.5", "manylinux2010": "2.12", "manylinux2014": "2.17"}


def required_glibc(tags: list[str]) -> str | None:
    """The lowest glibc any of the wheel's platform tags accepts; None when a tag needs no glibc."""
    best: Version | None = None
    for tag in tags:
        for t in parse_tag(tag):
            m = re.match(r"manylinux_(\d+)_(\d+)_", t.platform)
            need = f"{m.group(1)}.{m.group(2)}" if m else LEGACY_MANYLINUX.get(t.platform.split("_")[0])
            if need is None:
                return None  # 'any', 'linux_x86_64' (no declared floor), ...
            if best is None or Version(need) < best:
                best = Version(need)
    return str(best) if best else None


def _platform_arch(tags: list[str]) -> set[str]:
    archs = set()
    for tag in tags:
        for t in parse_tag(tag):
            if t.platform == "any":
                return set()
            m = re.match(r"(?:manylinux\w*?|musllinux_\d+_\d+|linux)_(x86_64|aarch64|i686|ppc64le|s390x|armv7l)$",
                         t.platform)
            if m:
                archs.add(m.group(1))
    return archs


def find_blockers(ref_facts: dict, tgt_facts: dict, items: list[Item], scan: dict | None = None,
                  stage: dict | None = None) -> tuple[list[Finding], list[Finding], dict]:
    """(blockers, warnings, disk) for installing `items` from the reference onto the target."""
    blockers: list[Finding] = []
    warnings: list[Finding] = []
    installs = [i for i in items if i.action == "install"]
    if not installs and not any(i.action for i in items):
        return blockers, warnings, {}
    rv, tv = ref_facts.get("venv") or {}, tgt_facts.get("venv") or {}
    if not tv.get("exists") or not tv.get("python"):
        blockers.append(Finding("venv", f"the target venv {tv.get('path') or '?'} does not exist or has no "
                                        f"working python ({tv.get('error') or 'no details'})"))
        return blockers, warnings, {}
    if tv.get("trust") not in (None, "ok"):
        blockers.append(Finding("venv-trust", f"root will not run {tv.get('path')}/bin/python: {tv['trust']}"))
    # Python ABI
    tabi, tpy = tv.get("abi"), tv.get("python")
    if rv.get("abi") and tabi and rv["abi"] != tabi:
        bad = [i.name for i in installs if (rv.get("wheel_tags") or {}).get(i.name)
               and not _abi_ok(rv["wheel_tags"][i.name], tpy, tabi)]
        if bad:
            blockers.append(Finding("python-abi", f"the reference venv is {rv['abi']} (Python {rv.get('python')}), "
                                                  f"the target {tabi} (Python {tpy}): {', '.join(bad)} "
                                                  f"cannot install there"))
    # glibc and machine
    tglibc = (tgt_facts.get("os") or {}).get("glibc")
    tmachine = (tgt_facts.get("os") or {}).get("machine")
    for i in installs:
        tags = (rv.get("wheel_tags") or {}).get(i.name) or []
        if not tags:
            continue
        need = required_glibc(tags)
        if need and tglibc:
            try:
                if Version(tglibc) < Version(need):
                    blockers.append(Finding("glibc", f"{i.name} {i.reference} needs glibc >= {need} "
                                                     f"(manylinux tag), the target has {tglibc}"))
            except InvalidVersion:
                pass
        elif need and not tglibc:
            warnings.append(Finding("glibc", f"target glibc unknown; {i.name} needs >= {need}"))
        archs = _platform_arch(tags)
        if archs and tmachine and tmachine not in archs:
            blockers.append(Finding("machine", f"{i.name} is built for {', '.join(sorted(archs))}, "
                                               f"the target is {tmachine}"))
    # NVIDIA driver and GPU archs: only when torch changes
    torch_changes = any(i.name == "torch" for i in installs)
    rt = ref_facts.get("torch") or {}
    if torch_changes and rt:
        cuda = rt.get("cuda") or drivers.cuda_from_local(rt.get("local"))
        nv = tgt_facts.get("nvidia") or {}
        if cuda:
            if not nv.get("driver"):
                blockers.append(Finding("driver", f"the reference torch is built for CUDA {cuda} but the target "
                                                  f"shows no NVIDIA driver ({nv.get('error') or 'no nvidia-smi'})"))
            else:
                res = drivers.driver_check(cuda, nv["driver"])
                if res:
                    (blockers if res[0] == "blocker" else warnings).append(Finding("driver", res[1]))
            archs = rt.get("arch_list")
            gpu_sms = sorted({g["sm"] for g in nv.get("gpus") or [] if g.get("sm")})
            if archs is None and gpu_sms:
                warnings.append(Finding("gpu-arch", "the reference torch's CUDA arch list is unknown "
                                                    "(torch could not be imported there); GPU archs not checked"))
            elif archs:
                missing = [sm for sm in gpu_sms if not drivers.arch_supported(sm, archs)]
                if missing:
                    blockers.append(Finding("gpu-arch", f"target GPUs {', '.join(missing)} are not in the reference "
                                                        f"torch's arch list ({' '.join(archs)})"))
    # disk
    disk = {}
    if scan is not None:
        staged = (stage or {}).get("staged") or {}
        inst = sum((scan.get(i.name) or {}).get("installed_bytes") or 0 for i in installs)
        backup = sum((scan.get(i.name) or {}).get("installed_bytes") or 0 for i in installs if i.target)
        wheels = sum(((scan.get(i.name) or {}).get("source") or {}).get("size") or
                     (scan.get(i.name) or {}).get("installed_bytes") or 0
                     for i in installs
                     if (((scan.get(i.name) or {}).get("source") or {}).get("sha256") not in staged))
        need = int((inst + backup + wheels) * DISK_MARGIN)
        free = ((tgt_facts.get("disk") or {}).get("venv") or {}).get("free")
        disk = {"install_bytes": inst, "backup_bytes_est": backup, "stage_bytes": wheels, "need": need,
                "free": free}
        if free is not None and need > free:
            blockers.append(Finding("disk", f"needs about {human(need)} (install {human(inst)}, backup "
                                            f"{human(backup)}, staged wheels {human(wheels)}), "
                                            f"{human(free)} free at the venv"))
        for i in installs:
            s = scan.get(i.name) or {}
            if s.get("error"):
                blockers.append(Finding("reference", f"{i.name} on the reference: {s['error']}"))
    return blockers, warnings, disk


def reference_findings(ref_facts: dict, accept_unmet=()) -> tuple[list[Finding], list[Finding]]:
    """(blockers, warnings) about the reference itself: provision copies its exact wheels, so an incoherent
    reference (installed pins unmet as `pip check` says, or native extensions that do not resolve against its
    torch: its facts' coherence verdicts) would copy its breakage; one blocker per reason, but for the unmet
    requirements the inventory accepts (`accept_unmet`: each is a warning that names it). Unknown (its
    distributions were not read): a warning."""
    c = ref_facts.get("coherence")
    name = ref_facts.get("host", "?")
    if c is None:
        return [], [Finding("reference-coherence", f"the reference {name}'s coherence is unknown (its venv's "
                                                   f"distributions were not read): not checked")]
    if c.get("ok") is False:
        from ..coherence import accepted_unmet
        standing, accepted = accepted_unmet(c, accept_unmet)
        return ([Finding("incoherent-reference", f"{name}: {r}") for r in standing],
                [Finding("accepted-unmet", f"{name}: {r} (accept_unmet)") for r in accepted])
    return [], []


def drift_findings(scan: dict, names: list[str]) -> list[Finding]:
    out = []
    for n in names:
        d = (scan.get(n) or {}).get("drift") or []
        if d:
            shown = ", ".join(f"{x['path']} ({x['problem']})" for x in d[:3]) + (f", +{len(d) - 3} more" if len(d) > 3 else "")
            out.append(Finding("drift", f"reference {n}: {len(d)} installed file(s) differ from RECORD: {shown}; "
                                        f"the wheel is rebuilt from the files as they are"))
    return out


def make_plan(ref_facts: dict, tgt_facts: dict, patterns: list[str], scan: dict | None = None,
              stage: dict | None = None, accept_unmet=()) -> Plan:
    ref_d = (ref_facts.get("venv") or {}).get("distributions") or {}
    tgt_d = (tgt_facts.get("venv") or {}).get("distributions") or {}
    items = classify(ref_d, tgt_d, patterns, build_versions(ref_facts), build_versions(tgt_facts))
    plan = Plan(tgt_facts.get("host", "?"), ref_facts.get("host", "?"), items)
    plan.blockers, plan.warnings, plan.disk = find_blockers(ref_facts, tgt_facts, items, scan, stage)
    ref_blockers, ref_warnings = reference_findings(ref_facts, accept_unmet)
    plan.blockers[:0], plan.warnings[:0] = ref_blockers, ref_warnings
    plan.stage = dict(stage or {})
    if scan:
        staged = (stage or {}).get("staged") or {}
        plan.staged_shas = sorted(staged)
        plan.warnings += drift_findings(scan, [i.name for i in plan.installs])
        for i in plan.installs:
            s = scan.get(i.name) or {}
            src = dict(s.get("source") or {"kind": "rebuild"})
            src.pop("path", None)
            if src.get("filename") is not None and (parse_wheel_filename(src["filename"]) is None
                                                    or not SHA256.fullmatch(str(src.get("sha256")))):
                plan.blockers.append(Finding("wheel-name", f"the reference offered {i.name} as "
                                                           f"{src['filename']!r} (sha256 {src.get('sha256')!r}), "
                                                           f"which is not a wheel file name and sha256: refused"))
                src = {"kind": "refused"}
            src["pth"] = list(s.get("pth") or [])
            src["staged"] = bool(src.get("sha256") and src["sha256"] in staged)
            src["drift"] = len(s.get("drift") or [])
            src.setdefault("size", None)
            src["installed_bytes"] = s.get("installed_bytes")
            plan.sources[i.name] = src
        plan.reference_smoke, smoke_warnings = reference_smoke(scan, [i.name for i in plan.installs],
                                                               plan.reference)
        plan.warnings += smoke_warnings
    return plan


def reference_smoke(scan: dict, names: list[str], reference: str = "the reference") -> tuple[dict, list[Finding]]:
    """The reference's smoke import of the modules of `names` ({module: None or its error there}), and a warning
    per module that fails there (the target is held to the same) or per distribution whose smoke did not run
    (its modules must then all import on the target)."""
    modules: dict = {}
    warnings: list[Finding] = []
    for n in names:
        sm = (scan.get(n) or {}).get("smoke")
        if not sm:
            continue
        if sm.get("error"):
            warnings.append(Finding("reference-smoke", f"{n}: the smoke import did not run on {reference} "
                                                       f"({sm['error']}): each of its modules must import on "
                                                       f"the target"))
            continue
        for m, err in sorted((sm.get("modules") or {}).items()):
            modules[m] = err
    for m, err in sorted(modules.items()):
        if err is not None:
            warnings.append(Finding("reference-smoke", f"fails on the reference too: {listed({m: err})}"))
    return modules, warnings


def human(n: int | float | None) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------- rendering

STYLE = {"sync": "green", "missing": "yellow", "other-version": "yellow", "local-tag-mismatch": "bold red",
         "extra": "magenta"}


def render(plan: Plan, console, show_sync: bool = False) -> None:
    """The plan as a table. Names, versions, details and messages come from hosts and wheels: they are rich
    Text (plain), never markup, so `[...]` in them is shown as is and cannot restyle or crash the output."""
    from rich.table import Table
    from rich.text import Text
    title = Text(f"provision {plan.host} from {plan.reference}")
    if plan.blocked:
        title.append("  BLOCKED", style="bold red")
    elif plan.empty:
        title.append("  in sync, nothing to do", style="green")
    t = Table(title=title, title_justify="left")
    for col in ("distribution", f"{plan.reference} (reference)", plan.host, "status", "action", "wheel source"):
        t.add_column(Text(col))
    shown = 0
    for i in plan.items:
        if i.status == "sync" and not show_sync:
            continue
        shown += 1
        s = plan.sources.get(i.name) or {}
        src = Text()
        if i.action == "install" and s:
            kind = str(s.get("kind", ""))
            if kind == "rebuild":
                src.append(f"rebuild from RECORD ({human(s.get('installed_bytes'))} installed)")
            else:
                src.append(kind + (f" {human(s['size'])}" if s.get("size") else ""))
            if s.get("staged"):
                src.append(" (on target)")
            if s.get("drift"):
                src.append(f" DRIFT {s['drift']} file(s)", style="red")
        status = Text(str(i.status), style=STYLE.get(i.status, ""))
        if i.detail:
            status.append(f"\n{i.detail}")
        t.add_row(Text(str(i.name)), Text(str(i.reference or "-")), Text(str(i.target or "-")), status,
                  Text(str(i.action or "")), src)
    nsync = sum(1 for i in plan.items if i.status == "sync")
    if shown:
        console.print(t)
    else:
        console.print(Text(title.plain, style="bold"))
    unsized = [i.name for i in plan.installs if not (plan.sources.get(i.name) or {}).get("size")
               and not (plan.sources.get(i.name) or {}).get("staged")]
    xfer = human(plan.transfer_bytes()) + (f" + {len(unsized)} wheel(s) rebuilt first" if unsized else "")
    xfer = "nothing scanned or sent (blocked)" if plan.blocked and not plan.sources else f"{xfer} to transfer"
    console.print(Text(f"  {nsync} managed distribution(s) in sync, {len(plan.installs)} to install, "
                       f"{len(plan.removals)} to remove; {xfer}"))
    for b in plan.blockers:
        console.print(Text.assemble("  ", ("BLOCKER", "bold red"), f" {b.code}: {b.message}"))
    for w in plan.warnings:
        console.print(Text.assemble("  ", ("warning", "yellow"), f" {w.code}: {w.message}"))