"""`fab inventory`: gather every host's GPU/CUDA/torch facts in parallel."""
from __future__ import annotations

import sys

from invoke import Exit, task


def collect(inv, hosts, refresh: bool):
    """Facts of `hosts`: cached ones younger than settings.facts_ttl (and complete) unless refresh, the rest
    gathered. Returns (facts by host, errors by host as (kind, message))."""
    from ..facts import gather, is_fresh, previous_facts, save_facts
    from ..ssh import run_per_host
    ttl = inv.settings["facts_ttl"]
    facts, stale, previous = {}, [], {}
    for h in hosts:
        cached = previous_facts(inv.path, h)
        if cached:
            previous[h.name] = cached  # its coherence verdicts serve again if the venv did not change
            if not refresh and not cached.get("incomplete") and is_fresh(cached, ttl):
                facts[h.name] = cached
                continue
        stale.append(h)

    def gather_and_cache(conn, host):
        # cached in the host's own thread, while other hosts are still answering (not all at the end)
        f = gather(conn, host, previous=previous.get(host.name))
        save_facts(inv.path, f)
        return f

    errors = {}
    for r in run_per_host(inv, stale, gather_and_cache, label="gathering facts"):
        if r.ok:
            facts[r.host] = r.value
        else:
            errors[r.host] = (r.kind, r.error)
    return {h.name: facts[h.name] for h in hosts if h.name in facts}, errors


def printed(facts: dict) -> dict:
    """A host's facts as --json prints them: the coherence verdicts, not the raw collector documents they were
    made from (every distribution's metadata, the ELF reports: kept in inventory/facts/HOST.json)."""
    venv = facts.get("venv")
    if not venv:
        return facts
    return dict(facts, venv={k: v for k, v in venv.items() if k not in ("collected", "native")})


@task(help={"json": "print JSON instead of a table (every fact)",
            "hosts": "comma-separated hosts or groups (default: all)",
            "refresh": "gather again even if cached facts are younger than settings.facts_ttl",
            "wide": "every fact a column (OS, glibc, torch ABI and archs, triton, flashinfer, endpoint...), as wide "
                    "as it needs"})
def inventory(c, json=False, hosts=None, refresh=False, wide=False):
    """Gather each host's driver, CUDA, GPUs, OS, Python, venv and torch/SGLang facts in parallel; flag incoherent hosts.

    The table has one line per host and fits the terminal (COLUMNS): GPUs, driver, CUDA, Python ABI, torch,
    SGLang, its kernel, coherence, age; drift from the reference host and every problem follow it in words.
    --wide shows every fact as a column, --json every fact as data.

    A host is incoherent when its venv's installed pins are unmet (what `pip check` prints) or when the native
    extensions SGLang loads (sgl_kernel's common_ops for the host's GPU arch) do not resolve against its torch:
    the `coherent` column says so, the reasons follow the table, and --json has them under "incoherent".

    Exit 0 when every host answered with complete facts and is coherent; 1 when a host failed or some facts did
    not come back within the probe's deadline (shown as `incomplete`; takes precedence); 3 when every fact came
    back but a host is incoherent (fab deploy would refuse it: fix its venv, or `fab provision` it)."""
    from ..facts import incoherent, incomplete_summary
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
    bad = incoherent(facts)
    if json:
        import json as jsonlib
        print(jsonlib.dumps({"fleet": inv.fleet, "reference": inv.reference_name,
                             "hosts": {h: printed(f) for h, f in facts.items()},
                             "errors": {h: {"kind": k, "error": e} for h, (k, e) in errors.items()},
                             "incomplete": incomplete, "incoherent": bad,
                             "endpoints": {h: {"router": inv.hosts[h].vars.get("router"),
                                               "listen_address": inv.hosts[h].vars.get("listen_address")}
                                           for h in facts}}, indent=1))
    else:
        from ..report import incoherent_lines, inventory_table, problem_lines, terminal_console, wide_console
        table = inventory_table(inv, facts, errors, wide=bool(wide))
        console = wide_console(table) if wide else terminal_console()
        console.print(table)
        for line in (incoherent_lines(facts) if wide else problem_lines(inv, facts, errors)):
            console.print(line)
    if errors:
        print(f"{len(errors)} host(s) failed: " + "; ".join(f"{h} ({k}: {e})" for h, (k, e) in errors.items()),
              file=sys.stderr)
    if incomplete:
        print(f"{len(incomplete)} host(s) with incomplete facts: "
              + "; ".join(f"{h} ({s})" for h, s in incomplete.items()), file=sys.stderr)
    if bad:
        print(f"{len(bad)} host(s) incoherent: " + ", ".join(bad), file=sys.stderr)
    if errors or incomplete:
        raise Exit(code=1)
    if bad:
        raise Exit(code=3)


TASKS = [inventory]
