"""The router as rendered (no host): its unit and arguments, checked against the real sglang-router 0.3.2 wheel's
own parser; the metrics parser on captured /metrics text and against SGLang 0.5.17's metric names; the labserver's
/metrics through the same parser."""
from __future__ import annotations

import dataclasses
import glob
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deploy.inventory import load_inventory
from deploy.release import render
from deploy.release import router as routermod
from deploy.remote.host import metrics

from test_inventory import GOOD, write  # noqa: E402 (tests/ is on sys.path)

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests" / "captures"


def host(tmp_path, **vars):
    inv = load_inventory(write(tmp_path, GOOD))
    h = inv.hosts["a"]
    return dataclasses.replace(h, vars=dict(h.vars, **vars))


def test_unit_keeps_the_key_out_and_the_hardening_in(tmp_path):
    w = routermod.wheel()
    plain = routermod.render_unit(host(tmp_path), w)
    keyed = routermod.render_unit(host(tmp_path, listen_address="10.0.0.1", api_key_file="/etc/ddtree/k.yaml"), w)
    venv = f"/opt/ddtree/router/sglang-router-0.3.2-{w.sha256[:12]}"
    assert f"ExecStart={venv}/bin/python -I /opt/ddtree/releases/current/bin/router_launch.py -- $ROUTER_ARGS" in plain
    assert "LoadCredential" not in plain and "--api-key" not in plain
    assert "LoadCredential=sglang-server.yaml:/etc/ddtree/k.yaml" in keyed
    assert "router_launch.py --api-key-credential sglang-server.yaml -- $ROUTER_ARGS" in keyed
    gpu_unit = render.render_unit(host(tmp_path))
    shared = [ln for ln in (ROOT / "systemd" / "hardening.j2").read_text().splitlines()
              if ln and not ln.startswith(("#", "{#", "    "))]
    for ln in shared:  # every directive of the GPU services' hardening, in both units
        assert ln in plain.splitlines() and ln in gpu_unit.splitlines(), ln
    for ln in ("User=sglang", "MemoryDenyWriteExecute=yes", "PrivateDevices=yes", "ProcSubset=pid", "Restart=always"):
        assert ln in plain.splitlines(), ln
    env = routermod.render_env(host(tmp_path, listen_address="10.0.0.1", api_key_file="/etc/ddtree/k.yaml"))
    assert "k.yaml" not in env and "--api-key" not in env


