"""Inventory validation: every kind of bad input is refused with file:line and the key."""
from __future__ import annotations

import textwrap

import pytest

from deploy.contract import BUDGET_MAX
from deploy.inventory import InventoryError, load_inventory

GOOD = """\
fleet: t
reference: a
vars:
  venv: /opt/v
  mode: tree-verify
  budget: 16
groups:
  g:
    hosts: [a, b]
    vars: {budget: 32}
hosts:
  a:
    address: 10.0.0.1
    gpus: 2
  b:
    address: 10.0.0.2
    gpus: [0, 1, 3]
    vars: {budget: 8}
    services:
      3: {port: 31000, mode: linear}
"""


def write(tmp_path, text):
    p = tmp_path / "inv.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def errors(tmp_path, text):
    with pytest.raises(InventoryError) as ei:
        load_inventory(write(tmp_path, text))
    return ei.value.problems


def test_good_inventory_resolves_vars_by_precedence(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD))
    a, b = inv.hosts["a"], inv.hosts["b"]
    assert inv.reference is a
    assert [s.port for s in a.services] == [30000, 30001]
    assert a.services[0].budget == 32  # group overrides fleet
    assert b.vars["budget"] == 8  # host overrides group
    s3 = b.services[-1]
    assert (s3.gpu, s3.port, s3.mode, s3.budget) == (3, 31000, "linear", 8)
    assert [h.name for h in inv.select("g")] == ["a", "b"]


def test_repo_inventories_load():
    inv = load_inventory("inventory/hosts.yaml")
    assert inv.reference.name == "ct129" and len(inv.hosts["ct200"].services) == 8
    assert inv.hosts["ct200"].services[1].port == 30001
    lab = load_inventory("inventory/lab.yaml")
    assert set(lab.hosts) == {"ct129", "ct200", "h200"}


@pytest.mark.parametrize("text,line,needle", [
    (GOOD.replace("    gpus: 2\n", "    gpus: 2\n    colour: red\n"), 15, "hosts.a.colour: unknown key"),
    (GOOD.replace("budget: 16", "budget: many"), 6, "vars.budget: must be an integer"),
    (GOOD.replace("budget: 16", "budget: 100000"), 6, f"vars.budget: must be an integer in [1, {BUDGET_MAX}]"),
    (GOOD.replace("mode: tree-verify", "mode: tree"), 5, "vars.mode: must be one of"),
    (GOOD.replace("reference: a", "reference: zz"), 2, "reference: 'zz' is not one of the listed hosts"),
    (GOOD.replace("gpus: [0, 1, 3]", "gpus: [0, 1, 1]"), 17, "GPU index 1 is listed twice"),
    (GOOD.replace("3: {port: 31000, mode: linear}", "3: {port: 30000}"), 20, "port 30000 is also used by GPU 0"),
    (GOOD.replace("3: {port: 31000", "7: {port: 31000"), 20, "GPU 7 is not one of this host's GPUs"),
    (GOOD.replace("hosts: [a, b]", "hosts: [a, c]"), 9, "'c' is not a host of this inventory"),
    (GOOD.replace("    address: 10.0.0.2\n", "    address: 10.0.0.1\n"), 16, "10.0.0.1:22 is also host a"),
    (GOOD.replace("venv: /opt/v", "venv: opt/v"), 4, "vars.venv: must be an absolute path"),
    (GOOD.replace("  a:\n    address: 10.0.0.1\n", "  a:\n    port: 22\n"), 12, "hosts.a.address: required"),
    (GOOD.replace("fleet: t\n", "fleet: t\nssh: {connect_retries: 9}\n"), 2,
     "ssh.connect_retries: must be new connections after sshd cut a handshake, an integer in [0, 5]"),
    (GOOD.replace("fleet: t\n", "fleet: t\nfleet: u\n"), 2, "fleet: duplicate key"),
    (GOOD.replace("  venv: /opt/v", "  venv: [/opt/v"), 5, "YAML syntax"),
    (GOOD.replace("vars:\n  venv", "vars:\n  service_user: root\n  venv"), 4, "service_user: must be a non-root user"),
    (GOOD.replace("budget: 16", "budget: {1: 15, 4: 31}"), 6, "vars.budget: budget schedule {1: 15, 4: 31}: "
     "schedule budgets must not increase with the batch size: 31 at 4 after 15"),
    (GOOD.replace("vars: {budget: 8}", "vars: {budget: {2: 31}}"), 18, "hosts.b.vars.budget: budget schedule "
     "{2: 31}: a schedule starts at batch size 1, got 2"),
    (GOOD.replace("budget: 16", "budget: {1: 15, 8: fast}"), 6, "or 'chain', got 'fast'"),
    (GOOD.replace("{port: 31000, mode: linear}", "{port: 31000, mode: shadow-linear, budget: {1: 31, 4: chain}}"),
     20, "hosts.b.services.3: budget 1:31,4:chain is a schedule, which only tree-verify serves"),
])
def test_bad_input_names_file_line_and_key(tmp_path, text, line, needle):
    problems = errors(tmp_path, text)
    assert any(p.startswith(f"{tmp_path}/inv.yaml:{line}: ") and needle in p for p in problems), problems


def test_all_problems_reported_at_once(tmp_path):
    text = GOOD.replace("budget: 16", "budget: 0").replace("mode: tree-verify", "mode: x")
    assert len(errors(tmp_path, text)) == 2


def test_missing_file_and_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("DEPLOY_INVENTORY", str(tmp_path / "nope.yaml"))
    with pytest.raises(InventoryError, match="no such inventory file"):
        load_inventory()


def test_unknown_host_selection(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD))
    with pytest.raises(InventoryError, match="unknown host or group 'zz'"):
        inv.select("a,zz")


def test_budget_schedule_in_the_inventory(tmp_path):
    """`budget:` takes one integer or a schedule by batch size; the service carries the contract's schedule (a
    one-entry schedule is its plain budget)."""
    from deploy import contract
    inv = load_inventory(write(tmp_path, GOOD.replace("vars: {budget: 8}", "vars: {budget: {1: 127, 4: 31, 16: 15, "
                                                                            "64: chain}}")))
    b = inv.hosts["b"].services[0].budget
    assert isinstance(b, contract.BudgetSchedule) and str(b) == "1:127,4:31,16:15,64:chain"
    assert [b.budget_for(n) for n in (1, 3, 4, 16, 64)] == [127, 127, 31, 15, "chain"]
    assert inv.hosts["a"].services[0].budget == 32
    one = load_inventory(write(tmp_path, GOOD.replace("vars: {budget: 8}", "vars: {budget: {1: 31, 4: 31}}")))
    assert one.hosts["b"].services[0].budget == 31
