"""`fab bench HOST`: throughput and latency of plain, DFLASH and DDTREE serving on one GPU of a fleet host, kept per
host and release on the control machine, and the choice `mode: auto` makes from it at `fab deploy`.

Plan (pure, from the inventory and one read-only `release.probe`): which GPU (default: the host's first enabled
service), which model pair (that service's target and draft model, or with `--tiny` the training kit's tiny pair,
trained on the host as `fab smoke` writes its tiny model there), modes, budgets, concurrencies, the DFLASH block
(the service's `block_size`), and the active release whose venv and plugin run it. Refused before anything runs:
no active release, a venv root must not run, a GPU the host does not have, no model configured. Then one
`bench.run` agent call carries this checkout's tools wheel (:mod:`deploy.tools`: installed into the run's private
directory on the host, never into the venv) and runs its `python -m sglang_ddtree_tools.bench` with the release's
venv (transient `systemd-run` servers as the service user, one at a time, always torn down); its report comes back. The report is hostile
input: :func:`parse_report` checks it whole (types, ranges, sizes) before anything is kept or shown. A host
without a GPU (a CPU lab host) says so and the run exits 2.

Kept: ``inventory/bench/HOST/RELEASE.json`` next to the inventory file (not committed; RELEASE is the host's active
release, matched against the release id grammar before it becomes a file name), a list of results (one per bench
run: GPU, model pair, the release's plugin version and source digest, the report), and the plot of the last one
beside it (``RELEASE.png``).

`mode: auto` (:func:`choose`), at `fab deploy`, for each service whose inventory mode is ``auto``:

1. the results that apply: this host, the service's own target and draft model (not a tiny pair), and the plugin
   being deployed (same plugin source digest as the release the bench ran on: each deploy builds a new release id,
   the plugin source is what was measured); of those, the newest;
2. its runs that the deploy can serve as measured: a deployable mode (DFLASH = ``linear``, ``shadow-linear``,
   ``tree-verify``), measured with the CUDA-graph setting the deploy renders for that mode, the chain modes at
   the service's ``block_size``, tree-verify on the scheduler the service asks for (its ``env``'s
   ``SGLANG_DDTREE_OVERLAP``: the overlap scheduler where set to 1, else the synchronous one; a run is on the one
   its server said it ran), and no failed request;
3. the level: the measured concurrency nearest the service's ``concurrency`` on a log scale (4 and 16 are equally
   near 8); a tie goes to the higher one (throughput under more load is the safer guess);
4. the fastest run at that level by output tok/s; runs within 1% of the fastest are a tie, which goes to the
   simpler mode (``linear`` < ``shadow-linear`` < ``tree-verify``) and then to the smaller budget.

With ``concurrency: all`` (sized for every load, :func:`choose_schedule`), steps 3 and 4 are the tools'
``report.propose_schedule`` instead: tree-verify with a budget schedule, each measured concurrency's entry the
fastest budget there, or ``chain`` where chain is faster (a served chain entry's figure, else DFLASH's; thresholds
at the measured concurrencies); ``linear``
when DFLASH is the fastest at the lowest one. `fab bench` prints the schedule its results propose.

No applicable result (or none with a usable run): the host is refused at the plan with what to run. Plain
decoding is measured too but is not a mode the toolkit deploys: when it beats the choice, the plan says so.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import contract, modes, values
from . import smoke as smokemod
from . import tools
from .tools import report as benchreport
from .inventory import Host, Inventory
from .release import hybrid

REPORT_SCHEMA = benchreport.SCHEMA  # what the tools' bench module writes (sglang_ddtree_tools/report.py)
RESULT_SCHEMA = "ddtree-bench-result/1"  # what is kept here
BENCH_MODES = contract.BENCH_MODES
# --overlap: the scheduler the bench asks of each tree-verify server (the plugin's bench --overlap); "default":
# none asked, the plugin's own (the synchronous scheduler)
OVERLAP_CHOICES = ("default", "off", "on", "both")
OVERLAP_ENV = contract.OVERLAP_ENV  # the plugin's switch
OVERLAP_ON = contract.OVERLAP_ON  # what the plugin reads as asked (config.overlap_decision)
DEPLOY_MODE = {m: contract.deploy_name(m) for m in BENCH_MODES if contract.deploy_name(m) in contract.MODES}
SIMPLER = {m: i for i, m in enumerate(contract.MODES)}  # the tie order
TIE = 0.01
RELEASE_RE = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}\Z")
DIGEST_RE = re.compile(r"[0-9a-f]{64}\Z")
EXIT_OK, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
PROBE_DEADLINE = 60.0
MAX_TEXT = benchreport.MAX_TEXT
PROMPTS_MAX, PROMPT_TOKENS_MAX, PROMPTS_BYTES_MAX = 4096, 32768, 4 << 20
DEFAULTS = {"modes": (contract.PLAIN, contract.DFLASH, contract.TREE_VERIFY), "budgets": (15, 31, 63),
            "concurrency": (1, 4, 16),
            "graphs": "both", "max_new_tokens": 128, "num_prompts": 32, "prompt_len": 64, "seed": 0}


# the bench report's schema and checks live in one module, shared with the host side (deploy/tools.py loads it)
BadReport = benchreport.BadReport  # a report from a host that is not a well-formed ddtree-bench/1 document
parse_report = benchreport.parse_report  # a host's report, checked whole and copied into a clean document
ran_overlap = benchreport.ran_overlap  # whether a DDTREE run's server ran SGLang's overlap scheduler
run_label = benchreport.run_label  # a run's name in tables, as the tools' bench names it
failure_line = benchreport.failure_summary  # a failed run's reason on one line
_text = benchreport.clip


class BenchRefused(ValueError):
    """The benchmark cannot run on this host as asked (nothing was started)."""


class NoChoice(ValueError):
    """`mode: auto` cannot be resolved for a service (the message says what to run)."""


# ----------------------------------------------------------------------------- arguments
def int_list(text, what: str, lo: int, hi: int, most: int = 16) -> tuple[int, ...]:
    """``"1,4,16"`` -> (1, 4, 16), sorted and unique, each in [lo, hi]; raises BenchRefused."""
    words = [w.strip() for w in str(text).split(",") if w.strip()]
    try:
        vals = sorted({int(w) for w in words})
    except ValueError:
        raise BenchRefused(f"{what}: {text!r} is not a comma list of integers") from None
    if not vals or len(vals) > most or any(not lo <= v <= hi for v in vals):
        raise BenchRefused(f"{what}: 1-{most} integers in [{lo}, {hi}], got {text!r}")
    return tuple(vals)


def budget_list(text, most: int = 16) -> tuple:
    """`--budgets` as the tools' bench reads them (the report module's ``parse_budget_list``: node budgets, and
    budget schedules as their canonical text, ``"31; 1:127,4:31,64:chain"``), refused with BenchRefused."""
    try:
        vals = tuple(benchreport.parse_budget_list(text, "--budgets"))
    except ValueError as e:
        raise BenchRefused(str(e)) from None
    if len(vals) > most:
        raise BenchRefused(f"--budgets: at most {most} budgets and schedules, got {len(vals)}")
    return vals


def mode_list(text) -> tuple[str, ...]:
    """`--modes` as the tools' bench reads them (the report module's parser), refused with BenchRefused."""
    try:
        return tuple(benchreport.parse_modes(text, "--modes"))
    except ValueError as exc:
        raise BenchRefused(str(exc)) from None


def load_prompt_file(path: str) -> list[list[int]]:
    """Token-id prompts from a JSON document (a list, or {"prompts": [...]}) or JSONL (one a line); each prompt a
    list of ids or {"input_ids": [...]}. Problems name the file and line."""
    p = Path(path)
    try:
        if p.stat().st_size > PROMPTS_BYTES_MAX:
            raise BenchRefused(f"{path}: larger than {PROMPTS_BYTES_MAX >> 20} MiB")
        text = p.read_text()
    except OSError as exc:
        raise BenchRefused(f"{path}: {exc.strerror or exc}") from None
    items: list[tuple[str, object]] = []
    try:
        doc = json.loads(text)
        if isinstance(doc, dict) and "prompts" in doc:
            doc = doc["prompts"]
        if not isinstance(doc, list):
            raise BenchRefused(f"{path}:1: expected a list of prompts")
        items = [(f"{path}: prompt {i}", x) for i, x in enumerate(doc)]
    except json.JSONDecodeError:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    items.append((f"{path}:{n}", json.loads(line)))
                except json.JSONDecodeError as e:
                    raise BenchRefused(f"{path}:{n}: not JSON: {e.msg}") from None
    if not items or len(items) > PROMPTS_MAX:
        raise BenchRefused(f"{path}: 1-{PROMPTS_MAX} prompts, found {len(items)}")
    out = []
    for where, x in items:
        ids = x.get("input_ids") if isinstance(x, dict) else x
        if not (isinstance(ids, list) and 1 <= len(ids) <= PROMPT_TOKENS_MAX
                and all(type(t) is int and 0 <= t < 2 ** 31 for t in ids)):
            raise BenchRefused(f"{where}: a prompt is 1-{PROMPT_TOKENS_MAX} token ids (non-negative integers) or "
                               '{"input_ids": [...]}')
        out.append(ids)
    return out


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class BenchPlan:
    host: str
    gpu: int
    instance: str | None
    modes: tuple
    budgets: tuple
    concurrency: tuple
    graphs: str
    block: int
    max_new_tokens: int
    requests: int | None
    num_prompts: int
    prompt_len: int
    seed: int
    tiny: str | None  # the family of the tiny pair trained on the host, or None: the service's models
    family_reason: str | None
    model: str | None
    draft_model: str | None
    release: str
    plugin: dict
    venv: str
    user: str
    prefix: str
    server_args: tuple
    deadline: float
    prompts: list | None = field(default=None, repr=False)
    prompts_source: str = "random"
    warnings: tuple = ()
    rounds: int = 1  # the whole list this many times over, a fresh server each time (medians reported)
    cpus: str | None = None  # the host's CPUs every bench server is pinned to (the load generator gets the rest)
    overlap: str = "default"  # tree-verify's scheduler: default, off, on or both (one of each a round)
    cache_key: str | None = None  # the active payload's JIT cache folder of the GPU's service (smoke.jit_source)
    env: tuple = ()  # the GPU's service environment (smoke.service_env): the bench servers run with it

    def agent_args(self) -> dict:
        return {"gpu": self.gpu, "modes": list(self.modes), "budgets": list(self.budgets),
                "concurrency": list(self.concurrency), "graphs": self.graphs, "block": self.block,
                "max_new_tokens": self.max_new_tokens, "requests": self.requests, "num_prompts": self.num_prompts,
                "prompt_len": self.prompt_len, "seed": self.seed, "tiny": self.tiny, "model": self.model,
                "draft_model": self.draft_model, "venv": self.venv, "user": self.user, "prefix": self.prefix,
                "server_args": list(self.server_args), "prompts": self.prompts, "rounds": self.rounds,
                "cpus": self.cpus, "overlap": self.overlap,
                "env": dict(self.env)} | smokemod.jit_args(self.instance, self.cache_key)

    def to_json(self) -> dict:
        d = asdict(self)
        d["prompts"] = None if self.prompts is None else len(self.prompts)
        return d


def plan_bench(host: Host, probe: dict, *, gpu: int | None = None, modes_: tuple = DEFAULTS["modes"],
               budgets: tuple = DEFAULTS["budgets"], concurrency: tuple = DEFAULTS["concurrency"],
               graphs: str = DEFAULTS["graphs"], tiny: bool = False, family: str | None = None,
               max_new_tokens: int = DEFAULTS["max_new_tokens"], requests: int | None = None,
               num_prompts: int = DEFAULTS["num_prompts"], prompt_len: int = DEFAULTS["prompt_len"],
               seed: int = DEFAULTS["seed"], prompts: list | None = None, prompts_source: str = "random",
               server_args: tuple = (), deadline: float = 3600.0, rounds: int = 1,
               cpus: str | None = None, overlap: str = "default") -> BenchPlan:
    """The benchmark run for `host` from its inventory entry and a `release.probe` result. Raises BenchRefused."""
    gpu, svc = smokemod.gpu_and_service(host, gpu, BenchRefused, "pass --gpu (and --tiny)")
    if graphs not in ("on", "off", "both"):
        raise BenchRefused(f"--graphs {graphs!r}: on, off or both")
    if not (type(rounds) is int and 1 <= rounds <= 20):
        raise BenchRefused(f"--rounds {rounds!r}: 1 to 20")
    if overlap not in OVERLAP_CHOICES:
        raise BenchRefused(f"--overlap {str(overlap)[:40]!r}: {', '.join(OVERLAP_CHOICES)}")
    if overlap != "default" and contract.TREE_VERIFY not in modes_:
        raise BenchRefused(f"--overlap {overlap}: it sets tree-verify's scheduler, and --modes has no tree-verify")
    if family is not None and family not in ("hybrid", "dense"):
        raise BenchRefused(f"--family {family!r}: hybrid or dense")
    for b in budgets:
        if problem := contract.budget_problem(b, contract.TREE_VERIFY):
            raise BenchRefused(f"--budgets: {str(b)[:80]!r} {problem}")
    if any(type(b) is not int for b in budgets) and contract.SHADOW_LINEAR in modes_:
        raise BenchRefused("--budgets: a schedule is served by tree-verify only; shadow-linear takes budgets "
                           "(bench it with node budgets, or leave it out of --modes)")
    from .remote.host.bench import CPUS_RE  # the host op's own rule (imported where used, as host_command does)

    if cpus is not None and not CPUS_RE.match(str(cpus)):
        raise BenchRefused(f"--cpus {str(cpus)[:80]!r}: a CPU list like 0-3,8 (whether the host has them, its "
                           "bench says before it starts anything)")
    if not probe.get("current"):
        raise BenchRefused(f"{host.name} has no active release: run `fab deploy` first (the benchmark runs the "
                           f"release's plugin from {host.vars['venv']})")
    if not RELEASE_RE.match(str(probe["current"])):
        raise BenchRefused(f"{host.name}: its active release id {str(probe['current'])[:80]!r} is not one this "
                           "toolkit makes")
    if probe.get("venv_trust") != "ok":
        raise BenchRefused(f"{host.name}: {host.vars['venv']}: root will not run it: {probe.get('venv_trust')}")
    for w in server_args:
        if problem := values.extra_arg(w):
            raise BenchRefused(f"--server-args: {problem}")
    man = probe.get("manifest") if isinstance(probe.get("manifest"), dict) else {}
    plug = man.get("plugin") if isinstance(man.get("plugin"), dict) else {}
    digest = plug.get("source_digest") if isinstance(plug.get("source_digest"), str) else None
    plugin = {"version": str(plug.get("version"))[:100] if plug.get("version") else None,
              "source_digest": digest if digest and DIGEST_RE.match(digest) else None}
    model = draft = reason = None
    warnings = []
    if tiny:
        if family is None:
            family, reason = "dense", "no model configured for this GPU: the dense tiny pair"
            if svc is not None and svc.model:
                got = (probe.get("configs") or {}).get(svc.model) or {}
                if "config" not in got:
                    raise BenchRefused(f"{host.name}: the model of {svc.instance} ({svc.model}) has no readable "
                                       f"config.json ({got.get('error', 'not probed')}): its family decides the "
                                       "tiny pair (or pass --family)")
                why = hybrid.hybrid_reason(got["config"])
                family, reason = ("hybrid", f"{svc.model}: {why}") if why else ("dense", f"{svc.model}: no recurrent layers")
        else:
            reason = "--family"
    else:
        if svc is None or not svc.model:
            raise BenchRefused(f"{host.name}: GPU {gpu} has no service with a model: pass --tiny to bench the tiny "
                               "pair")
        model, draft = svc.model, svc.draft_model
        if draft is None and modes_ != (contract.PLAIN,):
            raise BenchRefused(f"{host.name}: {svc.instance} has no draft_model: only --modes plain can run")
    if svc is not None and svc.enabled:
        warnings.append(f"GPU {gpu} serves {svc.instance}: the bench servers share its memory and compute with the "
                        "running service (figures are lower than alone; all modes share it alike)")
    block = svc.block_size if svc is not None else 8
    return BenchPlan(host=host.name, gpu=gpu, instance=svc.instance if svc else None, modes=tuple(modes_),
                     budgets=tuple(b if type(b) is int else contract.budget_text(b) for b in budgets),
                     concurrency=tuple(concurrency), graphs=graphs, block=block,
                     max_new_tokens=int(max_new_tokens), requests=requests, num_prompts=int(num_prompts),
                     prompt_len=int(prompt_len), seed=int(seed), tiny=family if tiny else None,
                     family_reason=reason, model=model, draft_model=draft, release=probe["current"], plugin=plugin,
                     venv=host.vars["venv"], user=host.vars["service_user"],
                     prefix=f"ddtree-bench-{secrets.token_hex(6)}",
                     # the service's own extra_args less its pool sizing (sized for the GPU alone: a bench server
                     # beside the running service sizes its own), then --server-args (last: the operator's word wins)
                     server_args=(tuple(contract.without_pool_flags(svc.extra_args)) if svc is not None and not tiny
                                  else ()) + tuple(server_args),
                     deadline=float(deadline), prompts=prompts, prompts_source=prompts_source,
                     warnings=tuple(warnings), rounds=rounds, cpus=cpus, overlap=overlap,
                     cache_key=smokemod.jit_source(svc, probe), env=smokemod.service_env(svc))


def jit_start_lines(rec: dict) -> list[str]:
    """Which servers started warm (MiB already in their JIT caches) and which cold (every kernel compiled at
    start: its start-up, not its figures, is slower), a line; none for a report without it."""
    warm, cold = [], []
    for r in rec["report"]["runs"]:
        mib = r.get("jit_cache_mib")
        if mib is None:
            continue
        (warm if mib > 0 else cold).append(run_label(r) + (f" ({mib:.0f} MiB)" if mib > 0 else ""))
    out = []
    if warm:
        out.append("started warm (JIT caches): " + ", ".join(warm))
    if cold:
        out.append("started cold (empty JIT caches): " + ", ".join(cold))
    return out


def paired_lines(report: dict) -> list[str]:
    """The report's paired comparisons, a line each, for under the table."""
    out = []
    for r in report.get("paired") or []:
        iv = (f"{r['interval'][0]:.2f}-{r['interval'][1]:.2f}" if r["interval"]
              else f"none with {r['n']} pairs (6 needed)")
        out.append(f"{r['run']} / {r['peer']} at c={r['concurrency']}: median paired ratio {r['median_ratio']:.2f}x "
                   f"(95% interval {iv}), ahead in {r['ahead']} of {r['n']} rounds; ratios "
                   + " ".join(f"{x:.2f}" for x in r["ratios"]))
    return out


