"""Pure decisions behind "every rollout ends with each GPU serving, in the router, and the router holding exactly the
host's enabled workers": what restarts (a hung or routed-out GPU too), which workers a drain takes out (the old url
of a GPU whose port changes), what a lock says about a run that died, and when `fab status` exits 1."""
from __future__ import annotations

import subprocess

from deploy.release import changes
from deploy.release import router as routermod
from deploy.release import status as st
from deploy.remote.host import locks


def manifest(ports: dict, enabled: dict | None = None, digest: str = "d") -> dict:
    return {"router": {"enabled": True, "address": "127.0.0.1", "port": 8000, "api_key_file": None,
                       "drain_timeout": 30},
            "services": {i: {"port": p, "digest": digest, "enabled": (enabled or {}).get(i, True)}
                         for i, p in ports.items()}}


def test_a_port_change_drains_the_old_url_and_the_router_expects_only_enabled_workers():
    old = manifest({"gpu0": 30000, "gpu1": 30001})
    new = manifest({"gpu0": 30010, "gpu1": 30001, "gpu2": 30002}, enabled={"gpu2": False})
    spec = routermod.drain_spec(new, previous=old)
    assert spec["workers"]["gpu0"] == "http://127.0.0.1:30010"
    assert spec["previous"] == {"gpu0": "http://127.0.0.1:30000"}            # gpu1 did not move
    assert spec["expected"] == ["http://127.0.0.1:30001", "http://127.0.0.1:30010"]  # gpu2 disabled
    assert "previous" not in routermod.drain_spec(new, previous=new)
    # the automatic rollback's batches drain the failed release's url of a moved GPU
    back = routermod.drain_spec(old, previous=new)
    assert back["previous"] == {"gpu0": "http://127.0.0.1:30010"}


def test_a_hung_or_routed_out_gpu_restarts_with_the_reason():
    man = manifest({"gpu0": 30000, "gpu1": 30001, "gpu2": 30002})
    units = {i: {"ActiveState": "active"} for i in man["services"]}
    rec = {i: {"digest": "d"} for i in man["services"]}
    assert changes.changed_services(man, man, units, rec) == {}
    why = changes.changed_services(man, man, units, rec, {"gpu0": "/health: timed out", "gpu1": "ok"},
                                   {"gpu0": True, "gpu1": False, "gpu2": True})
    assert why == {"gpu0": "not healthy (/health: timed out)", "gpu1": "out of the router"}
    view = {"alive": True, "workers": {"http://127.0.0.1:30000": {}, "http://127.0.0.1:30002": {}}}
    assert changes.routed(man, view) == {"gpu0": True, "gpu1": False, "gpu2": True}
    assert changes.routed(man, {"alive": False}) is None and changes.routed(man, None) is None
    assert changes.out_first(["gpu0", "gpu1", "gpu2"], {"gpu0": "changed", "gpu2": "out of the router"}) == \
        ["gpu2", "gpu0", "gpu1"]


def test_the_lock_of_a_run_that_died_says_where_it_stopped(tmp_path):
    state = str(tmp_path)
    agent = subprocess.Popen(["sleep", "60"])  # the agent process of the run that dies
    got = locks.acquire(state, {"token": "a" * 32, "holder": "op@ctl", "command": "fab deploy"}, agent_pid=agent.pid)
    assert got["ok"] and locks.interrupted(got["lock"]) is None              # no step begun: nothing to finish
    locks.check(state, "a" * 32, step="restart gpu0")
    before = locks.read(state)["expires_ts"]
    locks.check(state, "a" * 32, renew=False, out=["gpu0"])
    cur = locks.read(state)
    assert cur["expires_ts"] == before and cur["step"] == "restart gpu0" and cur["out"] == ["gpu0"]
    assert locks.stale(cur) is None
    agent.kill()
    agent.wait()
    assert "is gone" in locks.stale(cur)
    took = locks.acquire(state, {"token": "b" * 32, "holder": "op2@ctl", "command": "fab deploy"})
    dead = locks.interrupted(took["took_over"])
    assert dead["step"] == "restart gpu0" and dead["out"] == ["gpu0"] and dead["token"] == "a" * 32
    line = changes.interrupted_line(dict(cur, stale=locks.stale(cur)))
    assert "found an interrupted run: op@ctl running 'fab deploy'" in line and "'restart gpu0'" in line
    assert "out of the router: gpu0" in line
    assert changes.interrupted_line(dict(cur, stale=None)) is None           # a live run: not interrupted


