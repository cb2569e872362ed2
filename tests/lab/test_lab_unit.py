"""The hardened GPU unit on a real lab host (systemd 252 in systemd-nspawn, real sshd, the named SGLang stand-in):
its `systemd-analyze security` score as deployed, its own-GPU device ACL, the listen address, the API key through
a systemd credential, the secrets-file checks, and two faults -- a newline in an inventory value and markup in a
host's strings -- each ending with what was lost: nothing.

Not testable here, and said so: the lab's cgroups are v1 with the devices controller read-only inside the
containers, so systemd cannot enforce DevicePolicy/DeviceAllow or IPAddressDeny there (it loads them, scores them,
and `systemctl show` lists them; enforcement needs a GPU host). Order matters: each test starts from the state
the previous one left, which it asserts first.
"""
from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from helpers import agent_call, lab_inventory, ssh, strip_ansi

pytestmark = pytest.mark.lab
HOST = "h200"
KEY = "Kx9fTq2LmZ7wP4sR8vB1nY6hLabOnly"
KEY_FILE = "/etc/ddtree/api-key.yaml"
LOCK = "/var/lib/ddtree/lock.json"  # the host lock, in the agent's private state directory
CLEAN = ("systemctl stop 'sglang-ddtree@*' sglang-router 2>/dev/null; "
         "systemctl reset-failed 'sglang-ddtree@*' sglang-router 2>/dev/null; "
         "rm -f /etc/systemd/system/sglang-router.service /etc/systemd/system/multi-user.target.wants/sglang-router*; "
         "rm -rf /opt/ddtree /etc/systemd/system/sglang-ddtree@.service /etc/systemd/system/sglang-ddtree@*.service.d "
         f"/etc/systemd/system/multi-user.target.wants/sglang-ddtree@* {KEY_FILE} /tmp/pwned; "
         "systemctl daemon-reload")


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labunit")
    ssh(lab, HOST, CLEAN)
    address = lab.hosts[HOST].address
    yield {"tmp": tmp, "lab": lab, "inv": lab_inventory(tmp, keep=[HOST]),
           # the GPU server itself on the host's address (no router in front: tests/lab/test_lab_router.py
           # covers the router's own unit, key and endpoint)
           "keyed": lab_inventory(tmp, "keyed.yaml", keep=[HOST], hosts={HOST: {"vars": {
               "listen_address": address, "api_key_file": KEY_FILE, "router": {"enabled": False}}}}),
           "address": address}
    ssh(lab, HOST, CLEAN + f"; {lab.hosts[HOST].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
        check=False)


def exposure(lab) -> tuple[float, str]:
    out = ssh(lab, HOST, "systemd-analyze security --no-pager sglang-ddtree@gpu0.service").stdout
    m = re.search(r"Overall exposure level for sglang-ddtree@gpu0\.service: ([0-9.]+) (\w+)", out)
    assert m, out
    return float(m.group(1)), out


def show(lab, *props) -> dict[str, list[str]]:
    out = ssh(lab, HOST, f"systemctl show -p {','.join(props)} sglang-ddtree@gpu0.service").stdout
    d: dict[str, list[str]] = {}
    for line in out.splitlines():
        k, _, v = line.partition("=")
        d.setdefault(k, []).append(v)
    return d


def snapshot(lab) -> dict:
    """What a refused command must leave exactly as it was on the host."""
    cmd = ("readlink /opt/ddtree/releases/current; sha256sum /etc/systemd/system/sglang-ddtree@.service "
           "/etc/systemd/system/sglang-ddtree@gpu0.service.d/*.conf /opt/ddtree/releases/current/env/*.env; "
           f"wc -l < /opt/ddtree/journal.jsonl; ls /opt/ddtree/releases; test -e {LOCK} && echo LOCKED; "
           "systemctl show -p InvocationID,ActiveState,NRestarts sglang-ddtree@gpu0; test -e /tmp/pwned && echo PWNED; true")
    return {"state": ssh(lab, HOST, cmd).stdout}


