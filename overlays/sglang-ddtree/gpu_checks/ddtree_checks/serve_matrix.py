"""Serve the tiny models with real SGLang on one GPU in every mode and measure them.

``python -m ddtree_checks.serve_matrix --out DIR [--families hybrid dense] [--quick]``
``python -m ddtree_checks.serve_matrix --out DIR --pairs /tmp/tiny --block 16 --graphs --prompts 64 --tokens 128``
(the training kit's pairs and held-out prompts, decode CUDA graphs on: issue 12's item 6 in one command)

Per family (``hybrid``: Qwen3-Next with GDN layers; ``dense``: Qwen3), servers
started side by side on the GPU (each its own port and memory fraction):
``plain``, ``dflash`` (SGLang's own, block 8), DDTREE ``shadow-linear`` (block 8,
B = 15) and DDTREE ``tree-verify`` at B = 7, 15, 31, 63, plus on the hybrid
target a deliberately *leaky* tree-verify (``SGLANG_DDTREE_UNSAFE_CHAIN_STATE=1``:
the recurrent layers process the tree's slots in chain order, so a node starts
from its previous sibling's state, not its parent's).

Measured per server, with the statistic of :mod:`sglang_ddtree_tools.smoke`:
greedy outputs of ``--prompts`` prompts x ``--tokens`` new tokens, one at a
time and ``--concurrency`` at a time, each emitted token re-scored by one
prefill of the plain server (top-2 log-probs; violation = not the argmax by
more than the margin), exact-match rate against plain decoding, SGLang's
reported accept length (and DDTREE shadow's would-accept length), tokens/s;
sampling (temperature 1, top-p 0.9): all requests complete; an unsupported
request (return_logprob) is rejected alone and the next one is served.
With ``--graphs`` every server but the leaky one runs SGLang's decode CUDA graphs (tree-verify: the target's
verify graph captured with the tree mask, the step's glue replayed from graphs); the leaky variant stays eager (it
drops the tree links, which a graph captured with them would refill). Each DDTREE tree-verify server's last
``DDTREE accept stats`` line (accepted tokens off the first branch, own rank > 0, the depth histogram, the glue
graphs' replays and failures; with a schedule's chain entries, the chain-entry steps DFLASH's own step and the
plugin's served) is read from its log into the result.
Writes ``serve_matrix.json`` and a readable ``serve_matrix.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from sglang_ddtree_tools import servers as servers_mod
from sglang_ddtree_tools import smoke
from sglang_ddtree import contract
from sglang_ddtree.contract import DFLASH, PLAIN, SHADOW_LINEAR, TREE_VERIFY
from sglang_ddtree_tools.bench import OVERLAP_CHOICES, level_prompts, overlap_env, server_overlap

from .graph_check import GRAPHS_ON, _log_facts, _pair


def _specs(family: str, paths: dict, quick: bool, a=None):
    t, d = paths["target"], paths["drafter"]
    blk = a.block
    g = GRAPHS_ON if a.graphs else ()
    # The servers start side by side, and SGLang sizes its pools from the memory it finds free at start-up
    # (budget = free - total * (1 - fraction)): uncapped, the first ones up take their whole budget and a later
    # one finds none (on the H200, tree-verify B=31 started last and failed with "Not enough GPU memory for
    # hybrid state cache"). Capped pools keep each server small, so a generous fraction fits them all.
    caps = dict(mem_fraction=a.mem_fraction, max_total_tokens=a.max_total_tokens,
                max_mamba_cache=max(48, 4 * a.concurrency) if family == "hybrid" else None)
    specs = {
        PLAIN: (smoke.ServerSpec(PLAIN, t, extra_args=g, **caps), {}),
        DFLASH: (smoke.ServerSpec(DFLASH, t, d, block=blk, extra_args=g, **caps), {}),
        "shadow-linear B=15": (smoke.ServerSpec(SHADOW_LINEAR, t, d, budget=15, block=blk, extra_args=g, **caps),
                               {}),
    }
    # --overlap: the scheduler each tree-verify server runs (the plugin reads SGLANG_DDTREE_OVERLAP at start-up);
    # "both" serves every budget twice, synchronous and overlap, so one matrix proves both schedulers lossless.
    scheds = OVERLAP_CHOICES[getattr(a, "overlap", "default")]
    for b in ((15,) if quick else tuple(a.budgets)):
        for ov in scheds:
            suffix = " overlap" if ov and len(scheds) > 1 else ""
            # a schedule (its steps switch budgets with the batch size) is given the drafter's block, as a
            # deployed unit is: its chain entry verifies that width
            sched = contract.is_schedule(b)
            specs[f"tree-verify B={b}{suffix}"] = (
                smoke.ServerSpec(TREE_VERIFY, t, d, budget=b, block=blk if sched else None, extra_args=g, **caps),
                overlap_env(ov))
    if family == "hybrid":
        specs["LEAKY tree-verify B=15"] = (smoke.ServerSpec(TREE_VERIFY, t, d, budget=15, **caps),
                                           {"SGLANG_DDTREE_UNSAFE_CHAIN_STATE": "1"})
    return specs


def _budget(text: str):
    """A node budget (int) or a budget schedule's canonical text (argparse's type: a bad one is its error)."""
    if problem := contract.budget_problem(text if ":" in text else _int(text), TREE_VERIFY):
        raise argparse.ArgumentTypeError(f"{text!r} {problem}")
    return contract.budget_text(text) if ":" in text else int(text)


def _int(text: str):
    try:
        return int(text)
    except ValueError:
        return text


def _pair_and_prompts(family: str, a):
    """The models (the kit's trained pair with --pairs, else the random tiny kit) and the prompts (--prompts-file,
    else the kit's held-out prompts.jsonl beside a trained pair, else seeded random ones)."""
    from sglang_ddtree_tools.bench import load_prompts, resolve_tiny

    paths = _pair(family, a)
    pfile = a.prompts_file or (resolve_tiny(a.pairs, family)["prompts"] if a.pairs else None)
    if pfile:
        prompts = load_prompts(pfile)[: a.prompts]
        if len(prompts) < a.prompts:
            raise SystemExit(f"{pfile}: {len(prompts)} prompts, --prompts {a.prompts} asked")
        return paths, prompts
    return paths, smoke.make_prompts(a.prompts)


def run_family(family: str, out: str, a) -> dict:
    paths, prompts = _pair_and_prompts(family, a)
    specs = _specs(family, paths, a.quick, a)
    if a.server_args:
        import dataclasses
        specs = {n: (dataclasses.replace(sp, extra_args=sp.extra_args + tuple(a.server_args.split())), e)
                 for n, (sp, e) in specs.items()}
    logs = {}
    servers, bases = {}, {}
    res = {"family": family, "models": paths, "servers": {}}
    def start(name):
        spec, extra_env = specs[name]
        port = smoke.free_port()
        env = smoke.server_env(spec, a.gpu)
        env.update(extra_env)
        log = logs[name] = os.path.join(a.work, f"{family}-{name.replace(' ', '_').replace('=', '')}.log")
        srv = smoke.Server(smoke.server_argv(sys.executable, spec, port), env, log, launcher="process")
        srv.start()
        servers[name], bases[name] = srv, f"http://127.0.0.1:{port}"

    try:
        for name in specs:
            start(name)
        t0 = time.time()

        def up(name):
            for attempt in range(3):
                try:
                    return name, round(smoke.wait_healthy(bases[name], servers[name], a.start_timeout), 1), None
                except Exception as e:  # noqa: BLE001
                    err = str(e)[-3000:]
                    if attempt == 2 or not servers_mod.lost_port_race(err):
                        return name, None, err
                    # another process took the port between free_port() and the bind: a new port, not a failure
                    print(f"[{family}] {name}: port taken at start-up, restarting on a new one", flush=True)
                    servers[name].stop()
                    start(name)

        with ThreadPoolExecutor(len(servers)) as pool:
            health = list(pool.map(up, servers))
        print(f"[{family}] servers up in {time.time() - t0:.0f}s: {[(n, s) for n, s, _ in health]}", flush=True)
        for name, secs, err in health:
            res["servers"][name] = {"healthy_after_s": secs}
            if err:
                res["servers"][name]["error"] = err
                print(f"[{family}] {name} FAILED to start:\n{err}", flush=True)
        plain = bases[PLAIN]
        if res["servers"][PLAIN].get("error"):
            return res
        plain_seq = [g["output_ids"] for g in smoke.generate(plain, prompts, a.tokens)]

        def measure(name):
            r = res["servers"][name]
            if r.get("error"):
                return
            base = bases[name]
            try:
                for label, conc in (("sequential", 1), (f"concurrent{a.concurrency}", a.concurrency)):
                    t1 = time.time()
                    got = smoke.generate(base, prompts, a.tokens, concurrency=conc)
                    wall = time.time() - t1
                    outs = [g["output_ids"] for g in got]
                    st = smoke.lossless_stats(outs, [smoke.rescore(plain, p, o) for p, o in zip(prompts, outs)],
                                              a.margin)
                    st["exact_match_vs_plain"] = smoke.exact_match(outs, plain_seq)
                    st["tokens_per_s"] = round(sum(map(len, outs)) / wall, 1)
                    acc = [g["meta_info"].get("spec_accept_length") for g in got]
                    acc = [x for x in acc if x is not None]
                    st["mean_accept_length"] = round(sum(acc) / len(acc), 3) if acc else None
                    cap = [g["meta_info"].get("spec_cap_length") for g in got]
                    cap = [x for x in cap if x is not None]
                    st["mean_shadow_tree_accept_length"] = round(sum(cap) / len(cap), 3) if cap else None
                    r[label] = st
                t1 = time.time()
                samp = smoke.generate(base, level_prompts(prompts, a.sampling_requests, 1), a.tokens,
                                      concurrency=a.concurrency, sampling={"temperature": 1.0, "top_p": 0.9})
                r["sampling"] = {"requests": a.sampling_requests,
                                 "completed": sum(1 for g in samp if len(g["output_ids"]) == a.tokens),
                                 "seconds": round(time.time() - t1, 1)}
                if name != PLAIN:
                    info = smoke._get(base + "/server_info")
                    r["algorithm"] = info.get("speculative_algorithm")
                    # the scheduler it ran (DDTREE: the plugin's decision, SGLANG_DDTREE_OVERLAP passed through)
                    r["overlap_schedule"] = server_overlap(info)
                    r["unsupported_request"] = smoke.unsupported_request_check(base, prompts[0], specs[name][0].mode)
            except Exception as e:  # noqa: BLE001
                r["error"] = f"{type(e).__name__}: {e}"[-3000:] + "\n" + servers[name].log_tail(40)
            if TREE_VERIFY in name:
                r["log"] = _log_facts(logs[name])
            with open(os.path.join(out, f"partial-{family}.json"), "w") as fh:  # survives a timeout
                json.dump(res, fh, indent=1)
            print(f"[{family}] {name}: " + json.dumps({k: v for k, v in r.items() if k != "error"})[:1500]
                  + (f"\n  ERROR {r['error'][-2500:]}" if r.get("error") else ""), flush=True)

        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(measure, list(servers)))
    finally:
        for srv in servers.values():
            srv.stop()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree_checks.serve_matrix")
    ap.add_argument("--out", required=True, help="serve_matrix.json and serve_matrix.txt go here")
    ap.add_argument("--work", default="/tmp/ddtree-matrix", help="models and server logs")
    ap.add_argument("--families", nargs="+", default=["hybrid", "dense"])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sampling-requests", type=int, default=32)
    ap.add_argument("--margin", type=float, default=smoke.DEFAULT_MARGIN)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--quick", action="store_true", help="B=15 only (a first look)")
    ap.add_argument("--mem-fraction", type=float, default=0.25,
                    help="--mem-fraction-static of every server (default 0.25: the pools are capped, see below)")
    ap.add_argument("--max-total-tokens", type=int, default=32768,
                    help="each server's KV pool cap (default 32768: 8 requests of 4k tokens)")
    ap.add_argument("--server-args", default="", help="extra flags for every server (e.g. pool caps when many share a GPU)")
    ap.add_argument("--pairs", help="the training kit's DIR (DIR/FAMILY-{target,drafter}, DIR/prompts.jsonl) or "
                                    "DIR/FAMILY/{target,drafter}; default: the random tiny kit")
    ap.add_argument("--prompts-file", help="JSON/JSONL token-id prompts (default: the kit's held-out ones)")
    ap.add_argument("--block", type=int, default=8, help="DFLASH and shadow-linear chain block (the drafter's)")
    ap.add_argument("--budgets", nargs="+", type=_budget, default=[7, 15, 31, 63],
                    help="tree-verify budgets, or budget schedules (1:127,4:31,64:chain): one server each")
    ap.add_argument("--graphs", action="store_true", help="decode CUDA graphs on (all but the leaky server)")
    ap.add_argument("--overlap", choices=tuple(OVERLAP_CHOICES), default="default",
                    help="the tree-verify servers' scheduler (SGLANG_DDTREE_OVERLAP): the plugin's default, overlap, "
                         "synchronous, or both (every budget served on each: 'tree-verify B=N overlap' beside it)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    import importlib.metadata as md

    import torch

    doc = {"argv": sys.argv, "python": platform.python_version(), "torch": torch.__version__,
           "sglang": md.version("sglang"), "sglang_ddtree": md.version("sglang-ddtree"),
           "gpu": torch.cuda.get_device_name(a.gpu) if torch.cuda.is_available() else None,
           "margin": a.margin, "prompts": a.prompts, "tokens": a.tokens, "graphs": a.graphs, "block": a.block,
           "pairs": a.pairs, "overlap": a.overlap, "families": {}}
    t0 = time.time()
    for fam in a.families:
        doc["families"][fam] = run_family(fam, a.out, a)
        with open(os.path.join(a.out, "serve_matrix.json"), "w") as fh:
            json.dump(doc, fh, indent=1)
    doc["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(a.out, "serve_matrix.json"), "w") as fh:
        json.dump(doc, fh, indent=1)
    with open(os.path.join(a.out, "serve_matrix.txt"), "w") as fh:
        fh.write(summary(doc))
    print(summary(doc), flush=True)
    print(f"done in {doc['seconds']}s", flush=True)
    return 0


def summary(doc: dict) -> str:
    """One line per server: the lossless statistic, exact match, accept length, tokens/s, sampling."""
    lines = [f"# {doc['gpu']}; torch {doc['torch']}; SGLang {doc['sglang']}; sglang-ddtree {doc['sglang_ddtree']}",
             f"# {doc['prompts']} prompts x {doc['tokens']} new tokens, greedy; violation = emitted token not the "
             f"target's argmax by more than {doc['margin']} nats (prefill re-score on the plain server)",
             f"{'family':7} {'server':24} {'run':13} {'viol':>5} {'off':>4} {'maxgap':>7} {'exact':>6} "
             f"{'acc_len':>7} {'shadow':>6} {'tok/s':>7}  sampling  unsupported  off-argmax gaps by bucket"]
    for fam, f in doc["families"].items():
        for name, r in f["servers"].items():
            if TREE_VERIFY in name and r.get("overlap_schedule") is True and not name.endswith(" overlap"):
                name += " ovl"  # the scheduler it ran, where not the default
            if r.get("error") and not any(k.startswith(("sequential", "concurrent")) for k in r):
                lines.append(f"{fam:7} {name:24} ERROR: {r['error'].splitlines()[0][:120]}")
                continue
            for run in [k for k in r if k.startswith(("sequential", "concurrent"))]:
                st = r[run]
                em = st["exact_match_vs_plain"]
                samp = r.get("sampling", {})
                un = r.get("unsupported_request", {})
                lines.append(
                    f"{fam:7} {name:24} {run:13} {st['violations']:5d} {st['off_argmax']:4d} "
                    f"{st['max_off_argmax_gap']:7.3f} {em['identical']:3d}/{em['prompts']:<2d} "
                    f"{st['mean_accept_length'] if st['mean_accept_length'] is not None else '-':>7} "
                    f"{st['mean_shadow_tree_accept_length'] if st['mean_shadow_tree_accept_length'] is not None else '-':>6} "
                    f"{st['tokens_per_s']:7.1f}  {samp.get('completed', '-')}/{samp.get('requests', '-')}  "
                    f"{('rejected, next served' if un.get('rejected') and un.get('served_after') else un) if un else '-'}"
                    f"  {' '.join(f'{k}:{v}' for k, v in (st.get('off_argmax_gaps') or {}).items())}")
            stats = (r.get("log") or {}).get("accept_stats")
            if stats:
                gg = stats.get("glue_graphs") or {}
                lines.append(f"{fam:7} {name:24} counters: {stats.get('accepted')} accepted, "
                             f"{stats.get('off_first_branch')} off the first branch "
                             f"({stats.get('off_first_branch_share')}), own rank > 0 {stats.get('own_rank_gt0')}, "
                             f"depths {stats.get('depth_hist')}, glue graphs "
                             + ", ".join(f"{k} {v.get('replays')} replays / {v.get('failures')} failures"
                                         for k, v in gg.items())
                             + ("".join(f", chain steps {k} {v}" for k, v in sorted(stats["chain_steps"].items()))
                                if isinstance(stats.get("chain_steps"), dict) else ""))
            if r.get("error"):
                lines.append(f"{fam:7} {name:24} ERROR after measuring: {r['error'].splitlines()[0][:120]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
