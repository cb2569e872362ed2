"""`fab smoke HOST`: the DDTree payload's smoke test on one GPU of a fleet host."""
from __future__ import annotations

import json as jsonlib
import sys

from invoke import Exit, task


@task(help={"gpu": "GPU index (default: the host's first enabled service)",
            "mode": "tree-verify | shadow-linear | linear | plain (default: that service's mode)",
            "budget": "tree budget B (default: the service's, at most 63)",
            "prompts": "prompts of the lossless statistic (default 8)", "tokens": "new tokens each (default 32)",
            "timeout": "seconds for the whole run on the host (default 900)", "json": "print the report as JSON"})
def smoke(c, host, gpu=None, mode=None, budget=None, prompts=8, tokens=32, timeout=900, json=False):
    """Serve a tiny model of the configured family on one GPU with the active release; check it is lossless."""
    from ..smoke import run
    from .release import _inv

    inv, picked = _inv(host)  # an unknown name: exit 2 with the inventory's own message
    if [h.name for h in picked] != [host]:
        raise Exit(f"smoke: {host!r} is a group; smoke runs on one host", code=2)
    try:
        g = None if gpu in (None, "") else int(gpu)
        b = None if budget in (None, "") else int(budget)
    except ValueError:
        raise Exit("smoke: --gpu and --budget take integers", code=2)

    def show(plan):
        if not json:
            print(f"[{plan.host}] smoke on GPU {plan.gpu} ({plan.instance or 'no service'}): "
                                   f"mode {plan.mode}, {plan.family} tiny model ({plan.family_reason}), B={plan.budget}, "
                                   f"release {plan.release}, {plan.prompts} prompts x {plan.tokens} tokens", flush=True)

    out = run(inv, inv.hosts[host], g, mode, b, int(prompts), int(tokens), float(timeout), on_plan=show)
    if json:
        print(jsonlib.dumps(out, indent=1))
    else:
        if out.get("jit"):
            print(f"[{host}] {out['jit']}")
        print(f"[{host}] {out['line']}")
        rep = (out.get("result") or {}).get("report") or {}
        for k, v in (rep.get("checks") or {}).items():
            print(f"  {k}: {jsonlib.dumps(v)}")
    if out["exit"]:
        print(f"smoke: {host}: {out['line']}", file=sys.stderr)
        raise Exit(code=out["exit"])


TASKS = [smoke]
