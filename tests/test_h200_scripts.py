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
