"""Decode a trained kit's prompts as a DFLASH or DDTREE server does, in plain torch, step by step.

``python -m sglang_ddtree_tools.replay KIT [--family dense|hybrid|both] [--budgets 15,31] [--block N]
[--new 128] [--prompts N] [--device cpu|cuda] [--json FILE]``

For each family of a kit written by :mod:`sglang_ddtree_tools.trainkit` and each of its held-out prompts
(``KIT/prompts.jsonl``), greedy speculative decoding with the kit's own pair, the way SGLang 0.5.17 serves it:

* the first token comes from the prompt's forward (prefill), then every step drafts one block from the bonus
  token (the last committed one) and the target's captured features of the committed text before it
  (:func:`sglang_ddtree_tools.trainkit.draft_rows`, the drafter's serving layout);
* DFLASH (``chain``): the block's argmax chain, verified by one target forward; the step keeps the drafts while
  they equal the target's argmax, then the target's own next token;
* DDTREE (``tree_B<b>``): the plugin's tree from the same distributions
  (:func:`sglang_ddtree.step.draft_topk_candidates`, :func:`~sglang_ddtree.step.merge_vocab_shards`,
  :func:`~sglang_ddtree.step.build_tree_from_candidates`), verified greedily: from the root, the child whose
  token is the target's argmax after the path so far, until none is.

It reports three accept lengths per mode (bonus included, as SGLang counts them):

* ``replayed``: committed tokens over decode steps of the replay itself, what a server decoding these prompts with
  this pair reports (``completion_tokens / spec_verify_ct``, pooled over the requests);
* ``walk``: :func:`sglang_ddtree_tools.markov.decode_walk` over the per-anchor accept lengths of the emitted text
  (trainkit's ``offline["decode"]``); it equals ``replayed`` when the estimate models serving right;
* ``every_anchor``: the mean over every anchor (trainkit's ``offline`` chain and tree figures), the drafter's
  quality at an arbitrary position, higher than a server's figure whenever some stretches are easier than others.

And whether the emitted text is the target's own greedy continuation (it must be: speculation changes no output).
The forwards are full-prefix, without a KV cache: a reference for the tiny pairs, not a server. They run in the
precision trainkit trains and measures the kit in (:func:`sglang_ddtree_tools.trainkit._autocast`: bfloat16 autocast
on CUDA, float32 on CPU), and the target's greedy continuation the text is held against is made in that precision
too: a kit's drafter learned the bfloat16 target on CUDA, and the float32 target's greedy text is another text.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["decode", "load_pair", "replay_family", "main"]


def _torch():
    import torch
    return torch


def load_pair(kit: Path, family: str, device: str):
    """The kit's ``family`` target (transformers) and drafter (:func:`trainkit.DFlashDrafter`), float32, eval."""
    torch = _torch()
    import transformers
    from safetensors.torch import load_file

    from . import trainkit

    tdir, ddir = kit / f"{family}-target", kit / f"{family}-drafter"
    for d in (tdir, ddir):
        if not (d / "config.json").is_file() or not (d / "model.safetensors").is_file():
            raise SystemExit(f"replay: {d} has no config.json and model.safetensors (a trainkit output?)")
    target = transformers.AutoModelForCausalLM.from_pretrained(str(tdir), dtype=torch.float32).to(device).eval()
    dcfg = json.loads((ddir / "config.json").read_text())
    drafter = trainkit.DFlashDrafter(dcfg)
    drafter.load_state_dict({k: v.float() for k, v in load_file(str(ddir / "model.safetensors")).items()})
    return target, drafter.to(device).eval(), dcfg


def _forward(target, ids):
    """The target's logits and captured DFLASH features over ``ids`` [1, S]."""
    from . import trainkit

    out = target.model(input_ids=ids, output_hidden_states=True)
    return target.lm_head(out.last_hidden_state), trainkit.capture_features(out, trainkit.TARGET_LAYER_IDS)


