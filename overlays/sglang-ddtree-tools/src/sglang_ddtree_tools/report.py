"""The bench report, schema ``ddtree-bench/1``: what :mod:`sglang_ddtree_tools.bench` writes on a host and what
the control side (``fab bench``: ``deploy/bench.py``) reads back, in one module.

* the schema's names: :data:`SCHEMA`, the modes a report holds (:data:`BENCH_MODES`, ``linear`` = ``dflash``) and
  which of them take a budget (:data:`BUDGETED`);
* a run's name in tables, plots and paired comparisons (:func:`run_label`) and a failed run's reason on one line
  (:func:`failure_summary`);
* the host's own check of the report it is about to write (:func:`validate_report`: every problem listed);
* the control side's check of a report that crossed from a host (:func:`parse_report`): hostile input, checked
  whole with a bound on every size and number, and copied into a clean document holding only the fields kept
  (every string cut to size); :class:`BadReport` names each problem.

Pure and stdlib only, importing nothing of the plugin or of these tools: the control side loads this one file
from the checkout without the plugin, torch or SGLang.
"""
from __future__ import annotations

import math
import re
from typing import List, Optional

try:  # on a host: the serving plugin these tools depend on
    from sglang_ddtree import contract
except ImportError:  # the control side loads this file by path from a checkout: the contract beside it there
    import importlib.util as _util
    import os as _os
    _spec = _util.spec_from_file_location("sglang_ddtree_contract", _os.path.join(
        _os.path.dirname(_os.path.abspath(__file__)), "..", "..", "..", "sglang-ddtree", "src", "sglang_ddtree",
        "contract.py"))
    contract = _util.module_from_spec(_spec)
    _spec.loader.exec_module(contract)

SCHEMA = "ddtree-bench/1"
BENCH_MODES = contract.BENCH_MODES
MODE_ALIASES = contract.ALIASES
BUDGETED = contract.BUDGETED_MODES
MAX_RUNS, MAX_LEVELS, MAX_TEXT = 256, 64, 4000  # the control side's bounds on a host's report


# ----------------------------------------------------------------------------- names
def ran_overlap(run: dict) -> bool:
    """Whether a DDTREE run's server ran SGLang's overlap scheduler (what it said; where it said nothing, what the
    bench asked of it). DFLASH and plain run it by default and are not named by it."""
    ran = run.get("overlap_schedule")
    if not isinstance(ran, bool):
        ran = run.get("overlap")
    return run.get("mode") in BUDGETED and ran is True


def run_label(run: dict) -> str:
    """A report's run by name, as tables, plots and :mod:`sglang_ddtree_tools.paired` show it: with ``overlap`` where
    a DDTREE server ran SGLang's overlap scheduler (:func:`ran_overlap`)."""
    return name_run(run["mode"], run.get("budget"), run.get("block"), bool(run.get("graphs")), ran_overlap(run))


def name_run(mode: str, budget, block, graphs: bool, overlap) -> str:
    """The one way a bench run is named (bench's table and plot, paired's rows): only the overlap scheduler is
    named, so a DDTREE server without the word ran the synchronous one (the plugin's default) and reports from
    before bench's --overlap and after it pool under one name."""
    part = {contract.PLAIN: contract.PLAIN, contract.DFLASH: f"{contract.DFLASH} blk={block}"}.get(
        mode, f"{mode} B={budget}")
    return f"{part}{' overlap' if overlap else ''} graphs={'on' if graphs else 'off'}"


def parse_modes(text, what: str = "modes") -> List[str]:
    """``"plain,dflash,tree-verify"`` -> modes in the order given (``linear`` is ``dflash``), unique; ValueError
    names the word. One parser for the tools' bench and `fab bench` (`what`: the option's name in the message)."""
    out: List[str] = []
    for word in (w.strip() for w in str(text).split(",")):
        if not word:
            continue
        mode = contract.bench_name(word)
        if mode not in BENCH_MODES:
            raise ValueError(f"mode {word!r}: choose from {', '.join(BENCH_MODES)} (linear = dflash)")
        if mode not in out:
            out.append(mode)
    if not out:
        raise ValueError(f"{what}: give at least one")
    return out


