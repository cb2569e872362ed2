"""The rollout gate's canary (control side, pure): what a restarted GPU server must prove before it goes back into
the router, planned here and run by the host agent's gate (deploy/remote/host/gate.py, `canary`).

Lossless: a few held prompts are generated greedy on the new server, then re-scored by the same server's own
prefill (a prefill-only request, max_new_tokens 0 with input-token logprobs: the target's own forward, no
speculation; the plugin admits exactly that request in its speculative modes). Every emitted token must be within
`margin` nats of the target's argmax at its position (0.125 nats by default: the bf16 step of the logits measured
in benchmarks/results/ddtree_issue12_h200.md, where ties within it are not a fault of the speculation).

Paying: the accept length of the canary's generations (SGLang's own per-request figures summed as `fab bench`
sums them: completion tokens over `spec_verify_ct`; else the mean of each request's `spec_accept_length`, as
serve_matrix averaged it on the H200; else the server's /metrics `sglang:spec_accept_length`) must be at or above
a floor: the inventory's `accept_floor`, else FLOOR_FRACTION x the accept length `fab bench` measured on this host
for the plugin being deployed (its source digest: each deploy is a new release id, the plugin source is what was
measured), in this mode and budget, at its lowest measured concurrency (the canary sends one request at a time).
No floor when no such bench result is kept (the deploy's log says so).

The inventory's `canary:` mapping (any scope; validated with file:line like every inventory value):

    canary:
      enabled: true          # false: no canary (the gate's other steps still run)
      prompts: [...]         # strings (sent as text) or lists of token ids (sent as input_ids, for servers
                             # started with --skip-tokenizer-init); default: the tiny kit's held prompts
      tokens: 24             # generated per prompt
      margin: 0.125          # nats
      accept_floor: 3.0      # or null: from the host's bench result
"""
from __future__ import annotations

import math
import random

from . import contract

DEFAULT_TOKENS = 24
DEFAULT_MARGIN = 0.125
FLOOR_FRACTION = 0.8
MAX_PROMPTS = 16
MAX_PROMPT_CHARS = 4096
MAX_PROMPT_IDS = 4096
TOKEN_ID_MAX = 1 << 31


def kit_prompts(n: int = 4, length: int = 12, seed: int = 1, lo: int = 100, hi: int = 31000) -> list[list[int]]:
    """The tiny kit's held prompts (sglang_ddtree_tools.smoke.make_prompts: token ids any target's vocabulary holds;
    a test keeps the two equal)."""
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


DEFAULTS = {"enabled": True, "tokens": DEFAULT_TOKENS, "margin": DEFAULT_MARGIN, "accept_floor": None}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _prompt_problem(p) -> str | None:
    if isinstance(p, str):
        if not p.strip() or len(p) > MAX_PROMPT_CHARS or any(ord(c) < 32 and c not in "\n\t" for c in p):
            return f"a text prompt must be 1-{MAX_PROMPT_CHARS} printable characters, got {p[:40]!r}"
        return None
    if isinstance(p, list):
        if not 1 <= len(p) <= MAX_PROMPT_IDS or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < TOKEN_ID_MAX for x in p):
            return f"a token-id prompt must be a list of 1-{MAX_PROMPT_IDS} integers in [0, 2^31)"
        return None
    return f"a prompt is a string or a list of token ids, got {p!r}"


CANARY_KEYS = {
    "enabled": (lambda v: isinstance(v, bool), "true or false"),
    "tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 512,
               "an integer in [1, 512]"),
    "margin": (lambda v: _number(v) and 0 < v <= 10, "nats, a number in (0, 10]"),
    "accept_floor": (lambda v: v is None or (_number(v) and 0 <= v <= 1024), "a number in [0, 1024] or null"),
    "prompts": (lambda v: isinstance(v, list) and 1 <= len(v) <= MAX_PROMPTS and not any(map(_prompt_problem, v)),
                f"a list of 1-{MAX_PROMPTS} prompts (strings, or lists of token ids)"),
}


def check(v):
    """The inventory check of a `canary:` mapping: None, or [(key, message)] (each at its key's line)."""
    if not isinstance(v, dict):
        return f"must be a mapping with keys {', '.join(CANARY_KEYS)}, got {v!r}"
    out = []
    for k, x in v.items():
        if k not in CANARY_KEYS:
            out.append((k, f"{k}: unknown key (allowed: {', '.join(sorted(CANARY_KEYS))})"))
            continue
        ok, desc = CANARY_KEYS[k]
        if not ok(x):
            why = next((p for p in map(_prompt_problem, x) if p), None) if k == "prompts" and isinstance(x, list) \
                else None
            out.append((k, f"{k}: must be {desc}" + (f": {why}" if why else f", got {x!r}")))
    return out


def settings(host_vars: dict) -> dict:
    """The host's canary settings, defaults filled in."""
    return dict(DEFAULTS, **(host_vars.get("canary") or {}))


