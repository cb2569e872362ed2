"""`fab bench HOST`: tok/s, accept length, TTFT and per-token latency of each serving mode on one GPU of a host."""
from __future__ import annotations

import json as jsonlib
import sys

from invoke import Exit, task


@task(help={"gpu": "GPU index (default: the host's first enabled service)",
            "modes": "comma list of plain, dflash (= linear), tree-verify, shadow-linear (default plain,dflash,tree-verify)",
            "budgets": "DDTREE budgets B, comma list (default 15,31,63; tree-verify verifies B+1 tokens); budget "
                       "schedules for tree-verify among them, items then split by ';' (\"31; 1:127,4:31,64:chain\")",
            "concurrency": "concurrent requests, comma list (default 1,4,16)",
            "graphs": "CUDA graphs on, off or both (default both)",
            "prompts": "JSON/JSONL file of token-id prompts (default: random prompts inside the model's vocabulary)",
            "tiny": "bench the training kit's tiny pair (trained on the host, seeded) instead of the service's models",
            "family": "with --tiny: hybrid or dense (default: the family of the service's model)",
            "tokens": "new tokens a request (default 128)", "requests": "requests a level (default: the prompts)",
            "server_args": "extra SGLang arguments for every bench server (one string; the service's extra_args "
                           "are passed too)",
            "rounds": "run the whole list N times over, a fresh server each time; report each level's median round "
                      "(default 1)",
            "cpus": "pin every bench server to these CPUs of the host (0-3,8) and the load generator to the others: "
                    "a host-bound decode step then does not depend on where the kernel put the server",
            "overlap": "tree-verify on SGLang's overlap scheduler (on), the synchronous one (off), or one of each "
                       "every round (both); default: the plugin's own (synchronous). mode: auto picks among the runs "
                       "on the scheduler the service asks for (env SGLANG_DDTREE_OVERLAP)",
            "timeout": "seconds for the whole run on the host (default 3600)", "json": "print the result as JSON",
            "wide": "every figure a column (ITL p99 too) and run names never shortened, as wide as it needs",
            "dry_run": "probe and plan only: show the plan and the host's command line, start nothing"})
def bench(c, host, gpu=None, modes=None, budgets=None, concurrency=None, graphs=None, prompts=None, tiny=False,
          family=None, tokens=None, requests=None, server_args=None, rounds=None, cpus=None, overlap=None, timeout=3600,
          json=False, dry_run=False, wide=False):
    """Benchmark plain, DFLASH and DDTREE on one GPU with the active release; keep the result for `mode: auto`."""
    from pathlib import Path

    from .. import bench as lib
    from .release import _inv

    inv, picked = _inv(host)  # an unknown name: exit 2 with the inventory's own message
    if [h.name for h in picked] != [host]:
        raise Exit(f"bench: {host!r} is a group; bench runs on one host", code=2)
    d = lib.DEFAULTS
    try:
        kw = {"gpu": None if gpu in (None, "") else int(gpu),
              "modes_": lib.mode_list(modes) if modes else d["modes"],
              "budgets": lib.budget_list(budgets) if budgets else d["budgets"],
              "concurrency": lib.int_list(concurrency, "--concurrency", 1, 1024) if concurrency else d["concurrency"],
              "graphs": graphs or d["graphs"], "tiny": bool(tiny), "family": family or None,
              "max_new_tokens": int(tokens) if tokens else d["max_new_tokens"],
              "requests": int(requests) if requests else None,
              "server_args": tuple((server_args or "").split()), "deadline": float(timeout),
              "rounds": int(rounds) if rounds else 1, "cpus": cpus or None, "overlap": overlap or "default"}
        if prompts:
            kw.update(prompts=lib.load_prompt_file(prompts), prompts_source=str(prompts))
    except ValueError as exc:  # BenchRefused is one
        raise Exit(f"bench: {exc}", code=2)
    if kw["max_new_tokens"] < 1 or (kw["requests"] is not None and kw["requests"] < 1):
        raise Exit("bench: --tokens and --requests must be at least 1", code=2)

    def show(plan):
        if json:
            return
        what = (f"tiny {plan.tiny} pair trained on the host ({plan.family_reason})" if plan.tiny
                else f"{plan.model} + {plan.draft_model}")
        print(f"[{plan.host}] bench on GPU {plan.gpu} ({plan.instance or 'no service'}), release {plan.release}: "
              f"{what}; modes {','.join(plan.modes)}, budgets {lib.contract.budgets_word(plan.budgets)}, graphs "
              f"{plan.graphs}, concurrency {','.join(map(str, plan.concurrency))}, {plan.max_new_tokens} tokens, "
              f"prompts {plan.prompts_source}; one server at a time"
              + (f", the whole list {plan.rounds} times over (medians)" if plan.rounds > 1 else "")
              + (f", servers pinned to CPUs {plan.cpus}" if plan.cpus else "")
              + (f", tree-verify scheduler: {plan.overlap}" if plan.overlap != "default" else ""), flush=True)
        for w in plan.warnings:
            print(f"[{plan.host}] WARNING {w}", flush=True)

    out = lib.run(inv, inv.hosts[host], on_plan=show, dry_run=bool(dry_run), **kw)
    if out.get("command") and not json:
        import shlex

        print(f"[{host}] would run: {shlex.join(out['command'])}")
    rec = out.get("record")
    if rec is not None:
        try:
            png = lib.plot(rec, Path(out["saved"]).with_suffix(".png"))
            out["plot"] = str(png)
        except (ImportError, ValueError) as exc:
            out["plot"] = None
            print(f"bench: no plot: {exc}", file=sys.stderr)
    if json:
        print(jsonlib.dumps(out, indent=1))
    else:
        if rec is not None:
            from ..report import terminal_console, wide_console
            table = lib.table(rec, wide=bool(wide))
            console = wide_console(table) if wide else terminal_console()
            console.print(table)
            if not wide:
                for line in lib.failure_notes(rec):
                    console.print(line, markup=False, highlight=False)
            for line in lib.paired_lines(rec["report"]):
                print(f"[{host}] paired by round: {line}")
            for line in lib.schedule_lines(rec):
                print(f"[{host}] {line}")
            for line in lib.jit_start_lines(rec):
                print(f"[{host}] {line}")
            print(f"[{host}] kept {out['saved']}" + (f", plot {out['plot']}" if out.get("plot") else ""))
        if out.get("jit"):
            print(f"[{host}] servers' {out['jit']}")
        print(f"[{host}] {out['line']}")
    if out["exit"]:
        print(f"bench: {host}: {out['line']}", file=sys.stderr)
        raise Exit(code=out["exit"])


TASKS = [bench]
