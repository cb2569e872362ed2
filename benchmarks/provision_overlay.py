"""Benchmark `provision` on the lab with real large wheels: torch 2.14.1 and its CUDA 13 libraries.

One run: installs torch 2.14.1 with its nvidia-*/cuda-*/triton wheels (about 3 GB of wheels, several GB
installed) into a benchmark venv on ct129 (the reference), then overlays them onto ct200 with
`provision` and prints its transfer throughput next to rsync of the same files over the same links, side by
side in one run: rsync runs before and after the provision (the mean of the two is the baseline) with the very
same OpenSSH command line the provision uses (deploy.ssh.openssh_argv: the inventory's known_hosts and key),
then the install time, the re-run time (nothing to do), undo, and a warm re-provision.

It never touches the lab's shared /opt/sglang/venv: it uses /opt/provbench/venv on ct129 and ct200, its
own agent state directory and its own control-side cache, and removes them at the end (--keep keeps them).

    .venv/bin/python benchmarks/provision_overlay.py [--wheels DIR] [--keep]

The wheels come from this machine's pip (`pip download torch==2.14.1` into --wheels once, cached).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from deploy.inventory import load_inventory  # noqa: E402
from deploy.lab.fleet import lab_inventory_path  # noqa: E402
from deploy.provision import overlay  # noqa: E402
from deploy.provision.cache import WheelCache  # noqa: E402
from deploy.provision.plan import human, managed  # noqa: E402
from deploy.ssh import open_checked, openssh_argv  # noqa: E402

VENV = "/opt/provbench/venv"
HOUSE = "/opt/provbench/wheelhouse"
STAGE = "/var/lib/ddtree-provbench"
RSYNC_DST = "/var/tmp/provbench-rsync"
MANAGED = ["torch", "triton", "nvidia-*", "cuda-*"]
console = Console()


def sh(conn, cmd, timeout=1800):
    r = conn.run(cmd, hide=True, warn=True, in_stream=False, timeout=timeout)
    if r.exited != 0:
        raise SystemExit(f"{cmd[:120]}: exit {r.exited}: {r.stderr[-800:]}")
    return r.stdout


def ssh_cmd(inv, host) -> str:
    """The provision's own OpenSSH command line for `host`, less the address (rsync appends it)."""
    return shlex.join(openssh_argv(inv, host)[:-1])


def rsync(inv, host, srcs: list[str], dst: str) -> float:
    t = time.time()
    subprocess.run(["rsync", "-a", "--whole-file", "-e", ssh_cmd(inv, host), *srcs, dst], check=True)
    return time.time() - t


