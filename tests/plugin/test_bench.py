"""The benchmark's pure parts (sglang_ddtree_tools.bench): run planning, prompt files, the stream client against a
local SSE endpoint, percentiles, aggregation, the report schema, the table, the plot, argv through SGLang's own
parser, and its refusal on a host without a GPU."""

import argparse
import http.server
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sglang_ddtree_tools import bench, servers, spy


# ----------------------------------------------------------------------------- what to run
def test_lists_and_modes_parse_strictly():
    assert bench.parse_int_list("16,1,4,4", "--concurrency") == [1, 4, 16]
    for bad, msg in (("1,x", "not an integer"), ("0", "outside"), ("", "at least one")):
        with pytest.raises(ValueError, match=msg):
            bench.parse_int_list(bad, "--concurrency")
    assert bench.parse_modes("tree-verify,linear,plain,dflash") == ["tree-verify", "dflash", "plain"]
    with pytest.raises(ValueError, match="choose from"):
        bench.parse_modes("plain,beam")


def test_plan_runs_one_server_per_mode_budget_and_graph_setting():
    runs = bench.plan_runs(["plain", "dflash", "tree-verify", "shadow-linear"], [15, 31], "both", 8)
    assert len(runs) == 2 * (1 + 1 + 2 + 2)
    assert [r.graphs for r in runs] == [False] * 6 + [True] * 6  # every eager server first, then the graphed ones
    tv = [r for r in runs if r.mode == "tree-verify"]
    assert [(r.budget, r.draft_tokens) for r in tv[:2]] == [(15, 16), (31, 32)]  # D = B + 1
    df = next(r for r in runs if r.mode == "dflash")
    assert (df.budget, df.block, df.draft_tokens) == (None, 8, 8)
    sl = next(r for r in runs if r.mode == "shadow-linear")
    assert (sl.budget, sl.draft_tokens) == (15, 8)  # the chain commits: it verifies the block
    assert runs[0].label == "plain graphs=off" and tv[0].label == "tree-verify B=15 graphs=off"
    with pytest.raises(ValueError, match="on, off or both"):
        bench.plan_runs(["plain"], [15], "sometimes", 8)
    # --overlap both: each tree-verify budget on the synchronous scheduler, then on the overlap one; others once
    both = bench.plan_runs(["dflash", "tree-verify", "shadow-linear"], [63, 127], "on", 16, "both")
    assert [(r.mode, r.budget, r.overlap) for r in both] == [
        ("dflash", None, None), ("tree-verify", 63, False), ("tree-verify", 63, True), ("tree-verify", 127, False),
        ("tree-verify", 127, True), ("shadow-linear", 63, None), ("shadow-linear", 127, None)]
    # only the overlap scheduler is named: a synchronous DDTREE server keeps the name reports had before --overlap
    assert [r.label for r in both[1:3]] == ["tree-verify B=63 graphs=on", "tree-verify B=63 overlap graphs=on"]
    assert [r.overlap for r in bench.plan_runs(["tree-verify"], [7], "on", 8)] == [None]
    with pytest.raises(ValueError, match="default, off, on, both"):
        bench.plan_runs(["tree-verify"], [7], "on", 8, "sometimes")


def test_budgets_take_schedules_beside_plain_budgets():
    assert bench.parse_budget_list("63,15,31,15") == [15, 31, 63]
    # a schedule holds commas: with one in the text, ';' (or whitespace) separates the items
    assert bench.parse_budget_list("31; 1:127,4:31,64:chain ;15") == [15, 31, "1:127,4:31,64:chain"]
    # canonical: repeats dropped, and a schedule of one entry is that plain budget
    assert bench.parse_budget_list("1:31,4:31,16:15 1:63") == [63, "1:31,16:15"]
    for bad, msg in (("15,x", "'x' must be an integer"), ("0", "'0' must be an integer"),
                     ("1:31,4:63", "must not increase"), ("2:31", "starts at batch size 1"),
                     (" ; ", "at least one")):
        with pytest.raises(ValueError, match=msg):
            bench.parse_budget_list(bad)
    runs = bench.plan_runs(["dflash", "tree-verify", "shadow-linear"], [31, "1:63,4:31,64:chain"], "on", 16)
    assert [(r.mode, r.budget) for r in runs] == [("dflash", None), ("tree-verify", 31),
                                                  ("tree-verify", "1:63,4:31,64:chain"), ("shadow-linear", 31)]
    sched = runs[2]
    # the server's D is the schedule's largest width; the chain entry verifies the drafter's block
    assert sched.draft_tokens == 64 and sched.label == "tree-verify B=1:63,4:31,64:chain graphs=on"
    assert bench._slug(sched.budget) == "1-63_4-31_64-chain"
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny", "/k", "--modes", "shadow-linear", "--budgets", "1:31,4:15"])
    assert bench.parse_args(["--tiny", "/k", "--modes", "tree-verify", "--budgets", "15;1:31,4:15"]).budgets == \
        [15, "1:31,4:15"]


@pytest.mark.sglang_api
def test_a_schedule_server_argv_parses_with_sglangs_real_parser_and_carries_the_schedule():
    run = bench.plan_runs(["tree-verify"], ["1:127,4:31,64:chain"], "on", 16)[0]
    sizing = bench.plan_sizing([[5] * 100], 128, [1, 64], [run], {"max_position_embeddings": 4096}, {})
    spec = bench.spec_for(run, "/m/t", "/m/d", sizing, 0.2)
    ns = _parse(servers.server_argv("/venv/bin/python", spec, 30001))
    assert (ns.speculative_algorithm, ns.speculative_num_draft_tokens, ns.speculative_dflash_block_size) == \
        ("DDTREE", 128, 16)
    env = servers.server_env(spec, 0, base={"PATH": "/bin"})
    assert env["SGLANG_DDTREE_BUDGET"] == "1:127,4:31,64:chain"


def test_a_report_with_a_schedule_run_validates_and_crosses_to_the_control_side():
    from sglang_ddtree_tools import report

    doc = _doc()
    tv = next(r for r in doc["runs"] if r["mode"] == "tree-verify")
    tv["budget"] = "1:63,4:31,64:chain"
    assert bench.validate_report(doc) == []
    got = report.parse_report(json.loads(json.dumps(doc)))
    assert next(r for r in got["runs"] if r["mode"] == "tree-verify")["budget"] == "1:63,4:31,64:chain"
    for bad in ("1:31,4:63", "x" * 5000):
        tv["budget"] = bad
        assert any("budget" in e for e in bench.validate_report(doc))
        with pytest.raises(report.BadReport, match="budget"):
            report.parse_report(json.loads(json.dumps(doc)))
    tv["mode"], tv["budget"] = "shadow-linear", "1:31,4:15"  # a schedule is tree-verify's
    assert any("budget" in e for e in bench.validate_report(doc))


def test_run_label_names_the_scheduler_the_server_ran():
    run = {"mode": "tree-verify", "budget": 127, "block": None, "graphs": True}
    assert bench.run_label(run) == "tree-verify B=127 graphs=on"
    assert bench.run_label(dict(run, overlap_schedule=True)) == "tree-verify B=127 overlap graphs=on"
    # asked for overlap, but the server said it runs the synchronous scheduler (the plugin's validator refused)
    assert bench.run_label(dict(run, overlap=True, overlap_schedule=False)) == "tree-verify B=127 graphs=on"
    assert bench.run_label(dict(run, overlap=True)) == "tree-verify B=127 overlap graphs=on"  # the server said nothing
    # DFLASH and plain run SGLang's overlap scheduler by default: not named
    assert bench.run_label({"mode": "dflash", "block": 16, "graphs": True, "overlap_schedule": True}) == \
        "dflash blk=16 graphs=on"


def _parse(argv):
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return p.parse_args(argv[3:])


@pytest.mark.sglang_api
@pytest.mark.parametrize("graphs", [False, True])
def test_server_argv_of_each_run_parses_with_sglangs_real_parser(graphs):
    runs = [r for r in bench.plan_runs(["plain", "dflash", "tree-verify"], [31], "both", 16) if r.graphs == graphs]
    sizing = bench.plan_sizing([[5] * 100], 128, [1, 4, 16], runs, {"max_position_embeddings": 4096}, {})
    assert (sizing.max_running, sizing.context_length) == (16, 512)  # 100 + 128 + 32 + 64 -> 512
    for run in runs:
        spec = bench.spec_for(run, "/m/t", "/m/d", sizing, 0.2, ["--chunked-prefill-size", "4096",
                                                                  "--max-running-requests", "20"])
        ns = _parse(servers.server_argv("/venv/bin/python", spec, 30001))
        assert (ns.model_path, ns.port, ns.skip_tokenizer_init, ns.context_length) == ("/m/t", 30001, True, 512)
        assert ns.max_running_requests == 20 and ns.chunked_prefill_size == 4096  # --server-args come last and win
        assert ns.max_total_tokens == sizing.max_total_tokens and ns.mem_fraction_static == 0.2
        decode_off = getattr(ns, "cuda_graph_backend_decode", None) == "disabled" or getattr(ns, "disable_cuda_graph", False)
        assert decode_off is (not graphs)
        if graphs:
            assert ns.cuda_graph_max_bs_decode == 16
        want = {"plain": (None, None, None), "dflash": ("DFLASH", None, 16),
                "tree-verify": ("DDTREE", 32, 16)}[run.mode]
        # the chain's width is its block; tree-verify is given the block too, as a deployed unit is
        assert (ns.speculative_algorithm, ns.speculative_num_draft_tokens, ns.speculative_dflash_block_size) == want
        env = servers.server_env(spec, 2, base={"PATH": "/bin"})
        assert env["CUDA_VISIBLE_DEVICES"] == "2"
        assert env.get("SGLANG_DDTREE_BUDGET") == ("31" if run.mode == "tree-verify" else None)


