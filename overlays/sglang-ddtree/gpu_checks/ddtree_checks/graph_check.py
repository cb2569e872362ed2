"""Tree-verify under CUDA graphs on a real GPU: lossless, replayed, and where the step's time goes.

``python -m ddtree_checks.graph_check --out DIR [--families hybrid dense] [--pairs DIR] [--budget 15]``

Per family: a plain server (graphs off; the re-scoring reference) stays up; then, ONE AT A TIME beside it,
DDTREE tree-verify with decode CUDA graphs on and off, and SGLang's DFLASH with graphs on.  For each:
greedy outputs of ``--prompts`` x ``--tokens`` one at a time and 4 at a time, the lossless statistic of
:mod:`sglang_ddtree_tools.smoke` (every emitted token re-scored by one prefill of the plain server), accept
length, tok/s (indicative only: the plain server idles beside it), whether the target's verify graph was
captured with the tree mask (the worker's log line), the plugin's accept counters, and a torch-profiler
summary of ``--profile-steps`` steps (:mod:`ddtree_checks.profile_step`).
Models: ``--pairs DIR`` (the trained kit's DIR/FAMILY/{target,drafter}) or the random tiny kit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from sglang_ddtree_tools import smoke, tiny
from sglang_ddtree.contract import DFLASH, PLAIN, TREE_VERIFY

from .profile_step import profile_server

GRAPHS_ON = ("--cuda-graph-backend-decode", "full")


def _pair(family, a):
    if a.pairs:  # either layout: DIR/FAMILY/{target,drafter} or the training kit's DIR/FAMILY-{target,drafter}
        from sglang_ddtree_tools.bench import resolve_tiny

        got = resolve_tiny(a.pairs, family)
        return {"target": got["target"], "drafter": got["drafter"]}
    return tiny.write_family(os.path.join(a.work, "models"), family, seed=0)


def _log_facts(path):
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return {}
    stats = re.findall(r"DDTREE accept stats (\{.*\})", text)
    return {
        "tree_mask_graph": "captured with the tree mask" in text,
        "graph_line": next((ln.strip()[-220:] for ln in text.splitlines() if "DDTREE tree-verify: target verify" in ln), None),
        "accept_stats": json.loads(stats[-1]) if stats else None,
        "errors": [ln.strip()[-300:] for ln in text.splitlines() if "Traceback" in ln or "Error" in ln][:5],
    }


def run_family(family, a, log=print):
    paths = _pair(family, a)
    ps = smoke.make_prompts(a.prompts, length=16, seed=3, lo=4, hi=a.vocab_hi) if not a.prompts_file else \
        [json.loads(l)["input_ids"] for l in open(a.prompts_file) if l.strip()][: a.prompts]
    caps = dict(mem_fraction=0.3, max_total_tokens=65536, max_mamba_cache=48 if family == "hybrid" else None)
    res = {"family": family, "models": paths, "servers": {}}
    ref_spec = smoke.ServerSpec(PLAIN, paths["target"], **caps)
    port = smoke.free_port()
    ref = smoke.Server(smoke.server_argv(sys.executable, ref_spec, port), smoke.server_env(ref_spec, a.gpu),
                       os.path.join(a.work, f"{family}-plain.log"), launcher="process")
    ref.start()
    ref_base = f"http://127.0.0.1:{port}"
    try:
        log(f"{family}: plain reference healthy after {smoke.wait_healthy(ref_base, ref, 400):.0f}s")
        plain_out = [g["output_ids"] for g in smoke.generate(ref_base, ps, a.tokens)]
        runs = [("tree-verify B=%d graphs on" % a.budget, smoke.ServerSpec(TREE_VERIFY, paths["target"], paths["drafter"],
                                                                          budget=a.budget, extra_args=GRAPHS_ON, **caps)),
                ("tree-verify B=%d graphs off" % a.budget, smoke.ServerSpec(TREE_VERIFY, paths["target"], paths["drafter"],
                                                                           budget=a.budget, **caps)),
                ("dflash graphs on", smoke.ServerSpec(DFLASH, paths["target"], paths["drafter"], block=a.block,
                                                      extra_args=GRAPHS_ON, **caps))]
        runs = [r for r in runs if not a.only or any(o in r[0] for o in a.only)]
        for name, spec in runs:
            port = smoke.free_port()
            logp = os.path.join(a.work, f"{family}-{name.replace(' ', '_').replace('=', '')}.log")
            srv = smoke.Server(smoke.server_argv(sys.executable, spec, port), smoke.server_env(spec, a.gpu), logp,
                               launcher="process")
            base = f"http://127.0.0.1:{port}"
            row = {}
            try:
                srv.start()
                row["healthy_after_s"] = round(smoke.wait_healthy(base, srv, 400), 1)
                smoke.generate(base, ps[:2], 16)  # warm-up
                for conc in a.concurrency:
                    t0 = time.time()
                    got = smoke.generate(base, ps, a.tokens, concurrency=conc)
                    wall = time.time() - t0
                    outs = [g["output_ids"] for g in got]
                    st = smoke.lossless_stats(outs, [smoke.rescore(ref_base, p, o) for p, o in zip(ps, outs)])
                    acc = [g["meta_info"].get("spec_accept_length") for g in got]
                    acc = [x for x in acc if x is not None]
                    st["accept_length"] = round(sum(acc) / len(acc), 3) if acc else None
                    st["tok_s"] = round(sum(len(o) for o in outs) / wall, 1)
                    st["identical_to_plain"] = smoke.exact_match(outs, plain_out)
                    row[f"conc{conc}"] = st
                    log(f"{family} {name} conc {conc}: {json.dumps(st)}")
                if a.profile_steps and TREE_VERIFY in name:
                    try:
                        row["profile"] = profile_server(base, os.path.join(a.work, "prof", family + name.replace(" ", "_")),
                                                        a.profile_steps, ps[0], max_new=256, concurrency=1)
                        row["profile_conc4"] = profile_server(base, os.path.join(a.work, "prof4", family + name.replace(" ", "_")),
                                                              a.profile_steps, ps[0], max_new=256, concurrency=4)
                    except Exception as e:  # noqa: BLE001 - reported
                        row["profile_error"] = f"{type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - reported, the next server still runs
                row["error"] = f"{type(e).__name__}: {e}"[-2000:]
            finally:
                srv.stop()
            row["log"] = _log_facts(logp)
            res["servers"][name] = row
            log(f"{family} {name}: {json.dumps({k: v for k, v in row.items() if k not in ('profile', 'profile_conc4')})[:1500]}")
    finally:
        ref.stop()
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m ddtree_checks.graph_check")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/graph_check")
    ap.add_argument("--families", nargs="+", default=["hybrid", "dense"])
    ap.add_argument("--pairs", help="trained tiny pairs: DIR/FAMILY/{target,drafter}")
    ap.add_argument("--prompts-file", help="JSONL of {input_ids: [...]} (held-out prompts)")
    ap.add_argument("--vocab-hi", type=int, default=31000)
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--profile-steps", type=int, default=30)
    ap.add_argument("--only", nargs="*", help="run only the servers whose name contains one of these")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4], help="requests in flight (default 1 4)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    out = {"argv": sys.argv, "families": {}}
    for fam in a.families:
        out["families"][fam] = run_family(fam, a)
        with open(os.path.join(a.out, "graph_check.json"), "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