def row(**kw) -> dict:
    base = {"host": "h", "instance": "gpu0", "health": "ok", "router": "in/healthy", "enabled": True,
            "lock": None, "lock_stale": None, "lock_step": None}
    return dict(base, **kw)


def test_status_exits_1_for_each_thing_out_of_place_and_says_which():
    ok_router = [{"host": "h", "alive": True, "error": None, "stray": []}]
    assert st.problems([row(), row(instance="gpu1")], ok_router) == []
    assert st.problems([row(router="-")], []) == []                          # a host without a router
    assert st.problems([row(router="OUT", enabled=False)], ok_router) == []  # a disabled GPU is not expected in
    assert st.problems([row(router="OUT")], ok_router) == ["h:gpu0 out of the router"]
    assert st.problems([row(router="in/UNHEALTHY")], ok_router) == ["h:gpu0 router: in/UNHEALTHY"]
    assert st.problems([row(health="down")], ok_router) == ["h:gpu0 not healthy (/health down)"]
    stray = [{"host": "h", "alive": True, "error": None, "stray": ["http://127.0.0.1:30010"]}]
    assert st.problems([row()], stray) == [
        "h: the router holds worker(s) the inventory does not name: http://127.0.0.1:30010"]
    dead = st.problems([row(lock="op@ctl (fab deploy, since T)", lock_stale="its agent process 9 is gone",
                            lock_step="restart gpu0"), row(instance="gpu1", lock="op@ctl (fab deploy, since T)",
                                                           lock_stale="its agent process 9 is gone",
                                                           lock_step="restart gpu0")], ok_router)
    assert len(dead) == 1 and "lock of a dead run" in dead[0] and "'restart gpu0'" in dead[0], dead
    assert st.problems([row(lock="op@ctl (fab deploy, since T)")], ok_router) == []  # a live run's lock
    assert st.problems([{"host": "h", "gpu": None, "error": "link-lost: x"}], []) == ["h: link-lost: x"]


def test_status_names_the_workers_the_inventory_does_not():
    from types import SimpleNamespace as NS
    host = NS(services=[NS(port=30001, enabled=True), NS(port=30010, enabled=True), NS(port=30002, enabled=False)])
    view = {"alive": True, "listen": "10.0.0.1", "port": 8000, "workers": {
        u: {"healthy": h} for u, h in [("http://127.0.0.1:30000", False), ("http://127.0.0.1:30001", True),
                                       ("http://127.0.0.1:30010", True)]}}
    [r] = st.routers([{"host": "h", "ok": True, "state": {"router_view": view}}], {"h": host})
    assert (r["workers"], r["healthy"], r["stray"]) == (3, 2, ["http://127.0.0.1:30000"])
    [r] = st.routers([{"host": "h", "ok": True, "state": {"router_view": view}}])
    assert r["stray"] is None                                                # no inventory given: not judged


def test_the_status_table_shows_an_accept_length_with_two_decimals():
    """SGLang reports the accept length as a ratio of counters (1.1428571428571428 on the H200): the table shows it
    to two decimals, so the 100-column table keeps its other columns; a missing one is '-'."""
    from deploy.release import status
    assert status._accept(1.1428571428571428) == "1.14" and status._accept(8) == "8.00"
    assert status._accept(None) == "-" and status._accept("n/a") == "n/a"
