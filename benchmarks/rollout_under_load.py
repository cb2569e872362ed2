"""Requests lost across a rollout: streaming clients through each host's real sglang-router while `fab deploy
--mode tree-verify`, `fab restart`, `fab rollback` run, while gpu0's port changes (30000 -> 30010 on every host),
while the host agent of a `fab deploy` is SIGKILLed on ct129 (right after `gpu0 out of the router`) and the next
`fab deploy` finishes that run, and while a GPU server is SIGKILLed.

    DDTREE_LAB_ID=N .venv/bin/python benchmarks/rollout_under_load.py [--clients 8] [--gpus 4]

Lab only (deploy/lab/loadgen.py refuses any address outside this lab's subnet); bounded: every phase has a fixed
request budget and a time cap, and the script stops by itself. Hosts: ct129, ct200 and ct201 (booted here with
`fab lab.up --extra 1` if missing; each restricted to --gpus GPU services: a host needs a second GPU to keep serving
while one restarts -- the 1-GPU h200 cannot, whatever the drain). Each host: its router on its own address with
an API key (root-only key file), GPU servers on loopback, the stand-in generating at 50 tokens/s per request.

Per action: --window s of load before it, the action, --window s after; a request is "during" when its lifetime
overlaps the action. Printed: sent / completed / failed and p50/p99 latency of completed requests, before /
during / after. For the SIGKILL: the requests the killed server was running at that moment (its own /metrics,
read just before the kill), how many failed, and how long until the router listed it unhealthy.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.inventory import load_inventory  # noqa: E402
from deploy.lab import fleet, loadgen  # noqa: E402

HOSTS = ["ct129", "ct200", "ct201"]
KEY = "KbenchRolloutUnderLoad0123456789"
KEY_FILE = "/etc/ddtree/api-key.yaml"
CLEAN = ("systemctl stop 'sglang-ddtree@*' sglang-router 2>/dev/null; "
         "systemctl reset-failed 'sglang-ddtree@*' sglang-router 2>/dev/null; "
         "rm -rf /opt/ddtree /etc/systemd/system/sglang-ddtree@.service /etc/systemd/system/sglang-ddtree@*.service.d "
         "/etc/systemd/system/sglang-router.service /etc/systemd/system/multi-user.target.wants/sglang-*; "
         "systemctl daemon-reload")


def inventory(tmp: Path, gpus: int, services: dict | None = None, name: str = "rollout-under-load.yaml") -> Path:
    doc = yaml.safe_load(fleet.lab_inventory_path().read_text())
    doc["vars"] = dict(doc.get("vars") or {}, server="labserver", mode="shadow-linear", api_key_file=KEY_FILE)
    doc["hosts"] = {h: {"address": f"{fleet.SUBNET}.{o}", "gpus": gpus,
                        "vars": {"listen_address": f"{fleet.SUBNET}.{o}"},
                        **({"services": services} if services else {})}
                    for h, o in (("ct129", 129), ("ct200", 200), ("ct201", 201))}
    doc["reference"] = "ct129"
    doc["groups"] = {}
    p = tmp / name
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    return p


def ssh(inv, host, cmd, check=True):
    h = inv.hosts[host]
    return subprocess.run(["ssh", "-i", inv.ssh_path("identity_file"), "-o",
                           f"UserKnownHostsFile={inv.ssh_path('known_hosts')}", "-o", "BatchMode=yes",
                           f"{h.user}@{h.address}", cmd], check=check, capture_output=True, text=True, timeout=120)


def fab(inv_path, *args):
    env = {"DEPLOY_INVENTORY": str(inv_path), "PATH": "/usr/bin:/bin", "COLUMNS": "200"}
    import os
    env = dict(os.environ, **env)
    t = time.monotonic()
    r = subprocess.run([str(Path(sys.executable).with_name("fab")), *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    return r, time.monotonic() - t


def fmt(s):
    def sec(v):
        return "-" if v is None else f"{v:.2f}s"
    return f"sent {s['sent']:>5}  completed {s['completed']:>5}  failed {s['failed']:>3}  p50 {sec(s['p50'])}  " \
           f"p99 {sec(s['p99'])}"


def split(results, a0, a1):
    before = [r for r in results if r.end < a0]
    during = [r for r in results if r.start <= a1 and r.end >= a0]
    after = [r for r in results if r.start > a1]
    return before, during, after


def under_load(endpoints, clients, window, action, budget):
    load = loadgen.Load(endpoints, clients=clients, total=budget, time_cap=3 * window + 600, max_new_tokens=32).start()
    time.sleep(window)
    a0 = time.monotonic()
    info = action()
    a1 = time.monotonic()
    time.sleep(window)
    load.stop()
    return load.results, a0, a1, info


def router_workers(inv, host):
    """{url: healthy} as the host's router lists them."""
    code = ("import json,urllib.request as u\nr=u.Request('http://%s:8000/workers',headers={'Authorization':'Bearer %s'})\n"
            "print(json.dumps({w['url']: w['is_healthy'] for w in json.load(u.urlopen(r,timeout=3))['workers']}))"
            % (inv.hosts[host].address, KEY))
    return json.loads(ssh(inv, host, f"python3 -c \"{code}\"").stdout)


