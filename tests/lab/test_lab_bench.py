"""`fab bench` and `mode: auto` on the lab: refused before any release; a CPU lab host says it cannot run a GPU
benchmark - clearly, exit 2, no transient unit or work directory left, the deployed service untouched, nothing
kept; `fab deploy` refuses a `mode: auto` service without a bench result for its host, plugin and model, and
deploys the mode and budget a bench result picks when there is one."""
from __future__ import annotations

import json
import re
import time

import pytest

from deploy.release import build

from helpers import CLEAN, lab_inventory, ssh

pytestmark = pytest.mark.lab
HOST = "h200"


@pytest.fixture(scope="module")
def deployed(lab, tmp_path_factory, fab):
    tmp = tmp_path_factory.mktemp("labbench")
    ssh(lab, HOST, CLEAN)
    inv = lab_inventory(tmp, keep=[HOST])
    none = fab("bench", HOST, inventory=inv)
    r = fab("deploy", "--yes", inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    yield {"inv": inv, "tmp": tmp, "before_deploy": none, "lab": lab}
    ssh(lab, HOST, CLEAN + f"; {lab.hosts[HOST].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
        check=False)


def invocation(lab):
    return ssh(lab, HOST, "systemctl show -p InvocationID --value sglang-ddtree@gpu0").stdout.strip()


def current_release(lab):
    return ssh(lab, HOST, "readlink /opt/ddtree/releases/current").stdout.strip().rstrip("/").rsplit("/", 1)[-1]


def test_refused_before_any_release(deployed):
    r = deployed["before_deploy"]
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{HOST} has no active release: run `fab deploy` first" in r.stderr


def test_lab_host_has_no_gpu_and_says_so(lab, deployed, fab):
    before = invocation(lab)
    r = fab("bench", HOST, "--concurrency", "1,4", "--budgets", "7", inventory=deployed["inv"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot run: no GPU device /dev/nvidiactl or /dev/nvidia0 on this host" in r.stderr
    # the plan was shown: the service's own models, the active release, what would run
    assert (f"[{HOST}] bench on GPU 0 (gpu0), release {current_release(lab)}: /models/Qwen3-8B + "
            "/models/Qwen3-8B-DFlash-b16; modes plain,dflash,tree-verify, budgets 7, graphs both, concurrency 1,4"
            in r.stdout), r.stdout
    assert "WARNING GPU 0 serves gpu0" in r.stdout
    left = ssh(lab, HOST, "systemctl list-units --all --no-legend 'ddtree-bench-*'").stdout.strip()
    assert left == ""
    assert ssh(lab, HOST, "ls /tmp | grep -c ddtree-bench || true").stdout.strip() == "0"
    assert invocation(lab) == before  # the deployed service was not touched
    assert not (deployed["tmp"] / "bench").exists()  # nothing measured, nothing kept
    # the tools ran from the wheel the call carried (the report above is their bench's); the serving venv has the
    # plugin and no tool: neither the tools distribution nor a measurement module in the plugin
    spec = ssh(lab, HOST, f"{lab.hosts[HOST].vars['venv']}/bin/python -c 'import importlib.util as u; "
                          "print(u.find_spec(\"sglang_ddtree\") is not None, u.find_spec(\"sglang_ddtree_tools\"), "
                          "u.find_spec(\"sglang_ddtree.bench\"), u.find_spec(\"sglang_ddtree.smoke\"))'").stdout.split()
    assert spec == ["True", "None", "None", "None"], spec


def test_json_and_tiny_say_the_same(deployed, fab):
    r = fab("bench", HOST, "--json", "--tiny", "--modes", "plain,tree-verify", inventory=deployed["inv"])
    out = json.loads(r.stdout)
    assert r.returncode == 2 and out["exit"] == 2 and out["record"] is None
    assert out["plan"]["tiny"] == "dense" and out["plan"]["modes"] == ["plain", "tree-verify"]
    assert out["line"].startswith("cannot run: no GPU device")
    pf = deployed["tmp"] / "prompts.jsonl"  # prompts travel in the call and are written in the op's private dir
    pf.write_text('{"input_ids": [1, 2, 3]}\n[4, 5]\n')
    r = fab("bench", HOST, "--prompts", str(pf), "--modes", "plain", inventory=deployed["inv"])
    assert r.returncode == 2 and f"prompts {pf}" in r.stdout and "cannot run: no GPU device" in r.stderr
    assert ssh(deployed["lab"], HOST, "ls /tmp | grep -c ddtree-bench || true").stdout.strip() == "0"
    pf.write_text('[1, 2]\n[3, "x"]\n')
    r = fab("bench", HOST, "--prompts", str(pf), inventory=deployed["inv"])
    assert r.returncode == 2 and f"{pf}:2: a prompt is" in r.stderr
    r = fab("bench", HOST, "--dry-run", "--budgets", "15,31", inventory=deployed["inv"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"[{HOST}] would run: /opt/sglang/venv/bin/python -m sglang_ddtree_tools.bench --gpu 0 --modes "
            "plain,dflash,tree-verify --budgets 15,31 --concurrency 1,4,16 --graphs both --block 16") in r.stdout
    assert "--launcher systemd-run --unit-prefix ddtree-bench-" in r.stdout and "--user sglang" in r.stdout
    assert "--model /models/Qwen3-8B --draft-model /models/Qwen3-8B-DFlash-b16" in r.stdout
    # a budget schedule beside a node budget: shown in the plan and sent as one word the host's bench reads back
    r = fab("bench", HOST, "--dry-run", "--modes", "dflash,tree-verify", "--budgets", "15; 1:15,4:15,8:7",
            inventory=deployed["inv"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "modes dflash,tree-verify, budgets 15;1:15,8:7, graphs both" in r.stdout, r.stdout
    assert "--modes dflash,tree-verify --budgets '15;1:15,8:7' --concurrency" in r.stdout, r.stdout
    r = fab("bench", HOST, "--budgets", "15; 1:15,0:7", inventory=deployed["inv"])
    assert r.returncode == 2 and "--budgets: '1:15,0:7' is not a valid schedule" in r.stderr, r.stderr
    r = fab("bench", HOST, "--gpu", "3", inventory=deployed["inv"])
    assert r.returncode == 2 and f"{HOST} has no GPU 3 (its GPUs: 0)" in r.stderr
    r = fab("bench", HOST, "--server-args", "--host 0.0.0.0", inventory=deployed["inv"])
    assert r.returncode == 2 and "--host is it; the deploy tool sets --host itself" in r.stderr


def auto_inventory(deployed, name):
    return lab_inventory(deployed["tmp"], name=name, keep=[HOST],
                         hosts={HOST: {"services": {0: {"mode": "auto", "concurrency": 4}}}})


def test_deploy_refuses_auto_without_a_bench_result(lab, deployed, fab):
    inv = auto_inventory(deployed, "auto-none.yaml")
    before, rel = invocation(lab), current_release(lab)
    r = fab("deploy", "--yes", inventory=inv)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert (f"[{HOST}] REFUSED gpu0: mode auto: no bench result for host {HOST}, model /models/Qwen3-8B with "
            "drafter /models/Qwen3-8B-DFlash-b16, plugin source ") in out
    assert f"run `fab bench {HOST}` with this plugin deployed" in out
    assert invocation(lab) == before and current_release(lab) == rel  # nothing was touched


def hand_made_result(release: str, digest: str) -> dict:
    """HAND-MADE bench result (this test writes it; no GPU measured it): what `fab bench` keeps, in the shape
    deploy/bench.py reads, for the lab's model pair and the plugin being deployed. At concurrency 4 DDTREE
    tree-verify at B=7 is fastest among the runs the deploy can serve; B=31 and DFLASH are slower; a tree-verify
    run with CUDA graphs off is faster still but is not what the deploy renders (graphs on), so it must not win."""
    lv = lambda c, tps: {"concurrency": c, "requests": 16, "errors": 0, "output_tokens": 2048,  # noqa: E731
                         "output_tok_s": tps, "wall_s": 2048 / tps, "accept_length": 3.1,
                         "ttft_ms": {"p50": 12.0, "p99": 30.0}, "itl_ms": {"p50": 3.0, "p99": 9.0}, "first_error": None}
    run = lambda mode, b, blk, g, pts: {"mode": mode, "budget": b, "block": blk, "graphs": g, "status": "ok",  # noqa: E731
                                        "error": None, "levels": [lv(c, t) for c, t in pts]}
    report = {"schema": "ddtree-bench/1", "created": "2026-12-02T00:00:00Z", "ok": True,
              "note": "HAND-MADE by tests/lab/test_lab_bench.py: not a measurement",
              "gpu": {"name": "HAND-MADE", "memory_total_mib": 1, "memory_used_mib_at_start": 0},
              "versions": {}, "settings": {"max_new_tokens": 128}, "model": {},
              "runs": [run("plain", None, None, True, [(1, 100.0), (4, 300.0)]),
                       run("dflash", None, 16, True, [(1, 150.0), (4, 400.0)]),
                       run("tree-verify", 7, None, True, [(1, 180.0), (4, 520.0)]),
                       run("tree-verify", 31, None, True, [(1, 200.0), (4, 450.0)]),
                       run("tree-verify", 7, None, False, [(1, 400.0), (4, 900.0)])]}
    rec = {"created": report["created"], "host": HOST, "release": release, "plugin": {"version": "HAND-MADE",
           "source_digest": digest}, "gpu": 0, "instance": "gpu0", "model": "/models/Qwen3-8B",
           "draft_model": "/models/Qwen3-8B-DFlash-b16", "tiny": None, "block": 16, "prompts": "HAND-MADE",
           "report": report}
    return {"schema": "ddtree-bench-result/1", "host": HOST, "release": release, "results": [rec]}


def test_deploy_gives_auto_the_mode_the_bench_result_picks(lab, deployed, fab):
    inv = auto_inventory(deployed, "auto-picked.yaml")
    rel = current_release(lab)
    d = deployed["tmp"] / "bench" / HOST
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{rel}.json").write_text(json.dumps(hand_made_result(rel, build.tree_digest(build.DEFAULT_PLUGIN_DIR))))
    t = time.monotonic()
    r = fab("deploy", "--yes", inventory=inv)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert (f"[{HOST}] gpu0: mode auto -> tree-verify B=7: 520.0 tok/s at concurrency 4, bench {HOST}/{rel}.json "
            "(2026-12-02T00:00:00Z); next tree-verify B=31 450.0 tok/s") in out
    new = current_release(lab)
    assert new != rel
    env = ssh(lab, HOST, "cat /opt/ddtree/releases/current/env/gpu0.env").stdout
    assert "SGLANG_DDTREE_MODE=tree-verify" in env and "SGLANG_DDTREE_BUDGET=7" in env, env
    assert re.search(r"--speculative-num-draft-tokens 8(\s|$)", env, re.M)  # D = B + 1 of the chosen budget, not the inventory's 16
    man = json.loads(ssh(lab, HOST, "cat /opt/ddtree/releases/current/manifest.json").stdout)
    assert man["services"]["gpu0"]["mode"] == "tree-verify" and man["services"]["gpu0"]["budget"] == 7
    assert man["services"]["gpu0"]["auto"].startswith("tree-verify B=7: 520.0 tok/s")
    assert man["params"]["auto"]["gpu0"] == man["services"]["gpu0"]["auto"]
    st = json.loads(fab("status", "--json", inventory=inv).stdout)
    assert [(x["mode"], x["health"]) for x in st] == [("tree-verify", "ok")]
    print(f"auto deploy: {time.monotonic() - t:.1f}s")
