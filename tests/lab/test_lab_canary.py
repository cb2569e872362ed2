"""The rollout gate's canary on the lab's real hosts (real sshd, systemd, sglang-router; the lab's GPU server
stand-in told to be lossy or to collapse its acceptance through the service's `env`): a deploy whose canary fails
is refused, the GPU stays out of the router, the host rolls back and the previous release serves again; the
message names the prompt, the position and the gap (or the accept length and its floor). `fab deploy` says how long
the rollout is expected to take before it begins."""
from __future__ import annotations

import json
import re

import pytest

from helpers import CLEAN, lab_inventory, ssh, strip_ansi

pytestmark = pytest.mark.lab
HOST = "h200"


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory, fab):
    tmp = tmp_path_factory.mktemp("labcanary")
    ssh(lab, HOST, CLEAN)
    inv = lab_inventory(tmp, keep=[HOST])
    r = fab("deploy", "--yes", inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    yield {"tmp": tmp, "lab": lab, "inv": inv}
    ssh(lab, HOST, CLEAN + f"; {lab.hosts[HOST].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
        check=False)


def row(fab, inv) -> dict:
    r = fab("status", "--json", "--hosts", HOST, inventory=inv)
    [x] = json.loads(r.stdout)
    return x


def last_journal(lab) -> dict:
    return json.loads(ssh(lab, HOST, "tail -n 1 /opt/ddtree/journal.jsonl").stdout)


def refused_and_rolled_back(env, fab, bad, good: dict) -> str:
    """Deploy `bad`: refused at the canary, out of the router until the rollback put the old release back."""
    r = fab("deploy", "--yes", inventory=bad)
    out = strip_ansi(r.stdout + r.stderr)
    assert r.returncode != 0, out
    lines = out.splitlines()
    failed = next(k for k, ln in enumerate(lines) if "gpu0 :30000 gate FAILED at canary: " in ln)
    out_of_router = next(k for k, ln in enumerate(lines) if "gpu0 out of the router" in ln)
    back = [k for k, ln in enumerate(lines) if "gpu0 back in the router" in ln]
    rollback = next(k for k, ln in enumerate(lines) if "rolling back to" in ln)
    # the failing GPU never went back into the router with the new release: only the rollback's restart did
    assert out_of_router < failed < rollback and all(k > rollback for k in back), out
    assert "rolled back to " + good["release"] in out and "deploy: 0/1 hosts ok" in out, out
    now = row(fab, env["inv"])
    assert now["release"] == good["release"] and now["health"] == "ok" and now["state"] == "active/running", now
    assert now["router"] == "in/healthy", now  # the old release serves through the router again: nothing lost
    j = last_journal(env["lab"])
    assert j["event"] == "deploy-failed" and j["rollback_ok"] is True and j["failed"] == ["gpu0"], j
    return lines[failed]


def test_deploy_says_the_expected_rollout_time_before_it_begins(env, fab):
    inv = lab_inventory(env["tmp"], "timed.yaml", keep=[HOST], vars={"start_seconds": 5, "start_timeout": 600,
                                                                         "budget": 8})
    r = fab("deploy", "--yes", inventory=inv)
    out = strip_ansi(r.stdout + r.stderr)
    assert r.returncode == 0, out
    m = re.search(r"expected rollout time ~(\d+) s \(1 GPU in 1 batch x ~(\d+) s\)", out)
    assert m and int(m.group(1)) == int(m.group(2)) >= 5, out
    assert out.index("expected rollout time") < out.index("gpu0 out of the router")
    # the gate's start timeout follows start_seconds (2 x 5 + 60), below the inventory's start_timeout
    assert "start timeout 70 s (expected start ~5 s)" in out, out
    assert "gpu0 :30000 gate ok" in out and "canary 96 tokens within 0.0 nats of the argmax" in out, out


def test_a_lossy_server_is_refused_by_the_canary_and_rolled_back(env, fab):
    good = row(fab, env["inv"])
    bad = lab_inventory(env["tmp"], "lossy.yaml", keep=[HOST], vars={"budget": 9},
                        hosts={HOST: {"services": {0: {"env": {"LABSERVER_OFF_ARGMAX": "3"}}}}})
    line = refused_and_rolled_back(env, fab, bad, good)
    assert re.search(r"gate FAILED at canary: prompt 0 \(12 token ids\) position 3: emitted token \d+ is 2\.950 "
                     r"nats below the target's argmax \d+ \(margin 0\.125 nats\)", line), line


def test_a_collapsed_acceptance_is_refused_by_the_floor_and_rolled_back(env, fab):
    good = row(fab, env["inv"])
    bad = lab_inventory(env["tmp"], "collapsed.yaml", keep=[HOST], vars={"budget": 10, "canary": {"accept_floor": 3}},
                        hosts={HOST: {"services": {0: {"env": {"LABSERVER_ACCEPT_LENGTH": "1.0"}}}}})
    line = refused_and_rolled_back(env, fab, bad, good)
    assert line.endswith("gate FAILED at canary: accept length 1.000 over 4 prompts is below the floor 3.0 "
                         "(the inventory's accept_floor)"), line


def test_restart_and_rollback_gate_with_the_canary_too(env, fab):
    """Every GPU a runbook restarts proves itself before it goes back into the router, not only at a deploy: a lossy
    release that got in with the canary switched off is kept out of the router by `fab restart` (the inventory's
    canary on again), and `fab rollback` to that release is refused the same way; a deploy of the good release puts
    the host right."""
    lossy_env = {HOST: {"services": {0: {"env": {"LABSERVER_OFF_ARGMAX": "3"}}}}}
    unguarded = lab_inventory(env["tmp"], "unguarded.yaml", keep=[HOST], vars={"budget": 12, "canary":
                                                                               {"enabled": False}}, hosts=lossy_env)
    guarded = lab_inventory(env["tmp"], "guarded.yaml", keep=[HOST], vars={"budget": 12}, hosts=lossy_env)
    r = fab("deploy", "--yes", inventory=unguarded)
    out = strip_ansi(r.stdout + r.stderr)
    assert r.returncode == 0 and "no canary (the inventory's canary.enabled is false)" in out, out
    lossy = row(fab, env["inv"])["release"]

    def refused(out: str) -> None:
        assert re.search(r"gate of gpu0: canary 4 prompts x \d+ tokens, margin 0\.125 nats", out), out
        assert re.search(r"gpu0 :30000 gate FAILED at canary: prompt 0 \(12 token ids\) position 3: emitted token "
                         r"\d+ is 2\.950 nats below", out), out
        assert "gpu0 back in the router" not in out, out
        now = row(fab, env["inv"])
        assert now["release"] == lossy and now["router"] != "in/healthy", now  # kept out of the router

    r = fab("restart", "--hosts", HOST, "--yes", inventory=guarded)
    assert r.returncode != 0
    refused(strip_ansi(r.stdout + r.stderr))
    assert last_journal(env["lab"])["event"] == "restart" and last_journal(env["lab"])["ok"] is False

    r = fab("deploy", "--yes", inventory=env["inv"])  # the good release: gated, canary passed, back in the router
    assert r.returncode == 0, r.stdout + r.stderr
    good = row(fab, env["inv"])
    assert good["router"] == "in/healthy" and good["release"] != lossy, good
    r = fab("rollback", "--hosts", HOST, inventory=guarded)
    out = strip_ansi(r.stdout + r.stderr)
    assert r.returncode != 0 and f"rollback {good['release']} -> {lossy}" in out, out
    refused(out)
    assert "gate failed after rollback on gpu0" in out, out

    r = fab("deploy", "--yes", inventory=env["inv"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert row(fab, env["inv"])["router"] == "in/healthy"