# ----------------------------------------------------------------------------- results kept here
def results_dir(inventory_path: str) -> Path:
    return Path(inventory_path).parent / "bench"


def result_path(inventory_path: str, host: str, release: str) -> Path:
    if not values.HOSTNAME_RE.fullmatch(host) or not RELEASE_RE.match(release):
        raise ValueError(f"not a host name and release id: {host!r}, {release!r}")
    return results_dir(inventory_path) / host / f"{release}.json"


def result_record(plan: BenchPlan, report: dict) -> dict:
    return {"created": report.get("created") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": plan.host, "release": plan.release, "plugin": dict(plan.plugin), "gpu": plan.gpu,
            "instance": plan.instance, "model": plan.model, "draft_model": plan.draft_model, "tiny": plan.tiny,
            "block": plan.block, "prompts": plan.prompts_source, "report": report}


def save_result(inventory_path: str, record: dict) -> Path:
    """Append `record` to inventory/bench/HOST/RELEASE.json (written whole, then renamed: never half a file)."""
    path = result_path(inventory_path, record["host"], record["release"])
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": RESULT_SCHEMA, "host": record["host"], "release": record["release"], "results": []}
    if path.exists():
        try:
            old = json.loads(path.read_text())
            if isinstance(old, dict) and isinstance(old.get("results"), list):
                doc["results"] = old["results"]
        except (OSError, ValueError):
            pass  # an unreadable file is replaced by the new result (the old one could not be used anyway)
    doc["results"].append(record)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_results(inventory_path: str, host: str) -> tuple[list[dict], list[str]]:
    """Every kept result of `host` (each report checked again: the files may have been edited) and the problems
    of the files or results that could not be used."""
    d = results_dir(inventory_path) / host
    out, problems = [], []
    if not values.HOSTNAME_RE.fullmatch(host) or not d.is_dir():
        return out, problems
    for f in sorted(d.glob("*.json")):
        try:
            doc = json.loads(f.read_text())
            if not (isinstance(doc, dict) and doc.get("schema") == RESULT_SCHEMA and doc.get("host") == host
                    and f.stem == doc.get("release") and isinstance(doc.get("results"), list)):
                raise ValueError(f"not a {RESULT_SCHEMA} file of host {host} and release {f.stem}")
        except (OSError, ValueError) as exc:
            problems.append(f"{f}: {exc}")
            continue
        for k, r in enumerate(doc["results"]):
            try:
                if not isinstance(r, dict):
                    raise BadReport(["not an object"])
                rec = dict(r, report=parse_report(r.get("report")), host=host, release=doc["release"])
                plug = rec.get("plugin") if isinstance(rec.get("plugin"), dict) else {}
                rec["plugin"] = {"version": _text(plug.get("version"), 100),
                                 "source_digest": plug.get("source_digest")
                                 if isinstance(plug.get("source_digest"), str) else None}
                out.append(rec)
            except BadReport as exc:
                problems.append(f"{f}: results[{k}]: {exc}")
    return out, problems


