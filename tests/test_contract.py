"""The plugin's contract (overlays/sglang-ddtree/src/sglang_ddtree/contract.py) is the one place a mode name, the
linear = dflash alias, an environment name of the plugin, a budget bound or D = B + 1 is written; one builder makes
a server's SGLang argv and env for the unit and for the plugin's transient servers; and neither deploy/ nor the
plugin has an import cycle."""
from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "overlays" / "sglang-ddtree" / "src" / "sglang_ddtree"
TOOLS = ROOT / "overlays" / "sglang-ddtree-tools" / "src" / "sglang_ddtree_tools"
CONTRACT = PLUGIN / "contract.py"


def _contract():
    from deploy import contract
    return contract


# ----------------------------------------------------------------------------- one file, three packages
def test_the_control_side_and_the_agent_import_the_plugins_own_file():
    for link in (ROOT / "deploy" / "contract.py", ROOT / "deploy" / "remote" / "host" / "contract.py"):
        assert link.is_symlink() and link.resolve() == CONTRACT.resolve(), link
    from deploy.remote import zipapp
    assert zipapp.sources()["contract.py"] == CONTRACT.read_bytes()  # the agent carries the same bytes


def test_the_contract_is_stdlib_only():
    tree = ast.parse(CONTRACT.read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert mods <= {"__future__"}, mods
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], "no relative import"


def test_capabilities_json_declares_what_the_contract_says():
    c = _contract()
    caps = json.loads((PLUGIN / "capabilities.json").read_text())
    assert tuple(caps["modes"]) == c.PLUGIN_MODES and caps["default_mode"] == c.DEFAULT_PLUGIN_MODE
    assert (caps["mode_env"], caps["budget_env"], caps["plugin_allowlist_env"]) == (
        c.MODE_ENV, c.BUDGET_ENV, c.PLUGIN_ALLOWLIST_ENV)
    assert (caps["algorithm"], caps["entry_point"]["name"]) == (c.ALGORITHM_DDTREE, c.PLUGIN_NAME)
    for v in caps["per_version"].values():
        assert set(v["modes"]) <= set(c.PLUGIN_MODES)
        assert v["tree_verify_attention_backends"] == [c.ATTENTION_BACKEND]


def test_budget_schedule_parse_text_and_widths():
    """A schedule by batch size: validated, one canonical text (the plugin's variable), the budget and width of each
    batch size, D = its largest width; a plain budget answers the same everywhere."""
    c = _contract()
    s = c.parse_budget({1: 127, 4: 31, 16: 15, 64: c.CHAIN})
    assert str(s) == c.budget_text(s) == "1:127,4:31,16:15,64:chain" and c.parse_budget(str(s)) == s
    assert [c.budget_for(s, n) for n in (1, 3, 4, 15, 16, 63, 64, 4096)] == [127, 127, 31, 31, 15, 15, c.CHAIN, c.CHAIN]
    assert c.schedule_widths(s, 16) == {1: 128, 4: 32, 16: 16, 64: 16} and c.draft_tokens(c.TREE_VERIFY, s, 16) == 128
    assert c.draft_tokens(c.TREE_VERIFY, "1:7,4:chain", 16) == 16  # chain wider than the largest tree
    assert c.step_width(s, 70, 8) == 8 and c.largest_budget(s) == 127
    assert c.budget_for(31, 500) == 31 and c.step_width(31, 500, 16) == 32
    assert c.parse_budget("1:31, 4:31, 8:15") == c.parse_budget({1: 31, 8: 15})  # repeats dropped
    assert c.parse_budget({1: 31, 4: 31}) == 31 == c.parse_budget("31")  # one entry: the plain budget
    assert c.budget_problem(s) is None and c.budget_problem(s, c.TREE_VERIFY) is None
    assert "only tree-verify serves" in c.budget_problem(s, c.SHADOW_LINEAR)
    env = dict(c.sglang_env(c.TREE_VERIFY, s, 0))
    assert env[c.BUDGET_ENV] == "1:127,4:31,16:15,64:chain" and dict(c.sglang_env(c.TREE_VERIFY, 15, 0))[
        c.BUDGET_ENV] == "15"
    args = c.sglang_args(c.TREE_VERIFY, "/m", "/d", budget=s, block=16, host="h", port=1, decode_graphs=True)
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "128"
    with pytest.raises(ValueError, match="needs the drafter's block size"):
        c.draft_tokens(c.TREE_VERIFY, "1:31,4:chain", None)
    for bad, msg in [({2: 5}, "starts at batch size 1"), ({1: c.CHAIN}, "starts with a node budget"),
                     ("1:5,1:4", "must ascend"), ({1: c.BUDGET_MAX + 1}, "must be an integer in"),
                     ("1:15,4:chain,8:3", "must not increase"), ("1:15,4:31", "must not increase"),
                     ("1:15,x:3", "threshold 'x'"), ("15;31", "neither an integer nor a schedule"),
                     (True, "an integer or a schedule"), ({}, "at least one entry"), ("1-15", "neither")]:
        with pytest.raises(ValueError, match=msg):
            c.parse_budget(bad)
        assert c.budget_problem(bad)


