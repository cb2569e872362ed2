"""Target-only tree sampling with bounded memory (no SGLang import).

The verify returns one logits row per tree node: ``[N*D, V]``.  Turning those
into the target's processed distributions (temperature, top-k, top-p, min-p,
in SGLang's sampler order) and handing them to SGLang's tree sampling kernel
with zero draft probabilities needs about four ``[rows, V]`` float32 tensors at
once (probabilities, two renormalised copies, the zero draft).  At V = 151936,
48 requests and D = 64 that is ~7.5 GB, none of it budgeted by SGLang's memory
planner.  :func:`sample_tree_accept` therefore runs the kernel over groups of
requests whose rows fit ``max_bytes`` (default 256 MiB, env
``SGLANG_DDTREE_SAMPLING_BYTES``): peak extra memory is bounded by that, not by
the batch.

The kernel and the renorm functions are passed in (each SGLang version
exports them from a different place); CPU tests pass a pure-torch reference.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

DEFAULT_MAX_BYTES = 256 << 20
MAX_BYTES_ENV = "SGLANG_DDTREE_SAMPLING_BYTES"

__all__ = ["target_probs", "requests_per_chunk", "sample_tree_accept", "max_bytes_from_env"]


def max_bytes_from_env(environ=None) -> int:
    env = os.environ if environ is None else environ
    v = env.get(MAX_BYTES_ENV)
    return DEFAULT_MAX_BYTES if not v else max(1 << 20, int(v))


def target_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: Optional[torch.Tensor],
    top_ps: Optional[torch.Tensor],
    min_ps: Optional[torch.Tensor],
    *,
    top_k_renorm: Optional[Callable] = None,
    top_p_renorm: Optional[Callable] = None,
) -> torch.Tensor:
    """Rows ``[R, V]`` -> the target's sampling distribution per row.

    ``temperatures`` ``[R, 1]`` (or ``[R]``); ``top_ks`` / ``top_ps`` /
    ``min_ps`` ``[R]`` or ``None`` when no row needs them.  Order as SGLang's
    sampler: softmax(logits / T), top-k renorm, top-p renorm, min-p filter and
    renorm (a token survives min-p when ``p >= min_p * max p``)."""
    t = temperatures.reshape(-1, 1).to(torch.float32)
    probs = torch.softmax(logits.float() / t, dim=-1)
    if top_ks is not None:
        probs = top_k_renorm(probs, top_ks) if top_k_renorm is not None else _top_k_renorm_torch(probs, top_ks)
    if top_ps is not None:
        probs = top_p_renorm(probs, top_ps) if top_p_renorm is not None else _top_p_renorm_torch(probs, top_ps)
    if min_ps is not None:
        thr = probs.max(dim=-1, keepdim=True).values * min_ps.reshape(-1, 1).to(probs.dtype)
        probs = torch.where(probs < thr, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _top_k_renorm_torch(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    v = probs.shape[-1]
    k = top_ks.to(torch.int64).clamp(min=1, max=v).reshape(-1, 1)
    srt = torch.sort(probs, dim=-1, descending=True).values
    kth = torch.gather(srt, 1, k - 1)
    out = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return out / out.sum(dim=-1, keepdim=True)


def _top_p_renorm_torch(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    srt, idx = torch.sort(probs, dim=-1, descending=True)
    csum = torch.cumsum(srt, dim=-1)
    keep_sorted = (csum - srt) < top_ps.reshape(-1, 1).to(srt.dtype)
    keep = torch.zeros_like(keep_sorted).scatter(1, idx, keep_sorted)
    out = torch.where(keep, probs, torch.zeros_like(probs))
    return out / out.sum(dim=-1, keepdim=True)


def requests_per_chunk(bs: int, d: int, vocab: int, max_bytes: int, tensors: int = 4) -> int:
    """How many requests' ``d`` rows of ``vocab`` float32 fit ``max_bytes``
    with ``tensors`` such tensors alive at once (at least one request)."""
    per_req = max(1, d * vocab * 4 * tensors)
    return max(1, min(bs, max_bytes // per_req))


def sample_tree_accept(
    *,
    logits: torch.Tensor,
    d: int,
    temperatures: torch.Tensor,
    top_ks: Optional[torch.Tensor],
    top_ps: Optional[torch.Tensor],
    min_ps: Optional[torch.Tensor],
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    coins: torch.Tensor,
    coins_final: torch.Tensor,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_num: torch.Tensor,
    kernel: Callable,
    top_k_renorm: Optional[Callable] = None,
    top_p_renorm: Optional[Callable] = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> int:
    """Lossless target-only tree sampling over request groups; fills
    ``predicts`` ``[N*D]``, ``accept_index`` ``[N, M]``, ``accept_num`` ``[N]`` in
    place.  ``kernel`` has the signature of SGLang's
    ``tree_speculative_sampling_target_only``.  Per-request tensors
    (``temperatures`` ``[N, 1]``, ``top_ks``/``top_ps``/``min_ps`` ``[N]``) are
    expanded to the request's ``d`` rows.  Returns the number of groups."""
    bs = candidates.shape[0]
    vocab = logits.shape[-1]
    step = requests_per_chunk(bs, d, vocab, max_bytes)
    groups = 0
    zeros = None
    for a in range(0, bs, step):
        b = min(bs, a + step)
        n = b - a

        def rows(x):
            return None if x is None else torch.repeat_interleave(x[a:b].reshape(n, -1)[:, 0], d, dim=0)

        probs = target_probs(
            logits[a * d : b * d],
            rows(temperatures).reshape(-1, 1),
            rows(top_ks),
            rows(top_ps),
            rows(min_ps),
            top_k_renorm=top_k_renorm,
            top_p_renorm=top_p_renorm,
        ).reshape(n, d, vocab)
        if zeros is None or zeros.shape[0] != n:
            zeros = torch.zeros_like(probs)
        kernel(
            predicts=predicts[a * d : b * d],
            accept_index=accept_index[a:b],
            accept_token_num=accept_num[a:b],
            candidates=candidates[a:b],
            retrive_index=retrieve_index[a:b] - a * d,
            retrive_next_token=retrieve_next_token[a:b],
            retrive_next_sibling=retrieve_next_sibling[a:b],
            uniform_samples=coins[a:b],
            uniform_samples_for_final_sampling=coins_final[a:b],
            target_probs=probs,
            draft_probs=zeros,
            threshold_single=1.0,
            threshold_acc=1.0,
            deterministic=True,
        )
        if a:
            # the kernel writes flat row ids relative to its slice; make them global again
            sl = accept_index[a:b]
            sl.copy_(torch.where(sl >= 0, sl + a * d, sl))
        groups += 1
    return groups
