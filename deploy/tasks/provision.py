"""`fab provision HOSTS`: make targets' managed distributions match the reference host's."""
from __future__ import annotations

import json as jsonlib
import sys

from invoke import Exit, task


@task(help={"hosts": "target host(s) or group(s), comma separated",
            "dry-run": "print the plan and change nothing",
            "json": "print the plan / result as JSON",
            "yes": "apply without asking (a run with no terminal never asks: it needs --yes)",
            "undo": "restore each host's latest provision from its backup",
            "parallel": "hosts worked on at once (default: inventory settings.parallel)"})
def provision(c, hosts, dry_run=False, json=False, yes=False, undo=False, parallel=0):
    """Overlay the reference host's exact wheels onto HOSTS (plan, back up, install offline, verify).

    An incoherent reference (pins unmet as `pip check` says, or native extensions not resolving against its torch:
    `fab inventory` flags it) blocks every target's plan, one blocker per reason, and nothing runs."""
    from rich.console import Console

    from ..inventory import InventoryError, load_inventory
    from ..provision import overlay

    console = Console(stderr=True) if json else Console()
    try:
        inv = load_inventory()
        inv.select(hosts)
    except InventoryError as exc:
        raise Exit(str(exc), code=2)
    opts = overlay.Options(dry_run=dry_run, yes=yes, parallel=parallel or None, console=console, quiet=json)
    if undo:
        report = overlay.undo(inv, hosts, opts)
    else:
        report = overlay.provision(inv, hosts, opts)
    if json:
        sys.stdout.write(jsonlib.dumps(report.to_json(), indent=1, sort_keys=True) + "\n")
    else:
        overlay.render_summary(report, console)
    if not report.ok:
        failed = ", ".join(f"{h.host} ({h.status})" for h in report.hosts if not h.ok)
        raise Exit(f"provision failed on: {failed}", code=1)


TASKS = [provision]