def test_sizing_caps_pools_and_refuses_a_context_the_model_lacks():
    runs = bench.plan_runs(["tree-verify"], [63], "off", 8)
    hyb = {"layer_types": ["linear_attention", "full_attention"], "max_position_embeddings": 4096,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
    s = bench.plan_sizing([[1] * 40], 64, [1, 8], runs, hyb, {})
    assert s.max_mamba_cache == 48 and s.max_total_tokens == 32768 and s.context_length == 256
    assert s.kv_mib == 2 * 4 * 2 * 64 * 2 * 32768 / 2**20
    assert bench.plan_sizing([[1] * 40], 64, [1, 32], runs, {}, {}).max_mamba_cache is None  # dense: no cap
    with pytest.raises(ValueError, match="the model allows 256"):
        bench.plan_sizing([[1] * 200], 64, [1], runs, {"max_position_embeddings": 256}, {})


def test_mem_fraction_covers_weights_pools_and_what_others_use():
    f = servers.server_mem_fraction(used_mib=0, total_mib=143771, weights_mib=16000, kv_mib=8192)
    assert f * 143771 >= 1.25 * 16000 + 8192
    assert servers.server_mem_fraction(0, 143771, 30, 4096) == servers.shared_gpu_fraction(0, 143771, 4096 + 37.5)


# ----------------------------------------------------------------------------- prompts and models
def test_prompt_files_json_jsonl_and_their_errors(tmp_path):
    j = tmp_path / "p.json"
    j.write_text(json.dumps({"prompts": [[1, 2, 3], {"input_ids": [4, 5]}]}))
    assert bench.load_prompts(str(j)) == [[1, 2, 3], [4, 5]]
    j.write_text(json.dumps([7, 8, 9]))
    assert bench.load_prompts(str(j)) == [[7, 8, 9]]
    jl = tmp_path / "p.jsonl"
    jl.write_text('[1, 2]\n\n{"input_ids": [3]}\n')
    assert bench.load_prompts(str(jl)) == [[1, 2], [3]]
    jl.write_text('[1, 2]\n{"input_ids": [3, 600]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: token 600 is not an id in \[0, 512\)"):
        bench.load_prompts(str(jl), vocab=512)
    jl.write_text('[1, 2]\n[3, \n')
    with pytest.raises(ValueError, match="p.jsonl:2: not JSON"):
        bench.load_prompts(str(jl))
    for bad, msg in (('{"x": 1}', "non-empty list"), ('[[1, true]]', "token True"), ("[]", "no prompts"),
                     ('[[1.5]]', "token 1.5")):
        j.write_text(bad)
        with pytest.raises(ValueError, match=msg):
            bench.load_prompts(str(j))


def test_random_prompts_stay_inside_the_vocabulary():
    ps = bench.random_prompts(5, 9, vocab=512, seed=3)
    assert ps == bench.random_prompts(5, 9, vocab=512, seed=3) != bench.random_prompts(5, 9, vocab=512, seed=4)
    assert all(len(p) == 9 and all(100 <= t < 510 for t in p) for p in ps)


def _pair(root, t, d, block=None):
    for p in (t, d):
        p.mkdir(parents=True)
        (p / "config.json").write_text(json.dumps({"dflash_config": {"block_size": block}} if block and p == d else {}))


def test_resolve_tiny_reads_both_layouts(tmp_path):
    _pair(tmp_path, tmp_path / "hybrid" / "target", tmp_path / "hybrid" / "drafter", block=16)
    (tmp_path / "hybrid" / "prompts.jsonl").write_text("[1]\n")
    _pair(tmp_path, tmp_path / "dense-target", tmp_path / "dense-drafter")
    h = bench.resolve_tiny(str(tmp_path), "hybrid")
    assert (h["kind"], h["target"], h["prompts"]) == ("trained", str(tmp_path / "hybrid" / "target"),
                                                       str(tmp_path / "hybrid" / "prompts.jsonl"))
    assert bench.drafter_block(bench.read_config(h["drafter"])) == 16
    d = bench.resolve_tiny(str(tmp_path), "dense")
    assert (d["kind"], d["drafter"], d["prompts"]) == ("random", str(tmp_path / "dense-drafter"), None)
    assert bench.drafter_block(bench.read_config(d["drafter"])) == 8
    # the training kit: the flat layout with its manifest.json and held-out prompts.jsonl at the top
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"id": 0, "input_ids": [3, 4], "regime": 1}\n')
    d = bench.resolve_tiny(str(tmp_path), "dense")
    assert (d["kind"], d["prompts"]) == ("trained", str(tmp_path / "prompts.jsonl"))
    assert bench.load_prompts(d["prompts"]) == [[3, 4]]
    assert bench.trainkit_argv("/py", "/w/tiny", "dense", 7) == [
        "/py", "-m", "sglang_ddtree_tools.trainkit", "/w/tiny", "--seed", "7", "--family", "dense", "--device", "cuda"]
    with pytest.raises(ValueError, match="no tiny hybrid pair"):
        bench.resolve_tiny(str(tmp_path / "nowhere"), "hybrid")
    with pytest.raises(ValueError, match="choose hybrid or dense"):
        bench.resolve_tiny(str(tmp_path), "moe")


def test_resolve_tiny_reads_what_the_tiny_kit_writes(tmp_path):
    pytest.importorskip("transformers")
    from sglang_ddtree_tools import tiny

    tiny.write_family(tmp_path, "dense", seed=0)
    got = bench.resolve_tiny(str(tmp_path), "dense")
    assert got["kind"] == "random" and bench.drafter_block(bench.read_config(got["drafter"])) == tiny.DRAFT_BLOCK
    assert not bench.is_hybrid(bench.read_config(got["target"]))
    assert bench.is_hybrid(tiny.target_config("hybrid"))


# ----------------------------------------------------------------------------- measuring
def test_percentile_interpolates_like_numpy():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 9.0, 3.0, 7.5, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert bench.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert bench.percentile([], 50) is None and bench.percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        bench.percentile(xs, 101)


def test_request_ttft_and_per_token_latency():
    r = bench.RequestRecord(sent=10.0, chunks=[(10.0, 0), (10.5, 1), (10.6, 4), (10.6, 4), (11.0, 5)])
    assert r.ttft() == pytest.approx(0.5) and r.tokens == 5
    # 3 tokens 0.1 s after the first: 3 x 0.0333; a chunk with no new token adds nothing; then 1 token in 0.4 s
    assert r.itl() == pytest.approx([0.1 / 3] * 3 + [0.4])
    assert bench.RequestRecord(sent=0.0).ttft() is None


def test_request_decode_step_is_its_decode_time_over_its_steps():
    chunks = [(10.0, 0), (10.5, 1), (10.6, 4), (10.6, 4), (11.0, 5)]
    # SGLang counted 2 verify steps after the prefill's token: 0.5 s of decode over 2 steps
    assert bench.RequestRecord(sent=10.0, chunks=chunks, meta={"spec_verify_ct": 2}).step() == pytest.approx(0.25)
    # plain (no verify count) or a count that says nothing: a step a token after the first, 4 of them
    assert bench.RequestRecord(sent=10.0, chunks=chunks).step() == pytest.approx(0.125)
    assert bench.RequestRecord(sent=10.0, chunks=chunks, meta={"spec_verify_ct": 0}).step() == pytest.approx(0.125)
    assert bench.RequestRecord(sent=10.0, chunks=chunks, meta={"spec_verify_ct": True}).step() == pytest.approx(0.125)
    assert bench.RequestRecord(sent=0.0, chunks=[(0.0, 0), (0.2, 3)]).step() is None  # one chunk: no span


def test_parse_sse_and_token_counts():
    stream = [b'data: {"output_ids": [5], "meta_info": {"completion_tokens": 1}}\n', b"\n",
              b": keep-alive\n", b'data: {"output_ids": [5, 6, 7]}\n', b"\n", b"data: [DONE]\n",
              b'data: {"never": "read"}\n']
    evs = list(bench.parse_sse(stream))
    assert len(evs) == 2 and [bench.event_tokens(e) for e in evs] == [1, 3]


def _rec(sent, chunks, meta=None, error=None):
    return bench.RequestRecord(sent=sent, chunks=chunks, meta=meta or {}, error=error)


def test_aggregate_level_sums_sglangs_counters():
    recs = [_rec(0.0, [(0.1, 1), (0.2, 4)], {"completion_tokens": 4, "spec_verify_ct": 2, "spec_accept_length": 2.0}),
            _rec(0.0, [(0.3, 2), (0.5, 4)], {"completion_tokens": 4, "spec_verify_ct": 1, "spec_accept_length": 4.0}),
            _rec(0.0, [], error="HTTPError: 500")]
    row = bench.aggregate_level(recs, wall_s=0.5, concurrency=3)
    assert (row["requests"], row["errors"], row["output_tokens"], row["output_tok_s"]) == (3, 1, 8, 16.0)
    assert row["accept_length"] == pytest.approx(8 / 3, abs=1e-4)  # token-weighted, not the mean of 2.0 and 4.0
    assert row["ttft_ms"]["p50"] == pytest.approx(200.0) and row["first_error"] == "HTTPError: 500"
    assert row["itl_ms"]["p50"] == pytest.approx(1000 * 0.1 / 3, rel=1e-3)
    # steps: 0.1 s over 2 verify steps (50 ms) and 0.2 s over 1 (200 ms); the failed request has none
    assert row["step_ms"]["p50"] == pytest.approx(125.0) and row["step_ms"]["p99"] == pytest.approx(198.5)
    plain = bench.aggregate_level([_rec(0.0, [(0.1, 1), (0.2, 2)], {"completion_tokens": 2})], 0.2, 1)
    assert plain["accept_length"] is None
    old = bench.aggregate_level([_rec(0.0, [(0.1, 2)], {"spec_accept_length": 1.5})], 0.1, 1)
    assert old["accept_length"] == 1.5  # no spec_verify_ct: SGLang's per-request figure
    assert bench.level_prompts([[1], [2], [3]], 2, 4) == [[1], [2], [3], [1]]


class _StandInSGLang(http.server.BaseHTTPRequestHandler):
    """TEST STAND-IN for SGLang's streaming ``/generate`` (no model on a CPU test host): answers each request
    with ``max_new_tokens`` tokens in chunks of 2, as SGLang 0.5.17 streams them (cumulative ``output_ids``,
    ``meta_info.completion_tokens`` / ``spec_verify_ct``), 20 ms apart, then ``data: [DONE]``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        n = body["sampling_params"]["max_new_tokens"]
        assert body["stream"] is True and body["sampling_params"]["temperature"] == 0
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def chunk(b):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
            self.wfile.flush()

        for k in range(2, n + 2, 2):
            k = min(k, n)
            time.sleep(0.02)
            meta = {"completion_tokens": k, "spec_verify_ct": (k + 1) // 2}
            chunk(b"data: " + json.dumps({"output_ids": body["input_ids"][:1] * k, "meta_info": meta}).encode() + b"\n\n")
        chunk(b"data: [DONE]\n\n")
        chunk(b"")


@pytest.fixture
def sse_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandInSGLang)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_a_level_streams_every_request_and_measures_it(sse_server):
    recs, wall = bench.run_level(sse_server, [[3, 4]] * 6, 6, 3, timeout=30)
    assert len(recs) == 6 and all(r.error is None and r.tokens == 6 for r in recs)
    row = bench.aggregate_level(recs, wall, 3)
    assert row["output_tokens"] == 36 and row["accept_length"] == 2.0
    assert 15 <= row["ttft_ms"]["p50"] < 500 and 5 <= row["itl_ms"]["p50"] < 250  # 20 ms a 2-token chunk
    assert 5 <= row["step_ms"]["p50"] < 500  # 20 ms a chunk; the stand-in also counts its first chunk a step
    assert 0.1 < wall < 5  # two waves of three concurrent requests, three 20 ms chunks each
    short = bench.stream_request(sse_server, [1], 5, timeout=30)
    assert short.error is None and short.tokens == 5
    bad = bench.stream_request("http://127.0.0.1:9", [1], 4, timeout=5)
    assert bad.error and "URLError" in bad.error


# ----------------------------------------------------------------------------- the report
def _doc():
    runs = bench.plan_runs(["plain", "tree-verify"], [15], "off", 8)
    doc = {"schema": bench.SCHEMA, "host": "box", "ok": False, "gpu": {"name": "NVIDIA H200"},
           "model": {"target": "/m/tiny-target", "drafter": "/m/d"}, "settings": {"max_new_tokens": 64}, "runs": []}
    for run, tps in zip(runs, (100.0, 150.0)):
        levels = [dict(bench.aggregate_level([_rec(0.0, [(0.01, 1), (0.02, 64)], {"completion_tokens": 64})],
                                             64 * c / (tps * c), c), concurrency=c) for c in (1, 4)]
        doc["runs"].append({"mode": run.mode, "budget": run.budget, "block": run.block, "graphs": run.graphs,
                            "status": "ok", "error": None, "levels": levels})
    doc["runs"].append({"mode": "tree-verify", "budget": 15, "block": None, "graphs": True, "status": "failed",
                        "error": "RuntimeError: server exited during start-up:\nDDTREE tree-verify needs ...",
                        "levels": []})
    return doc


def test_report_schema_accepts_the_report_and_names_what_is_wrong():
    doc = _doc()
    assert bench.validate_report(doc) == []
    assert bench.validate_report(json.loads(json.dumps(doc))) == []
    assert bench.validate_report([]) == ["the report is not a JSON object"]
    bad = json.loads(json.dumps(doc))
    bad["schema"] = "ddtree-bench/0"
    bad["runs"][0]["mode"] = "beam"
    bad["runs"][1]["budget"] = 0
    bad["runs"][1]["levels"][0]["output_tok_s"] = -1
    bad["runs"][1]["levels"][1]["ttft_ms"] = {"p50": "fast"}
    bad["runs"][2]["graphs"] = "yes"
    got = bench.validate_report(bad)
    assert any("schema is 'ddtree-bench/0'" in e for e in got)
    assert any("runs[0].mode 'beam'" in e for e in got)
    assert any("runs[1].budget" in e for e in got)
    assert any("runs[1].levels[0].output_tok_s" in e for e in got)
    assert any("runs[1].levels[1].ttft_ms" in e for e in got)
    assert any("runs[2].graphs" in e for e in got)
    bad["runs"][1]["levels"][0]["output_tok_s"] = float("nan")
    assert any("levels[0].output_tok_s" in e for e in bench.validate_report(bad))
    hostile = json.loads(json.dumps(doc))
    hostile["runs"][0]["levels"][0]["host"] = {"busy_pct": "all", "procs": "x"}
    assert [e for e in bench.validate_report(hostile) if "host" in e] == [
        "runs[0].levels[0].host must be {busy_pct, steal_pct, procs[, sched_cpu_ms]} (sglang_ddtree_tools.hostload)"]
    hostile["runs"][0]["levels"][0]["host"] = {"busy_pct": 5.0, "steal_pct": 0.0, "procs": [], "sched_cpu_ms": -1}
    assert [e for e in bench.validate_report(hostile) if "host" in e] == [
        "runs[0].levels[0].host must be {busy_pct, steal_pct, procs[, sched_cpu_ms]} (sglang_ddtree_tools.hostload)"]
    # cpu_ms: absent in older reports (valid); where present {before, after} of {CPU digits: ms}, rounds too
    speeds = json.loads(json.dumps(doc))
    speeds["runs"][0]["cpu_ms"] = {"before": {"0": 210.5, "15": 470.0}, "after": None}
    assert bench.validate_report(speeds) == []
    speeds["runs"][0]["cpu_ms"] = {"before": {"../0": 1.0}, "after": None}
    speeds["runs"][1]["cpu_ms"] = {"during": {}}
    speeds["runs"][1]["rounds"] = [{"cpu_ms": {"before": {"3": -2.0}}}]
    assert [e for e in bench.validate_report(speeds) if "cpu_ms" in e] == [
        "runs[0].cpu_ms before must be null or {CPU number: ms}", "runs[1].cpu_ms must be {before, after}",
        "runs[1].rounds[0].cpu_ms before must be null or {CPU number: ms}"]
    # step_ms: absent in reports from before it (valid), checked like the other latencies where present
    old = json.loads(json.dumps(doc))
    del old["runs"][0]["levels"][0]["step_ms"]
    assert bench.validate_report(old) == []
    old["runs"][0]["levels"][1]["step_ms"] = {"p50": -0.5, "p99": 1.0}
    assert [e for e in bench.validate_report(old) if "step_ms" in e] == [
        "runs[0].levels[1].step_ms must be {p50, p99} of non-negative numbers or null"]


def test_table_has_a_line_per_run_and_level_and_says_what_failed():
    text = bench.format_table(_doc())
    lines = text.splitlines()
    assert "NVIDIA H200" in lines[0] and "64 new tokens" in lines[0]
    assert lines[1].split()[:4] == ["run", "conc", "req", "tok/s"]
    body = [ln for ln in lines[3:]]
    assert len(body) == 6
    assert body[0].startswith("plain graphs=off") and body[0].split()[2:4] == ["1", "1"]
    assert "150.0" in body[2] and "tree-verify B=15 graphs=off" in body[2]
    assert lines[1].split()[-2:] == ["step", "p50"] and body[0].split()[-1] == "0.16"  # 10 ms over 63 steps
    assert body[4].split()[:4] == ["tree-verify", "B=15", "graphs=on", "-"] and "FAILED" in body[4]
    assert body[5] == ("FAILED tree-verify B=15 graphs=on: RuntimeError: server exited during start-up: ... "
                       "DDTREE tree-verify needs ...")


def _png_size(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    return w, h, data


def test_plot_writes_a_png_with_one_line_per_run(tmp_path):
    pytest.importorskip("matplotlib")
    out = bench.write_plot(_doc(), str(tmp_path / "b.png"))
    w, h, data = _png_size(out)
    assert (w, h) == (880, 550)
    assert len(data) > 5000
    import matplotlib.pyplot as plt

    assert plt.get_fignums() == []  # the figure was closed
    nolevel = _doc()
    nolevel["runs"] = nolevel["runs"][2:]
    with pytest.raises(ValueError, match="no measured level"):
        bench.write_plot(nolevel, str(tmp_path / "c.png"))


# ----------------------------------------------------------------------------- the command line
def test_arguments_are_checked_before_anything_runs(capsys):
    for argv, msg in ((["--modes", "plain"], "exactly one of --model, --tiny DIR, --tiny-random, --tiny-train"),
                      (["--tiny-random", "--tiny-train"], "exactly one of"),
                      (["--model", "/m"], "--draft-model is needed by dflash, tree-verify"),
                      (["--tiny-random", "--concurrency", "1,0"], "outside"),
                      (["--tiny-random", "--modes", "beam"], "choose from"),
                      (["--tiny-random", "--graphs", "maybe"], "invalid choice"),
                      (["--tiny-random", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
    a = bench.parse_args(["--model", "/m", "--modes", "plain", "--concurrency", "8,2", "--graphs", "both"])
    assert (a.modes, a.concurrency, a.budgets, a.graphs) == (["plain"], [2, 8], [15], "both")


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="this host has a GPU; the refusal is for hosts without one")
def test_cli_on_a_host_without_gpu_says_so_and_exits_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sglang_ddtree_tools.bench", "--tiny-random", "--json",
                          str(tmp_path / "r.json")], capture_output=True, text=True, timeout=120)
    assert out.returncode == bench.EXIT_CANNOT_RUN == 2, out.stderr
    assert "bench: cannot run: no GPU device /dev/nvidiactl or /dev/nvidia0" in out.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == bench.SCHEMA and doc["ok"] is False and doc["cannot_run"].startswith("no GPU device")
    assert bench.validate_report(doc) == []


def _standin_bench(tmp_path, monkeypatch, prompts_jsonl: str):
    """The bench's CPU set-up: a fake interpreter that runs the stand-in server (tests/plugin/standin_sglang_server.py,
    marked as such), nvidia-smi's figures patched in, a dense tiny pair and its prompts. Returns (python, state dir)."""
    here = os.path.dirname(os.path.abspath(__file__))
    fake_py = tmp_path / "python"
    fake_py.write_text(f"#!/bin/sh\nexec {sys.executable} {here}/standin_sglang_server.py \"$@\"\n")
    fake_py.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("STANDIN_DIR", str(state))
    monkeypatch.setattr(bench, "gpu_device_problem", lambda gpu: None)
    monkeypatch.setattr(bench, "gpu_memory_mib", lambda gpu: (512.0, 81559.0))
    monkeypatch.setattr(bench, "gpu_name", lambda gpu: "stand-in GPU")
    for n in ("target", "drafter"):
        (tmp_path / "tiny" / "dense" / n).mkdir(parents=True)
    (tmp_path / "tiny" / "dense" / "target" / "config.json").write_text(json.dumps({"vocab_size": 512}))
    (tmp_path / "tiny" / "dense" / "drafter" / "config.json").write_text(json.dumps({"block_size": 4}))
    (tmp_path / "tiny" / "dense" / "prompts.jsonl").write_text(prompts_jsonl)
    return fake_py, state


