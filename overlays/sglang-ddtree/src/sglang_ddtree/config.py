"""DDTREE settings: modes, node budget, and every server-argument rule, as pure code.

No SGLang import: the plugin (``plugin.py``), the per-version adapters
(``adapters/``) and the workers all read their settings through
:func:`resolve_ddtree_config`, and the tests run it on SGLang's real parser
output for every supported version.

Server arguments (``--speculative-algorithm DDTREE``)
-----------------------------------------------------
* **Budget.**  In ``tree-verify`` mode the verify width is the tree:
  ``--speculative-num-draft-tokens D`` gives ``B = D - 1`` draft nodes plus the
  bonus root.  ``D`` is what SGLang sizes every verify buffer, KV reservation
  and graph by, so it is the single source of truth; ``SGLANG_DDTREE_BUDGET=B``
  may be used instead (it then sets ``D = B + 1``) and is refused when it
  disagrees with an explicit ``D``.  ``SGLANG_DDTREE_BUDGET`` may also carry a
  budget schedule (``1:127,4:31,16:15,64:chain``, ``contract``'s *Budget
  schedule*): each step then uses the budget of its batch size, and ``D`` is the
  schedule's largest width (``chain``: the drafter block, so a schedule with it
  needs ``--speculative-dflash-block-size``).  In ``shadow-linear`` mode ``D`` stays the
  DFlash chain width and ``B`` comes from ``SGLANG_DDTREE_BUDGET`` (default
  ``D - 1``).
* **Mode.**  ``SGLANG_DDTREE_MODE`` = ``tree-verify`` (default) or
  ``shadow-linear``: an environment variable because SGLang's ``ServerArgs``
  cannot take new fields, and the environment reaches the scheduler / TP
  worker processes where the worker reads it.
* **Attention backend (tree-verify).**  The tree is verified in one target
  forward with a per-forward custom ancestor mask whose width (``D``) differs
  from the drafter block's (``blk``) in the same step.  SGLang's Triton
  backend sizes each ``TARGET_VERIFY`` forward by that forward's own
  ``draft_token_num`` and applies its custom mask; others do not (FA3, SGLang's
  Hopper default, sizes every verify by the global ``D`` and gathers the mask
  out of range when ``D > blk``).  SGLang resolves the backend before a plugin's
  validator runs, so DDTREE cannot choose it afterwards: it refuses anything
  but ``triton`` with the flag to pass.
* What the builtin DFLASH handler sets is set here too: ``speculative_num_steps
  = 1``, ``speculative_eagle_topk`` (``>= 2`` in tree-verify so the hybrid
  linear-attention backend takes its tree path and the mamba pool keeps a
  dense conv window per node; 1 in shadow-linear), ``speculative_num_draft_tokens
  = B + 1``, ``page_size = 1`` (accepted KV is kept by remapping
  ``req_to_token``, one token per page), ``max_running_requests`` default 48.
* **Overlap scheduling** (:func:`overlap_decision`), opt-in with
  ``SGLANG_DDTREE_OVERLAP=1``.  SGLang's own DFLASH runs under the overlap
  scheduler (the CPU prepares step N+1 and processes step N's result while the
  GPU runs); DDTREE tree-verify can too, where the adapter has run it
  (``overlap_schedule`` in ``capabilities.json``: 0.5.17) and the drafter block
  ``blk <= D``: under overlap the scheduler reserves ``2*D`` KV slots from a
  committed length one step behind, so a step may start up to ``min(blk, D)``
  tokens (the last step's accepted path) past it and writes a window of
  ``max(blk, D)``; both fit in ``2*D`` only when ``blk <= D``.  It is not the
  default because it serves DDTREE slower at one and four requests while
  emitting the same tokens (``benchmarks/results/MEASUREMENTS.md``).  Off by default, in
  shadow-linear (its tree walk reads the chain's result on the host every
  step), where the block does not fit, or with ``--disable-overlap-schedule``;
  the validator logs which.
* Refused, each with the reason: rejection sampling / block verification /
  accept thresholds, ReplaySSM spec-verify and adaptive speculation, unified
  memory, page size > 1, pipeline parallelism, devices other than CUDA, other
  attention backends in tree-verify mode, and decode CUDA graphs in tree-verify
  mode where the adapter cannot capture the verify graph with the tree mask
  (SGLang captures the DFLASH-family verify graph with ``custom_mask=None``: a
  replayed graph would run the tree causally).  The 0.5.17 adapter captures it
  with the Triton backend's mask buffer, as SGLang does for EAGLE ``topk > 1``
  (``tree_verify_cuda_graphs`` in ``capabilities.json``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from . import contract
from .contract import BUDGET_ENV, MODE_ENV, OVERLAP_ENV, SHADOW_LINEAR, TREE_VERIFY  # noqa: F401 (re-exported)

ALGORITHM_NAME = contract.ALGORITHM_DDTREE
MODES = contract.PLUGIN_MODES
DEFAULT_TOPK = 2
DEFAULT_MAX_RUNNING_REQUESTS = 48  # what the builtin DFLASH handler defaults to
TREE_VERIFY_ATTENTION_BACKENDS = ("triton",)

__all__ = [
    "ALGORITHM_NAME", "MODE_ENV", "BUDGET_ENV", "OVERLAP_ENV", "TREE_VERIFY", "SHADOW_LINEAR", "DEFAULT_TOPK",
    "TREE_VERIFY_ATTENTION_BACKENDS", "DDTreeConfigError", "DDTreeConfig", "resolve_ddtree_config",
    "server_arg_writes", "overlap_decision",
]


class DDTreeConfigError(ValueError):
    """A server-argument combination DDTREE cannot run, with the reason."""


@dataclass(frozen=True)
class DDTreeConfig:
    mode: str
    budget: int  # B
    num_draft_tokens: int  # D as SGLang sees it (B + 1 in tree-verify)
    topk: int
    drafter_block_size: Optional[int]  # from --speculative-dflash-block-size, if given
    # the budget per batch size: ``budget`` itself, or a contract.BudgetSchedule (tree-verify) whose largest
    # budget is ``budget`` and whose largest width is ``num_draft_tokens``
    schedule: Any = None

    def budget_for(self, batch: int):
        """The budget (int, or ``contract.CHAIN``) of a step of ``batch`` requests."""
        return contract.budget_for(self.budget if self.schedule is None else self.schedule, batch)


def _int_or_none(v) -> Optional[int]:
    return None if v is None else int(v)


def _decode_graph_disabled(args: Any) -> bool:
    if getattr(args, "disable_cuda_graph", False):
        return True
    if getattr(args, "cuda_graph_backend_decode", None) == "disabled":
        return True
    cfg = getattr(args, "cuda_graph_config", None)
    decode = getattr(cfg, "decode", None) if cfg is not None else None
    backend = getattr(decode, "backend", None) if decode is not None else None
    return str(getattr(backend, "value", backend)) == "disabled"


def _check_backends(backends: Mapping[str, Optional[str]]) -> None:
    bad = {k: v for k, v in backends.items() if v is not None and v not in TREE_VERIFY_ATTENTION_BACKENDS}
    if bad:
        got = ", ".join(f"{k}={v}" for k, v in sorted(bad.items()))
        raise DDTreeConfigError(
            f"DDTREE tree-verify needs --attention-backend triton (got {got}): the tree is verified with a "
            "per-forward ancestor mask and a width D that differs from the drafter block's, which SGLang's "
            "Triton backend honours per forward; other backends size every verify by the global D (FA3, "
            "the Hopper default, then gathers the mask out of range). SGLang resolves the backend before "
            "DDTREE's validator runs, so pass --attention-backend triton (and leave "
            "--speculative-draft-attention-backend unset or triton)."
        )


# Server flags DDTREE refuses, each with why (checked in this order: the first two before the accept
# thresholds, the rest after, as the messages were always reported).
_REFUSED_FLAGS = (
    ("speculative_use_rejection_sampling",
     "rejection sampling needs the draft probability of one sampled chain, while a DDTree is built "
     "deterministically from the top prefixes; DDTREE samples losslessly with target-only tree sampling instead."),
    ("speculative_use_block_verification",
     "block verification is defined for a sampled linear draft block, not for a tree."),
    ("enable_linear_replayssm_spec",
     "ReplaySSM spec-verify folds a linear chain of drafts into one ring buffer (topk <= 1 only); tree nodes "
     "need per-node intermediate states so each node can read its parent's state."),
    ("speculative_adaptive",
     "adaptive speculation changes the chain width at run time (topk = 1 only); the tree budget is fixed by "
     "D = B + 1."),
    ("enable_unified_memory",
     "the unified pool's speculative audits cover the builtin chain/EAGLE verify paths, not a tree verify that "
     "keeps a non-contiguous accepted path of KV slots and per-node recurrent states."),
)


def resolve_ddtree_config(
    args: Any,
    environ: Optional[Mapping[str, str]] = None,
    backends: Optional[Mapping[str, Optional[str]]] = None,
    tree_verify_cuda_graphs: bool = False,
) -> DDTreeConfig:
    """Pure resolution/validation of DDTREE settings from a ServerArgs-like
    object and an environment mapping.  ``backends`` maps the attention-backend
    fields to their resolved values (each SGLang version resolves them its own
    way; the adapter reads them); ``None`` reads the plain attributes.
    ``tree_verify_cuda_graphs``: the adapter captures the target's verify graph
    with the tree-mask buffer (SGLang 0.5.17); otherwise decode CUDA graphs are
    refused in tree-verify mode.  Raises :class:`DDTreeConfigError`."""
    env = os.environ if environ is None else environ
    mode = (env.get(MODE_ENV) or contract.DEFAULT_PLUGIN_MODE).strip().lower()
    if mode not in MODES:
        raise DDTreeConfigError(f"{MODE_ENV}={mode!r} is not a DDTREE mode; choose one of {list(MODES)}.")

    device = str(getattr(args, "device", None) or "cuda")
    if not device.startswith("cuda"):
        raise DDTreeConfigError(
            f"DDTREE runs only on CUDA (got --device {device}): its tree verify uses SGLang's CUDA/Triton "
            "tree-attention and hybrid linear-attention tree kernels."
        )
    if getattr(args, "speculative_draft_model_path", None) is None:
        raise DDTreeConfigError("DDTREE needs a DFlash drafter: set --speculative-draft-model-path.")
    if int(getattr(args, "pp_size", 1) or 1) != 1:
        raise DDTreeConfigError("DDTREE supports pp_size == 1 only, like the DFlash worker it extends.")
    for flag, why in _REFUSED_FLAGS[:2]:
        if getattr(args, flag, False):
            raise DDTreeConfigError(f"DDTREE refuses --{flag.replace('_', '-')}: {why}")
    if (
        float(getattr(args, "speculative_accept_threshold_single", 1.0)) != 1.0
        or float(getattr(args, "speculative_accept_threshold_acc", 1.0)) != 1.0
    ):
        raise DDTreeConfigError(
            "DDTREE refuses speculative accept thresholds other than 1.0: relaxed acceptance would make "
            "tree sampling lossy (each emitted token must be a sample of the target's distribution)."
        )
    for flag, why in _REFUSED_FLAGS[2:]:
        if getattr(args, flag, False):
            raise DDTreeConfigError(f"DDTREE refuses --{flag.replace('_', '-')}: {why}")
    page = _int_or_none(getattr(args, "page_size", None))
    if page is not None and page != 1:
        raise DDTreeConfigError(
            f"DDTREE needs --page-size 1 (got {page}): the accepted root-to-node path is scattered over "
            "the verify slots and is kept by remapping one KV slot per token."
        )

    d_arg = _int_or_none(getattr(args, "speculative_num_draft_tokens", None))
    b_env = env.get(BUDGET_ENV)
    b_env_i = None
    schedule = None
    if b_env not in (None, ""):
        if contract.is_schedule(b_env):
            try:
                schedule = contract.parse_budget(b_env)
            except ValueError as e:
                raise DDTreeConfigError(f"{BUDGET_ENV}={b_env!r} is not a budget schedule: {e}.") from None
            if not isinstance(schedule, contract.BudgetSchedule):  # one entry: that plain budget
                schedule, b_env = None, str(schedule)
        if schedule is None:
            try:
                b_env_i = int(b_env)
            except ValueError:
                raise DDTreeConfigError(f"{BUDGET_ENV}={b_env!r} is not an integer node budget or a schedule "
                                        "THRESHOLD:BUDGET,... .") from None
            if b_env_i < 1:
                raise DDTreeConfigError(f"{BUDGET_ENV} must be >= 1, got {b_env_i}.")
    block = _int_or_none(getattr(args, "speculative_dflash_block_size", None))
    if schedule is not None:
        if mode != TREE_VERIFY:
            raise DDTreeConfigError(f"{BUDGET_ENV}={b_env!r} is a budget schedule, which only {TREE_VERIFY} serves; "
                                    f"{mode} reports what one budget would accept: give one integer.")
        if schedule.has_chain and block is None:
            raise DDTreeConfigError(f"{BUDGET_ENV}={b_env!r} has {contract.CHAIN} (verified at the drafter's block "
                                    "width): set --speculative-dflash-block-size.")
        want = contract.draft_tokens(mode, schedule, block)
        if d_arg is not None and d_arg != want:
            raise DDTreeConfigError(
                f"--speculative-num-draft-tokens {d_arg} and {BUDGET_ENV}={b_env} disagree: a schedule's server "
                f"verifies up to its largest width D = {want} (SGLang sizes its buffers by it).")
        b_env_i = contract.largest_budget(schedule)
        d_arg = want

    if mode == TREE_VERIFY:
        if d_arg is None and b_env_i is None:
            raise DDTreeConfigError(
                "DDTREE tree-verify needs the node budget: set --speculative-num-draft-tokens D "
                f"(B = D - 1 tree nodes plus the bonus root) or {BUDGET_ENV}=B."
            )
        if schedule is None and d_arg is not None and b_env_i is not None \
                and d_arg != contract.draft_tokens(mode, b_env_i, block):
            raise DDTreeConfigError(
                f"--speculative-num-draft-tokens {d_arg} and {BUDGET_ENV}={b_env_i} disagree: "
                "DDTREE verifies D = B + 1 tokens (bonus + B nodes)."
            )
        d = d_arg if d_arg is not None else contract.draft_tokens(mode, b_env_i, block)
        if d < 2:
            raise DDTreeConfigError(f"--speculative-num-draft-tokens must be >= 2 for DDTREE (B >= 1), got {d}.")
        topk_arg = _int_or_none(getattr(args, "speculative_eagle_topk", None))
        if topk_arg is not None and topk_arg < 2:
            raise DDTreeConfigError(
                f"DDTREE tree-verify needs --speculative-eagle-topk >= 2 (got {topk_arg}): SGLang's "
                "hybrid linear-attention backend and tree metadata take the tree path only when topk > 1."
            )
        if not tree_verify_cuda_graphs and not _decode_graph_disabled(args):
            raise DDTreeConfigError(
                "DDTREE tree-verify needs --cuda-graph-backend-decode disabled (or --disable-cuda-graph) with "
                "this SGLang version: it captures the DFlash-family verify graph with custom_mask=None and "
                "topk=1, so a replayed graph would run the tree with a causal mask (silently wrong); the "
                "plugin captures it with the tree mask only where its adapter says so (capabilities.json, "
                "tree_verify_cuda_graphs)."
            )
        if block is not None and block > 2 * d:
            raise DDTreeConfigError(
                f"--speculative-dflash-block-size {block} is wider than 2*D = {2 * d}: the scheduler reserves "
                "2*D KV slots per request for a step and the drafter writes its whole block there; use a "
                "larger node budget or a drafter with a smaller block."
            )
        if backends is None:
            backends = {k: getattr(args, k, None) for k in (
                "attention_backend", "decode_attention_backend", "prefill_attention_backend",
                "speculative_draft_attention_backend")}
        _check_backends(backends)
        if schedule is not None:
            return DDTreeConfig(mode, b_env_i, d, topk_arg or DEFAULT_TOPK, block, schedule)
        return DDTreeConfig(mode, contract.budget_of(d), d, topk_arg or DEFAULT_TOPK, block)

    # shadow-linear: the chain verifier commits; D is the DFlash block width.
    d = d_arg if d_arg is not None else block
    if d is not None and block is not None and d != block:
        raise DDTreeConfigError(
            "In shadow-linear mode --speculative-num-draft-tokens is the DFlash block size and must equal "
            f"--speculative-dflash-block-size (got {d} and {block})."
        )
    if d is None:
        raise DDTreeConfigError(
            "DDTREE shadow-linear needs the DFlash block size: set --speculative-num-draft-tokens or "
            "--speculative-dflash-block-size."
        )
    topk_arg = _int_or_none(getattr(args, "speculative_eagle_topk", None))
    if topk_arg not in (None, 1):
        raise DDTreeConfigError("DDTREE shadow-linear verifies a chain: --speculative-eagle-topk must be 1 or unset.")
    return DDTreeConfig(mode, b_env_i if b_env_i is not None else contract.budget_of(d), d, 1, block)


def overlap_decision(cfg: DDTreeConfig, drafter_block: Optional[int], adapter_overlap: bool,
                     environ: Optional[Mapping[str, str]] = None, user_disabled: bool = False):
    """Whether a DDTREE server runs under SGLang's overlap scheduler, and why (see the module docstring):
    ``(on, reason)``. ``drafter_block``: the drafter's block width ``blk`` where known (None: unknown, off);
    ``adapter_overlap``: the adapter's ``OVERLAP_SCHEDULE`` (capabilities.json ``overlap_schedule``)."""
    env = os.environ if environ is None else environ
    if user_disabled:
        return False, "--disable-overlap-schedule given"
    if cfg.mode != TREE_VERIFY:
        return False, ("shadow-linear walks the tree on the host after every chain step (it reads that step's "
                       "result), which the synchronous scheduler serves without a lag")
    asked = (env.get(OVERLAP_ENV) or "").strip().lower()
    if not contract.overlap_asked(asked):
        return False, (f"opt-in with {OVERLAP_ENV}=1" + (f", got {OVERLAP_ENV}={env.get(OVERLAP_ENV)}" if asked else "")
                       + ": on the H200 the synchronous scheduler served tree-verify faster at 1 and 4 requests")
    if not adapter_overlap:
        return False, "this SGLang version's adapter has not run tree-verify under the overlap scheduler"
    if drafter_block is None:
        return False, "the drafter's block width is unknown here (it must be <= D for overlap)"
    if int(drafter_block) > cfg.num_draft_tokens:
        return False, (f"the drafter block {drafter_block} is wider than D = {cfg.num_draft_tokens}: under overlap "
                       f"the scheduler reserves 2*D KV slots from a committed length one step behind, and a step "
                       f"may start {min(int(drafter_block), cfg.num_draft_tokens)} tokens past it with a window "
                       f"of {max(int(drafter_block), cfg.num_draft_tokens)}")
    return True, f"drafter block {drafter_block} <= D = {cfg.num_draft_tokens}"


def server_arg_writes(args: Any, cfg: DDTreeConfig, overlap: bool = False) -> dict:
    """The server arguments DDTREE sets (what the builtin DFLASH handler would
    set, with DDTREE's topk and width): a plain dict the validator assigns.
    ``overlap``: :func:`overlap_decision`'s verdict (False: the synchronous scheduler)."""
    writes = {
        "speculative_num_steps": 1,
        "speculative_eagle_topk": cfg.topk,
        "speculative_num_draft_tokens": cfg.num_draft_tokens,
        "disable_overlap_schedule": not overlap,
        "page_size": 1,
    }
    if getattr(args, "max_running_requests", None) is None:
        writes["max_running_requests"] = DEFAULT_MAX_RUNNING_REQUESTS
    return writes
