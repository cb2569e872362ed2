"""The tools wheel `fab bench` and `fab smoke` carry to a host: built from the checkout (deploy/tools.py), sent on
the agent call's stdin, checked by the host op and installed into the run's private directory with the real pip -
on PYTHONPATH of that run only, never into the interpreter's own site-packages."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile

import pytest

from deploy import tools
from deploy.remote.host import smoke as hostsmoke
from deploy.remote.host.registry import Context, Failure


@pytest.fixture(scope="module")
def wheel():
    return tools.wheel()


def ctx(data: bytes) -> Context:
    return Context({"op": "smoke.run", "deadline": 300}, state=None, stdin=io.BytesIO(data), stdout=io.StringIO())


def test_the_tools_wheel_is_built_from_the_checkout(wheel):
    assert wheel.name.startswith("sglang_ddtree_tools-") and wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(io.BytesIO(wheel.data)) as z:
        names = z.namelist()
    assert "sglang_ddtree_tools/bench.py" in names and "sglang_ddtree_tools/report.py" in names
    assert not [n for n in names if n.startswith("sglang_ddtree/")]
    hostsmoke.check_tools(wheel.agent_args())  # what the host op accepts


def test_host_op_installs_it_into_the_run_directory_only(wheel, tmp_path):
    target = hostsmoke.install_tools(ctx(wheel.data), sys.executable, wheel.agent_args(), str(tmp_path))
    assert target == str(tmp_path / "tools") and (tmp_path / "tools" / "sglang_ddtree_tools" / "report.py").is_file()
    probe = "import sglang_ddtree_tools.report as r; print(r.__file__)"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=target), cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip().startswith(target), r.stderr
    # the interpreter itself did not get it: without the run's PYTHONPATH, sglang_ddtree_tools is either absent or
    # the interpreter's own copy (this test venv has one from scripts/bootstrap), never the run's
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", "import sglang_ddtree_tools as t; print(t.__file__)"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    if r.returncode != 0:
        assert "No module named 'sglang_ddtree_tools'" in r.stderr
    else:
        assert not r.stdout.strip().startswith(target), r.stdout


def test_host_op_refuses_a_damaged_or_foreign_wheel(wheel, tmp_path):
    a = wheel.agent_args()
    with pytest.raises(Failure, match="arrived damaged"):
        hostsmoke.install_tools(ctx(wheel.data[:-1] + b"x"), sys.executable, a, str(tmp_path / "a"))
    with pytest.raises(Failure, match="arrived damaged"):
        hostsmoke.install_tools(ctx(wheel.data[:100]), sys.executable, a, str(tmp_path / "b"))
    for bad, msg in [(dict(a, wheel="sglang_ddtree-0.1.0-py3-none-any.whl"), "sglang-ddtree-tools wheel"),
                     (dict(a, wheel="../x-1-py3-none-any.whl"), "sglang-ddtree-tools wheel"),
                     (dict(a, size=0), "tools.size"), (dict(a, size=True), "tools.size"),
                     (dict(a, sha256="0" * 63), "tools.sha256"), (None, "tools must be")]:
        with pytest.raises(Failure, match=msg):
            hostsmoke.check_tools(bad)
    # a wheel whose member does not match its RECORD is refused before pip sees it
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(wheel.data)) as zin, zipfile.ZipFile(buf, "w") as zout:
        for i in zin.infolist():
            data = zin.read(i)
            zout.writestr(i, data + b"# changed\n" if i.filename.endswith("report.py") else data)
    data = buf.getvalue()
    w2 = tools.ToolsWheel(wheel.name, wheel.version, data)
    (tmp_path / "c").mkdir()
    with pytest.raises(Failure, match="was refused: .*RECORD"):
        hostsmoke.install_tools(ctx(data), sys.executable, w2.agent_args(), str(tmp_path / "c"))
    assert not (tmp_path / "c" / "tools").exists()


def test_the_modules_run_from_the_tools_package():
    a = {"gpu": 0, "mode": "tree-verify", "family": "dense", "budget": 7, "prompts": 2, "tokens": 4}
    assert hostsmoke.smoke_argv("/v/bin/python", a, "/w/r.json", "ddtree-smoke-0123456789ab", 60)[1:3] == [
        "-m", "sglang_ddtree_tools.smoke"]
    assert hostsmoke.tools_install_argv("/v/bin/python", "/w/x.whl", "/w/tools")[1:] == [
        "-m", "pip", "install", "--isolated", "--no-index", "--no-deps", "--no-compile", "--disable-pip-version-check",
        "--no-input", "--no-cache-dir", "--target", "/w/tools", "/w/x.whl"]


def test_run_transient_hands_the_service_env_to_the_module_as_a_file(wheel, tmp_path, monkeypatch):
    """The module gets `--service-env FILE` (the checked env, JSON) and reads it while the run's directory exists;
    the directory is gone afterwards."""
    monkeypatch.setattr(hostsmoke.venvmod, "check_runnable", lambda venv: None)
    monkeypatch.setattr(hostsmoke, "stop_units", lambda prefix: None)  # no systemd here: nothing was started
    script = ("import json, sys; f = sys.argv[sys.argv.index('--service-env') + 1]; "
              "json.dump({'argv': sys.argv[1:], 'env': json.load(open(f))}, open(sys.argv[1], 'w'))")
    seen = {}

    def build(python, report, runtime_max, work):
        seen["work"] = work
        return [sys.executable, "-c", script, report]

    env = {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"}
    res = hostsmoke.run_transient(ctx(wheel.data), os.path.dirname(os.path.dirname(sys.executable)),
                                  "ddtree-smoke-0123456789ab", build, wheel.agent_args(), service_env=env)
    assert res["rc"] == 0, res
    assert res["report"]["env"] == env and res["report"]["argv"][-2] == "--service-env"
    assert not os.path.exists(seen["work"])
    with pytest.raises(Failure, match="set by the run"):  # refused before anything is installed or run
        hostsmoke.run_transient(ctx(wheel.data), "/nonexistent", "ddtree-smoke-0123456789ab", build,
                                wheel.agent_args(), service_env={"PATH": "/tmp"})


def test_the_smoke_servers_must_start_before_the_deadline_leaves_no_time_to_say_why(tmp_path):
    """The module gets a start timeout inside the op's deadline (the module's own parser reads it), so a slow
    start ends with the server's reason rather than the deadline's kill."""
    smokemod = pytest.importorskip("sglang_ddtree_tools.smoke")
    a = {"gpu": 0, "mode": "tree-verify", "family": "hybrid", "budget": 31, "prompts": 4, "tokens": 32}
    report = str(tmp_path / "r.json")
    for runtime_max in (45, 135, 885):
        argv = hostsmoke.smoke_argv("/v/bin/python", a, report, "ddtree-smoke-0123456789ab", runtime_max)
        st = float(argv[argv.index("--start-timeout") + 1])
        assert st == max(20, runtime_max - hostsmoke.START_MARGIN_S)
        r = subprocess.run([sys.executable, "-c", "import sys; from sglang_ddtree_tools import smoke; "
                            "smoke.gpu_device_problem = lambda g: 'no GPU here'; sys.exit(smoke.main(sys.argv[1:]))"]
                           + argv[3:], capture_output=True, text=True, timeout=120)
        assert r.returncode == smokemod.EXIT_CANNOT_RUN, r.stderr  # every word parsed, then refused for the GPU


def test_a_deadline_says_what_the_smoke_had_reached():
    from deploy import smoke as ctl

    code, line = ctl.outcome({"timed_out": True, "stderr": "GPU 0: 9 of 80 MiB in use\nplain: healthy after 41s\n"})
    assert code == ctl.EXIT_FAILED and "did not finish within its deadline" in line
    assert line.endswith("it had said: GPU 0: 9 of 80 MiB in use | plain: healthy after 41s"), line
    assert "it had said" not in ctl.outcome({"timed_out": True, "stderr": ""})[1]