def _standin_main(tmp_path, fake_py, out, *args) -> int:
    """bench.main on _standin_bench's set-up (the dense tiny pair, process launcher) with ``args`` after."""
    return bench.main(["--tiny", str(tmp_path / "tiny"), "--family", "dense", "--launcher", "process",
                       "--python", str(fake_py), "--start-timeout", "30", "--request-timeout", "30",
                       "--out", str(out), *args])


def test_a_whole_run_on_stand_in_servers_one_at_a_time(tmp_path, monkeypatch, capsys):
    """The orchestration end to end on CPU: the stand-in (tests/plugin/standin_sglang_server.py, marked as such)
    takes the place of SGLang's server and nvidia-smi's figures are patched in; everything else is the module's."""
    fake_py, state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n[4, 5]\n[6]\n")  # nested layout
    out = tmp_path / "out"
    code = bench.main(["--tiny", str(tmp_path / "tiny"), "--family", "dense", "--modes", "plain,dflash,tree-verify",
                       "--budgets", "7", "--graphs", "both", "--concurrency", "1,4", "--max-new-tokens", "12",
                       "--warmup-tokens", "2", "--launcher", "process", "--python", str(fake_py),
                       "--start-timeout", "30", "--request-timeout", "30", "--out", str(out),
                       "--server-args", "--chunked-prefill-size 256"])
    table = capsys.readouterr().out
    assert code == bench.EXIT_FAILED  # tree-verify with graphs on refused to start; the rest ran
    assert not (state / "overlap").exists() and not (state / "running").exists()  # one at a time, all stopped
    doc = json.loads((out / "bench.json").read_text())
    assert bench.validate_report(doc) == [] and doc["schema"] == bench.SCHEMA
    assert doc["model"]["source"] == "tiny-trained" and doc["settings"]["prompts"]["count"] == 3
    assert doc["settings"]["requests_per_level"] == {"1": 3, "4": 4}
    st = [(r["mode"], r["graphs"], r["status"]) for r in doc["runs"]]
    assert st == [("plain", False, "ok"), ("dflash", False, "ok"), ("tree-verify", False, "ok"),
                  ("plain", True, "ok"), ("dflash", True, "ok"), ("tree-verify", True, "failed")]
    failed = doc["runs"][-1]
    assert "server exited during start-up" in failed["error"] and "needs --cuda-graph-backend-decode" in failed["error"]
    acc = {(r["mode"], r["graphs"]): [lv["accept_length"] for lv in r["levels"]] for r in doc["runs"]}
    assert acc[("plain", False)] == [None, None] and acc[("dflash", True)] == [2.0, 2.0]
    assert acc[("tree-verify", False)] == [3.0, 3.0]
    lv = doc["runs"][2]["levels"]
    assert [(x["concurrency"], x["requests"], x["errors"], x["output_tokens"]) for x in lv] == [(1, 3, 0, 36), (4, 4, 0, 48)]
    assert lv[1]["output_tok_s"] > lv[0]["output_tok_s"]  # 4 in flight beat 1 on a server that batches freely
    # the host's CPUs over each level, and the stand-in server's process among the busiest where it used a tick
    for x in lv:
        h = x["host"]
        assert 0 <= h["steal_pct"] <= h["busy_pct"] <= 100 and isinstance(h["procs"], list)
        assert all(p["cpu_s"] > 0 and p["last_cpu"] >= 0 for p in h["procs"])
        if h["procs"]:  # the speed of the CPU the busiest process ran on, read before the server started
            assert h["sched_cpu_ms"] == doc["runs"][2]["cpu_ms"]["before"][str(h["procs"][0]["last_cpu"])]
    # every CPU's speed before each server started and after it stopped (failed servers too)
    cpus = sorted(str(c) for c in os.sched_getaffinity(0))
    for r in doc["runs"]:
        assert sorted(r["cpu_ms"]["before"]) == cpus and sorted(r["cpu_ms"]["after"]) == cpus
        assert all(v > 0 for v in list(r["cpu_ms"]["before"].values()) + list(r["cpu_ms"]["after"].values()))
    argvs = [json.loads(x) for x in (state / "argv.jsonl").read_text().splitlines()]
    assert len(argvs) == 6 and all(x[x.index("--chunked-prefill-size") + 1] == "256" for x in argvs)
    tv = argvs[2]
    assert tv[tv.index("--speculative-num-draft-tokens") + 1] == "8" and "--skip-tokenizer-init" in tv
    assert argvs[1][argvs[1].index("--speculative-dflash-block-size") + 1] == "4"  # the drafter's own block
    assert tv[tv.index("--speculative-dflash-block-size") + 1] == "4"  # tree-verify's drafter too
    assert "tree-verify B=7 graphs=on" in table and "FAILED" in table and "dflash blk=4 graphs=off" in table
    assert ("FAILED tree-verify B=7 graphs=on: RuntimeError: server exited during start-up: ValueError: DDTREE "
            "tree-verify needs --cuda-graph-backend-decode disabled") in table  # the server's own reason, once
    assert sorted(os.listdir(out / "logs")) == sorted(f"{k:02d}-{m}.log" for k, m in enumerate(
        ["plain-0-e", "dflash-4-e", "tree-verify-7-e", "plain-0-g", "dflash-4-g", "tree-verify-7-g"]))
    if (out / "bench.png").exists():
        assert _png_size(out / "bench.png")[:2] == (880, 550)
    else:
        pytest.importorskip("matplotlib")
        raise AssertionError("matplotlib is installed but no plot was written")


