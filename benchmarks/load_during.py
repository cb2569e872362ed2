"""Requests lost and latency while one `fab` command runs under load, through the hosts' real sglang-routers.

    python benchmarks/load_during.py --hosts gpu-ref [--clients 4] [--window 20] [--tokens 64] -- restart --hosts gpu-ref --yes

For the GPU lab (inventory/gpulab.yaml, where the routers listen on the hosts' addresses behind the lab's API key:
deploy/lab/fleet.gpu_api_key) and any lab inventory whose routers are reachable so. Lab addresses only
(deploy/lab/loadgen.py refuses anything else). Streaming clients send greedy requests (`ignore_eos`, --tokens
each) through each named host's router for --window s, then the `fab` command runs (its output printed as it
goes), then --window s more; `fab status` runs once in the first window, while the servers are loaded. Printed:
sent / completed / failed and p50/p99 latency before, during and after the command, the errors seen, and the
command's exit status. A request is "during" when its lifetime overlaps the command. Bounded: the request budget
(--budget) and a time cap stop the clients by themselves.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.inventory import load_inventory  # noqa: E402
from deploy.lab import fleet, loadgen  # noqa: E402


def fab(args: list[str], inventory: str, timeout: float) -> tuple[int, str, float]:
    """`fab ARGS` against `inventory`, its output echoed line by line and returned; (exit, output, seconds)."""
    exe = Path(sys.executable).with_name("fab")
    env = dict(os.environ, DEPLOY_INVENTORY=inventory, COLUMNS=os.environ.get("COLUMNS", "100"))
    t = time.monotonic()
    p = subprocess.Popen([str(exe), *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    lines = []
    for line in p.stdout:
        lines.append(line)
        print("  | " + line.rstrip(), flush=True)
    rc = p.wait()
    timer.cancel()
    return rc, "".join(lines), time.monotonic() - t


def line(name: str, part: list) -> str:
    s = loadgen.summary(part)
    sec = (lambda v: "-" if v is None else f"{v:.2f}s")
    return (f"  {name:<7} sent {s['sent']:>5}  completed {s['completed']:>5}  failed {s['failed']:>4}  "
            f"p50 {sec(s['p50'])}  p99 {sec(s['p99'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inventory", default=os.environ.get("DEPLOY_INVENTORY", "inventory/gpulab.yaml"))
    ap.add_argument("--hosts", required=True, help="comma list: the hosts whose routers get the load")
    ap.add_argument("--clients", type=int, default=4, help="streaming clients per host")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of load before and after the command")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens a request")
    ap.add_argument("--budget", type=int, default=20000, help="requests in all (a cap, not a target)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds the fab command may take")
    ap.add_argument("--no-status", action="store_true", help="skip the `fab status` in the first window")
    ap.add_argument("fab_args", nargs=argparse.REMAINDER, help="-- then the fab command and its arguments")
    a = ap.parse_args()
    args = a.fab_args[1:] if a.fab_args[:1] == ["--"] else a.fab_args
    if not args:
        ap.error("no fab command given (after --)")
    inv = load_inventory(a.inventory)
    key = fleet.gpu_api_key() if (fleet.LAB_DIR / "api-key").exists() else None
    endpoints = []
    for name in a.hosts.split(","):
        h = inv.hosts[name]
        endpoints.append((f"http://{h.vars.get('listen_address') or h.address}:{h.vars['router']['port']}", key))
    print(f"# {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}  {a.clients} streaming client(s) per router "
          f"({', '.join(u for u, _ in endpoints)}), {a.tokens} tokens a request (greedy, ignore_eos), window "
          f"{a.window:g}s; during: fab {' '.join(args)}", flush=True)
    load = loadgen.Load(endpoints, clients=a.clients, total=a.budget, time_cap=2 * a.window + a.timeout + 120,
                        max_new_tokens=a.tokens, timeout=120.0).start()
    t0 = time.monotonic()
    if not a.no_status:
        time.sleep(a.window / 2)
        print("# fab status, under load:", flush=True)
        fab(["status", "--hosts", a.hosts], a.inventory, 120)
    time.sleep(max(0.0, a.window - (time.monotonic() - t0)))
    a0 = time.monotonic()
    rc, out, took = fab(args, a.inventory, a.timeout)
    a1 = time.monotonic()
    time.sleep(a.window)
    load.stop()
    res = load.results
    print(f"\nfab {' '.join(args)}: exit {rc} in {took:.1f}s; "
          f"{out.count('out of the router; drained')} GPU(s) drained")
    print(line("before", [r for r in res if r.end < a0]))
    print(line("during", [r for r in res if r.start <= a1 and r.end >= a0]))
    print(line("after", [r for r in res if r.start > a1]))
    print(line("all", res))
    errs = sorted({r.error for r in res if not r.ok})
    if errs:
        print(f"  errors ({len(errs)} kinds): " + "; ".join(e[:160] for e in errs[:4]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
