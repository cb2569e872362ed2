"""Throughput and latency of plain, DFLASH and DDTREE serving on one GPU: ``python -m sglang_ddtree_tools.bench``.

Runs where SGLang and this plugin are installed (a fleet host's managed venv, driven by ``fab bench``, or any GPU
box: nothing of the toolkit is needed).  For each requested mode, budget and CUDA-graph setting it starts ONE
transient SGLang server (:mod:`sglang_ddtree_tools.servers`, as ``sglang_ddtree_tools.smoke`` starts them: ``systemd-run``
units where systemd runs, plain process sessions otherwise, ``--launcher``), alone on the GPU: servers run one
after another, never two at once, and each is torn down before the next starts, also on an error, SIGTERM or
Ctrl-C.  It then replays the prompts (token ids through ``/generate`` with ``--skip-tokenizer-init``,
``stream: true``, greedy, ``ignore_eos``, a fixed ``max_new_tokens``) at each concurrency and reports, per
(mode, budget, graphs, concurrency):

* ``output_tok_s``: output tokens of all requests of the level / the level's wall time (first request sent to
  last request finished);
* ``accept_length``: SGLang's own figures, summed over the level's requests: ``completion_tokens /
  spec_verify_ct`` (SGLang 0.5.17's ``meta_info``; per request that is ``spec_accept_length``); None for plain;
* ``ttft_ms`` p50/p99: time to the first streamed chunk that carries a token;
* ``step_ms`` p50/p99 over the level's requests: one request's decode time (first token-carrying chunk to the
  last) over its decode steps (SGLang's ``spec_verify_ct``; plain: a step a token). With ``accept_length`` it
  splits a race in two: what a step costs and what it buys (tok/s ~ accept / step, less the fixed TTFT);
* ``host`` (where /proc is): the machine's busy and stolen CPU time over the level and the server's busiest
  processes, their CPU share and the CPU each last ran on (:mod:`sglang_ddtree_tools.hostload`): on a shared or virtual
  host a whole server instance can run slow, and this says next to its tok/s whether the host was why; with
  ``sched_cpu_ms``, the before-start speed of the CPU the scheduler ran on (below);
* per server (and per round), ``cpu_ms`` {"before", "after"}: each CPU's time for one pinned Python loop right
  before the server starts and right after it stops (:func:`sglang_ddtree_tools.hostload.cpu_speeds`; on the H200's
  host one vCPU ran it 2x slower than another, and the same vCPU 2x slower minutes later, with no steal shown);
* ``itl_ms`` p50/p99: per-token latency after the first chunk.  A streamed chunk that brings ``n`` tokens
  ``g`` ms after the previous one counts as ``n`` tokens of ``g / n`` ms each (a speculative step emits several
  tokens at once; counting the chunk gap as one token's latency would penalise exactly what speculation buys);
* ``requests``, ``errors``, ``output_tokens``, ``wall_s``.

Modes: ``plain`` (no speculation), ``dflash`` (SGLang's own DFLASH chain, block ``--block``; ``linear`` is
accepted as its name in the fleet), ``tree-verify`` and ``shadow-linear`` (DDTREE; for each budget B in
``--budgets``; tree-verify verifies ``--speculative-num-draft-tokens = B + 1`` tokens).  A tree-verify server
also serves a budget schedule (``contract``'s *Budget schedule*: each step the budget of its batch size), given
among the budgets with ``;`` between the items: ``--budgets "31; 1:127,4:31,64:chain"`` serves B=31 and that
schedule (:func:`sglang_ddtree_tools.report.parse_budget_list`).  ``--graphs on|off|both``:
off passes ``--cuda-graph-backend-decode disabled``; on leaves SGLang's decode graph backend on (captured up to
the largest concurrency).  A server that refuses to start is recorded as a failed run with the reason and its
log tail, and the others still run.  ``--server-args`` words
are appended to every server's command line (last, so they win).  ``--overlap on|off|both`` sets each tree-verify
server's own ``SGLANG_DDTREE_OVERLAP`` (both: one server on SGLang's synchronous scheduler and one on its overlap
scheduler per budget, in the same rounds against the same DFLASH server); a DDTREE run is named ``overlap`` where
its server said it ran that scheduler (:func:`run_label`).

``--rounds N`` runs the whole list N times over, every other round in reverse (A B C, C B A, ...; a fresh server
each time; a level's row is its median round, with every round's tok/s in ``tok_s_rounds``), and prints, under
the table, each run's paired ratio to DFLASH (and to plain) round by round (:mod:`sglang_ddtree_tools.paired`): on the
H200's host the same step's host time differed by ~30% between two servers started one after the other, and one
server's tok/s 2x from one start to another, more than the gaps being measured.

Each level is preceded by ``c`` unmeasured warm-up requests of ``--warmup-tokens`` tokens at that concurrency
(Triton compiles per batch shape); a level sends ``max(--requests, c)`` requests (prompts reused in order).

Models: ``--model PATH [--draft-model PATH]``; or ``--tiny DIR [--family hybrid|dense]``: a tiny pair as
``python -m sglang_ddtree_tools.trainkit DIR`` (trained; with its held-out ``prompts.jsonl``) or
``python -m sglang_ddtree_tools.tiny DIR`` (random weights) write it (``DIR/FAMILY-target``, ``DIR/FAMILY-drafter``;
``DIR/FAMILY/{target,drafter}`` too); or ``--tiny-train`` (the training kit run here first, seeded by ``--seed``,
into the private work directory: what ``fab bench --tiny`` does) or ``--tiny-random`` (tiny.py's random pair
written there).  Prompts: ``--prompts FILE`` (JSON or JSONL of token-id lists or ``{"input_ids": [...]}``
objects; with a tiny pair its ``prompts.jsonl`` is used when none is given), or ``--num-prompts`` random prompts
of ``--prompt-len`` tokens within the target's vocabulary.

Output: the table on stdout; ``--json FILE`` (``-`` for stdout) the report, schema ``ddtree-bench/1``
(:func:`validate_report` says what it holds); ``--plot FILE`` a PNG (matplotlib, Agg; skipped with a note when
matplotlib is not installed): output tok/s against concurrency, one line per mode/budget/graphs.  ``--out DIR``
writes ``bench.json``, ``bench.png`` and the servers' logs there.  Exit status: 0 every run measured, 1 a run
failed (the report still says what did run), 2 this host cannot run it (no GPU device; said plainly on stderr),
130 interrupted (servers stopped, the partial report written).

The pure parts (argument parsing and run planning, prompt files, stream parsing, percentiles, aggregation, the
report schema, the table and the plot) are tested on CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

from sglang_ddtree import contract
from sglang_ddtree.contract import BUDGETED_MODES as BUDGETED, DFLASH, OVERLAP_ENV, PLAIN, TREE_VERIFY
from .hostload import LevelWatch, cpu_speeds, host_line, sched_cpu_ms, speed_line
from .spy import format_summary, spy_argv, summarize
from .servers import (Server, ServerSpec, cpu_list, free_port, get, gpu_device_problem, gpu_memory_mib, gpu_name,
                      load_service_env, map_concurrent, parse_cpus, server_argv, server_env, server_mem_fraction,
                      wait_healthy)
from .paired import report_section, section_line
from .report import (BENCH_MODES, BUDGETED, MODE_ALIASES, SCHEMA, failure_summary, name_run,  # noqa: F401
                     parse_budget_list, parse_modes, run_label, validate_report)

GRAPHS = {"on": (True,), "off": (False,), "both": (False, True)}
# --overlap: the scheduler each tree-verify server is asked for (SGLANG_DDTREE_OVERLAP in its own environment);
# "default" leaves the plugin's switch as this process has it (unset: the synchronous scheduler)
OVERLAP_CHOICES = {"default": (None,), "off": (False,), "on": (True,), "both": (False, True)}


def overlap_env(overlap: Optional[bool]) -> Dict[str, str]:
    """A tree-verify server's own environment for one of OVERLAP_CHOICES' values (None: the switch as it is here)."""
    return {} if overlap is None else {OVERLAP_ENV: "1" if overlap else "0"}

FAMILIES = ("hybrid", "dense")
EXIT_OK, EXIT_FAILED, EXIT_CANNOT_RUN, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_PROMPT_TOKENS = 32768
MAX_PROMPTS = 100000

__all__ = [
    "SCHEMA", "BENCH_MODES", "RunSpec", "parse_int_list", "parse_modes", "plan_runs", "load_prompts",
    "random_prompts", "resolve_tiny", "Sizing", "plan_sizing", "spec_for", "parse_sse", "RequestRecord",
    "percentile", "aggregate_level", "validate_report", "format_table", "write_plot", "main",
]


# ----------------------------------------------------------------------------- pure parts: what to run
def parse_int_list(text: str, what: str, lo: int = 1, hi: int = 4096) -> List[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (sorted, unique); every value in ``[lo, hi]``."""
    out = []
    for word in str(text).split(","):
        word = word.strip()
        if not word:
            continue
        try:
            v = int(word)
        except ValueError:
            raise ValueError(f"{what}: {word!r} is not an integer") from None
        if not lo <= v <= hi:
            raise ValueError(f"{what}: {v} is outside [{lo}, {hi}]")
        out.append(v)
    if not out:
        raise ValueError(f"{what}: give at least one value")
    return sorted(set(out))


