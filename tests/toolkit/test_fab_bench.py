"""fab bench's control side without hosts: the plan and its refusals, the host's report read as hostile input, the
results kept per host and release, the plot and table, the `mode: auto` choice (ties, the nearest-concurrency
rule, missing results, results of another plugin or model), the inventory's `mode: auto` / `concurrency` checks,
and the host op's argument checks and command line (parsed by the plugin's own bench parser)."""
from __future__ import annotations

import copy
import json
import textwrap

import pytest

from deploy import bench
from deploy.inventory import InventoryError, load_inventory
from deploy.release import render
from deploy.remote.host import bench as hostbench
from deploy.remote.host.registry import Failure

DIGEST = "ab" * 32
OTHER = "cd" * 32
RELEASE = "20261202T010203Z-a1b2c3"

INV = """\
fleet: t
reference: h
vars:
  venv: /opt/v
  model: /models/T
  draft_model: /models/D
  mode: tree-verify
  budget: 16
  block_size: 16
hosts:
  h:
    address: 10.0.0.1
    gpus: 2
    services:
      1: {mode: auto, concurrency: 6, extra_args: [--chunked-prefill-size, "4096", --mem-fraction-static, "0.5",
                                                  --max-total-tokens=65536]}
"""


def inventory(tmp_path, text=INV):
    p = tmp_path / "inv.yaml"
    p.write_text(textwrap.dedent(text))
    return load_inventory(str(p))


def probe(**kw):
    base = {"current": RELEASE, "venv_trust": "ok",
            "manifest": {"plugin": {"version": "0.1.0+r2026", "source_digest": DIGEST}},
            "configs": {"/models/T": {"config": {"architectures": ["Qwen3NextForCausalLM"],
                                                 "layer_types": ["linear_attention", "full_attention"]}}}}
    return base | kw


# ----------------------------------------------------------------------------- the plan
def test_plan_takes_the_service_its_models_block_and_extra_args(tmp_path):
    h = inventory(tmp_path).hosts["h"]
    p = bench.plan_bench(h, probe())
    assert (p.gpu, p.instance, p.model, p.draft_model, p.block, p.release) == (0, "gpu0", "/models/T", "/models/D",
                                                                               16, RELEASE)
    assert p.plugin == {"version": "0.1.0+r2026", "source_digest": DIGEST}
    assert p.prefix.startswith("ddtree-bench-") and p.user == "sglang" and p.tiny is None
    assert "share its memory" in p.warnings[0]
    p1 = bench.plan_bench(h, probe(), gpu=1, server_args=("--max-running-requests", "32"))
    # the service's pool sizing (for a GPU of its own) stays with the service; the operator's --server-args win
    assert p1.server_args == ("--chunked-prefill-size", "4096", "--max-running-requests", "32")
    a = p1.agent_args()
    assert a["modes"] == ["plain", "dflash", "tree-verify"] and a["budgets"] == [15, 31, 63] and a["prompts"] is None
    t = bench.plan_bench(h, probe(), tiny=True)
    assert (t.tiny, t.model, t.server_args) == ("hybrid", None, ())
    assert "recurrent layers" in t.family_reason
    assert bench.plan_bench(h, probe(), tiny=True, family="dense").tiny == "dense"


@pytest.mark.parametrize("kw,pr,msg", [
    ({}, {"current": None}, "h has no active release: run `fab deploy` first"),
    ({}, {"current": "../../etc"}, "is not one this toolkit makes"),
    ({}, {"venv_trust": "site-packages is writable by group"}, "root will not run it"),
    ({"gpu": 5}, {}, "h has no GPU 5 (its GPUs: 0, 1)"),
    ({"server_args": ("--host", "0.0.0.0")}, {}, "the deploy tool sets --host itself"),
    ({"server_args": ("--api-key", "x")}, {}, "passes a secret"),
    ({"graphs": "sometimes"}, {}, "on, off or both"),
    ({"rounds": 0}, {}, "--rounds 0: 1 to 20"), ({"rounds": 21}, {}, "1 to 20"),
    ({"cpus": "0-3 8"}, {}, "a CPU list like 0-3,8"), ({"cpus": "$(reboot)"}, {}, "a CPU list like 0-3,8"),
    ({"tiny": True}, {"configs": {}}, "no readable config.json"),
    ({"overlap": "maybe"}, {}, "--overlap 'maybe': default, off, on, both"),
    ({"overlap": "both", "modes_": ("plain", "dflash")}, {}, "--modes has no tree-verify"),
])
def test_plan_refusals(tmp_path, kw, pr, msg):
    h = inventory(tmp_path).hosts["h"]
    with pytest.raises(bench.BenchRefused, match=msg.replace("(", r"\(").replace(")", r"\)")):
        bench.plan_bench(h, probe(**pr), **kw)


def test_plan_without_models(tmp_path):
    h = inventory(tmp_path, INV.replace("  draft_model: /models/D\n", "")).hosts["h"]
    with pytest.raises(bench.BenchRefused, match="has no draft_model: only --modes plain"):
        bench.plan_bench(h, probe())
    assert bench.plan_bench(h, probe(), modes_=("plain",)).draft_model is None


def test_argument_lists_and_prompt_files(tmp_path):
    assert bench.int_list("16,1,4", "--concurrency", 1, 1024) == (1, 4, 16)
    for bad in ("0", "1,x", ""):
        with pytest.raises(bench.BenchRefused):
            bench.int_list(bad, "--concurrency", 1, 1024)
    assert bench.mode_list("linear,tree-verify,dflash") == ("dflash", "tree-verify")
    with pytest.raises(bench.BenchRefused, match="choose from"):
        bench.mode_list("beam")
    f = tmp_path / "p.jsonl"
    f.write_text('[1, 2]\n{"input_ids": [3], "regime": 0}\n')
    assert bench.load_prompt_file(str(f)) == [[1, 2], [3]]
    f.write_text('[1, 2]\n[1, -4]\n')
    with pytest.raises(bench.BenchRefused, match=r"p.jsonl:2: a prompt is"):
        bench.load_prompt_file(str(f))
    with pytest.raises(bench.BenchRefused, match="No such file"):
        bench.load_prompt_file(str(tmp_path / "none.json"))


