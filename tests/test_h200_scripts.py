"""benchmarks/h200: the scripts of a device session (benchmarks/h200/README.md). The GPU steps run only on the
H200; what runs anywhere is run here for real: the install step (a batch of a wheel and a tgz into a target)
and the refusals."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ROOT / "benchmarks" / "h200" / "device.sh"


def test_both_scripts_parse():
    for name in ("device.sh", "batches.sh", "gpulab.sh"):
        r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "h200" / name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def _env(tmp_path):
    # python3 is the venv's (it has pip, as the H200's python3 has), the install target and $OUT are the test's
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", SITE=str(tmp_path / "site"),
                OUT=str(tmp_path / "out"))


def _wheel(dest: Path, name: str, body: str) -> None:
    """A minimal pure wheel (what pip installs from a carried batch)."""
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(dest / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}.py", body)
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def test_install_puts_a_batchs_wheels_and_tgz_into_the_target(tmp_path):
    batch = tmp_path / "A"
    batch.mkdir()
    _wheel(batch, "carried_mod", "VALUE = 42\n")
    pkg = tmp_path / "src" / "trimmed_kernel"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("OK = True\n")
    subprocess.run(["tar", "czf", str(batch / "kernel-trimmed.tgz"), "-C", str(tmp_path / "src"), "trimmed_kernel"],
                   check=True)
    r = subprocess.run(["bash", str(DEVICE), "install", str(batch)], capture_output=True, text=True,
                       env=_env(tmp_path), cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed" in r.stdout
    site = tmp_path / "site"
    probe = subprocess.run([sys.executable, "-c", "import carried_mod, trimmed_kernel; "
                            "print(carried_mod.VALUE, trimmed_kernel.OK)"],
                           capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(site)))
    assert probe.stdout.strip() == "42 True", probe.stderr


def test_a_batch_that_was_not_carried_or_a_broken_wheel_fails_the_call(tmp_path):
    r = subprocess.run(["bash", str(DEVICE), "install", str(tmp_path / "missing")], capture_output=True, text=True,
                       env=_env(tmp_path), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "carry" in r.stderr
    bad = tmp_path / "B"
    bad.mkdir()
    (bad / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    r = subprocess.run(["bash", str(DEVICE), "install", str(bad)], capture_output=True, text=True,
                       env=_env(tmp_path), cwd=ROOT, timeout=300)
    assert r.returncode == 1 and "pip install of" in r.stderr, r.stdout + r.stderr


def test_an_unknown_step_or_missing_arguments_are_refused(tmp_path):
    r = subprocess.run(["bash", str(DEVICE), "frobnicate"], capture_output=True, text=True, env=_env(tmp_path),
                       cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "unknown step" in r.stderr
    r = subprocess.run(["bash", str(DEVICE), "bench", "hybrid"], capture_output=True, text=True, env=_env(tmp_path),
                       cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "MODES" in r.stderr
    r = subprocess.run(["bash", str(DEVICE), "replay", "dense"], capture_output=True, text=True, env=_env(tmp_path),
                       cwd=ROOT, timeout=60)
    assert r.returncode != 0 and "BUDGETS" in r.stderr


def _gpulab_inventory(tmp_path, **env):
    """gpulab.sh's inventory() as the fab step calls it, with the chroot's /tmp in tmp_path; the loaded copy."""
    import re

    from deploy.inventory import load_inventory

    script = (ROOT / "benchmarks" / "h200" / "gpulab.sh").read_text()
    fn = re.search(r"^inventory\(\) \{.*?^\}$", script, re.S | re.M).group(0)
    base = tmp_path / "base"
    r = subprocess.run(["bash", "-c", fn + '\nB="$0"; inventory', str(base)], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, **env), timeout=60)
    assert r.returncode == 0, r.stderr
    rel = r.stdout.strip()
    return rel, (load_inventory(str(base / rel.lstrip("/"))) if rel.startswith("/tmp/") else None)


def test_gpulab_serves_the_kits_dense_pair_with_family_dense(tmp_path):
    rel, _ = _gpulab_inventory(tmp_path, FAMILY="hybrid")
    assert rel == "inventory/gpulab.yaml"  # nothing asked of the copy: the inventory itself
    rel, inv = _gpulab_inventory(tmp_path, FAMILY="dense", BUDGET="63")
    v = inv.hosts["gpu-ref"].vars  # fleet vars resolved into each host
    assert (v["model"], v["draft_model"], v["served_model_name"], v["budget"]) == \
        ("/models/dense-target", "/models/dense-drafter", "tiny-dense", 63)
    assert (tmp_path / "base" / "tmp" / "bench").is_symlink()  # fab bench's kept results: the original's


def _bench_json(tmp_path, runs):
    import json

    lv = lambda c, tps: {"concurrency": c, "requests": 8, "errors": 0, "output_tok_s": tps}  # noqa: E731
    doc = {"runs": [{"mode": m, "budget": b, "block": 16 if m == "dflash" else None, "graphs": True,
                     "levels": [lv(*x) for x in levels]} for m, b, levels in runs]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_propose_prints_the_schedule_a_bench_report_proposes_for_the_next_call(tmp_path):
    """`device.sh propose BENCH_JSON`: report.propose_schedule on the report, the schedule alone on stdout (what the
    next call's bench serves); where DFLASH wins at one request (mode linear) the tree-verify runs' own schedule,
    and the reason on stderr; no tree-verify run at all fails the call."""
    env = _env(tmp_path)
    site = Path(env["SITE"])  # the install target is where device.sh imports from: this checkout's packages
    site.mkdir()
    for pkg, src in (("sglang_ddtree", "sglang-ddtree"), ("sglang_ddtree_tools", "sglang-ddtree-tools")):
        (site / pkg).symlink_to(ROOT / "overlays" / src / "src" / pkg)
    run = lambda f: subprocess.run(["bash", str(DEVICE), "propose", f], capture_output=True, text=True,  # noqa: E731
                                   env=env, cwd=ROOT, timeout=120)
    r = run(_bench_json(tmp_path, [("dflash", None, [(1, 1400), (16, 10000), (64, 16000)]),
                                   ("tree-verify", 127, [(1, 1800), (16, 3300), (64, 14700)]),
                                   ("tree-verify", 31, [(1, 1100), (16, 8500), (64, 9400)]),
                                   ("tree-verify", "1:15,2:chain", [(1, 1450), (16, 7400), (64, 16200)])]))
    assert r.returncode == 0 and r.stdout.strip() == "1:127,16:31,64:chain", r.stdout + r.stderr
    assert "DFLASH is faster" in r.stderr
    r = run(_bench_json(tmp_path, [("dflash", None, [(1, 2000), (4, 5000)]),
                                   ("tree-verify", 63, [(1, 1500), (4, 5500)]),
                                   ("tree-verify", 15, [(1, 1400), (4, 5600)])]))
    assert r.returncode == 0 and r.stdout.strip() == "1:63,4:15", r.stdout + r.stderr
    assert '"mode": "linear"' in r.stderr and "tree-verify runs alone" in r.stderr
    r = run(_bench_json(tmp_path, [("plain", None, [(1, 900)])]))
    assert r.returncode != 0 and r.stdout.strip() == "" and "no schedule to propose" in r.stderr


def test_usekit_refuses_a_seed_whose_kit_is_not_there(tmp_path):
    r = subprocess.run(["bash", str(DEVICE), "usekit", "987654321"], capture_output=True, text=True,
                       env=_env(tmp_path), cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "no kit of seed 987654321" in r.stderr