def test_budget_bound_is_the_plugins_gpu_tree_kernel_bound():
    c = _contract()
    assert c.budget_problem(c.BUDGET_MAX) is None and c.budget_problem(c.BUDGET_MIN) is None
    assert c.budget_problem(c.BUDGET_MAX + 1) and c.budget_problem(0) and c.budget_problem(True)
    assert c.draft_tokens(c.TREE_VERIFY, 7, 16) == 8 and c.budget_of(8) == 7
    assert c.draft_tokens(c.SHADOW_LINEAR, 7, 16) == 16 and c.draft_tokens(c.PLAIN, 7, 16) is None
    # the kernel packs node fields in 10 bits (tree_kernels); its own bound is the contract's
    src = (PLUGIN / "tree_kernels.py").read_text()
    assert "MAX_TRITON_BUDGET = contract.BUDGET_MAX" in src and "& 1023" in src


# ----------------------------------------------------------------------------- written once
# "auto" (the inventory's mode) is not scanned as a bare word: it also names a launcher, a tree builder backend
# and a manifest field; the inventory loader and the deploy take it from the contract (contract.AUTO).
MODE_WORDS = {"linear", "shadow-linear", "tree-verify", "dflash", "plain"}
ENV_WORDS = {"SGLANG_DDTREE_MODE", "SGLANG_DDTREE_BUDGET", "SGLANG_DDTREE_OVERLAP", "SGLANG_PLUGINS"}
ALGO_WORDS = {"DDTREE", "DFLASH"}
BOUNDS = {511, 512, 1023}
# the control side (the inventory loader included), the host agent, the plugin and its GPU checks
SCANNED = [ROOT / "deploy", PLUGIN, TOOLS, ROOT / "overlays" / "sglang-ddtree" / "gpu_checks"]


def _docstrings(tree) -> set[int]:
    ids = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _budgetish(node) -> bool:
    return bool(re.search(r"budget|\bb_env|\bB\b", ast.unparse(node)))


def _a_budget(node) -> bool:
    """A budget itself: a name or attribute that says budget (or b_env_i), or int() of one."""
    if isinstance(node, ast.Call) and len(node.args) == 1 and ast.unparse(node.func) == "int":
        node = node.args[0]
    return isinstance(node, (ast.Name, ast.Attribute)) and _budgetish(node)


def written_outside(path: Path) -> list[str]:
    """Where `path` (a Python file) writes a mode name, an env name, an algorithm, a budget bound or D = B + 1
    itself: a string constant equal to one (not a docstring, not inside a longer sentence), an int bound
    compared with or passed beside a budget, `<budget> + 1` / `<D> - 1`."""
    tree = ast.parse(path.read_text())
    docs, out = _docstrings(tree), []
    rel = path.relative_to(ROOT)
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            if n.value in MODE_WORDS | ENV_WORDS | ALGO_WORDS:
                out.append(f"{rel}:{n.lineno}: {n.value!r}")
        elif isinstance(n, ast.BinOp) and isinstance(n.right, ast.Constant) and n.right.value == 1:
            if isinstance(n.op, ast.Add) and _a_budget(n.left):
                out.append(f"{rel}:{n.lineno}: {ast.unparse(n)} (D = B + 1)")
        elif isinstance(n, (ast.Compare, ast.Call, ast.Tuple, ast.Assign)):
            ints = [c.value for c in ast.walk(n) if isinstance(c, ast.Constant) and type(c.value) is int]
            if any(v in BOUNDS for v in ints) and _budgetish(n):
                out.append(f"{rel}:{n.lineno}: {ast.unparse(n)[:80]} (a budget bound)")
    return sorted(set(out), key=lambda f: int(f.split(":")[1]))