def worker_healthy(inv, host, url):
    return router_workers(inv, host).get(url)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8, help="streaming clients per host (through its router)")
    ap.add_argument("--gpus", type=int, default=4, help="GPU services per host")
    ap.add_argument("--window", type=float, default=8.0, help="seconds of load before and after each action")
    ap.add_argument("--budget", type=int, default=4000, help="request budget per action (a cap, not a target)")
    a = ap.parse_args()
    fleet.up(extra=1, log=lambda *_: None)
    tmp = Path(tempfile.mkdtemp(prefix="rollout-load-"))
    inv_path = inventory(tmp, a.gpus)
    inv = load_inventory(str(inv_path))
    for h in HOSTS:
        ssh(inv, h, CLEAN + f"; install -d -m 0755 /etc/ddtree && (umask 077; printf 'api-key: {KEY}\\n' > {KEY_FILE})")
    r, t = fab(inv_path, "deploy", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}  lab {fleet.SUBNET}.0/24, hosts {','.join(HOSTS)} x "
          f"{a.gpus} GPU services, {a.clients} streaming clients per host through its sglang-router 0.3.2 "
          f"({a.clients * len(HOSTS)} in all), 32 tokens per request at 50 tokens/s (stand-in), window {a.window:g}s")
    print(f"# setup: fab deploy --mode shadow-linear (no load) in {t:.1f}s")
    endpoints = [(f"http://{inv.hosts[h].address}:8000", KEY) for h in HOSTS]
    all_ok = True
    for label, args in (("fab deploy --mode tree-verify", ("deploy", "--yes", "--mode", "tree-verify")),
                        ("fab restart", ("restart",)), ("fab rollback", ("rollback",))):
        holder = {}

        def act():
            holder["r"], holder["t"] = fab(inv_path, *args)
        results, a0, a1, _ = under_load(endpoints, a.clients, a.window, act, a.budget)
        rr = holder["r"]
        all_ok &= rr.returncode == 0
        drained = rr.stdout.count("out of the router; drained")
        print(f"\n{label}: exit {rr.returncode} in {holder['t']:.1f}s; {drained} GPU(s) drained"
              + ("" if rr.returncode == 0 else f"\n{rr.stdout[-1500:]}{rr.stderr[-800:]}"))
        for name, part in zip(("before", "during", "after"), split(results, a0, a1)):
            print(f"  {name:<7} {fmt(loadgen.summary(part))}")
        errs = loadgen.summary(results)["errors"]
        if errs:
            print(f"  errors: {errs}")
    # gpu0's port changes on every host: drained at its old url, back at the new one
    moved = inventory(tmp, a.gpus, {0: {"port": 30010}}, "moved.yaml")
    holder = {}

    def move():
        holder["r"], holder["t"] = fab(moved, "deploy", "--yes")
    results, a0, a1, _ = under_load(endpoints, a.clients, a.window, move, a.budget)
    rr = holder["r"]
    all_ok &= rr.returncode == 0
    old = rr.stdout.count("(and its old worker http://127.0.0.1:30000)")
    print(f"\nport change gpu0 30000 -> 30010 (fab deploy): exit {rr.returncode} in {holder['t']:.1f}s; drained at "
          f"the old url on {old} host(s); router workers on ct129: {sorted(router_workers(inv, 'ct129'))}"
          + ("" if rr.returncode == 0 else f"\n{rr.stdout[-1500:]}{rr.stderr[-800:]}"))
    for name, part in zip(("before", "during", "after"), split(results, a0, a1)):
        print(f"  {name:<7} {fmt(loadgen.summary(part))}")
    # the host agent of a deploy SIGKILLed on ct129 right after gpu0 left the router; the next deploy finishes it
    ainfo = {}

    def kill_agent():
        env = dict(os.environ, DEPLOY_INVENTORY=str(moved), COLUMNS="200")
        p = subprocess.Popen([str(Path(sys.executable).with_name("fab")), "deploy", "--yes", "--mode", "tree-verify"],
                             cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("[ct129] gpu0 out of the router") and "pid" not in ainfo:
                lock = json.loads(ssh(inv, "ct129", "cat /var/lib/ddtree/lock.json").stdout)
                ainfo["pid"] = lock["agent"]["pid"]
                ssh(inv, "ct129", f"kill -9 {ainfo['pid']}")
        p.wait()
        ainfo["killed_rc"] = p.returncode
        ainfo["died"] = [ln.strip() for ln in lines if "agent died" in ln][:1]
        st, _t = fab(moved, "status", "--hosts", "ct129")
        ainfo["status_rc"] = st.returncode
        ainfo["r"], ainfo["t"] = fab(moved, "deploy", "--yes", "--mode", "tree-verify")
    results, a0, a1, _ = under_load(endpoints, a.clients, a.window, kill_agent, a.budget)
    rr = ainfo["r"]
    all_ok &= rr.returncode == 0
    print(f"\nagent SIGKILLed on ct129 during fab deploy --mode tree-verify (after gpu0 left the router): that run "
          f"exit {ainfo['killed_rc']} ({ainfo['died'][0] if ainfo['died'] else 'no agent-died line'}); fab status "
          f"exit {ainfo['status_rc']}; the next fab deploy exit {rr.returncode} in {ainfo['t']:.1f}s, "
          f"{'named' if 'found an interrupted run' in rr.stdout else 'DID NOT NAME'} the interrupted run; router "
          f"workers on ct129: {router_workers(inv, 'ct129')}"
          + ("" if rr.returncode == 0 else f"\n{rr.stdout[-1500:]}{rr.stderr[-800:]}"))
    for name, part in zip(("before", "during", "after"), split(results, a0, a1)):
        print(f"  {name:<7} {fmt(loadgen.summary(part))}")
    errs = loadgen.summary(results)["errors"]
    if errs:
        print(f"  errors: {errs}")
    # SIGKILL one GPU server
    victim, inst, port = "ct129", "gpu1", 30001
    url = f"http://127.0.0.1:{port}"
    kinfo = {}

    def kill():
        m = ssh(inv, victim, f"python3 -c \"import urllib.request as u; print(u.urlopen('{url}/metrics').read().decode())\"")
        running = [ln for ln in m.stdout.splitlines() if ln.startswith("sglang:num_running_reqs")]
        kinfo["running"] = int(float(running[0].rsplit(" ", 1)[1])) if running else None
        pid = ssh(inv, victim, f"systemctl show -p MainPID --value sglang-ddtree@{inst}").stdout.strip()
        ssh(inv, victim, f"kill -9 {pid}")
        t0 = time.monotonic()
        kinfo["t_kill"] = t0
        while time.monotonic() - t0 < 30:
            if worker_healthy(inv, victim, url) is False:
                kinfo["unhealthy_after"] = time.monotonic() - t0
                break
            time.sleep(0.2)
        time.sleep(max(0.0, 15 - (time.monotonic() - t0)))  # systemd restarts it (RestartSec=10), the router re-admits
        kinfo["healthy_again"] = worker_healthy(inv, victim, url)
    results, a0, a1, _ = under_load(endpoints, a.clients, a.window, kill, a.budget)
    failed = [r for r in results if not r.ok]
    late = [r for r in failed if r.start > kinfo["t_kill"] + 5.0]
    print(f"\nSIGKILL {victim} {inst} (sglang-ddtree@{inst} main PID, under load): it was running {kinfo['running']} "
          f"request(s); router listed it unhealthy after "
          + (f"{kinfo['unhealthy_after']:.1f}s" if "unhealthy_after" in kinfo else "NEVER (30s)")
          + f"; healthy again after systemd's restart: {kinfo['healthy_again']}")
    for name, part in zip(("before", "during", "after"), split(results, a0, a1)):
        print(f"  {name:<7} {fmt(loadgen.summary(part))}")
    print(f"  failed {len(failed)} (at most the {kinfo['running']} it was running: "
          f"{'yes' if kinfo['running'] is not None and len(failed) <= kinfo['running'] else 'NO'}); failed requests "
          f"started more than 5 s after the kill: {len(late)}")
    if failed:
        print(f"  errors: {sorted({r.error for r in failed})[:3]}")
    for h in HOSTS:  # the lab as it was: no release, no router, no key, no plugin in the managed venv
        ssh(inv, h, CLEAN + f"; rm -f {KEY_FILE}; {inv.hosts[h].vars['venv']}/bin/python -m pip uninstall -y -q "
                            "sglang-ddtree", check=False)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