def failure_summary(error) -> str:
    """A failed run's reason on one line: its first line, which names the cause where the server's log had an
    exception (servers.failure_line), and the log's last line when the first does not already end with it."""
    lines = [ln.strip() for ln in str(error or "failed").splitlines() if ln.strip()] or ["failed"]
    text = lines[0] if len(lines) == 1 or lines[0].endswith(lines[-1]) else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def parse_budget_list(text, what: str = "budgets") -> list:
    """``--budgets`` text -> the budgets to serve: plain node budgets (``"15,31,63"``: sorted, unique) and budget
    schedules (``contract``'s *Budget schedule*), each as its canonical text, after them in the order given.
    A schedule holds commas of its own, so where the text holds a schedule (a ``:``) or a ``;``, the items are
    separated by ``;`` or whitespace instead: ``"31; 1:127,4:31,64:chain"``. ValueError names the item."""
    text = str(text)
    items = re.split(r"[;\s]+", text) if (":" in text or ";" in text) else text.split(",")
    ints: List[int] = []
    schedules: List[str] = []
    for word in (w.strip() for w in items):
        if not word:
            continue
        if problem := contract.budget_problem(word if ":" in word else _int_or(word), contract.TREE_VERIFY):
            raise ValueError(f"{what}: {word!r} {problem}")
        b = contract.parse_budget(word if ":" in word else int(word))
        if type(b) is int:
            ints.append(b)
        elif str(b) not in schedules:
            schedules.append(str(b))
    if not ints and not schedules:
        raise ValueError(f"{what}: give at least one budget or schedule")
    return sorted(set(ints)) + schedules


def _int_or(word: str):
    try:
        return int(word)
    except ValueError:
        return word


# ----------------------------------------------------------------------------- the host's check
def _is_num(v, allow_none=True) -> bool:
    if v is None:
        return allow_none
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def _bad_cpu_ms(v) -> Optional[str]:
    """What is wrong with a run's ``cpu_ms`` ({"before", "after"}: each null or {cpu digits: ms}); None: fine or
    absent (reports from before it)."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) - {"before", "after"}:
        return "must be {before, after}"
    for when, speeds in v.items():
        if speeds is not None and not (isinstance(speeds, dict) and all(
                isinstance(c, str) and c.isdigit() and _is_num(ms, allow_none=False) for c, ms in speeds.items())):
            return f"{when} must be null or {{CPU number: ms}}"
    return None


def validate_report(doc) -> List[str]:
    """What is wrong with a report (empty when it is a well-formed ``ddtree-bench/1`` document)."""
    if not isinstance(doc, dict):
        return ["the report is not a JSON object"]
    errs = []
    if doc.get("schema") != SCHEMA:
        errs.append(f"schema is {doc.get('schema')!r}, not {SCHEMA!r}")
    for k in ("model", "settings", "gpu"):
        if not isinstance(doc.get(k), dict):
            errs.append(f"{k} is not an object")
    runs = doc.get("runs")
    if not isinstance(runs, list):
        return errs + ["runs is not a list"]
    for i, run in enumerate(runs):
        where = f"runs[{i}]"
        if not isinstance(run, dict):
            errs.append(f"{where} is not an object")
            continue
        if run.get("mode") not in BENCH_MODES:
            errs.append(f"{where}.mode {run.get('mode')!r} is not one of {BENCH_MODES}")
        if run.get("mode") in BUDGETED and not (type(run.get("budget")) is int and run["budget"] > 0) and not (
                run.get("mode") == contract.TREE_VERIFY and isinstance(run.get("budget"), str)
                and not contract.budget_problem(run["budget"], contract.TREE_VERIFY)):
            errs.append(f"{where}.budget must be a positive integer (tree-verify: or a budget schedule's text)")
        if not isinstance(run.get("graphs"), bool):
            errs.append(f"{where}.graphs must be true or false")
        if run.get("status") not in ("ok", "failed"):
            errs.append(f"{where}.status must be ok or failed")
        for k in ("overlap", "overlap_schedule"):
            if run.get(k) is not None and not isinstance(run.get(k), bool):
                errs.append(f"{where}.{k} must be true, false or null")
        for k, trial in [("", run)] + [(f".rounds[{r}]", t) for r, t in enumerate(run.get("rounds") or [])
                                        if isinstance(t, dict)]:
            bad = _bad_cpu_ms(trial.get("cpu_ms"))
            if bad:
                errs.append(f"{where}{k}.cpu_ms {bad}")
        levels = run.get("levels")
        if not isinstance(levels, list):
            errs.append(f"{where}.levels is not a list")
            continue
        for j, lv in enumerate(levels):
            w = f"{where}.levels[{j}]"
            if not isinstance(lv, dict):
                errs.append(f"{w} is not an object")
                continue
            for k in ("concurrency", "requests", "errors", "output_tokens"):
                if type(lv.get(k)) is not int or lv[k] < 0:
                    errs.append(f"{w}.{k} must be a non-negative integer")
            for k in ("output_tok_s", "wall_s"):
                if not _is_num(lv.get(k), allow_none=False):
                    errs.append(f"{w}.{k} must be a non-negative number")
            if not _is_num(lv.get("accept_length")):
                errs.append(f"{w}.accept_length must be a non-negative number or null")
            for k in ("ttft_ms", "itl_ms", "step_ms"):
                d = lv.get(k)
                if d is None and k == "step_ms":  # reports from before step_ms
                    continue
                if not (isinstance(d, dict) and _is_num(d.get("p50")) and _is_num(d.get("p99"))):
                    errs.append(f"{w}.{k} must be {{p50, p99}} of non-negative numbers or null")
            h = lv.get("host")
            if h is not None and not (isinstance(h, dict) and _is_num(h.get("busy_pct"), allow_none=False)
                                      and _is_num(h.get("steal_pct"), allow_none=False)
                                      and isinstance(h.get("procs"), list) and _is_num(h.get("sched_cpu_ms"))):
                errs.append(f"{w}.host must be {{busy_pct, steal_pct, procs[, sched_cpu_ms]}} (sglang_ddtree_tools.hostload)")
            tr = lv.get("tok_s_rounds")
            if tr is not None and not (isinstance(tr, list) and tr and all(_is_num(x, allow_none=False) for x in tr)):
                errs.append(f"{w}.tok_s_rounds must be a non-empty list of non-negative numbers")
    for i, r in enumerate(doc.get("paired") or []):  # --rounds: sglang_ddtree_tools.paired.report_section
        ok = isinstance(r, dict) and isinstance(r.get("run"), str) and isinstance(r.get("peer"), str) and \
            type(r.get("concurrency")) is int and type(r.get("n")) is int and r["n"] > 0 and \
            _is_num(r.get("median_ratio"), allow_none=False) and type(r.get("ahead")) is int and \
            isinstance(r.get("ratios"), list) and len(r["ratios"]) == r["n"] and \
            all(_is_num(x, allow_none=False) for x in r["ratios"]) and \
            (r.get("interval") is None or (isinstance(r["interval"], list) and len(r["interval"]) == 2
                                           and all(_is_num(x, allow_none=False) for x in r["interval"])))
        if not ok:
            errs.append(f"paired[{i}] is not a paired comparison (sglang_ddtree_tools.paired.report_section)")
    return errs


# ----------------------------------------------------------------------------- the control side's check
class BadReport(ValueError):
    """A report from a host that is not a well-formed ddtree-bench/1 document (every problem listed)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))


