"""Which requests a DDTREE server serves, decided when a request arrives (pure).

A request tree-verify cannot serve is rejected alone, before it joins a batch,
with a message that says why (SGLang finishes it with an abort, the client gets
an error, the server keeps serving the others).  Deciding inside the decode
step instead would raise in the scheduler loop and take every request down
with it.

Tree-verify serves greedy and temperature / top-k / top-p / min-p sampling.
It rejects what is defined along a single chain only: logprobs (the verify
returns one distribution per tree node, not per emitted position), grammar
constraints, frequency / presence / repetition penalties, ``min_new_tokens``,
``logit_bias`` and custom logit processors (they depend on the emitted history,
which differs per tree branch).  Shadow-linear commits through SGLang's own
DFlash chain step and admits what DFlash admits.

One logprob request is served in every speculative mode: the prefill-only
re-score (``max_new_tokens == 0`` with ``return_logprob``), whose input-token
logprobs come from the target's own forward over the prompt -- no draft, no
verify, nothing emitted.  The deploy gate's canary re-scores a server's greedy
output with it (deploy/canary.py).  SGLang's DFLASH refuses every
``return_logprob``; :func:`dflash_verdict` lifts exactly that refusal for
exactly this request, and :func:`logprobs_past_dflash` takes it past 0.5.17's
DFlash worker, which checks again on every batch.  Logprobs with generation
stay refused.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from .config import TREE_VERIFY

__all__ = ["tree_verify_rejection", "rejection", "prefill_only_logprob", "dflash_verdict",
           "logprobs_past_dflash"]


def _nonzero(v, neutral: float) -> bool:
    try:
        return v is not None and float(v) != neutral
    except (TypeError, ValueError):
        return True


def prefill_only_logprob(req: Any) -> bool:
    """``req`` asks input-token logprobs and generates nothing (``max_new_tokens == 0``)."""
    sp = getattr(req, "sampling_params", None)
    try:
        return bool(getattr(req, "return_logprob", False)) and sp is not None and \
            int(getattr(sp, "max_new_tokens", -1)) == 0
    except (TypeError, ValueError):
        return False


def dflash_verdict(result: Optional[str], req: Any, enable_overlap: bool = False) -> Optional[str]:
    """SGLang's ``validate_dflash_request`` verdict, except that the prefill-only
    logprob request is admitted (SGLang checks ``return_logprob`` first, so its
    other check, hidden states under overlap, is made again here)."""
    if result is None or not prefill_only_logprob(req):
        return result
    if enable_overlap and getattr(req, "return_hidden_states", False):
        return result
    return None


def tree_verify_rejection(req: Any) -> Optional[str]:
    """The reason a tree-verify DDTREE server cannot serve ``req`` (an SGLang
    ``Req``-like object with ``sampling_params``), or ``None``."""
    sp = getattr(req, "sampling_params", None)
    what = []
    if getattr(req, "return_logprob", False) and not prefill_only_logprob(req):
        what.append("return_logprob")
    if sp is not None:
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            if getattr(sp, name, None):
                what.append(f"grammar ({name})")
        for name in ("frequency_penalty", "presence_penalty"):
            if _nonzero(getattr(sp, name, 0.0), 0.0):
                what.append(name)
        if _nonzero(getattr(sp, "repetition_penalty", 1.0), 1.0):
            what.append("repetition_penalty")
        if int(getattr(sp, "min_new_tokens", 0) or 0) > 0:
            what.append("min_new_tokens")
        if getattr(sp, "logit_bias", None):
            what.append("logit_bias")
    if getattr(req, "custom_logit_processor", None):
        what.append("custom_logit_processor")
    if getattr(req, "grammar", None) is not None and "grammar" not in " ".join(what):
        what.append("grammar")
    if not what:
        return None
    return (
        "DDTREE tree-verify does not support " + ", ".join(what) + ": these are defined along one emitted "
        "chain, while a tree verify scores many branches at once. Send the request without them, or to a "
        "server in DDTREE shadow-linear mode or without speculative decoding."
    )


def rejection(mode: Optional[str], req: Any) -> Optional[str]:
    """Admission decision for the active DDTREE mode (``None``: not a DDTREE server)."""
    return tree_verify_rejection(req) if mode == TREE_VERIFY else None


@contextmanager
def logprobs_past_dflash(batch: Any, target_worker: Any) -> Iterator[None]:
    """Around DFlash's own ``forward_batch_generation`` of a prefill batch:
    SGLang 0.5.17's DFlash worker raises on any batch with ``return_logprob``
    (inside the scheduler loop: the server would go down), while admission lets
    the prefill-only logprob request through.  The flag is hidden from DFlash's
    check and handed back to the target's own forward (``target_worker``'s
    ``forward_batch_generation``, which computes the input-token logprobs), then
    restored.  A batch without logprobs passes untouched."""
    if not getattr(batch, "return_logprob", False):
        yield
        return
    original = target_worker.forward_batch_generation

    def target_forward(b, *args, **kwargs):
        b.return_logprob = True
        return original(b, *args, **kwargs)

    batch.return_logprob = False
    target_worker.forward_batch_generation = target_forward
    try:
        yield
    finally:
        try:
            del target_worker.forward_batch_generation  # the instance attribute: the method shows again
        except AttributeError:
            target_worker.forward_batch_generation = original
        batch.return_logprob = True
