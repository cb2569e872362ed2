"""The real SGLang router (sglang-router 0.3.2) on real lab hosts under real systemd: its hardened unit, the API key
through a credential (never argv, unit or journal), GPU servers on loopback behind it, and the drain on every
restart -- under streaming load, with a worker that never drains, and with the router down (refused at the plan;
--no-drain restarts anyway, loudly). `fab status` figures are checked against what the load generator sent.

Hosts: h200 (1 GPU) for the unit, the key and the router's hold (its only server restarts: the router holds the
requests that arrive meanwhile); ct129 restricted to 2 GPUs for the drain (the second GPU serves while one
restarts). Order matters: each test starts from the state the previous one left.
"""
from __future__ import annotations

import json
import re
import time

import pytest

from deploy.lab import loadgen

from helpers import CLEAN, lab_inventory, ssh, strip_ansi

pytestmark = pytest.mark.lab
KEY = "Kr7uTq2LmZ7wP4sR8vB1nY6hRouterLab"
KEY_FILE = "/etc/ddtree/api-key.yaml"
ROUTER_PORT = 8000
SLOW_START_S = 6  # the stand-in's load time in the hold test: the one-GPU host's outage


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labrouter")
    for h in ("h200", "ct129"):
        ssh(lab, h, CLEAN + f"; install -d -m 0755 /etc/ddtree && (umask 077; printf 'api-key: {KEY}\\n' > {KEY_FILE})")
    keyed = {"listen_address": None, "api_key_file": KEY_FILE}
    hosts = {h: {"vars": dict(keyed, listen_address=lab.hosts[h].address)} for h in ("h200", "ct129")}
    hosts["ct129"]["gpus"] = 2
    yield {"lab": lab, "tmp": tmp, "h200": lab_inventory(tmp, "h200.yaml", keep=["h200"], hosts={"h200": hosts["h200"]}),
           **{f"h200-hold{name}": lab_inventory(tmp, f"h200-hold{name}.yaml", keep=["h200"], hosts={"h200": dict(
               hosts["h200"], vars=dict(hosts["h200"]["vars"], router={"hold_secs": hold},
                                      start_seconds=SLOW_START_S + 2),
               services={0: {"env": {"LABSERVER_LOAD_SECONDS": str(SLOW_START_S + extra)}}})})
              for hold, extra, name in ((0, 0, "0"), (90, 0, "90"), (90, 1, "90b"))},
           "ct129": lab_inventory(tmp, "ct129.yaml", keep=["ct129"], hosts={"ct129": hosts["ct129"]}),
           "stuck": lab_inventory(tmp, "stuck.yaml", keep=["ct129"], hosts={"ct129": dict(
               hosts["ct129"], vars=dict(hosts["ct129"]["vars"], router={"drain_timeout": 2}),
               services={0: {"env": {"LABSERVER_NEVER_DRAINS": "1"}}})})}
    for h in ("h200", "ct129"):
        ssh(lab, h, CLEAN + f"; rm -f {KEY_FILE}; {lab.hosts[h].vars['venv']}/bin/python -m pip uninstall -y -q "
                            "sglang-ddtree", check=False)


def router_url(lab, host):
    return f"http://{lab.hosts[host].address}:{ROUTER_PORT}"


def get(url, key=None, timeout=5):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError as e:
        return None, str(e).encode()