def _nonneg(v, allow_none=False) -> bool:
    if v is None:
        return allow_none
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e12


def clip(v, n=MAX_TEXT):
    """A host's string cut to `n` characters (None stays None)."""
    return None if v is None else str(v)[:n]


def parse_report(doc) -> dict:
    """A host's bench report, checked whole and copied into a clean document (only the fields kept, every string
    cut to size). Raises BadReport naming each problem."""
    p: list[str] = []
    if not isinstance(doc, dict):
        raise BadReport(["the report is not a JSON object"])
    if doc.get("schema") != SCHEMA:
        p.append(f"schema is {clip(doc.get('schema'), 60)!r}, not {SCHEMA!r}")
    runs = doc.get("runs")
    if not isinstance(runs, list) or len(runs) > MAX_RUNS:
        raise BadReport(p + [f"runs must be a list of at most {MAX_RUNS}"])
    out_runs = []
    for i, r in enumerate(runs):
        w = f"runs[{i}]"
        if not isinstance(r, dict):
            p.append(f"{w} is not an object")
            continue
        mode, budget, block, graphs = r.get("mode"), r.get("budget"), r.get("block"), r.get("graphs")
        if mode not in BENCH_MODES:
            p.append(f"{w}.mode {clip(mode, 40)!r} is not one of {', '.join(BENCH_MODES)}")
        if mode in BUDGETED and (problem := contract.budget_problem(
                clip(budget, 200) if isinstance(budget, str) else budget, mode)):
            p.append(f"{w}.budget {problem}")
        if block is not None and not (type(block) is int and 1 <= block <= 1024):
            p.append(f"{w}.block must be an integer or null")
        if not isinstance(graphs, bool):
            p.append(f"{w}.graphs must be true or false")
        if r.get("status") not in ("ok", "failed"):
            p.append(f"{w}.status must be ok or failed")
        for k in ("overlap", "overlap_schedule"):  # asked of the plugin / what the server said it ran
            if r.get(k) is not None and not isinstance(r.get(k), bool):
                p.append(f"{w}.{k} must be true, false or null")
        levels = r.get("levels")
        if not isinstance(levels, list) or len(levels) > MAX_LEVELS:
            p.append(f"{w}.levels must be a list of at most {MAX_LEVELS}")
            continue
        out_levels = []
        for j, lv in enumerate(levels):
            lw = f"{w}.levels[{j}]"
            if not isinstance(lv, dict):
                p.append(f"{lw} is not an object")
                continue
            bad = [k for k in ("concurrency", "requests", "errors", "output_tokens")
                   if not (type(lv.get(k)) is int and 0 <= lv[k] < 10 ** 9)]
            bad += [k for k in ("output_tok_s", "wall_s") if not _nonneg(lv.get(k))]
            bad += [k for k in ("accept_length",) if not _nonneg(lv.get(k), allow_none=True)]
            for k in ("ttft_ms", "itl_ms", "step_ms"):
                d = lv.get(k)
                if d is None and k == "step_ms":  # reports of plugins from before it
                    continue
                if not (isinstance(d, dict) and _nonneg(d.get("p50"), True) and _nonneg(d.get("p99"), True)):
                    bad.append(k)
            if lv.get("concurrency") == 0:
                bad.append("concurrency")
            if bad:
                p.append(f"{lw}: {', '.join(sorted(set(bad)))} out of range or of the wrong type")
                continue
            tr = lv.get("tok_s_rounds")
            if tr is not None and not (isinstance(tr, list) and 1 <= len(tr) <= 20 and all(map(_nonneg, tr))):
                p.append(f"{lw}.tok_s_rounds must be a list of 1-20 non-negative numbers")
                continue
            out_levels.append({k: lv[k] for k in ("concurrency", "requests", "errors", "output_tokens", "output_tok_s",
                                                  "wall_s", "accept_length")}
                              | {k: {"p50": lv[k]["p50"], "p99": lv[k]["p99"]} for k in ("ttft_ms", "itl_ms")}
                              | ({"step_ms": {"p50": lv["step_ms"]["p50"], "p99": lv["step_ms"]["p99"]}}
                                 if lv.get("step_ms") is not None else {})
                              | {"first_error": clip(lv.get("first_error"), 300)}
                              | ({"tok_s_rounds": list(tr)} if tr is not None else {}))
        if isinstance(budget, str) and mode in BUDGETED and not p:  # a schedule: its canonical text
            budget = contract.budget_text(budget)
        out_runs.append({"mode": mode, "budget": budget if mode in BUDGETED else None,
                         "block": block, "graphs": graphs, "status": r.get("status"), "error": clip(r.get("error")),
                         "levels": out_levels}
                        | {k: r[k] for k in ("overlap", "overlap_schedule") if isinstance(r.get(k), bool)}
                        # MiB in its JIT caches when its first server started (0: cold); absent from older tools
                        | ({"jit_cache_mib": r["jit_cache_mib"]} if _nonneg(r.get("jit_cache_mib")) else {}))
    paired = _parse_paired(doc.get("paired"), {run_label(r) for r in out_runs} if not p else set(), p)
    if p:
        raise BadReport(p)
    gpu = doc.get("gpu") if isinstance(doc.get("gpu"), dict) else {}
    vers = doc.get("versions") if isinstance(doc.get("versions"), dict) else {}
    st = doc.get("settings") if isinstance(doc.get("settings"), dict) else {}
    return {"schema": SCHEMA, "created": clip(doc.get("created"), 40), "ok": doc.get("ok") is True,
            "cannot_run": clip(doc.get("cannot_run")), "error": clip(doc.get("error")),
            "interrupted": doc.get("interrupted") is True,
            "gpu": {"name": clip(gpu.get("name"), 100),
                    "memory_total_mib": gpu.get("memory_total_mib") if _nonneg(gpu.get("memory_total_mib")) else None,
                    "memory_used_mib_at_start": gpu.get("memory_used_mib_at_start")
                    if _nonneg(gpu.get("memory_used_mib_at_start")) else None},
            "versions": {k: clip(vers.get(k), 100) for k in ("sglang", "sglang-ddtree", "sglang-ddtree-tools", "torch")},
            "max_new_tokens": st.get("max_new_tokens") if type(st.get("max_new_tokens")) is int else None,
            "runs": out_runs, "paired": paired}