# Places that must write a name themselves, each with why:
ALLOWED = {
    # The lab's stand-in for SGLang runs as a lone script on a lab host (release_root/current/labserver/server.py,
    # nothing beside it to import): it logs the plugin's mode variable and answers DDTREE's accept rate as
    # SGLang with the plugin would.
    "deploy/labserver/server.py",
}


def test_modes_budgets_and_env_names_are_written_only_in_the_contract():
    found = []
    for base in SCANNED:
        for p in sorted(base.rglob("*.py")):
            if p.resolve() == CONTRACT.resolve() or "__pycache__" in p.parts:
                continue
            found += [f for f in written_outside(p) if f.split(": ", 1)[0] not in ALLOWED
                      and f.split(":", 1)[0] not in ALLOWED]
    for p in sorted((ROOT / "systemd").glob("*.j2")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if any(w in line for w in ENV_WORDS | {"tree-verify", "shadow-linear"}):
                found.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}")
    assert not found, "written outside the contract (import it from sglang_ddtree.contract / deploy.contract):\n" \
        + "\n".join(found)


def test_the_scan_finds_what_it_is_for(tmp_path):
    """The scan above is not vacuous: each kind of restatement is found in a file that writes it."""
    p = ROOT / "deploy" / "_probe_written_outside.py"
    p.write_text('"""doc: tree-verify here is prose."""\nM = ("tree-verify", "x")\nE = "SGLANG_DDTREE_BUDGET"\n'
                 'def f(budget):\n    d = budget + 1\n    return 1 <= budget <= 1023\n')
    try:
        got = written_outside(p)
    finally:
        p.unlink()
    assert [g.split(": ", 1)[1][:16] for g in got] == ["'tree-verify'", "'SGLANG_DDTREE_B", "budget + 1 (D = ",
                                                       "1 <= budget <= 1"], got
    assert all(g.startswith("deploy/_probe_written_outside.py:") for g in got)


# ----------------------------------------------------------------------------- one builder
def _plugin():
    """The plugin tools' bench and servers from this checkout's overlay sources (the venv's installed copies may
    be another checkout's)."""
    import sys
    for src in (str(TOOLS.parent), str(PLUGIN.parent)):
        if src not in sys.path:
            sys.path.insert(0, src)
    import sglang_ddtree
    import sglang_ddtree_tools
    for mod, want in ((sglang_ddtree, PLUGIN), (sglang_ddtree_tools, TOOLS)):
        have = Path(mod.__file__).resolve().parent
        stale = [f.name for f in want.glob("*.py") if not (have / f.name).is_file()
                 or (have / f.name).read_bytes() != f.read_bytes()]
        if stale:  # an installed copy (scripts/bootstrap's) that is not this checkout's
            pytest.fail(f"{mod.__name__} comes from {have}, which differs from this checkout in {stale[:3]}: "
                        f"run scripts/bootstrap or PYTHONPATH={want.parent}")
    bench = pytest.importorskip("sglang_ddtree_tools.bench")
    from sglang_ddtree_tools import servers
    return bench, servers