# ----------------------------------------------------------------------------- mode: auto
@dataclass(frozen=True)
class Choice:
    mode: str
    budget: int | None
    tok_s: float
    concurrency: int  # the measured level the choice was made at
    wanted: int  # the service's concurrency
    source: str  # which result: HOST/RELEASE.json and when
    plain_tok_s: float | None = None
    runner_up: str | None = None
    overlap: bool = False  # measured (and deployed) on SGLang's overlap scheduler: the service's env asks it
    # choose_schedule's: (concurrency, entry, tok/s, note) per measured level; None for one concurrency's choice
    schedule_levels: tuple | None = None

    def note(self) -> str:
        if self.schedule_levels is not None:
            return self._schedule_note()
        b = f" B={self.budget}" if contract.is_ddtree(self.mode) else ""
        b += " on the overlap scheduler" if self.overlap and self.mode == contract.TREE_VERIFY else ""
        at = f"concurrency {self.concurrency}" + ("" if self.concurrency == self.wanted else
                                                  f" (nearest measured to {self.wanted})")
        s = f"{self.mode}{b}: {self.tok_s:.1f} tok/s at {at}, bench {self.source}"
        if self.runner_up:
            s += f"; next {self.runner_up}"
        if self.plain_tok_s is not None and self.plain_tok_s > self.tok_s:
            s += (f"; NOTE plain decoding measured {self.plain_tok_s:.1f} tok/s, faster: the toolkit deploys "
                  "speculative modes only")
        return s


    def _schedule_note(self) -> str:
        what = (f"{self.mode} B={self.budget}" if self.mode == contract.TREE_VERIFY else
                f"{self.mode} (DFLASH fastest at concurrency {self.concurrency})")
        what += " on the overlap scheduler" if self.overlap and self.mode == contract.TREE_VERIFY else ""
        per = ", ".join(f"{c}: {e} {t:.1f} tok/s" + (f" ({n})" if n else "") for c, e, t, n in self.schedule_levels)
        return f"{what} for every load (concurrency all): per measured concurrency {per}; bench {self.source}"


