"""The lab state a test asserts, set by the test itself: whatever ran on the lab before (`fab provision ct200`, which
copies the reference's torch build onto ct200; a `fab deploy` or `fab rollback` left running; a `fab lab.drift`),
the tests that need the lab as `fab lab.up` built it put it back first (tests/conftest.py: lab_as_built)."""
from __future__ import annotations

import subprocess

# Leaves a lab host with no sglang-ddtree services, releases or unit (the lab is shared by test modules).
CLEAN = ("systemctl stop 'sglang-ddtree@*' sglang-router 2>/dev/null; "
         "systemctl reset-failed 'sglang-ddtree@*' sglang-router 2>/dev/null; "
         "rm -f /etc/systemd/system/sglang-router.service /etc/systemd/system/multi-user.target.wants/sglang-router*; "
         "rm -rf /opt/ddtree /etc/systemd/system/sglang-ddtree@.service /etc/systemd/system/sglang-ddtree@*.service.d "
         "/etc/systemd/system/multi-user.target.wants/sglang-ddtree@*; systemctl daemon-reload")


def ssh(inv, host: str, command: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a shell command on a lab host with the lab's key and known_hosts (host keys verified)."""
    h = inv.hosts[host]
    argv = ["ssh", "-i", inv.ssh_path("identity_file"), "-o", f"UserKnownHostsFile={inv.ssh_path('known_hosts')}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"{h.user}@{h.address}", command]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and r.returncode != 0:
        raise AssertionError(f"{host}: {command}: {r.stdout}{r.stderr}")
    return r


def as_built(inv, hosts=None) -> None:
    """Each lab host as `fab lab.up` built it: no release, service or plugin of this toolkit, and its managed venv
    back to the as-built distributions with no drift (`fab lab.drift HOST coherent`: its persona's torch, e.g.
    ct200's +cu128, whatever a provision copied onto it)."""
    from deploy.lab import fleet
    for h in hosts or inv.hosts:
        ssh(inv, h, CLEAN + f"; {inv.hosts[h].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
            check=False)
        fleet.set_drift(h, "coherent", log=lambda *_: None)