# ----------------------------------------------------------------------------- the report, as hostile input
def report(runs=None, **kw):
    lv = lambda c, tps, err=0: {"concurrency": c, "requests": 8, "errors": err, "output_tokens": 1024,  # noqa: E731
                                "output_tok_s": tps, "wall_s": 1.0, "accept_length": 2.5,
                                "ttft_ms": {"p50": 10.0, "p99": 20.0}, "itl_ms": {"p50": 2.0, "p99": 4.0},
                                "first_error": None}
    runs = runs if runs is not None else [
        ("plain", None, None, True, [(1, 100), (4, 380), (16, 1200)]),
        ("dflash", None, 16, True, [(1, 150), (4, 500), (16, 1300)]),
        ("tree-verify", 15, None, False, [(1, 210), (4, 520), (16, 1000)]),
        ("tree-verify", 31, None, False, [(1, 230), (4, 505), (16, 800)]),
    ]
    doc = {"schema": "ddtree-bench/1", "created": "2026-12-02T01:00:00Z", "ok": True, "host": "box",
           "gpu": {"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771, "memory_used_mib_at_start": 0},
           "versions": {"sglang": "0.5.17", "sglang-ddtree": "0.1.0", "sglang-ddtree-tools": "0.1.0+r1",
                        "torch": "2.11.0"}, "model": {},
           "settings": {"max_new_tokens": 128}, "runs": []}
    for mode, b, blk, g, levels in runs:
        doc["runs"].append({"mode": mode, "budget": b, "block": blk, "graphs": g, "status": "ok", "error": None,
                            "levels": [lv(*x) for x in levels]})
    doc.update(kw)
    return doc


def test_the_report_keeps_which_plugin_and_tools_measured():
    got = bench.parse_report(report())["versions"]
    assert got == {"sglang": "0.5.17", "sglang-ddtree": "0.1.0", "sglang-ddtree-tools": "0.1.0+r1", "torch": "2.11.0"}
    assert bench.parse_report(report(versions={"sglang-ddtree-tools": "x" * 500}))["versions"][
        "sglang-ddtree-tools"] == "x" * 100


def test_the_plugins_report_passes_the_control_sides_check():
    """Both sides of the schema: a report assembled by the plugin's own code is what parse_report accepts."""
    pb = pytest.importorskip("sglang_ddtree_tools.bench")
    recs = [pb.RequestRecord(sent=0.0, chunks=[(0.01, 1), (0.05, 8)], meta={"completion_tokens": 8, "spec_verify_ct": 3})]
    doc = {"schema": pb.SCHEMA, "created": "x", "host": "b", "ok": True, "versions": {}, "gpu": {"name": "g"},
           "model": {}, "settings": {"max_new_tokens": 8},
           "runs": [{"mode": "tree-verify", "budget": 15, "block": None, "draft_tokens": 16, "graphs": False,
                     "status": "ok", "error": None, "levels": [pb.aggregate_level(recs, 0.05, 1)]}]}
    assert pb.validate_report(doc) == []
    got = bench.parse_report(json.loads(json.dumps(doc)))
    assert got["runs"][0]["levels"][0]["accept_length"] == pytest.approx(8 / 3, abs=1e-3)
    # the decode step (40 ms over SGLang's 3 verify steps) is kept; a report from before it still reads
    assert got["runs"][0]["levels"][0]["step_ms"] == {"p50": pytest.approx(13.333, abs=1e-3),
                                                      "p99": pytest.approx(13.333, abs=1e-3)}
    assert "step_ms" not in bench.parse_report(report())["runs"][0]["levels"][0]
    bad = json.loads(json.dumps(doc))
    bad["runs"][0]["levels"][0]["step_ms"] = {"p50": "slow", "p99": 1}
    with pytest.raises(bench.BadReport, match="step_ms"):
        bench.parse_report(bad)
    # --rounds: the median round's row with every round's tok/s, kept on the control side too
    lv = pb.median_round([pb.aggregate_level(recs, w, 1) for w in (0.05, 0.04, 0.06)])
    doc["runs"][0]["levels"] = [lv]
    assert pb.validate_report(doc) == []
    kept = bench.parse_report(json.loads(json.dumps(doc)))["runs"][0]["levels"][0]
    assert kept["tok_s_rounds"] == lv["tok_s_rounds"] and kept["output_tok_s"] == sorted(lv["tok_s_rounds"])[1]
    doc["runs"][0]["levels"][0]["tok_s_rounds"] = ["fast"]
    with pytest.raises(bench.BadReport, match="tok_s_rounds"):
        bench.parse_report(doc)
    assert bench.REPORT_SCHEMA == pb.SCHEMA


def test_the_plugins_paired_section_is_kept_checked_and_shown():
    """--rounds: the host's paired comparisons (sglang_ddtree_tools.paired) pass the control side's check, are kept and
    printed under the table; numbers out of range, or a run the report does not have, refuse the report."""
    pp = pytest.importorskip("sglang_ddtree_tools.paired")

    level = report()["runs"][0]["levels"][0]

    def run(mode, per_round, **kw):
        rounds = [{"status": "ok", "levels": [dict(level, output_tok_s=v)]} for v in per_round]
        return {"mode": mode, "budget": kw.get("budget"), "block": kw.get("block"), "graphs": True, "status": "ok",
                "error": None, "rounds": rounds, "levels": [dict(level, output_tok_s=sorted(per_round)[0])]}
    doc = report()
    doc["runs"] = [run("dflash", [100.0, 200.0], block=16), run("tree-verify", [150.0, 180.0], budget=31)]
    doc["paired"] = pp.report_section(doc)
    got = bench.parse_report(json.loads(json.dumps(doc)))
    assert got["paired"] == [{"run": "tree-verify B=31 graphs=on", "peer": "dflash blk=16 graphs=on", "concurrency": 1,
                              "n": 2, "median_ratio": 1.2, "interval": None, "ahead": 1, "ratios": [1.5, 0.9]}]
    assert bench.paired_lines(got) == ["tree-verify B=31 graphs=on / dflash blk=16 graphs=on at c=1: median paired "
                                       "ratio 1.20x (95% interval none with 2 pairs (6 needed)), ahead in 1 of 2 "
                                       "rounds; ratios 1.50 0.90"]
    for mutate in (lambda r: r.update(run="tree-verify B=63 graphs=on"),    # not a run of this report
                   lambda r: r.update(peer="\x1b]0;owned\x07plain"), lambda r: r.update(ratios=[1.5]),
                   lambda r: r.update(median_ratio=-1), lambda r: r.update(ahead=3), lambda r: r.update(interval=[1])):
        d = json.loads(json.dumps(doc))
        mutate(d["paired"][0])
        with pytest.raises(bench.BadReport, match=r"paired\[0\]"):
            bench.parse_report(d)
    assert bench.parse_report(report())["paired"] == []  # one round: no section


def test_parse_report_refuses_what_is_not_a_report_and_cuts_strings():
    assert bench.parse_report(report())["runs"][2]["budget"] == 15
    for mutate, needle in [
        (lambda d: d.update(schema="x"), "schema is 'x'"),
        (lambda d: d["runs"][0].update(mode="rm -rf"), "runs[0].mode 'rm -rf'"),
        (lambda d: d["runs"][2].update(budget="15"), "runs[2].budget"),
        (lambda d: d["runs"][1].update(graphs=1), "runs[1].graphs"),
        (lambda d: d["runs"][0]["levels"][0].update(output_tok_s=float("nan")), "output_tok_s"),
        (lambda d: d["runs"][0]["levels"][1].update(output_tok_s=-5), "output_tok_s"),
        (lambda d: d["runs"][0]["levels"][1].update(concurrency=True), "concurrency"),
        (lambda d: d["runs"][0]["levels"][1].update(ttft_ms=[1, 2]), "ttft_ms"),
        (lambda d: d.update(runs=[{}] * 300), "at most 256"),
        (lambda d: d["runs"].append("x"), "runs[4] is not an object"),
    ]:
        d = report()
        mutate(d)
        with pytest.raises(bench.BadReport) as ei:
            bench.parse_report(d)
        assert any(needle in p for p in ei.value.problems), ei.value.problems
    with pytest.raises(bench.BadReport, match="not a JSON object"):
        bench.parse_report([1])
    d = report()
    d["runs"][0]["error"] = "[bold red]x[/] " + "y" * 10000
    d["gpu"]["name"] = "n" * 500
    d["extra"] = {"anything": "dropped"}
    got = bench.parse_report(d)
    assert len(got["runs"][0]["error"]) == bench.MAX_TEXT and len(got["gpu"]["name"]) == 100 and "extra" not in got


def test_outcome_lines():
    assert bench.outcome({"report": {"cannot_run": "no GPU device /dev/nvidiactl"}})[:2] == (
        2, "cannot run: no GPU device /dev/nvidiactl")
    code, line, _ = bench.outcome({"rc": 1, "report": None, "stderr": "x\nModuleNotFoundError: No module named "
                                                                      "'sglang_ddtree'"})
    assert code == 1 and "venv has no sglang_ddtree (the serving plugin" in line
    code, line, rep = bench.outcome({"report": report()})
    assert code == 0 and line == "ok: 4/4 servers measured (12 levels)" and rep["runs"]
    bad = report()
    bad["runs"][3].update(status="failed", error="RuntimeError: server exited during start-up:\nrefused", levels=[])
    code, line, _ = bench.outcome({"report": bad})
    assert code == 1 and "3/4 servers measured" in line
    assert "tree-verify B=31 graphs=off: RuntimeError: server exited during start-up: ... refused" in line
    code, line, _ = bench.outcome({"report": report(schema="evil")})
    assert code == 1 and line.startswith("the host's report was refused: schema is 'evil'")


# ----------------------------------------------------------------------------- kept results
def record(rep=None, release=RELEASE, digest=DIGEST, model="/models/T", draft="/models/D", created=None, tiny=None):
    rep = bench.parse_report(rep or report())
    if created:
        rep["created"] = created
    return {"created": rep["created"], "host": "h", "release": release, "plugin": {"version": "v", "source_digest": digest},
            "gpu": 0, "instance": "gpu0", "model": None if tiny else model, "draft_model": None if tiny else draft,
            "tiny": tiny, "block": 16, "prompts": "random", "report": rep}


def test_results_are_kept_per_host_and_release_and_checked_again(tmp_path):
    inv = str(tmp_path / "inv.yaml")
    p = bench.save_result(inv, record())
    assert p == tmp_path / "bench" / "h" / f"{RELEASE}.json"
    bench.save_result(inv, record(created="2026-12-02T02:00:00Z"))
    got, problems = bench.load_results(inv, "h")
    assert len(got) == 2 and problems == [] and json.loads(p.read_text())["schema"] == bench.RESULT_SCHEMA
    with pytest.raises(ValueError, match="not a host name and release id"):
        bench.save_result(inv, record(release="../../../etc/cron.d/x"))
    doc = json.loads(p.read_text())  # an edited file: the bad result is named and left out, the good one used
    doc["results"][0]["report"]["runs"][0]["levels"][0]["output_tok_s"] = "fast"
    p.write_text(json.dumps(doc))
    got, problems = bench.load_results(inv, "h")
    assert len(got) == 1 and "results[0]" in problems[0] and "output_tok_s" in problems[0]
    (p.parent / "20261201T000000Z-000000.json").write_text(json.dumps(dict(doc, release="20990101T000000Z-ffffff")))
    got, problems = bench.load_results(inv, "h")
    assert any("20261201T000000Z-000000.json: not a" in x for x in problems)
    assert bench.load_results(inv, "nohost") == ([], [])


def test_plot_and_table(tmp_path):
    pytest.importorskip("matplotlib")
    rec = record()
    png = bench.plot(rec, tmp_path / "b" / "x.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    from rich.console import Console

    rec["report"]["runs"][0]["levels"] = []
    rec["report"]["runs"][0]["error"] = "[red]boom[/red]"
    for wide in (True, False):
        con = Console(width=200 if wide else 100, record=True)
        con.print(bench.table(rec, wide=wide))
        for line in ([] if wide else bench.failure_notes(rec)):
            con.print(line, markup=False, highlight=False)
        text = con.export_text()
        assert "[red]boom[/red]" in text and "FAILED" in text  # shown as is, never as markup
        assert "tree-verify B=15 graphs=off" in text and "NVIDIA H200" in text
        assert "step p50 ms" in text.replace("\np50 ms", " p50 ms") or "p50 ms" in text  # "-" without step_ms
        assert ("ITL p99 ms" in text) == wide   # the narrow view leaves ITL p99 to --wide and --json
    # narrow: one line per run and level, none over 100 characters
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100
    for r in bench.rows(rec["report"]):
        assert sum(1 for ln in lines if ln.startswith(r["label"][:20]) and (
            "failed" in r or f" {r['concurrency']} " in ln)) >= 1, (r["label"], text)
    assert len([ln for ln in lines if ln.startswith(("plain", "dflash", "tree-verify")) and ": FAILED: " not in ln]
               ) == len(bench.rows(rec["report"]))
    assert "plain graphs=on: FAILED: [red]boom[/red]" in lines  # the reason in full under the table
    rec["report"]["runs"][1]["levels"][0]["step_ms"] = {"p50": 2.714, "p99": 3.3}
    con = Console(width=100, record=True)
    con.print(bench.table(rec))
    assert "2.71" in con.export_text()


# ----------------------------------------------------------------------------- mode: auto
def graphs(mode):
    return mode != "tree-verify"  # what the deploy renders today (render.decode_cuda_graphs, tested below)


def pick(results, concurrency, **kw):
    args = dict(host="h", plugin_digest=DIGEST, model="/models/T", draft_model="/models/D",
                concurrency=concurrency, block_size=16, graphs_for=graphs) | kw
    return bench.choose(results, **args)


def test_choice_at_the_measured_concurrency():
    rs = [record()]
    c = pick(rs, 1)
    assert (c.mode, c.budget, c.tok_s, c.concurrency) == ("tree-verify", 31, 230, 1)
    assert c.runner_up == "tree-verify B=15 210.0 tok/s"
    c = pick(rs, 16)
    assert (c.mode, c.budget, c.concurrency) == ("linear", None, 16)
    assert "NOTE plain decoding measured 1200.0" not in c.note()  # 1300 > 1200


def test_nearest_concurrency_is_on_a_log_scale_and_a_tie_goes_up():
    assert bench.nearest_level([1, 4, 16], 8) == 16  # |log 4 - log 8| == |log 16 - log 8|: the higher
    assert bench.nearest_level([1, 4, 16], 6) == 4
    assert bench.nearest_level([1, 4, 16], 2) == 4  # 2 is as near 1 as 4 on a log scale: the higher
    assert bench.nearest_level([1, 4, 16], 3) == 4
    assert bench.nearest_level([1, 4, 16], 1000) == 16
    c = pick([record()], 6)
    assert (c.concurrency, c.wanted, c.mode, c.budget) == (4, 6, "tree-verify", 15)
    assert "nearest measured to 6" in c.note()


def test_ties_go_to_the_simpler_mode_then_the_smaller_budget():
    rs = [record(report(runs=[("dflash", None, 16, True, [(4, 500.0)]),
                              ("tree-verify", 15, None, False, [(4, 503.0)]),
                              ("tree-verify", 7, None, False, [(4, 504.0)])]))]
    assert pick(rs, 4).mode == "linear"  # all within 1% of 504
    rs = [record(report(runs=[("dflash", None, 16, True, [(4, 400.0)]),
                              ("tree-verify", 31, None, False, [(4, 504.0)]),
                              ("tree-verify", 7, None, False, [(4, 500.0)])]))]
    assert (pick(rs, 4).mode, pick(rs, 4).budget) == ("tree-verify", 7)
    rs = [record(report(runs=[("dflash", None, 16, True, [(4, 400.0)]), ("tree-verify", 31, None, False, [(4, 520.0)]),
                              ("tree-verify", 7, None, False, [(4, 500.0)])]))]
    assert pick(rs, 4).budget == 31  # 500 is not within 1% of 520


def test_only_runs_the_deploy_can_serve_as_measured_count():
    rs = [record(report(runs=[("tree-verify", 15, None, True, [(1, 900.0)]),  # graphs on: not what deploy runs
                              ("dflash", None, 8, True, [(1, 800.0)]),  # another block than the service's
                              ("tree-verify", 31, None, False, [(1, 700.0, 2)]),  # failed requests
                              ("plain", None, None, True, [(1, 650.0)]),
                              ("dflash", None, 16, True, [(1, 300.0)])]))]
    c = pick(rs, 1)
    assert (c.mode, c.tok_s) == ("linear", 300.0) and "NOTE plain decoding measured 650.0" in c.note()
    assert pick(rs, 1, graphs_for=lambda m: True).mode == "tree-verify"  # once the deploy runs its graphs
    with pytest.raises(bench.NoChoice, match="has no run the deploy can serve"):
        pick([record(report(runs=[("plain", None, None, True, [(1, 1.0)])]))], 1)


def test_missing_results_and_results_of_another_plugin_or_model_refuse():
    with pytest.raises(bench.NoChoice, match=r"no bench result for host h, model /models/T with drafter /models/D, "
                                             r"plugin source abababababab \(none kept for this host\); run `fab bench h`"):
        pick([], 4)
    for r in (record(digest=OTHER), record(model="/models/Other"), record(draft="/models/D2"), record(tiny="hybrid")):
        with pytest.raises(bench.NoChoice, match=r"no bench result for host h.*\(kept: 20261202T010203Z-a1b2c3"):
            pick([r], 4)
    with pytest.raises(bench.NoChoice, match="no source digest"):
        pick([record()], 4, plugin_digest=None)
    with pytest.raises(bench.NoChoice, match="no bench result"):
        pick([dict(record(), host="other")], 4)


def test_the_newest_matching_result_decides():
    old = record(report(runs=[("dflash", None, 16, True, [(4, 900.0)])]), created="2026-12-01T00:00:00Z")
    new = record(report(runs=[("tree-verify", 15, None, False, [(4, 100.0)])]), created="2026-12-02T00:00:00Z")
    assert pick([new, old], 4).mode == "tree-verify" and new["created"] in pick([old, new], 4).source


def test_tree_verify_counts_only_on_the_scheduler_the_service_asks_for():
    """A DDTREE run is on the scheduler its server said it ran (else the one asked); a service gets tree-verify
    measured on its own scheduler: the overlap one where its env sets SGLANG_DDTREE_OVERLAP=1."""
    rep = report(runs=[("dflash", None, 16, True, [(1, 150)]), ("tree-verify", 63, None, False, [(1, 200)]),
                       ("tree-verify", 63, None, False, [(1, 240)]), ("tree-verify", 127, None, False, [(1, 260)])])
    rep["runs"][2]["overlap_schedule"] = True  # --overlap both: the same budget on the overlap scheduler
    rep["runs"][3].update(overlap=True, overlap_schedule=False)  # asked, but the plugin kept it synchronous
    rs = [record(rep)]
    sync, over = pick(rs, 1), pick(rs, 1, overlap=True)
    assert (sync.mode, sync.budget, sync.tok_s, sync.overlap) == ("tree-verify", 127, 260, False)
    assert (over.mode, over.budget, over.tok_s) == ("tree-verify", 63, 240)
    assert over.note().startswith("tree-verify B=63 on the overlap scheduler: 240.0 tok/s")
    assert [bench.run_label(r) for r in record(rep)["report"]["runs"][1:]] == [
        "tree-verify B=63 graphs=off", "tree-verify B=63 overlap graphs=off", "tree-verify B=127 graphs=off"]
    assert bench.service_overlap((("SGLANG_DDTREE_OVERLAP", "1"),)) and bench.service_overlap((("X", "1"),
                                                                                          ("SGLANG_DDTREE_OVERLAP", "yes")))
    assert not bench.service_overlap((("SGLANG_DDTREE_OVERLAP", "0"),)) and not bench.service_overlap(())
    only_sync = [record(report(runs=[("tree-verify", 15, None, False, [(1, 900)])]))]
    with pytest.raises(bench.NoChoice, match="tree-verify on the overlap scheduler"):
        pick(only_sync, 1, overlap=True)
    bad = json.loads(json.dumps(rep))
    bad["runs"][2]["overlap_schedule"] = "yes"
    with pytest.raises(bench.BadReport, match=r"runs\[2\].overlap_schedule must be true, false or null"):
        bench.parse_report(bad)


def test_the_plugins_overlap_both_report_and_its_paired_names_pass_the_control_side():
    """The plugin's own names for a report with both schedulers (bench.run_label, paired.report_section) are the
    control side's: the paired section's runs are all among the report's."""
    pb = pytest.importorskip("sglang_ddtree_tools.bench")
    pp = pytest.importorskip("sglang_ddtree_tools.paired")
    level = report()["runs"][0]["levels"][0]

    def run(per_round, **kw):
        rounds = [{"status": "ok", "levels": [dict(level, output_tok_s=v)]} for v in per_round]
        return dict({"budget": None, "block": None, "graphs": True, "status": "ok", "error": None,
                     "rounds": rounds, "levels": [dict(level, output_tok_s=sorted(per_round)[0])]}, **kw)
    doc = report()
    doc["runs"] = [run([100.0, 200.0], mode="dflash", block=16, overlap_schedule=True),
                   run([150.0, 180.0], mode="tree-verify", budget=127, overlap=False, overlap_schedule=False),
                   run([130.0, 260.0], mode="tree-verify", budget=127, overlap=True, overlap_schedule=True)]
    doc["paired"] = pp.report_section(doc)
    got = bench.parse_report(json.loads(json.dumps(doc)))
    assert [r["run"] for r in got["paired"]] == ["tree-verify B=127 graphs=on", "tree-verify B=127 overlap graphs=on"]
    assert [bench.run_label(r) for r in got["runs"]] == [pb.run_label(r) for r in doc["runs"]]


def test_resolve_auto_gives_the_service_its_mode_or_refuses_the_host(tmp_path):
    inv = inventory(tmp_path)
    h = inv.hosts["h"]
    assert [(s.mode, s.concurrency) for s in h.services] == [("tree-verify", None), ("auto", 6)]
    gf = lambda svc, mode: render.decode_cuda_graphs(svc.__class__(**{**svc.__dict__, "mode": mode}))  # noqa: E731
    hosts, refused, notes = bench.resolve_auto(inv.path, [h], DIGEST, gf)
    assert hosts == [] and "gpu1: mode auto: no bench result for host h" in refused["h"][0]
    # measured as the deploy renders it: tree-verify with decode CUDA graphs (0.5.17's adapter captures the mask)
    graphs_on = [("plain", None, None, True, [(1, 100), (4, 380), (16, 1200)]),
                 ("dflash", None, 16, True, [(1, 150), (4, 500), (16, 1300)]),
                 ("tree-verify", 15, None, True, [(1, 210), (4, 520), (16, 1000)]),
                 ("tree-verify", 31, None, True, [(1, 230), (4, 505), (16, 800)]),
                 ("tree-verify", 15, None, False, [(1, 900), (4, 900), (16, 900)])]  # not how it deploys: ignored
    bench.save_result(inv.path, record(report(graphs_on)))
    hosts, refused, notes = bench.resolve_auto(inv.path, [h], DIGEST, gf)
    s0, s1 = hosts[0].services
    assert refused == {} and (s0.mode, s0.budget, s0.auto) == ("tree-verify", 16, None)
    assert (s1.mode, s1.budget) == ("tree-verify", 15) and s1.auto.startswith("tree-verify B=15: 520.0 tok/s at concurrency 4")
    assert notes["h"][0].startswith("gpu1: mode auto -> tree-verify B=15")
    hosts, refused, _ = bench.resolve_auto(inv.path, [h], OTHER, gf)
    assert hosts == [] and "plugin source cdcdcdcdcdcd" in refused["h"][0]


def test_auto_choice_is_pure_and_checked_as_a_written_mode(tmp_path):
    """auto_services decides from the results it is given (no file read) and refuses a choice the inventory would
    refuse if it were written there: a budget outside the contract's bounds."""
    from deploy import contract
    inv = inventory(tmp_path)
    h = inv.hosts["h"]
    gf = lambda svc, mode: render.decode_cuda_graphs(svc.__class__(**{**svc.__dict__, "mode": mode}))  # noqa: E731
    too_big = contract.BUDGET_MAX + 1
    rec = record(report([("tree-verify", 63, None, True, [(1, 900), (4, 900), (16, 900)]),
                         ("tree-verify", 15, None, True, [(1, 100), (4, 100), (16, 100)])]))
    with pytest.raises(bench.BadReport, match="budget must be an integer"):  # a report cannot carry it ...
        record(report([("tree-verify", too_big, None, True, [(1, 900)])]))
    rec["report"]["runs"][0]["budget"] = too_big  # ... and a result handed in whole is checked again
    hosts, refused, _ = bench.auto_services([h], {"h": ([rec], [])}, DIGEST, gf)
    assert hosts == [] and f"tree-verify B={too_big}: the budget must be an integer in [1, {contract.BUDGET_MAX}]" \
        in refused["h"][0]
    ok = record(report([("tree-verify", 15, None, True, [(1, 100), (4, 100), (16, 100)])]))
    hosts, refused, _ = bench.auto_services([h], {"h": ([ok], [])}, DIGEST, gf)
    assert refused == {} and (hosts[0].services[1].mode, hosts[0].services[1].budget) == ("tree-verify", 15)
    assert not list(tmp_path.glob("**/bench/**/*.json"))  # nothing was read or kept on disk


def test_render_says_which_modes_run_decode_graphs(tmp_path):
    s = inventory(tmp_path).hosts["h"].services[0]
    rep = lambda **kw: s.__class__(**{**s.__dict__, **kw})  # noqa: E731
    assert render.decode_cuda_graphs(rep(mode="tree-verify")) is True
    assert render.decode_cuda_graphs(rep(mode="tree-verify", cuda_graphs=False)) is False
    assert render.decode_cuda_graphs(rep(mode="linear")) is True
    assert render.decode_cuda_graphs(rep(mode="shadow-linear")) is True
    assert render.decode_cuda_graphs(rep(mode="linear", extra_args=("--cuda-graph-backend-decode", "disabled"))) is False
    assert render.decode_cuda_graphs(rep(mode="linear", extra_args=("--disable-cuda-graph",))) is False


# ----------------------------------------------------------------------------- the inventory
def test_inventory_mode_auto_needs_a_concurrency(tmp_path):
    with pytest.raises(InventoryError) as ei:
        inventory(tmp_path, INV.replace(", concurrency: 6", ""))
    assert ei.value.problems == [f"{tmp_path}/inv.yaml:15: hosts.h.services.1: mode auto needs concurrency: N (the "
                                 "concurrent requests this service is sized for: fab deploy gives it the mode and "
                                 "budget fab bench measured fastest at N) or concurrency: all (every load: the "
                                 "budget schedule fab bench proposes)"]
    with pytest.raises(InventoryError) as ei:  # set for the whole fleet: said once per host, at the host
        inventory(tmp_path, INV.replace("  mode: tree-verify\n", "  mode: auto\n").replace(", concurrency: 6", ""))
    assert [p.split(": ")[0:2] for p in ei.value.problems] == [[f"{tmp_path}/inv.yaml:11", "hosts.h"],
                                                               [f"{tmp_path}/inv.yaml:15", "hosts.h.services.1"]]
    with pytest.raises(InventoryError, match=r"inv.yaml:15: hosts.h.services.1.concurrency: must be an integer in "
                                             r"\[1, 4096\] or 'all', got 0"):
        inventory(tmp_path, INV.replace("concurrency: 6", "concurrency: 0"))
    with pytest.raises(InventoryError, match=r"vars.mode: must be one of linear, shadow-linear, tree-verify, auto"):
        inventory(tmp_path, INV.replace("  mode: tree-verify\n", "  mode: fastest\n"))
    assert inventory(tmp_path, INV.replace("  budget: 16\n", "  budget: 16\n  concurrency: 8\n")).hosts["h"].services[0].concurrency == 8


# ----------------------------------------------------------------------------- the host op
def agent_args(**kw):
    a = bench.plan_bench(inventory_for_args(), probe()).agent_args() | {"prefix": "ddtree-bench-0123456789ab"}
    return a | kw


_INV_CACHE = {}


def inventory_for_args():
    if "h" not in _INV_CACHE:
        import tempfile
        from pathlib import Path

        d = Path(tempfile.mkdtemp())
        (d / "inv.yaml").write_text(textwrap.dedent(INV))
        _INV_CACHE["h"] = load_inventory(str(d / "inv.yaml")).hosts["h"]
    return _INV_CACHE["h"]


@pytest.mark.parametrize("kw,msg", [
    ({"gpu": -1}, "gpu must be"), ({"modes": ["beam"]}, "modes must be"), ({"budgets": []}, "budgets must be"),
    ({"concurrency": [0]}, "concurrency must be"), ({"graphs": "x"}, "graphs must be"),
    ({"model": "/models/../etc"}, "model must be an absolute path"), ({"model": "models/T"}, "model must be"),
    ({"draft_model": None}, "needs draft_model"), ({"server_args": ["a b"]}, "plain words"),
    ({"server_args": ["--x;rm"]}, "plain words"), ({"prefix": "ddtree-smoke-0123456789ab"}, "ddtree-bench-"),
    ({"user": "r oot"}, "plain user name"), ({"prompts": [[1, -1]]}, "token ids"), ({"prompts": []}, "1-4096"),
    ({"tiny": "moe"}, "tiny must be"), ({"rounds": 0}, "rounds must be"), ({"rounds": True}, "rounds must be"),
    ({"cpus": "0-3;reboot"}, "cpus must be"), ({"cpus": "0 1"}, "cpus must be"), ({"cpus": 3}, "cpus must be"),
    ({"overlap": "--spy"}, "overlap must be"), ({"overlap": None}, "overlap must be"),
])
def test_host_op_refuses_bad_arguments(kw, msg):
    with pytest.raises(Failure, match=msg):
        hostbench.check_args(agent_args(**kw))


def test_host_op_command_line_is_what_the_plugins_parser_reads():
    pb = pytest.importorskip("sglang_ddtree_tools.bench")
    a = agent_args(prompts=[[1, 2]], server_args=["--chunked-prefill-size", "4096"], requests=8)
    hostbench.check_args(a)
    argv = hostbench.bench_argv("/opt/v/bin/python", a, "/tmp/w/report.json", 900, "/tmp/w")
    assert argv[:3] == ["/opt/v/bin/python", "-m", "sglang_ddtree_tools.bench"]
    ns = pb.parse_args(argv[3:])
    assert (ns.model, ns.draft_model, ns.modes, ns.budgets, ns.concurrency) == (
        "/models/T", "/models/D", ["plain", "dflash", "tree-verify"], [15, 31, 63], [1, 4, 16])
    assert (ns.graphs, ns.block, ns.launcher, ns.unit_prefix, ns.user, ns.runtime_max) == (
        "both", 16, "systemd-run", "ddtree-bench-0123456789ab", "sglang", 900)
    assert (ns.prompts, ns.json, ns.requests, ns.server_args) == ("/tmp/w/prompts.json", "/tmp/w/report.json", 8,
                                                                 "--chunked-prefill-size 4096")
    t = agent_args(tiny="dense", model=None, draft_model=None)
    hostbench.check_args(t)
    ns = pb.parse_args(hostbench.bench_argv("/py", t, "/r", 60, "/w")[3:])
    assert (ns.tiny_train, ns.family, ns.model) == (True, "dense", None)
    assert copy.deepcopy(a) == a  # check_args changed nothing
    assert pb.parse_args(hostbench.bench_argv("/py", t, "/r", 60, "/w")[3:]).rounds == 1
    r = agent_args(rounds=3)
    hostbench.check_args(r)
    assert pb.parse_args(hostbench.bench_argv("/py", r, "/r", 60, "/w")[3:]).rounds == 3
    assert pb.parse_args(hostbench.bench_argv("/py", t, "/r", 60, "/w")[3:]).cpus is None
    # --overlap: passed only where asked (a host whose plugin predates it is never given the flag)
    assert a["overlap"] == "default" and "--overlap" not in hostbench.bench_argv("/py", a, "/r", 60, "/w")
    for ov in ("both", "on", "off"):
        o = bench.plan_bench(inventory_for_args(), probe(), overlap=ov).agent_args() | {"prefix": a["prefix"]}
        hostbench.check_args(o)
        assert pb.parse_args(hostbench.bench_argv("/py", o, "/r", 60, "/w")[3:]).overlap == ov
    import os

    one = str(sorted(os.sched_getaffinity(0))[0])  # the plugin checks the CPUs against the host it runs on
    if len(os.sched_getaffinity(0)) > 1:
        p = agent_args(cpus=one)
        hostbench.check_args(p)
        assert pb.parse_args(hostbench.bench_argv("/py", p, "/r", 60, "/w")[3:]).cpus == [int(one)]


def test_smoke_of_an_auto_service_runs_the_mode_the_last_deploy_chose(tmp_path):
    from deploy.smoke import SmokeRefused, plan_smoke

    h = inventory(tmp_path).hosts["h"]
    pr = probe(manifest={"services": {"gpu1": {"mode": "linear", "auto": "linear: 500.0 tok/s ..."}}})
    assert plan_smoke(h, pr, gpu=1).mode == "linear"
    assert plan_smoke(h, pr, gpu=1, mode="plain").mode == "plain"
    with pytest.raises(SmokeRefused, match="gpu1 has mode auto and no deployed choice yet"):
        plan_smoke(h, probe(manifest=None), gpu=1)


@pytest.mark.parametrize("report,overlap,expect", [
    ("bench_h200_hybrid_glue.json", False, {1: ("linear", None), 4: ("tree-verify", 31), 16: ("tree-verify", 31)}),
    ("bench_h200_dense_glue.json", False, {1: ("tree-verify", 31), 4: ("tree-verify", 31), 16: ("tree-verify", 31)}),
    # a report with DDTREE on SGLang's overlap scheduler (the report's per-server overlap_schedule): for a service that
    # asks for that scheduler DFLASH wins at 1 and 4, DDTREE at 16; a service on the synchronous one gets DFLASH,
    # the only run measured as it would serve
    ("h200_scheduler_ab_lossless_b15_b63/bench-dense-gdef.json", True,
     {1: ("linear", None), 4: ("linear", None), 16: ("tree-verify", 31)}),
    ("h200_scheduler_ab_lossless_b15_b63/bench-dense-gdef.json", False,
     {1: ("linear", None), 4: ("linear", None), 16: ("linear", None)}),
])
def test_mode_auto_on_the_h200_figures_picks_each_levels_winner(report, overlap, expect):
    """The real reports of the H200 runs (benchmarks/results/, all servers with decode CUDA graphs), read as any
    kept result is: `mode: auto` gets the fastest speculative mode at the service's level, on its scheduler."""
    from pathlib import Path

    doc = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" / report).read_text())
    rs = [record(doc)]
    for conc, (mode, budget) in expect.items():
        c = pick(rs, conc, graphs_for=lambda m: True, overlap=overlap)
        fastest = max((lv["output_tok_s"], r["mode"], r["budget"]) for r in doc["runs"] if r["mode"] != "plain"
                      and (r["mode"] != "tree-verify" or (r.get("overlap_schedule") is True) == overlap)
                      for lv in r["levels"] if lv["concurrency"] == conc)
        assert (c.mode, c.budget, c.concurrency) == (mode, budget, conc)
        assert c.tok_s == fastest[0] and bench.DEPLOY_MODE[fastest[1]] == c.mode


def test_cpus_reach_the_hosts_command_line(tmp_path):
    plan = bench.plan_bench(inventory(tmp_path).hosts["h"], probe(), cpus="2-3,8")
    assert plan.agent_args()["cpus"] == "2-3,8"
    argv = bench.host_command(plan)
    assert argv[argv.index("--cpus") + 1] == "2-3,8"
    assert "--cpus" not in bench.host_command(bench.plan_bench(inventory(tmp_path).hosts["h"], probe()))


def test_overlap_reaches_the_hosts_command_line(tmp_path):
    plan = bench.plan_bench(inventory(tmp_path).hosts["h"], probe(), overlap="both")
    argv = bench.host_command(plan)
    assert argv[argv.index("--overlap") + 1] == "both" and plan.to_json()["overlap"] == "both"
    assert "--overlap" not in bench.host_command(bench.plan_bench(inventory(tmp_path).hosts["h"], probe()))


# ----------------------------------------------------------------------------- the budget schedule
from deploy.tools import report as benchreport  # noqa: E402


def test_the_proposed_schedule_takes_each_levels_fastest_under_the_schedules_rules():
    """Frozen per-concurrency figures: the fastest budget at each level, chain where DFLASH wins, budgets that do
    not increase with the load (a larger budget measured fastest later is said, not taken), plain named where it
    is ahead (a tree-verify server cannot stop speculating)."""
    runs = report([
        ("plain", None, None, True, [(1, 100), (4, 380), (16, 1000), (64, 3000)]),
        ("dflash", None, 16, True, [(1, 150), (4, 500), (16, 1300), (64, 2500)]),
        ("tree-verify", 15, None, True, [(1, 210), (4, 520), (16, 1200), (64, 2000)]),
        ("tree-verify", 31, None, True, [(1, 200), (4, 560), (16, 1250), (64, 1900)]),
        ("tree-verify", 63, None, True, [(1, 260), (4, 540), (16, 1400), (64, 1500)]),
    ])["runs"]
    p = benchreport.propose_schedule(runs)
    assert (p["mode"], p["budget"]) == ("tree-verify", "1:63,4:31,16:chain")
    lv = {x["concurrency"]: x for x in p["levels"]}
    assert [lv[c]["entry"] for c in (1, 4, 16, 64)] == [63, 31, "chain", "chain"]
    assert lv[16]["fastest"] == 63 and "do not increase" in lv[16]["note"]  # 63 fastest at 16, but after 31 ...
    assert lv[16]["tok_s"] == 1300  # ... so the fastest allowed: DFLASH's chain (1300 > B=31's 1250)
    assert "plain decoding is faster (3000.0 tok/s, 1.20x)" in lv[64]["note"] and lv[1]["note"] == ""
    assert bench.contract.parse_budget(p["budget"]).budget_for(20) == "chain"
    # graphs off only: one budget everywhere is a plain int; DFLASH fastest at the lowest level: mode linear
    off = report([("tree-verify", 15, None, False, [(1, 210), (4, 520)]),
                  ("tree-verify", 31, None, False, [(1, 200), (4, 500)])])["runs"]
    assert benchreport.propose_schedule(off)["budget"] == 15
    assert benchreport.propose_schedule(runs, usable=lambda r: r["graphs"] is False)["mode"] is None
    lin = benchreport.propose_schedule(report([("dflash", None, 16, True, [(1, 300)]),
                                               ("tree-verify", 15, None, True, [(1, 200), (4, 900)])])["runs"])
    assert (lin["mode"], lin["budget"]) == ("linear", None) and "starts with a budget" in lin["notes"][-1]
    # failed levels never count; within 1% the smaller budget (and chain before a budget) wins
    tie = report([("tree-verify", 15, None, True, [(1, 199)]), ("tree-verify", 31, None, True, [(1, 200)]),
                  ("tree-verify", 63, None, True, [(1, 900, 3)])])["runs"]
    assert benchreport.propose_schedule(tie)["budget"] == 15


def test_a_benched_schedule_proposes_its_own_entries_beside_the_one_budget_servers():
    """A tree-verify run that served a schedule counts at each level as that level's entry: here it beats DFLASH
    where no one-budget server ran, so the proposal is tree-verify (not linear), and where a one-budget server is
    faster at a level, that budget is the entry."""
    runs = report([
        ("plain", None, None, True, [(1, 100), (4, 380), (64, 3000)]),
        ("dflash", None, 16, True, [(1, 150), (4, 500), (64, 2500)]),
        ("tree-verify", "1:31,32:15,64:7", None, True, [(1, 180), (4, 540), (64, 2600)]),
    ])["runs"]
    p = benchreport.propose_schedule(runs)
    assert (p["mode"], p["budget"]) == ("tree-verify", "1:31,64:7")
    assert [x["tok_s"] for x in p["levels"]] == [180, 540, 2600] and "plain decoding is faster" in p["levels"][2]["note"]
    beside = report([("dflash", None, 16, True, [(1, 150), (4, 500)]),
                     ("tree-verify", "1:31,4:15", None, True, [(1, 180), (4, 520)]),
                     ("tree-verify", 31, None, True, [(1, 170), (4, 600)])])["runs"]
    assert benchreport.propose_schedule(beside)["budget"] == 31  # B=31 at 4 (600) beats the schedule's 15 (520)
    # a schedule slower than DFLASH at its first level: linear, as with one-budget servers
    slow = report([("dflash", None, 16, True, [(1, 150)]), ("tree-verify", "1:31,4:15", None, True, [(1, 120)])])
    assert benchreport.propose_schedule(slow["runs"])["mode"] == "linear"


def test_chain_counts_at_what_a_tree_verify_server_served_not_at_dflashs_figure():
    """Where a tree-verify server served chain at a level, that is chain's figure there (the plugin's chain step,
    slower than DFLASH's where the host is the bottleneck): a budget faster than it wins although DFLASH is faster
    still, and the level says DFLASH is ahead. Where none served chain, DFLASH's figure stands in, and says so."""
    runs = report([
        ("dflash", None, 16, True, [(1, 1400), (16, 10000), (64, 16000)]),
        ("tree-verify", 127, None, True, [(1, 1800), (16, 3300), (64, 14700)]),
        ("tree-verify", 31, None, True, [(1, 1100), (16, 8500), (64, 9400)]),
        ("tree-verify", "1:15,2:chain", None, True, [(1, 1450), (16, 7400), (64, 16200)]),
    ])["runs"]
    p = benchreport.propose_schedule(runs)
    assert (p["mode"], p["budget"]) == ("tree-verify", "1:127,16:31,64:chain")
    lv = {x["concurrency"]: x for x in p["levels"]}
    assert lv[16]["tok_s"] == 8500 and "DFLASH is faster (10000.0 tok/s, 1.18x)" in lv[16]["note"]
    assert lv[64]["tok_s"] == 16200 and "DFLASH" not in lv[64]["note"]  # the served chain beats DFLASH's 16000
    # without the chain server, DFLASH's 10000 at 16 is chain's figure (an estimate, named as one)
    est = benchreport.propose_schedule([r for r in runs if r.get("budget") != "1:15,2:chain"])
    assert est["budget"] == "1:127,16:chain"
    assert "chain's figure is DFLASH's" in {x["concurrency"]: x for x in est["levels"]}[16]["note"]


def test_mode_auto_with_concurrency_all_deploys_the_proposed_schedule(tmp_path):
    from deploy import contract
    inv = inventory(tmp_path, INV.replace("concurrency: 6", "concurrency: all"))
    h = inv.hosts["h"]
    assert h.services[1].concurrency == "all"
    gf = lambda svc, mode: render.decode_cuda_graphs(svc.__class__(**{**svc.__dict__, "mode": mode}))  # noqa: E731
    rec = record(report([("plain", None, None, True, [(1, 100), (8, 700), (32, 2600)]),
                         ("dflash", None, 16, True, [(1, 150), (8, 900), (32, 2400)]),
                         ("dflash", None, 8, True, [(1, 150), (8, 900), (32, 9999)]),  # another block: not served
                         ("tree-verify", 15, None, True, [(1, 210), (8, 1000), (32, 2300)]),
                         ("tree-verify", 63, None, True, [(1, 260), (8, 950), (32, 1500)])]))
    hosts, refused, notes = bench.auto_services([h], {"h": ([rec], [])}, DIGEST, gf)
    s1 = hosts[0].services[1]
    assert refused == {} and (s1.mode, s1.budget) == ("tree-verify", contract.parse_budget("1:63,8:15,32:chain"))
    assert "for every load (concurrency all)" in s1.auto
    assert "32: chain 2400.0 tok/s (chain's figure is DFLASH's" in s1.auto and "plain decoding is faster" in s1.auto
    # what it renders: the schedule's text in the plugin's variable, D = its largest width
    env = dict(render.service_env(s1))
    assert env[contract.BUDGET_ENV] == "1:63,8:15,32:chain"
    args = render.server_args(s1)
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "64"
    lines = bench.schedule_lines(rec)
    assert lines[0] == "schedule (graphs on): mode: tree-verify, budget: {1: 63, 8: 15, 32: chain}"


def test_fab_bench_proposes_a_schedule_for_each_scheduler_a_tree_verify_server_ran():
    """`fab bench --overlap both`: the synchronous scheduler's proposal from its own tree-verify runs and the
    overlap scheduler's from its own (what a service with SGLANG_DDTREE_OVERLAP=1 gets from `mode: auto`), each
    beside DFLASH; one scheduler measured, one proposal."""
    rep = report([("plain", None, None, True, [(1, 100), (64, 3000)]),
                  ("dflash", None, 16, True, [(1, 150), (64, 2300)]),
                  ("tree-verify", "1:127,64:chain", None, True, [(1, 250), (64, 2000)]),
                  ("tree-verify", "1:127,64:chain", None, True, [(1, 240), (64, 2500)])])
    rep["runs"][3]["overlap_schedule"] = True
    lines = bench.schedule_lines(record(rep))
    heads = [x for x in lines if x.startswith("schedule")]
    assert heads == ["schedule (graphs on): mode: tree-verify, budget: {1: 127, 64: chain}",
                     "schedule (graphs on, overlap scheduler): mode: tree-verify, budget: {1: 127, 64: chain} "
                     "(service env SGLANG_DDTREE_OVERLAP=1)"]
    sync_64 = lines[lines.index(heads[0]) + 2]
    over_64 = lines[lines.index(heads[1]) + 2]
    assert "chain 2000.0 tok/s" in sync_64 and "DFLASH is faster (2300.0" in sync_64
    assert "chain 2500.0 tok/s" in over_64 and "DFLASH" not in over_64
    rep["runs"] = rep["runs"][:3]
    assert [x for x in bench.schedule_lines(record(rep)) if x.startswith("schedule")] == heads[:1]


def test_fab_bench_takes_budget_schedules_beside_node_budgets(tmp_path):
    """`--budgets "31; 1:31,32:15,64:7"`: node budgets and schedules reach the host's bench as one word it reads back
    to the same values; a schedule's text is canonical on the wire, and what no server can take is refused first."""
    assert bench.budget_list("63,15") == (15, 63)
    assert bench.budget_list("31; 1:31,4:31,32:15,64:7") == (31, "1:31,32:15,64:7")
    for bad, msg in (("1:31,0:15", "--budgets"), ("31; 4:15", "--budgets"), ("x", "--budgets"), ("", "--budgets"),
                     (";".join(str(b) for b in range(1, 19)), "at most 16")):
        with pytest.raises(bench.BenchRefused, match=msg):
            bench.budget_list(bad)
    h = inventory(tmp_path).hosts["h"]
    plan = bench.plan_bench(h, probe(), budgets=bench.budget_list("31; 1:31,32:15,64:7"))
    assert plan.budgets == (31, "1:31,32:15,64:7") and plan.agent_args()["budgets"] == [31, "1:31,32:15,64:7"]
    argv = bench.host_command(plan)
    assert argv[argv.index("--budgets") + 1] == "31;1:31,32:15,64:7"
    assert bench.budget_list(argv[argv.index("--budgets") + 1]) == plan.budgets  # the word reads back whole
    one = bench.host_command(bench.plan_bench(h, probe(), budgets=(15, 63)))
    assert one[one.index("--budgets") + 1] == "15,63"
    with pytest.raises(bench.BenchRefused, match="served by tree-verify only"):
        bench.plan_bench(h, probe(), budgets=(31, "1:31,32:15"), modes_=("dflash", "shadow-linear"))
    with pytest.raises(bench.BenchRefused, match="--budgets"):
        bench.plan_bench(h, probe(), budgets=(0,))
    pb = pytest.importorskip("sglang_ddtree_tools.bench")
    a = plan.agent_args() | {"prefix": "ddtree-bench-0123456789ab"}
    hostbench.check_args(a)
    ns = pb.parse_args(hostbench.bench_argv("/py", a, "/r", 60, "/w")[3:])
    assert ns.budgets == [31, "1:31,32:15,64:7"]


@pytest.mark.parametrize("budgets,modes,msg", [
    ([31, "1:31,4:31,32:15"], None, "canonical text"),  # the control side sends the canonical text only
    (["1:31;reboot"], None, "budget"), (["$(id)"], None, "budget"), ([True], None, "integer or a schedule"),
    (["1:" + "9" * 300], None, "integer or a schedule"), ([[31]], None, "integer or a schedule"),
    ([31, "1:31,32:15"], ["dflash", "shadow-linear"], "tree-verify only"), ([0], None, "budget .0. must be"),
])
def test_host_op_refuses_a_budget_or_schedule_it_cannot_serve(budgets, modes, msg):
    kw = {"budgets": budgets} | ({"modes": modes} if modes else {})
    with pytest.raises(Failure, match=msg):
        hostbench.check_args(agent_args(**kw))


def test_budgets_word_is_one_word_the_tools_bench_reads_back():
    from deploy import contract

    for budgets in ([15, 31], [31, "1:127,4:31,64:chain"], ["1:63,8:15"]):
        word = contract.budgets_word(budgets)
        assert " " not in word and benchreport.parse_budget_list(word) == budgets
    assert contract.budgets_word([15, 63]) == "15,63"
