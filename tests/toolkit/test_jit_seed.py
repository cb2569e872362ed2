"""The transient bench/smoke servers' JIT caches: seeded from a copy of the GPU's service caches (host agent's
jitcache), on real directory trees, and the cache variables reaching the servers' systemd-run units."""
from __future__ import annotations

import hashlib
import io
import os
import stat
import textwrap

import pytest

from deploy import bench, smoke
from deploy.inventory import load_inventory
from deploy.release import render
from deploy.remote.host import bench as hostbench
from deploy.remote.host import contract as hostcontract
from deploy.remote.host import jitcache
from deploy.remote.host import smoke as hostsmoke
from deploy.remote.host.registry import Context, Failure

KEY = "0123456789abcdef"
OLD = "fedcba9876543210"


def snapshot(top):
    """Every entry under `top`: its kind, inode, mode, size, mtime and content digest (links not followed)."""
    out = {}
    for root, dirs, files in os.walk(top):
        for n in dirs + files:
            p = os.path.join(root, n)
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).hexdigest()
            out[os.path.relpath(p, top)] = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_mode, st.st_size,
                                            st.st_mtime_ns, st.st_nlink, digest)
    return out


@pytest.fixture
def roots(tmp_path):
    svc = tmp_path / "sglang-ddtree"
    src = svc / "gpu1" / KEY
    (src / "triton" / "abc").mkdir(parents=True)
    (src / "triton" / "abc" / "kernel.cubin").write_bytes(b"\x7fELF" + os.urandom(4096))
    (src / "triton" / "abc" / "kernel.json").write_text('{"name": "k"}')
    (src / "flashinfer" / ".cache" / "flashinfer").mkdir(parents=True)
    (src / "flashinfer" / ".cache" / "flashinfer" / "op.so").write_bytes(os.urandom(2048))
    (src / "inductor").mkdir()
    secret = tmp_path / "secret"
    secret.write_text("not the service's")
    (src / "triton" / "link").symlink_to(secret)  # a link the service user could plant: never followed
    return svc, tmp_path / "ddtree-transient"


def seed(roots, **kw):
    svc, transient = roots
    return jitcache.seed("gpu1", KEY, service_root=str(svc), transient_root=str(transient), **kw)


def test_the_service_caches_are_copied_never_linked_and_left_unchanged(roots):
    svc, transient = roots
    src = svc / "gpu1" / KEY
    before = snapshot(src)
    env, res = seed(roots)
    assert snapshot(src) == before  # nothing of the service's changed: not a byte, a mode, an mtime, a link count
    dest = transient / "gpu1" / KEY
    for rel in ("triton/abc/kernel.cubin", "triton/abc/kernel.json", "flashinfer/.cache/flashinfer/op.so"):
        a, b = os.lstat(src / rel), os.lstat(dest / rel)
        assert (dest / rel).read_bytes() == (src / rel).read_bytes()
        assert stat.S_ISREG(b.st_mode) and b.st_ino != a.st_ino and b.st_nlink == 1 and a.st_nlink == 1
    assert not os.path.lexists(dest / "triton" / "link")  # the symlink was neither copied nor followed
    assert not [n for n in os.listdir(dest / "triton" / "abc") if n.startswith(".")]  # no temporary left
    assert stat.S_IMODE(os.lstat(transient / "gpu1").st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(dest).st_mode) == 0o700
    # the servers' cache variables: the contract's names, each at its folder of the copy (XDG's too)
    assert env == {k: str(dest / d) for k, d in hostcontract.JIT_CACHE_ENV + (hostcontract.XDG_CACHE_ENV,)}
    assert [k for k, _d in hostcontract.JIT_CACHE_ENV] == [k for k, _d in render.CACHE_ENV]
    assert all(os.path.isdir(p) for p in env.values())
    size = sum(os.lstat(src / r).st_size for r in ("triton/abc/kernel.cubin", "triton/abc/kernel.json",
                                                    "flashinfer/.cache/flashinfer/op.so"))
    assert res["state"] == "warm" and res["seeded_files"] == 3
    assert res["seeded_mib"] == round(size / 2 ** 20, 1) and res["cache_mib"] == round(size / 2 ** 20, 1)
    assert jitcache.line(res).startswith("warm:") and str(src) in jitcache.line(res)