def nearest_level(levels, wanted: int) -> int:
    """The measured concurrency nearest `wanted` on a log scale; a tie goes to the higher."""
    if not levels:
        raise ValueError("no measured level")
    return min(set(levels), key=lambda c: (abs(math.log2(c) - math.log2(wanted)), -c))


def service_overlap(env) -> bool:
    """Whether a service asks the plugin for SGLang's overlap scheduler: its ``env`` (Service.env, (name, value)
    pairs) sets SGLANG_DDTREE_OVERLAP to what the plugin reads as yes."""
    return any(k == OVERLAP_ENV and contract.overlap_asked(v) for k, v in env or ())


def choose(results: list[dict], *, host: str, plugin_digest: str | None, model: str | None,
           draft_model: str | None, concurrency: int, block_size: int, graphs_for, overlap: bool = False) -> Choice:
    """The mode and budget `mode: auto` gives a service (the rule is in the module docstring). `graphs_for(mode)`
    is whether the deploy runs `mode` with decode CUDA graphs; `overlap`: the service asks for SGLang's overlap
    scheduler (:func:`service_overlap`). Raises NoChoice with what to do."""
    rec, source, todo = _newest(results, host=host, plugin_digest=plugin_digest, model=model, draft_model=draft_model)
    usable = _usable(block_size, graphs_for, overlap)
    rows, plain = [], {}
    for run in rec["report"]["runs"]:
        for lv in run["levels"]:
            if lv["errors"] or lv["requests"] == 0:
                continue
            if run["mode"] == contract.PLAIN:
                plain[lv["concurrency"]] = max(plain.get(lv["concurrency"], 0.0), lv["output_tok_s"])
                continue
            if usable(run):
                rows.append((DEPLOY_MODE[run["mode"]], run["budget"], lv["concurrency"], lv["output_tok_s"]))
    if not rows:
        raise NoChoice(_no_usable(source, block_size, overlap, todo))
    level = nearest_level([r[2] for r in rows], concurrency)
    at = sorted((r for r in rows if r[2] == level), key=lambda r: -r[3])
    best_tps = at[0][3]
    tied = [r for r in at if r[3] >= best_tps * (1 - TIE)]
    pick = min(tied, key=lambda r: (SIMPLER[r[0]], r[1] or 0))
    rest = [r for r in at if r is not pick]
    runner = (f"{rest[0][0]}" + (f" B={rest[0][1]}" if contract.is_ddtree(rest[0][0]) else "")
              + f" {rest[0][3]:.1f} tok/s" if rest else None)
    return Choice(mode=pick[0], budget=pick[1], tok_s=pick[3], concurrency=level, wanted=concurrency,
                  source=source, plain_tok_s=plain.get(level), runner_up=runner, overlap=overlap)


