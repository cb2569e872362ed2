"""`bench.run`: throughput and latency of the serving modes on one GPU of this host, with the active release's venv
and plugin.

It runs `{venv}/bin/python -m sglang_ddtree_tools.bench` (the plugin tools' host-side benchmark: one transient
SGLang server at a time, alone on the GPU, started with `systemd-run` as the service user, the prompts replayed at
each concurrency) the way `smoke.run` runs the smoke module (smoke.run_transient: the venv trust check, the tools
wheel carried by the call installed into a private work directory for this run only, the op's deadline, and every
transient unit of the run's prefix stopped at the end whatever happened).
The servers change nothing the deploy manages and the op takes no host lock. Every argument is checked whole here
again: the module's command line is built from them, never from a string.
"""
import json
import re

from . import contract
from .registry import Failure, op
from .smoke import TOOLS_MODULE, USER_RE, check_jit, run_transient

PREFIX_RE = re.compile(r"ddtree-bench-[0-9a-f]{8,32}\Z")
CPUS_RE = re.compile(r"[0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,63}\Z")  # 0-3,8 (AllowedCPUs=)
MODES = contract.BENCH_MODES
FAMILIES = ("hybrid", "dense")
PATH_RE = re.compile(r"/(?:[A-Za-z0-9_.+@=-]+/)*[A-Za-z0-9_.+@=-]+\Z")
# one --server-args word: deploy/values.py's ARG_RE (no whitespace, quotes, '\\', '#', '$', '%', ';'), so that the
# module's shlex.split gives the words back as they are; the control side also refuses the flags the tool sets
WORD_RE = re.compile(r"[A-Za-z0-9_.,:/=+@^~!&*()\[\]{}|<>?-]{1,4096}\Z")
PROMPTS_MAX = 4096
PROMPT_TOKENS_MAX = 32768


def _int(a, k, lo, hi, optional=False):
    v = a.get(k)
    if v is None and optional:
        return
    if not (isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi):
        raise Failure("bad-args", "%s must be an integer in [%d, %d]" % (k, lo, hi))


def _ints(a, k, lo, hi, most):
    v = a.get(k)
    if not (isinstance(v, list) and 1 <= len(v) <= most
            and all(isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi for x in v)):
        raise Failure("bad-args", "%s must be 1-%d integers in [%d, %d]" % (k, most, lo, hi))


def _budgets(a):
    """1-16 node budgets and budget schedules (each in its canonical text; tree-verify's only)."""
    v = a.get("budgets")
    if not (isinstance(v, list) and 1 <= len(v) <= 16):
        raise Failure("bad-args", "budgets must be 1-16 node budgets or schedules")
    for b in v:
        if isinstance(b, bool) or not isinstance(b, (int, str)) or (isinstance(b, str) and len(b) > 200):
            raise Failure("bad-args", "a budget must be an integer or a schedule's text")
        problem = contract.budget_problem(b, contract.TREE_VERIFY)
        if problem is None and isinstance(b, str) and contract.budget_text(b) != b:
            problem = "is not a schedule's canonical text"
        if problem:
            raise Failure("bad-args", "budget %r %s" % (str(b)[:80], problem))
    if any(isinstance(b, str) for b in v) and contract.SHADOW_LINEAR in (a.get("modes") or []):
        raise Failure("bad-args", "a budget schedule is served by tree-verify only, and modes has shadow-linear")


def _path(v, what):
    if not (isinstance(v, str) and PATH_RE.match(v) and "/../" not in v + "/" and "/./" not in v + "/"):
        raise Failure("bad-args", "%s must be an absolute path of plain names" % what)