def test_a_kept_copy_makes_the_next_run_warm_and_other_payloads_go(roots):
    svc, transient = roots
    old = transient / "gpu1" / OLD / "triton"
    old.mkdir(parents=True)
    (old / "stale").write_text("x")
    seed(roots)
    kernel = transient / "gpu1" / KEY / "triton" / "abc" / "kernel.cubin"
    ino = os.lstat(kernel).st_ino
    env, res = seed(roots)  # again: what is there is kept, nothing copied twice
    assert res["state"] == "warm" and res["seeded_files"] == 0 and os.lstat(kernel).st_ino == ino
    assert not (transient / "gpu1" / OLD).exists()
    import shutil

    shutil.rmtree(svc / "gpu1" / KEY)  # the service's caches gone (a new payload not yet started): still warm
    env, res = seed(roots)
    assert res["state"] == "warm" and "kept from an earlier run" in jitcache.line(res) and env


def test_the_size_cap_and_a_missing_service_directory(roots):
    svc, transient = roots
    env, res = seed(roots, cap=1024)
    assert res["state"] == "cold" and "larger than" in res["warning"] and res["seeded_mib"] == 0
    assert not list((transient / "gpu1" / KEY / "triton").iterdir())  # nothing copied
    assert env["TRITON_CACHE_DIR"] == str(transient / "gpu1" / KEY / "triton")  # still the servers' own folder
    env, res = jitcache.seed("gpu3", KEY, service_root=str(svc), transient_root=str(transient))
    assert res["state"] == "cold" and "no JIT caches" in res["note"] and os.path.isdir(env["TRITON_CACHE_DIR"])
    assert jitcache.line(res).startswith("cold:")
    env, res = jitcache.seed(None, None, service_root=str(svc), transient_root=str(transient))
    assert env == {} and res["state"] == "cold"


def test_the_deadline_stops_the_copy(roots):
    env, res = seed(roots, deadline_s=0)
    assert "deadline" in res["warning"] and res["seeded_files"] == 0


def test_the_host_op_checks_instance_and_key():
    assert jitcache.check(None, None) is None and jitcache.check("gpu1", KEY) is None
    for inst, key in (("gpu1", None), ("../x", KEY), ("gpu1", "../../etc"), ("gpu1", KEY.upper()), (1, KEY)):
        assert jitcache.check(inst, key)
    a = {"gpu": 0, "mode": "tree-verify", "family": "dense", "budget": 15, "prompts": 1, "tokens": 1,
         "prefix": "ddtree-smoke-0123456789ab", "instance": "gpu0", "cache_key": "/etc/passwd"}
    with pytest.raises(Failure, match="cache_key"):
        hostsmoke._check(a)
    hostsmoke._check(a | {"cache_key": KEY})


def test_the_plan_names_the_service_and_its_active_payload(tmp_path):
    p = tmp_path / "inv.yaml"
    p.write_text(textwrap.dedent("""\
        fleet: t
        reference: h
        vars: {venv: /opt/v, model: /models/T, draft_model: /models/D, mode: tree-verify, budget: 16}
        hosts:
          h: {address: 10.0.0.1, gpus: 2, services: {1: {}}}
        """))
    h = load_inventory(str(p)).hosts["h"]
    digest = "ab" * 32
    pr = {"current": "20261202T010203Z-a1b2c3", "venv_trust": "ok",
          "manifest": {"payload_digest": digest, "plugin": {"version": "1"}},
          "configs": {"/models/T": {"config": {"architectures": ["X"]}}}}
    a = bench.plan_bench(h, pr, gpu=1).agent_args()
    assert (a["instance"], a["cache_key"]) == ("gpu1", digest[:16])
    hostbench.check_args(a | {"venv": "/opt/v"})
    s = smoke.plan_smoke(h, pr, gpu=1).agent_args()
    assert (s["instance"], s["cache_key"]) == ("gpu1", digest[:16])
    # the key is the service unit's own folder (render.cache_dirs of that payload)
    svc = next(x for x in h.services if x.gpu == 1)
    assert dict(render.cache_dirs(svc, digest))["TRITON_CACHE_DIR"] == \
        os.path.join(jitcache.paths("gpu1", a["cache_key"])[0], "triton")
    # no service on the GPU, or a release without a payload digest: nothing to seed from, both null
    assert smoke.jit_source(None, pr) is None and smoke.jit_source(svc, {"manifest": {}}) is None
    assert smoke.jit_args("gpu1", None) == {"instance": None, "cache_key": None}
    a = bench.plan_bench(h, pr | {"manifest": {}}, gpu=1).agent_args()
    assert a["instance"] is None and a["cache_key"] is None
    hostbench.check_args(a | {"venv": "/opt/v"})