def decode(target, drafter, prompt: Sequence[int], new: int, block: int, mask_id: int,
           budget: Optional[int] = None) -> Dict[str, object]:
    """Greedy speculative decoding of one prompt for ``new`` tokens: DFLASH's chain (``budget`` None) or DDTREE's
    tree of ``budget`` nodes.  Returns ``{"tokens": the emitted ids, "steps": [...]}``, a step being ``{"anchor":
    its bonus token's position after the prompt, "accept": tokens it committed (the accepted drafts and the
    target's next token), "drafts": the candidates it verified}``; the first token (the prefill's) belongs to no
    step, and a step cut by ``new`` counts the tokens it kept.  As in SGLang, a step's drafter context is the
    features its previous verify forward captured (the prefill's for the first step): one target pass a chain
    step."""
    torch = _torch()
    from . import trainkit

    dev = next(target.parameters()).device
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    seq = list(prompt)
    plen = len(seq)
    steps: List[dict] = []
    with torch.no_grad():
        logits, feats = _forward(target, torch.tensor([seq], device=dev))
        seq.append(int(logits[0, -1].argmax()))
        while len(seq) - plen < new:
            p = len(seq) - 1  # the bonus token's position: the context is [0, p), the features of positions < p
            ids = torch.tensor([seq], device=dev)
            ctx = torch.cat([feats[:, :p], feats.new_zeros(1, 1, feats.shape[-1])], 1)  # the bonus: masked out
            dl, _ = trainkit.draft_rows(drafter, embed, lm_head, ids, ctx, torch.tensor([p], device=dev), block,
                                        mask_id)
            if budget is None:
                chain = dl[0].argmax(-1).tolist()
                logits, feats = _forward(target, torch.tensor([seq + chain], device=dev))
                want = logits[0, p:].argmax(-1).tolist()  # want[j]: the target's token at p + j + 1
                a = 0
                while a < len(chain) and chain[a] == want[a]:
                    a += 1
                got, drafts = chain[:a] + [want[a]], len(chain)
            else:
                got, drafts, feats = _tree_step(target, dl[0], seq, int(budget))
            keep = got[:new - (len(seq) - plen)]
            seq.extend(keep)
            steps.append({"anchor": p - plen, "accept": len(keep), "drafts": drafts})
    return {"tokens": seq[plen:], "steps": steps}


def _tree_step(target, depth_logits, seq: List[int], budget: int):
    """One DDTREE step: the plugin's tree from ``depth_logits`` [blk-1, V], verified greedily node by node.
    Returns (the committed tokens, the drafts verified, the features of the last forward: the accepted path's)."""
    torch = _torch()
    from sglang_ddtree.step import build_tree_from_candidates, draft_topk_candidates, merge_vocab_shards

    dev = depth_logits.device
    length, v = depth_logits.shape
    k = min(budget, v)
    vals, cid, lse = draft_topk_candidates(depth_logits.float(), k)
    lp, cid = merge_vocab_shards(vals.unsqueeze(0), cid.unsqueeze(0), lse.unsqueeze(0), k)
    tree = build_tree_from_candidates(lp.view(1, length, k).cpu(), cid.view(1, length, k).cpu(), budget)
    parents, tokens, valid = tree.parents[0].tolist(), tree.token_ids[0].tolist(), tree.valid[0].tolist()
    node, path = 0, []
    while True:
        logits, feats = _forward(target, torch.tensor([seq + path], device=dev))
        nxt = int(logits[0, -1].argmax())
        child = next((i for i in range(len(parents)) if valid[i] and i != 0 and parents[i] == node
                      and tokens[i] == nxt), None)
        if child is None:
            return path + [nxt], int(sum(valid)) - 1, feats
        node = child
        path.append(nxt)