def check_args(a):
    _int(a, "gpu", 0, 63)
    if not (isinstance(a.get("modes"), list) and a["modes"] and all(m in MODES for m in a["modes"])):
        raise Failure("bad-args", "modes must be a list of %s" % (MODES,))
    _budgets(a)
    _ints(a, "concurrency", 1, 1024, 16)
    if a.get("graphs") not in ("on", "off", "both"):
        raise Failure("bad-args", "graphs must be on, off or both")
    _int(a, "block", 2, 64)
    _int(a, "max_new_tokens", 1, 8192)
    _int(a, "requests", 1, 4096, optional=True)
    _int(a, "num_prompts", 1, PROMPTS_MAX)
    _int(a, "prompt_len", 1, 8192)
    _int(a, "seed", 0, 2 ** 31)
    _int(a, "rounds", 1, 20, optional=True)
    if a.get("overlap", "default") not in ("default", "off", "on", "both"):
        raise Failure("bad-args", "overlap must be default, off, on or both")
    if a.get("cpus") is not None and not (isinstance(a["cpus"], str) and CPUS_RE.match(a["cpus"])):
        raise Failure("bad-args", "cpus must be a CPU list like 0-3,8")
    if a.get("user") is not None and not USER_RE.match(a["user"]):
        raise Failure("bad-args", "user must be a plain user name")
    if not PREFIX_RE.match(a.get("prefix") or ""):
        raise Failure("bad-args", "prefix must be ddtree-bench-<hex>")
    check_jit(a)
    words = a.get("server_args") or []
    if not (isinstance(words, list) and len(words) <= 64 and all(isinstance(w, str) and WORD_RE.match(w)
                                                                  for w in words)):
        raise Failure("bad-args", "server_args must be a list of plain words")
    if a.get("tiny") is not None:
        if a["tiny"] not in FAMILIES:
            raise Failure("bad-args", "tiny must be one of %s" % (FAMILIES,))
    else:
        _path(a.get("model"), "model")
        if a.get("draft_model") is not None:
            _path(a["draft_model"], "draft_model")
        elif a["modes"] != [contract.PLAIN]:
            raise Failure("bad-args", "every mode but plain needs draft_model")
    ps = a.get("prompts")
    if ps is not None:
        if not (isinstance(ps, list) and 1 <= len(ps) <= PROMPTS_MAX):
            raise Failure("bad-args", "prompts must be a list of 1-%d prompts" % PROMPTS_MAX)
        for p in ps:
            if not (isinstance(p, list) and 1 <= len(p) <= PROMPT_TOKENS_MAX
                    and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 31 for t in p)):
                raise Failure("bad-args", "each prompt must be a list of token ids")


def bench_argv(python, a, report, runtime_max, work):
    """The bench module's command line (the control side shows the same fields in its plan)."""
    argv = [python, "-m", TOOLS_MODULE + ".bench", "--gpu", str(a["gpu"]), "--modes", ",".join(a["modes"]),
            "--budgets", contract.budgets_word(a["budgets"]), "--concurrency", ",".join(map(str, a["concurrency"])),
            "--graphs", a["graphs"], "--block", str(a["block"]), "--max-new-tokens", str(a["max_new_tokens"]),
            "--num-prompts", str(a["num_prompts"]), "--prompt-len", str(a["prompt_len"]), "--seed", str(a["seed"]),
            "--launcher", "systemd-run", "--unit-prefix", a["prefix"], "--runtime-max", str(int(runtime_max)),
            "--json", report]
    if a.get("tiny"):
        argv += ["--tiny-train", "--family", a["tiny"]]
    else:
        argv += ["--model", a["model"]] + (["--draft-model", a["draft_model"]] if a.get("draft_model") else [])
    if a.get("requests"):
        argv += ["--requests", str(a["requests"])]
    if a.get("rounds") and a["rounds"] > 1:
        argv += ["--rounds", str(a["rounds"])]
    if a.get("cpus"):
        argv += ["--cpus", a["cpus"]]
    if a.get("overlap", "default") != "default":  # a plugin from before --overlap is never asked for it
        argv += ["--overlap", a["overlap"]]
    if a.get("prompts") is not None:
        argv += ["--prompts", work + "/prompts.json"]
    if a.get("server_args"):
        argv += ["--server-args", " ".join(a["server_args"])]  # plain words only (WORD_RE): split back as is
    if a.get("user"):
        argv += ["--user", a["user"]]
    return argv


@op("bench.run")
def run(ctx, a):
    check_args(a)
    inputs = {"prompts.json": json.dumps(a["prompts"])} if a.get("prompts") is not None else None
    return run_transient(ctx, a["venv"], a["prefix"], lambda python, report, rmax, work: bench_argv(
        python, a, report, rmax, work), a.get("tools"), inputs=inputs, jit=a, service_env=a.get("env"))
