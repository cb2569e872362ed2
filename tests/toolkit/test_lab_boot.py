"""The lab hands a host over only once its systemd has finished booting and it accepts logins (deploy/lab/fleet.py:
_wait_booted): before systemd-user-sessions has run, PAM's nologin turns every user but root away, so a host ready
at its sshd banner is not ready, and neither is one whose boot finished degraded with logins still closed."""
import subprocess

import pytest

from deploy.lab import fleet

HOST = fleet.lab_hosts(0)[0]


@pytest.fixture(autouse=True)
def plain_ssh_argv(monkeypatch):
    """The ssh command line without the lab's control key (fleet._ssh_argv would make one on a machine that has
    none, through the faked _run)."""
    monkeypatch.setattr(fleet, "_ssh_argv", lambda h, command: ["ssh", f"root@{h.address}", command])


class FakeHost:
    """Answers the commands _wait_booted sends over ssh, as a host in the given state would."""

    def __init__(self, state: str, retry_out: str = "", nologin: str = ""):
        self.state, self.retry_out, self.nologin, self.calls = state, retry_out, nologin, []

    def __call__(self, argv, check=True, **kw):
        cmd = argv[-1]
        self.calls.append(cmd)
        if "is-system-running --wait" in cmd:
            out = self.state
        elif "list-jobs" in cmd:
            out = "JOB UNIT\n1 systemd-user-sessions.service"
        elif "started again" in cmd:
            out = self.retry_out
        elif cmd.startswith("test ! -e /run/nologin"):
            out = self.nologin
        else:
            out = "systemd-user-sessions.service failed"
        return subprocess.CompletedProcess(argv, 0, out + "\n", "")


@pytest.mark.parametrize("state", ["running", "degraded"])
def test_a_booted_host_with_logins_open_is_handed_over(monkeypatch, capsys, state):
    host = FakeHost(state)
    monkeypatch.setattr(fleet, "_run", host)
    fleet._wait_booted(HOST, timeout=5)
    assert host.calls[0] == "timeout 5 systemctl is-system-running --wait" and len(host.calls) == 3
    assert capsys.readouterr().err == ""


def test_a_degraded_boot_gets_its_failed_units_started_again_and_says_so(monkeypatch, capsys):
    host = FakeHost("degraded", retry_out="started again: systemd-user-sessions.service")
    monkeypatch.setattr(fleet, "_run", host)
    fleet._wait_booted(HOST, timeout=5)
    err = capsys.readouterr().err
    assert f"{HOST.name}: boot finished degraded: started again: systemd-user-sessions.service" in err


def test_a_host_whose_logins_stay_closed_is_refused_with_why(monkeypatch):
    host = FakeHost("degraded", retry_out="logins still closed: systemd-user-sessions started again",
                    nologin="System is booting up.")
    monkeypatch.setattr(fleet, "_run", host)
    with pytest.raises(fleet.LabError, match="logins are still closed") as e:
        fleet._wait_booted(HOST, timeout=5)
    assert "System is booting up." in str(e.value) and "systemd-user-sessions.service failed" in str(e.value)


def test_a_host_still_booting_is_refused_with_its_pending_jobs(monkeypatch):
    host = FakeHost("starting")
    monkeypatch.setattr(fleet, "_run", host)
    with pytest.raises(fleet.LabError, match=r"did not finish booting within 5s \(state starting") as e:
        fleet._wait_booted(HOST, timeout=5)
    assert "systemd-user-sessions.service" in str(e.value) and len(host.calls) == 2
