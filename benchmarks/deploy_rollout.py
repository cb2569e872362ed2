"""Benchmark `fab deploy` and `fab rollback` on the lab: deploy time minus service start time per host.

    DEPLOY_INVENTORY is not used: the lab inventory (inventory/lab.yaml) is copied with `server: labserver`.
    .venv/bin/python benchmarks/deploy_rollout.py [--hosts ct129,ct200,h200] [--load-seconds 0]

Phases, each through the real code path (rollout.deploy / rollout.rollback over SSH, real systemd):
  1. first deploy (tree-verify) onto a clean slate      2. no-op redeploy (must restart nothing)
  3. mode change to shadow-linear (every GPU restarts)   4. rollback to the first release
"Service" time is the time spent in restart+gate batches (systemd restart, server start, health gate);
"overhead" = host time - service time: SSH round trips, bundle upload, pip install of the wheel, unit
install, locking and journaling. Lab servers start in well under a second; on GPU hosts the service time
is dominated by model loading, the overhead stays what is printed here.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.inventory import load_inventory  # noqa: E402
from deploy.release import plan, progress, rollout  # noqa: E402


def lab_inventory(tmp: Path, hosts: list[str], load_seconds: float) -> Path:
    doc = yaml.safe_load((ROOT / "inventory" / "lab.yaml").read_text())
    doc["vars"] = dict(doc.get("vars") or {}, server="labserver")
    if load_seconds:
        doc["vars"]["env"] = {"LABSERVER_LOAD_SECONDS": str(load_seconds)}
    doc["hosts"] = {h: v for h, v in doc["hosts"].items() if h in hosts}
    doc["reference"] = hosts[0]
    for g in (doc.get("groups") or {}).values():
        g["hosts"] = [h for h in g.get("hosts", []) if h in hosts]
    p = tmp / "bench-lab.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


CLEAN = ("systemctl stop 'sglang-ddtree@*' 2>/dev/null; systemctl reset-failed 'sglang-ddtree@*' 2>/dev/null; "
         "rm -rf /opt/ddtree /etc/systemd/system/sglang-ddtree@.service "
         "/etc/systemd/system/multi-user.target.wants/sglang-ddtree@*; systemctl daemon-reload")


def clean(inv, names, setup=True):
    for n in names:
        h = inv.hosts[n]
        subprocess.run(["ssh", "-i", inv.ssh_path("identity_file"), "-o",
                        f"UserKnownHostsFile={inv.ssh_path('known_hosts')}", "-o", "BatchMode=yes",
                        f"{h.user}@{h.address}",
                        # the lab ships /models/Qwen3-8B/config.json; only the release state is cleaned
                        CLEAN + ("" if setup else
                                 f"; {h.vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree")],
                       check=setup, capture_output=True)


def row(phase, summary):
    for h, r in summary["hosts"].items():
        secs, svc = r.get("seconds", 0), r.get("service_seconds", 0)
        n = len(r.get("restarted") or [])
        print(f"{phase:<22} {h:<7} {'ok' if r.get('ok') else 'FAIL':<4} restarted {n:>2}  host {secs:6.2f}s  "
              f"service {svc:6.2f}s  overhead {secs - svc:6.2f}s" + (f"  ({r.get('error')})" if not r.get("ok") else ""))
    print(f"{phase:<22} total wall {summary['seconds']:.2f}s (incl. wheel build {summary.get('build_seconds', 0):.2f}s "
          f"and the plan round trip)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="ct129,ct200,h200")
    ap.add_argument("--load-seconds", type=float, default=0.0, help="simulated model load per service")
    ap.add_argument("--keep", action="store_true", help="leave the services running afterwards")
    a = ap.parse_args()
    names = a.hosts.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        inv = load_inventory(str(lab_inventory(Path(tmp), names, a.load_seconds)))
        hosts = inv.select(names)
        clean(inv, names)
        quiet = progress.Printer(quiet=True)
        gpus = sum(len(h.services) for h in hosts)
        print(f"lab deploy benchmark: {len(hosts)} hosts, {gpus} GPU services, load {a.load_seconds}s/service")
        s1 = rollout.deploy(inv, hosts, plan.DeployOptions(mode="tree-verify"), out=quiet)
        row("1 first deploy", s1)
        s2 = rollout.deploy(inv, hosts, plan.DeployOptions(mode="tree-verify"), out=quiet)
        row("2 no-op redeploy", s2)
        s3 = rollout.deploy(inv, hosts, plan.DeployOptions(mode="shadow-linear"), out=quiet)
        row("3 mode change", s3)
        t = time.monotonic()
        s4 = rollout.rollback(inv, hosts, out=quiet)
        row("4 rollback", s4)
        for h, r in s4["hosts"].items():
            print(f"rollback {h}: {r.get('previous')} -> {r.get('release')} in {r.get('seconds', 0):.2f}s "
                  f"({len(r.get('restarted') or [])} GPUs re-gated)")
        print(f"rollback wall (all hosts in parallel): {time.monotonic() - t:.2f}s")
        ok = all(s["ok"] for s in (s1, s2, s3, s4)) and not any(r.get("restarted") for r in s2["hosts"].values())
        if not a.keep:
            clean(inv, names, setup=False)  # the lab is shared: no services, releases or plugin left behind
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
