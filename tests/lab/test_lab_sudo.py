"""A non-root SSH user with passwordless sudo (the lab's `deploy` user): every remote change goes through
`sudo -n` and root's SFTP (sftp-server started through sudo), the facts probe runs unprivileged."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from labstate import ssh

# ct200 as lab.up built it (+cu128), whatever ran on the lab before: tests/labstate.py
pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("lab_as_built")]


@pytest.fixture
def sudo_inventory(lab, tmp_path):
    text = Path(lab.path).read_text()
    assert "\n  user: root\n" in text
    p = tmp_path / "lab-sudo.yaml"
    p.write_text(text.replace("\n  user: root\n", "\n  user: deploy\n"))
    _deploy_can_log_in(lab)
    return p


def _deploy_can_log_in(lab) -> None:
    """Every lab host lets `deploy` in before the test starts. `fab lab.up` hands a host over with its logins open
    (deploy/lab/fleet.py: _wait_booted); a host whose PAM nologin is back later gets the same handover again, with a
    warning that names it, since what this file tests is the toolkit's sudo path, not the lab's boot. One that still
    refuses fails here with sshd's own words, not as the toolkit's failure further on."""
    import warnings

    from deploy.lab import fleet
    for name, h in lab.hosts.items():
        inv = dataclasses.replace(lab, hosts={**lab.hosts, name: dataclasses.replace(h, user="deploy")})
        r = ssh(inv, name, "true", check=False)
        if r.returncode != 0 and "pam_nologin" in r.stderr:
            warnings.warn(f"{name}: logins closed after lab.up handed it over: {r.stderr.strip()}")
            fleet._wait_booted(fleet._host(name))
            r = ssh(inv, name, "true", check=False)
        if r.returncode != 0:
            why = ssh(lab, name, "journalctl -q --no-pager -n 5 -u ssh; ls -l /run/nologin /etc/nologin 2>&1",
                      check=False)
            pytest.fail(f"{name}: deploy cannot log in: {r.stderr.strip()}\n{why.stdout}")


def torch_versions(fab, inv):
    r = fab("inventory", "--json", "--refresh", inventory=inv)
    assert r.returncode == 0, r.stderr
    return {h: f["torch"]["version"] for h, f in json.loads(r.stdout)["hosts"].items()}


def test_provision_and_undo_as_sudo_user(fab, sudo_inventory):
    assert torch_versions(fab, sudo_inventory)["ct200"] == "2.11.0+cu128"
    r = fab("provision", "ct200", "--yes", inventory=sudo_inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert torch_versions(fab, sudo_inventory)["ct200"] == "2.11.0+cu130"
    r = fab("provision", "ct200", "--undo", "--yes", inventory=sudo_inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert torch_versions(fab, sudo_inventory)["ct200"] == "2.11.0+cu128"


def test_deploy_status_rollback_as_sudo_user(fab, sudo_inventory):
    def h200():
        r = fab("status", "--hosts", "h200", "--json", inventory=sudo_inventory)
        (row,) = json.loads(r.stdout)
        return row

    r = fab("deploy", "--mode", "shadow-linear", "--hosts", "h200", "--yes", inventory=sudo_inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    first = h200()
    assert (first["mode"], first["health"], first["state"]) == ("shadow-linear", "ok", "active/running")
    r = fab("deploy", "--mode", "tree-verify", "--hosts", "h200", "--yes", inventory=sudo_inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    assert h200()["mode"] == "tree-verify"
    r = fab("rollback", "--hosts", "h200", "--yes", inventory=sudo_inventory)
    assert r.returncode == 0, r.stdout + r.stderr
    back = h200()
    assert (back["mode"], back["release"], back["health"]) == ("shadow-linear", first["release"], "ok")
    assert back["last_deploy"].startswith("rollback")
