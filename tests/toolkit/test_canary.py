"""The rollout gate's canary and the start-time expectation: the pure parts (deploy/canary.py, deploy/startup.py,
the inventory's `canary:` and `start_seconds`), and the host agent's canary against the lab stand-in on loopback
(real HTTP, real processes; the stand-in told to be lossy or to collapse its acceptance)."""
from __future__ import annotations

import json
import textwrap
import urllib.error
import urllib.request

import pytest

from deploy import canary, startup
from deploy.inventory import InventoryError, parse_inventory
from deploy.release import gateplan
from deploy.remote.host import gate as agent
from deploy.yamlpos import load_yaml

from test_gate_local import EXPECT, labserver  # noqa: F401 (the fixture)


# ---------------------------------------------------------------- start-time expectation

def test_expected_start_follows_budget_and_family():
    hyb = [startup.expected_start("tree-verify", b, "hybrid") for b in (15, 31, 63, 127, 255)]
    assert hyb == sorted(hyb) and len(set(hyb)) == len(hyb)  # grows with the budget, past the last point too
    assert startup.expected_start("tree-verify", 127, "dense") < startup.expected_start("tree-verify", 127, "hybrid")
    # between two points: between their figures; an unknown family: the slower one's
    mid = startup.expected_start("tree-verify", 47, "hybrid")
    assert startup.expected_start("tree-verify", 31, "hybrid") < mid < startup.expected_start("tree-verify", 63,
                                                                                             "hybrid")
    assert startup.expected_start("tree-verify", 100, None) == startup.expected_start("tree-verify", 100, "hybrid")
    assert startup.expected_start("linear", 127) == startup.expected_start("linear", 1)
    assert startup.expected_start("tree-verify", 127, "hybrid", override=30) == 30


def test_start_timeout_derives_from_the_expectation_and_is_capped():
    small, big = startup.start_timeout(10, 7200), startup.start_timeout(400, 7200)
    assert small < big and big >= 400 * startup.FACTOR
    assert startup.start_timeout(400, 120) == 120


def test_rollout_estimate_counts_batches_and_runs_hosts_in_parallel():
    one = startup.rollout_estimate([[[100.0], [100.0]]], parallel=4)
    assert one["gpus"] == 2 and one["batches"] == 2
    two = startup.rollout_estimate([[[100.0], [100.0]], [[100.0], [100.0]]], parallel=4)
    assert two["seconds"] == one["seconds"] and two["gpus"] == 4 and two["batches"] == 4
    serial = startup.rollout_estimate([[[100.0], [100.0]], [[100.0], [100.0]]], parallel=1)
    assert serial["seconds"] == 2 * one["seconds"]
    batched = startup.rollout_estimate([[[100.0, 300.0]]], parallel=1)  # a batch lasts as long as its slowest
    assert batched["seconds"] == round(300 + startup.GATE_S)
    line = startup.estimate_line(two)
    assert line.startswith(f"expected rollout time ~{two['seconds']} s (4 GPUs in 4 batches x ~")


# ---------------------------------------------------------------- a host left without a worker

def test_a_batch_that_takes_every_worker_out_says_how_long_the_router_holds(tmp_path):
    one = inv(tmp_path, "router: {hold_secs: 120}\n").hosts["a"]  # one GPU: its restart leaves the router empty
    [line] = gateplan.outage_lines(one, [["gpu0"]], {"gpu0": 60.0})
    assert "no worker serves" in line and "up to 120 s" in line and f"~{round(60 + startup.GATE_S)} s" in line
    [warn] = gateplan.outage_lines(one, [["gpu0"]], {"gpu0": 600.0})
    assert warn.startswith("WARNING") and "503" in warn and "router.hold_secs" in warn
    none = inv(tmp_path, "router: {hold_secs: 0}\n").hosts["a"]
    assert gateplan.outage_lines(none, [["gpu0"]], {"gpu0": 1.0})[0].startswith("WARNING")
    off = inv(tmp_path, "router: {enabled: false}\n").hosts["a"]
    assert gateplan.outage_lines(off, [["gpu0"]], {"gpu0": 600.0}) == []