def real_router_args(tmp_path, argv: list[str]) -> dict:
    """The real sglang-router 0.3.2 parser (its wheel, unpacked) run over `argv` through our launcher."""
    d = tmp_path / "wheel"
    zipfile.ZipFile(routermod.wheel().path).extractall(d)
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2]); "
            "import router_launch; a = router_launch.router_args(json.loads(sys.argv[3]), api_key='Kinprocess0123456789'); "
            "print(json.dumps({k: getattr(a, k) for k in ('host', 'port', 'worker_urls', 'policy', 'prometheus_host', "
            "'prometheus_port', 'health_check_interval_secs', 'health_failure_threshold', 'api_key', "
            "'shutdown_grace_period_secs', 'retry_max_retries', 'retry_initial_backoff_ms', 'retry_max_backoff_ms', "
            "'retry_backoff_multiplier', 'retry_jitter_factor', 'disable_retries')}))")
    r = subprocess.run([sys.executable, "-I", "-c", code, str(d), str(ROOT / "deploy" / "release"), json.dumps(argv)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_arguments_are_the_real_routers_flags(tmp_path):
    h = host(tmp_path, listen_address="10.0.0.1", api_key_file="/etc/ddtree/k.yaml")
    args = routermod.router_args(h)
    parsed = real_router_args(tmp_path, args)
    retry = routermod.retry_policy(h.vars["router"]["hold_secs"])
    assert parsed == {"host": "10.0.0.1", "port": 8000, "worker_urls": ["http://127.0.0.1:30000", "http://127.0.0.1:30001"],
                      "policy": "cache_aware", "prometheus_host": "127.0.0.1", "prometheus_port": 29000,
                      "health_check_interval_secs": 1, "health_failure_threshold": 2,
                      "api_key": "Kinprocess0123456789", "shutdown_grace_period_secs": 30,
                      "retry_max_retries": retry["max_retries"], "retry_initial_backoff_ms": retry["initial_backoff_ms"],
                      "retry_max_backoff_ms": retry["max_backoff_ms"],
                      "retry_backoff_multiplier": retry["backoff_multiplier"],
                      "retry_jitter_factor": retry["jitter_factor"], "disable_retries": False}
    assert retry["max_retries"] > 1  # the default hold is not zero
    # the GPU servers behind it listen on loopback only
    assert {s.listen for s in h.services} == {"127.0.0.1"}


@pytest.mark.parametrize("hold", [0, 1, 2, 7, 30, 90, 601, 3600])
def test_the_hold_is_the_fewest_attempts_whose_shortest_waits_span_it(hold):
    p = routermod.retry_policy(hold)
    n = p["max_retries"]
    shortest = routermod.backoffs_ms(n, -p["jitter_factor"])
    assert sum(shortest) >= hold * 1000
    assert n == 1 or sum(routermod.backoffs_ms(n - 1, -p["jitter_factor"])) < hold * 1000
    assert n >= 1 and all(w <= p["max_backoff_ms"] for w in routermod.backoffs_ms(n))
    if hold:  # never past the hold by more than the jitter and one capped wait
        assert sum(routermod.backoffs_ms(n, p["jitter_factor"])) <= hold * 1000 * (1 + p["jitter_factor"]) / (
            1 - p["jitter_factor"]) + p["max_backoff_ms"] * (1 + p["jitter_factor"])


@pytest.mark.parametrize("bad", [-1, 1.5, "90", True, None])
def test_a_hold_that_is_not_whole_seconds_is_refused(bad):
    with pytest.raises(ValueError, match="hold_secs"):
        routermod.retry_policy(bad)


def test_the_hold_follows_the_inventory_and_changes_the_routers_digest(tmp_path):
    h = host(tmp_path)
    none = dataclasses.replace(h, vars=dict(h.vars, router=dict(h.vars["router"], hold_secs=0)))
    longer = dataclasses.replace(h, vars=dict(h.vars, router=dict(h.vars["router"], hold_secs=300)))
    parsed = {n: real_router_args(tmp_path, routermod.router_args(x)) for n, x in
              (("none", none), ("default", h), ("longer", longer))}
    assert parsed["none"]["retry_max_retries"] == 1
    assert parsed["default"]["retry_max_retries"] < parsed["longer"]["retry_max_retries"]
    w = routermod.Wheel(Path("/nonexistent.whl"), "sglang_router-0.3.2-x.whl", "0.3.2", "0" * 64)
    digests = {routermod.manifest_entry(x, w, routermod.files(x, w))["digest"] for x in (none, h, longer)}
    assert len(digests) == 3


def test_the_launcher_refuses_a_key_on_its_command_line(tmp_path):
    r = subprocess.run([sys.executable, "-I", str(ROOT / "deploy" / "release" / "router_launch.py"), "--",
                        "--api-key", "Kleakedleakedleaked"], capture_output=True, text=True)
    assert r.returncode != 0 and "refusing --api-key on the command line" in r.stderr and "Kleaked" not in r.stderr


def test_pin_and_wheel_check(tmp_path):
    assert routermod.pin("sglang-router==0.3.2 --hash=sha256:" + "a" * 64 + "\n") == ("0.3.2", "a" * 64)
    with pytest.raises(routermod.RouterError, match="no `sglang-router==VERSION"):
        routermod.pin("sglang-router>=0.3\n")
    fake = tmp_path / "sglang_router-0.3.2-cp38-abi3-manylinux_2_17_x86_64.whl"
    fake.write_bytes(b"not the pinned wheel")
    with pytest.raises(routermod.RouterError, match="sha256 differs from the pin"):
        routermod.wheel(tmp_path)
    with pytest.raises(routermod.RouterError, match="run scripts/bootstrap"):
        routermod.wheel(tmp_path / "empty")


def test_metrics_parsing_on_captured_text():
    busy = metrics.serving((CAPTURES / "labserver-metrics-busy.txt").read_text())
    idle = metrics.serving((CAPTURES / "labserver-metrics-idle.txt").read_text())
    assert busy["running"] == 3 and busy["queued"] == 0 and metrics.in_flight(busy) == 3
    assert busy["accept_length"] is None  # a 0.0 gauge: no scheduler has decoded yet
    assert idle["running"] == 0 and metrics.in_flight(idle) == 0 and idle["accept_length"] == 2.2
    assert idle["generation_tokens"] == 60 and idle["prompt_tokens"] == 6 and idle["requests"] == 3
    # two schedulers (dp ranks): summed, accept length averaged
    two = "\n".join(["# TYPE sglang:num_running_reqs gauge",
                     'sglang:num_running_reqs{model_name="m",dp_rank="0"} 2.0',
                     'sglang:num_running_reqs{model_name="m",dp_rank="1"} 5.0',
                     "# TYPE sglang:spec_accept_length gauge",
                     'sglang:spec_accept_length{model_name="m",dp_rank="0"} 3.0',
                     'sglang:spec_accept_length{model_name="m",dp_rank="1"} 4.0', ""])
    f = metrics.serving(two)
    assert f["running"] == 7 and f["accept_length"] == 3.5 and f["queued"] is None and metrics.in_flight(f) == 7
    assert metrics.in_flight(metrics.serving("# nothing here\n")) is None
    with pytest.raises(metrics.MetricsError):
        metrics.serving('sglang:num_running_reqs{model_name="m" 1\n')


def test_metric_names_are_sglang_0_5_17s():
    """Every name the parser reads (and the stand-in exports) is declared in SGLang 0.5.17's own collector."""
    found = glob.glob(str(ROOT / ".venv-sglang-0.5.17/lib/python3*/site-packages/sglang/srt/observability/"
                                 "metrics_collector.py"))
    if not found:
        pytest.skip("the SGLang 0.5.17 venv (scripts/bootstrap) is not here")
    declared = set(re.findall(r'name="(sglang:[a-z_]+)"', Path(found[0]).read_text()))
    wanted = {n[:-len("_total")] if n.endswith("_total") and n not in declared else n
              for n in list(metrics.SUMMED) + list(metrics.MEAN)}
    assert wanted <= declared, wanted - declared
    exported = set(re.findall(r"^# TYPE (sglang:[a-z_]+)", (CAPTURES / "labserver-metrics-idle.txt").read_text(), re.M))
    assert exported <= declared | {n[:-len("_total")] for n in declared}, exported - declared


def test_router_down_refusal_and_no_drain_are_pure_plan_decisions(tmp_path):
    from deploy.release import changes, payload
    down = {"router": {"expected": True, "alive": False, "detail": "inactive, /liveness HTTP None"}}
    why = changes.router_refusal(down, restarting=True, no_drain=False)
    assert why.startswith("router: sglang-router.service is down (inactive, /liveness HTTP None)") and "--no-drain" in why
    assert changes.router_refusal(down, restarting=False, no_drain=False) is None      # nothing to drain
    assert changes.router_refusal(down, restarting=True, no_drain=True) is None        # the operator said so
    assert changes.router_refusal({"router": {"expected": True, "alive": True}}, True, False) is None
    assert changes.router_refusal({"router": {"expected": False}}, True, False) is None  # no router yet: first deploy
    h = host(tmp_path)
    man = {"release": "r1", "router": {"enabled": True, "address": "127.0.0.1", "port": 8000, "drain_timeout": 30,
                                       "api_key_file": None, "digest": "d", "unit": "sglang-router.service"},
           "services": {"gpu0": {"gpu": 0, "port": 30000, "enabled": True, "digest": "x", "model": "/m",
                                 "algorithm": "DDTREE"},
                        "gpu1": {"gpu": 1, "port": 30001, "enabled": True, "digest": "y", "model": "/m",
                                 "algorithm": "DDTREE"}}}
    state = {"manifest": man, "current": "r1"}
    drained = payload.restart_payload(h, state, None)
    assert [b["drain"]["workers"]["gpu1"] for b in drained["batches"]] == ["http://127.0.0.1:30001"] * 2
    assert drained["batches"][0]["drain"]["timeout"] == 30 and "router" not in drained  # a restart leaves it be
    assert [b["drain"] for b in payload.restart_payload(h, state, None, no_drain=True)["batches"]] == [None, None]


def test_switching_the_router_off_stops_and_disables_it_with_the_activation(tmp_path):
    from deploy.release import payload
    h = host(tmp_path)
    on = {"release": "r1", "router": {"enabled": True, "unit": "sglang-router.service", "venv": "/opt/ddtree/router/v",
                                      "wheel": {"path": "wheels/w.whl", "sha256": "0" * 64}},
          "plugin": {"wheel": "wheels/p.whl", "dist": "p"}, "services": {}}
    off = dict(on, release="r2", router={"enabled": False})
    act = payload.activation(h, off, on)
    assert act["commands"]["disable"] == ["systemctl", "disable", "--now", "--quiet", "sglang-router.service"]
    assert act["router_venv"] is None
    back = payload.activation(h, on, off)
    assert "sglang-router.service" in back["commands"]["enable"] and back["commands"]["disable"] is None
