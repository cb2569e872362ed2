"""How learnable is the synthetic language's greedy map for a one-layer DFlash drafter? (CPU, minutes)

``PYTHONPATH=overlays/sglang-ddtree/src:overlays/sglang-ddtree-tools/src python benchmarks/markov_drafter_proxy.py [--noise 0,0.25,1] [--steps N]``

A design check before GPU time: it trains :class:`sglang_ddtree_tools.trainkit.DFlashDrafter`
(the kit's drafter, SGLang 0.5.17's DFlash computation) on the *source's* greedy text
with **oracle target features** instead of a trained target - each position's two
"captured layers" are fixed random embeddings of (current token + regime) and
(previous token + current token), i.e. what a target that has learned the source
carries in its residual stream - and a fixed random LM head.  Then it prints, on
held-out prompts, the per-depth rank histogram of the true token and the chain /
DDTree accept lengths the kit's offline estimate computes (same code path).

It stands in for the target only (stated here, as the standards ask); the drafter,
the block layout, the tree builder and the accept walk are the kit's own.  Figures
are pessimistic against the GPU run (far fewer steps).
"""

import argparse
import sys
import time

import torch

from sglang_ddtree_tools import markov, trainkit as tk


def oracle_features(seq, regimes, e1, e2, e3, er):
    prev = torch.cat([seq[:, :1], seq[:, :-1]], 1)
    return torch.cat([e1[seq] + er[regimes].unsqueeze(1), e2[prev] + e3[seq]], -1)


def run(noise: float, steps: int, seed: int, p: tk.Preset) -> dict:
    torch.manual_seed(seed)
    src = markov.make_source(seed, vocab=p.vocab, member_noise=noise)
    h, v = p.hidden, p.vocab
    g = torch.Generator().manual_seed(seed + 1)
    e1, e2, e3 = (torch.randn(v, h, generator=g) for _ in range(3))
    er = torch.randn(3, h, generator=g)
    embed = torch.nn.Embedding(v, h)
    lm_head = torch.nn.Linear(h, v, bias=False)
    for m in (embed, lm_head):
        m.requires_grad_(False)
    drafter = tk.DFlashDrafter(tk.drafter_config("dense", p))
    opt = torch.optim.AdamW(drafter.parameters(), lr=p.drafter_lr, betas=(0.9, 0.98), weight_decay=0.01)
    s = p.seq_len
    t0 = time.time()
    for step in range(steps):
        prompts, r = src.sample(p.drafter_batch, p.prompt_len, g)
        seq = torch.cat([prompts, src.greedy_continuation(prompts, r, s - p.prompt_len)], 1)
        feats = oracle_features(seq, r, e1, e2, e3, er)
        anchors = p.prompt_len + (torch.rand(p.drafter_batch, p.anchors, generator=g) * (s - 1 - p.prompt_len)).long()
        loss, _ = tk.drafter_loss(drafter, embed, lm_head, seq, feats, anchors, p.block, v - 1, p.loss_gamma)
        for grp in opt.param_groups:
            grp["lr"] = p.drafter_lr * (0.1 + 0.9 * (1 - step / steps))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    # held-out: the kit's own estimate path, with the oracle standing in for the target's features
    prompts, r = src.sample(16, p.prompt_len, torch.Generator().manual_seed(seed + 99))
    seq = torch.cat([prompts, src.greedy_continuation(prompts, r, s - p.prompt_len)], 1)
    feats = oracle_features(seq, r, e1, e2, e3, er)
    anc = torch.arange(p.prompt_len, s - p.block + 1)
    rows = torch.arange(16).repeat_interleave(anc.numel())
    with torch.no_grad():
        logits, truth = tk.draft_rows(drafter, embed, lm_head, seq[rows], feats[rows], anc.repeat(16), p.block, v - 1)
    rank = (logits > logits.gather(2, truth.unsqueeze(-1))).sum(-1)
    acc = markov.accept_lengths(logits, truth, (15, 31, 63))
    chain = acc["chain"].float().mean()
    out = {"noise": noise, "steps": steps, "loss": round(float(loss.detach()), 3), "seconds": round(time.time() - t0, 1),
           "chain": round(float(chain), 3),
           "rank_hist": [[round(float((rank[:, d] == j).float().mean()), 3) for j in range(3)]
                         + [round(float((rank[:, d] >= 3).float().mean()), 3)] for d in range(min(6, rank.shape[1]))]}
    for b in (15, 31, 63):
        t = float(acc[f"tree_B{b}"].float().mean())
        out[f"tree_B{b}"] = f"{t:.3f} (x{t / float(chain):.2f})"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--noise", default="0,0.25,1")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="small", choices=sorted(tk.PRESETS))
    a = ap.parse_args(argv)
    p = tk.PRESETS[a.preset]
    print(f"preset {a.preset}: vocab {p.vocab}, hidden {p.hidden}, drafter MLP {p.drafter_inter}, block {p.block}, "
          f"batch {p.drafter_batch} x {p.anchors} anchors, {a.steps} steps")
    for noise in (float(x) for x in a.noise.split(",")):
        print(run(noise, a.steps, a.seed, p), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
