"""Shared fixtures. The lab is booted once per test session (and left up; .ci/run tears it down)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tests/helpers.py, agenthelpers.py, provhelpers.py, labstate.py for every test folder. No test folder is a package
# named like a product package: `deploy` is always this checkout's (its root first, before an installed copy).
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
# inventory/lab.yaml, or for a second lab on this machine (DDTREE_LAB_ID) its own copy of it
from deploy.lab.fleet import lab_inventory_path  # noqa: E402

LAB_INVENTORY = lab_inventory_path()


@pytest.fixture(scope="session")
def lab():
    """The running lab (booted if needed) as a loaded Inventory of inventory/lab.yaml, put back as `fab lab.up`
    built it whatever ran on it before the tests (tests/labstate.py: a provision, a deploy, a drift left behind)."""
    from deploy.inventory import load_inventory
    from deploy.lab import fleet
    from labstate import as_built

    fleet.up(log=lambda *_: None)  # idempotent: boots only what is missing; raises if it cannot
    inv = load_inventory(str(LAB_INVENTORY))
    as_built(inv)
    return inv


@pytest.fixture(scope="module")
def lab_as_built(lab):
    """The lab as `fab lab.up` built it again, whatever an earlier test module ran on it (tests/labstate.py), for a
    module whose tests assert that state (ct200's torch +cu128 against ct129's +cu130, no drift, no plugin)."""
    from labstate import as_built
    as_built(lab)
    return lab


def run_fab(*args: str, inventory: str | Path = LAB_INVENTORY, timeout: int = 300, env: dict | None = None):
    """Run the real `fab` CLI from the repo root against an inventory; returns CompletedProcess."""
    e = dict(os.environ, DEPLOY_INVENTORY=str(inventory), COLUMNS="250")
    e.update(env or {})
    fab = Path(sys.executable).with_name("fab")
    return subprocess.run([str(fab), *args], cwd=ROOT, env=e, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def fab():
    return run_fab