def healthy(fab, inv) -> dict:
    r = fab("status", "--json", "--hosts", HOST, inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    [row] = json.loads(r.stdout)
    assert row["state"] == "active/running" and row["health"] == "ok", row
    return row


def test_deployed_unit_scores_at_most_3_and_allows_only_its_own_gpu(env, fab):
    lab = env["lab"]
    r = fab("deploy", "--yes", "--hosts", HOST, inventory=env["inv"])
    assert r.returncode == 0 and "gate ok" in r.stdout, r.stdout + r.stderr
    score, out = exposure(lab)
    print(f"\nsystemd-analyze security sglang-ddtree@gpu0.service on {HOST} (loopback, no key): {score}")
    assert score <= 3.0, out
    for directive in ("CapabilityBoundingSet=~CAP_SYS_ADMIN", "ProtectKernelLogs=", "ProtectProc=", "UMask=",
                      "SystemCallFilter=~@privileged", "NoNewPrivileges=", "RestrictAddressFamilies=~AF_PACKET"):
        lines = [ln for ln in out.splitlines() if directive in ln]
        assert lines and not any(ln.lstrip().startswith("✗") for ln in lines), (directive, lines)
    props = show(lab, "DevicePolicy", "DeviceAllow", "IPAddressDeny", "IPAddressAllow", "User", "UMask",
                 "CapabilityBoundingSet", "ProtectProc", "DropInPaths")
    assert props["DevicePolicy"] == ["closed"] and props["User"] == ["sglang"] and props["UMask"] == ["0077"]
    allowed = set(props["DeviceAllow"])
    assert {"/dev/nvidia0 rw", "/dev/nvidiactl rw", "/dev/nvidia-uvm rw"} <= allowed
    assert not [d for d in allowed if re.fullmatch(r"/dev/nvidia[1-9]\d* rw", d)]  # no other GPU
    assert props["CapabilityBoundingSet"] == [""] and props["ProtectProc"] == ["invisible"]
    assert [sorted(v.split()) for v in props["IPAddressDeny"]] == [["0.0.0.0/0", "::/0"]]  # systemd prints either order
    assert props["DropInPaths"] == ["/etc/systemd/system/sglang-ddtree@gpu0.service.d/50-ddtree-gpu.conf"]
    v = ssh(lab, HOST, "systemd-analyze verify --man=no sglang-ddtree@gpu0.service", check=False)
    assert v.returncode == 0 and not v.stderr.strip(), v.stderr
    # listens on loopback only: reachable on the host, refused from the next host
    listen = ssh(lab, HOST, "ss -Hltn 'sport = :30000'").stdout
    assert "127.0.0.1:30000" in listen and env["address"] not in listen, listen
    probe = (f"python3 -c \"import socket; socket.create_connection(('{env['address']}', 30000), timeout=3)\"")
    assert ssh(lab, "ct129", probe, check=False).returncode != 0
    healthy(fab, env["inv"])


def test_newline_in_an_inventory_value_is_refused_before_anything_runs(env, fab):
    """Fault (issue 9, item 7), on a host serving the previous test's release:

    | done | seen | lost |
    | `fab deploy` / `fab status` with release_root or venv = "/opt/ddtree/releases\\nExecStartPre=+/bin/sh -c
      'touch /tmp/pwned'\\nUser=root", or service_user "root\\n" | exit 2, `file:line: vars.<key>: ...` on stderr,
      no SSH connection | nothing: same release, unit, drop-in, env file, journal, lock, service process; no
      /tmp/pwned |
    """
    lab = env["lab"]
    before = snapshot(lab)
    assert "ActiveState=active" in before["state"] and "PWNED" not in before["state"] \
        and "LOCKED" not in before["state"]
    payload = "/opt/ddtree/releases\nExecStartPre=+/bin/sh -c 'touch /tmp/pwned'\nUser=root"
    for key, value in (("release_root", payload), ("venv", payload), ("service_user", "root\n"),
                       ("model", "/models/Qwen3-8B\nUser=root")):
        doc = yaml.safe_load(env["inv"].read_text())
        doc["vars"][key] = value
        bad = env["tmp"] / f"bad-{key}.yaml"
        bad.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000))
        line = next(i for i, ln in enumerate(bad.read_text().splitlines(), 1) if ln.startswith(f"  {key}:"))
        for args in (("deploy", "--yes", "--hosts", HOST), ("status", "--hosts", HOST)):
            t = time.monotonic()
            r = fab(*args, inventory=bad)
            assert r.returncode == 2, (key, args, r.stdout, r.stderr)
            assert f"{bad}:{line}: vars.{key}: must be" in r.stderr, r.stderr
            assert r.stdout == "" and "[local] built" not in r.stderr  # refused before building or connecting
            assert time.monotonic() - t < 30
    assert snapshot(lab) == before
    healthy(fab, env["inv"])


