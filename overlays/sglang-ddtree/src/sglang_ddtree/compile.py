"""Compile a :class:`~sglang_ddtree.tree.TreeBatch` into SGLang 0.5.23 verify inputs.

Conventions (read from SGLang 0.5.23's ``DFlashVerifyInput`` /
``EagleVerifyInput`` and the contract documented on
``sglang.kernels.ops.speculative.reconstruct_tree``):

* ``draft_token``: int64 ``[N * D]``, request-major, each request's row is
  ``[bonus, node_1, ..., node_B]`` with ``D = B + 1`` (slot order of the tree).
* ``positions``: int64 ``[N * D]``, ``prefix_len + depth(slot)``.
* ``custom_mask``: flat bool "allow" mask, request-major.  ``FULL_MASK`` layout
  (what the GPU verify backends read): for request ``n`` there are ``D`` rows of
  ``prefix_len[n] + D`` columns, the prefix columns all True and the last ``D``
  columns the ancestor-or-self mask of the tree; total size
  ``sum(prefix_len) * D + N * D * D`` (the ``mask_numel`` that
  ``DFlashVerifyInput.generate_attn_arg_prefill`` computes).  ``QLEN_ONLY``
  layout: just the ``N * D * D`` tree part.
* ``retrieve_index``: int64 ``[N, D]``, ``n * D + slot`` (batch-flattened row
  of the verify logits).  ``retrieve_next_token`` / ``retrieve_next_sibling``:
  int64 ``[N, D]`` holding *local* slot indices, ``-1`` for none.  These are
  exactly what ``reconstruct_indices_from_tree_mask`` derives from the tree
  mask (cross-checked in the tests against SGLang's own Triton kernel).
* ``topk``: SGLang gates tree-aware metadata (hybrid linear-attention tree path,
  tree mask) on ``topk > 1``; DDTree always reports ``>= 2``.
* ``max_tree_depth``: the deepest allowed node (number of draft positions used).

Slots that hold no node (``TreeBatch.valid`` False; only when the search space
is smaller than ``B``) get the bonus token, the root's position, a self-only
mask row and no links, so no walk can reach them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .tree import TreeBatch

__all__ = ["FULL_MASK", "QLEN_ONLY", "VerifyInputs", "ancestor_mask", "compile_tree", "full_mask_index",
           "full_mask_layout", "with_full_mask"]

FULL_MASK = "full"
QLEN_ONLY = "qlen"


@dataclass
class VerifyInputs:
    draft_token: torch.Tensor  # int64 [N*D]
    positions: torch.Tensor  # int64 [N*D]
    custom_mask: torch.Tensor  # bool, flat (layout per mask_mode)
    tree_mask: torch.Tensor  # bool [N, D, D], ancestor-or-self
    retrieve_index: torch.Tensor  # int64 [N, D]
    retrieve_next_token: torch.Tensor  # int64 [N, D]
    retrieve_next_sibling: torch.Tensor  # int64 [N, D]
    depths: torch.Tensor  # int64 [N, D]
    draft_token_num: int  # D = B + 1
    topk: int
    max_tree_depth: int
    mask_mode: str
    # int64 [N*D*D]: where the tree part of each row goes in the FULL layout (a function of the prefix lengths
    # only, so a QLEN_ONLY compile inside a CUDA graph can carry it and the FULL write after it is two launches)
    full_mask_index: Optional[torch.Tensor] = None


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[N, D, D]`` bool: ``mask[n, i, j]`` iff slot ``j`` is slot ``i`` or one of its
    ancestors (up to ``max_depth`` hops).  Static shapes, no host sync.

    Pointer jumping: after round ``t`` row ``i`` holds its ancestors up to ``2**t``
    hops and ``jump[i]`` is its ``2**t``-th ancestor (``-1`` past the root), so
    ``ceil(log2(max_depth))`` rounds of one row gather each replace ``max_depth``
    rounds of one hop (a decode step is launch-bound: 4 rounds instead of 15 at a
    16-token drafter block).  Equal to the one-hop walk (tests/plugin/test_compile.py)."""
    n, d = parents.shape
    dev = parents.device
    eye = torch.eye(d, dtype=torch.bool, device=dev).unsqueeze(0)
    ok = (parents >= 0).unsqueeze(-1)
    safe = parents.clamp_min(0)
    mask = eye | (torch.nn.functional.one_hot(safe, d).to(torch.bool) & ok)  # self and parent: 1 hop
    jump = parents
    hops = 1
    while hops < max_depth:
        jok = jump >= 0
        jsafe = jump.clamp_min(0)
        # rows of the 2**t-th ancestor (its ancestors up to 2**t hops), where there is one
        far = torch.gather(mask, 1, jsafe.unsqueeze(-1).expand(n, d, d)) & jok.unsqueeze(-1)
        mask = mask | far
        jump = torch.where(jok, torch.gather(jump, 1, jsafe), jump)
        hops *= 2
    return mask


