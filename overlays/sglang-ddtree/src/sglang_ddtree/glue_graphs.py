"""CUDA graphs of a tree-verify step's own glue, captured per batch size (no SGLang import).

A decode step of a small model is launch-bound: on the H200 the tree-verify step's index arithmetic around
SGLang's forwards (drafter top-K, tree build, verify-input compile; greedy accept, accept counters, commit
indices) was ~250 small kernels and ~60% of the step's host time, while the GPU was busy for ~7% of it
(benchmarks/results/MEASUREMENTS.md). Those pieces are pure functions of a few tensors with shapes
fixed by the batch size, so each is captured once per batch size and replayed: one launch instead of ~100.

:class:`GlueGraph` wraps one such function ``fn(*tensors) -> outputs`` (outputs: tensors, or tuples, lists,
dicts and dataclasses of them, plus Python constants):

* the first call for a key (the batch size and every input's shape and dtype) runs ``fn`` eagerly - that is
  the step's result - and then captures ``fn`` on static copies of the inputs (capture runs no kernel, so
  nothing is done twice; the eager run has already tuned every Triton kernel in it);
* the next call copies the inputs into the static ones, replays, and checks the replay against an eager run
  once (``check_first``): a mismatch logs an error and that key stays eager for good, so a graph can cost
  speed, never an output;
* a capture that fails (an op that syncs or allocates by data) is logged once and the key stays eager.

Replayed outputs live in the graph's static buffers and are overwritten by the next replay of the same key:
a caller clones what outlives the step (:func:`clone_out`).

``share=True`` (glue level 2) chains graphs without copies: the first call also replays right after its capture
and returns the graph's own buffers (checked against the eager run it just made, as ``check_first`` checks the
first replay), so what a graph returns is always its static buffers; and an input that lies in another glue
graph's output buffer (graph 2 reads graph 1's tree links and ranks) is read there in place instead of being
copied into a buffer of its own, an input passed twice is copied once. A replay then copies only the inputs that
came from elsewhere (one launch saved per input). Should such an input not be the buffer the graph reads (the
other graph ran eagerly for this batch size), it is copied into that buffer like any static input: the buffer is
the other graph's scratch, which its next replay overwrites anyway. Off CUDA (CPU tests) or when disabled it is
``fn`` itself. ``SGLANG_DDTREE_GLUE_GRAPHS=0`` disables every glue graph (A/B runs); ``=1`` / ``=2`` pick a level of
:data:`GLUE_LEVELS`; unset, a target without recurrent layers gets 2 and a hybrid one 1 (what has served on a GPU).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["GLUE_GRAPHS_ENV", "GLUE_LEVELS", "DEFAULT_LEVEL", "GlueGraph", "CudaGraphs", "glue_graph_level",
           "glue_graphs_enabled", "clone_out", "flatten", "unflatten", "same"]

logger = logging.getLogger(__name__)

GLUE_GRAPHS_ENV = "SGLANG_DDTREE_GLUE_GRAPHS"
MAX_KEYS = 64  # batch sizes a server sees are bounded by --max-running-requests; this bounds memory too


# What each level of SGLANG_DDTREE_GLUE_GRAPHS captures (the worker reads glue_graph_level):
# 0 nothing (every glue op eager), 1 the two glue graphs, 2 also the FULL mask's scatter index (into graph 1)
# and the recurrent commit's indices (into graph 2), and graph 2 reads graph 1's outputs in place (share).
# Unset, the level is what has served on the H200 for that kind of target (level 2 on a dense
# target, with fewer launches a step and no glue failure: benchmarks/results/MEASUREMENTS.md; level 2's recurrent indices only in ddtree_checks.glue_check, not
# yet served), so a hybrid target stays at 1 unless asked for 2.
GLUE_LEVELS = {"0": 0, "off": 0, "false": 0, "1": 1, "on": 1, "true": 1, "2": 2}
DEFAULT_LEVEL = {False: 2, True: 1}  # keyed by "the target has recurrent (Mamba/GDN) layers"


def glue_graph_level(environ=None, recurrent: bool = True) -> int:
    """The glue level asked for in ``environ`` (default ``os.environ``); unset or empty, the default of a target
    with (``recurrent``) or without recurrent layers."""
    v = (environ if environ is not None else os.environ).get(GLUE_GRAPHS_ENV, "").strip().lower()
    if not v:
        return DEFAULT_LEVEL[bool(recurrent)]
    if v not in GLUE_LEVELS:
        raise ValueError(f"{GLUE_GRAPHS_ENV} must be 0, 1 or 2, got {v!r}")
    return GLUE_LEVELS[v]


def glue_graphs_enabled(environ=None) -> bool:
    return glue_graph_level(environ, recurrent=True) >= 1


# ----- outputs as leaves (tensors are captured buffers, the rest constants) -------------------------
def flatten(obj) -> Tuple[list, Any]:
    """``obj`` -> (tensor leaves, spec). Spec rebuilds ``obj`` from leaves; non-tensor values are kept in it."""
    leaves: list = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            leaves.append(o)
            return ("T", len(leaves) - 1)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return ("D", type(o), tuple((f.name, walk(getattr(o, f.name))) for f in dataclasses.fields(o)
                                        if f.init))
        if isinstance(o, (tuple, list)):
            return ("S", type(o), tuple(walk(x) for x in o))
        if isinstance(o, dict):
            return ("M", tuple((k, walk(v)) for k, v in o.items()))
        return ("C", o)

    return leaves, walk(obj)


def unflatten(leaves, spec):
    kind = spec[0]
    if kind == "T":
        return leaves[spec[1]]
    if kind == "D":
        return spec[1](**{name: unflatten(leaves, s) for name, s in spec[2]})
    if kind == "S":
        return spec[1](unflatten(leaves, s) for s in spec[2])
    if kind == "M":
        return {k: unflatten(leaves, s) for k, s in spec[1]}
    return spec[1]


def _consts(spec):
    """The spec with tensor slots erased: two results of one key must agree on it."""
    kind = spec[0]
    if kind == "T":
        return ("T",)
    if kind == "D":
        return ("D", spec[1], tuple((n, _consts(s)) for n, s in spec[2]))
    if kind == "S":
        return ("S", spec[1], tuple(_consts(s) for s in spec[2]))
    if kind == "M":
        return ("M", tuple((k, _consts(s)) for k, s in spec[1]))
    return spec


def same(a, b) -> bool:
    """Bit-equal results (tensors: shape, dtype and every element; NaN equals NaN)."""
    la, sa = flatten(a)
    lb, sb = flatten(b)
    if _consts(sa) != _consts(sb) or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.is_floating_point():
            if not torch.equal(torch.nan_to_num(x, nan=0.0), torch.nan_to_num(y, nan=0.0)) or \
                    not torch.equal(torch.isnan(x), torch.isnan(y)):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def clone_out(obj):
    """A copy of a replayed result whose tensors no later replay overwrites."""
    leaves, spec = flatten(obj)
    return unflatten([t.clone() for t in leaves], spec)


class CudaGraphs:
    """What :class:`GlueGraph` asks of the device: CUDA graphs (the only backend that serves; tests on a CPU host
    pass a stand-in for the GPU with the same five calls)."""

    @staticmethod
    def usable(inputs) -> bool:
        return all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)

    @staticmethod
    def new_graph():
        return torch.cuda.CUDAGraph()

    @staticmethod
    def new_pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def capture(graph, pool):
        return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")

    @staticmethod
    def synchronize() -> None:
        torch.cuda.synchronize()


@dataclasses.dataclass
class _Entry:
    graph: Any = None  # torch.cuda.CUDAGraph
    inputs: Tuple[torch.Tensor, ...] = ()
    out_leaves: list = dataclasses.field(default_factory=list)
    spec: Any = None
    checked: bool = False
    eager: bool = False  # capture failed or the check did: this key runs fn for good
    replays: int = 0
    alias: Tuple[int, ...] = ()  # (share) inputs that are an earlier input's buffer: copied once


# Every glue graph's output buffers (share=True), by where they lie: the inputs a sharing graph reads in place.
# A buffer lives as long as its graph, and graphs are kept for the server's life.
_STATIC_OUTPUTS: Dict[tuple, torch.Tensor] = {}


def _where(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def _in_static_output(t: torch.Tensor) -> bool:
    """Whether ``t`` is, or is a view inside, a registered output buffer."""
    if _where(t) in _STATIC_OUTPUTS:
        return True
    p, storage = t.data_ptr(), t.untyped_storage().data_ptr()
    return any(b.device == t.device and b.untyped_storage().data_ptr() == storage
               and b.data_ptr() <= p < b.data_ptr() + b.numel() * b.element_size() for b in _STATIC_OUTPUTS.values())


class GlueGraph:
    """One pure step function, replayed from a CUDA graph per input signature (see the module docstring)."""

    def __init__(self, name: str, fn: Callable, *, enabled: bool = True, check_first: bool = True,
                 pool=None, device=CudaGraphs, share: bool = False) -> None:
        self.name, self.fn = name, fn
        self._dev = device
        self.enabled = bool(enabled)
        self.check_first = bool(check_first)
        self.share = bool(share)
        self.copies = 0  # input copies made at replays (what sharing saves shows here)
        self._pool = pool
        self._entries: Dict[tuple, _Entry] = {}
        self.captures = 0
        self.failures = 0

    @staticmethod
    def _key(inputs) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)

    def stats(self) -> Dict[str, int]:
        e = self._entries.values()
        return {"graphs": sum(1 for x in e if x.graph is not None and not x.eager),
                "eager_keys": sum(1 for x in e if x.eager), "replays": sum(x.replays for x in e),
                "failures": self.failures, "input_copies": self.copies}

    def __call__(self, *inputs: torch.Tensor):
        if not self.enabled or not inputs or not self._dev.usable(inputs):
            return self.fn(*inputs)
        key = self._key(inputs)
        e = self._entries.get(key)
        if e is None:
            if len(self._entries) >= MAX_KEYS:
                return self.fn(*inputs)
            out = self.fn(*inputs)  # this step's result; also warms (tunes) every kernel in fn
            e = self._entries[key] = self._capture(key, inputs, out)
            if not self.share or e.eager:
                return out
            # share: the result comes from the graph's buffers from the first call on (the static inputs hold
            # these inputs' values: clones, or the very buffers), checked against the eager run just made
            return self._replay(key, e, inputs, ref=out)
        if e.eager:
            return self.fn(*inputs)
        for i, (s, x) in enumerate(zip(e.inputs, inputs)):
            if i in e.alias or (self.share and _where(s) == _where(x)):
                continue  # an earlier input's buffer, or already where the graph reads it
            s.copy_(x)
            self.copies += 1
        return self._replay(key, e, inputs)

    def _replay(self, key, e: "_Entry", inputs, ref=None):
        e.graph.replay()
        e.replays += 1
        out = unflatten(e.out_leaves, e.spec)
        if self.check_first and not e.checked:
            e.checked = True
            ref = self.fn(*inputs) if ref is None else ref
            if not same(out, ref):
                e.eager = True
                self.failures += 1
                logger.error("DDTREE glue graph %s: the replay differs from the eager run for inputs %s; this "
                             "batch size runs eagerly from now on", self.name, [tuple(s) for s, _, _ in key])
                return ref
        return out

    def _static_inputs(self, inputs):
        """The buffers a capture reads its inputs from: copies of them, except (``share``) what lies in another
        glue graph's output buffer (read in place) and a tensor passed again (one buffer; ``alias`` lists it)."""
        if not self.share:
            return tuple(x.clone() for x in inputs), ()
        out: list = []
        alias, seen = [], {}
        for i, x in enumerate(inputs):
            w = _where(x)
            if w in seen:
                out.append(out[seen[w]])
                alias.append(i)
                continue
            seen[w] = i
            out.append(x if _in_static_output(x) else x.clone())
        return tuple(out), tuple(alias)

    def _capture(self, key, inputs, eager_out) -> _Entry:
        e = _Entry()
        try:
            e.inputs, e.alias = self._static_inputs(inputs)
            g = self._dev.new_graph()
            if self._pool is None:
                self._pool = self._dev.new_pool()
            self._dev.synchronize()
            with self._dev.capture(g, self._pool):
                out = self.fn(*e.inputs)
            leaves, spec = flatten(out)
            _, espec = flatten(eager_out)
            if _consts(spec) != _consts(espec):
                raise RuntimeError("the captured run's constants differ from the eager run's")
            e.graph, e.out_leaves, e.spec = g, leaves, spec
            if self.share:
                for t in leaves:
                    _STATIC_OUTPUTS[_where(t)] = t
            if hasattr(g, "record"):  # a stand-in graph (tests without a GPU) re-runs fn into these buffers at replay
                g.record(self.fn, e.inputs, leaves)
            self.captures += 1
        except Exception as exc:  # a graph is an optimisation: never let it fail the step
            e = _Entry(eager=True)
            self.failures += 1
            logger.warning("DDTREE glue graph %s: capture failed for inputs %s (%s: %s); this batch size runs "
                           "eagerly", self.name, [tuple(s) for s, _, _ in key], type(exc).__name__, exc)
            try:
                self._dev.synchronize()
            except Exception:
                pass
        return e