def _newest(results: list[dict], *, host: str, plugin_digest: str | None, model: str | None,
            draft_model: str | None) -> tuple[dict, str, str]:
    """(the newest result that applies, where it is kept, what to do without one): step 1 of the rule."""
    want = f"host {host}, model {model} with drafter {draft_model}, plugin source {str(plugin_digest)[:12]}"
    todo = ("run `fab bench " + host + "` with this plugin deployed (fab deploy --mode ... first), or set a mode")
    if not plugin_digest:
        raise NoChoice(f"the plugin being deployed has no source digest to match bench results against; {todo}")
    mine = [r for r in results if r.get("host") == host and not r.get("tiny") and r.get("model") == model
            and r.get("draft_model") == draft_model and (r.get("plugin") or {}).get("source_digest") == plugin_digest]
    if not mine:
        others = sorted({f"{r.get('release')} ({str((r.get('plugin') or {}).get('source_digest'))[:12]}, "
                         f"{r.get('model') or 'tiny ' + str(r.get('tiny'))})" for r in results})
        raise NoChoice(f"no bench result for {want}" + (f" (kept: {', '.join(others)})" if others else
                                                        " (none kept for this host)") + f"; {todo}")
    rec = max(mine, key=lambda r: (str(r.get("created")), str(r.get("release"))))
    return rec, f"{host}/{rec['release']}.json ({rec.get('created')})", todo