def _parse_paired(section, labels: set[str], p: list[str]) -> list[dict]:
    """A report's `paired` section (--rounds: each run against DFLASH and plain, round by round, as
    sglang_ddtree_tools.paired computed it on the host), checked like the rest: numbers in range, and the two runs named
    exactly as two of the report's own runs (so no host text reaches the terminal); absent -> []."""
    if section is None:
        return []
    if not isinstance(section, list) or len(section) > MAX_RUNS:
        p.append(f"paired must be a list of at most {MAX_RUNS}")
        return []
    out = []
    for i, r in enumerate(section):
        n = r.get("n") if isinstance(r, dict) else None
        iv = r.get("interval") if isinstance(r, dict) else None
        if not (isinstance(r, dict) and type(n) is int and 1 <= n <= 20 and _nonneg(r.get("median_ratio"))
                and type(r.get("concurrency")) is int and 1 <= r["concurrency"] <= 4096
                and type(r.get("ahead")) is int and 0 <= r["ahead"] <= n
                and isinstance(r.get("ratios"), list) and len(r["ratios"]) == n and all(map(_nonneg, r["ratios"]))
                and (iv is None or (isinstance(iv, list) and len(iv) == 2 and all(map(_nonneg, iv))))
                and r.get("run") in labels and r.get("peer") in labels):
            p.append(f"paired[{i}] is not a paired comparison of two of the report's runs (n 1-20 ratios, their "
                     f"median, interval, rounds ahead)")
            continue
        out.append({"run": r["run"], "peer": r["peer"],
                    "concurrency": r["concurrency"], "n": n, "median_ratio": r["median_ratio"],
                    "interval": list(iv) if iv is not None else None, "ahead": r["ahead"], "ratios": list(r["ratios"])})
    return out


