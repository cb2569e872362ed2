"""Host facts: pure parsers of probe output, and the one-round-trip remote gather.

Every parser takes the text a standard tool printed and returns plain values; they are tested
against real captures (lab/personas/h200-1gpu, copied from shared/fixtures/gpu-hosts). The probe itself is
the agent's `facts.probe` op (deploy/remote/host/probe.py): every command under one deadline (PROBE_BUDGET),
what did not finish in time listed in the facts' `incomplete`.
"""
from __future__ import annotations

import ast
import csv
import io
import json
import os
import re
import shlex
import time
from datetime import datetime, timezone
from pathlib import Path

from packaging.tags import parse_tag
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from .remote.host.dists import parse_wheel_tags

# One deadline for every probe command together: a hung nvidia-smi costs this, once, not once per command.
PROBE_BUDGET = float(os.environ.get("DDTREE_PROBE_BUDGET") or 10.0)
CALL_MARGIN = 6.0  # the agent's start and reply around the budget; past it the host itself is hung
TRACKED = ("torch", "triton", "sglang", "sglang-kernel", "flashinfer-python", "sglang-ddtree")
# What a facts document holds: cached facts of another version are gathered again (3: coherence, requirements).
FACTS_VERSION = 3


# ---------------------------------------------------------------- nvidia-smi and driver

def _strip_unit(value: str) -> str:
    return re.sub(r"\s*(MiB|W|%|MHz|C)$", "", value.strip())


def parse_query_gpu_csv(text: str) -> list[dict]:
    """`nvidia-smi --query-gpu=... --format=csv` (with header and units) -> one dict per GPU."""
    rows = list(csv.reader(io.StringIO(text.strip()), skipinitialspace=True))
    if not rows:
        return []
    header = [re.sub(r"\s*\[.*\]$", "", h.strip()) for h in rows[0]]
    gpus = []
    for row in rows[1:]:
        if not row or len(row) != len(header):
            continue
        r = dict(zip(header, (c.strip() for c in row)))
        cap = r.get("compute_cap", "")
        gpu = {"index": int(r["index"]) if r.get("index", "").isdigit() else None,
               "uuid": r.get("uuid"), "name": r.get("name"),
               "driver": r.get("driver_version"),
               "compute_cap": cap or None,
               "sm": "sm_" + cap.replace(".", "") if re.match(r"^\d+\.\d+$", cap) else None,
               "memory_mib": int(_strip_unit(r["memory.total"])) if _strip_unit(r.get("memory.total", "")).isdigit() else None,
               "pci_bus_id": r.get("pci.bus_id")}
        gpus.append(gpu)
    return gpus


def parse_nvidia_smi_header(text: str) -> dict:
    """Plain `nvidia-smi`: the banner names the driver and the highest CUDA version it supports."""
    m = re.search(r"Driver Version:\s*([\d.]+)\s+CUDA Version:\s*([\d.]+)", text or "")
    return {"driver": m.group(1), "cuda": m.group(2)} if m else {}


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_topo_matrix(text: str | None) -> dict:
    """`nvidia-smi topo -m` -> {"links": {"GPU0": {"GPU1": "NV18", ...}, ...}, "cpu_affinity": {"GPU0": "0-47"},
    "numa": {"GPU0": "0"}}: the GPU-to-GPU cells of the matrix (NIC rows and columns left out). The header is
    tab-separated and, from driver 5xx, underlined with ANSI escapes even when piped (the real h200-1gpu
    capture); the matrix ends at the first blank line (the legend follows)."""
    lines = [_ANSI.sub("", ln) for ln in (text or "").splitlines()]
    start = next((i for i, ln in enumerate(lines) if re.search(r"(?:^|\t)GPU0(?:\t|$)", ln)
                  and not ln.startswith("GPU")), None)
    if start is None:
        return {"links": {}, "cpu_affinity": {}, "numa": {}}
    cols = [c.strip() for c in lines[start].split("\t")[1:]]
    links: dict = {}
    aff: dict = {}
    numa: dict = {}
    for ln in lines[start + 1:]:
        if not ln.strip():
            break
        cells = ln.split("\t")
        name = cells[0].strip()
        if not re.fullmatch(r"GPU\d+", name):
            continue
        row = dict(zip(cols, (c.strip() for c in cells[1:])))
        links[name] = {c: v for c, v in row.items() if re.fullmatch(r"GPU\d+", c) and c != name}
        if row.get("CPU Affinity"):
            aff[name] = row["CPU Affinity"]
        if row.get("NUMA Affinity"):
            numa[name] = row["NUMA Affinity"]
    return {"links": links, "cpu_affinity": aff, "numa": numa}


