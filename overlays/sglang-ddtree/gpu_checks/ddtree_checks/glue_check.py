"""The tree-verify step's glue under CUDA graphs, on a GPU, without SGLang: captured, replayed, equal to eager.

``python -m ddtree_checks.glue_check [--budgets 15 31] [--batch-sizes 1 4 16] [--levels 1 2]``

For each budget and batch size: the worker's two glue functions from the same pure parts (``step.tree_verify_inputs``,
``step.accept_commit``; drafter
top-K over a random LM head -> tree -> ``QLEN_ONLY`` compile; a greedy accept walk (the plugin's reference of
SGLang's kernel, on device here) -> accept counters -> commit indices), each wrapped in
:class:`sglang_ddtree.glue_graphs.GlueGraph`; random inputs per step, every replay compared with an eager run,
and the host time per call eager vs replayed. ``--levels``: the glue levels of ``SGLANG_DDTREE_GLUE_GRAPHS`` (2
adds the FULL mask's scatter index to the build and the recurrent commit's indices, with a track interval, to
the accept; checked against the eager functions and against the indices computed after the accept, as level 1
does). Also: a function that syncs is refused at capture and stays eager.
Prints one JSON line per case and a summary; exit 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from sglang_ddtree import glue_graphs as G
from sglang_ddtree.compile import compile_tree, with_full_mask
from sglang_ddtree.indexing import recurrent_state_step
from sglang_ddtree.step import (accept_commit, draft_topk_candidates, mamba_track_steps, merge_vocab_shards,
                                tree_verify_inputs)

TRACK_INTERVAL = 8  # small, so track boundaries fall inside many accepted paths (the case the indices are for)
from sglang_ddtree.verify import walk_tree


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def make_fns(weight, budget, depths, level=1, interval=TRACK_INTERVAL):
    k = min(budget, weight.shape[0])
    more = {"recurrent": True, "track_interval": interval} if level >= 2 else {}

    def build(hidden, bonus, prefix):
        bs = hidden.shape[0]
        v, i, l = draft_topk_candidates(torch.matmul(hidden.reshape(-1, hidden.shape[-1]), weight.T), k)
        lp, ids = merge_vocab_shards(v.unsqueeze(0), i.unsqueeze(0), l.unsqueeze(0), k)
        return tree_verify_inputs(lp.view(bs, depths, k), ids.view(bs, depths, k), bonus, prefix, budget, 2,
                                  full_index=level >= 2)

    def commit(tokens, parents, valid, max_depth_t, target_predict, ranks, prefix, window):
        bs, d = ranks.shape
        # the accept walk on device (what SGLang's verify_tree_greedy kernel computes, in torch ops)
        w = walk_tree(tokens, parents, target_predict, int(max_depth_t.shape[0]), valid)
        m = int(max_depth_t.shape[0]) + 1
        acc = torch.full((bs, m), -1, dtype=torch.int32, device=ranks.device)
        acc[:, 0] = (torch.arange(bs, device=ranks.device) * d).to(torch.int32)
        num = w.accept_length.to(torch.int32)
        predicts = torch.zeros(bs * d, dtype=torch.int32, device=ranks.device)
        return accept_commit(predicts, acc, num, ranks, prefix, window, window, m - 1, **more)

    return build, commit


def run_case(budget, bs, steps, hid, vocab, depths, dev, gen, level=1, interval=TRACK_INTERVAL, graphs=G.CudaGraphs):
    weight = torch.randn(vocab, hid, device=dev, generator=gen) * 0.2
    build, commit = make_fns(weight, budget, depths, level, interval)
    # level 2 chains the graphs as the worker does there: the commit reads the build's outputs in place
    gb = G.GlueGraph("build", build, share=level >= 2, device=graphs)
    gc = G.GlueGraph("commit", commit, share=level >= 2, device=graphs)
    mism, t_eager, t_graph, crossed = 0, [], [], 0
    for step in range(steps):
        hidden = torch.randn(bs, depths, hid, device=dev, generator=gen)
        bonus = torch.randint(0, vocab, (bs,), device=dev, generator=gen)
        prefix = torch.randint(1, 500, (bs,), device=dev, generator=gen)
        _sync(dev)
        t0 = time.perf_counter()
        tree, vin = gb(hidden, bonus, prefix)
        d = vin.draft_token_num
        pred = torch.where(torch.rand(bs, d, device=dev, generator=gen) < 0.8, vin.draft_token.view(bs, d),
                           torch.randint(0, vocab, (bs, d), device=dev, generator=gen))
        pred = torch.roll(pred, -1, 1)  # a node's prediction is often its first child's token
        window = torch.randint(0, 10**6, (bs, d), device=dev, generator=gen)
        counts, c = gc(tree.token_ids, tree.parents, tree.valid, torch.empty(vin.max_tree_depth, device=dev),
                       pred, tree.ranks, prefix, window)
        _sync(dev)
        (t_graph if step >= 2 else t_eager).append(time.perf_counter() - t0)
        # the reference: the same functions, eagerly
        t0 = time.perf_counter()
        rt, rv = build(hidden, bonus, prefix)
        rc = commit(rt.token_ids, rt.parents, rt.valid, torch.empty(rv.max_tree_depth, device=dev), pred, rt.ranks, prefix, window)
        _sync(dev)
        t_eager.append(time.perf_counter() - t0)
        full = with_full_mask(vin, prefix, int(prefix.sum()))
        rfull = compile_tree(rt, bonus, prefix, topk=2)
        ok = G.same((tree, vin), (rt, rv)) and G.same((counts, c), rc) and torch.equal(full.custom_mask,
                                                                                     rfull.custom_mask)
        if level >= 2:  # the replayed indices are those the commit computes after the accept at level 1
            ok = ok and torch.equal(c.recurrent_step.long(), recurrent_state_step(c.accept_slots, c.accept_length))
            track = mamba_track_steps(prefix, prefix + c.commit_lens.long(), c.commit_lens, interval,
                                      c.accept_slots, c.accept_length)
            ok = ok and torch.equal(c.track_steps.long(), track)
            crossed += int((track >= 0).sum())
        mism += not ok
    return {"budget": budget, "batch": bs, "level": level, "steps": steps, "mismatches": mism,
            **({"track_crossings": crossed} if level >= 2 else {}), "build": gb.stats(),
            "commit": gc.stats(), "eager_ms": round(1e3 * sorted(t_eager)[len(t_eager) // 2], 3),
            "replay_ms": round(1e3 * sorted(t_graph)[len(t_graph) // 2], 3) if t_graph else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree_checks.glue_check")
    ap.add_argument("--budgets", nargs="+", type=int, default=[15, 31])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depths", type=int, default=15)
    ap.add_argument("--levels", nargs="+", type=int, choices=(1, 2), default=[1, 2])
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("glue_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bad = 0
    for level in a.levels:
        for b in a.budgets:
            for bs in a.batch_sizes:
                r = run_case(b, bs, a.steps, a.hidden, a.vocab, a.depths, dev, gen, level)
                bad += r["mismatches"] + r["build"]["failures"] + r["commit"]["failures"]
                print(json.dumps(r), flush=True)
    # a function that syncs cannot be captured: logged, and that key stays eager (the step never fails on it)
    g = G.GlueGraph("sync", lambda x: x * int(x.sum().item()))
    x = torch.ones(4, device=dev)
    outs = [g(x) for _ in range(3)]
    refused = g.stats()["failures"] == 1 and g.stats()["eager_keys"] == 1 and all(torch.equal(o, x * 4) for o in outs)
    print(json.dumps({"syncing_fn_refused_and_eager": refused, **g.stats()}), flush=True)
    bad += not refused
    print(f"glue_check: {'OK' if not bad else 'FAILED'} ({bad} problems)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