def _usable(block_size: int, graphs_for, overlap: bool):
    """Step 2 of the rule: whether a (non-plain) run is one the deploy can serve as measured."""
    def usable(run: dict) -> bool:
        if run["mode"] not in DEPLOY_MODE:
            return False
        mode = DEPLOY_MODE[run["mode"]]
        if run["graphs"] != graphs_for(mode):
            return False
        if mode != contract.TREE_VERIFY and run["block"] != block_size:  # the chain modes' width
            return False
        return mode != contract.TREE_VERIFY or ran_overlap(run) == overlap  # measured on the service's scheduler
    return usable


def _no_usable(source: str, block_size: int, overlap: bool, todo: str) -> str:
    return (f"bench {source} has no run the deploy can serve as measured (a deployable mode with the deploy's "
            f"CUDA-graph setting, block {block_size} for the chain modes, tree-verify on the "
            f"{'overlap' if overlap else 'synchronous'} scheduler, no failed request); {todo}")


def choose_schedule(results: list[dict], *, host: str, plugin_digest: str | None, model: str | None,
                    draft_model: str | None, block_size: int, graphs_for, overlap: bool = False) -> Choice:
    """What `mode: auto` with ``concurrency: all`` gives a service: tree-verify with the budget schedule the newest
    applicable result proposes (the tools' ``report.propose_schedule`` over the runs the deploy can serve as
    measured: step 1 and 2 of the rule), or ``linear`` where DFLASH is the fastest at the lowest measured
    concurrency. A pure function; raises NoChoice with what to do."""
    rec, source, todo = _newest(results, host=host, plugin_digest=plugin_digest, model=model, draft_model=draft_model)
    usable = _usable(block_size, graphs_for, overlap)
    prop = benchreport.propose_schedule(rec["report"]["runs"],
                                        usable=lambda run: run["mode"] == contract.PLAIN or usable(run))
    if prop["mode"] is None:
        raise NoChoice(_no_usable(source, block_size, overlap, todo))
    lows = prop["levels"][0]
    budget = None if prop["budget"] is None else contract.parse_budget(prop["budget"])
    return Choice(mode=prop["mode"], budget=budget, tok_s=lows["tok_s"], concurrency=lows["concurrency"],
                  wanted=lows["concurrency"], source=source, plain_tok_s=lows["plain_tok_s"],
                  runner_up=None, overlap=overlap, schedule_levels=tuple(
                      (lv["concurrency"], lv["entry"], lv["tok_s"], lv["note"]) for lv in prop["levels"]))


def resolve_auto(inventory_path: str, hosts: list[Host], plugin_digest: str | None, graphs_for,
                 results_by_host: dict | None = None) -> tuple[list[Host], dict[str, list[str]], dict[str, list[str]]]:
    """:func:`auto_services` with the results kept next to the inventory (:func:`load_results`) for every host
    with a `mode: auto` service that `results_by_host` ({host: results}) does not give."""
    kept = {}
    for h in hosts:
        if any(s.mode == contract.AUTO for s in h.services):
            kept[h.name] = ((results_by_host[h.name], []) if results_by_host is not None and h.name in results_by_host
                            else load_results(inventory_path, h.name))
    return auto_services(hosts, kept, plugin_digest, graphs_for)


def auto_services(hosts: list[Host], kept: dict, plugin_digest: str | None, graphs_for
                  ) -> tuple[list[Host], dict[str, list[str]], dict[str, list[str]]]:
    """Hosts with every `mode: auto` service given its chosen mode and budget (Service.auto says why), from
    `kept` ({host: (results, problems reading them)}): a pure function. The choice is checked as a mode written
    in the inventory is (a deployable mode, the budget within the contract's bounds). Returns the resolved hosts;
    the hosts that could not be resolved ({host: refusals}), left out; notes per host for the plan's output."""
    out, refused, notes = [], {}, {}
    for h in hosts:
        autos = [s for s in h.services if s.mode == contract.AUTO and s.enabled]
        disabled = [s for s in h.services if s.mode == contract.AUTO and not s.enabled]
        if not autos and not disabled:
            out.append(h)
            continue
        results, problems = kept.get(h.name, ([], []))
        svcs, bad, told = [], [], []
        for s in h.services:
            if s.mode != contract.AUTO:
                svcs.append(s)
                continue
            try:
                if s.concurrency == modes.CONCURRENCY_ALL:
                    c = choose_schedule(results, host=h.name, plugin_digest=plugin_digest, model=s.model,
                                        draft_model=s.draft_model, block_size=s.block_size,
                                        graphs_for=lambda m, s=s: graphs_for(s, m), overlap=service_overlap(s.env))
                else:
                    c = choose(results, host=h.name, plugin_digest=plugin_digest, model=s.model,
                               draft_model=s.draft_model, concurrency=s.concurrency or 1, block_size=s.block_size,
                               graphs_for=lambda m, s=s: graphs_for(s, m), overlap=service_overlap(s.env))
                budget = c.budget if c.budget is not None else s.budget
                if c.mode not in contract.MODES:
                    raise NoChoice(f"the bench chose mode {c.mode!r}, not one of {', '.join(contract.MODES)}")
                if contract.is_ddtree(c.mode) and (problem := contract.budget_problem(budget, c.mode)):
                    raise NoChoice(f"the bench chose {c.mode} B={budget!r}: the budget {problem}")
            except ValueError as exc:  # NoChoice, or a service the deploy could not render (its message)
                if s.enabled:
                    bad.append(f"{s.instance}: mode auto: {exc}")
                    continue
                svcs.append(replace(s, mode=contract.MODES[0], auto="disabled: not resolved"))
                continue
            svcs.append(replace(s, mode=c.mode, budget=budget, auto=c.note()))
            told.append(f"{s.instance}: mode auto -> {c.note()}")
        if bad:
            refused[h.name] = bad + [f"bench results not used: {p}" for p in problems[:3]]
            continue
        notes[h.name] = told + [f"bench results not used: {p}" for p in problems[:3]]
        out.append(replace(h, services=tuple(svcs)))
    return out, refused, notes