def test_sigterm_mid_run_stops_the_server_and_writes_the_partial_report(tmp_path):
    here = os.path.dirname(os.path.abspath(__file__))
    fake_py = tmp_path / "python"
    fake_py.write_text(f"#!/bin/sh\nexec {sys.executable} {here}/standin_sglang_server.py \"$@\"\n")
    fake_py.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    driver = ("import sys; from sglang_ddtree_tools import bench as b\n"
              "b.gpu_device_problem = lambda g: None; b.gpu_memory_mib = lambda g: (0.0, 81559.0)\n"
              "b.gpu_name = lambda g: 'stand-in GPU'\n"  # nvidia-smi's figures: the stand-in has no GPU
              "sys.exit(b.main(sys.argv[1:]))\n")
    env = dict(os.environ, STANDIN_DIR=str(state))
    p = subprocess.Popen([sys.executable, "-c", driver, "--model", "/m", "--modes", "plain", "--concurrency", "1",
                          "--max-new-tokens", "1000", "--requests", "50", "--launcher", "process", "--python",
                          str(fake_py), "--json", str(tmp_path / "r.json")], env=env, stderr=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (state / "running").exists() and time.time() < deadline:
        time.sleep(0.1)
    time.sleep(1.5)  # healthy and measuring by now (50 requests of 1000 tokens take minutes)
    assert (state / "running").exists() and p.poll() is None
    p.send_signal(subprocess.signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == bench.EXIT_INTERRUPTED, err
    assert "interrupted; servers stopped" in err
    assert not (state / "running").exists()  # the stand-in removes it only when it is stopped
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["interrupted"] is True and doc["runs"][0]["error"] == "interrupted"
    assert bench.validate_report(doc) == []


def test_tiny_train_runs_the_kit_on_the_bench_gpu_first(tmp_path, monkeypatch, capsys):
    """--tiny-train: the training kit runs first (here the stand-in interpreter answers for it: it writes a pair
    as the kit lays it out, and records the GPU it was given), then the servers serve what it wrote."""
    here = os.path.dirname(os.path.abspath(__file__))
    fake_py = tmp_path / "python"
    fake_py.write_text(
        "#!/bin/sh\n"
        "if [ \"$1\" = -c ]; then [ -e \"$STANDIN_DIR/no-kit\" ] && exit 1; exit 0; fi\n"  # is the kit there?
        "if [ \"$2\" = sglang_ddtree_tools.trainkit ]; then\n"  # the kit's stand-in: its flat layout and prompts
        "  mkdir -p \"$3/dense-target\" \"$3/dense-drafter\"; echo '{\"vocab_size\": 512}' > \"$3/dense-target/config.json\"\n"
        "  echo '{\"block_size\": 4}' > \"$3/dense-drafter/config.json\"; echo '{}' > \"$3/manifest.json\"\n"
        "  echo '{\"input_ids\": [5, 6]}' > \"$3/prompts.jsonl\"; echo \"$CUDA_VISIBLE_DEVICES $*\" > \"$STANDIN_DIR/kit\"; exit 0\n"
        "fi\n"
        f"exec {sys.executable} {here}/standin_sglang_server.py \"$@\"\n")
    fake_py.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("STANDIN_DIR", str(state))
    monkeypatch.setattr(bench, "gpu_device_problem", lambda gpu: None)
    monkeypatch.setattr(bench, "gpu_memory_mib", lambda gpu: (0.0, 81559.0))
    monkeypatch.setattr(bench, "gpu_name", lambda gpu: "stand-in GPU")
    code = bench.main(["--tiny-train", "--family", "dense", "--seed", "5", "--gpu", "3", "--modes", "dflash",
                       "--concurrency", "2", "--max-new-tokens", "4", "--launcher", "process", "--python",
                       str(fake_py), "--json", str(tmp_path / "r.json"), "--start-timeout", "30"])
    assert code == bench.EXIT_OK, capsys.readouterr().err
    kit = (state / "kit").read_text().split()
    assert kit[0] == "3" and kit[1:4] == ["-m", "sglang_ddtree_tools.trainkit", kit[3]] and kit[4:] == [
        "--seed", "5", "--family", "dense", "--device", "cuda"]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["model"]["source"] == "tiny-trained" and doc["model"]["target"].endswith("/tiny/dense-target")
    assert doc["settings"]["prompts"]["source"].endswith("/tiny/prompts.jsonl")
    assert doc["runs"][0]["levels"][0]["requests"] == 2 and doc["runs"][0]["block"] == 4
    assert doc["settings"]["tiny_train_s"] is not None
    assert not os.path.exists(os.path.dirname(doc["model"]["target"]))  # the private work dir is gone
    (state / "no-kit").touch()  # a plugin without the training kit: said plainly, nothing started
    (state / "argv.jsonl").unlink()
    code = bench.main(["--tiny-train", "--modes", "plain", "--launcher", "process", "--python", str(fake_py),
                       "--json", str(tmp_path / "r2.json")])
    assert code == bench.EXIT_FAILED and not (state / "argv.jsonl").exists()
    assert "this plugin has no sglang_ddtree_tools.trainkit" in json.loads((tmp_path / "r2.json").read_text())["error"]


def test_reads_what_the_training_kit_writes(tmp_path):
    """The training kit's own output (its CPU toy preset, seconds): the pair, its block and its held-out prompts."""
    pytest.importorskip("transformers")
    out = tmp_path / "kit"
    r = subprocess.run([sys.executable, "-m", "sglang_ddtree_tools.trainkit", str(out), "--family", "dense", "--device", "cpu",
                        "--preset", "toy", "--seed", "3"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = bench.resolve_tiny(str(out), "dense")
    assert got["kind"] == "trained" and got["prompts"] == str(out / "prompts.jsonl")
    tcfg, dcfg = bench.read_config(got["target"]), bench.read_config(got["drafter"])
    prompts = bench.load_prompts(got["prompts"], tcfg["vocab_size"])
    assert prompts and all(0 <= t < tcfg["vocab_size"] for p in prompts for t in p)
    assert bench.drafter_block(dcfg) == dcfg["dflash_config"]["block_size"] and not bench.is_hybrid(tcfg)
    assert bench.trainkit_argv(sys.executable, str(out), "dense", 3)[2:] == ["sglang_ddtree_tools.trainkit", str(out), "--seed",
                                                                          "3", "--family", "dense", "--device", "cuda"]


def test_cold_warm_caches_are_the_ones_a_deployed_service_keeps_and_reach_a_systemd_run_server(tmp_path):
    from pathlib import Path

    env = bench.jit_cache_env(str(tmp_path))
    assert all(v.startswith(str(tmp_path) + os.sep) for v in env.values())
    assert len(set(env.values())) == len(env)
    # deploy/release/render.py gives each release's services the contract's caches; bench must time the same ones
    from sglang_ddtree import contract
    render = (Path(__file__).resolve().parents[2] / "deploy" / "release" / "render.py").read_text()
    assert "CACHE_ENV = contract.JIT_CACHE_ENV" in render
    assert bench.JIT_CACHE_ENV == contract.JIT_CACHE_ENV + (contract.XDG_CACHE_ENV,)
    for name, _ in bench.JIT_CACHE_ENV:
        assert name in servers.Server.ENV_KEEP  # systemd-run --setenv passes only these
    a = bench.parse_args(["--tiny-random", "--cold-warm"])
    assert a.cold_warm and not bench.parse_args(["--tiny-random"]).cold_warm


def test_first_request_figures():
    rec = bench.RequestRecord(sent=10.0, chunks=[(10.25, 0), (10.5, 4), (11.0, 8)], done=11.0)
    assert bench.first_request_figures(rec, 61.23) == {"server_start_s": 61.2, "ttft_ms": 500.0,
                                                       "total_ms": 1000.0, "tokens": 8, "error": None}
    bad = bench.RequestRecord(sent=1.0, error="URLError: refused", done=1.5)
    f = bench.first_request_figures(bad, 5.0)
    assert f["ttft_ms"] is None and f["tokens"] == 0 and f["error"] == "URLError: refused"


def test_profile_steps_keeps_a_step_profile_of_every_server(tmp_path, monkeypatch, capsys):
    """``--profile-steps``: after its levels each server is asked for a trace (the stand-in writes one, as
    SGLang's /start_profile does) and its summary lands in the report and the log, per step."""
    fake_py, state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n[4, 5]\n")
    out = tmp_path / "out"
    code = _standin_main(tmp_path, fake_py, out, "--modes", "dflash,tree-verify", "--budgets", "7",
                         "--concurrency", "1", "--max-new-tokens", "12", "--profile-steps", "3")
    logged = capsys.readouterr()
    assert code == 0
    doc = json.loads((out / "bench.json").read_text())
    assert bench.validate_report(doc) == []
    dfl, tv = doc["runs"]
    for r in (dfl, tv):
        p = r["profile"]
        assert p["steps_for_per_step"] == 3 and p["totals_per_step"]["gpu_ms"] == 0.1
        assert p["totals_per_step"]["launches"] == 1 and p["kernels"][0]["name"] == "standin_kernel"
    assert dfl["profile"]["steps"] == 0 and tv["profile"]["steps"] == 3  # the plugin's own step count
    # the raw traces stay beside the report, one folder a server
    kept = sorted(p.parent.name for p in (out / "profiles").glob("*/**/*.json*"))
    assert len(kept) == 2 and kept[0].endswith("dflash-4-e") and "tree-verify-7" in kept[1], kept
    assert "profile per step: span" in logged.out + logged.err and "standin_kernel 100us" in logged.out + logged.err
    assert not (state / "running").exists()


def test_profile_concurrency_profiles_the_steps_at_that_many_requests(tmp_path, monkeypatch, capsys):
    """``--profile-concurrency C``: the profiled steps run with C requests in flight (a step's cost at a batch
    size is read at that batch size), the summary says so and the log line names it."""
    from sglang_ddtree_tools import profile_step

    seen = []
    real = profile_step.profile_server

    def spying(*args, **kw):
        seen.append(kw["concurrency"])
        return real(*args, **kw)

    monkeypatch.setattr(profile_step, "profile_server", spying)
    fake_py, _state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n[4, 5]\n")
    out = tmp_path / "out"
    code = _standin_main(tmp_path, fake_py, out, "--modes", "tree-verify", "--budgets", "7", "--concurrency", "3",
                         "--max-new-tokens", "12", "--profile-steps", "3", "--profile-concurrency", "3")
    logged = capsys.readouterr()
    assert code == 0 and seen == [3]
    (tv,) = json.loads((out / "bench.json").read_text())["runs"]
    assert tv["profile"]["concurrency"] == 3
    assert "profile at 3 requests, per step: span" in logged.out + logged.err
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny-random", "--profile-steps", "3", "--profile-concurrency", "0"])
    assert bench.parse_args(["--tiny-random"]).profile_concurrency == 1


def test_profile_line_names_the_phases_and_the_heaviest_kernels():
    p = {"totals_per_step": {"span_ms": 6.0, "gpu_ms": 1.5, "launches": 40, "graph_launches": 3, "syncs": 2},
         "ranges": {"ddtree.commit": {"per_step": {"host_ms": 0.8, "gpu_ms": 0.05, "launches": 12}}},
         "kernels": [{"name": "fused_recurrent_kernel", "per_step_us": 420.0}]}
    line = bench.profile_line(p)
    assert line.startswith("per step: span 6.000 ms, GPU busy 1.500 ms, 40 launches (3.0 graphs), 2.0 syncs")
    assert "commit 0.80/0.050 ms 12L" in line and "fused_recurrent_kernel 420us" in line
    assert "GPU waits" not in line  # a summary from before the split says nothing of it
    p["totals_per_step"].update(runtime_syncs=1.0, item_calls=1.5, host_items=0.5)
    assert "2.0 syncs (1.0 GPU waits, 1.5 .item() of which 0.5 on host tensors)" in bench.profile_line(p)


def test_median_round_takes_one_real_round_and_keeps_every_rounds_figure():
    lv = lambda t, e=0: {"concurrency": 1, "output_tok_s": t, "accept_length": t / 100, "errors": e,
                         "first_error": "boom" if e else None}
    m = bench.median_round([lv(700.0), lv(650.0), lv(760.0)])
    assert m["output_tok_s"] == 700.0 and m["accept_length"] == 7.0 and m["round"] == 0  # one round's row, whole
    assert m["tok_s_rounds"] == [700.0, 650.0, 760.0] and m["tok_s_spread"] == round(110 / 700, 4)
    even = bench.median_round([lv(700.0), lv(650.0, e=1)])
    assert even["output_tok_s"] == 650.0 and even["errors"] == 1 and even["first_error"] == "boom"  # lower median
    assert bench.median_round([lv(5.0)]) == lv(5.0)  # one round: the row as measured
    entry = {"rounds": [{"status": "ok", "error": None, "levels": [lv(1.0)]},
                        {"status": "failed", "error": "server exited", "levels": []}]}
    bench._merge_rounds(entry)
    assert entry["status"] == "failed" and entry["error"] == "round 2 of 2: server exited"
    assert entry["levels"][0]["tok_s_rounds"] == [1.0]


def test_rounds_run_the_whole_list_again_with_fresh_servers(tmp_path, monkeypatch, capsys):
    """--rounds 2: A B, B A (a fresh stand-in server each time, one at a time); each level's row is a median
    round with every round's tok/s, the table shows them and the paired ratios, the report passes its schema."""
    fake_py, state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n[4, 5]\n")
    out = tmp_path / "out"
    code = _standin_main(tmp_path, fake_py, out, "--modes", "plain,tree-verify", "--budgets", "7",
                         "--concurrency", "1,2", "--max-new-tokens", "8", "--rounds", "2")
    table = capsys.readouterr().out
    assert code == 0
    assert not (state / "overlap").exists() and not (state / "running").exists()
    doc = json.loads((out / "bench.json").read_text())
    assert bench.validate_report(doc) == [] and doc["settings"]["rounds"] == 2
    for r in doc["runs"]:
        assert len(r["rounds"]) == 2 and all(x["status"] == "ok" for x in r["rounds"])
        for i, lv in enumerate(r["levels"]):
            per = [x["levels"][i]["output_tok_s"] for x in r["rounds"]]
            assert lv["tok_s_rounds"] == per and lv["output_tok_s"] == min(per)  # the lower of two
    argvs = [json.loads(x) for x in (state / "argv.jsonl").read_text().splitlines()]
    assert len(argvs) == 4  # two servers, twice; the second round in reverse
    assert ["--speculative-algorithm" in " ".join(map(str, x)) for x in argvs] == [False, True, True, False]
    assert sorted(os.listdir(out / "logs")) == ["00-plain-0-e-r2.log", "00-plain-0-e.log",
                                                "01-tree-verify-7-e-r2.log", "01-tree-verify-7-e.log"]
    assert "tok/s rounds" in table and "spread" in table
    assert "paired by round (each ratio: two servers one right after the other):\ntree-verify B=7 graphs=off / " \
           "plain graphs=off at c=1: median paired ratio" in table and "of 2 rounds" in table
    tv, plain = doc["runs"][1], doc["runs"][0]
    assert [(r["run"], r["peer"], r["concurrency"], r["n"]) for r in doc["paired"]] == [
        ("tree-verify B=7 graphs=off", "plain graphs=off", 1, 2), ("tree-verify B=7 graphs=off", "plain graphs=off", 2, 2)]
    assert doc["paired"][0]["ratios"] == [round(a["levels"][0]["output_tok_s"] / b["levels"][0]["output_tok_s"], 4)
                                          for a, b in zip(tv["rounds"], plain["rounds"])]
    bad = dict(doc, paired=[dict(doc["paired"][0], ratios=[1.0])])
    assert bench.validate_report(bad) == ["paired[0] is not a paired comparison (sglang_ddtree_tools.paired.report_section)"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny-random", "--rounds", "0"])


def test_overlap_both_races_each_scheduler_against_the_same_rounds_dflash(tmp_path, monkeypatch, capsys):
    """--overlap both --rounds 2: DFLASH, DDTREE on the synchronous scheduler, DDTREE on the overlap one, then the
    reverse; each DDTREE server gets its own SGLANG_DDTREE_OVERLAP (whatever this process has), the report names
    each by the scheduler its server said it ran, and both pair with the same round's DFLASH."""
    fake_py, state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n[4, 5]\n")
    monkeypatch.setenv("SGLANG_DDTREE_OVERLAP", "1")  # a switch left set in the caller's shell does not decide
    out = tmp_path / "out"
    code = _standin_main(tmp_path, fake_py, out, "--modes", "dflash,tree-verify", "--budgets", "7",
                         "--concurrency", "1", "--max-new-tokens", "8", "--rounds", "2", "--overlap", "both")
    cap = capsys.readouterr()
    table = cap.out
    assert code == 0
    doc = json.loads((out / "bench.json").read_text())
    assert bench.validate_report(doc) == [] and doc["settings"]["overlap"] == "both"
    assert [(r["mode"], r.get("overlap"), r.get("overlap_schedule")) for r in doc["runs"]] == [
        ("dflash", None, True), ("tree-verify", False, False), ("tree-verify", True, True)]
    assert [json.loads(x) for x in (state / "overlap_env.jsonl").read_text().splitlines()] == [
        "1", "0", "1", "1", "0", "1"]  # DFLASH keeps the caller's (unused by it); DDTREE: sync, overlap, reversed
    assert sorted(os.listdir(out / "logs")) == [
        "00-dflash-4-e-r2.log", "00-dflash-4-e.log", "01-tree-verify-7-e-sy-r2.log", "01-tree-verify-7-e-sy.log",
        "02-tree-verify-7-e-ov-r2.log", "02-tree-verify-7-e-ov.log"]
    assert [(r["run"], r["peer"], r["n"]) for r in doc["paired"]] == [
        ("tree-verify B=7 graphs=off", "dflash blk=4 graphs=off", 2),
        ("tree-verify B=7 overlap graphs=off", "dflash blk=4 graphs=off", 2)]
    assert "tree-verify B=7 overlap graphs=off" in table and "scheduler: overlap" in cap.err
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny-random", "--overlap", "maybe"])
    bad = json.loads(json.dumps(doc))
    bad["runs"][1]["overlap"] = "yes"
    assert bench.validate_report(bad) == ["runs[1].overlap must be true, false or null"]


def test_a_round_interrupted_while_its_server_stops_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    """A timeout's SIGTERM that lands while a measured server is being stopped: the round is in the report saved
    on the way out, its levels with it."""
    fake_py, state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n")
    out = tmp_path / "out"
    real_stop, stops = servers.Server.stop, []

    def stop(self):
        real_stop(self)
        stops.append(1)
        if len(stops) == 3:  # the third server (round 2's first: dflash, the round runs reversed) is stopped, then
            # the signal lands
            bench._on_sigterm(15, None)

    monkeypatch.setattr(servers.Server, "stop", stop)
    code = _standin_main(tmp_path, fake_py, out, "--modes", "plain,dflash", "--concurrency", "1",
                         "--max-new-tokens", "4", "--warmup-tokens", "0", "--graphs", "off", "--rounds", "3")
    capsys.readouterr()
    assert code == 130
    doc = json.loads((out / "bench.json").read_text())
    dflash = doc["runs"][1]
    assert [r["mode"] for r in doc["runs"]] == ["plain", "dflash"]  # the order asked, whatever order they ran in
    assert len(dflash["rounds"]) == 2 and dflash["rounds"][1]["status"] == "ok"
    assert dflash["levels"][0]["tok_s_rounds"] == [r["levels"][0]["output_tok_s"] for r in dflash["rounds"]]
    assert len(doc["runs"][0]["rounds"]) == 1  # plain's second round never started


def test_cpu_lists_parse_strictly_and_print_compactly():
    assert servers.parse_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert servers.parse_cpus(" 5 ") == [5] and servers.parse_cpus("2,1,2") == [1, 2]
    for bad in ("", "a", "3-1", "1,,2", "-1", "1-", "0-4096", "1 2"):
        with pytest.raises(ValueError, match="CPU list"):
            servers.parse_cpus(bad)
    assert servers.cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11" and servers.cpu_list([4]) == "4"
    # the clients keep the rest of what they may use; the servers cannot take CPUs outside it, nor all of it
    assert bench.pin_clients([0, 1], allowed=[0, 1, 2, 3]) == [2, 3]
    with pytest.raises(ValueError, match="no CPU for the clients"):
        bench.pin_clients([0, 1], allowed=[0, 1])
    with pytest.raises(ValueError, match="CPUs 7 are not among"):
        bench.pin_clients([0, 7], allowed=[0, 1])


def test_bad_cpus_are_refused_before_anything_runs(capsys):
    usable = sorted(os.sched_getaffinity(0))
    for spec, msg in (("x", "CPU list"), (servers.cpu_list(usable), "no CPU for the clients"),
                      ("4095", "not among")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(["--tiny-random", "--cpus", spec])
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_a_pinned_server_and_its_children_run_only_on_its_cpus(tmp_path, monkeypatch):
    """A real process launch (the launcher a host without systemd uses): the server and a process it starts run on
    the given CPUs; under systemd the unit gets AllowedCPUs= instead."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    code = ("import os, subprocess, sys; print('self', sorted(os.sched_getaffinity(0)), flush=True); "
            "subprocess.run([sys.executable, '-c', 'import os; print(\"child\", sorted(os.sched_getaffinity(0)))'])")
    log = tmp_path / "server.log"
    srv = servers.Server([sys.executable, "-c", code], dict(os.environ), str(log), launcher="process", cpus=[cpu])
    srv.start()
    srv.proc.wait(timeout=60)
    assert log.read_text().split("\n")[:2] == [f"self [{cpu}]", f"child [{cpu}]"]
    seen = []
    monkeypatch.setattr(servers.subprocess, "run", lambda argv, **kw: seen.append(argv))
    servers.Server(["python3", "-m", "sglang.launch_server"], {}, str(log), launcher="systemd-run", unit="u",
                   cpus=[3, 0, 1, 2, 8]).start()
    assert "--property=AllowedCPUs=0-3,8" in seen[0] and seen[0].index("--property=AllowedCPUs=0-3,8") < \
        seen[0].index("--")


def test_bench_cpus_pins_every_server_and_keeps_the_clients_off_them(tmp_path, monkeypatch, capsys):
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("needs two usable CPUs: one for the servers, one for the clients")
    fake_py, state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n")
    out = tmp_path / "out"
    try:
        code = _standin_main(tmp_path, fake_py, out, "--modes", "plain,dflash", "--concurrency", "1",
                             "--max-new-tokens", "4", "--warmup-tokens", "0", "--graphs", "off",
                             "--cpus", str(usable[0]))
        clients = sorted(os.sched_getaffinity(0))  # this process ran the clients
    finally:
        os.sched_setaffinity(0, usable)  # the rest of the test session as it was
    assert code == bench.EXIT_OK, capsys.readouterr().err
    aff = [json.loads(x) for x in (state / "affinity.jsonl").read_text().splitlines()]
    assert aff == [[usable[0]], [usable[0]]]  # both servers, only there
    assert clients == usable[1:]  # the clients on the others
    doc = json.loads((out / "bench.json").read_text())
    assert doc["settings"]["server_cpus"] == str(usable[0])


def _pyspy() -> str:
    """The real py-spy: beside this interpreter, on PATH, or the main venv's (the SGLang 0.5.17 venv has none)."""
    root = Path(__file__).resolve().parents[2]
    for exe in (os.path.join(os.path.dirname(sys.executable), "py-spy"), shutil.which("py-spy"),
                str(root / ".venv" / "bin" / "py-spy")):
        if exe and os.access(exe, os.X_OK):
            return exe
    pytest.fail("py-spy is a test dependency (pyproject's [test] extra, scripts/bootstrap): not installed")


def test_spy_summary_of_a_real_capture():
    """py-spy 0.4.3's raw output of a process with SGLang's loop names (tests/plugin/fixtures/pyspy_raw.txt,
    recorded with --subprocesses): the busiest loop's process is the scheduler, functions count once a stack,
    line numbers fold, samples outside the loop (start-up, the other process) do not count."""
    text = (Path(__file__).parent / "fixtures" / "pyspy_raw.txt").read_text()
    stacks = spy.parse_raw(text)
    assert stacks and all(n > 0 for _, n in stacks)
    s = spy.summarize(text, steps=100, marks=("run_batch", "process_batch_result", "absent_fn"))
    assert s["process"] is not None and s["samples"] > 0
    incl = {r["function"]: r["samples"] for r in s["inclusive"]}
    assert incl["event_loop_normal (capture_pyspy.py)"] == s["samples"]  # every counted sample is in the loop
    assert incl["run_batch (capture_pyspy.py)"] > incl["process_batch_result (capture_pyspy.py)"] > 0
    assert s["marks"]["absent_fn"]["samples"] == 0
    assert s["marks"]["run_batch"]["per_step"] == round(incl["run_batch (capture_pyspy.py)"] / 100, 3)
    outside = sum(n for frames, n in stacks if not any("event_loop_normal" in f for f in frames))
    assert outside > 0 and s["samples"] < sum(n for _, n in stacks)
    assert "scheduler samples" in spy.format_summary(s)
    assert spy.frame_key("f (a/b/c.py:12)") == "f (c.py)" and spy.frame_key("<module> (x.py)") == "<module> (x.py)"
    assert spy.parse_raw("garbage\nf (a.py:1);g (b.py:2) 7\nno-count x\n") == [(["f (a.py:1)", "g (b.py:2)"], 7)]
    assert spy.summarize("f (a.py:1) 3\n")["samples"] == 0  # no scheduler loop: nothing counted
    # SGLang's shapes: methods by qualified name, a spawned child's command line holding a newline and a ';'
    raw = ('process 1:"python -m sglang.launch_server";process 2:"python -c from multiprocessing.spawn import '
           'spawn_main;\n spawn_main(tracker_fd=3)";Scheduler.event_loop_normal (sglang/scheduler.py:10);'
           'Scheduler.run_batch (sglang/scheduler.py:20) 5\n'
           'process 1:"python -m sglang.launch_server";process 2:"python -c from multiprocessing.spawn import '
           'spawn_main;\n spawn_main(tracker_fd=3)";Scheduler.event_loop_normal (sglang/scheduler.py:10);'
           'Scheduler.on_idle (sglang/scheduler.py:30) 7\n'
           'process 1:"python -m sglang.launch_server";process 2:"x";Scheduler.event_loop_normal (s.py:1);'
           'JITFunction._do_compile (triton/jit.py:9) 2\n'
           'process 1:"python -m sglang.launch_server";main (launch_server.py:3) 4\n')
    assert [n for _, n in spy.parse_raw(raw)] == [5, 7, 2, 4]
    assert spy.parse_raw(raw)[0][0][1].startswith('process 2:"python -c from') and spy._process_of(
        spy.parse_raw(raw)[0][0]) == "2"
    q = spy.summarize(raw, marks=("run_batch",))
    assert q["samples"] == 5 and q["excluded"] == {"on_idle": 7, "_do_compile": 2}
    assert q["marks"]["run_batch"]["samples"] == 5
    assert spy.summarize(raw, exclude=())["samples"] == 14


def test_spy_argv_pins_the_server_not_the_sampler():
    argv = spy.spy_argv("/x/py-spy", "/o/s.txt", 500, [3, 1, 2], "/usr/bin/taskset")
    assert argv[:2] == ["/x/py-spy", "record"] and "--nonblocking" in argv and "--subprocesses" in argv
    assert argv[argv.index("--rate") + 1] == "500" and argv[argv.index("--output") + 1] == "/o/s.txt"
    assert argv[argv.index("--") + 1:] == ["/usr/bin/taskset", "--cpu-list", "1,2,3"]
    assert spy.spy_argv("p", "o")[-1] == "--"
    with pytest.raises(ValueError):
        spy.spy_argv("p", "o", 0)


def test_bench_spy_samples_each_server_and_stops_it(tmp_path, monkeypatch, capsys):
    """--spy with the real py-spy around each stand-in server: its capture is written (SIGINT to the sampler),
    the server's whole process group is gone after, and the report has the scheduler loop's samples per step."""
    exe = _pyspy()
    usable = sorted(os.sched_getaffinity(0))
    cpus = ["--cpus", str(usable[0])] if len(usable) > 1 else []  # the servers pinned under the sampler too
    fake_py, state = _standin_bench(tmp_path, monkeypatch, "[1, 2, 3]\n")
    out = tmp_path / "out"
    code = _standin_main(tmp_path, fake_py, out, "--modes", "plain,dflash", "--concurrency", "1",
                         "--max-new-tokens", "200", "--warmup-tokens", "0", "--graphs", "off", "--requests", "2",
                         "--profile-steps", "5", "--spy", exe, "--spy-rate", "500", "--rounds", "2", *cpus)
    os.sched_setaffinity(0, usable)  # the clients' pinning undone for the rest of the session
    err = capsys.readouterr().err
    assert code == bench.EXIT_OK, err
    assert not (state / "running").exists()  # each stand-in stopped (it holds the file while it lives)
    doc = json.loads((out / "bench.json").read_text())
    for r in doc["runs"]:
        s = r["spy"]
        assert s["samples"] > 0 and s["marks"]["run_batch"]["samples"] > 0, s
        assert s["steps"] == bench.decode_steps(r["levels"]) and s["per_step"] > 0
        assert (out / "spy" / s["capture"]).is_file()
        assert "profile" not in r  # --spy replaces the torch profiler, which it would sample too
    assert doc["runs"][1]["spy"]["steps"] == 200.0  # DFLASH's stand-in accepts 2 a step: 400 tokens, 200 steps
    for r in doc["runs"]:  # the second round's server sampled too, its summary kept with its round
        assert r["rounds"][1]["spy"]["samples"] > 0 and r["rounds"][1]["spy"]["capture"].endswith("-r2.txt")
    if cpus:  # each stand-in (started by taskset under py-spy) ran on the servers' CPU only
        aff = [json.loads(x) for x in (state / "affinity.jsonl").read_text().splitlines()]
        assert aff == [[usable[0]]] * 4
    assert "scheduler samples" in err
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny-random", "--spy", exe, "--launcher", "systemd-run"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--tiny-random", "--spy", str(tmp_path / "nope"), "--launcher", "process"])


def test_stop_ends_the_whole_session_also_after_its_leader_exited(tmp_path):
    """Server.stop: a server whose main process exited and left a child (what py-spy's SIGINT or a crashed
    launch_server leaves) still has that child stopped; the group counts as gone once only zombies are left."""
    log = tmp_path / "server.log"
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print(p.pid, flush=True)")
    srv = servers.Server([sys.executable, "-c", code], dict(os.environ), str(log), launcher="process")
    srv.start()
    srv.proc.wait(timeout=60)  # the leader is gone; its child sleeps on in the same session
    child = int(log.read_text().split()[0])
    assert servers._group_alive(srv.proc.pid) and servers._stat_fields(str(child))[2] == str(srv.proc.pid)
    t = time.monotonic()
    srv.stop()
    assert time.monotonic() - t < 14  # SIGTERM sufficed; not the SIGKILL round
    f = servers._stat_fields(str(child))
    assert f is None or (f[0] == "Z" and not servers._group_alive(srv.proc.pid))
    assert servers.child_pids(os.getpid()) == sorted(servers.child_pids(os.getpid()))


def test_spy_reads_a_kept_capture_again_from_the_command_line(tmp_path, capsys):
    """``python -m sglang_ddtree_tools.spy CAPTURE``: the same summary as bench's, per step with --steps; a capture with no
    scheduler loop exits 1, a missing file 2 with one line."""
    cap = Path(__file__).parent / "fixtures" / "pyspy_raw.txt"
    assert spy.main([str(cap), "--steps", "150", "--mark", "process_batch_result", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads(json.dumps(spy.summarize(cap.read_text(), steps=150, marks=["process_batch_result"])))
    assert got["marks"]["process_batch_result"]["per_step"] > 0
    assert spy.main([str(cap), "--top", "3"]) == 0 and "scheduler samples" in capsys.readouterr().out
    empty = tmp_path / "x.txt"
    empty.write_text("f (a.py:1) 3\n")
    assert spy.main([str(empty)]) == 1
    assert spy.main([str(tmp_path / "missing.txt")]) == 2 and "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        spy.main([str(cap), "--steps", "0"])


@pytest.mark.sglang_api
def test_every_pool_flag_is_an_option_of_sglangs_real_parser():
    """contract.POOL_FLAGS keeps a service's sizing off a bench server beside it: a flag SGLang does not know
    would be kept instead, silently."""
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    known = {o for a in p._actions for o in a.option_strings}
    from sglang_ddtree import contract
    assert [f for f in contract.POOL_FLAGS if f not in known] == []


def test_a_failed_start_up_is_named_by_the_logs_last_exception_not_its_last_line():
    log = "\n".join([
        "[2026-12-05 08:04:40] Scheduler hit an exception: Traceback (most recent call last):",
        '  File "/venv/sglang/srt/managers/scheduler.py", line 3, in run_scheduler_process',
        '    raise RuntimeError("Not enough memory")',
        "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
        "[2026-12-05 08:04:44] kill_process_tree called: parent_pid=5832, include_parent=True, pid=5832"])
    assert servers.failure_line(log) == "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static."
    assert servers.failure_line("[t] torch.OutOfMemoryError: CUDA out of memory") == \
        "torch.OutOfMemoryError: CUDA out of memory"
    assert servers.failure_line("loading\nready on :30000") == ""


def test_a_server_run_as_another_user_gets_its_own_cache_directory_not_roots_home(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(servers.subprocess, "run", lambda argv, **kw: seen.append(argv))
    servers.Server(["python3", "-m", "sglang.launch_server"], {"HOME": "/root", "PATH": "/bin"},
                   str(tmp_path / "log"), launcher="systemd-run", unit="u", user="sglang").start()
    argv = seen[0][:seen[0].index("--")]
    cache = f"/var/cache/{servers.TRANSIENT_CACHE}"
    assert "--uid=sglang" in argv and f"--property=CacheDirectory={servers.TRANSIENT_CACHE}" in argv
    assert f"--setenv=HOME={cache}" in argv and "--setenv=HOME=/root" not in argv
    assert f"--setenv=XDG_CACHE_HOME={cache}/xdg" in argv
    seen.clear()
    servers.Server(["python3"], {"HOME": "/root"}, str(tmp_path / "log"), launcher="systemd-run", unit="u").start()
    assert "--setenv=HOME=/root" in seen[0]  # root's own server keeps root's HOME


def test_a_bench_server_has_the_path_of_a_deployed_unit_its_venvs_bin_first():
    spec = servers.ServerSpec(mode="plain", target="/m/t")
    env = servers.server_env(spec, 0, base={"PATH": "/usr/bin"}, python="/opt/v/bin/python")
    assert env["PATH"].split(":")[0] == "/opt/v/bin"  # FlashInfer's JIT runs the venv's ninja
    from sglang_ddtree import contract
    assert env["PATH"] == contract.server_path("/opt/v")
    assert servers.server_env(spec, 0, base={"PATH": "/usr/bin"})["PATH"] == "/usr/bin"