def _slug(budget) -> str:
    """A budget or schedule as a file name's part (``1:127,4:31`` -> ``1-127_4-31``)."""
    return str(budget).replace(":", "-").replace(",", "_")


@dataclass(frozen=True)
class RunSpec:
    """One server of the benchmark: a mode, its budget (DDTREE) or block (DFLASH chain), graphs on or off."""

    mode: str
    budget: Optional[int]  # B for tree-verify / shadow-linear (tree-verify: or a schedule's text), else None
    block: Optional[int]  # the DFlash chain width for dflash / shadow-linear, else None
    graphs: bool
    overlap: Optional[bool] = None  # tree-verify: overlap scheduler asked on (True), off (False), as the switch is (None)

    @property
    def draft_tokens(self) -> Optional[int]:
        return contract.draft_tokens(self.mode, self.budget, self.block)

    @property
    def label(self) -> str:
        return name_run(self.mode, self.budget, self.block, self.graphs, self.overlap)


def plan_runs(modes: Sequence[str], budgets: Sequence[int], graphs: str, block: int,
              overlap: str = "default") -> List[RunSpec]:
    """Every server to start, in order: for each graph setting (off first), each mode, each budget, and for
    tree-verify each scheduler of ``overlap`` (``both``: synchronous, then overlap)."""
    if graphs not in GRAPHS:
        raise ValueError(f"graphs {graphs!r}: choose on, off or both")
    if overlap not in OVERLAP_CHOICES:
        raise ValueError(f"overlap {overlap!r}: choose {', '.join(OVERLAP_CHOICES)}")
    runs = []
    for g in GRAPHS[graphs]:
        for m in modes:
            if m == TREE_VERIFY:  # the drafter's block too: the server is given it, as a deployed unit is
                runs += [RunSpec(m, b, block, g, ov) for b in budgets for ov in OVERLAP_CHOICES[overlap]]
            elif m in BUDGETED:  # shadow-linear: one budget (a schedule is tree-verify's)
                runs += [RunSpec(m, b, block, g) for b in budgets if type(b) is int]
            else:
                runs.append(RunSpec(m, None, block if m == DFLASH else None, g))
    return runs


def _prompt_from(value, where: str, vocab: Optional[int]) -> List[int]:
    ids = value.get("input_ids") if isinstance(value, dict) else value
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{where}: a prompt is a non-empty list of token ids or {{\"input_ids\": [...]}}")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(f"{where}: {len(ids)} tokens (at most {MAX_PROMPT_TOKENS})")
    for t in ids:
        if type(t) is not int or t < 0 or (vocab is not None and t >= vocab):
            raise ValueError(f"{where}: token {t!r} is not an id in [0, {vocab if vocab is not None else 'vocab'})")
    return ids


def load_prompts(path: str, vocab: Optional[int] = None) -> List[List[int]]:
    """Prompts from a JSON document (a list, or ``{"prompts": [...]}``) or JSONL (one prompt a line)."""
    text = Path(path).read_text()
    try:
        doc = json.loads(text)
        items = doc.get("prompts") if isinstance(doc, dict) and "prompts" in doc else doc
        if isinstance(items, dict) or (isinstance(items, list) and items and all(type(x) is int for x in items)):
            items = [items]  # one prompt alone
        if not isinstance(items, list):
            raise ValueError(f"{path}: expected a list of prompts")
        where = [f"{path}: prompt {i}" for i in range(len(items))]
    except json.JSONDecodeError:
        items, where = [], []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e.msg}") from None
            where.append(f"{path}:{n}")
    if not items:
        raise ValueError(f"{path}: no prompts")
    if len(items) > MAX_PROMPTS:
        raise ValueError(f"{path}: {len(items)} prompts (at most {MAX_PROMPTS})")
    return [_prompt_from(v, w, vocab) for v, w in zip(items, where)]