# ----------------------------------------------------------------------------- the budget schedule a report proposes
def _run_schedule(run):
    """The :class:`contract.BudgetSchedule` a tree-verify run served, or None (one budget, or no valid schedule)."""
    b = run.get("budget")
    if not isinstance(b, str) or not contract.is_schedule(b):
        return None
    try:
        s = contract.parse_budget(b)
    except ValueError:
        return None
    return s if isinstance(s, contract.BudgetSchedule) else None


def propose_schedule(runs, usable=None, tie: float = 0.01) -> dict:
    """The budget schedule (``contract``'s *Budget schedule*) a report's per-concurrency results propose, as a pure
    function of its ``runs`` (the parsed report's, or a host's own). ``usable(run)``: which runs count (the control
    side passes the deploy's CUDA-graph setting, the DFLASH block and the scheduler; default all). Failed levels
    never count.

    For each measured concurrency, ascending, the entry is the fastest speculative option by output tok/s: a
    tree-verify budget, or ``chain`` where chain is faster than every budget allowed there. A schedule's budgets do
    not increase with the batch size, so a level chooses among the budgets no larger than the previous level's
    (and chain); where the fastest budget measured there is larger, the entry says so. Within ``tie`` of the
    fastest, the smaller budget (and chain before a budget) wins. The thresholds are the measured concurrencies,
    the first one 1. Plain decoding is not an entry a tree-verify server can take (it always speculates): where
    plain is the fastest at a level, the entry is still the fastest speculative option and the level says by how
    much plain is ahead. A tree-verify run that served a schedule counts at each of its levels as its own entry
    there (the budget of that batch size, or chain), beside the separate servers of one budget each and DFLASH's
    own: a schedule benched once proposes what it measured, and a schedule run beside budgets is compared with them.
    Chain's figure at a level is what a tree-verify server measured serving chain there (its step is the plugin's,
    not DFLASH's, and is slower where the host is the bottleneck); only where none did is it DFLASH's, and the level
    says so. Where DFLASH is faster than the entry, the level says by how much.

    Returns ``{"budget": canonical text, an int (one budget at every level) or None, "mode": "tree-verify" or
    "linear" (DFLASH fastest at the lowest level: a schedule starts with a budget), "levels": [{"concurrency",
    "entry", "tok_s", "fastest", "fastest_tok_s", "plain_tok_s", "note"}], "notes": [...]}`` (JSON-ready)."""
    usable = usable or (lambda run: True)
    opts: dict = {}  # concurrency -> {entry: tok/s}
    plain: dict = {}
    dflash: dict = {}  # concurrency -> DFLASH's tok/s (chain's figure where no tree-verify server served chain)
    for run in runs or ():
        mode = run.get("mode")
        if not usable(run):
            continue
        sched = _run_schedule(run) if mode == contract.TREE_VERIFY else None
        for lv in run.get("levels") or ():
            if lv.get("errors") or not lv.get("requests") or not _is_num(lv.get("output_tok_s"), False):
                continue
            c, tps = lv["concurrency"], float(lv["output_tok_s"])
            if mode == contract.PLAIN:
                plain[c] = max(plain.get(c, 0.0), tps)
                continue
            if mode == contract.TREE_VERIFY and type(run.get("budget")) is int:
                entry = run["budget"]
            elif mode == contract.TREE_VERIFY and sched is not None:
                entry = sched.budget_for(int(c))  # a schedule's level: its own entry at that batch size, served
            elif contract.deploy_name(mode) == contract.LINEAR:
                dflash[c] = max(dflash.get(c, 0.0), tps)
                continue
            else:
                continue  # shadow-linear serves DFLASH's chain: not an entry of its own
            at = opts.setdefault(c, {})
            at[entry] = max(at.get(entry, 0.0), tps)
    chain_from_dflash = set()
    for c, tps in dflash.items():
        at = opts.setdefault(c, {})
        if contract.CHAIN not in at:
            at[contract.CHAIN] = tps
            chain_from_dflash.add(c)
    levels, notes, prev = [], [], None
    for c in sorted(opts):
        at = opts[c]
        allowed = {e: t for e, t in at.items()
                   if e == contract.CHAIN or prev is None or (prev != contract.CHAIN and e <= prev)}
        best_any = max(at.items(), key=lambda kv: kv[1])
        if not allowed:
            notes.append(f"concurrency {c}: only budgets above the previous entry {prev} measured; left out")
            continue
        top = max(allowed.values())
        tied = [e for e, t in allowed.items() if t >= top * (1 - tie)]
        entry = min(tied, key=lambda e: (e != contract.CHAIN, 0 if e == contract.CHAIN else e))
        note = []
        if best_any[0] not in allowed:
            note.append(f"B={best_any[0]} measured fastest ({best_any[1]:.1f} tok/s), but a schedule's budgets do "
                        f"not increase with the batch size (previous entry {prev})")
        if entry == contract.CHAIN and c in chain_from_dflash and c != min(opts):
            note.append("chain's figure is DFLASH's: no tree-verify server served chain at this concurrency")
        elif c in dflash and dflash[c] > allowed[entry]:
            note.append(f"DFLASH is faster ({dflash[c]:.1f} tok/s, {dflash[c] / allowed[entry]:.2f}x)")
        if plain.get(c, 0.0) > allowed[entry]:
            note.append(f"plain decoding is faster ({plain[c]:.1f} tok/s, {plain[c] / allowed[entry]:.2f}x): a "
                        "tree-verify server cannot switch speculation off")
        levels.append({"concurrency": c, "entry": entry, "tok_s": round(allowed[entry], 3),
                       "fastest": best_any[0], "fastest_tok_s": round(best_any[1], 3),
                       "plain_tok_s": plain.get(c), "note": "; ".join(note)})
        prev = entry
    if not levels:
        return {"budget": None, "mode": None, "levels": [], "notes": notes + [
            "no usable tree-verify or DFLASH level: nothing to propose"]}
    if levels[0]["entry"] == contract.CHAIN:
        return {"budget": None, "mode": contract.LINEAR, "levels": levels, "notes": notes + [
            f"DFLASH is the fastest at the lowest measured concurrency ({levels[0]['concurrency']}): a schedule "
            f"starts with a budget, so the proposal is mode {contract.LINEAR}"]}
    sched = contract.parse_budget({(1 if i == 0 else lv["concurrency"]): lv["entry"] for i, lv in enumerate(levels)})
    return {"budget": sched if type(sched) is int else str(sched), "mode": contract.TREE_VERIFY, "levels": levels,
            "notes": notes}