# ----------------------------------------------------------------------------- showing it
def rows(report: dict) -> list[dict]:
    """One flat row per run and level (a failed run with no level: one row saying why)."""
    out = []
    for run in report["runs"]:
        label = run_label(run)
        if not run["levels"]:
            out.append({"label": label, "failed": failure_line(run.get("error") or run["status"])})
        for lv in run["levels"]:
            out.append(dict(lv, label=label))
    return out


def table(record: dict, wide: bool = False):
    """The result as a rich Table, one line per run and level, fit for a 100-column terminal: run, concurrency,
    requests, tok/s, accept length, TTFT p50/p99, ITL p50 and step p50 (ms); `wide` adds ITL p99 and lets the
    cells wrap instead of shortening the run's name. Every cell is a Text (host strings are never read as rich
    markup)."""
    from rich.table import Table
    from rich.text import Text

    rep = record["report"]
    what = record.get("model") or f"tiny {record.get('tiny')} pair (trained on the host)"
    title = Text(f"{record['host']} GPU {record['gpu']} ({rep['gpu'].get('name')}), release "
                 f"{record['release']}: {what}, {rep.get('max_new_tokens')} new tokens a request")
    cols = [("run", "run"), ("conc", "conc"), ("req", "req"), ("tok/s", "tok/s"), ("accept", "accept"),
            ("ttft50", "TTFT p50 ms"), ("ttft99", "TTFT p99 ms"), ("itl50", "ITL p50 ms"), ("itl99", "ITL p99 ms"),
            ("step50", "step p50 ms")]
    if wide:
        t = Table(title=title)
        for _, header in cols:
            t.add_column(header, justify="left" if header == "run" else "right")
    else:
        cols = [c for c in cols if c[0] != "itl99"]
        t = Table(title=title, box=None, pad_edge=False, title_justify="left", header_style="bold")
        for _, header in cols:  # "TTFT p50 ms" over two lines: a column as wide as its figures
            t.add_column(header.replace(" p", "\np", 1) if " p" in header else header, no_wrap=True,
                         overflow="ellipsis", justify="left" if header == "run" else "right",
                         max_width=8 if header == "accept" else None)  # a failure's reason: in full below

    def f(v, nd=1):
        return "-" if v is None else f"{v:.{nd}f}"

    for r in rows(rep):
        if "failed" in r:
            cells = {"run": r["label"], "conc": "-", "req": "-", "tok/s": "FAILED", "accept": r["failed"]}
        else:
            cells = {"run": r["label"], "conc": str(r["concurrency"]),
                     "req": f"{r['requests']}" + (f" ({r['errors']} err)" if r["errors"] else ""),
                     "tok/s": f(r["output_tok_s"]), "accept": f(r["accept_length"], 2),
                     "ttft50": f(r["ttft_ms"]["p50"]), "ttft99": f(r["ttft_ms"]["p99"]),
                     "itl50": f(r["itl_ms"]["p50"], 2), "itl99": f(r["itl_ms"]["p99"], 2),
                     "step50": f((r.get("step_ms") or {}).get("p50"), 2)}
        t.add_row(*[Text(cells.get(k, "")) for k, _ in cols])
    return t


def failure_notes(record: dict) -> list[str]:
    """Each failed run's whole reason, for under the narrow table (where the cell is shortened)."""
    return [f"{r['label']}: FAILED: {r['failed']}" for r in rows(record["report"]) if "failed" in r]


def plot(record: dict, path: Path) -> Path:
    """PNG: output tok/s against concurrency, one line per mode/budget/graphs (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list] = {}
    for r in rows(record["report"]):
        if "failed" not in r and r["requests"] > r["errors"]:
            series.setdefault(r["label"], []).append((r["concurrency"], r["output_tok_s"]))
    if not series:
        raise ValueError("no measured level to plot")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for label, pts in series.items():
        pts.sort()
        ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o",
                linestyle="--" if label.endswith("graphs=off") else "-", label=label)
    levels = sorted({c for pts in series.values() for c, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels)
    ax.set_xticklabels([str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    what = os.path.basename(str(record.get("model") or f"tiny-{record.get('tiny')}").rstrip("/"))
    ax.set_title(f"{record['host']} GPU {record['gpu']} ({record['report']['gpu'].get('name')}): {what}, "
                 f"release {record['release']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(path), format="png")
    plt.close(fig)
    return path


def schedule_lines(record: dict) -> list[str]:
    """What `fab bench` prints after its table: per CUDA-graph setting and DDTREE scheduler measured, the budget
    schedule the results propose (the tools' ``report.propose_schedule`` over the tree-verify runs on that scheduler,
    beside DFLASH and plain: what `mode: auto` gives a service with that ``overlap`` setting), as the inventory writes
    it, with each level's entry and why where it is not the plain fastest. The synchronous scheduler's is always
    given; the overlap scheduler's where a tree-verify server ran it (`fab bench --overlap on|both`)."""
    runs = record["report"]["runs"]
    out = []
    for graphs in sorted({bool(r.get("graphs")) for r in runs}, reverse=True):
        schedulers = [False] + ([True] if any(ran_overlap(r) and bool(r.get("graphs")) == graphs
                                              and r.get("mode") == contract.TREE_VERIFY for r in runs) else [])
        for ov in schedulers:
            prop = benchreport.propose_schedule(runs, usable=lambda r, g=graphs, o=ov: bool(r.get("graphs")) == g
                                                and ran_overlap(r) == o)
            out += _proposal_lines(prop, f"schedule (graphs {'on' if graphs else 'off'}"
                                         f"{', overlap scheduler' if ov else ''})", ov)
    return out


