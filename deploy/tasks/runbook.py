"""`fab status`, `fab logs`, `fab restart`: the on-call runbook for the GPU services."""
from __future__ import annotations

import json as jsonlib
import sys

from invoke import Exit, task

from .release import _inv, report


def _gpus(gpus):
    try:
        return [int(g) for g in str(gpus).split(",") if g.strip()] if gpus not in (None, "") else None
    except ValueError:
        raise Exit("--gpus takes comma-separated GPU indices, e.g. 0,3", code=2)


@task(help={"hosts": "comma-separated hosts or groups (default: all)", "json": "print JSON",
            "history": "also show the last N audit-journal entries of each host (deploys, rollbacks, restarts)",
            "watch": "refresh every --interval seconds until Ctrl-C (tokens/s from the generated-token counter); "
                     "with --json one JSON document per line",
            "interval": "seconds between refreshes with --watch (default 2)",
            "count": "with --watch, stop after this many refreshes (default: until Ctrl-C)",
            "wide": "every field a column (port, release, HYBRID-UNSAFE, lock, last deploy), as wide as it needs"})
def status(c, hosts=None, json=False, history=0, watch=False, interval=2.0, count=0, wide=False):
    """Per host and GPU: unit state, health, the router's view, tokens/s, running/queued, accept length, mode.

    One line per GPU, fit for the terminal (COLUMNS); each host's release, lock and last deploy and every problem
    follow in words; --wide shows every field as a column, --json every field as data."""
    import time
    from ..release import status as st
    inv, selected = _inv(hosts)
    previous, last_t, n = None, None, 0
    while True:
        t = time.monotonic()
        gathered = st.gather(inv, selected, journal_n=max(5, int(history)))
        rows = st.rows(gathered, inv.hosts, previous, (t - last_t) if last_t else None)
        routers = st.routers(gathered, inv.hosts)
        if json:
            doc = rows if not history and not watch else {"services": rows, "routers": routers, "journal": {
                g["host"]: (g["state"] or {}).get("journal", [])[-int(history):] for g in gathered}}
            print(jsonlib.dumps(doc, indent=None if watch else 1), flush=True)
        else:
            if watch:
                print("\033[2J\033[H" + time.strftime("%H:%M:%S") + f"  (every {float(interval):g}s; Ctrl-C stops)")
            st.print_table(rows, router_rows=routers, wide=bool(wide))
            if history:
                for g in gathered:
                    for j in (g["state"] or {}).get("journal", [])[-int(history):]:
                        print(st.journal_line(g["host"], j))
        n += 1
        if not watch or (count and n >= int(count)):
            break
        previous = {(r["host"], r.get("instance")): r for r in rows if not r.get("error")}
        last_t = t
        try:
            time.sleep(max(0.0, float(interval) - (time.monotonic() - t)))
        except KeyboardInterrupt:
            break
    bad = st.problems(rows, routers)
    if bad and not json:
        print("\n".join(["NOT OK:"] + ["  " + b for b in bad]), file=sys.stderr)
    if bad:
        raise Exit(code=1)


@task(help={"hosts": "comma-separated hosts or groups (default: all)", "gpus": "comma-separated GPU indices",
            "lines": "journal lines per service (default 50)", "since": "journalctl --since, e.g. '10 min ago'",
            "router": "also the host's sglang-router journal"})
def logs(c, hosts=None, gpus=None, lines=50, since=None, router=False):
    """Show the journal of the GPU services (prefixed by host and GPU; --router: and of the host's router)."""
    from ..release import status as st
    inv, selected = _inv(hosts)
    bad = False
    for r in st.logs(inv, selected, _gpus(gpus), int(lines), since, router):
        if not r.ok:
            print(f"[{r.host}] {r.kind}: {r.error}", file=sys.stderr)
            bad = True
            continue
        for inst, ls in r.value.items():
            for ln in ls:
                print(f"[{r.host} {inst}] {ln}")
    if bad:
        raise Exit(code=1)


@task(help={"hosts": "comma-separated hosts or groups (default: all)", "gpus": "comma-separated GPU indices",
            "break_lock": "remove another run's host lock first", "json": "print the summary as JSON",
            "yes": "accepted for symmetry with deploy: restart never asks (a runbook action, gated per GPU)",
            "no_drain": "restart without draining the GPUs out of the host's router (in-flight requests are cut)"})
def restart(c, yes=False, hosts=None, gpus=None, break_lock=False, json=False, no_drain=False):
    """Restart services of the active release one batch at a time: drained out of the router, gated, put back."""
    from ..release import rollout
    inv, selected = _inv(hosts)
    summary = rollout.restart(inv, selected, _gpus(gpus), break_lock=break_lock,
                              command=" ".join(["fab"] + sys.argv[1:]), no_drain=no_drain)
    report(summary, json, "restart")


TASKS = [status, logs, restart]