def wheel_name(p: Path) -> str:
    return p.name.split("-")[0].lower().replace("_", "-")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wheels", default="/var/tmp/provbench/wheels")
    ap.add_argument("--keep", action="store_true", help="leave the benchmark venvs and files in place")
    a = ap.parse_args()
    wheels_dir = Path(a.wheels)
    if not list(wheels_dir.glob("torch-2.14.1-*.whl")):
        wheels_dir.mkdir(parents=True, exist_ok=True)
        console.print("downloading torch 2.14.1 and its dependencies with this machine's pip ...")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels_dir), "torch==2.14.1",
                        "--only-binary", ":all:"], check=True)
    wheels = sorted(wheels_dir.glob("*.whl"))
    names = {wheel_name(w): w for w in wheels}
    man = set(managed({n: "0" for n in names}, MANAGED))
    managed_wheels = [w for w in wheels if wheel_name(w) in man]
    other_wheels = [w for w in wheels if wheel_name(w) not in man]
    total = sum(w.stat().st_size for w in managed_wheels)
    console.print(f"{len(managed_wheels)} managed wheels, {human(total)}; {len(other_wheels)} plain dependencies")

    lab = load_inventory(str(lab_inventory_path()))
    hosts = dict(lab.hosts)
    for n in ("ct129", "ct200"):
        hosts[n] = dataclasses.replace(hosts[n], vars=dict(hosts[n].vars, venv=VENV, managed=MANAGED,
                                                           wheelhouse=[HOUSE]))
    work = Path("/var/tmp/provbench/run")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    inv = dataclasses.replace(lab, hosts=hosts, path=str(work / "inventory.yaml"))
    ref, tgt = hosts["ct129"], hosts["ct200"]
    results = []

    # setup: the reference gets every wheel installed (and keeps them in its wheelhouse); the target only
    # the plain dependencies, so that torch imports there once the overlay lands
    t = time.time()
    for h in (ref, tgt):
        c = open_checked(inv, h)
        sh(c, f"rm -rf /opt/provbench {STAGE} {RSYNC_DST} && mkdir -p {HOUSE} && python3 -m venv {VENV}")
        c.close()
    up = time.time()
    rsync(inv, ref, [str(w) for w in wheels], f"{ref.address}:{HOUSE}/")
    results.append(("rsync control -> ct129 (setup, all wheels)", sum(w.stat().st_size for w in wheels),
                    time.time() - up))
    c = open_checked(inv, ref)
    sh(c, f"{VENV}/bin/python -m pip install -q --no-index --no-deps --disable-pip-version-check {HOUSE}/*.whl",
       timeout=3600)
    c.close()
    c = open_checked(inv, tgt)
    sh(c, f"mkdir -p /opt/provbench/deps")
    c.close()
    subprocess.run(["rsync", "-a", "-e", ssh_cmd(inv, tgt)] + [str(w) for w in other_wheels]
                   + [f"{tgt.address}:/opt/provbench/deps/"], check=True)
    c = open_checked(inv, tgt)
    sh(c, f"{VENV}/bin/python -m pip install -q --no-index --no-deps --disable-pip-version-check "
          f"/opt/provbench/deps/*.whl && rm -rf /opt/provbench/deps", timeout=1800)
    c.close()
    console.print(f"setup done in {time.time() - t:.0f}s (reference venv installed from {len(wheels)} wheels)")

    # rsync baselines over the same links, the same files, the same ssh command line (before and after provision)
    rsync_runs = {"get": [], "put": []}

    def rsync_baseline(label: str) -> None:
        dl = work / "rsync-get"
        shutil.rmtree(dl, ignore_errors=True)
        dl.mkdir()
        secs = rsync(inv, ref, [f"{ref.address}:{HOUSE}/{w.name}" for w in managed_wheels], str(dl) + "/")
        rsync_runs["get"].append(total / secs)
        results.append((f"rsync ct129 -> control ({label})", total, secs))
        c = open_checked(inv, tgt)
        sh(c, f"rm -rf {RSYNC_DST} && mkdir -p {RSYNC_DST}")
        c.close()
        secs = rsync(inv, tgt, [str(dl) + "/"], f"{tgt.address}:{RSYNC_DST}/")
        rsync_runs["put"].append(total / secs)
        results.append((f"rsync control -> ct200 ({label})", total, secs))
        shutil.rmtree(dl)
        c = open_checked(inv, tgt)
        sh(c, f"rm -rf {RSYNC_DST}")
        c.close()

    rsync_baseline("before")

    cache = WheelCache(work / "cache")

    def opts():
        return overlay.Options(yes=True, cache=cache, state_dir=STAGE, console=console)

    # cold provision: empty control cache, nothing staged on the target
    t = time.time()
    rep = overlay.provision(inv, "ct200", opts())
    cold = time.time() - t
    (h,) = rep.hosts
    if not h.ok:
        console.print(f"[red]provision failed: {h.error}[/]")
        return 1
    ph = rep.phases
    fetch_rate = rep.fetched_bytes / ph["fetch"] if ph.get("fetch") else 0.0
    put_rate = h.sent_bytes / h.details["put_seconds"] if h.details.get("put_seconds") else 0.0
    results.append(("provision: ct129 -> control cache (OpenSSH stream, sha256 + RECORD check after)",
                     rep.fetched_bytes, ph.get("fetch", 0)))
    results.append(("provision: control -> ct200 private staging (OpenSSH stream, sha256 on arrival)", h.sent_bytes,
                     h.details["put_seconds"]))
    results.append(("provision: control cache check (sha256 + every member against RECORD)", None,
                    ph.get("cache_check", 0)))
    results.append(("provision: scan reference (RECORD + wheel hashes)", None, ph.get("scan", 0)))
    results.append(("provision: apply on ct200 (backup, pip, smoke import)", None, h.details["apply_seconds"]))
    results.append(("provision: verify (facts again)", None, h.details["verify_seconds"]))
    results.append(("provision cold, total", h.sent_bytes, cold))
    smoke = h.details.get("smoke_modules")

    t = time.time()
    rep2 = overlay.provision(inv, "ct200", opts())
    results.append(("re-run (in sync: nothing to do)", rep2.sent_bytes + rep2.fetched_bytes, time.time() - t))
    assert rep2.hosts[0].status == "in-sync", rep2.hosts[0].status

    t = time.time()
    u = overlay.undo(inv, "ct200", opts())
    results.append(("undo (back to the pre-provision venv)", 0, time.time() - t))
    assert u.ok, u.hosts[0].error

    t = time.time()
    rep3 = overlay.provision(inv, "ct200", opts())
    results.append(("provision warm (wheels already staged on ct200)", rep3.sent_bytes, time.time() - t))
    assert rep3.ok, rep3.hosts[0].error

    rsync_baseline("after")
    tab = Table(title=f"provision benchmark: {len(managed_wheels)} wheels, {human(total)} (torch 2.14.1 + CUDA 13)",
                title_justify="left")
    for col in ("step", "bytes", "seconds", "throughput"):
        tab.add_column(col)
    for name, b, s in results:
        rate = f"{b / s / 1e6:.0f} MB/s" if b and s else ""
        tab.add_row(name, human(b) if b is not None else "", f"{s:.1f}", rate)
    console.print(tab)
    console.print(f"smoke-imported on ct200: {', '.join(smoke or [])}")
    get_base = sum(rsync_runs["get"]) / len(rsync_runs["get"])
    put_base = sum(rsync_runs["put"]) / len(rsync_runs["put"])
    console.print(f"ratio, wheels ct129 -> control: provision {fetch_rate / 1e6:.0f} MB/s (transfer; the cache's "
                  f"sha256 + RECORD check comes after) / rsync {get_base / 1e6:.0f} MB/s = {fetch_rate / get_base:.2f}x")
    console.print(f"ratio, wheels control -> ct200: provision {put_rate / 1e6:.0f} MB/s (sha256 on arrival included) / "
                  f"rsync {put_base / 1e6:.0f} MB/s = {put_rate / put_base:.2f}x  (goal >= 0.9x)")

    if not a.keep:
        for hh in (ref, tgt):
            c = open_checked(inv, hh)
            sh(c, f"rm -rf /opt/provbench {STAGE} {RSYNC_DST}")
            c.close()
        shutil.rmtree(work / "cache", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