def _proposal_lines(prop: dict, tag: str, overlap: bool) -> list[str]:
    """One proposal as `fab bench` prints it: its head (the inventory's words; the service env that asks the
    overlap scheduler where it was measured there), one line per level, its notes."""
    if prop["mode"] is None:
        return [f"{tag}: none proposed: {'; '.join(prop['notes'])}"]
    if prop["mode"] == contract.LINEAR:
        head = f"mode: {contract.LINEAR}"
    else:
        b = contract.parse_budget(prop["budget"])
        head = f"mode: {contract.TREE_VERIFY}, budget: " + (
            str(b) if type(b) is int else "{" + ", ".join(f"{t}: {e}" for t, e in b.entries) + "}")
        head += f" (service env {OVERLAP_ENV}={OVERLAP_ON[0]})" if overlap else ""
    return ([f"{tag}: {head}"]
            + [f"  concurrency {lv['concurrency']}: {lv['entry']} {lv['tok_s']:.1f} tok/s"
               + (f" ({lv['note']})" if lv["note"] else "") for lv in prop["levels"]]
            + [f"  {n}" for n in prop["notes"]])


# ----------------------------------------------------------------------------- the run
def outcome(res: dict) -> tuple[int, str, dict | None]:
    """(exit code, one line, the checked report or None) from the bench.run result."""
    raw = res.get("report")
    if isinstance(raw, dict) and raw.get("cannot_run"):
        return EXIT_CANNOT_RUN, f"cannot run: {_text(raw['cannot_run'], 400)}", None
    if res.get("timed_out"):
        return EXIT_FAILED, "the benchmark did not finish within its deadline (its servers were stopped)", None
    if raw is None:
        tail = " | ".join((res.get("stderr") or "").strip().splitlines()[-3:])[:600]
        if "No module named 'sglang_ddtree'" in (res.get("stderr") or ""):
            return EXIT_FAILED, ("the active release's venv has no sglang_ddtree (the serving plugin the tools run "
                                 "with): deploy a release built by this toolkit first"), None
        return EXIT_FAILED, f"the bench module exited {res.get('rc')} without a report: {tail}", None
    try:
        rep = parse_report(raw)
    except BadReport as exc:
        return EXIT_FAILED, f"the host's report was refused: {exc}", None
    if rep.get("error"):
        return EXIT_FAILED, f"bench failed: {rep['error']}", rep
    if not rep["runs"]:
        return EXIT_FAILED, "bench measured nothing", rep
    failed = [r for r in rep["runs"] if r["status"] != "ok"]
    n = sum(len(r["levels"]) for r in rep["runs"])
    line = f"{len(rep['runs']) - len(failed)}/{len(rep['runs'])} servers measured ({n} levels)"
    if failed:
        return EXIT_FAILED, line + "; failed: " + "; ".join(
            f"{r['mode']}{' B=%s' % r['budget'] if r['budget'] else ''} graphs={'on' if r['graphs'] else 'off'}: "
            f"{failure_line(r.get('error'))}" for r in failed[:4]), rep
    return EXIT_OK, "ok: " + line, rep


def host_command(plan: BenchPlan) -> list[str]:
    """The command line the host op will run for `plan` (built by the op's own function, shown by --dry-run)."""
    from .remote.host.bench import bench_argv

    work = "/tmp/" + plan.prefix + "-op-XXXX"
    return bench_argv(f"{plan.venv}/bin/python", plan.agent_args(), work + "/report.json", int(plan.deadline) - 15,
                      work)


def run(inv: Inventory, host: Host, on_plan=None, dry_run: bool = False, **kw) -> dict:
    """Plan and run the benchmark on `host`: {plan, result, exit, line, record, saved} (plan None when refused
    or unreachable); a checked report is kept (save_result) even when some of its runs failed. `dry_run`: the
    read-only probe and the plan only (with the host's command line), nothing started."""
    from .release.layout import host_args
    from .remote.client import Remote
    from .ssh import run_per_host

    models = sorted({s.model for s in host.services if s.enabled and s.model})

    def one(conn, h):
        remote = Remote(conn, h.name)
        probe = remote.call("release.probe", host_args(h) | {"models": models}, deadline=PROBE_DEADLINE)
        try:
            plan = plan_bench(h, probe, **kw)
        except BenchRefused as exc:
            return None, str(exc)
        if on_plan:
            on_plan(plan)
        if dry_run:
            return plan, None
        w = tools.wheel()  # the measurement tools travel with the call, for this run only
        return plan, remote.call("bench.run", plan.agent_args() | {"tools": w.agent_args()}, deadline=plan.deadline,
                                 data=w.data)

    (r,) = run_per_host(inv, [host], one, label="bench")
    if not r.ok:
        return {"plan": None, "result": None, "exit": EXIT_FAILED, "line": f"{r.kind}: {r.error}"}
    plan, res = r.value
    if plan is None:
        return {"plan": None, "result": None, "exit": EXIT_CANNOT_RUN, "line": f"refused: {res}"}
    if dry_run:
        return {"plan": plan.to_json(), "command": host_command(plan), "result": None, "exit": EXIT_OK,
                "line": "dry run: nothing started", "record": None, "saved": None}
    code, line, rep = outcome(res)
    jit = smokemod.jit_line(res)  # how its servers started: warm (a copy of the service's JIT caches) or cold
    out = {"plan": plan.to_json(), "result": {k: res.get(k) for k in ("rc", "timed_out", "seconds")},
           "exit": code, "line": line, "record": None, "saved": None, "jit": jit}
    if rep is not None and any(run["levels"] for run in rep["runs"]):
        rec = result_record(plan, rep) | {"jit": jit}
        out["record"] = rec
        out["saved"] = str(save_result(inv.path, rec))
    return out
