"""Tree verify walk: greedy (exact) and sampling (lossless, target-only).

The walk follows SGLang's ``verify_tree_greedy`` contract: start at the root
(slot 0); the target's prediction at the current slot is compared with the
tokens of the current slot's children (``retrieve_next_token`` then the
``retrieve_next_sibling`` chain); on a match the child is accepted and becomes
the current slot, otherwise the walk stops and the target's prediction at the
current slot is the bonus token.  Siblings carry distinct tokens (the tree
takes distinct top-K tokens per depth), so at most one child matches.

Greedy (T = 0): predictions are ``argmax`` of the target logits at every slot,
so the emitted tokens are exactly what step-by-step greedy decoding emits.

Sampling (T > 0), as in the DDTree paper: draw ONE independent sample from the
target's own (temperature / top-k / top-p processed) distribution at every slot
and run the same walk with those samples as predictions.  Every emitted token -
accepted or bonus - is the sample drawn at the node whose root-to-node path is
exactly the accepted prefix, i.e. a sample of ``p_target(. | accepted prefix)``,
independent of everything emitted before.  The output is therefore distributed
exactly as ancestral sampling from the target (lossless); the draft tree only
changes how many tokens one verify step emits.  No draft probabilities are
needed, which is what makes this valid for a deterministically built tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["WalkResult", "walk_tree", "verify_greedy", "verify_sample", "sample_from_probs"]


@dataclass
class WalkResult:
    accept_slots: torch.Tensor  # int64 [N, max_depth + 1]; [:, 0] = 0 (root), -1 padded
    accept_length: torch.Tensor  # int64 [N]; number of accepted DRAFT nodes (root excluded)
    bonus_tokens: torch.Tensor  # int64 [N]; target prediction at the deepest accepted slot
    emitted_tokens: torch.Tensor  # int64 [N, max_depth + 1]; accepted tokens then bonus, -1 padded
    last_slot: torch.Tensor  # int64 [N]; deepest accepted slot (0 if none)


def walk_tree(
    token_ids: torch.Tensor,
    parents: torch.Tensor,
    predictions: torch.Tensor,
    max_depth: int,
    valid: Optional[torch.Tensor] = None,
) -> WalkResult:
    """Vectorised walk for a batch; ``token_ids`` / ``parents`` / ``predictions``
    are ``[N, D]`` (slot 0 = root; ``predictions[n, s]`` is the target's token at
    slot ``s``).  ``max_depth`` device iterations, no host sync."""
    n, d = token_ids.shape
    dev = token_ids.device
    if valid is None:
        valid = parents >= 0
        valid[:, 0] = True
    cur = torch.zeros(n, dtype=torch.int64, device=dev)
    alive = torch.ones(n, dtype=torch.bool, device=dev)
    slots = torch.full((n, max_depth + 1), -1, dtype=torch.int64, device=dev)
    slots[:, 0] = 0
    length = torch.zeros(n, dtype=torch.int64, device=dev)
    slot_ids = torch.arange(d, device=dev).expand(n, d)
    for step in range(1, max_depth + 1):
        want = torch.gather(predictions, 1, cur.unsqueeze(1))  # [N, 1]
        match = (parents == cur.unsqueeze(1)) & (token_ids == want) & valid
        found = match.any(dim=1) & alive
        child = torch.where(match, slot_ids, torch.full_like(slot_ids, d)).amin(dim=1)
        cur = torch.where(found, child, cur)
        slots[:, step] = torch.where(found, child, torch.full_like(child, -1))
        length = length + found.to(torch.int64)
        alive = found
    bonus = torch.gather(predictions, 1, cur.unsqueeze(1)).squeeze(1)
    toks = torch.where(slots > 0, torch.gather(token_ids, 1, slots.clamp_min(0)), torch.full_like(slots, -1))
    emitted = toks[:, 1:].clone()
    emitted = torch.cat([emitted, torch.full((n, 1), -1, dtype=torch.int64, device=dev)], 1)
    emitted.scatter_(1, length.unsqueeze(1), bonus.unsqueeze(1))
    return WalkResult(slots, length, bonus, emitted, cur)


def verify_greedy(tree, target_logits: torch.Tensor) -> WalkResult:
    """Greedy verify. ``target_logits``: ``[N, D, V]`` (or ``[N*D, V]``) rows in slot order."""
    n, d = tree.token_ids.shape
    pred = target_logits.reshape(n, d, -1).argmax(dim=-1)
    return walk_tree(tree.token_ids, tree.parents, pred, tree.max_depth, tree.valid)


def sample_from_probs(
    probs: torch.Tensor, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """One independent categorical sample per row of ``probs`` (``[..., V]``),
    inverse-CDF with uniforms from ``generator``; no host sync."""
    flat = probs.reshape(-1, probs.shape[-1]).to(torch.float64)
    cdf = torch.cumsum(flat, dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    idx = torch.searchsorted(cdf, u * total, right=True).clamp_max(flat.shape[-1] - 1)
    return idx.reshape(probs.shape[:-1])


def verify_sample(
    tree,
    target_probs: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    predictions: Optional[torch.Tensor] = None,
) -> WalkResult:
    """Lossless sampling verify.  ``target_probs``: ``[N, D, V]`` the target's
    processed sampling distribution at every slot (temperature, top-k/p already
    applied, exactly as the non-speculative sampler would use).  ``predictions``
    may carry samples drawn elsewhere (e.g. SGLang's sampler) instead."""
    n, d = tree.token_ids.shape
    if predictions is None:
        predictions = sample_from_probs(target_probs.reshape(n, d, -1), generator)
    return walk_tree(tree.token_ids, tree.parents, predictions, tree.max_depth, tree.valid)
