"""`fab lab.up|down|status`: the built-in fleet of real systemd-nspawn hosts on this machine."""
from __future__ import annotations

import json as jsonlib

from invoke import Exit, task

from ..lab.drifts import DRIFTS


@task(help={"extra": "also boot N more hosts of the ct200 kind (ct201, ct202, ...) for scale tests",
            "gpu": "the GPU lab instead: gpu-ref and gpu-drift over this machine's own root, with its GPUs "
                   "(inventory/gpulab.yaml; deploy/lab/gpuhost.py)",
            "tp": "also boot the tensor-parallel host ct208 (eight H200 on NVSwitch; inventory/lab-tp.yaml)"})
def up(c, extra=0, gpu=False, tp=False):
    """Boot the lab hosts that are not running (builds the Debian base once); idempotent."""
    from ..lab import fleet
    try:
        report = fleet.up(int(extra), gpu=bool(gpu), tp=bool(tp))
    except fleet.LabError as exc:
        raise Exit(f"lab.up failed: {exc}", code=1)
    base = report["base_build_seconds"]
    print(f"lab up: {', '.join(f'{h} ({a})' for h, a in report['hosts'].items())}")
    print(f"base: {'built in %.1fs' % base if base is not None else 'cached'}; hosts ready in "
          f"{report['boot_seconds']:.1f}s; total {report['total_seconds']:.1f}s")
    print(f"known_hosts: {report['known_hosts']}  (use DEPLOY_INVENTORY={fleet.lab_inventory_path()})")


@task
def down(c):
    """Remove every lab container, mount, namespace, veth and bridge (also after a crash)."""
    from ..lab import fleet
    removed = fleet.down()
    print("lab down: " + ", ".join(f"{v} {k}" for k, v in removed.items()))


@task(help={"host": "the lab host (ct129, ct200, h200, ...)",
            "kind": "one of: " + ", ".join(DRIFTS)})
def drift(c, host, kind):
    """Make one lab host's managed venv incoherent on purpose (real captured metadata), or 'coherent' again."""
    from ..lab import fleet
    try:
        fleet.set_drift(host, kind)
    except fleet.LabError as exc:
        raise Exit(f"lab.drift failed: {exc}", code=1)
    print(f"{host}: {DRIFTS[kind]}")


@task(help={"host": "only these lab hosts (comma list)", "lines": "lines per host (default 25)"})
def journal(c, host=None, lines=25):
    """Print each lab host's recent journal warnings and sshd lines, routine logins left out (read from outside)."""
    from ..lab import fleet
    names = [n for n in (host or "").split(",") if n] or None
    for name, kept in fleet.journal(names, int(lines)).items():
        print(f"== {name}: its journal's last {len(kept)} warnings and sshd lines (routine logins left out)")
        for ln in kept:
            print(f"  {ln}")


@task(help={"json": "print JSON"})
def status(c, json=False):
    """Show the lab hosts: running, address, sshd, GPU persona, torch build."""
    from rich.console import Console
    from rich.table import Table

    from ..lab import fleet
    rows = fleet.status()
    if json:
        print(jsonlib.dumps(rows, indent=1))
        return
    t = Table(title="lab")
    for col in ("host", "address", "state", "sshd", "persona", "gpus", "torch (as built)", "drift"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["host"], r["address"], r["state"], "yes" if r["sshd"] else "no", r["persona"], str(r["gpus"]),
                  r["torch"], r["drift"])
    Console().print(t if rows else "lab: no hosts (fab lab.up)")