def parse_proc_driver_version(text: str | None) -> str | None:
    """/proc/driver/nvidia/version -> '580.159.04'."""
    m = re.search(r"NVRM version:.*?\s(\d+\.\d+(?:\.\d+)?)\s", text or "")
    return m.group(1) if m else None


def parse_nvcc_version(text: str | None) -> str | None:
    """`nvcc --version` -> '13.0' (the toolkit release)."""
    m = re.search(r"release\s+(\d+\.\d+)", text or "")
    return m.group(1) if m else None


# ---------------------------------------------------------------- OS and Python

def parse_os_release(text: str | None) -> dict:
    out = {}
    for line in (text or "").splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            try:
                out[k.strip()] = shlex.split(v)[0] if v.strip() else ""
            except ValueError:
                out[k.strip()] = v.strip().strip('"')
    return out


def parse_glibc(text: str | None) -> str | None:
    """`ldd --version` first line or platform.libc_ver() ('glibc 2.36') -> '2.36'."""
    m = re.search(r"(?:GLIBC|glibc|GNU libc)[^\d]*?(\d+\.\d+)", text or "") or re.search(r"\)\s+(\d+\.\d+)\s*$", text or "")
    return m.group(1) if m else None


def parse_pyvenv_cfg(text: str | None, lib_dir: str | None = None) -> dict:
    """pyvenv.cfg (`version = 3.11.2`, or virtualenv's `version_info = 3.12.3.final.0`) and the venv's
    lib/pythonX.Y[t] directory name -> {version, abiflags}."""
    cfg = {}
    for line in (text or "").splitlines():
        k, sep, v = line.partition("=")
        if sep:
            cfg[k.strip().lower()] = v.strip()
    version = None
    for key in ("version", "version_info"):
        m = re.match(r"(\d+\.\d+(?:\.\d+)?)", cfg.get(key, ""))
        if m:
            version = m.group(1)
            break
    m = re.fullmatch(r"python(\d+\.\d+)([a-z]*)", lib_dir or "")
    if version is None and m:
        version = m.group(1)
    return {"version": version, "abiflags": m.group(2) if m else ""}


def python_abi_tag(version: str, abiflags: str = "") -> str:
    """'3.12.3' -> 'cp312' (plus ABI flags such as 't' for free-threaded builds)."""
    v = Version(version)
    return f"cp{v.major}{v.minor}{abiflags or ''}"


# ---------------------------------------------------------------- torch and distributions

def split_local(version: str) -> tuple[str, str | None]:
    """'2.11.0+cu130' -> ('2.11.0', 'cu130'): public version and local build tag (packaging)."""
    try:
        v = Version(version)
    except InvalidVersion:
        return version, None
    return v.public, v.local


def parse_torch_version_py(text: str | None) -> dict:
    """torch/version.py (read, never imported) -> version, cuda, git_version and any lab extras."""
    out: dict = {}
    if not text:
        return out
    for node in ast.parse(text).body:
        targets = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            if isinstance(t, ast.Name):
                try:
                    out[t.id] = ast.literal_eval(value)
                except ValueError:
                    pass
    return out


parse_wheel_file = parse_wheel_tags  # a dist-info WHEEL file -> its tags (the host library's one copy)