def test_the_seeded_env_reaches_the_systemd_run_unit(roots, tmp_path, monkeypatch):
    """seed_jit's variables in the tools module's environment reach a transient server's systemd-run as
    --setenv (a stand-in systemd-run on PATH records its argv)."""
    servers = pytest.importorskip("sglang_ddtree_tools.servers")
    svc, transient = roots
    monkeypatch.setattr(jitcache, "SERVICE_ROOT", str(svc))
    monkeypatch.setattr(jitcache, "TRANSIENT_ROOT", str(transient))
    ctx = Context({"op": "bench.run", "deadline": 300}, state=None, stdin=io.BytesIO(), stdout=io.StringIO())
    env, res = hostsmoke.seed_jit(ctx, {"instance": "gpu1", "cache_key": KEY, "user": None})
    assert res["state"] == "warm"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    rec = tmp_path / "argv"
    (bindir / "systemd-run").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {rec}\n')
    (bindir / "systemd-run").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # what run_transient gives the tools module
    spec = servers.ServerSpec(mode="plain", target="/m/t")
    servers.Server(["python3", "-m", "sglang.launch_server"], servers.server_env(spec, 1), str(tmp_path / "log"),
                   launcher="systemd-run", unit="ddtree-bench-0123456789ab-x", user="sglang").start()
    argv = rec.read_text().splitlines()
    argv = argv[:argv.index("--")]
    dest = transient / "gpu1" / KEY
    for k, d in hostcontract.JIT_CACHE_ENV + (hostcontract.XDG_CACHE_ENV,):
        assert f"--setenv={k}={dest / d}" in argv
    assert f"--property=CacheDirectory={hostcontract.TRANSIENT_CACHE}" in argv



def test_each_server_says_whether_it_started_warm_or_cold(tmp_path):
    """The tools' bench measures a server's JIT caches before it starts; the control side keeps that per run
    (checked like the rest) and says which started warm and which cold."""
    pb = pytest.importorskip("sglang_ddtree_tools.bench")
    from tests.toolkit.test_fab_bench import report

    root = tmp_path / "jit"
    env = pb.jit_cache_env(str(root))
    for d in env.values():
        os.makedirs(d)
    assert pb.jit_cache_mib(env) == 0  # empty: a cold start
    (root / "triton" / "k.cubin").write_bytes(b"x" * (3 << 20))
    (root / "xdg" / "other").write_bytes(b"x" * (1 << 20))
    (root / "triton" / "ln").symlink_to(root / "xdg" / "other")  # a link is not counted twice
    assert pb.jit_cache_mib(env) == 4.0
    doc = report()
    doc["runs"][0]["jit_cache_mib"] = 0
    doc["runs"][2]["jit_cache_mib"] = 812.5
    doc["runs"][3]["jit_cache_mib"] = "lots"  # not a number: dropped, like any field out of range
    rep = bench.parse_report(doc)
    assert [r.get("jit_cache_mib") for r in rep["runs"]] == [0, None, 812.5, None]
    lines = bench.jit_start_lines({"report": rep})
    assert len(lines) == 2 and lines[0].startswith("started warm") and "(812 MiB)" in lines[0]
    assert lines[1].startswith("started cold") and bench.run_label(rep["runs"][0]) in lines[1]
    assert bench.jit_start_lines({"report": bench.parse_report(report())}) == []  # tools from before it