def bench_floor(results: list[dict], *, plugin_digest: str | None, model: str | None, draft_model: str | None,
                mode: str, budget: int | None) -> tuple[float | None, str]:
    """(FLOOR_FRACTION x the accept length bench measured, where it came from) or (None, why there is none).
    `results`: deploy.bench.load_results of the host."""
    if contract.is_ddtree(mode) and contract.is_schedule(budget):
        # the canary sends one request at a time: a schedule serves it at its budget for one request
        budget = contract.budget_for(budget, 1)
    want = f"mode {mode}" + (f" B={budget}" if contract.is_ddtree(mode) else "")
    if not plugin_digest:
        return None, "the plugin has no source digest to match bench results against"
    mine = [r for r in results if (r.get("plugin") or {}).get("source_digest") == plugin_digest
            and not r.get("tiny") and r.get("model") == model and r.get("draft_model") == draft_model]
    best = None
    for rec in sorted(mine, key=lambda r: (str(r.get("created")), str(r.get("release"))), reverse=True):
        for run in (rec.get("report") or {}).get("runs") or []:
            ran = contract.deploy_name(run.get("mode"))
            if ran not in contract.MODES or ran != mode or (contract.is_ddtree(mode) and run.get("budget") != budget):
                continue
            lvs = [lv for lv in run.get("levels") or [] if not lv.get("errors") and lv.get("accept_length")]
            if lvs:
                lv = min(lvs, key=lambda x: x["concurrency"])
                best = (lv["accept_length"], f"bench {rec.get('host')}/{rec.get('release')}.json "
                                             f"({rec.get('created')}), concurrency {lv['concurrency']}")
                break
        if best:
            break
    if best is None:
        return None, f"no bench result for this plugin, model pair and {want}"
    return round(FLOOR_FRACTION * float(best[0]), 3), f"{FLOOR_FRACTION} x {best[0]} ({best[1]})"


# Modes whose server admits the prefill-only logprob request: the plugin's (its admission hook). `linear` is
# SGLang's own DFLASH without the plugin loaded, which refuses every return_logprob: its canary checks the
# accept length only.
RESCORE_MODES = contract.PLUGIN_MODES


def spec(cfg: dict, floor: float | None, floor_source: str, rescore: bool = True) -> dict | None:
    """What the host agent's gate runs for one service (None: no canary); `rescore`: the lossless check too."""
    if not cfg.get("enabled", True):
        return None
    prompts = cfg.get("prompts") or kit_prompts()
    return {"prompts": [{"input_ids": list(p)} if isinstance(p, list) else {"text": p} for p in prompts],
            "tokens": int(cfg["tokens"]), "margin": float(cfg["margin"]), "rescore": bool(rescore),
            "accept_floor": floor, "floor_source": floor_source}


def plan_host(host, results: list[dict], plugin_digest: str | None) -> tuple[dict, dict]:
    """({instance: canary spec or None}, {instance: the line that says its canary and floor}) for a host's
    enabled services, as the inventory names them (what `fab deploy` gates)."""
    return _plan(host.vars, [(s.instance, s.mode, s.model, s.draft_model, s.budget) for s in host.services
                             if s.enabled], results, plugin_digest)


def plan_manifest(host, manifest: dict, results: list[dict]) -> tuple[dict, dict]:
    """The same for the services of a release's manifest (what `fab restart` and `fab rollback` gate: the release
    that is restarted or rolled back to, with its own modes, budgets and plugin, read from the host and checked
    here: a service whose manifest entry is not what a release writes gets the canary without a floor)."""
    man = manifest if isinstance(manifest, dict) else {}
    svcs = man.get("services") if isinstance(man.get("services"), dict) else {}
    plugin = man.get("plugin") if isinstance(man.get("plugin"), dict) else {}
    rows = []
    for inst, s in svcs.items():
        if not isinstance(s, dict) or s.get("enabled", True) is False:
            continue
        mode = s.get("mode") if s.get("mode") in contract.MODES else None
        rows.append((inst, mode, _text(s.get("model")), _text(s.get("draft_model")), s.get("budget")))
    return _plan(host.vars, rows, results, _text(plugin.get("source_digest")))


def _text(v):
    return v if isinstance(v, str) else None


def _plan(host_vars: dict, services, results: list[dict], plugin_digest: str | None) -> tuple[dict, dict]:
    cfg = settings(host_vars)
    specs, notes = {}, {}
    for inst, mode, model, draft_model, budget in services:
        if not cfg.get("enabled", True):
            specs[inst] = None
            notes[inst] = "no canary (the inventory's canary.enabled is false)"
            continue
        if cfg.get("accept_floor") is not None:
            floor, src = float(cfg["accept_floor"]), "the inventory's accept_floor"
        elif mode is None:
            floor, src = None, "its release names no mode this toolkit knows"
        else:
            try:
                floor, src = bench_floor(results, plugin_digest=plugin_digest, model=model, draft_model=draft_model,
                                         mode=mode, budget=budget)
            except (TypeError, ValueError):  # a budget no release writes (a hand-edited manifest)
                floor, src = None, f"its budget {budget!r} is not one"
        rescore = mode in RESCORE_MODES
        specs[inst] = spec(cfg, floor, src, rescore)
        notes[inst] = (f"canary {len(specs[inst]['prompts'])} prompts x {cfg['tokens']} tokens, "
                       + (f"margin {cfg['margin']} nats, " if rescore else
                          f"no lossless re-score in {mode} mode (SGLang's DFLASH refuses logprobs), " if mode else
                          "no lossless re-score (a mode this toolkit does not know), ")
                       + (f"accept floor {floor} ({src})" if floor is not None else f"no accept floor: {src}"))
    return specs, notes


def attach(payload: dict, specs: dict, timeouts: dict) -> dict:
    """Give each gate of a release.apply payload's restart batches its canary and its start timeout."""
    for b in payload.get("batches") or []:
        for inst, g in b["gates"].items():
            if specs.get(inst) is not None:
                g["canary"] = specs[inst]
            if inst in timeouts:
                g["start_timeout"] = timeouts[inst]
    return payload