def cxx11_abi_from_tags(tags: list[str]) -> bool | None:
    """PyTorch's Linux wheels since 2.7 are manylinux_2_28 and built with the C++11 ABI; older
    manylinux2014/_2_17 wheels used the pre-C++11 ABI. None when the tags do not tell."""
    for tag in tags:
        for t in parse_tag(tag):
            m = re.match(r"manylinux_(\d+)_(\d+)_", t.platform)
            if m:
                return (int(m.group(1)), int(m.group(2))) >= (2, 28)
            if t.platform.startswith(("manylinux2014", "manylinux2010", "manylinux1")):
                return False
    return None


def parse_arch_flags(flags: str | None) -> list[str]:
    """torch._C._cuda_getArchFlags() ('sm_75 sm_80 ... compute_120') -> sorted sm_XY list."""
    archs = set(re.findall(r"sm_(\d+)[a-z]?", flags or ""))
    return [f"sm_{a}" for a in sorted(archs, key=int)]


def parse_pip_list_json(text: str) -> dict[str, str]:
    """`pip list --format=json` -> {canonical name: version}."""
    return {canonicalize_name(d["name"]): d["version"] for d in json.loads(text)}


def raw_distributions(venv: dict) -> list[dict]:
    """The probe's distributions of a venv as [{name, version, wheel_tags}]: from its collected metadata
    (dists.collect: the METADATA name and version, the directory's when METADATA lacks them), or from the
    list older probes sent (tests/captures/h200-probe-raw.json: WHEEL text)."""
    collected = venv.get("collected")
    if collected is None:
        return [{"name": d["name"], "version": d["version"], "wheel_tags": parse_wheel_file(d.get("wheel"))}
                for d in venv.get("distributions") or []]
    return [{"name": d.get("name") or d.get("dir_name"), "version": d.get("version") or d.get("dir_version"),
             "wheel_tags": list(d.get("wheel_tags") or [])} for d in collected.get("distributions") or []]


def torch_facts(venv: dict) -> dict | None:
    dists = {canonicalize_name(d["name"]): d for d in raw_distributions(venv)}
    if "torch" not in dists:
        return None
    t = venv.get("torch") or {}
    vp = parse_torch_version_py(t.get("version_py"))
    version = vp.get("__version__") or dists["torch"]["version"]
    public, local = split_local(version)
    imported = t.get("imported") or {}
    abi = imported.get("cxx11_abi")
    abi_source = "import" if abi is not None else None
    if abi is None:
        abi = cxx11_abi_from_tags(dists["torch"]["wheel_tags"])
        abi_source = "wheel-tag" if abi is not None else None
    return {"version": version, "public": public, "local": local, "cuda": vp.get("cuda"),
            "git": vp.get("git_version"), "cxx11_abi": abi, "cxx11_abi_source": abi_source,
            "arch_list": parse_arch_flags(imported.get("arch_flags")) if imported else None,
            "import_error": t.get("import_error"), "from_cache": t.get("imported_from_cache")}


# ---------------------------------------------------------------- raw probe output -> facts

def coherence_of(venv: dict | None, machine: str | None, glibc: str | None, previous: dict | None) -> dict | None:
    """coherence.facts_coherence of the venv, or `previous` facts' verdicts when they were made from the same
    inputs: the probe's key of the distributions' metadata, the venv's Python, the machine, glibc and the same
    native reports (a pip check of a few hundred distributions costs tens of ms; a fleet rarely changes)."""
    collected = (venv or {}).get("collected") or {}
    key = [collected["key"], venv.get("python"), machine, glibc] if collected.get("key") else None
    prev = previous or {}
    if key and prev.get("facts_version") == FACTS_VERSION and (prev.get("coherence") or {}).get("key") == key \
            and (prev.get("venv") or {}).get("native") == venv.get("native"):
        return prev["coherence"]
    from . import coherence  # packaging's markers and requirements: imported only when a verdict is made
    c = coherence.facts_coherence(venv, machine, glibc)
    return dict(c, key=key) if c is not None else None


