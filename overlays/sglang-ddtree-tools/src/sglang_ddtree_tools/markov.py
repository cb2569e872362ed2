"""A seeded synthetic language with known branching, and an exact accept-length estimator.

The language (:class:`MarkovSource`) exists so that a tiny target and its DFlash
drafter can be *trained* in minutes and speculative decoding measured on
something where a tree should pay - and the figure checked against a number
computed here before any GPU time is spent.

The source
----------
An order-2 Markov source over ``vocab`` token ids with a per-sequence *regime*: a
vector ``r`` of ``K`` (``components``, default 4) values in ``{0, 1, 2}``, drawn
uniformly at the start of each sequence.  A sequence is ``[marker_0(r_0) ..
marker_{K-1}(r_{K-1}), x1, x2, ...]``: ``K`` marker tokens (``4 + 3 i + r_i``),
then two uniform text tokens, then the chain.  Ids ``0..31`` (pad/bos/eos/spare,
the markers, spare), ``vocab - 1`` (the drafter's mask token) and the few ids left
over below it never occur in text.  The
``3 * F`` text tokens form ``F = (vocab - 9) // 3`` *families* of three *members*
(token ``8 + 3 f + m``).  Seeded tables, all lookups:

* ``nxt[f]``: the family path, a random permutation of the families made of one
  cycle through all ``F`` of them;
* ``cls[x]``: a class per token, a random permutation of ``{0, 1, 2}`` within each family;
* ``comp[x]``: which regime component a token consults when it is the token before
  last, random per family;
* ``sigma[x]``: which member each slot names - the identity (slot ``j`` is member
  ``j``), except for a ``member_noise`` fraction of tokens with a random permutation;
* ``cand[x][j] = 8 + 3 nxt[f] + sigma[x][j]``: the three members of the next family,
  in *slot* order; ``tail[x]``: ``n_tail`` random text tokens.

Given the last two tokens ``(a, b)`` and the regime, the next token is
``cand[b][(s + i) % 3]`` with probability ``probs[i]`` (``i = 0, 1, 2``), where
``s = (r[comp[a]] + cls[a]) % 3``, else one of ``tail[b]`` uniformly (the remaining
``1 - sum(probs)``; default ``probs = (0.6, 0.25, 0.1)``, tail 0.05).  The
source's greedy continuation is ``x[t+1] = cand[x[t]][(r[comp[a]] + cls[a]) % 3]``
with ``a = x[t-1]``.

Why this shape (the design point)
---------------------------------
Tree speculation is judged under *greedy* decoding, where the target emits a
deterministic function of the prefix, and a DFlash drafter reads the target's
hidden states.  Two ways it goes wrong (the first is the issue's reasoning, the
second was measured at small scale on a CPU):

1. A plain order-2 source: the target's greedy output is a fixed lookup of the
   last two tokens that the drafter learns almost perfectly - a chain is nearly
   always right, a tree buys nothing.
2. A random greedy map: greedy orbits of a random map on ``N`` states merge and fall
   into a few cycles of total length ``~ sqrt(pi N / 2)`` (~50 states at ``N`` =
   1500), the same for every prompt; the drafter memorises those cycles (measured:
   chain accept 10.9 at block 16, tree/chain 1.0-1.05).
3. A small state space: with one regime value, the whole greedy future is a function
   of ``(cls[x[p-1]], x[p], r)``, ``9 V`` states; a one-layer drafter memorises the
   per-depth tables (measured at V = 512: hybrid chain 14.1 of 16, tree x1.05).

Here the greedy map on the state ``(cls[x[t-1]], x[t])`` is a **bijection** for
every regime (``cls`` is a permutation within each family and ``nxt`` a
one-cycle permutation), so greedy orbits never merge and no state repeats within
``F`` steps (679 at ``vocab`` 2048, more than a prompt and 128 new tokens): prompts
do not converge on shared text.  What makes
the drafter *uncertain among a few* is the two-level structure: the next *family*
is a function of the current family alone (a small table per depth that a drafter
learns), while the *member* within it is chosen by ``r + cls`` of the token before
last and by the regime component *that token's family names* (with the identity
``sigma``, member ``(r[comp[a]] + cls[a]) % 3``).  A drafter's block is ``[bonus,
mask...]``: in its one layer the mask positions' queries do not depend on the
content, so at depth ``k`` it cannot *look up* the component ``comp`` of the family
two steps back; it gets all ``K`` markers mixed and must have learnt, per family
and depth, which one matters - over ``3^K`` regime vectors - on top of composing the
member chain through ``k / 2`` per-family ``cls`` permutations.  The target, running
causally over real tokens, does the lookup with one attention hop (query: the
component named by the previous token; keys: the markers).
So at depth ``k`` the drafter knows the family (three tokens) and is partly unsure
of the member: the truth sits in its top 3 while its top 1 is wrong part of the
time - where a best-first tree, spending budget on second and third candidates,
beats a chain.  ``member_noise`` moves members from a shared rule to per-token rules
(harder for both the target and the drafter), a knob between "chain wins" and
"chain too short"; the default is 0, since the target must learn the source first.
For the target the identity ``sigma`` keeps the prediction additive - the family
from the last token, the member from the token before last and the regime.

The target must read ``r[comp[a]]`` from the markers, however far back, and combine
it with the class of the token before last; every piece is a lookup or one attention
hop, meant to be learned by a 4-layer model in the kit's GPU minutes so that its
greedy continuation becomes the source's (not yet run on a GPU; the vector regime is
the newest part and was not run at any scale beyond the toy tests; earlier designs at
small scale on a CPU: ``benchmarks/results/trainkit_cpu_small.md``).  How often the
drafter is wrong is set by its capacity and training, which is why ``trainkit``
*measures* it (per-depth rank histogram, offline accept lengths) and
:func:`expected_accept` turns any per-depth profile into exact chain/tree figures.

What the drafter must look like for the issue's targets (chain accept >= 3.0, tree
>= 1.3x chain), from :func:`expected_accept` with a calibrated drafter whose depth 1
is ``(0.97, 0.02, 0.005)`` and every deeper depth has the profile shown (accept
lengths include the bonus token)::

    depths 2..15          chain blk8  chain blk16  tree B15       B31            B63
    0.90 / 0.07 / 0.02    6.06        8.70         8.70 (x1.00)   9.52 (x1.09)   10.57 (x1.21)
    0.75 / 0.17 / 0.06    4.36        4.83         5.28 (x1.09)   6.17 (x1.28)    7.07 (x1.46)
    0.60 / 0.25 / 0.10    3.36        3.42         4.32 (x1.26)   4.98 (x1.45)    5.59 (x1.63)

A sharp drafter makes the tree a chain (at B = 15 the best 15 nodes *are* the chain);
a drafter right 60-75% of the time at depths >= 2 with the truth in its top 3 gives
both targets at B = 31-63.  The kit prints the measured per-depth rank histogram, so
which row a trained pair is in is known before serving.

Everything is vectorised torch on any device (4096 sequences of 128 tokens take
~0.1 s on one CPU core); given the seed, the tables are the same on every device,
and sampling is deterministic per (seed, device type).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

__all__ = [
    "FIRST_TEXT_TOKEN",
    "MARKER_BASE",
    "NUM_REGIMES",
    "DEFAULT_COMPONENTS",
    "MarkovSource",
    "make_source",
    "expected_accept",
    "accept_lengths",
    "decode_walk",
    "tree_rank_tuples",
]

FIRST_TEXT_TOKEN = 32  # 0 pad, 1 bos, 2 eos, 3 spare, 4-30 regime markers, 31 spare: never in text
MARKER_BASE = 4  # component i of value v is announced by token MARKER_BASE + 3 i + v
NUM_REGIMES = 3  # values per regime component
MAX_COMPONENTS = 9
DEFAULT_COMPONENTS = 4
DEFAULT_PROBS = (0.6, 0.25, 0.1)
DEFAULT_MEMBER_NOISE = 0.0


@dataclass(frozen=True)
class MarkovSource:
    """The source's tables (see the module docstring); build with :func:`make_source`."""

    vocab: int
    seed: int
    probs: tuple  # (p_slot0, p_slot1, p_slot2); the tail gets the rest
    member_noise: float
    components: int  # K: the regime is a vector of K values in {0, 1, 2}
    comp: torch.Tensor  # int64 [V]: which regime component a token, as the token before last, consults
    cls: torch.Tensor  # int64 [V]
    cand: torch.Tensor  # int64 [V, 3]
    tail: torch.Tensor  # int64 [V, n_tail]

    @property
    def mask_token_id(self) -> int:
        return self.vocab - 1

    @property
    def text_tokens(self) -> range:
        return range(FIRST_TEXT_TOKEN, FIRST_TEXT_TOKEN + 3 * self.num_families)

    def family(self, x: torch.Tensor) -> torch.Tensor:
        return (x - FIRST_TEXT_TOKEN) // 3

    @property
    def tail_prob(self) -> float:
        return 1.0 - float(sum(self.probs))

    def to(self, device) -> "MarkovSource":
        return MarkovSource(self.vocab, self.seed, self.probs, self.member_noise, self.components,
                            *(t.to(device) for t in (self.comp, self.cls, self.cand, self.tail)))

    @property
    def prefix_len(self) -> int:
        """Tokens before the chain: K markers and two uniform text tokens."""
        return self.components + 2

    @property
    def num_families(self) -> int:
        return (self.vocab - 1 - FIRST_TEXT_TOKEN) // 3

    # -- the conditional distribution ------------------------------------------------------------
    def slot(self, a: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The slot of ``cand[b]`` that is most likely after ``(a, b)`` in regime ``r``."""
        rc = r.gather(1, self.comp[a].unsqueeze(1)).squeeze(1)  # r: [N, K]
        return (rc + self.cls[a]) % NUM_REGIMES

    def next_probs(self, a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """Dense ``p(. | a, b, r)``: ``[N, V]`` float64 (coinciding entries add up)."""
        n = a.shape[0]
        out = torch.zeros(n, self.vocab, dtype=torch.float64, device=a.device)
        s = self.slot(a, r)
        for i, p in enumerate(self.probs):
            c = self.cand[b, :].gather(1, ((s + i) % NUM_REGIMES).unsqueeze(1))
            out.scatter_add_(1, c, torch.full((n, 1), float(p), dtype=torch.float64, device=a.device))
        nt = self.tail.shape[1]
        out.scatter_add_(1, self.tail[b], torch.full((n, nt), self.tail_prob / nt, dtype=torch.float64,
                                                     device=a.device))
        return out

    def greedy_next(self, a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The source's argmax continuation of ``(a, b)`` in regime ``r``."""
        return self.cand[b, :].gather(1, self.slot(a, r).unsqueeze(1)).squeeze(1)

    def sample_next(self, a, b, r, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        n, dev = a.shape[0], a.device
        u = torch.rand(n, device=dev, generator=generator, dtype=torch.float64)
        cum = torch.tensor(list(self._cum()), device=dev, dtype=torch.float64)
        cat = torch.searchsorted(cum, u.unsqueeze(1)).squeeze(1).clamp_max(NUM_REGIMES)  # 0,1,2 slot; 3 tail
        s = (self.slot(a, r) + cat.clamp_max(2)) % NUM_REGIMES
        from_cand = self.cand[b, :].gather(1, s.unsqueeze(1)).squeeze(1)
        k = torch.randint(0, self.tail.shape[1], (n,), device=dev, generator=generator)
        from_tail = self.tail[b, :].gather(1, k.unsqueeze(1)).squeeze(1)
        return torch.where(cat < NUM_REGIMES, from_cand, from_tail)

    def _cum(self):
        acc = 0.0
        for p in self.probs:
            acc += float(p)
            yield acc

    # -- sequences ------------------------------------------------------------------------------
    def sample(self, n: int, length: int, generator: Optional[torch.Generator] = None,
               regimes: Optional[torch.Tensor] = None, device=None):
        """``n`` sequences of ``length`` tokens: ``(tokens int64 [n, length], regimes int64 [n, K])``.

        Tokens ``0..K-1`` announce the regime's components, the next two are uniform
        text tokens, then the chain."""
        k = self.components
        if length < k + 3:
            raise ValueError(f"length must be >= {k + 3}, got {length}")
        dev = device if device is not None else self.cand.device
        if regimes is None:
            regimes = torch.randint(0, NUM_REGIMES, (n, k), device=dev, generator=generator)
        out = torch.empty(n, length, dtype=torch.int64, device=dev)
        out[:, :k] = MARKER_BASE + 3 * torch.arange(k, device=dev) + regimes
        out[:, k:k + 2] = torch.randint(FIRST_TEXT_TOKEN, FIRST_TEXT_TOKEN + 3 * self.num_families, (n, 2),
                                        device=dev, generator=generator)
        for t in range(k + 2, length):
            out[:, t] = self.sample_next(out[:, t - 2], out[:, t - 1], regimes, generator)
        return out, regimes

    def greedy_continuation(self, prefix: torch.Tensor, regimes: torch.Tensor, steps: int) -> torch.Tensor:
        """The source's greedy continuation of each prefix (``[n, >=2]``): ``[n, steps]``."""
        a, b = prefix[:, -2], prefix[:, -1]
        out = torch.empty(prefix.shape[0], steps, dtype=torch.int64, device=prefix.device)
        for t in range(steps):
            c = self.greedy_next(a, b, regimes)
            out[:, t] = c
            a, b = b, c
        return out


def make_source(seed: int, vocab: int = 2048, probs: Sequence[float] = DEFAULT_PROBS, n_tail: int = 8,
                member_noise: float = DEFAULT_MEMBER_NOISE, components: int = DEFAULT_COMPONENTS,
                device=None) -> MarkovSource:
    """The seeded source (tables drawn on the CPU, so they do not depend on the device)."""
    if not 64 <= vocab <= 65536:
        raise ValueError(f"vocab must be in [64, 65536], got {vocab}")
    probs = tuple(float(p) for p in probs)
    if len(probs) != 3 or not all(p > 0 for p in probs) or sum(probs) >= 1.0:
        raise ValueError(f"probs must be three positive slot probabilities summing below 1, got {probs}")
    if not probs[0] > probs[1] > probs[2] > (1.0 - sum(probs)) / max(1, n_tail):
        raise ValueError(f"probs must be strictly decreasing and above a tail token's share, got {probs}")
    if not 0.0 <= member_noise <= 1.0:
        raise ValueError(f"member_noise must be in [0, 1], got {member_noise}")
    if not 1 <= components <= MAX_COMPONENTS:
        raise ValueError(f"components must be in [1, {MAX_COMPONENTS}], got {components}")
    g = torch.Generator().manual_seed(int(seed))
    nf = (vocab - 1 - FIRST_TEXT_TOKEN) // 3
    text = torch.arange(FIRST_TEXT_TOKEN, FIRST_TEXT_TOKEN + 3 * nf)
    fam, mem = (text - FIRST_TEXT_TOKEN) // 3, (text - FIRST_TEXT_TOKEN) % 3
    order = torch.randperm(nf, generator=g)  # the family path: one cycle through all families
    nxt = torch.empty(nf, dtype=torch.int64)
    nxt[order] = order.roll(-1)
    perms = torch.tensor([[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]])
    cls = torch.zeros(vocab, dtype=torch.int64)
    cls[text] = perms[torch.randint(0, 6, (nf,), generator=g)][fam].gather(1, mem.unsqueeze(1)).squeeze(1)
    own_sigma = perms[torch.randint(0, 6, (text.numel(),), generator=g)]
    own = torch.rand(text.numel(), generator=g) < member_noise
    sigma = torch.where(own.unsqueeze(1), own_sigma, perms[0].expand(text.numel(), 3))
    cand = torch.zeros(vocab, 3, dtype=torch.int64)
    cand[text] = FIRST_TEXT_TOKEN + 3 * nxt[fam].unsqueeze(1) + sigma
    tail = torch.full((vocab, n_tail), FIRST_TEXT_TOKEN, dtype=torch.int64)
    tail[text] = text[torch.randint(0, text.numel(), (text.numel(), n_tail), generator=g)]
    comp = torch.zeros(vocab, dtype=torch.int64)
    comp[text] = torch.randint(0, int(components), (nf,), generator=g)[fam]  # per family
    src = MarkovSource(int(vocab), int(seed), probs, float(member_noise), int(components), comp, cls, cand, tail)
    return src.to(device) if device is not None else src


# ------------------------------------------------------------------------------------------------
# The estimator
# ------------------------------------------------------------------------------------------------
def tree_rank_tuples(depth_logprobs: torch.Tensor, budget: int):
    """The rank tuples of the DDTree nodes built from one per-depth profile.

    ``depth_logprobs``: ``[L, K]`` log-probabilities of the drafter's top ``K``
    candidates per depth, sorted descending.  Uses the plugin's own builder
    (:func:`sglang_ddtree.tree.build_tree_reference`), so the node set is the
    one the served tree would hold for a drafter with this profile."""
    from sglang_ddtree.tree import build_tree_reference

    t = build_tree_reference(depth_logprobs.to(torch.float64), int(budget))
    out = []
    for slot in range(1, t.num_nodes + 1):
        out.append(tuple(t.ranks[s] for s in t.path(slot)))
    return out


def expected_accept(depth_probs, budget: int, rank_probs=None, block: Optional[int] = None) -> Dict[str, float]:
    """Exact expected accept lengths (bonus token included) of a chain and a DDTree.

    Model: the drafter's distribution at depth ``d`` (1-based) has the sorted
    probability profile ``depth_probs[d-1]`` (``[L, K]``, each row descending,
    summing to <= 1), and the target's greedy token at depth ``d`` sits at the
    drafter's rank ``j`` with probability ``rank_probs[d-1][j]``, independently
    across depths given the profile (``rank_probs`` defaults to ``depth_probs``:
    a calibrated drafter).  Then, exactly:

    * chain (block ``blk``, ``blk - 1`` drafted tokens):
      ``1 + sum_{d<blk} prod_{i<=d} rank_probs[i][0]``;
    * tree of budget ``B``: the best-first tree over the profile is a fixed set
      of rank tuples; a node ``(j1..jd)`` is on the accepted path iff the truth
      has those ranks at depths ``1..d``, so the expected number of accepted
      nodes is ``sum_{node} prod_i rank_probs[i][j_i]`` (the tree is prefix
      closed, so the accepted path is the set of nodes matching the truth).

    Returns ``{"chain": .., "tree": .., "ratio": tree / chain}``.  The chain uses
    ``block`` (default ``L + 1``); the tree is capped at the same depth."""
    dp = torch.as_tensor(depth_probs, dtype=torch.float64)
    rp = dp if rank_probs is None else torch.as_tensor(rank_probs, dtype=torch.float64)
    if dp.dim() != 2 or rp.shape != dp.shape:
        raise ValueError(f"depth_probs / rank_probs must both be [L, K], got {tuple(dp.shape)}, {tuple(rp.shape)}")
    if (dp < 0).any() or (dp.sum(1) > 1 + 1e-9).any() or (rp < 0).any() or (rp.sum(1) > 1 + 1e-9).any():
        raise ValueError("each row must hold probabilities summing to <= 1")
    if (dp[:, 1:] > dp[:, :-1]).any():
        raise ValueError("depth_probs rows must be sorted descending")
    depth = dp.shape[0] if block is None else min(dp.shape[0], int(block) - 1)
    if depth < 1:
        raise ValueError("need at least one drafted depth")
    chain = 1.0 + float(torch.cumprod(rp[:depth, 0], 0).sum())
    lp = torch.log(dp[:depth].clamp_min(1e-300))
    tree = 1.0
    for ranks in tree_rank_tuples(lp, budget):
        tree += math.prod(float(rp[i, j]) for i, j in enumerate(ranks))
    return {"chain": chain, "tree": tree, "ratio": tree / chain}


def tree_walk_accept(tree, truth: torch.Tensor) -> torch.Tensor:
    """Accept length (bonus included) of the greedy ``truth`` [R, L] through a
    :class:`sglang_ddtree.tree.TreeBatch`: 1 + the depth of the deepest node whose
    path spells ``truth[:, :d]`` (what a greedy tree verify accepts)."""
    r = truth.shape[0]
    cur = torch.zeros(r, dtype=torch.int64, device=truth.device)
    acc = torch.zeros(r, dtype=torch.int64, device=truth.device)
    alive = torch.ones(r, dtype=torch.bool, device=truth.device)
    for d in range(truth.shape[1]):
        hit = (tree.parents == cur.unsqueeze(1)) & (tree.token_ids == truth[:, d:d + 1]) & tree.valid
        found = hit.any(1) & alive
        cur = torch.where(found, hit.to(torch.int64).argmax(1), cur)
        acc += found.long()
        alive &= found
    return acc + 1


def accept_lengths(logits: torch.Tensor, truth: torch.Tensor, budgets: Sequence[int] = ()) -> Dict[str, torch.Tensor]:
    """Exact per-row accept lengths of real drafter outputs against a greedy truth.

    ``logits`` [R, L, V]: the drafter's distributions at depths ``1..L`` (one block
    per row); ``truth`` [R, L]: the target's greedy tokens there.  Returns
    ``{"chain": [R], "tree_B<b>": [R] for b in budgets}`` (bonus included): the chain
    accepts while its argmax is right; the tree is the plugin's (top-K per depth
    with the tie rule, :func:`sglang_ddtree.step.build_tree_from_candidates`, built
    on CPU tensors by its torch builder, identical to the Triton one) walked with
    :func:`tree_walk_accept`."""
    from sglang_ddtree.step import build_tree_from_candidates, draft_topk_candidates, merge_vocab_shards

    r, length, v = logits.shape
    logits = logits.float()
    out = {"chain": (1 + (logits.argmax(-1) == truth).long().cumprod(1).sum(1)).cpu()}
    flat = logits.reshape(-1, v)
    for b in budgets:
        k = min(int(b), v)
        vals, ids, lse = draft_topk_candidates(flat, k)
        lp, cid = merge_vocab_shards(vals.unsqueeze(0), ids.unsqueeze(0), lse.unsqueeze(0), k)
        tree = build_tree_from_candidates(lp.view(r, length, k).cpu(), cid.view(r, length, k).cpu(), int(b))
        out[f"tree_B{b}"] = tree_walk_accept(tree, truth.cpu())
    return out


def decode_walk(lengths) -> Dict[str, int]:
    """What greedy speculative decoding of a text reports, from the accept length at each of its anchors.

    ``lengths``: one row per text (a list of lists or an int tensor ``[N, A]``); ``lengths[s][i]`` is the accept
    length (bonus included, >= 1) of a step whose bonus token sits at the text's anchor ``i``, anchor 0 being the
    first decode step's.  A step at anchor ``i`` commits ``lengths[s][i]`` tokens and the next step's bonus is at
    anchor ``i + lengths[s][i]``: a server visits those anchors only, the ones right after a rejection, so its
    accept length is *not* the mean over every anchor (which weights each position once and so counts the easy
    stretches that one step crosses whole many times over).  The walk stops at the first anchor past the row (no
    full block left there, as a request's last steps are cut by its token limit).

    Returns ``{"tokens": committed tokens, "steps": decode steps}`` summed over the texts: ``tokens / steps`` is
    what SGLang reports as the accept length of these requests (``completion_tokens / spec_verify_ct``, pooled),
    and ``"anchor_tokens"`` / ``"anchors"`` the per-anchor sum and count, for the mean over every anchor."""
    rows = lengths.tolist() if hasattr(lengths, "tolist") else [list(r) for r in lengths]
    tokens = steps = anchor_tokens = anchors = 0
    for s, row in enumerate(rows):
        bad = next((i for i, n in enumerate(row) if int(n) < 1), None)
        if bad is not None:
            raise ValueError(f"accept length {row[bad]} at text {s}, anchor {bad}: every step commits at least its "
                             "bonus token")
        i = 0
        while i < len(row):
            n = int(row[i])
            tokens += n
            steps += 1
            i += n
        anchor_tokens += sum(int(x) for x in row)
        anchors += len(row)
    return {"tokens": tokens, "steps": steps, "anchor_tokens": anchor_tokens, "anchors": anchors}