def test_markup_in_a_hosts_strings_is_printed_verbatim(env, fab):
    """Fault: a lock file whose holder is `[/red][green]alice` (a host string). `fab status` prints it as is
    and does not crash (before: rich.errors.MarkupError); nothing changes on the host."""
    lab = env["lab"]
    holder = "[/red][green]alice[/green]@[bold]laptop"
    lock = json.dumps({"holder": holder, "command": "fab deploy [/]", "pid": 1, "token": "x", "started": "[red]then"})
    ssh(lab, HOST, f"(umask 077; printf %s '{lock}' > {LOCK})")
    try:
        r = fab("status", "--hosts", HOST, inventory=env["inv"])
        out = strip_ansi(r.stdout)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "MarkupError" not in r.stderr, r.stderr
        for piece in ("[/red][green]alice", "[bold]laptop", "[/],", "[red]then)"):  # the cell may wrap at spaces
            assert piece in out, (piece, out)
        r = fab("status", "--json", "--hosts", HOST, inventory=env["inv"])
        assert holder in json.loads(r.stdout)[0]["lock"]
    finally:
        ssh(lab, HOST, f"rm -f {LOCK}")
    healthy(fab, env["inv"])


def test_api_key_from_a_root_only_file_through_a_credential(env, fab):
    lab = env["lab"]
    ssh(lab, HOST, f"install -d -m 0755 /etc/ddtree && (umask 077; printf 'api-key: {KEY}\\n' > {KEY_FILE})")
    r = fab("deploy", "--yes", "--hosts", HOST, inventory=env["keyed"])
    assert r.returncode == 0 and "gate ok" in r.stdout, r.stdout + r.stderr  # the gate sent the key
    assert KEY not in r.stdout + r.stderr
    row = healthy(fab, env["keyed"])  # status reaches it on its own address
    score, out = exposure(lab)
    print(f"\nsystemd-analyze security sglang-ddtree@gpu0.service on {HOST} ({env['address']}, API key): {score}")
    assert score <= 3.0, out
    # from another host: /health open (as SGLang), everything else 401 without the key, 200 with it
    check = ("python3 - <<'EOF'\nimport urllib.request, urllib.error\n"
             "def get(p, h):\n    try:\n        return urllib.request.urlopen(urllib.request.Request("
             f"'http://{env['address']}:30000' + p, headers=h), timeout=5).status\n"
             "    except urllib.error.HTTPError as e:\n        return e.code\n"
             f"print(get('/health', {{}}), get('/v1/models', {{}}), get('/v1/models', "
             f"{{'Authorization': 'Bearer {KEY}'}}), get('/server_info', {{'Authorization': 'Bearer nope'}}))\nEOF")
    assert ssh(lab, "ct129", check).stdout.split() == ["200", "401", "200", "401"]
    # the key is in no argv, unit, env file, release, journal; the service reads its private copy
    pid = ssh(lab, HOST, "systemctl show -p MainPID --value sglang-ddtree@gpu0").stdout.strip()
    cmdline = ssh(lab, HOST, f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout
    assert "--config /run/credentials/sglang-ddtree@gpu0.service/sglang-server.yaml" in cmdline and KEY not in cmdline
    leaks = ssh(lab, HOST, f"grep -rl '{KEY}' /opt/ddtree /etc/systemd/system /proc/{pid}/environ; "
                           f"journalctl --no-pager -u 'sglang-ddtree@*' | grep -c '{KEY}'", check=False).stdout.split()
    assert leaks == ["0"], leaks
    # the stand-in logs its resolved arguments, key included, as SGLang does: the release's redactor masked it
    started = ssh(lab, HOST, "journalctl --no-pager -u sglang-ddtree@gpu0 | grep 'server_args=' | tail -1").stdout
    assert "'api_key': '<redacted>'" in started, started
    cred = ssh(lab, HOST, "stat -c '%a %U' /run/credentials/sglang-ddtree@gpu0.service/sglang-server.yaml").stdout
    assert cred.split() == ["400", "sglang"]
    assert row["release"]


def test_an_unsafe_secrets_file_stops_a_restart_before_anything_stops(env, fab):
    """Fault: the key file made world-readable (0644). `fab restart` and `fab deploy` refuse at their plan (the
    probe judged the file as the unit's ExecStartPre does), and the host's agent refuses a restart it is sent
    anyway (a file changed between plan and apply) before anything stops: the service keeps serving the same
    process. systemd itself refuses to start the unit (ExecStartPre); back to 0600: fine."""
    from deploy.inventory import load_inventory
    from deploy.release import payload
    from deploy.release.layout import host_args
    from deploy.remote.client import lock_holder
    lab = env["lab"]
    before = show(lab, "InvocationID")["InvocationID"]
    journal_before = ssh(lab, HOST, "wc -l < /opt/ddtree/journal.jsonl").stdout
    ssh(lab, HOST, f"chmod 0644 {KEY_FILE}")
    try:
        for args in (("restart", "--hosts", HOST), ("deploy", "--yes", "--hosts", HOST, "--mode", "shadow-linear")):
            r = fab(*args, inventory=env["keyed"])
            assert r.returncode != 0 and f"REFUSED API key file: {KEY_FILE}: has mode 0644" in r.stdout, r.stdout
            assert KEY not in r.stdout + r.stderr
        assert show(lab, "InvocationID")["InvocationID"] == before  # nothing was restarted
        assert ssh(lab, HOST, "wc -l < /opt/ddtree/journal.jsonl").stdout == journal_before  # nor applied
        # the agent's own check, past the plan: the restart payload sent as is
        inv = load_inventory(str(env["keyed"]))
        host = inv.hosts[HOST]
        state = agent_call(inv, HOST, "release.probe", host_args(host) | {"instances": ["gpu0"]})
        assert state["api_keys"][KEY_FILE].startswith(f"{KEY_FILE}: has mode 0644")
        res = agent_call(inv, HOST, "release.apply", payload.restart_payload(host, state, None),
                         lock=dict(lock_holder("pytest"), mode="once"), deadline=120)
        assert not res["ok"] and res["kind"] == "secrets" and "has mode 0644" in res["error"], res
        assert res["restarted"] == [] and KEY not in json.dumps(res)
        assert show(lab, "InvocationID")["InvocationID"] == before
        healthy(fab, env["keyed"])
        r = ssh(lab, HOST, "systemctl restart sglang-ddtree@gpu0", check=False)  # behind the tool's back
        assert r.returncode != 0
        log = ssh(lab, HOST, "journalctl --no-pager -n 30 -u sglang-ddtree@gpu0").stdout
        assert f"refusing to start: {KEY_FILE}: has mode 0644" in log and KEY not in log, log
    finally:
        ssh(lab, HOST, f"chmod 0600 {KEY_FILE}")
    r = fab("restart", "--hosts", HOST, inventory=env["keyed"])
    assert r.returncode == 0 and "gate ok" in r.stdout, r.stdout + r.stderr
    healthy(fab, env["keyed"])
