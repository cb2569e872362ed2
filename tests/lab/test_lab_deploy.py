"""`fab deploy/rollback/status/logs/restart` on the lab: real systemd-nspawn hosts, real sshd and systemd,
real pip into the managed venv; the service is the named lab stand-in (deploy/labserver).

Order matters inside this module (it walks one fleet through a day of deploys); every test starts from
the state the previous one left, which each asserts first.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.remote.client import Remote
from deploy.ssh import open_checked

from helpers import CLEAN, lab_inventory, ssh, strip_ansi, write_model

pytestmark = pytest.mark.lab
ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["ct129", "ct200", "h200"]
HYBRID = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
          "layer_types": ["linear_attention"] * 3 + ["full_attention"]}


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory):
    """A clean slate on the three named lab hosts, and inventories derived from inventory/lab.yaml."""
    tmp = tmp_path_factory.mktemp("labdeploy")
    for h in HOSTS:
        ssh(lab, h, CLEAN)
        # /models/Qwen3-8B and its DFlash drafter come with every lab host (deploy/lab/fleet.py LAB_MODELS)
        write_model(lab, h, "/models/Qwen3-Next-80B", HYBRID)
    yield {"tmp": tmp, "lab": lab, "inv": lab_inventory(tmp, keep=HOSTS)}
    for h in HOSTS:  # the lab is shared with other tests: leave no services, releases or plugin behind
        ssh(lab, h, CLEAN + f"; {lab.hosts[h].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
            check=False)


def status_rows(fab, inventory, hosts=None) -> list[dict]:
    r = fab("status", "--json", *(["--hosts", hosts] if hosts else []), inventory=inventory)
    rows = json.loads(r.stdout)
    healthy = all(x.get("health") == "ok" for x in rows)
    assert r.returncode == (0 if healthy else 1), r.stdout + r.stderr  # non-zero exit when anything is down
    return rows


def invocations(lab, host) -> dict[str, str]:
    out = ssh(lab, host, "systemctl show -p Id,InvocationID 'sglang-ddtree@*'").stdout
    ids, cur = {}, None
    for line in out.splitlines():
        if line.startswith("Id="):
            cur = line[3:]
        elif line.startswith("InvocationID=") and cur:
            ids[cur] = line.split("=", 1)[1]
    return ids


def test_deploy_tree_verify_brings_the_lab_up_and_redeploy_restarts_nothing(env, fab):
    t = time.monotonic()
    r = fab("deploy", "--mode", "tree-verify", "--yes", inventory=env["inv"])
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("gate ok") == 17, out
    assert "deploy: 3/3 hosts ok" in out
    rows = status_rows(fab, env["inv"])
    assert len(rows) == 17
    for row in rows:
        assert row["state"] == "active/running" and row["health"] == "ok", row
        assert row["mode"] == "tree-verify" and row["algorithm"] == "DDTREE" and not row["unsafe"]
        assert row["release"] and row["running_release"] == row["release"] and row["lock"] is None
        assert row["last_deploy"].startswith("deploy ")
    assert {r["port"] for r in rows if r["host"] == "ct129"} == set(range(30000, 30008))
    # the table too
    table = strip_ansi(fab("status", "--hosts", "h200", inventory=env["inv"]).stdout)
    assert "h200" in table and "tree-verify" in table and "active/running" in table
    # on a 100-column terminal: one line per GPU, none over 100 characters; the release and the last deploy of
    # each host in words under the table; every field in the wide view
    r = fab("status", inventory=env["inv"], env={"COLUMNS": "100"})
    lines = strip_ansi(r.stdout).splitlines()
    assert r.returncode == 0 and max(map(len, lines)) <= 100, "\n".join(ln for ln in lines if len(ln) > 100)
    gpu_lines = [ln.split() for ln in lines if ln.split()[:1] and ln.split()[0] in HOSTS]
    assert sorted((w[0], int(w[1])) for w in gpu_lines) == sorted((x["host"], x["gpu"]) for x in rows)
    assert all("active/running" in w and "tree-verify" in w for w in gpu_lines), gpu_lines
    for h in HOSTS:
        said = next(ln for ln in lines if ln.startswith(f"{h}: "))
        assert f"release {rows[-1]['release']}" in said and "last deploy " in said, said
    wide = strip_ansi(fab("status", "--wide", "--hosts", "h200", inventory=env["inv"], env={"COLUMNS": "100"}).stdout)
    h200 = next(x for x in rows if x["host"] == "h200")
    assert "last deploy" in wide and str(h200["port"]) in wide and h200["release"] in wide
    # the installed unit verifies on a real host, where every path exists
    v = ssh(env["lab"], "h200", "systemd-analyze verify --man=no sglang-ddtree@gpu0.service", check=False)
    assert v.returncode == 0 and not v.stderr.strip(), v.stderr
    # runs as the non-root service user, plugin wheel installed with the release id in its version
    who = ssh(env["lab"], "h200", "ps -o user= -p $(systemctl show -p MainPID --value sglang-ddtree@gpu0)").stdout
    assert who.strip() == "sglang"
    rel = rows[-1]["release"]
    assert rows[-1]["plugin"].endswith("+" + "r" + rel.lower().replace("-", "."))
    # idempotent: a second deploy restarts nothing
    before = {h: invocations(env["lab"], h) for h in HOSTS}
    r = fab("deploy", "--mode", "tree-verify", "--yes", inventory=env["inv"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("nothing restarted") == 3 and "gate" not in r.stdout
    assert {h: invocations(env["lab"], h) for h in HOSTS} == before
    print(f"\nfirst deploy + redeploy of 17 services: {time.monotonic() - t:.1f}s")


def test_failing_gate_rolls_back_automatically(env, fab):
    lab = env["lab"]
    good = {r["host"]: r["release"] for r in status_rows(fab, env["inv"])}
    before = invocations(lab, "ct129")
    bad = lab_inventory(env["tmp"], "bad.yaml", keep=HOSTS, hosts={
        "ct129": {"services": {2: {"env": {"LABSERVER_WRONG_ALGORITHM": "EAGLE"}}}},
        "h200": {"services": {0: {"env": {"LABSERVER_FAIL_AT_START": "1"}}}}})
    r = fab("deploy", "--yes", "--hosts", "ct129,h200", inventory=bad)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "gpu2 :30002 gate FAILED at server_info: speculative_algorithm is 'EAGLE'" in out
    assert "gpu0 :30000 gate FAILED at start" in out
    assert out.count("rolled back to") == 2 and "deploy: 0/2 hosts ok" in out
    rows = status_rows(fab, env["inv"], "ct129,h200")
    for row in rows:  # the previous release serves again everywhere
        assert row["release"] == good[row["host"]] and row["health"] == "ok", row
        assert row["last_deploy"].startswith("deploy-failed") and "(rolled back)" in row["last_deploy"]
    after = invocations(lab, "ct129")
    changed = {u for u in before if before[u] != after[u]}
    assert changed == {"sglang-ddtree@gpu2.service"}  # only the GPU that changed was touched
    j = ssh(lab, "h200", "tail -n 1 /opt/ddtree/journal.jsonl").stdout
    assert json.loads(j)["event"] == "deploy-failed" and json.loads(j)["rollback_ok"] is True


def test_max_fail_stops_starting_new_hosts(env, fab):
    import yaml
    bad = lab_inventory(env["tmp"], "maxfail.yaml", keep=HOSTS, hosts={
        "ct200": {"services": {0: {"env": {"LABSERVER_WRONG_ALGORITHM": "EAGLE"}}}},
        "h200": {"services": {0: {"env": {"LABSERVER_WRONG_ALGORITHM": "EAGLE"}}}}})
    doc = yaml.safe_load(bad.read_text())
    doc["settings"]["parallel"] = 1  # hosts one after another, so the second sees the first's failure
    bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = fab("deploy", "--yes", "--hosts", "ct200,h200", "--max-fail", "1", inventory=bad)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "rolled back to" in out, out
    assert "h200: skipped: --max-fail 1 reached" in out, out
    assert "[h200] release" not in out  # nothing was staged on the skipped host
    assert status_rows(fab, env["inv"], "h200")[0]["lock"] is None  # and its lock was released


def test_rollback_restores_the_previous_release(env, fab):
    first = {r["host"]: r["release"] for r in status_rows(fab, env["inv"], "h200")}["h200"]
    r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "shadow-linear", inventory=env["inv"])
    assert r.returncode == 0, r.stdout + r.stderr
    [row] = status_rows(fab, env["inv"], "h200")
    assert row["mode"] == "shadow-linear" and row["release"] != first
    t = time.monotonic()
    r = fab("rollback", "--hosts", "h200", inventory=env["inv"])
    took = time.monotonic() - t
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"-> {first}" in r.stdout and "gate ok" in r.stdout
    [row] = status_rows(fab, env["inv"], "h200")
    assert row["release"] == first and row["mode"] == "tree-verify" and row["health"] == "ok"
    assert row["last_deploy"].startswith(f"rollback {first}")
    print(f"\nfab rollback (h200, 1 GPU, wall incl. CLI start): {took:.1f}s")
    # --to a release that is not there names the ones that are
    r = fab("rollback", "--hosts", "h200", "--to", "19990101T000000Z-000000", inventory=env["inv"])
    assert r.returncode != 0 and "is not on h200 (kept:" in r.stderr


def test_concurrent_deploy_is_refused_by_the_lock(env, fab):
    slow = lab_inventory(env["tmp"], "slow.yaml", keep=HOSTS,
                         hosts={"h200": {"services": {0: {"env": {"LABSERVER_LOAD_SECONDS": "4"}}}}})
    import os
    import sys
    e = dict(os.environ, DEPLOY_INVENTORY=str(slow))
    first = subprocess.Popen([str(Path(sys.executable).with_name("fab")), "deploy", "--yes", "--hosts", "h200"],
                             cwd=ROOT, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(100):
            if ssh(env["lab"], "h200", "test -f /var/lib/ddtree/lock.json", check=False).returncode == 0:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the first deploy never took the lock")
        r = fab("deploy", "--yes", "--hosts", "h200", inventory=env["inv"])
        assert r.returncode != 0
        assert "locked by" in r.stderr and "running 'fab deploy --yes --hosts h200'" in r.stderr, r.stderr
        rows = status_rows(fab, env["inv"], "h200")
        assert rows[0]["lock"] and "fab deploy" in rows[0]["lock"]
    finally:
        out = first.communicate(timeout=120)[0]
    assert first.returncode == 0, out
    assert status_rows(fab, env["inv"], "h200")[0]["lock"] is None


def test_stale_lock_and_break_lock(env, fab):
    lab = env["lab"]
    conn = open_checked(lab, lab.hosts["h200"])
    try:  # a run that holds the lock and has not expired yet (its client may be alive for all we know)
        res = Remote(conn, "h200").call("lock.acquire", {"holder": "alice@laptop", "command": "fab deploy (crashed)",
                                                         "pid": 1, "token": "dead", "ttl": 3600}, deadline=30)
        assert res["ok"]
    finally:
        conn.close()
    r = fab("deploy", "--yes", "--hosts", "h200", inventory=env["inv"])
    assert r.returncode != 0 and "alice@laptop" in r.stderr and "--break-lock" in r.stderr
    r = fab("deploy", "--yes", "--hosts", "h200", "--break-lock", inventory=env["inv"])
    assert r.returncode == 0, r.stdout + r.stderr
    events = [json.loads(x)["event"] for x in ssh(lab, "h200", "tail -n 3 /opt/ddtree/journal.jsonl").stdout.split("\n") if x]
    assert "break-lock" in events


def test_hybrid_gate_refuses_then_records_the_override(env, fab):
    lab = env["lab"]
    plugin = env["tmp"] / "plugin-no-decl"
    shutil.copytree(ROOT / "overlays" / "sglang-ddtree", plugin,
                    ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    caps = plugin / "src" / "sglang_ddtree" / "capabilities.json"
    c = json.loads(caps.read_text()) if caps.exists() else {"modes": ["tree-verify", "shadow-linear"]}
    c["tree_aware_recurrent_state"] = False
    caps.write_text(json.dumps(c))
    hyb = lab_inventory(env["tmp"], "hybrid.yaml", keep=HOSTS, hosts={"h200": {"vars": {"model": "/models/Qwen3-Next-80B"}}})
    before = status_rows(fab, env["inv"], "h200")[0]["release"]
    r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "tree-verify", "--plugin", str(plugin), inventory=hyb)
    assert r.returncode != 0
    assert "REFUSED gpu0: tree-verify refused: hybrid model (layer_types has 3/4 recurrent layers" in r.stdout
    assert status_rows(fab, env["inv"], "h200")[0]["release"] == before  # nothing changed on the host
    r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "tree-verify", "--plugin", str(plugin),
            "--allow-hybrid-unsafe", inventory=hyb)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" in r.stdout and "MAY DIFFER" in r.stdout
    [row] = status_rows(fab, hyb, "h200")
    assert row["unsafe"] and "MAY DIFFER" in row["unsafe_reason"] and row["health"] == "ok"
    man = json.loads(ssh(lab, "h200", "cat /opt/ddtree/releases/current/manifest.json").stdout)
    assert man["allow_hybrid_unsafe"] is True and "gpu0" in man["unsafe"]
    assert "HYBRID-UNSAFE" in strip_ansi(fab("status", "--hosts", "h200", inventory=hyb).stdout)
    # the real plugin declares tree-aware recurrent state: no override needed, none recorded
    if json.loads((ROOT / "overlays/sglang-ddtree/src/sglang_ddtree/capabilities.json").read_text()).get(
            "tree_aware_recurrent_state"):
        r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "tree-verify", inventory=hyb)
        assert r.returncode == 0, r.stdout + r.stderr
        assert not status_rows(fab, hyb, "h200")[0]["unsafe"]


def test_logs_restart_and_no_terminal(env, fab):
    lab = env["lab"]
    r = fab("logs", "--hosts", "h200", "--lines", "5", inventory=env["inv"])
    assert r.returncode == 0 and "[h200 gpu0]" in r.stdout
    before = invocations(lab, "h200")
    r = fab("restart", "--hosts", "h200", "--gpus", "0", inventory=env["inv"])
    assert r.returncode == 0 and "gate ok" in r.stdout, r.stdout + r.stderr
    assert invocations(lab, "h200") != before
    r = fab("status", "--hosts", "h200", "--history", "30", inventory=env["inv"])
    hist = strip_ansi(r.stdout)
    for event in ("deploy-failed", "rollback", "restart", "break-lock", "HYBRID-UNSAFE gpu0", "rolled back to"):
        assert event in hist, (event, hist)
    r = fab("deploy", "--hosts", "h200", inventory=env["inv"])  # stdin is not a terminal, no --yes
    assert r.returncode == 2 and "pass --yes" in r.stderr


def test_guarded_file_overlay_is_applied_and_rollback_restores_the_original(env, fab, tmp_path):
    """A file overlay over an installed distribution: refused on a sha256 mismatch, applied with the
    original kept in the release, restored by rollback. The target is a throwaway distribution installed
    for this test (never torch: other work uses the lab venvs) and removed afterwards."""
    import hashlib
    from deploy.release import build
    lab = env["lab"]
    proj = tmp_path / "probe"
    (proj / "src" / "ddtree_overlay_probe").mkdir(parents=True)
    (proj / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "ddtree-overlay-probe"\nversion = "1.0"\n'
        '[tool.setuptools.packages.find]\nwhere = ["src"]\n')
    orig = b"VALUE = 'original'\n"
    (proj / "src" / "ddtree_overlay_probe" / "__init__.py").write_bytes(orig)
    subprocess.run(build.wheel_build_argv(sys.executable, proj, tmp_path / "w"), check=True, capture_output=True)
    [whl] = (tmp_path / "w").glob("*.whl")
    (tmp_path / "patched.py").write_text("VALUE = 'patched'\n")
    spec = tmp_path / "overlays.yaml"
    entry = {"package": "ddtree-overlay-probe", "version": "1.0", "path": "ddtree_overlay_probe/__init__.py",
             "sha256": hashlib.sha256(orig).hexdigest(), "source": "patched.py"}
    py = lab.hosts["h200"].vars["venv"] + "/bin/python"
    conn = open_checked(lab, lab.hosts["h200"])
    try:
        conn.put(str(whl), f"/tmp/{whl.name}")
        conn.run(f"{py} -m pip install -q --no-index --no-deps /tmp/{whl.name}", hide=True, in_stream=False)
        read = f"{py} -c 'import ddtree_overlay_probe as m; print(m.VALUE)'"
        spec.write_text(json.dumps([dict(entry, sha256="0" * 64)]))
        r = fab("deploy", "--yes", "--hosts", "h200", "--overlays", str(spec), inventory=env["inv"])
        assert r.returncode != 0 and "REFUSED file overlay ddtree_overlay_probe/__init__.py" in r.stdout, r.stdout
        spec.write_text(json.dumps([dict(entry, version="9.9")]))
        r = fab("deploy", "--yes", "--hosts", "h200", "--overlays", str(spec), inventory=env["inv"])
        assert r.returncode != 0 and "is 1.0 on the host, the overlay is for 9.9" in r.stdout, r.stdout
        assert conn.run(read, hide=True, in_stream=False).stdout.strip() == "original"
        spec.write_text(json.dumps([entry]))
        r = fab("deploy", "--yes", "--hosts", "h200", "--overlays", str(spec), inventory=env["inv"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert conn.run(read, hide=True, in_stream=False).stdout.strip() == "patched"
        man = json.loads(conn.run("cat /opt/ddtree/releases/current/manifest.json", hide=True, in_stream=False).stdout)
        assert man["overlays"][0]["path"] == entry["path"]
        kept = conn.run(f"cat /opt/ddtree/releases/{man['release']}/overlays/orig/{entry['path']}", hide=True, in_stream=False).stdout
        assert kept.encode() == orig
        r = fab("rollback", "--hosts", "h200", inventory=env["inv"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert conn.run(read, hide=True, in_stream=False).stdout.strip() == "original"
    finally:
        conn.run(f"{py} -m pip uninstall -y -q ddtree-overlay-probe; rm -f /tmp/{whl.name}", hide=True, warn=True, in_stream=False)
        conn.close()