def test_a_host_that_keeps_a_worker_serving_has_no_outage(tmp_path):
    p = tmp_path / "two.yaml"
    p.write_text("reference: a\nhosts:\n  a:\n    address: 10.0.0.1\n    gpus: 2\n")
    two = parse_inventory(load_yaml(str(p)), str(p)).hosts["a"]
    assert gateplan.outage_lines(two, [["gpu0"], ["gpu1"]], {}) == []
    [line] = gateplan.outage_lines(two, [["gpu0", "gpu1"]], {})  # a batch as wide as the host
    assert "gpu0, gpu1 restart no worker serves" in line


# ---------------------------------------------------------------- the inventory's canary

def inv(tmp_path, extra: str):
    p = tmp_path / "inv.yaml"
    p.write_text(textwrap.dedent("""\
        reference: a
        hosts:
          a:
            address: 10.0.0.1
            gpus: 1
            vars:
        """) + textwrap.indent(textwrap.dedent(extra), "      "))
    return parse_inventory(load_yaml(str(p)), str(p))


def test_inventory_canary_is_validated_with_file_and_line(tmp_path):
    with pytest.raises(InventoryError) as e:
        inv(tmp_path, """\
            canary:
              tokens: 0
              margin: -1
              prompts: ["ok", [1, -2]]
              speed: 3
            start_seconds: 0
            """)
    msg = str(e.value)
    assert "inv.yaml:8: hosts.a.vars.canary: tokens: must be an integer in [1, 512]" in msg, msg
    assert "inv.yaml:9: hosts.a.vars.canary: margin:" in msg
    assert "inv.yaml:10: hosts.a.vars.canary: prompts:" in msg and "token-id prompt" in msg
    assert "inv.yaml:11: hosts.a.vars.canary: speed: unknown key" in msg
    assert "inv.yaml:12: hosts.a.vars.start_seconds:" in msg


def test_inventory_canary_settings_and_defaults(tmp_path):
    i = inv(tmp_path, """\
        canary:
          prompts: ["The capital of France is", [5, 6, 7]]
          accept_floor: 2.5
        start_seconds: 40
        """)
    h = i.hosts["a"]
    cfg = canary.settings(h.vars)
    assert cfg["tokens"] == canary.DEFAULT_TOKENS and cfg["margin"] == canary.DEFAULT_MARGIN
    specs, notes = canary.plan_host(h, [], "digest")
    assert specs["gpu0"]["prompts"] == [{"text": "The capital of France is"}, {"input_ids": [5, 6, 7]}]
    assert specs["gpu0"]["accept_floor"] == 2.5 and "accept floor 2.5 (the inventory's" in notes["gpu0"]
    assert h.vars["start_seconds"] == 40


def test_default_prompts_are_the_tiny_kits():
    smoke = pytest.importorskip("sglang_ddtree_tools.smoke")
    assert canary.kit_prompts() == smoke.make_prompts(4)


def _result(created, digest, runs, tiny=None):
    return {"created": created, "host": "a", "release": created, "plugin": {"source_digest": digest},
            "model": "/m/t", "draft_model": "/m/d", "tiny": tiny, "report": {"runs": runs}}


def _run(mode, budget, levels):
    return {"mode": mode, "budget": budget, "levels": [
        {"concurrency": c, "errors": 0, "accept_length": al} for c, al in levels]}


def test_accept_floor_from_the_hosts_bench_result():
    results = [
        _result("2026-01-01", "d1", [_run("tree-verify", 63, [(1, 7.5), (8, 7.0)]), _run("dflash", None, [(1, 5.0)])]),
        _result("2026-01-02", "d1", [_run("tree-verify", 63, [(1, 8.0)])]),
        _result("2026-01-03", "d2", [_run("tree-verify", 63, [(1, 9.0)])]),  # another plugin source
        _result("2026-01-04", "d1", [_run("tree-verify", 63, [(1, 9.5)])], tiny="dense"),  # the tiny pair
    ]
    kw = dict(plugin_digest="d1", model="/m/t", draft_model="/m/d")
    floor, src = canary.bench_floor(results, mode="tree-verify", budget=63, **kw)
    assert floor == pytest.approx(canary.FLOOR_FRACTION * 8.0) and "2026-01-02" in src  # the newest that applies
    floor, src = canary.bench_floor(results, mode="linear", budget=64, **kw)
    assert floor == pytest.approx(canary.FLOOR_FRACTION * 5.0)
    floor, why = canary.bench_floor(results, mode="tree-verify", budget=127, **kw)
    assert floor is None and "no bench result" in why and "B=127" in why