def build_facts(host: str, raw: dict, gathered_at: float | None = None, previous: dict | None = None) -> dict:
    """Turn the probe's raw JSON into the facts document cached in inventory/facts/HOST.json. `previous`: the
    host's last facts, whose coherence verdicts are reused when nothing they were made from changed."""
    smi_q = raw.get("nvidia_smi_query") or {}
    smi = raw.get("nvidia_smi") or {}
    gpus = parse_query_gpu_csv(smi_q.get("out", "")) if smi_q.get("rc") == 0 else []
    header = parse_nvidia_smi_header(smi.get("out", "")) if smi.get("rc") == 0 else {}
    driver = parse_proc_driver_version(raw.get("proc_driver")) or header.get("driver") or (gpus[0]["driver"] if gpus else None)
    topo_raw = raw.get("nvidia_smi_topo") or {}
    nvidia = None
    if raw.get("nvidia_smi_query") is not None or raw.get("proc_driver"):
        nvidia = {"driver": driver, "cuda": header.get("cuda"), "gpus": gpus,
                  # the GPUs' interconnect (None: the probe did not read it)
                  "topology": parse_topo_matrix(topo_raw.get("out")) if topo_raw.get("rc") == 0 else None,
                  "error": None if smi_q.get("rc") == 0 else (smi_q.get("err") or "nvidia-smi failed").strip()}
    osr = parse_os_release(raw.get("os_release"))
    ldd = raw.get("ldd") or []
    venv_raw = dict(raw.get("venv") or {})
    incomplete = list(raw.get("incomplete") or [])
    got = venv_raw.get("collected") or {}
    if got.get("unchanged"):  # the probe left out the distribution list the previous facts hold (same key)
        held = ((previous or {}).get("venv") or {}).get("collected") or {}
        if held.get("key") == got.get("key") and "distributions" in held:
            venv_raw["collected"] = dict(held, **{k: v for k, v in got.items() if k != "unchanged"})
        else:
            venv_raw["collected"] = None
            incomplete.append({"what": "venv", "error": "the probe left out a distribution list these facts lack"})
    if venv_raw and not venv_raw.get("version") and (venv_raw.get("pyvenv_cfg") or venv_raw.get("lib_dir")):
        venv_raw.update(parse_pyvenv_cfg(venv_raw.get("pyvenv_cfg"), venv_raw.get("lib_dir")))
    venv = None
    rows = raw_distributions(venv_raw) if venv_raw else []
    if venv_raw:
        dists = {canonicalize_name(d["name"]): d["version"] for d in rows if d["name"]}
        venv = {"path": venv_raw.get("path"), "exists": venv_raw.get("exists", False),
                "error": venv_raw.get("error"), "trust": venv_raw.get("trust"),
                "python": venv_raw.get("version"),
                "abi": python_abi_tag(venv_raw["version"], venv_raw.get("abiflags", "")) if venv_raw.get("version") else None,
                "purelib": venv_raw.get("purelib"),
                "distributions": dict(sorted(dists.items())),
                "wheel_tags": {canonicalize_name(d["name"]): d["wheel_tags"] for d in rows if d["name"] and d["wheel_tags"]},
                # what pip check reads (each distribution's requirements) and the native-extension reports
                "collected": venv_raw.get("collected"), "native": venv_raw.get("native")}
    packages = {name: (venv or {}).get("distributions", {}).get(name) for name in TRACKED}
    machine = raw.get("machine")
    glibc = parse_glibc(ldd[0] if ldd else None) or parse_glibc(raw.get("glibc"))
    return {
        "facts_version": FACTS_VERSION,
        "host": host,
        "gathered_at": datetime.fromtimestamp(gathered_at or time.time(), timezone.utc).isoformat(timespec="seconds"),
        "probe_seconds": raw.get("probe_seconds"),
        "hostname": raw.get("hostname"),
        "nvidia": nvidia,
        "nvcc": parse_nvcc_version((raw.get("nvcc") or {}).get("out")),
        "os": {"id": osr.get("ID"), "version_id": osr.get("VERSION_ID"), "pretty_name": osr.get("PRETTY_NAME"),
               "kernel": raw.get("kernel"), "machine": machine, "glibc": glibc},
        "system_python": raw.get("system_python"),
        "venv": venv,
        "torch": torch_facts(venv_raw) if rows else None,
        "packages": packages,
        "coherence": coherence_of(venv, machine, glibc, previous),
        "disk": raw.get("disk", {}),
        "incomplete": incomplete,
    }