def replay_family(kit: Path, family: str, budgets: Sequence[int], new: int, block: Optional[int] = None,
                  prompts: Optional[int] = None, device: str = "cpu") -> Dict[str, object]:
    """Every mode's three accept lengths (module docstring) on the kit's held-out prompts for ``family``."""
    torch = _torch()
    from . import trainkit
    from .markov import accept_lengths, decode_walk

    target, drafter, dcfg = load_pair(kit, family, device)
    blk = int(block or dcfg["dflash_config"]["block_size"])
    mask_id = int(dcfg["dflash_config"]["mask_token_id"])
    rows = _prompts(kit / "prompts.jsonl", int(target.config.vocab_size))
    rows = rows[:prompts] if prompts else rows
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    out: Dict[str, object] = {"family": family, "block": blk, "new": new, "prompts": len(rows), "modes": {}}
    for mode, budget in [("chain", None)] + [(f"tree_B{b}", int(b)) for b in budgets]:
        tokens = steps = 0
        per_anchor, texts_equal = [], 0
        for prompt in rows:
            # the kit's own precision (trainkit trains and measures it so; greedy_generate enters it too)
            with torch.no_grad(), trainkit._autocast(device):
                got = decode(target, drafter, prompt, new, blk, mask_id, budget)
                greedy = trainkit.greedy_generate(target, torch.tensor([prompt], device=device), new)[0].tolist()
                texts_equal += got["tokens"] == greedy
                # per-anchor lengths of the emitted text at every anchor whose step, whatever it accepts, ends
                # inside the text (its block and the target's token after it); the replay's steps at those anchors
                # are the walk's
                text = torch.tensor([prompt + got["tokens"]], device=device)
                anc = torch.arange(len(prompt), text.shape[1] - blk, device=device)
                if anc.numel() == 0:
                    raise SystemExit(f"replay: --new {new} leaves no full block of {blk} after the prompt")
                _, feats = _forward(target, text)
                dl, truth = trainkit.draft_rows(drafter, embed, lm_head, text.expand(anc.numel(), -1),
                                                feats.expand(anc.numel(), -1, -1), anc, blk, mask_id)
            acc = accept_lengths(dl, truth, () if budget is None else (budget,))
            per_anchor.append(acc["chain" if budget is None else mode].tolist())
            inside = [st for st in got["steps"] if st["anchor"] < anc.numel()]
            tokens += sum(st["accept"] for st in inside)
            steps += len(inside)
        walk = decode_walk(per_anchor)
        out["modes"][mode] = {
            "replayed": round(tokens / max(1, steps), 4), "replayed_tokens": tokens, "replayed_steps": steps,
            "walk": round(walk["tokens"] / max(1, walk["steps"]), 4), "walk_tokens": walk["tokens"],
            "walk_steps": walk["steps"],
            "every_anchor": round(walk["anchor_tokens"] / max(1, walk["anchors"]), 4),
            "texts_equal_greedy": texts_equal}
    return out


def _prompts(path: Path, vocab: int) -> List[List[int]]:
    """The kit's held-out prompts, read as ``bench`` reads them (the same prompts a served run sends), every id
    checked against the target's vocabulary; a bad line is named by its number."""
    from .bench import load_prompts

    try:
        return load_prompts(str(path), vocab)
    except ValueError as e:
        raise SystemExit(f"replay: {e}")


def _table(res: Dict[str, object]) -> str:
    lines = [f"{res['family']}: {res['prompts']} prompts x {res['new']} tokens, block {res['block']}",
             f"  {'mode':<10} {'replayed':>9} {'walk':>9} {'every anchor':>13} {'greedy text':>12}"]
    for mode, m in res["modes"].items():
        lines.append(f"  {mode:<10} {m['replayed']:>9.3f} {m['walk']:>9.3f} {m['every_anchor']:>13.3f} "
                     f"{m['texts_equal_greedy']:>7}/{res['prompts']:<4}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree_tools.replay", description=__doc__.split("\n")[0])
    ap.add_argument("kit", help="a trainkit output folder")
    ap.add_argument("--family", choices=("dense", "hybrid", "both"), default="both")
    ap.add_argument("--budgets", default="15,31", help="DDTREE node budgets, comma-separated (default 15,31)")
    ap.add_argument("--block", type=int, default=None, help="DFLASH block (default: the drafter's block_size)")
    ap.add_argument("--new", type=int, default=128, help="tokens per prompt (default 128)")
    ap.add_argument("--prompts", type=int, default=None, help="the first N prompts (default: all)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    a = ap.parse_args(argv)
    from sglang_ddtree import contract

    try:
        budgets = [int(x) for x in a.budgets.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--budgets {a.budgets!r}: comma-separated integers")
    bad = [p for p in (contract.budget_problem(b, contract.TREE_VERIFY) for b in budgets) if p]
    if bad:
        ap.error(f"--budgets: {bad[0]}")
    if a.new < 1 or (a.block is not None and a.block < 2) or (a.prompts is not None and a.prompts < 1):
        ap.error("--new >= 1, --block >= 2, --prompts >= 1")
    kit = Path(a.kit)
    if not (kit / "prompts.jsonl").is_file():
        ap.error(f"{kit} has no prompts.jsonl (a trainkit output?)")
    fams = ("hybrid", "dense") if a.family == "both" else (a.family,)
    results = []
    for fam in fams:
        res = replay_family(kit, fam, budgets, a.new, a.block, a.prompts, a.device)
        print(_table(res), flush=True)
        results.append(res)
    if a.json:
        Path(a.json).write_text(json.dumps({"kit": str(kit), "families": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
