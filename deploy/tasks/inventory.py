"""`fab inventory`: gather every host's GPU/CUDA/torch facts in parallel."""
from __future__ import annotations

import sys

from invoke import Exit, task


def collect(inv, hosts, refresh: bool):
    """Facts of `hosts`: cached ones younger than settings.facts_ttl (and complete) unless refresh, the rest
    gathered. Returns (facts by host, errors by host as (kind, message))."""
    from ..facts import gather, load_cached_facts, save_facts
    from ..ssh import run_per_host
    ttl = inv.settings["facts_ttl"]
    facts, stale = {}, []
    for h in hosts:
        cached = None if refresh else load_cached_facts(inv.path, h.name, max_age=ttl)
        if cached and cached.get("address") == h.address and not cached.get("incomplete"):
            facts[h.name] = cached
        else:
            stale.append(h)

    def gather_and_cache(conn, host):
        # cached in the host's own thread, while other hosts are still answering (not all at the end)
        f = gather(conn, host)
        save_facts(inv.path, f)
        return f

    errors = {}
    for r in run_per_host(inv, stale, gather_and_cache, label="gathering facts"):
        if r.ok:
            facts[r.host] = r.value
        else:
            errors[r.host] = (r.kind, r.error)
    return {h.name: facts[h.name] for h in hosts if h.name in facts}, errors


@task(help={"json": "print JSON instead of a table", "hosts": "comma-separated hosts or groups (default: all)",
            "refresh": "gather again even if cached facts are younger than settings.facts_ttl"})
def inventory(c, json=False, hosts=None, refresh=False):
    """Gather each host's driver, CUDA, GPUs, OS, Python, venv and torch/SGLang facts in parallel.

    Exit 0 only when every host answered with complete facts; 1 when a host failed or some facts did not come
    back within the probe's deadline (shown as `incomplete`)."""
    from ..facts import incomplete_summary
    from ..inventory import InventoryError, load_inventory
    try:
        inv = load_inventory()
        selected = inv.select(hosts)
    except InventoryError as exc:
        raise Exit(str(exc), code=2)
    wanted = selected if inv.reference in selected else selected + [inv.reference]
    facts, errors = collect(inv, wanted, refresh)
    if inv.reference not in selected:  # gathered only to show drift against it
        facts.pop(inv.reference_name, None)
        errors.pop(inv.reference_name, None)
    incomplete = {h: s for h, f in facts.items() if (s := incomplete_summary(f))}
    if json:
        import json as jsonlib
        print(jsonlib.dumps({"fleet": inv.fleet, "reference": inv.reference_name, "hosts": facts,
                             "errors": {h: {"kind": k, "error": e} for h, (k, e) in errors.items()},
                             "incomplete": incomplete}, indent=1))
    else:
        from rich.console import Console

        from ..report import inventory_table
        Console(width=max(Console().width, 200)).print(inventory_table(inv, facts, errors))
    if errors:
        print(f"{len(errors)} host(s) failed: " + "; ".join(f"{h} ({k}: {e})" for h, (k, e) in errors.items()),
              file=sys.stderr)
    if incomplete:
        print(f"{len(incomplete)} host(s) with incomplete facts: "
              + "; ".join(f"{h} ({s})" for h, s in incomplete.items()), file=sys.stderr)
    if errors or incomplete:
        raise Exit(code=1)


TASKS = [inventory]