def test_attach_gives_each_gate_its_canary_and_start_timeout():
    payload = {"batches": [{"instances": ["gpu0"], "gates": {"gpu0": {"port": 1}}},
                           {"instances": ["gpu1"], "gates": {"gpu1": {"port": 2}}}]}
    canary.attach(payload, {"gpu0": {"tokens": 3}, "gpu1": None}, {"gpu0": 100, "gpu1": 200})
    g0, g1 = payload["batches"][0]["gates"]["gpu0"], payload["batches"][1]["gates"]["gpu1"]
    assert g0["canary"] == {"tokens": 3} and g0["start_timeout"] == 100
    assert "canary" not in g1 and g1["start_timeout"] == 200


# ---------------------------------------------------------------- the agent's canary against the stand-in

PLUGIN = {"SGLANG_PLUGINS": "ddtree"}  # as the unit of a DDTREE service sets it: the plugin loaded
SPEC = {"prompts": [{"input_ids": p} for p in canary.kit_prompts(2)] + [{"text": "The capital of France is"}],
        "tokens": 8, "margin": 0.125, "accept_floor": 2.0, "floor_source": "test"}


def test_a_lossless_paying_server_passes_the_canary(labserver):  # noqa: F811
    _, port = labserver({**PLUGIN, "LABSERVER_TOKEN_SECONDS": "0"})
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=10, canary_spec=SPEC)
    assert g["ok"], g
    assert "canary" in g["steps"] and g["canary"]["tokens"] == 3 * 8 and g["canary"]["max_gap"] <= 0.125
    assert g["accept_length"] == g["canary"]["accept_length"] >= 2.0


def test_a_lossy_server_fails_the_canary_naming_prompt_position_and_gap(labserver):  # noqa: F811
    _, port = labserver({**PLUGIN, "LABSERVER_TOKEN_SECONDS": "0", "LABSERVER_OFF_ARGMAX": "5"})
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=10, canary_spec=SPEC)
    assert not g["ok"] and g["step"] == "canary", g
    assert g["detail"].startswith("prompt 0 (12 token ids) position 5: emitted token ")
    assert "is 2.950 nats below the target's argmax" in g["detail"] and "(margin 0.125 nats)" in g["detail"]


def test_a_collapsed_acceptance_fails_the_floor(labserver):  # noqa: F811
    _, port = labserver({**PLUGIN, "LABSERVER_TOKEN_SECONDS": "0", "LABSERVER_ACCEPT_LENGTH": "1.0"})
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=10, canary_spec=SPEC)
    assert not g["ok"] and g["step"] == "canary", g
    assert g["detail"] == "accept length 1.000 over 3 prompts is below the floor 2.0 (test)"
    # without a floor the same server passes: the floor is what refused it
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=10, canary_spec=dict(SPEC, accept_floor=None))
    assert g["ok"], g


def test_the_stand_in_refuses_logprobs_with_generation_like_dflash(labserver):  # noqa: F811
    _, port = labserver({**PLUGIN, "LABSERVER_TOKEN_SECONDS": "0"})
    assert agent.gate(port, EXPECT, start_timeout=10, gate_timeout=10)["ok"]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True}).encode(),
        headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400 and b"return_logprob" in e.value.read()


