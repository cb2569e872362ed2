"""The lab hands a host over only once its systemd has finished booting (deploy/lab/fleet.py: _wait_booted):
before that, PAM's nologin turns every user but root away, so a host ready at its sshd banner is not ready."""
import subprocess

import pytest

from deploy.lab import fleet

HOST = fleet.lab_hosts(0)[0]


def _fake(states):
    calls = []

    def run(argv, check=True, **kw):
        calls.append(argv[-1])
        out = states.pop(0) if "is-system-running" in argv[-1] else "JOB UNIT\n1 systemd-user-sessions.service\n"
        return subprocess.CompletedProcess(argv, 0 if out == "running" else 1, out + "\n", "")
    return run, calls


@pytest.mark.parametrize("state", ["running", "degraded"])
def test_a_booted_host_is_handed_over(monkeypatch, state):
    run, calls = _fake([state])
    monkeypatch.setattr(fleet, "_run", run)
    fleet._wait_booted(HOST, timeout=5)
    assert calls == ["timeout 5 systemctl is-system-running --wait"]


def test_a_host_still_booting_is_refused_with_its_pending_jobs(monkeypatch):
    run, calls = _fake(["starting"])
    monkeypatch.setattr(fleet, "_run", run)
    with pytest.raises(fleet.LabError, match=r"did not finish booting within 5s \(state starting") as e:
        fleet._wait_booted(HOST, timeout=5)
    assert "systemd-user-sessions.service" in str(e.value) and len(calls) == 2