def gather(conn, host, *, root: bool = False, staged: bool = False, state_dir: str | None = None,
           previous: dict | None = None) -> dict:
    """One agent call: run the facts probe on `conn` and build the facts of `host`. Without `root` it runs as
    the SSH user (no sudo). With `staged` (a provision target, as root) the facts carry the private staging
    listing under "stage" and whether root may run the venv under venv.trust. `previous`: see build_facts."""
    from .remote.client import Remote
    t0 = time.time()
    known = (((previous or {}).get("venv") or {}).get("collected") or {}).get("key")
    raw = Remote(conn, host.name, state_dir).call(
        "facts.probe", {"venv": host.venv, "budget": PROBE_BUDGET, "staged": staged, "trust": staged,
                        "known_dists": known}, deadline=PROBE_BUDGET + CALL_MARGIN, root=root)
    facts = build_facts(host.name, raw, t0, previous)
    facts["address"] = host.address
    facts["gather_seconds"] = round(time.time() - t0, 3)
    if staged:
        facts["stage"] = raw.get("stage")
    return facts


def incoherent(facts_by_host: dict[str, dict]) -> dict[str, list[str]]:
    """{host: its coherence reasons} for every host whose installed pins are unmet (pip check) or whose native
    extensions do not resolve against its torch."""
    return {h: list(f["coherence"]["reasons"]) for h, f in facts_by_host.items()
            if f.get("coherence") and f["coherence"]["ok"] is False}


def incomplete_summary(facts: dict) -> str | None:
    """'nvidia_smi_query: timed out after 10s; ...' when some facts did not come back, else None."""
    inc = facts.get("incomplete") or []
    return "; ".join(f"{i.get('what')}: {i.get('error')}" for i in inc) or None


# ---------------------------------------------------------------- cache

def facts_dir(inventory_path: str) -> Path:
    return Path(inventory_path).parent / "facts"


def save_facts(inventory_path: str, facts: dict) -> Path:
    """Cache a host's facts. One line (json's C encoder: the venv's metadata makes the file a few hundred KB,
    and an indented dump of it costs more than the probe); `fab inventory --json` is the readable form."""
    from .remote.host.fsutil import atomic_write
    d = facts_dir(inventory_path)
    d.mkdir(parents=True, exist_ok=True)
    p = d / f"{facts['host']}.json"
    atomic_write(str(p), json.dumps({k: v for k, v in facts.items() if k != "stage"}, sort_keys=True).encode(),
                 0o644)
    return p


def load_cached_facts(inventory_path: str, host: str, max_age: float | None = None) -> dict | None:
    p = facts_dir(inventory_path) / f"{host}.json"
    try:
        facts = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return facts if max_age is None or is_fresh(facts, max_age) else None


def previous_facts(inventory_path: str, host) -> dict | None:
    """The host's cached facts when they may serve a new gather as `previous` (same address, same facts
    version): an unchanged distribution list need not travel again, and unchanged verdicts are not made again."""
    cached = load_cached_facts(inventory_path, host.name)
    if cached and cached.get("address") == host.address and cached.get("facts_version") == FACTS_VERSION:
        return cached
    return None


def is_fresh(facts: dict, max_age: float, now: float | None = None) -> bool:
    """Gathered at most `max_age` seconds ago. A time in the future (a clock set back, a copied or edited file)
    or one that is not a time says nothing about the host now: stale."""
    try:
        at = datetime.fromisoformat(str(facts["gathered_at"]))
    except (KeyError, TypeError, ValueError):
        return False
    if at.tzinfo is None:
        return False  # what gather writes carries its zone; a naive time is not one of ours
    age = (time.time() if now is None else now) - at.timestamp()
    return 0 <= age <= max_age