def test_linear_mode_canary_checks_the_accept_length_only(tmp_path, labserver):  # noqa: F811
    """`linear` is SGLang's DFLASH without the plugin, which refuses every logprob request: its canary does not
    re-score (a re-score there fails, refused), and still holds the accept floor."""
    i = inv(tmp_path, """\
        mode: linear
        canary: {accept_floor: 2.0}
        """)
    specs, notes = canary.plan_host(i.hosts["a"], [], "d")
    assert specs["gpu0"]["rescore"] is False and "no lossless re-score in linear mode" in notes["gpu0"]
    _, port = labserver({"LABSERVER_TOKEN_SECONDS": "0"}, algorithm="DFLASH")
    expect = dict(EXPECT, algorithm="DFLASH")
    g = agent.gate(port, expect, start_timeout=10, gate_timeout=10, canary_spec=dict(SPEC, rescore=False))
    assert g["ok"] and g["canary"]["max_gap"] is None and g["canary"]["accept_length"] >= 2.0, g
    g = agent.gate(port, expect, start_timeout=10, gate_timeout=10, canary_spec=SPEC)
    assert not g["ok"] and g["step"] == "canary" and "does not support return_logprob" in g["detail"], g


def test_gate_plan_gives_each_gate_a_timeout_from_its_family_and_prints_the_estimate(tmp_path):
    import types

    i = inv(tmp_path, """\
        mode: tree-verify
        budget: 127
        model: /m/t
        start_timeout: 7200
        """)
    h = i.hosts["a"]
    payload = {"batches": [{"instances": ["gpu0"], "gates": {"gpu0": {"port": 30000}}}]}
    timeouts = {}
    for fam, config in (("hybrid", {"model_type": "qwen3_next"}), ("dense", {"model_type": "qwen3"})):
        p = types.SimpleNamespace(host=h, probe={"configs": {"/m/t": {"config": config}}},
                                  payload=json.loads(json.dumps(payload)))
        lines = []
        est = gateplan.plan(str(tmp_path / "inv.yaml"), {"a": p}, "d", 16, lambda n, m: lines.append((n, m)))
        g = p.payload["batches"][0]["gates"]["gpu0"]
        timeouts[fam] = g["start_timeout"]
        assert g["canary"]["rescore"] is True and g["canary"]["accept_floor"] is None
        assert g["start_timeout"] == startup.start_timeout(startup.expected_start("tree-verify", 127, fam), 7200)
        assert ("local", startup.estimate_line(est)) == lines[-1] and est["gpus"] == 1
        assert any("no accept floor: no bench result" in m for _, m in lines), lines
    assert timeouts["hybrid"] > timeouts["dense"]


def test_restart_gates_get_the_start_timeout_of_their_mode_and_budget(tmp_path):
    from deploy.release import payload
    h = inv(tmp_path, "start_timeout: 7200\n").hosts["a"]
    svc = {"port": 30000, "digest": "x", "served_model_name": "m", "model": "/m", "algorithm": "DDTREE",
           "address": "127.0.0.1", "api_key_file": None, "enabled": True, "gpu": 0}
    man = {"services": {"gpu0": dict(svc, mode="tree-verify", budget=127)}}
    small = {"services": {"gpu0": dict(svc, mode="tree-verify", budget=15)}}
    [b] = payload.restart_batches(h, man, ["gpu0"], drain=False)
    [s] = payload.restart_batches(h, small, ["gpu0"], drain=False)
    assert b["gates"]["gpu0"]["start_timeout"] == startup.start_timeout(
        startup.expected_start("tree-verify", 127, None), 7200) > s["gates"]["gpu0"]["start_timeout"]


def _manifest(**services):
    return {"plugin": {"source_digest": "d1"}, "services": services}