def post(url, body, key=None, timeout=10):
    import urllib.error
    import urllib.request
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def status_json(fab, inv, host):
    r = fab("status", "--json", "--hosts", host, inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def invocation(lab, host, inst="gpu0"):
    return ssh(lab, host, f"systemctl show -p InvocationID --value sglang-ddtree@{inst}").stdout.strip()


def test_router_unit_is_hardened_keyed_and_the_only_endpoint(env, fab):
    lab, inv = env["lab"], env["h200"]
    r = fab("deploy", "--yes", "--hosts", "h200", inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    out = strip_ansi(r.stdout)
    assert "sglang-router (re)started" in out and "gpu0 back in the router" in out, out
    assert KEY not in r.stdout + r.stderr
    sec = ssh(lab, "h200", "systemd-analyze security --no-pager sglang-router.service").stdout
    score = float(re.search(r"Overall exposure level for sglang-router\.service: ([0-9.]+)", sec).group(1))
    print(f"\nsystemd-analyze security sglang-router.service on h200 (API key, listening on the host address): {score}")
    assert score <= 3.0, sec
    user = ssh(lab, "h200", "ps -o user= -p $(systemctl show -p MainPID --value sglang-router)").stdout.split()
    assert user == ["sglang"]
    # the key: in no argv, unit, release file or journal line; the router got it from its credential
    pid = ssh(lab, "h200", "systemctl show -p MainPID --value sglang-router").stdout.strip()
    cmdline = ssh(lab, "h200", f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout
    assert "--api-key-credential sglang-server.yaml" in cmdline and KEY not in cmdline and "--api-key " not in cmdline
    leaks = ssh(lab, "h200", f"grep -rl '{KEY}' /opt/ddtree /etc/systemd/system /proc/{pid}/environ; journalctl "
                             f"--no-pager -u sglang-router -u 'sglang-ddtree@*' | grep -c '{KEY}'", check=False)
    assert leaks.stdout.split() == ["0"], leaks.stdout
    # from this machine: the GPU server is not reachable (loopback only), the router is, and wants the key
    base = router_url(lab, "h200")
    assert get(f"http://{lab.hosts['h200'].address}:30000/health")[0] is None
    # sglang-router's own auth: inference and worker management need the key; its model list does not
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert post(base + "/generate", gen)[0] == 401 and post(base + "/generate", gen, "Kwrongwrongwrongwrong")[0] == 401
    code, body = post(base + "/generate", gen, KEY)
    assert code == 200 and json.loads(body)["text"], body
    assert get(base + "/workers")[0] == 401 and get(base + "/workers", KEY)[0] == 200
    code, body = get(base + "/v1/models")
    assert code == 200 and "qwen3-8b" in body.decode(), body
    listening = ssh(lab, "h200", "ss -ltnH").stdout
    assert re.search(r"127\.0\.0\.1:30000\b", listening) and not re.search(r"(0\.0\.0\.0|\*):30000\b", listening)
    assert re.search(r"127\.0\.0\.1:29000\b", listening), listening  # the router's own /metrics: loopback
    load = loadgen.Load([(base, KEY)], clients=2, total=6, max_new_tokens=8).start()
    load.join()
    assert loadgen.summary(load.results)["failed"] == 0, loadgen.summary(load.results)
    [row] = status_json(fab, inv, "h200")
    assert row["router"] == "in/healthy" and row["health"] == "ok", row


def restart_under_load(lab, fab, inv, host, clients=4, command="restart"):
    """`fab COMMAND` (restart or rollback) of `host` while `clients` stream through its router; (its output, the
    load summary, the longest latency of a completed request)."""
    load = loadgen.Load([(router_url(lab, host), KEY)], clients=clients, total=10000, time_cap=120,
                        max_new_tokens=16).start()
    time.sleep(1.5)
    r = fab(command, "--hosts", host, *(["--yes"] if command == "rollback" else []), inventory=inv)
    time.sleep(1.0)
    load.stop()
    out = strip_ansi(r.stdout)
    assert r.returncode == 0, out + r.stderr
    assert "gpu0 out of the router" in out and "gpu0 back in the router" in out, out
    return out, loadgen.summary(load.results), max((x.latency for x in load.results if x.ok), default=0.0)


def test_a_one_gpu_hosts_restart_under_load_is_held_by_the_router_not_failed(env, fab):
    """h200 has one GPU: while its server restarts (the stand-in told to load for SLOW_START_S) the router has no
    worker. Without a hold (hold_secs: 0) what arrives meanwhile gets a 503; with one, the router holds it and
    hands it to the server once it is back: no request fails, the ones that arrived during the restart wait."""
    lab = env["lab"]
    for hold in (0, 90):
        inv = env[f"h200-hold{hold}"]
        # no load: the router restarts (new arguments); gpu0 too the first time (the stand-in's new load time)
        r = fab("deploy", "--yes", "--hosts", "h200", inventory=inv)
        assert r.returncode == 0, r.stdout + r.stderr
        out = strip_ansi(r.stdout)
        assert "sglang-router (re)started" in out, out
        if hold == 0:  # the plan says before anything changes what clients will see while gpu0 restarts
            [said] = [line for line in out.splitlines() if "while gpu0 restarts no worker serves" in line]
            assert "WARNING" in said and "503" in said and "(0 s, router.hold_secs)" in said, said
        out, s, longest = restart_under_load(lab, fab, inv, "h200")
        print(f"\nfab restart h200 (1 GPU, {SLOW_START_S} s start) under 4 streaming clients, hold_secs {hold}: "
              f"{s}, longest {longest:.1f} s")
        if hold == 0:
            assert s["failed"] > 0 and any("503" in e for e in s["errors"]), s
        else:
            assert s["failed"] == 0 and s["completed"] > 10, s
            assert longest >= SLOW_START_S - 1, (longest, s)  # held through the restart, not refused
    # a new release of gpu0 (its load time changed), the router's arguments the same: the plan says the outage fits
    r = fab("deploy", "--yes", "--hosts", "h200", inventory=env["h200-hold90b"])
    out = strip_ansi(r.stdout)
    assert r.returncode == 0 and "sglang-router (re)started" not in out, out + r.stderr
    [said] = [line for line in out.splitlines() if "while gpu0 restarts no worker serves" in line]
    assert "WARNING" not in said and "holds new requests up to 90 s" in said, said
    # and the rollback to the release before, under load: held, not failed
    out, s, longest = restart_under_load(lab, fab, env["h200-hold90"], "h200", command="rollback")
    print(f"fab rollback h200 (1 GPU) under 4 streaming clients, hold_secs 90: {s}, longest {longest:.1f} s")
    assert s["failed"] == 0 and s["completed"] > 10 and longest >= SLOW_START_S - 1, (longest, s)


def test_status_figures_match_what_the_load_generator_sent(env, fab):
    """Deploy ct129 (2 GPUs) behind its router; fab status --json: the generated-token counters rose by exactly
    what the clients received, and while requests stream, the running requests status shows are the ones open."""
    lab, inv = env["lab"], env["ct129"]
    r = fab("deploy", "--yes", "--hosts", "ct129", inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    before = {row["instance"]: row for row in status_json(fab, inv, "ct129")}
    assert [before[i]["router"] for i in ("gpu0", "gpu1")] == ["in/healthy", "in/healthy"], before
    load = loadgen.Load([(router_url(lab, "ct129"), KEY)], clients=4, total=20, max_new_tokens=24).start()
    load.join()
    s = loadgen.summary(load.results)
    assert s["failed"] == 0 and s["completed"] == 20, s
    after = {row["instance"]: row for row in status_json(fab, inv, "ct129")}
    sent = sum(after[i]["generation_tokens"] - before[i]["generation_tokens"] for i in ("gpu0", "gpu1"))
    assert sent == s["tokens"] == 20 * 24, (sent, s)
    assert all(after[i]["requests_total"] - before[i]["requests_total"] >= 1 for i in ("gpu0", "gpu1"))  # both used
    # in flight: 6 long streams (6 s each); status sees them running, spread by the router over both GPUs
    slow = loadgen.Load([(router_url(lab, "ct129"), KEY)], clients=6, total=6, max_new_tokens=300).start()
    time.sleep(1.0)
    during = status_json(fab, inv, "ct129")
    slow.join()
    assert sum(row["running"] for row in during) == 6, during
    assert all(row["tokens_per_s"] > 0 and row["accept_length"] for row in during), during
    assert loadgen.summary(slow.results)["failed"] == 0


def test_restart_under_load_drains_and_loses_nothing(env, fab):
    lab, inv = env["lab"], env["ct129"]
    load = loadgen.Load([(router_url(lab, "ct129"), KEY)], clients=8, total=10000, time_cap=90,
                        max_new_tokens=40).start()
    time.sleep(1.5)
    r = fab("restart", "--hosts", "ct129", inventory=inv)
    load.stop()
    out = strip_ansi(r.stdout)
    assert r.returncode == 0, out + r.stderr
    s = loadgen.summary(load.results)
    print(f"\nfab restart ct129 (2 GPUs) under 8 streaming clients: {s}")
    assert s["failed"] == 0 and s["completed"] > 20, s
    drained = re.findall(r"gpu(\d) out of the router; drained (\d+) in-flight request\(s\)", out)
    assert [g for g, _n in drained] == ["0", "1"] and any(int(n) > 0 for _g, n in drained), out
    assert out.index("gpu0 back in the router") < out.index("gpu1 out of the router")  # one GPU at a time


def test_a_worker_that_never_drains_is_restarted_at_the_deadline(env, fab):
    lab, inv = env["lab"], env["stuck"]
    r = fab("deploy", "--yes", "--hosts", "ct129", inventory=inv)  # gpu0's env changed: it restarts (drained)
    assert r.returncode == 0, r.stdout + r.stderr
    before = invocation(lab, "ct129")
    t = time.monotonic()
    r = fab("restart", "--hosts", "ct129", "--gpus", "0", inventory=inv)
    took = time.monotonic() - t
    out = strip_ansi(r.stdout)
    assert r.returncode == 0, out + r.stderr
    m = re.search(r"gpu0 out of the router; DRAIN DEADLINE passed after ([0-9.]+)s with 1 request\(s\) still in "
                  r"flight: restarting anyway", out)
    assert m and 2.0 <= float(m.group(1)) < 5.0 and took >= 2.0, out
    assert invocation(lab, "ct129") != before and "gpu0 back in the router" in out
    [row] = [x for x in status_json(fab, inv, "ct129") if x["instance"] == "gpu0"]
    assert row["router"] == "in/healthy" and row["running"] == 1  # the stand-in's stuck request, still counted


def test_a_host_whose_router_is_down_is_refused_unless_no_drain(env, fab):
    lab, inv = env["lab"], env["ct129"]
    ssh(lab, "ct129", "systemctl stop sglang-router")
    try:
        before, before1 = invocation(lab, "ct129"), invocation(lab, "ct129", "gpu1")
        for args in (("restart", "--hosts", "ct129"), ("deploy", "--yes", "--hosts", "ct129", "--mode",
                                                       "shadow-linear")):
            r = fab(*args, inventory=inv)
            out = strip_ansi(r.stdout + r.stderr)
            assert r.returncode == 1 and "REFUSED router: sglang-router.service is down (inactive" in out, out
            assert "--no-drain" in out and invocation(lab, "ct129") == before  # nothing restarted
        r = fab("restart", "--hosts", "ct129", "--gpus", "1", "--no-drain", inventory=inv)
        out = strip_ansi(r.stdout + r.stderr)
        assert r.returncode == 0 and "WARNING --no-drain" in out and "gate ok" in out, out
        assert "gpu1 out of the router" not in out and invocation(lab, "ct129", "gpu1") != before1
    finally:
        ssh(lab, "ct129", "systemctl start sglang-router")
    rows = status_json(fab, inv, "ct129")
    assert {row["router"] for row in rows} == {"in/healthy"}


def test_a_failed_gate_rolls_back_drained_and_a_killed_server_is_dropped_within_5s(env, fab):
    """ct129 with 3 GPUs under load: a release whose gpu1 fails at start is rolled back by the host's agent, every
    restart drained and the failed GPU first back (so two always serve): no request lost. Then gpu2's server is
    SIGKILLed: it costs at most what it was running, and the router lists it unhealthy within 5 s."""
    lab = env["lab"]
    three = lab_inventory(env["tmp"], "three.yaml", keep=["ct129"], hosts={"ct129": {
        "gpus": 3, "vars": {"listen_address": lab.hosts["ct129"].address, "api_key_file": KEY_FILE}}})
    bad = lab_inventory(env["tmp"], "bad.yaml", keep=["ct129"], hosts={"ct129": {
        "gpus": 3, "vars": {"listen_address": lab.hosts["ct129"].address, "api_key_file": KEY_FILE},
        "services": {1: {"env": {"LABSERVER_FAIL_AT_START": "1"}}}}})
    r = fab("deploy", "--yes", "--hosts", "ct129", inventory=three)
    assert r.returncode == 0, r.stdout + r.stderr
    load = loadgen.Load([(router_url(lab, "ct129"), KEY)], clients=8, total=10000, time_cap=120,
                        max_new_tokens=40).start()
    time.sleep(1.5)
    r = fab("deploy", "--yes", "--hosts", "ct129", "--mode", "shadow-linear", inventory=bad)
    load.stop()
    out = strip_ansi(r.stdout)
    s = loadgen.summary(load.results)
    print(f"\nfailed deploy + automatic rollback on ct129 (3 GPUs) under 8 streaming clients: {s}")
    assert r.returncode == 1 and "gpu1 :30001 gate FAILED" in out and "rollback to" in out and " ok in " in out, out
    rb = out[out.index("rolling back to"):]
    # the failed one first (it is out of the router already: nothing to drain), then the serving ones
    assert rb.index("gpu1 not in the router") < rb.index("gpu0 out of the router"), rb
    # gpu0 (changed, ok) and gpu1 (failed) were touched, gpu2 never: two come back
    assert rb.count("back in the router") == 2 and s["failed"] == 0 and s["completed"] > 20, (rb, s)
    # SIGKILL gpu2 under load
    url = "http://127.0.0.1:30002"
    load = loadgen.Load([(router_url(lab, "ct129"), KEY)], clients=8, total=10000, time_cap=60,
                        max_new_tokens=40).start()
    time.sleep(1.5)
    # the in-flight count and the kill in one remote command: read in two, clients started requests between them
    # that the kill then cut (3 failed against a count of 2 in one CI run); what starts in the window is bounded
    # by the requests the clients started while the command ran
    ta = time.monotonic()
    running = ssh(lab, "ct129", f"n=$(python3 -c \"import urllib.request as u; print(u.urlopen('{url}/metrics').read()"
                                ".decode())\" | grep '^sglang:num_running_reqs' | cut -d' ' -f2); "
                                "kill -9 $(systemctl show -p MainPID --value sglang-ddtree@gpu2) && echo $n").stdout
    t0 = time.monotonic()
    out_after = None
    while time.monotonic() - t0 < 10:
        code, body = get(router_url(lab, "ct129") + "/workers", KEY)
        w = {x["url"]: x for x in json.loads(body)["workers"]}.get(url)
        if w is None or not w["is_healthy"]:
            out_after = time.monotonic() - t0
            break
        time.sleep(0.1)
    time.sleep(3)
    load.stop()
    s = loadgen.summary(load.results)
    late = [x for x in load.results if not x.ok and x.start > t0 + 5]
    print(f"SIGKILL ct129 gpu2 under load: it ran {running.strip()} request(s); router dropped it after "
          f"{out_after}s; {s}")
    assert out_after is not None and out_after <= 5.0
    in_window = [x for x in load.results if ta <= x.start <= t0]
    assert s["failed"] <= int(float(running.strip())) + len(in_window) and not late, (s, running, len(in_window))


def test_a_gpu_removed_from_the_inventory_is_drained_out_of_the_running_router(env, fab):
    """ct129 goes from 3 GPU services (the previous test's) to 2 under load: the router is not restarted (its worker
    list is not in its digest), gpu2 is drained out of it and then stopped, nothing is lost."""
    lab, inv = env["lab"], env["ct129"]
    pid = ssh(lab, "ct129", "systemctl show -p MainPID --value sglang-router").stdout.strip()
    load = loadgen.Load([(router_url(lab, "ct129"), KEY)], clients=8, total=10000, time_cap=60,
                        max_new_tokens=40).start()
    time.sleep(1.5)
    r = fab("deploy", "--yes", "--hosts", "ct129", inventory=inv)
    load.stop()
    out = strip_ansi(r.stdout)
    s = loadgen.summary(load.results)
    assert r.returncode == 0 and "stop: gpu2" in out, out
    assert re.search(r"gpu2 out of the router; drained \d+ in-flight", out) and "sglang-router (re)started" not in out
    assert out.index("gpu2 out of the router") < out.index("stopped gpu2")
    assert s["failed"] == 0 and s["completed"] > 10, s
    assert ssh(lab, "ct129", "systemctl show -p MainPID --value sglang-router").stdout.strip() == pid
    code, body = get(router_url(lab, "ct129") + "/workers", KEY)
    assert sorted(w["url"] for w in json.loads(body)["workers"]) == ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