def _without(argv: list[str], flags: dict[str, int]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags:
            i += 1 + flags[argv[i]]
            continue
        out.append(argv[i])
        i += 1
    return out


@pytest.mark.parametrize("mode", ["linear", "shadow-linear", "tree-verify"])
@pytest.mark.parametrize("graphs", [True, False])
def test_the_bench_server_is_the_unit_but_for_host_port_and_gpu(mode, graphs):
    """For every mode, what `fab bench` starts on a host for a service (deploy/bench.py's plan -> the plugin bench's
    runs -> servers.server_argv/server_env) is what the unit runs for that service: the same argv but for the
    host, the port and the unit's or the harness's own flags (render.UNIT_FLAGS, servers.HARNESS_FLAGS), and the
    same plugin environment but for the GPU."""
    from deploy import contract
    from deploy.inventory import load_inventory
    from deploy.release import render
    bench, servers = _plugin()
    inv = load_inventory(str(ROOT / "inventory" / "hosts.yaml"))
    host = inv.hosts["ct200"]
    svc = dataclasses.replace(host.services[1], mode=mode, budget=31, cuda_graphs=graphs)
    unit = render.service_argv(host, svc)
    (run,) = [r for r in bench.plan_runs([contract.bench_name(mode)], [svc.budget], "on" if graphs else "off",
                                         svc.block_size)]
    sizing = bench.Sizing(max_running=4, context_length=1024, max_total_tokens=32768, max_mamba_cache=48, kv_mib=1.0)
    spec = bench.spec_for(run, svc.model, svc.draft_model, sizing, 0.2)
    srv = servers.server_argv(f"{host.vars['venv']}/bin/python", spec, port=41234)
    place = dict.fromkeys(contract.PLACE_FLAGS, 1)
    assert srv[srv.index("--port") + 1] == "41234" and unit[unit.index("--port") + 1] == str(svc.port)
    assert _without(srv, place | servers.HARNESS_FLAGS) == _without(unit, place | render.UNIT_FLAGS)
    assert unit[unit.index("--attention-backend") + 1] == "triton" and unit[unit.index("--page-size") + 1] == "1"
    env_unit = dict(render.service_env(svc))
    env_srv = servers.server_env(spec, gpu=5, base={})
    assert (env_unit["CUDA_VISIBLE_DEVICES"], env_srv["CUDA_VISIBLE_DEVICES"]) == (str(svc.gpu), "5")
    names = [contract.PLUGIN_ALLOWLIST_ENV, contract.MODE_ENV, contract.BUDGET_ENV, "CUDA_DEVICE_ORDER"]
    assert {k: env_unit.get(k) for k in names} == {k: env_srv.get(k) for k in names}
    assert (env_unit.get(contract.MODE_ENV), env_unit.get(contract.BUDGET_ENV)) == (
        (mode, "31") if contract.is_ddtree(mode) else (None, None))


# ----------------------------------------------------------------------------- no import cycle
def import_graph(pkg_dir: Path, pkg: str) -> dict[str, set[str]]:
    """{module: modules of the same package it imports}, from the source (every import statement, at the top or
    inside a function: a lazy import still ties the two modules together; `if TYPE_CHECKING:` ones excepted)."""
    mods = {}
    for p in sorted(pkg_dir.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        parts = list(p.relative_to(pkg_dir).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join([pkg] + parts)] = (p, is_pkg)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, (p, is_pkg) in mods.items():
        tree = ast.parse(p.read_text())
        skip = {id(n) for t in ast.walk(tree) if isinstance(t, ast.If) and "TYPE_CHECKING" in ast.unparse(t.test)
                for b in t.body for n in ast.walk(b)}
        here = mod if is_pkg else mod.rpartition(".")[0]
        out = set()
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.Import):
                out |= {resolve(a.name) for a in n.names if a.name.split(".")[0] == pkg}
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = here
                    for _ in range(n.level - 1):
                        base = base.rpartition(".")[0]
                    target = f"{base}.{n.module}" if n.module else base
                elif (n.module or "").split(".")[0] == pkg:
                    target = n.module
                else:
                    continue
                for a in n.names:
                    sub = f"{target}.{a.name}"
                    out.add(sub if sub in mods else resolve(target))
        out.discard(None)
        out.discard(mod)
        graph[mod] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of `graph` (one per strongly connected component of more than one module)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("where, pkg", [("deploy", "deploy"),
                                        ("overlays/sglang-ddtree/src/sglang_ddtree", "sglang_ddtree"),
                                        ("overlays/sglang-ddtree-tools/src/sglang_ddtree_tools",
                                         "sglang_ddtree_tools")])
def test_no_import_cycle(where, pkg):
    found = cycles(import_graph(ROOT / where, pkg))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_sees_a_lazy_cycle(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    g = import_graph(pkg, "p")
    assert g["p.a"] == {"p.sub.b"} and g["p.sub.b"] == {"p.a"} and g["p.c"] == set()
    assert cycles(g) == [["p.a", "p.sub.b"]]
