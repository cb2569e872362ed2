"""What a hostile but realistic operator found on the lab (issue 26, findings 4-7), one test each, on real hosts:

4. the deploy plan refuses what the host's facts show cannot work -- a GPU index the host lacks, a port sshd or
   another service listens on, a model path that is no model directory -- at the value's file:line, before anything
   changes; the toolkit's own services on their ports are not refused, and restart and rollback still run;
5. cached facts dated in the future are gathered again;
6. a full disk under the releases names the path it failed on, and leaves nothing half-written;
7. the lab state the tests assert comes back after the product's own commands changed it (`fab provision ct200`).
"""
from __future__ import annotations

import json
import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from labstate import as_built

from helpers import CLEAN, lab_inventory, ssh

pytestmark = pytest.mark.lab
HOST = "h200"   # one GPU (nvidia-smi replays a real H200's output)
# What a refused deploy must leave as it was: the lock, the releases, `current`, units, the plugin.
SNAPSHOT = ("test -e /var/lib/ddtree/lock.json && echo LOCKED; ls -1A /opt/ddtree/releases 2>&1; "
            "readlink /opt/ddtree/releases/current; systemctl show -p Id,InvocationID,ActiveState 'sglang-ddtree@*'; "
            "ls /opt/sglang/venv/lib/python3.11/site-packages | md5sum")


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostileplan")
    as_built(lab, [HOST])
    yield {"lab": lab, "tmp": tmp}
    ssh(lab, HOST, "systemctl stop hostile-other 2>/dev/null; umount /opt/ddtree/releases 2>/dev/null; true",
        check=False)
    as_built(lab, [HOST])


def refused(out: str) -> list[str]:
    return [ln.split(" REFUSED ", 1)[1] for ln in out.splitlines() if ln.startswith(f"[{HOST}] REFUSED ")]


def at_line(inv: Path, msg: str, key: str) -> str:
    """The file line a refusal names (`inv:N: key: ...`), after checking it names this file and key."""
    m = re.match(rf"{re.escape(str(inv))}:(\d+): {re.escape(key)}: ", msg)
    assert m, (msg, key)
    return inv.read_text().splitlines()[int(m.group(1)) - 1].strip()


def test_plan_refuses_a_gpu_the_host_lacks_a_port_in_use_and_a_path_that_is_no_model(env, fab):
    """Finding 4: `gpus: [0, 5]` on a one-GPU host deployed (gpu5 "deploy ok"), `model: /etc` deployed, a GPU or the
    router on port 22 failed only at activation (BadStatusLine: SSH-2.0-OpenSSH...). Now each is refused at the plan,
    naming the file:line of its value, and the host is left as it was."""
    lab, tmp = env["lab"], env["tmp"]
    before = ssh(lab, HOST, SNAPSHOT, check=False).stdout
    assert "LOCKED" not in before

    inv = lab_inventory(tmp, "bad.yaml", keep=[HOST], hosts={HOST: {"gpus": [0, 5], "services": {
        0: {"port": 22}, 5: {"model": "/etc"}}}})
    r = fab("deploy", "--yes", "--hosts", HOST, "--mode", "shadow-linear", inventory=inv)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "deploy: 0/1 hosts ok" in r.stderr, out
    got = refused(r.stdout)
    gpu = next(x for x in got if "has no GPU" in x)
    assert gpu.endswith(": gpu5: h200 has no GPU 5 (nvidia-smi lists GPU 0)")
    assert at_line(inv, gpu, "hosts.h200.gpus") == "- 5"
    port = next(x for x in got if "port 22" in x)
    assert "port 22 (gpu0, on 127.0.0.1) is in use on h200 by sshd, the host SSH server (pid " in port
    assert at_line(inv, port, "hosts.h200.services.0.port") == "port: 22"
    model = next(x for x in got if "/etc" in x)
    assert model.endswith(": /etc: not a model directory (no config.json) (gpu5)")
    assert at_line(inv, model, "hosts.h200.services.5.model") == "model: /etc"
    assert len(got) == 3, got
    assert ssh(lab, HOST, SNAPSHOT, check=False).stdout == before          # no lock, nothing staged or started

    # the router on sshd's port, and a GPU on the port another service of the host listens on
    ssh(lab, HOST, "systemd-run --unit hostile-other -p DynamicUser=yes /usr/bin/python3 -m http.server 30000 "
                   "--bind 127.0.0.1 && for i in $(seq 50); do ss -ltn | grep -q 127.0.0.1:30000 && break; "
                   "sleep 0.1; done")
    try:
        inv = lab_inventory(tmp, "ports.yaml", keep=[HOST], hosts={HOST: {"vars": {"router": {"port": 22}}}})
        r = fab("deploy", "--yes", "--hosts", HOST, "--mode", "shadow-linear", inventory=inv)
        assert r.returncode == 1, r.stdout + r.stderr
        got = refused(r.stdout)
        router = next(x for x in got if "port 22" in x)
        assert "port 22 (the router, on 127.0.0.1) is in use on h200 by sshd, the host SSH server" in router
        assert at_line(inv, router, "hosts.h200.vars.router.port") == "port: 22"
        other = next(x for x in got if "port 30000" in x)
        assert re.search(r"port 30000 \(gpu0, on 127\.0\.0\.1\) is in use on h200 by python3 \(pid \d+, "
                         r"hostile-other\.service, on 127\.0\.0\.1\)$", other), other
        assert at_line(inv, other, "vars.base_port + 0") == "base_port: 30000"
        assert len(got) == 2, got
        assert ssh(lab, HOST, SNAPSHOT, check=False).stdout == before
    finally:
        ssh(lab, HOST, "systemctl stop hostile-other", check=False)

    # what fits deploys; a second deploy finds the toolkit's own services on their ports and is not refused by
    # them; restart and rollback (whose probes ask for none of these checks) still run
    inv = lab_inventory(tmp, "good.yaml", keep=[HOST])
    for mode in ("shadow-linear", "tree-verify"):
        r = fab("deploy", "--yes", "--hosts", HOST, "--mode", mode, inventory=inv)
        assert r.returncode == 0 and "REFUSED" not in r.stdout and "gate ok" in r.stdout, r.stdout + r.stderr
    for cmd in (["restart", "--yes"], ["rollback", "--yes"]):
        r = fab(*cmd, "--hosts", HOST, inventory=inv)
        assert r.returncode == 0 and "REFUSED" not in r.stdout and "gate ok" in r.stdout, r.stdout + r.stderr
    ssh(lab, HOST, CLEAN)