def random_prompts(n: int, length: int, vocab: int, seed: int = 1) -> List[List[int]]:
    """``n`` seeded prompts of ``length`` ids, clear of the low ids (special tokens) and the last two (mask)."""
    import random

    lo, hi = min(100, vocab // 4), max(min(vocab - 2, 31000), min(100, vocab // 4) + 1)
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def resolve_tiny(root: str, family: str) -> dict:
    """The tiny pair of ``family`` under ``root``: ``FAMILY/{target,drafter}`` or ``FAMILY-target`` /
    ``FAMILY-drafter`` (what ``sglang_ddtree_tools.trainkit`` and ``sglang_ddtree_tools.tiny`` write), with the held-out
    ``prompts.jsonl`` beside it when there is one (``FAMILY/prompts.jsonl`` or ``prompts.jsonl``).  ``kind`` is
    ``trained`` when the training kit's ``manifest.json`` is there (or the nested layout), else ``random``."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: choose {' or '.join(FAMILIES)}")
    base = Path(root)
    layouts = [(base / family / "target", base / family / "drafter"),
               (base / f"{family}-target", base / f"{family}-drafter")]
    for n, (t, d) in enumerate(layouts):
        if (t / "config.json").is_file() and (d / "config.json").is_file():
            prompts = next((str(p) for p in (base / family / "prompts.jsonl", base / "prompts.jsonl") if p.is_file()),
                           None)
            trained = n == 0 or (base / "manifest.json").is_file()
            return {"target": str(t), "drafter": str(d), "kind": "trained" if trained else "random", "prompts": prompts}
    raise ValueError(f"{root}: no tiny {family} pair: looked for "
                     + " and ".join(f"{t}/config.json + {d}/config.json" for t, d in layouts))


def trainkit_argv(python: str, out: str, family: str, seed: int) -> List[str]:
    """The training kit's command line (``--tiny-train``): one family, on the GPU, seeded."""
    return [python, "-m", "sglang_ddtree_tools.trainkit", out, "--seed", str(seed), "--family", family, "--device", "cuda"]


def read_config(path: Optional[str]) -> dict:
    if not path:
        return {}
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def drafter_block(cfg: dict, default: int = 8) -> int:
    """The DFlash drafter's own block size (``dflash_config.block_size`` or ``block_size``)."""
    v = (cfg.get("dflash_config") or {}).get("block_size") or cfg.get("block_size")
    return int(v) if isinstance(v, int) and v > 1 else default


def is_hybrid(cfg: dict) -> bool:
    """Recurrent (linear-attention) layers in a target config: the pool caps differ."""
    return "linear_attention" in (cfg.get("layer_types") or []) or any(
        "Next" in a or "Mamba" in a for a in cfg.get("architectures") or [])


def _kv_bytes_per_token(cfg: dict) -> int:
    heads = cfg.get("num_attention_heads") or 1
    hd = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
    return int(2 * (cfg.get("num_hidden_layers") or 0) * (cfg.get("num_key_value_heads") or heads) * hd * 2)


def _weights_mib(path: Optional[str]) -> float:
    if not path or not os.path.isdir(path):
        return 0.0
    return sum(p.stat().st_size for p in Path(path).iterdir()
               if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt")) / 2**20


@dataclass(frozen=True)
class Sizing:
    max_running: int
    context_length: int
    max_total_tokens: int
    max_mamba_cache: Optional[int]
    kv_mib: float


def plan_sizing(prompts: Sequence[Sequence[int]], max_new: int, concurrency: Sequence[int], runs: Sequence[RunSpec],
                target_cfg: dict, drafter_cfg: dict) -> Sizing:
    """Pools for the largest level: every request's prompt + output + one step's draft window fits, twice over."""
    running = max(concurrency)
    window = max([r.draft_tokens or 1 for r in runs] + [1])
    need = max(len(p) for p in prompts) + max_new + window + 64
    ctx = int(math.ceil(need / 256.0) * 256)
    limit = target_cfg.get("max_position_embeddings")
    if isinstance(limit, int) and ctx > limit:
        raise ValueError(f"prompt + output + draft window needs {need} tokens of context; the model allows {limit}")
    total = max(32768, 2 * running * ctx)
    kv = (_kv_bytes_per_token(target_cfg) + _kv_bytes_per_token(drafter_cfg)) * total / 2**20
    mamba = max(48, 6 * running) if is_hybrid(target_cfg) else None
    return Sizing(running, ctx, total, mamba, round(kv, 1))


def spec_for(run: RunSpec, target: str, drafter: Optional[str], sizing: Sizing, mem_fraction: Optional[float],
             extra: Sequence[str] = ()) -> ServerSpec:
    """The server of one run (pools from ``sizing``; graphs captured up to the largest concurrency)."""
    return ServerSpec(mode=run.mode, target=target, drafter=drafter if run.mode != PLAIN else None,
                      budget=run.budget if run.budget is not None else 15, block=run.block,
                      mem_fraction=mem_fraction, max_running=sizing.max_running,
                      max_total_tokens=sizing.max_total_tokens, max_mamba_cache=sizing.max_mamba_cache,
                      context_length=sizing.context_length, cuda_graph=run.graphs,
                      cuda_graph_max_bs=sizing.max_running if run.graphs else None, extra_args=tuple(extra))


# ----------------------------------------------------------------------------- pure parts: measuring
@dataclass
class RequestRecord:
    """One streamed request: when it was sent, each chunk's arrival with the cumulative token count."""

    sent: float
    chunks: List[tuple] = field(default_factory=list)  # (time, cumulative completion tokens)
    meta: dict = field(default_factory=dict)
    error: Optional[str] = None
    done: Optional[float] = None

    @property
    def tokens(self) -> int:
        return self.chunks[-1][1] if self.chunks else 0

    def ttft(self) -> Optional[float]:
        first = next((t for t, n in self.chunks if n > 0), None)
        return None if first is None else first - self.sent

    def step(self) -> Optional[float]:
        """Seconds a decode step took, on average over this request: first token-carrying chunk to last, over the
        steps between (``meta_info.spec_verify_ct`` verify steps where SGLang counts them - the first token is the
        prefill's - else one step a token after the first). None where the request had no such span."""
        marks = [(t, n) for t, n in self.chunks if n > 0]
        if len(marks) < 2:
            return None
        verify = self.meta.get("spec_verify_ct")
        steps = verify if type(verify) is int and verify > 0 else marks[-1][1] - marks[0][1]
        return (marks[-1][0] - marks[0][0]) / steps if steps > 0 else None

    def itl(self) -> List[float]:
        """Per-token latencies after the first token-carrying chunk (a chunk of n tokens: n x gap / n)."""
        out: List[float] = []
        prev = None
        for t, n in self.chunks:
            if n <= 0:
                continue
            if prev is not None and n > prev[1]:
                k = n - prev[1]
                out += [(t - prev[0]) / k] * k
            if prev is None or n > prev[1]:
                prev = (t, n)
        return out


def parse_sse(lines: Iterable[bytes]):
    """SGLang's ``/generate`` stream (``data: {json}`` events, ``data: [DONE]`` last) -> the decoded events."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        body = line[5:].strip()
        if body == b"[DONE]":
            return
        yield json.loads(body)


def event_tokens(ev: dict) -> int:
    """Cumulative completion tokens after an event: ``meta_info.completion_tokens`` (SGLang sets it on every
    chunk, also with ``--incremental-streaming-output``), else the length of the (cumulative) ``output_ids``."""
    n = (ev.get("meta_info") or {}).get("completion_tokens")
    if type(n) is int:
        return n
    return len(ev.get("output_ids") or [])


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(v: Optional[float]) -> Optional[float]:
    return None if v is None else round(v * 1000.0, 3)


def aggregate_level(records: Sequence[RequestRecord], wall_s: float, concurrency: int) -> dict:
    """One row of the report from a level's requests (see the module docstring for each figure)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttfts = [x for x in (r.ttft() for r in ok) if x is not None]
    itls = [x for r in ok for x in r.itl()]
    steps = [x for x in (r.step() for r in ok) if x is not None]
    verify = [(r.meta.get("completion_tokens"), r.meta.get("spec_verify_ct")) for r in ok]
    verify = [(c, v) for c, v in verify if isinstance(c, int) and isinstance(v, int) and v > 0]
    if verify:
        accept = sum(c for c, _ in verify) / sum(v for _, v in verify)
    else:
        per = [r.meta.get("spec_accept_length") for r in ok]
        per = [float(x) for x in per if isinstance(x, (int, float))]
        accept = sum(per) / len(per) if per else None
    return {
        "concurrency": concurrency, "requests": len(records), "errors": len(records) - len(ok),
        "output_tokens": tokens, "wall_s": round(wall_s, 4),
        "output_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "accept_length": None if accept is None else round(accept, 4),
        "ttft_ms": {"p50": _ms(percentile(ttfts, 50)), "p99": _ms(percentile(ttfts, 99))},
        "itl_ms": {"p50": _ms(percentile(itls, 50)), "p99": _ms(percentile(itls, 99))},
        "step_ms": {"p50": _ms(percentile(steps, 50)), "p99": _ms(percentile(steps, 99))},
        "first_error": next((r.error for r in records if r.error), None),
    }


# ----------------------------------------------------------------------------- pure parts: the report
def rows(doc: dict) -> List[dict]:
    """One flat row per (run, level), with the run's label, for tables, plots and choices."""
    out = []
    for run in doc.get("runs") or []:
        label = run_label(run)
        if run.get("status") != "ok" and not run.get("levels"):
            out.append({"label": label, "mode": run["mode"], "budget": run.get("budget"), "graphs": run["graphs"],
                        "failed": run.get("error") or "failed"})
        for lv in run.get("levels") or []:
            out.append(dict(lv, label=label, mode=run["mode"], budget=run.get("budget"), graphs=run["graphs"]))
    return out


def _f(v, nd=1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def format_table(doc: dict) -> str:
    """The report as a fixed-width text table (one line per mode/budget/graphs and concurrency)."""
    head = ("run", "conc", "req", "tok/s", "accept", "ttft p50", "ttft p99", "itl p50", "itl p99", "step p50")
    rounds = any(r.get("tok_s_rounds") for r in rows(doc))
    if rounds:  # --rounds: the median round's row, and every round's tok/s beside it
        head += ("tok/s rounds",)
    lines, notes = [], []
    for r in rows(doc):
        if "failed" in r:
            lines.append((r["label"], "-", "-", "FAILED", "", "", "", "", "", "") + (("",) if rounds else ()))
            notes.append(f"FAILED {r['label']}: {failure_summary(r['failed'])}")
            continue
        line = (r["label"], str(r["concurrency"]), f"{r['requests']}" + (f" ({r['errors']} err)" if r["errors"] else ""),
                _f(r["output_tok_s"]), _f(r["accept_length"], 2), _f(r["ttft_ms"]["p50"]),
                _f(r["ttft_ms"]["p99"]), _f(r["itl_ms"]["p50"], 2), _f(r["itl_ms"]["p99"], 2),
                _f((r.get("step_ms") or {}).get("p50"), 2))
        if rounds:
            tr = r.get("tok_s_rounds") or []
            line += (" ".join(_f(x) for x in tr) + (f" (spread {100 * r['tok_s_spread']:.0f}%)"
                                                     if r.get("tok_s_spread") is not None else ""),)
        lines.append(line)
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda row: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
    m = doc.get("model") or {}
    title = (f"{m.get('target')} (drafter {m.get('drafter')}), GPU {(doc.get('gpu') or {}).get('name')}, "
             f"{(doc.get('settings') or {}).get('max_new_tokens')} new tokens a request; ms for latencies")
    return "\n".join([title, fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(x) for x in lines] + notes)


def write_plot(doc: dict, path: str) -> str:
    """PNG: output tok/s against concurrency, one line per mode/budget/graphs (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict = {}
    for r in rows(doc):
        if "failed" not in r:
            series.setdefault(r["label"], []).append((r["concurrency"], r["output_tok_s"]))
    if not series:
        raise ValueError("no measured level to plot")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                linestyle="--" if "graphs=off" in label else "-", label=label)
    levels = sorted({c for pts in series.values() for c, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    m = doc.get("model") or {}
    ax.set_title(f"{os.path.basename(str(m.get('target') or '').rstrip('/'))} on {(doc.get('gpu') or {}).get('name')}"
                 f" ({doc.get('host')})", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the servers and requests
def stream_request(base: str, input_ids: Sequence[int], max_new: int, timeout: float) -> RequestRecord:
    body = {"input_ids": list(input_ids), "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
    req = urllib.request.Request(base + "/generate", json.dumps(body).encode(), {"content-type": "application/json"})
    rec = RequestRecord(sent=time.perf_counter())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for ev in parse_sse(resp):
                now = time.perf_counter()
                if "error" in ev:
                    rec.error = f"server error: {str(ev['error'])[:300]}"
                    break
                rec.chunks.append((now, event_tokens(ev)))
                rec.meta = ev.get("meta_info") or rec.meta
    except Exception as e:  # noqa: BLE001 - a failed request is counted in the level, not fatal
        rec.error = f"{type(e).__name__}: {e}"
    rec.done = time.perf_counter()
    if rec.error is None and rec.tokens != max_new:
        rec.error = f"{rec.tokens} tokens streamed, {max_new} asked"
    return rec


# The JIT caches a deployed service keeps per release under its CacheDirectory (the contract's JIT_CACHE_ENV:
# Triton, FlashInfer, SGLang's own and DeepGEMM's, torch inductor's) and the default caches' XDG_CACHE_HOME, here
# under one root a run owns.
JIT_CACHE_ENV = contract.JIT_CACHE_ENV + (contract.XDG_CACHE_ENV,)


def jit_cache_env(root: str) -> Dict[str, str]:
    """Every JIT cache of a server under ``root`` (empty at first: a cold start; kept: a warm one)."""
    return {k: os.path.join(root, sub) for k, sub in JIT_CACHE_ENV}


def jit_cache_mib(env: Dict[str, str]) -> float:
    """MiB of files in a server's JIT caches (``env``'s :data:`JIT_CACHE_ENV` folders) before it starts."""
    total, seen = 0, set()
    for k, _sub in JIT_CACHE_ENV:
        top = env.get(k)
        if not top or top in seen or not os.path.isdir(top):
            continue
        seen.add(top)
        for root, _dirs, files in os.walk(top):
            for f in files:
                try:
                    st = os.lstat(os.path.join(root, f))
                except OSError:
                    continue
                if not os.path.islink(os.path.join(root, f)):
                    total += st.st_size
    return round(total / 2 ** 20, 1)


def first_request_figures(rec: "RequestRecord", start_s: float) -> dict:
    """One request's figures for the cold/warm comparison (ms; None where it failed)."""
    ttft = rec.ttft()
    total = None if rec.done is None else rec.done - rec.sent
    return {"server_start_s": round(start_s, 1), "ttft_ms": _ms(ttft), "total_ms": _ms(total),
            "tokens": rec.tokens, "error": rec.error}


def run_level(base: str, prompts: Sequence[Sequence[int]], max_new: int, concurrency: int, timeout: float):
    """Send every prompt with ``concurrency`` requests in flight; (records, wall seconds)."""
    t0 = time.perf_counter()
    out = map_concurrent(lambda _i, p: stream_request(base, p, max_new, timeout), list(prompts), concurrency)
    return [r for r in out if r is not None], time.perf_counter() - t0


def level_prompts(prompts: Sequence[Sequence[int]], requests: int, concurrency: int) -> List[Sequence[int]]:
    n = max(requests, concurrency)
    return [prompts[i % len(prompts)] for i in range(n)]


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for d in ("sglang", "sglang-ddtree", "sglang-ddtree-tools", "torch"):
        try:
            out[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            out[d] = None
    return out


def wait_gpu_released(gpu: int, baseline_mib: float, timeout: float = 90.0, slack_mib: float = 1024) -> float:
    """Wait until the GPU's used memory is back to ``baseline_mib`` (+ slack): the last server's processes may
    free their memory a moment after they are stopped, and the next server must start alone. Returns MiB used."""
    t0 = time.time()
    while True:
        used, _ = gpu_memory_mib(gpu)
        if used <= baseline_mib + slack_mib or time.time() - t0 > timeout:
            return used
        time.sleep(1)


class _Interrupted(BaseException):
    pass


def _on_sigterm(signum, frame):
    raise _Interrupted()


def median_round(levels_by_round: Sequence[dict]) -> dict:
    """One level's row over its rounds: the round with the median tok/s (the lower one of an even count, so each
    figure of the row comes from one real measurement), with ``tok_s_rounds`` (every round, in order) and
    ``tok_s_spread`` (max - min over the median, a fraction)."""
    rows_ = list(levels_by_round)
    if len(rows_) == 1:
        return rows_[0]
    order = sorted(range(len(rows_)), key=lambda i: rows_[i]["output_tok_s"])
    pick = dict(rows_[order[(len(rows_) - 1) // 2]])
    pick["round"] = order[(len(rows_) - 1) // 2]
    pick["tok_s_rounds"] = [r["output_tok_s"] for r in rows_]
    med = pick["output_tok_s"]
    pick["tok_s_spread"] = round((max(pick["tok_s_rounds"]) - min(pick["tok_s_rounds"])) / med, 4) if med else None
    # a round's errors are the level's: a request that failed in any round fails the level
    pick["errors"] = sum(r["errors"] for r in rows_)
    pick["first_error"] = next((r["first_error"] for r in rows_ if r.get("first_error")), None)
    return pick


def run_order(n: int, rnd: int) -> List[int]:
    """The order of the runs in round `rnd`: as asked in even rounds, reversed in odd ones (A B C, C B A, ...), so
    a drift of the host over the rounds (a warming machine, a neighbour's load) falls on every run alike instead of
    always favouring the one that runs first."""
    return list(range(n)) if rnd % 2 == 0 else list(range(n - 1, -1, -1))


def run_bench(a, runs: List[RunSpec], prompts: List[List[int]], target: str, drafter: Optional[str], workdir: str,
              logdir: str, doc: dict, log=print, save=lambda doc: None) -> None:
    """Start each run's server alone, measure every level, stop it; fills ``doc["runs"]`` as it goes and
    ``save``s it after each run (a run killed later still leaves what it measured).

    ``--rounds N``: the whole list N times over, every other round reversed (A B C, C B A, ...: :func:`run_order`),
    a fresh server each time, so host noise that lasts minutes or comes with a start (on a shared host, a server's
    processes land on other cores) is spread over every run alike; each level's row is its median round
    (:func:`median_round`), every round kept in ``entry["rounds"]`` (index = round), which
    :mod:`sglang_ddtree_tools.paired` pairs round by round. The profile and ``--cold-warm`` belong to the first round."""
    tcfg, dcfg = read_config(target), read_config(drafter)
    sizing = plan_sizing(prompts, a.max_new_tokens, a.concurrency, runs, tcfg, dcfg)
    weights = _weights_mib(target) + _weights_mib(drafter)
    doc["settings"]["sizing"] = asdict(sizing)
    extra = shlex.split(a.server_args or "")
    baseline, _ = gpu_memory_mib(a.gpu)
    rounds = max(1, int(getattr(a, "rounds", 1) or 1))
    entries: List[dict] = []
    for run in runs:
        entry = {"mode": run.mode, "budget": run.budget, "block": run.block, "draft_tokens": run.draft_tokens,
                 "graphs": run.graphs, "status": "failed", "error": None, "levels": []}
        if run.overlap is not None:
            entry["overlap"] = run.overlap
        entries.append(entry)
    for rnd in range(rounds):
        for k in run_order(len(runs), rnd):
            run = runs[k]
            if rnd == 0:  # round 0 runs them in order: the report's list is the order asked
                doc["runs"].append(entries[k])
            entry = entries[k]
            trial = entry if rnd == 0 else {"levels": [], "status": "failed", "error": None}
            tag = f" (round {rnd + 1}/{rounds})" if rounds > 1 else ""
            slug = f"{k:02d}-{run.mode}-{_slug(run.budget or run.block or 0)}-{'g' if run.graphs else 'e'}" + \
                {None: "", True: "-ov", False: "-sy"}[run.overlap] + (f"-r{rnd + 1}" if rnd else "")
            try:
                _one_server(a, run, rnd, trial, prompts, target, drafter, sizing, weights, extra, baseline, workdir,
                            logdir, slug, doc, f"[{k + 1}/{len(runs)}] {run.label}{tag}", log)
            finally:  # also when interrupted (a timeout's SIGTERM) while this server stops: what it measured stays
                if rounds > 1:  # the headline so far: a report saved mid-way holds the medians of the rounds done
                    kept = {key: trial.get(key) for key in ("status", "error", "start_s", "levels", "cpu_ms")}
                    if "spy" in trial:
                        kept["spy"] = trial["spy"]
                    entry.setdefault("rounds", []).append(kept)
                    _merge_rounds(entry)
                save(doc)


def _merge_rounds(entry: dict) -> None:
    """A run's headline rows from its rounds: per concurrency, the median round; failed if any round failed."""
    rounds = entry["rounds"]
    by_c: Dict[int, List[dict]] = {}
    for r in rounds:
        for lv in r.get("levels") or []:
            by_c.setdefault(lv["concurrency"], []).append(lv)
    # a level only some rounds measured still says so: its tok_s_rounds lists the rounds that did
    entry["levels"] = [median_round(v) if len(v) > 1 else dict(v[0], tok_s_rounds=[v[0]["output_tok_s"]])
                       for _, v in sorted(by_c.items())]
    bad = [r for r in rounds if r.get("status") != "ok"]
    entry["status"] = "failed" if bad else "ok"
    entry["error"] = None if not bad else f"round {rounds.index(bad[0]) + 1} of {len(rounds)}: {bad[0].get('error')}"


def _one_server(a, run: RunSpec, rnd: int, entry: dict, prompts, target, drafter, sizing, weights, extra,
                baseline, workdir, logdir, slug, doc, title, log) -> None:
    """One server of one round: start it alone, measure every level into ``entry`` (and in the first round the
    profile and the cold/warm figures), stop it."""
    used = wait_gpu_released(a.gpu, baseline)
    total = doc["gpu"]["memory_total_mib"]
    frac = a.mem_fraction if a.mem_fraction is not None else server_mem_fraction(used, total, weights, sizing.kv_mib + 4096)
    spec = spec_for(run, target, drafter, sizing, frac, extra)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = server_argv(a.python, spec, port)
    if rnd == 0:
        entry.update(server_argv=argv[1:], gpu_used_mib_before=used, mem_fraction=frac)
    env = server_env(spec, a.gpu, python=a.python, service=getattr(a, "service_env_vars", None))
    env.update(overlap_env(run.overlap))  # this server's scheduler, asked of the plugin (its validator still decides)
    cold_warm = a.cold_warm and rnd == 0
    if cold_warm:  # fresh, empty JIT caches for this run: its first start is cold, its restart warm
        cache_root = os.path.join(workdir, "jit-" + slug)
        env.update(jit_cache_env(cache_root))
        for d in jit_cache_env(cache_root).values():
            os.makedirs(d, exist_ok=True)
            if a.user:
                shutil.chown(d, user=a.user)
    spy_out = None
    run_argv, cpus = argv, a.cpus
    if getattr(a, "spy", None):  # the sampler is the server's parent, on the clients' CPUs; taskset pins the server
        spy_out = os.path.join(a.out or workdir, "spy", slug + ".txt")
        os.makedirs(os.path.dirname(spy_out), exist_ok=True)
        taskset = shutil.which("taskset") if a.cpus else None
        run_argv = spy_argv(a.spy, spy_out, a.spy_rate, a.cpus if taskset else None, taskset or "taskset") + list(argv)
        if a.cpus and not taskset:  # the sampler is pinned with the server (its few % of a CPU there)
            if rnd == 0:
                log("    --spy: no taskset here, py-spy runs on the servers' CPUs")
        else:
            cpus = None
    srv = Server(run_argv, env, os.path.join(logdir, slug + ".log"), launcher=a.launcher, cpus=cpus,
                 user=a.user, runtime_max_s=a.runtime_max, keep=env_keep(a),
                 unit=f"{a.unit_prefix}-{slug}" if a.unit_prefix else None)
    jit_mib = jit_cache_mib(env)  # 0: a cold start (every kernel compiled); more: its caches were kept or seeded
    if rnd == 0:
        entry.update(jit_cache_mib=jit_mib)
    log(f"{title}: starting ({used:.0f} of {total:.0f} MiB in use on GPU {a.gpu}; JIT caches "
        + (f"warm, {jit_mib:.0f} MiB)" if jit_mib else "cold)"))
    # each CPU's speed with nothing of this bench running (hostload: a host-bound step is as fast as its CPU)
    speeds = cpu_speeds()
    entry["cpu_ms"] = {"before": _keyed(speeds)}
    log(f"    {speed_line(speeds, 'before start')}")
    try:
        srv.start()
        entry["start_s"] = round(wait_healthy(base, srv, a.start_timeout), 1)
        if rnd == 0:
            try:
                info = get(base + "/server_info")
                entry["algorithm"] = info.get("speculative_algorithm") or (info.get("server_args") or {}).get(
                    "speculative_algorithm")
                entry["overlap_schedule"] = server_overlap(info)
                log(f"    scheduler: {scheduler_name(entry['overlap_schedule'])}")
            except Exception:  # noqa: BLE001 - informative only
                entry["algorithm"] = None
        if cold_warm:  # before any warm-up: the first request a cold server gets, then the next one
            fr = entry["first_request"] = {}
            fr["cold"] = first_request_figures(stream_request(base, prompts[0], a.max_new_tokens,
                                                              a.request_timeout), entry["start_s"])
            fr["cold_second"] = first_request_figures(stream_request(base, prompts[0], a.max_new_tokens,
                                                                     a.request_timeout), entry["start_s"])
            log(f"    first request, cold caches: {fr['cold']}; the next: {fr['cold_second']}")
        for c in a.concurrency:
            if a.warmup_tokens:
                run_level(base, level_prompts(prompts, c, c), a.warmup_tokens, c, a.request_timeout)
            watch = LevelWatch(srv.pids)  # the host's CPUs and the server's processes over the level
            recs, wall = run_level(base, level_prompts(prompts, a.requests, c), a.max_new_tokens, c,
                                   a.request_timeout)
            row = aggregate_level(recs, wall, c)
            host = watch.done(wall)
            if host:
                cpu_ms = sched_cpu_ms(host, speeds)
                if cpu_ms is not None:
                    host["sched_cpu_ms"] = cpu_ms
                row["host"] = host
            entry["levels"].append(row)
            log(f"    c={c}: {row['output_tok_s']} tok/s, accept {row['accept_length']}, "
                f"ttft p50 {row['ttft_ms']['p50']} ms, itl p50 {row['itl_ms']['p50']} ms, "
                f"step p50 {row['step_ms']['p50']} ms"
                + (f", {row['errors']} errors ({row['first_error']})" if row["errors"] else ""))
            if host:
                log(f"      {host_line(host)}")
        if a.profile_steps and rnd == 0:
            # with --out the raw trace stays beside the report (the summary says what; the trace says where)
            _profile_run(a, entry, base, prompts,
                         os.path.join(a.out, "profiles", slug) if a.out else os.path.join(workdir, "prof-" + slug),
                         log)
        failed = [lv for lv in entry["levels"] if lv["errors"]]
        entry["status"] = "failed" if failed else "ok"
        if failed:
            entry["error"] = f"{sum(lv['errors'] for lv in failed)} requests failed: {failed[0]['first_error']}"
    except (Exception, KeyboardInterrupt, _Interrupted) as e:
        if isinstance(e, Exception):
            entry["error"] = f"{type(e).__name__}: {e}"[:4000]
            log(f"    FAILED: {entry['error'].splitlines()[0][:300]}")
        else:
            entry["error"] = "interrupted"
            raise
    finally:
        if spy_out:
            srv.stop_wrapped()  # the server first: py-spy writes its capture when its target exits
        srv.stop()
    after = cpu_speeds()
    entry["cpu_ms"]["after"] = _keyed(after)
    log(f"    {speed_line(after, 'after stop')}")
    if spy_out:
        _spy_report(entry, spy_out, log)
    if cold_warm and entry["status"] == "ok":
        _warm_restart(a, entry, argv, env, prompts, logdir, slug, log, baseline)


def _keyed(speeds: Optional[Dict[int, float]]) -> Optional[Dict[str, float]]:
    """A CPU-speed reading as JSON keeps it (CPU numbers as strings)."""
    return None if speeds is None else {str(k): v for k, v in sorted(speeds.items())}


def decode_steps(levels: Sequence[dict]) -> Optional[float]:
    """Decode steps the measured levels took, from their tokens and accept lengths (1 a step without one)."""
    total = 0.0
    for lv in levels:
        acc = lv.get("accept_length") or 1.0
        total += (lv.get("output_tokens") or 0) / max(float(acc), 1e-9)
    return round(total, 1) if total else None


def _spy_report(entry: dict, path: str, log) -> None:
    """The py-spy capture of one server, summarized into ``entry["spy"]`` (a failure is reported, not fatal)."""
    try:
        with open(path, errors="replace") as fh:
            text = fh.read()
        s = summarize(text, steps=decode_steps(entry.get("levels") or []),
                      marks=("run_batch", "process_batch_result", "get_next_batch_to_run", "recv_requests",
                             "forward_batch_generation", "_forward_tree_verify", "_tree_draft", "_tree_verify",
                             "_tree_commit", "prepare_for_verify"))
        s["capture"] = os.path.basename(path)
        entry["spy"] = s
        log("    " + format_summary(s, 20).replace("\n", "\n    "))
    except (OSError, ValueError) as e:
        entry["spy_error"] = f"{type(e).__name__}: {e}"[:1000]
        log(f"    spy FAILED: {entry['spy_error'][:300]}")


def server_overlap(info: dict) -> Optional[bool]:
    """Whether the server runs SGLang's overlap scheduler, from its /server_info (its resolved
    ``disable_overlap_schedule``; None where it does not say). DFLASH and plain servers run it by default; DDTREE
    where its validator keeps it (the plugin's ``config.overlap_decision``)."""
    for src in (info, info.get("server_args") if isinstance(info.get("server_args"), dict) else {}):
        v = src.get("disable_overlap_schedule")
        if isinstance(v, bool):
            return not v
    return None


def scheduler_name(overlap: Optional[bool]) -> str:
    return {True: "overlap", False: "synchronous", None: "unknown"}[overlap]


def profile_line(p: dict) -> str:
    """One log line of a step profile: per step, the GPU's busy time against the span, launches, syncs, the
    plugin's phases (host ms / GPU ms) where the server has them, and the heaviest kernels."""
    t = p.get("totals_per_step") or {}
    at = f"at {p['concurrency']} requests, " if int(p.get("concurrency", 1)) > 1 else ""
    parts = [f"{at}per step: span {t.get('span_ms', 0):.3f} ms, GPU busy {t.get('gpu_ms', 0):.3f} ms, "
             f"{t.get('launches', 0):.0f} launches ({t.get('graph_launches', 0):.1f} graphs), {t.get('syncs', 0):.1f} syncs"
             + (f" ({t['runtime_syncs']:.1f} GPU waits, {t.get('item_calls', 0):.1f} .item() of which "
                f"{t.get('host_items', 0):.1f} on host tensors)" if "runtime_syncs" in t else "")]
    for name in ("ddtree.draft", "ddtree.tree_verify", "ddtree.verify_forward", "ddtree.accept", "ddtree.commit",
                 "ddtree.commit_recurrent_state", "ddtree.commit_draft_kv"):
        ps = ((p.get("ranges") or {}).get(name) or {}).get("per_step")
        if ps:
            parts.append(f"{name[7:]} {ps['host_ms']:.2f}/{ps['gpu_ms']:.3f} ms {ps['launches']:.0f}L")
    ks = p.get("kernels") or []
    parts.append("top: " + ", ".join(f"{k['name'][:48]} {k.get('per_step_us', 0):.0f}us" for k in ks[:6]))
    hf = [f for f in p.get("host_frames") or [] if "per_step_ms" in f]
    if hf:
        parts.append("host: " + ", ".join(f"{f['frame'][-56:]} {f['per_step_ms']:.2f} ms" for f in hf[:4]))
    ws = p.get("wait_sites") or []
    if ws:
        parts.append("waits at: " + ", ".join(f"{w['site'][-60:]} x{w.get('per_step', w['waits'])}" for w in ws[:4]))
    return "; ".join(parts)


def _profile_run(a, entry: dict, base: str, prompts, out_dir: str, log) -> None:
    """A torch-profiler trace of ``--profile-steps`` decode steps at ``--profile-concurrency`` requests in flight
    (SGLang's /start_profile),
    summarized into ``entry["profile"]`` (:mod:`sglang_ddtree_tools.profile_step`); a failure is reported, not fatal."""
    from .profile_step import profile_server

    try:
        os.makedirs(out_dir, exist_ok=True)
        if a.user:  # the server writes the trace, as that user
            shutil.chown(out_dir, user=a.user)
        entry["profile"] = profile_server(base, out_dir, a.profile_steps, prompts[0],
                                          max_new=a.max_new_tokens, concurrency=a.profile_concurrency,
                                          timeout=a.request_timeout)
        entry["profile"]["concurrency"] = a.profile_concurrency
        log("    profile " + profile_line(entry["profile"]))
    except Exception as e:  # noqa: BLE001 - the measured levels stand
        entry["profile_error"] = f"{type(e).__name__}: {e}"[:1000]
        log(f"    profile FAILED: {entry['profile_error'][:300]}")


def env_keep(a) -> tuple:
    """The service environment's names a transient unit keeps (``--service-env``)."""
    return tuple(getattr(a, "service_env_vars", None) or ())


def _warm_restart(a, entry: dict, argv, env, prompts, logdir: str, slug: str, log, baseline: float) -> None:
    """The same server again with the caches its first start filled: its first request is the warm one."""
    port = free_port()
    argv = list(argv)
    argv[argv.index("--port") + 1] = str(port)
    base = f"http://127.0.0.1:{port}"
    wait_gpu_released(a.gpu, baseline)
    srv = Server(argv, env, os.path.join(logdir, slug + "-warm.log"), launcher=a.launcher, cpus=a.cpus, user=a.user,
                 runtime_max_s=a.runtime_max, keep=env_keep(a),
                 unit=f"{a.unit_prefix}-{slug}-warm" if a.unit_prefix else None)
    try:
        srv.start()
        start = wait_healthy(base, srv, a.start_timeout)
        fr = entry["first_request"]
        fr["warm"] = first_request_figures(stream_request(base, prompts[0], a.max_new_tokens, a.request_timeout),
                                           start)
        fr["warm_second"] = first_request_figures(stream_request(base, prompts[0], a.max_new_tokens,
                                                                 a.request_timeout), start)
        log(f"    first request, warm caches (restarted): {fr['warm']}; the next: {fr['warm_second']}")
    except Exception as e:  # noqa: BLE001 - the cold figures and the levels stand; say what failed
        entry.setdefault("first_request", {})["warm_error"] = f"{type(e).__name__}: {e}"[:1000]
        log(f"    warm restart FAILED: {entry['first_request']['warm_error'][:300]}")
    finally:
        srv.stop()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree_tools.bench", description=__doc__.split("\n")[0],
                                 epilog="Each server starts alone on the GPU and is always stopped.")
    src = ap.add_argument_group("models (one of)")
    src.add_argument("--model", help="target model directory")
    src.add_argument("--draft-model", help="DFlash drafter directory (needed by every mode but plain)")
    src.add_argument("--tiny", metavar="DIR", help="a tiny pair: DIR/FAMILY/{target,drafter} or DIR/FAMILY-{target,drafter}")
    src.add_argument("--tiny-random", action="store_true", help="write sglang_ddtree_tools.tiny's random pair and use it")
    src.add_argument("--tiny-train", action="store_true",
                     help="train the pair here first (python -m sglang_ddtree_tools.trainkit, seed --seed) and use it")
    src.add_argument("--family", choices=FAMILIES, default="hybrid", help="with --tiny/--tiny-random (default hybrid)")
    ap.add_argument("--modes", default="plain,dflash,tree-verify", help="comma list of " + ", ".join(BENCH_MODES))
    ap.add_argument("--budgets", default="15",
                    help="DDTREE budgets B, comma list (tree-verify: D = B + 1); budget schedules (tree-verify) "
                         "separated by ';': '31; 1:127,4:31,64:chain'")
    ap.add_argument("--block", type=int, help="DFLASH chain block (default: the drafter's block_size, else 8)")
    ap.add_argument("--graphs", choices=tuple(GRAPHS), default="off", help="CUDA graphs on, off or both (default off)")
    ap.add_argument("--overlap", choices=tuple(OVERLAP_CHOICES), default="default",
                    help="tree-verify servers on SGLang's overlap scheduler (on), the synchronous one (off), one of "
                         "each in every round (both: paired against the same DFLASH server), or as "
                         f"{OVERLAP_ENV} is set here (default)")
    ap.add_argument("--concurrency", default="1,4,16", help="comma list of concurrent requests (default 1,4,16)")
    ap.add_argument("--prompts", help="JSON/JSONL file of token-id prompts")
    ap.add_argument("--num-prompts", type=int, default=32, help="random prompts when no file (default 32)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens of each random prompt (default 64)")
    ap.add_argument("--seed", type=int, default=1, help="seed of random prompts and of --tiny-random")
    ap.add_argument("--requests", type=int, help="requests a level (default: the number of prompts; at least c)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=16, help="tokens of each warm-up request (0: none)")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="measure the whole list N times over (A B C, C B A, ...), a fresh server each time; each "
                         "level reports its median round and every round's tok/s, and the paired ratios to DFLASH "
                         "and plain round by round (default 1)")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="after each server's levels, profile N decode steps at one request (torch profiler via "
                         "SGLang's /start_profile) and keep the summary: per-step GPU time, launches, syncs, "
                         "the plugin's phases, the heaviest kernels (default 0: no profile); with --out the "
                         "traces are kept in OUT/profiles/")
    ap.add_argument("--profile-concurrency", type=int, default=1, metavar="C",
                    help="requests in flight while --profile-steps profiles (default 1): a step's cost at a "
                         "batch size is profiled at that batch size")
    ap.add_argument("--cold-warm", action="store_true",
                    help="each server starts with empty JIT caches (Triton, FlashInfer, SGLang): time its first "
                         "request, then restart it on the filled caches and time the first request again")
    ap.add_argument("--server-args", default="", help="extra server arguments for every server (one string)")
    ap.add_argument("--mem-fraction", type=float, help="--mem-fraction-static (default: sized to the weights and pools)")
    ap.add_argument("--launcher", choices=("auto", "systemd-run", "process"), default="auto")
    ap.add_argument("--cpus", metavar="LIST",
                    help="pin every server to these CPUs (0-3,8; AllowedCPUs= of its unit, or its processes' "
                         "affinity) and this process, the clients, to the others it may use: a host-bound step's "
                         "speed then does not depend on where the kernel put the server or whom it shares a core "
                         "with (on the H200 one DDTREE server ran 1188 tok/s, the next 1869, same code)")
    ap.add_argument("--spy", metavar="PY_SPY",
                    help="start every server under this py-spy (record --nonblocking --subprocesses, raw) and "
                         "report where its scheduler's host time goes, per function and per decode step "
                         "(sglang_ddtree_tools.spy; raw captures in OUT/spy/); with --launcher process; replaces "
                         "--profile-steps, whose profiler would be sampled too")
    ap.add_argument("--spy-rate", type=int, default=1000, help="py-spy samples a second (default 1000: 1 ms each)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter SGLang runs from (default this one)")
    ap.add_argument("--user", help="run the servers as this user (systemd-run --uid)")
    ap.add_argument("--service-env", help="a JSON file of the GPU's service environment: the servers run with it")
    ap.add_argument("--unit-prefix", help="name the transient units <prefix>-<run> (so a caller can stop them all)")
    ap.add_argument("--runtime-max", type=int, default=1800, help="RuntimeMaxSec of each transient unit")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--json", help="write the report here (- for stdout)")
    ap.add_argument("--plot", help="write the PNG plot here")
    ap.add_argument("--out", help="directory for bench.json, bench.png and the server logs")
    return ap


def parse_args(argv=None):
    """Parse and check the command line; raises SystemExit(2) with argparse's message on a bad one."""
    ap = _parser()
    a = ap.parse_args(argv)
    try:
        a.modes = parse_modes(a.modes)
        a.budgets = parse_budget_list(a.budgets, "--budgets")
        if any(type(b) is not int for b in a.budgets) and set(a.modes) & set(BUDGETED) - {TREE_VERIFY}:
            raise ValueError("--budgets: a schedule is served by tree-verify only; shadow-linear takes budgets")
        a.concurrency = parse_int_list(a.concurrency, "--concurrency", 1, 1024)
        shlex.split(a.server_args or "")
    except ValueError as e:
        ap.error(str(e))
    given = sum(bool(x) for x in (a.model, a.tiny, a.tiny_random, a.tiny_train))
    if given != 1:
        ap.error("give exactly one of --model, --tiny DIR, --tiny-random, --tiny-train")
    if a.model and a.draft_model is None and a.modes != [PLAIN]:
        ap.error("--draft-model is needed by " + ", ".join(m for m in a.modes if m != PLAIN))
    for k in ("num_prompts", "prompt_len", "max_new_tokens"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be at least 1")
    if a.requests is not None and a.requests < 1:
        ap.error("--requests must be at least 1")
    if a.warmup_tokens < 0:
        ap.error("--warmup-tokens must be 0 or more")
    if not 1 <= a.profile_concurrency <= 1024:
        ap.error("--profile-concurrency must be 1 to 1024")
    if not 1 <= a.rounds <= 20:
        ap.error("--rounds must be 1 to 20")
    if a.spy:
        if a.launcher != "process":
            ap.error("--spy needs --launcher process (the sampler is the server's parent)")
        if not (os.path.isfile(a.spy) and os.access(a.spy, os.X_OK)):
            ap.error(f"--spy {a.spy}: not an executable file")
        if not 1 <= a.spy_rate <= 10000:
            ap.error("--spy-rate must be 1 to 10000")
        a.profile_steps = 0
    a.client_cpus = None
    if a.cpus is not None:
        try:
            a.cpus = parse_cpus(a.cpus)
            a.client_cpus = pin_clients(a.cpus)
        except ValueError as e:
            ap.error(f"--cpus: {e}")
    try:
        a.service_env_vars = load_service_env(a.service_env)
    except (OSError, ValueError) as e:
        ap.error(f"--service-env: {e}")
    return a


def pin_clients(server_cpus, allowed=None):
    """The CPUs this process (the load generator) keeps when the servers get ``server_cpus``: the rest of what it
    may use (``allowed``, default its current affinity). Raises ValueError when the servers would take CPUs this
    process may not use, or all of them."""
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    outside = sorted(set(server_cpus) - set(allowed))
    if outside:
        raise ValueError(f"--cpus {cpu_list(server_cpus)}: CPUs {cpu_list(outside)} are not among this host's "
                         f"usable ones ({cpu_list(allowed)})")
    rest = sorted(set(allowed) - set(server_cpus))
    if not rest:
        raise ValueError(f"--cpus {cpu_list(server_cpus)} leaves no CPU for the clients (usable: {cpu_list(allowed)})")
    return rest


def _write_json(doc: dict, dest: Optional[str]) -> None:
    if not dest:
        return
    text = json.dumps(doc, indent=1) + "\n"
    if dest == "-":
        sys.stdout.write(text)
        return
    tmp = dest + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, dest)


def main(argv=None) -> int:
    a = parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        a.json = a.json or os.path.join(a.out, "bench.json")
        a.plot = a.plot or os.path.join(a.out, "bench.png")
    doc = {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "host": socket.gethostname(), "ok": False, "versions": _versions(), "gpu": {"index": a.gpu},
           "model": {}, "settings": {}, "runs": []}
    problem = gpu_device_problem(a.gpu)
    if problem:
        log(f"bench: cannot run: {problem}")
        doc["cannot_run"] = problem
        _write_json(doc, a.json)
        return EXIT_CANNOT_RUN
    if a.cpus:
        os.sched_setaffinity(0, a.client_cpus)  # the clients' threads inherit it
        log(f"bench: servers on CPUs {cpu_list(a.cpus)}, clients on {cpu_list(a.client_cpus)}")
    workdir = tempfile.mkdtemp(prefix="ddtree-bench-")  # 0700: private to this run
    if a.user:
        shutil.chown(workdir, user=a.user)  # the servers (run as the user) read the models and write their logs
    logdir = os.path.join(a.out, "logs") if a.out else workdir
    os.makedirs(logdir, exist_ok=True)
    if a.user and logdir != workdir:
        shutil.chown(logdir, user=a.user)
    old = signal.signal(signal.SIGTERM, _on_sigterm)
    code, train_s = EXIT_FAILED, None
    try:
        if a.tiny_random:
            from . import tiny

            paths = tiny.write_family(workdir, a.family, seed=a.seed)
            target, drafter, source, tiny_prompts = paths["target"], paths["drafter"], "tiny-random", None
        elif a.tiny or a.tiny_train:
            if a.tiny_train:
                import subprocess

                probe = [a.python, "-c", "import importlib.util as u, sys; "
                         "sys.exit(u.find_spec('sglang_ddtree_tools.trainkit') is None)"]
                if subprocess.run(probe, timeout=120).returncode != 0:  # the interpreter the kit would run under
                    raise RuntimeError("this plugin has no sglang_ddtree_tools.trainkit (the training kit): --tiny-train "
                                       "needs a plugin that ships it; use --tiny DIR or --tiny-random")
                out = os.path.join(workdir, "tiny")
                argv = trainkit_argv(a.python, out, a.family, a.seed)
                log(f"bench: training the tiny {a.family} pair on GPU {a.gpu} (seed {a.seed}): {' '.join(argv)}")
                t0 = time.time()
                # not the servers' JIT caches (another user's directories, where the host agent seeded them)
                env = {k: v for k, v in os.environ.items() if k not in dict(JIT_CACHE_ENV)}
                env.update(CUDA_VISIBLE_DEVICES=str(a.gpu), PYTHONUNBUFFERED="1")
                try:  # the kit's progress goes where ours goes (stderr), never into the table on stdout
                    kit_out = sys.stderr.fileno()
                except (AttributeError, ValueError, OSError):
                    kit_out = subprocess.DEVNULL
                r = subprocess.run(argv, stdout=kit_out, env=env, timeout=max(60, a.runtime_max))
                if r.returncode:
                    raise RuntimeError(f"the training kit exited {r.returncode}")
                train_s = round(time.time() - t0, 1)
                if a.user:
                    for dirpath, _, files in os.walk(out):
                        shutil.chown(dirpath, user=a.user)
                        for f in files:
                            shutil.chown(os.path.join(dirpath, f), user=a.user)
            got = resolve_tiny(a.tiny or os.path.join(workdir, "tiny"), a.family)
            target, drafter, source, tiny_prompts = got["target"], got["drafter"], f"tiny-{got['kind']}", got["prompts"]
        else:
            target, drafter, source, tiny_prompts = a.model, a.draft_model, "model", None
        tcfg, dcfg = read_config(target), read_config(drafter)
        vocab = tcfg.get("vocab_size") if isinstance(tcfg.get("vocab_size"), int) else None
        pfile = a.prompts or tiny_prompts
        if pfile:
            prompts, psrc = load_prompts(pfile, vocab), pfile
        else:
            prompts, psrc = random_prompts(a.num_prompts, a.prompt_len, vocab or 32000, a.seed), "random"
        block = a.block or drafter_block(dcfg)
        runs = plan_runs(a.modes, a.budgets, a.graphs, block, a.overlap)
        used, total = gpu_memory_mib(a.gpu)
        doc["gpu"].update(name=gpu_name(a.gpu), memory_total_mib=total, memory_used_mib_at_start=used)
        doc["model"] = {"target": target, "drafter": drafter, "source": source,
                        "family": a.family if source.startswith("tiny") else ("hybrid" if is_hybrid(tcfg) else "dense"),
                        "architectures": tcfg.get("architectures")}
        doc["settings"] = {"modes": a.modes, "budgets": a.budgets, "block": block, "graphs": a.graphs,
                           "overlap": a.overlap,
                           "concurrency": a.concurrency, "max_new_tokens": a.max_new_tokens, "greedy": True,
                           "requests_per_level": {str(c): max(a.requests or len(prompts), c) for c in a.concurrency},
                           "warmup_tokens": a.warmup_tokens, "server_args": a.server_args,
                           "cold_warm": bool(a.cold_warm), "rounds": a.rounds,
                           "prompts": {"source": psrc, "count": len(prompts),
                                       "mean_len": round(sum(map(len, prompts)) / len(prompts), 1)},
                           "launcher": a.launcher, "tiny_train_s": train_s,
                           "server_cpus": cpu_list(a.cpus) if a.cpus else None,
                           # the plugin's own switches the servers inherit (glue level, overlap A/B, ...)
                           "ddtree_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_DDTREE_")}}
        a.requests = a.requests or len(prompts)
        log(f"bench: {len(runs)} server(s) one after another"
            + (f", {a.rounds} rounds over" if a.rounds > 1 else "") + f" on GPU {a.gpu} ({doc['gpu']['name']}), "
            f"concurrency {a.concurrency}, {a.max_new_tokens} new tokens, {len(prompts)} prompts ({psrc})")
        run_bench(a, runs, prompts, target, drafter, workdir, logdir, doc, log=log,
                  save=lambda d: _write_json(d, a.json) if a.json and a.json != "-" else None)
        doc["ok"] = all(r["status"] == "ok" for r in doc["runs"])
        code = EXIT_OK if doc["ok"] else EXIT_FAILED
    except (KeyboardInterrupt, _Interrupted):
        doc["interrupted"] = True
        log("bench: interrupted; servers stopped")
        code = EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - one clear line, non-zero exit, the report says it too
        doc["error"] = f"{type(e).__name__}: {e}"
        log(f"bench: {doc['error']}")
    finally:
        signal.signal(signal.SIGTERM, old)
        shutil.rmtree(workdir, ignore_errors=True)
    if (doc.get("settings") or {}).get("rounds", 1) > 1 and doc["runs"]:
        doc["paired"] = report_section(doc)
    bad = validate_report(doc)
    if bad:  # a bug here, not the host's: say so rather than write a report the control side will refuse
        doc["ok"], doc["error"] = False, "report fails its own schema: " + "; ".join(bad[:5])
        code = EXIT_FAILED
    _write_json(doc, a.json)
    if doc["runs"]:
        print(format_table(doc), flush=True)
        if doc.get("paired"):
            print("paired by round (each ratio: two servers one right after the other):\n"
                  + "\n".join(section_line(r) for r in doc["paired"]), flush=True)
    if a.plot and any(r.get("levels") for r in doc["runs"]):
        try:
            write_plot(doc, a.plot)
            log(f"bench: plot {a.plot}")
        except ImportError:
            log("bench: matplotlib is not installed here: no plot (fab bench plots from the JSON)")
    return code


if __name__ == "__main__":
    sys.exit(main())
