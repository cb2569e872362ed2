"""Smoke test of the environment and the DDTree payload on one GPU: ``python -m sglang_ddtree_tools.smoke``.

Runs where SGLang and this plugin are installed (a fleet host's managed venv,
driven by ``fab smoke``, or any GPU box).  It writes the tiny seeded model of
the requested family (:mod:`sglang_ddtree_tools.tiny`) into a private temporary
directory, starts transient SGLang servers on one GPU (a free loopback port
each, always torn down: ``systemd-run`` units with a runtime cap on a systemd
host, or a process session otherwise) and checks:

1. the mode's greedy tokens pass the *lossless statistic*: every emitted token
   is re-scored by one prefill of the plain (non-speculative) server with its
   top-2 log-probs, and a token that is not the target's argmax by more than
   ``--margin`` nats (default 0.05, above bf16 noise) counts as a violation;
   there must be none.  The exact-match rate against plain decoding is
   reported too (it is not the test: bf16 verify and decode kernels round
   differently at near-ties);
2. the server reports the algorithm (``/server_info``) and, for speculative
   modes, an accept length (``meta_info.spec_accept_length``);
3. a request the mode cannot serve (``return_logprob``) is rejected alone and
   the server answers the next request.

Modes: ``tree-verify``, ``shadow-linear`` (DDTREE), ``linear`` / ``dflash`` (SGLang's
own DFLASH chain, what a fleet service in mode ``linear`` runs), ``plain``.  With
``--user`` the servers run as that user (``systemd-run --uid``) and the private
work directory is handed to it.  Exit status: 0 all checks passed, 1 a check failed, 2 the host
cannot run it (no GPU device, SGLang missing) - said plainly on stderr.

The pure parts (argv, environment, prompts, the statistic) are tested on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from sglang_ddtree import contract
from sglang_ddtree.contract import DFLASH, LINEAR, PLAIN, SHADOW_LINEAR, TREE_VERIFY

# the transient servers (argv, environment, launch, health, teardown, GPU sizing) live in .servers, shared with
# the benchmark; re-exported here because gpu_checks and older callers use them through this module
from .servers import (MODES, Server, ServerSpec, free_port, gpu_device_problem, gpu_memory_mib,  # noqa: F401
                      load_service_env, server_argv, server_env, shared_gpu_fraction, wait_healthy)
from .servers import get as _get
from .servers import map_concurrent
from .servers import post as _post
DEFAULT_MARGIN = 0.05
EXIT_OK, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2

__all__ = [
    "MODES", "ServerSpec", "server_argv", "server_env", "make_prompts", "lossless_stats", "exact_match",
    "gpu_device_problem", "run_smoke", "main",
]


# ----------------------------------------------------------------------------- pure parts
def make_prompts(n: int, length: int = 12, seed: int = 1, lo: int = 100, hi: int = 31000) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


GAP_BUCKETS = (0.01, 0.07, 0.5)  # nats: ties, one bf16 step of logits below 16, a small model's near-ties, beyond


def lossless_stats(outputs: Sequence[Sequence[int]], rescored: Sequence[Sequence[tuple]],
                   margin: float = DEFAULT_MARGIN) -> dict:
    """The lossless statistic.  ``rescored[i][j]`` is ``(token_logprob, top1_logprob,
    top1_id)`` of emitted token ``outputs[i][j]`` under the target's prefill.
    A token is *off-argmax* when it is not the top-1 id; a *violation* when it
    is off-argmax by more than ``margin`` nats."""
    tokens = off = viol = 0
    gaps: List[float] = []
    worst = None
    for i, (out, rs) in enumerate(zip(outputs, rescored)):
        if len(rs) != len(out):
            raise ValueError(f"prompt {i}: {len(out)} emitted tokens but {len(rs)} re-scored")
        for j, (tok, (lp, best_lp, best_id)) in enumerate(zip(out, rs)):
            tokens += 1
            if tok == best_id:
                continue
            off += 1
            gap = float(best_lp) - float(lp)
            gaps.append(gap)
            if gap > margin:
                viol += 1
                if worst is None or gap > worst["gap"]:
                    worst = {"prompt": i, "position": j, "token": tok, "argmax": best_id, "gap": round(gap, 4)}
    # How far off: a bf16 logit in [8, 16) moves in steps of 0.0625, so rounding differences between the verify and
    # the re-score kernels land at <= 0.07 on a trained model's logits; a wrong state or mask moves whole nats.
    hist = {f"<={b}": 0 for b in GAP_BUCKETS}
    hist[f">{GAP_BUCKETS[-1]}"] = 0
    for g in gaps:
        hist[next((f"<={b}" for b in GAP_BUCKETS if g <= b), f">{GAP_BUCKETS[-1]}")] += 1
    return {"tokens": tokens, "off_argmax": off, "violations": viol, "margin": margin,
            "max_off_argmax_gap": round(max(gaps), 4) if gaps else 0.0, "worst_violation": worst,
            "off_argmax_gaps": hist}


def exact_match(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict:
    """Prompts whose outputs are identical, and the mean first divergence position."""
    same = sum(1 for x, y in zip(a, b) if list(x) == list(y))
    firsts = [next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
              for x, y in zip(a, b) if list(x) != list(y)]
    return {"identical": same, "prompts": min(len(a), len(b)),
            "mean_first_divergence": round(sum(firsts) / len(firsts), 1) if firsts else None}


def generate(base: str, prompts: Sequence[Sequence[int]], max_new: int, concurrency: int = 1,
             sampling: Optional[dict] = None) -> List[dict]:
    """``/generate`` by input_ids; returns per prompt {output_ids, meta_info}, in order."""
    sp = dict(sampling or {"temperature": 0}, max_new_tokens=max_new, ignore_eos=True)
    errors: List[str] = []

    def one(i, prompt):
        try:
            r = _post(base + "/generate", {"input_ids": list(prompt), "sampling_params": sp})
            return {"output_ids": r["output_ids"], "meta_info": r.get("meta_info", {})}
        except Exception as e:  # noqa: BLE001 - reported, the caller decides
            errors.append(f"prompt {i}: {type(e).__name__}: {e}")
            return None

    out = map_concurrent(one, list(prompts), concurrency)
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    return out  # type: ignore[return-value]


def rescore(base: str, prompt: Sequence[int], output: Sequence[int]) -> List[tuple]:
    """One prefill of ``prompt + output`` on a plain server with top-2 log-probs:
    ``(token_logprob, top1_logprob, top1_id)`` per emitted token."""
    r = _post(base + "/generate", {
        "input_ids": list(prompt) + list(output),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_logprob": True, "logprob_start_len": len(prompt) - 1, "top_logprobs_num": 2,
    })
    tok = r["meta_info"]["input_token_logprobs"]
    top = r["meta_info"]["input_top_logprobs"]
    # entry 0 is the last prompt token (its predicting distribution is not returned)
    rows = []
    for (lp, tid, *_), tp in list(zip(tok, top))[1:]:
        best = tp[0]
        rows.append((float(lp), float(best[0]), int(best[1])))
    return rows


UNSUPPORTED = {  # mode -> requests that mode cannot serve (rejected alone, the server keeps serving)
    TREE_VERIFY: [{"return_logprob": True}, {"sampling_params": {"frequency_penalty": 0.5}}],
    SHADOW_LINEAR: [{"return_logprob": True}],
    DFLASH: [{"return_logprob": True}],
    LINEAR: [{"return_logprob": True}],
}


def unsupported_request_check(base: str, prompt: Sequence[int], mode: str = TREE_VERIFY) -> dict:
    """Each request ``mode`` cannot serve is rejected alone, and the server answers the next one."""
    cases = []
    for extra in UNSUPPORTED.get(mode, []):
        body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        for k, v in extra.items():
            body[k] = dict(body[k], **v) if isinstance(v, dict) else v
        rejected, detail = False, ""
        try:
            r = _post(base + "/generate", body, timeout=120)
            fin = (r.get("meta_info") or {}).get("finish_reason") or {}
            rejected = isinstance(fin, dict) and fin.get("type") == "abort"
            detail = json.dumps(fin)[:300]
        except urllib.error.HTTPError as e:
            rejected, detail = True, f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
        nxt = generate(base, [prompt], 8)[0]
        cases.append({"request": extra, "rejected": rejected, "detail": detail,
                      "served_after": len(nxt["output_ids"]) == 8})
    return {"cases": cases, "rejected": all(c["rejected"] for c in cases),
            "served_after": all(c["served_after"] for c in cases)}


# ----------------------------------------------------------------------------- the run
@dataclass
class SmokeResult:
    ok: bool
    checks: Dict[str, dict] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)


def run_smoke(*, mode: str, family: str, gpu: int, python: str, workdir: str, prompts: int, tokens: int,
              budget: int, margin: float, launcher: str, start_timeout: float, concurrency: int,
              user: Optional[str] = None, unit_prefix: Optional[str] = None, runtime_max: int = 1800,
              service_env: Optional[Dict[str, str]] = None, log=print) -> SmokeResult:
    from . import tiny

    res = SmokeResult(ok=True)
    paths = tiny.write_family(workdir, family, seed=0)
    ps = make_prompts(prompts)
    servers: List[Server] = []
    try:
        used, total = gpu_memory_mib(gpu)
        caps = dict(mem_fraction=shared_gpu_fraction(used, total), max_total_tokens=65536,
                    max_mamba_cache=48 if family == "hybrid" else None)
        plain = ServerSpec(PLAIN, paths["target"], **caps)
        specs = [plain] if mode == PLAIN else [plain, ServerSpec(mode, paths["target"], paths["drafter"],
                                                                     budget=budget, **caps)]
        log(f"GPU {gpu}: {used:.0f} of {total:.0f} MiB in use; servers capped (--mem-fraction-static "
            f"{caps['mem_fraction']}, --max-total-tokens 65536)")
        bases = []
        for s in specs:
            port = free_port()
            srv = Server(server_argv(python, s, port), server_env(s, gpu, python=python, service=service_env),
                         os.path.join(workdir, f"{s.mode}.log"), launcher=launcher, user=user,
                         runtime_max_s=runtime_max, keep=service_env or (),
                         unit=f"{unit_prefix}-{s.mode}" if unit_prefix else None)
            servers.append(srv)
            srv.start()
            bases.append(f"http://127.0.0.1:{port}")
        for s, srv, base in zip(specs, servers, bases):
            t = wait_healthy(base, srv, start_timeout)
            log(f"{s.mode}: healthy after {t:.0f}s at {base}")
        plain_base, base = bases[0], bases[-1]
        t0 = time.time()
        got = generate(base, ps, tokens, concurrency=concurrency)
        wall = time.time() - t0
        outs = [g["output_ids"] for g in got]
        ref = generate(plain_base, ps, tokens) if mode != PLAIN else got
        stats = lossless_stats(outs, [rescore(plain_base, p, o) for p, o in zip(ps, outs)], margin)
        stats["exact_match_vs_plain"] = exact_match(outs, [g["output_ids"] for g in ref])
        stats["tokens_per_s"] = round(sum(len(o) for o in outs) / wall, 1)
        res.checks["lossless"] = stats
        if stats["violations"]:
            res.ok = False
            res.problems.append(f"{stats['violations']} emitted tokens are not the target's argmax by more than "
                                f"{margin} nats (worst {stats['worst_violation']})")
        info = _get(base + "/server_info") if mode != PLAIN else {}
        algo = (info.get("speculative_algorithm") or (info.get("server_args") or {}).get("speculative_algorithm"))
        accept = [g["meta_info"].get("spec_accept_length") for g in got]
        accept = [a for a in accept if a is not None]
        res.checks["reports"] = {"algorithm": algo, "mean_accept_length": round(sum(accept) / len(accept), 3)
                                 if accept else None,
                                 "spec_cap_length": [g["meta_info"].get("spec_cap_length") for g in got][:4]}
        if mode != PLAIN:
            want = contract.algorithm(mode)
            if algo != want or not accept:
                res.ok = False
                res.problems.append(f"server reports algorithm {algo!r} (want {want}) and accept lengths {accept[:3]}")
            un = unsupported_request_check(base, ps[0], mode)
            res.checks["unsupported_request"] = un
            if not (un["rejected"] and un["served_after"]):
                res.ok = False
                res.problems.append(f"unsupported request: {un}")
    finally:
        for srv in servers:
            srv.stop()
    return res


def emit(report: dict, path: Optional[str]) -> None:
    """The report on stdout and, given ``path`` (``--json``), in that file: every outcome, a failure included,
    so that a caller reading the file (the host agent's smoke op) always learns why."""
    if path:
        with open(path, "w") as fh:
            json.dump(report, fh, indent=1)
    print(json.dumps(report))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree_tools.smoke", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, default=TREE_VERIFY)
    ap.add_argument("--family", choices=("hybrid", "dense"), default="hybrid")
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--budget", type=int, default=15)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    ap.add_argument("--launcher", choices=("auto", "systemd-run", "process"), default="auto")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--python", default=sys.executable, help="the interpreter of the venv SGLang runs from")
    ap.add_argument("--user", help="run the servers as this user (systemd-run --uid); the work dir is handed to it")
    ap.add_argument("--unit-prefix", help="name the transient units <prefix>-<mode> (so a caller can stop them all)")
    ap.add_argument("--runtime-max", type=int, default=1800, help="RuntimeMaxSec of each transient unit")
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--service-env", help="a JSON file of the GPU's service environment: the servers run with it")
    a = ap.parse_args(argv)
    problem = gpu_device_problem(a.gpu)
    if problem:
        print(f"smoke: cannot run: {problem}", file=sys.stderr)
        emit({"ok": False, "cannot_run": problem}, a.json)
        return EXIT_CANNOT_RUN
    workdir = tempfile.mkdtemp(prefix="ddtree-smoke-")  # 0700: private to the smoke run
    if a.user:
        shutil.chown(workdir, user=a.user)  # the servers (run as the user) read the models and write their logs
    try:
        res = run_smoke(mode=a.mode, family=a.family, gpu=a.gpu, python=a.python, workdir=workdir,
                        prompts=a.prompts, tokens=a.tokens, budget=a.budget, margin=a.margin, launcher=a.launcher,
                        start_timeout=a.start_timeout, concurrency=a.concurrency, user=a.user,
                        unit_prefix=a.unit_prefix, runtime_max=a.runtime_max,
                        service_env=load_service_env(a.service_env),
                        log=lambda m: print(m, file=sys.stderr, flush=True))
    except Exception as e:  # noqa: BLE001 - one clear line, non-zero exit
        emit({"ok": False, "error": f"{type(e).__name__}: {e}"}, a.json)  # the caller reads the file, not stdout
        return EXIT_FAILED
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    emit({"ok": res.ok, "mode": a.mode, "family": a.family, "gpu": a.gpu, "checks": res.checks,
          "problems": res.problems}, a.json)
    return EXIT_OK if res.ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