def test_restart_and_rollback_gates_get_the_canary_of_the_release_they_come_back_on(tmp_path):
    """`fab restart` and `fab rollback` gate with the canary too, planned from the release the GPUs come back on
    (its mode, budget, model pair and plugin source), not from the inventory: a rollback to a `linear` release is
    not re-scored, a tree-verify one is, and the floor is that release's bench result."""
    h = inv(tmp_path, "canary: {tokens: 16}\n").hosts["a"]
    man = _manifest(gpu0={"mode": "tree-verify", "budget": 31, "model": "/m/t", "draft_model": "/m/d"},
                    gpu1={"mode": "linear", "budget": 31, "model": "/m/t", "draft_model": "/m/d"},
                    gpu2={"mode": "tree-verify", "budget": 31, "enabled": False})
    specs, notes = canary.plan_manifest(h, man, [dict(_result("2026-01-02", "d1", [
        _run("tree-verify", 31, [(1, 5.0)]), _run("dflash", None, [(1, 4.0)])]))])
    assert specs["gpu0"]["rescore"] is True and specs["gpu0"]["tokens"] == 16
    assert specs["gpu0"]["accept_floor"] == pytest.approx(canary.FLOOR_FRACTION * 5.0)
    assert specs["gpu1"]["rescore"] is False and specs["gpu1"]["accept_floor"] == pytest.approx(
        canary.FLOOR_FRACTION * 4.0) and "no lossless re-score in linear mode" in notes["gpu1"]
    assert "gpu2" not in specs  # a disabled service is not restarted
    # another plugin source than the release's: no floor, said
    specs, notes = canary.plan_manifest(h, dict(man, plugin={"source_digest": "d2"}), [_result(
        "2026-01-02", "d1", [_run("tree-verify", 31, [(1, 5.0)])])])
    assert specs["gpu0"]["accept_floor"] is None and "no bench result" in notes["gpu0"]

    payload = {"batches": [{"instances": ["gpu0", "gpu1"], "gates": {"gpu0": {"port": 1, "start_timeout": 99},
                                                                     "gpu1": {"port": 2}}}]}
    lines = []
    gateplan.runbook_canaries(str(tmp_path / "inv.yaml"), h, man, payload, lambda n, m: lines.append((n, m)))
    g = payload["batches"][0]["gates"]
    assert g["gpu0"]["canary"]["rescore"] is True and g["gpu0"]["start_timeout"] == 99  # the timeout is kept
    assert g["gpu1"]["canary"]["rescore"] is False
    assert ("a", f"gate of gpu0: {canary.plan_manifest(h, man, [])[1]['gpu0']}") in lines, lines


def test_a_hostile_manifest_gets_the_canary_without_a_floor(tmp_path):
    """A manifest is read from the host: an entry no release writes never crashes the plan, and the GPU still has
    to pass the lossless check where its mode is unknown (no re-score only where the mode says SGLang refuses it)."""
    h = inv(tmp_path, "").hosts["a"]
    man = {"plugin": "x", "services": {
        "gpu0": {"mode": "tree-verify", "budget": "1:zz", "model": 5},
        "gpu1": {"mode": "rm -rf /", "budget": 31},
        "gpu2": "not a mapping"}}
    specs, notes = canary.plan_manifest(h, man, [_result("2026-01-02", "d1", [_run("tree-verify", 31, [(1, 5.0)])])])
    assert specs["gpu0"]["accept_floor"] is None and specs["gpu0"]["rescore"] is True
    assert specs["gpu1"]["accept_floor"] is None and "no mode this toolkit knows" in notes["gpu1"]
    assert "gpu2" not in specs
    assert canary.plan_manifest(h, {"services": ["x"]}, []) == ({}, {})
    assert canary.plan_manifest(h, None, []) == ({}, {})
    # disabled in the inventory: no canary at all, said
    h = inv(tmp_path, "canary: {enabled: false}\n").hosts["a"]
    specs, notes = canary.plan_manifest(h, _manifest(gpu0={"mode": "tree-verify", "budget": 31}), [])
    assert specs == {"gpu0": None} and "canary.enabled is false" in notes["gpu0"]


def test_the_canary_stops_at_the_gates_deadline(labserver):  # noqa: F811
    _, port = labserver({**PLUGIN, "LABSERVER_TOKEN_SECONDS": "0"})
    assert agent.gate(port, EXPECT, start_timeout=10, gate_timeout=10)["ok"]
    ok, detail, info = agent.canary(port, SPEC, lambda: 1.0)
    assert not ok and detail == "prompt 0 (12 token ids): the gate's deadline (gate_timeout) passed after 0 of 3 prompts"


def test_canary_settings_merge_key_by_key_across_scopes(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text(textwrap.dedent("""\
        reference: a
        vars:
          canary: {margin: 0.5, tokens: 8}
        hosts:
          a:
            address: 10.0.0.1
            gpus: 1
            vars:
              canary: {accept_floor: 4}
        """))
    cfg = canary.settings(parse_inventory(load_yaml(str(p)), str(p)).hosts["a"].vars)
    assert (cfg["margin"], cfg["tokens"], cfg["accept_floor"]) == (0.5, 8, 4)
