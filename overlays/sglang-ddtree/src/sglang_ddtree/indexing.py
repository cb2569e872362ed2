"""Index arithmetic between a verify walk and SGLang's KV / recurrent-state bookkeeping.

Pure functions on tensors (no SGLang import, no host sync) so they are tested
on CPU and reused verbatim by the worker.

Notation: ``N`` requests, ``D = B + 1`` verify slots per request, slot 0 = the
root (bonus token of the previous step).  ``accept_slots`` is ``[N, M]``
(``M = max_depth + 1``) with ``accept_slots[:, 0] == 0`` and ``-1`` padding;
``accept_length[n]`` counts accepted draft nodes (root excluded), so the path
``accept_slots[n, 0 : accept_length[n] + 1]`` is the root plus accepted nodes.
"""

from __future__ import annotations

import torch

__all__ = [
    "flat_accept_index",
    "kv_keep_mask",
    "accepted_kv_locs",
    "kv_free_locs_mask",
    "recurrent_state_step",
    "map_chain_steps_to_slots",
    "gather_accepted_rows",
]


def _path_mask(accept_slots: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
    m = accept_slots.shape[1]
    ar = torch.arange(m, device=accept_slots.device)
    return ar.unsqueeze(0) <= accept_length.unsqueeze(1)


def flat_accept_index(accept_slots: torch.Tensor, accept_length: torch.Tensor, d: int) -> torch.Tensor:
    """SGLang's ``accept_index``: batch-flattened verify rows ``n * D + slot`` of
    the root and accepted nodes, ``-1`` elsewhere. ``[N, M]``."""
    n = accept_slots.shape[0]
    base = torch.arange(n, device=accept_slots.device).unsqueeze(1) * d
    keep = _path_mask(accept_slots, accept_length) & (accept_slots >= 0)
    return torch.where(keep, base + accept_slots, torch.full_like(accept_slots, -1))


def kv_keep_mask(accept_slots: torch.Tensor, accept_length: torch.Tensor, d: int) -> torch.Tensor:
    """``[N, D]`` bool: verify slots whose KV entry is kept (root + accepted path)."""
    n = accept_slots.shape[0]
    keep = torch.zeros(n, d + 1, dtype=torch.bool, device=accept_slots.device)
    on_path = _path_mask(accept_slots, accept_length) & (accept_slots >= 0)
    idx = torch.where(on_path, accept_slots, torch.full_like(accept_slots, d))
    keep.scatter_(1, idx, True)
    return keep[:, :d]


def accepted_kv_locs(
    out_cache_loc: torch.Tensor, accept_slots: torch.Tensor, accept_length: torch.Tensor
) -> torch.Tensor:
    """KV-pool locations of the kept path in sequence order.

    ``out_cache_loc``: ``[N, D]`` (or ``[N*D]``) KV slots the verify forward wrote
    (slot order).  Returns ``[N, M]``: column ``k`` is the location that holds
    the KV of sequence position ``prefix_len + k`` after commit (page size 1 lets
    the worker simply write these into ``req_to_token`` - no KV copy); ``-1`` past
    the path."""
    n, m = accept_slots.shape
    loc = out_cache_loc.reshape(n, -1)
    on_path = _path_mask(accept_slots, accept_length) & (accept_slots >= 0)
    got = torch.gather(loc, 1, accept_slots.clamp_min(0))
    return torch.where(on_path, got, torch.full_like(got, -1))


def kv_free_locs_mask(accept_slots: torch.Tensor, accept_length: torch.Tensor, d: int) -> torch.Tensor:
    """``[N*D]`` bool over ``out_cache_loc``: entries to return to the allocator
    (everything the verify wrote that is not on the accepted path)."""
    return (~kv_keep_mask(accept_slots, accept_length, d)).reshape(-1)


def recurrent_state_step(accept_slots: torch.Tensor, accept_length: torch.Tensor) -> torch.Tensor:
    """Step index for ``update_mamba_state_after_mtp_verify(last_correct_step_indices=...)``.

    In SGLang's tree verify the linear-attention kernels cache an intermediate
    state per verify SLOT (each node reads its parent's state), so the state to
    commit is the one of the deepest accepted node: ``accept_slots[n,
    accept_length[n]]`` (0 = root when nothing was accepted).  The chain
    formula DFlash uses (``commit_len - 1``) is only correct when slots are a
    chain; for a tree it picks an unrelated node's state."""
    return torch.gather(accept_slots, 1, accept_length.unsqueeze(1)).squeeze(1)


def map_chain_steps_to_slots(
    chain_steps: torch.Tensor, accept_slots: torch.Tensor, accept_length: torch.Tensor
) -> torch.Tensor:
    """Map chain-order step indices (``-1`` = none), e.g. the ``mamba_steps_to_track``
    that SGLang computes from sequence lengths, to verify slots along the
    accepted path.  Steps beyond the accepted path map to ``-1``."""
    ok = (chain_steps >= 0) & (chain_steps <= accept_length)
    safe = chain_steps.clamp(min=0, max=accept_slots.shape[1] - 1)
    got = torch.gather(accept_slots, 1, safe.unsqueeze(1)).squeeze(1)
    return torch.where(ok, got, torch.full_like(got, -1))


def gather_accepted_rows(
    rows: torch.Tensor, accept_slots: torch.Tensor, accept_length: torch.Tensor
):
    """Rows (e.g. target hidden states ``[N*D, H]``) of the root and accepted
    nodes, in path order, padded: returns ``(values [N, M, H], valid [N, M])``.
    The drafter's cache append takes the valid rows."""
    n, m = accept_slots.shape
    d = rows.shape[0] // n
    flat = torch.arange(n, device=rows.device).unsqueeze(1) * d + accept_slots.clamp_min(0)
    valid = _path_mask(accept_slots, accept_length) & (accept_slots >= 0)
    vals = rows.index_select(0, flat.reshape(-1)).reshape(n, m, *rows.shape[1:])
    return vals, valid