def test_cached_facts_dated_in_the_future_are_gathered_again(env, fab):
    """Finding 5: with h200's cached facts dated two days ahead and its SGLang since drifted, `fab inventory`
    showed the old version as ok, exit 0. Now such facts are stale: gathered again, drift seen, exit 3."""
    lab, tmp = env["lab"], env["tmp"]
    inv = lab_inventory(tmp, "facts.yaml", keep=[HOST])
    r = fab("inventory", "--json", "--refresh", "--hosts", HOST, inventory=inv)
    assert r.returncode == 0 and json.loads(r.stdout)["hosts"][HOST]["packages"]["sglang"] == "0.5.17", r.stderr
    cache = tmp / "facts" / f"{HOST}.json"
    facts = json.loads(cache.read_text())
    ahead = datetime.now(timezone.utc) + timedelta(days=2)
    cache.write_text(json.dumps(dict(facts, gathered_at=ahead.isoformat(timespec="seconds"))))
    assert fab("lab.drift", HOST, "sglang-0.5.16").returncode == 0
    try:
        r = fab("inventory", "--json", "--hosts", HOST, inventory=inv)
        doc = json.loads(r.stdout)
        assert doc["hosts"][HOST]["packages"]["sglang"] == "0.5.16", doc["hosts"][HOST]["gathered_at"]
        assert r.returncode == 3 and HOST in doc["incoherent"]
        assert datetime.fromisoformat(doc["hosts"][HOST]["gathered_at"]) <= datetime.now(timezone.utc)
    finally:
        assert fab("lab.drift", HOST, "coherent").returncode == 0


def test_a_full_disk_under_the_releases_names_the_path_and_leaves_nothing_half_written(env, fab):
    """Finding 6: a full disk said `OSError: [Errno 28] No space left on device` and nothing else. Now the error names
    the file it failed on and the free space there; nothing is half-written, no lock is left."""
    lab, tmp = env["lab"], env["tmp"]
    ssh(lab, HOST, CLEAN + "; mkdir -p /opt/ddtree/releases && "
                           "mount -t tmpfs -o size=64k,mode=0755 tmpfs /opt/ddtree/releases")
    try:
        inv = lab_inventory(tmp, "disk.yaml", keep=[HOST])
        r = fab("deploy", "--yes", "--hosts", HOST, "--mode", "shadow-linear", inventory=inv)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        m = re.search(r"OSError: \[Errno 28\] No space left on device: '(/opt/ddtree/releases/\.incoming-[^']+)' "
                      r"\([\d.]+ (B|KiB) free on the file system of /opt/ddtree/releases\)", out)
        assert m, out
        left = ssh(lab, HOST, "ls -1A /opt/ddtree/releases; test -e /var/lib/ddtree/lock.json && echo LOCKED; "
                              "systemctl is-active 'sglang-ddtree@gpu0' || true").stdout.split()
        assert left == ["inactive"], left                                  # no staging dir, no lock, nothing started
    finally:
        ssh(lab, HOST, "umount /opt/ddtree/releases", check=False)
        ssh(lab, HOST, CLEAN, check=False)


def test_the_lab_state_tests_assert_comes_back_after_provision_changed_it(env, fab):
    """Finding 7: after `fab provision ct200` (the product's main job: ct129's torch +cu130 onto ct200) the README's
    test command failed 6 tests that assert the lab as built (ct200's +cu128 drift). `fab lab.drift HOST coherent`
    (what the tests' lab_as_built fixture runs) now puts every lab-built distribution back."""
    lab = env["lab"]
    r = fab("provision", "ct200", "--yes", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(fab("inventory", "--json", "--refresh", "--hosts", "ct129,ct200").stdout)
    assert doc["hosts"]["ct200"]["torch"]["version"] == "2.11.0+cu130"      # provision did its job
    t = time.monotonic()
    as_built(lab, ["ct200"])
    took = time.monotonic() - t
    r = fab("inventory", "--json", "--refresh", "--hosts", "ct129,ct200")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["incoherent"] == {}, r.stdout
    assert doc["hosts"]["ct200"]["torch"]["version"] == "2.11.0+cu128", took
    assert doc["hosts"]["ct129"]["torch"]["version"] == "2.11.0+cu130"
    assert {x["host"]: x["drift"] for x in json.loads(fab("lab.status", "--json").stdout)}["ct200"] == "coherent"