def compile_tree(
    tree: TreeBatch,
    bonus_tokens: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    mask_mode: str = FULL_MASK,
    prefix_lens_sum: Optional[int] = None,
    topk: int = 2,
    full_index: bool = False,
) -> VerifyInputs:
    """Build SGLang verify inputs for a batch of trees.

    ``bonus_tokens``: int ``[N]`` (the last committed token of each request, the
    root).  ``prefix_lens``: int ``[N]`` committed sequence lengths *before* the
    verify tokens (SGLang's ``seq_lens``).  ``prefix_lens_sum``: pass the host-side
    sum (SGLang has ``seq_lens_sum``) to avoid a device sync when building the
    FULL_MASK layout.  ``full_index`` (``QLEN_ONLY`` only): also the FULL layout's scatter index
    (:func:`full_mask_index`), for :func:`with_full_mask`.
    """
    if topk < 2:
        raise ValueError("DDTree verify must report topk >= 2 so SGLang takes its tree paths")
    n, d = tree.token_ids.shape
    dev = tree.token_ids.device
    bonus = bonus_tokens.to(device=dev, dtype=torch.int64).view(n, 1)
    prefix = prefix_lens.to(device=dev, dtype=torch.int64).view(n)

    valid = tree.valid
    tokens = torch.where(valid, tree.token_ids, bonus.expand(n, d)).clone()
    tokens[:, 0] = bonus[:, 0]
    depths = torch.where(valid, tree.depths, torch.zeros_like(tree.depths))
    positions = prefix.unsqueeze(1) + depths

    tmask = ancestor_mask(tree.parents, tree.max_depth)
    retrieve_index = torch.arange(n * d, device=dev, dtype=torch.int64).view(n, d)

    if mask_mode == QLEN_ONLY:
        custom_mask = tmask.reshape(-1)
    elif mask_mode == FULL_MASK:
        custom_mask = full_mask_layout(tmask, prefix, prefix_lens_sum)
    else:
        raise ValueError(f"mask_mode must be {FULL_MASK!r} or {QLEN_ONLY!r}, got {mask_mode!r}")

    return VerifyInputs(
        draft_token=tokens.reshape(-1),
        positions=positions.reshape(-1),
        custom_mask=custom_mask,
        tree_mask=tmask,
        retrieve_index=retrieve_index,
        retrieve_next_token=tree.first_child.clone(),
        retrieve_next_sibling=tree.next_sibling.clone(),
        depths=depths,
        draft_token_num=d,
        topk=int(topk),
        max_tree_depth=int(tree.max_depth),
        mask_mode=mask_mode,
        full_mask_index=full_mask_index(prefix, d) if full_index and mask_mode == QLEN_ONLY else None,
    )


def full_mask_index(prefix_lens: torch.Tensor, d: int) -> torch.Tensor:
    """int64 ``[N*D*D]``: the flat FULL_MASK position of each ``[N, D, D]`` tree-mask entry (row ``r`` of
    request ``n`` starts at ``D * sum(prefix[:n]) + n*D*D + r * (prefix[n] + D)``; its tree part after the
    ``prefix[n]`` prefix columns). Fixed shape for a batch size, no host sync."""
    prefix = prefix_lens.to(torch.int64).view(-1)
    n, dev = prefix.shape[0], prefix.device
    req_start = d * (torch.cumsum(prefix, 0) - prefix) + torch.arange(n, device=dev) * d * d
    row_len = prefix + d  # [N]
    r = torch.arange(d, device=dev)
    idx = req_start.view(n, 1, 1) + r.view(1, d, 1) * row_len.view(n, 1, 1) + prefix.view(n, 1, 1) + r.view(1, 1, d)
    return idx.reshape(-1)


def full_mask_layout(tree_mask: torch.Tensor, prefix_lens: torch.Tensor, prefix_lens_sum: Optional[int] = None,
                     index: Optional[torch.Tensor] = None):
    """The FULL_MASK layout (see the module docstring) of ``[N, D, D]`` ancestor-or-self masks.

    Its size depends on ``sum(prefix_lens)``, so it is the one piece of a compile that a fixed-shape CUDA graph
    cannot hold: the glue graph captures everything else (:func:`compile_tree` with ``QLEN_ONLY``, and with
    ``full_index`` the scatter ``index`` of :func:`full_mask_index`) and this runs after it
    (:func:`with_full_mask`). ``prefix_lens_sum``: the host-side sum, to avoid a device sync."""
    n, d, _ = tree_mask.shape
    dev = tree_mask.device
    prefix = prefix_lens.to(device=dev, dtype=torch.int64).view(n)
    total = int(prefix.sum().item()) if prefix_lens_sum is None else int(prefix_lens_sum)
    total = total * d + n * d * d
    custom_mask = torch.ones(total, dtype=torch.bool, device=dev)
    custom_mask[full_mask_index(prefix, d) if index is None else index] = tree_mask.reshape(-1)
    return custom_mask


def with_full_mask(vin: VerifyInputs, prefix_lens: torch.Tensor, prefix_lens_sum: Optional[int] = None) -> VerifyInputs:
    """``vin`` (compiled ``QLEN_ONLY``) with its ``custom_mask`` in the FULL_MASK layout: equal to compiling
    with ``FULL_MASK`` directly (tests/plugin/test_compile.py)."""
    import dataclasses

    if vin.mask_mode != QLEN_ONLY:
        raise ValueError(f"with_full_mask expects a QLEN_ONLY compile, got {vin.mask_mode!r}")
    return dataclasses.replace(vin, custom_mask=full_mask_layout(vin.tree_mask, prefix_lens, prefix_lens_sum,
                                                                 vin.full_mask_index),
                               mask_mode=FULL_MASK)
