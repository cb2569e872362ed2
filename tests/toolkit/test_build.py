"""Release build: wheel version carries the release id, capabilities read from the wheel, overlays guarded,
bundle and manifest complete. The build mechanism does not care what the plugin contains."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from coherence_fixtures import probe_raw
from deploy.inventory import load_inventory
from deploy.release import router as routermod
from deploy.release import build, changes, payload
from deploy.release import plan as planmod

ROOT = Path(__file__).resolve().parents[2]


def test_release_id_and_local_label():
    rid = build.new_release_id(now=0)
    assert rid.startswith("19700101T000000Z-") and len(rid) == 23
    assert build.local_version_label("20261129T083000Z-abc123") == "r20261129t083000z.abc123"
    from packaging.version import Version
    assert str(Version("0.1.0+" + build.local_version_label(rid))).startswith("0.1.0+r19700101t000000z.")


def test_set_pyproject_version_only_touches_project_table():
    text = '[build-system]\nrequires = ["x"]\n\n[project]\nname = "p"\nversion = "1.2"\n\n[tool.x]\nversion = "9"\n'
    new, old = build.set_pyproject_version(text, "1.2+r1")
    assert old == "1.2" and 'version = "1.2+r1"' in new and 'version = "9"' in new
    with pytest.raises(build.BuildError):
        build.set_pyproject_version("[project]\nname = 'x'\ndynamic = ['version']\n", "1")


def _toy_project(tmp: Path, caps: dict | None) -> Path:
    src = tmp / "toy"
    (src / "src" / "toy_pkg").mkdir(parents=True)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "toy-pkg"\nversion = "2.0"\n\n[tool.setuptools.packages.find]\nwhere = ["src"]\n\n'
        '[tool.setuptools.package-data]\ntoy_pkg = ["*.json"]\n')
    (src / "src" / "toy_pkg" / "__init__.py").write_text("X = 1\n")
    if caps is not None:
        (src / "src" / "toy_pkg" / "capabilities.json").write_text(json.dumps(caps))
    return src


def test_build_any_project_with_release_in_version(tmp_path):
    p = build.build_plugin("20261129T083000Z-abc123", _toy_project(tmp_path, {"modes": ["tree-verify"]}),
                           tmp_path / "out")
    assert p.dist == "toy-pkg" and p.version == "2.0+r20261129t083000z.abc123"
    assert p.capabilities == {"modes": ["tree-verify"]}
    with zipfile.ZipFile(p.wheel) as z:
        meta = z.read(f"toy_pkg-{p.version}.dist-info/METADATA").decode()
    assert f"Version: {p.version}" in meta
    q = build.build_plugin("x", _toy_project(tmp_path / "b", None), tmp_path / "out2")
    assert q.capabilities == {}
    assert p.source_digest != q.source_digest


def test_build_the_real_plugin(tmp_path):
    p = build.build_plugin("20261129T083000Z-abc123", out_dir=tmp_path)
    assert p.dist == "sglang-ddtree" and p.version.endswith("+r20261129t083000z.abc123")
    if (build.DEFAULT_PLUGIN_DIR / "src/sglang_ddtree/capabilities.json").exists():
        assert "modes" in p.capabilities


def test_overlay_spec_validation(tmp_path):
    patched = tmp_path / "patched.py"
    patched.write_text("PATCHED = True\n")
    spec = tmp_path / "overlays.yaml"
    good = {"package": "sglang", "version": "0.5.23", "path": "sglang/srt/x.py", "sha256": "a" * 64,
            "source": "patched.py"}
    spec.write_text(json.dumps([good]))
    [o] = build.load_overlay_spec(spec)
    assert o["new_sha256"] == hashlib.sha256(b"PATCHED = True\n").hexdigest()
    for bad, msg in [(dict(good, sha256="zz"), "64 hex"), (dict(good, path="/etc/passwd"), "relative"),
                     (dict(good, path="../x"), "relative"), ({"package": "x"}, "exactly the keys"),
                     (dict(good, source="missing.py"), "does not exist")]:
        spec.write_text(json.dumps([bad]))
        with pytest.raises(build.BuildError, match=msg):
            build.load_overlay_spec(spec)
    assert build.load_overlay_spec(tmp_path / "none.yaml") == []


def test_bundle_and_manifest(tmp_path):
    inv = load_inventory(str(ROOT / "inventory" / "hosts.yaml"))
    host = inv.hosts["ct200"]
    plugin = build.build_plugin("20261129T083000Z-abc123", _toy_project(tmp_path, {}), tmp_path / "w")
    files, svc = build.host_files(host, plugin, [])
    man = build.make_manifest("20261129T083000Z-abc123", host, plugin, [], files, svc, "fab deploy", {})
    assert set(man["services"]) == {f"gpu{i}" for i in range(8)}
    assert man["services"]["gpu1"]["port"] == 30001 and man["services"]["gpu1"]["mode"] == "shadow-linear"
    for k in ("release", "toolkit", "created", "created_by", "files", "content_digest", "plugin"):
        assert man[k]
    data = build.bundle("20261129T083000Z-abc123", files, man)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = tar.getnames()
        for rel, sha in man["files"].items():
            assert hashlib.sha256(tar.extractfile(f"20261129T083000Z-abc123/{rel}").read()).hexdigest() == sha
    assert "20261129T083000Z-abc123/manifest.json" in names
    assert "20261129T083000Z-abc123/env/gpu7.env" in names


def test_same_inputs_same_service_digests_and_changes_are_per_gpu(tmp_path):
    inv = load_inventory(str(ROOT / "inventory" / "hosts.yaml"))
    host = inv.hosts["ct200"]
    plugin = build.build_plugin("r1", _toy_project(tmp_path, {}), tmp_path / "w")
    _, a = build.host_files(host, plugin, [])
    plugin2 = dataclasses.replace(plugin, version="2.0+r2")  # a new release of the same source
    _, b = build.host_files(host, plugin2, [])
    assert a == b
    changed = dataclasses.replace(host, services=tuple(
        dataclasses.replace(s, budget=32) if s.gpu == 3 else s for s in host.services))
    _, c = build.host_files(changed, plugin, [])
    diff = changes.changed_services(c, a, {i: {"ActiveState": "active"} for i in a["services"]}, {})
    assert diff == {"gpu3": "changed"}
    units = {i: {"ActiveState": "active"} for i in a["services"]}
    units["gpu5"] = {"ActiveState": "failed"}
    assert changes.changed_services(a, a, units, {}) == {"gpu5": "not running (failed)"}
    assert changes.changed_services(a, None, units, {})["gpu0"] == "new"
    assert changes.batches(list("abcde"), 2) == [["a", "b"], ["c", "d"], ["e"]]


def _gpus(raw: dict, n: int) -> dict:
    """`raw` with its nvidia-smi GPU row as GPUs 0..n-1 (the seed's hosts have 8; the capture is a 1-GPU H200)."""
    q = raw["nvidia_smi_query"]
    head, row = q["out"].strip().splitlines()[:2]
    rows = [", ".join([str(i)] + row.split(", ")[1:]) for i in range(n)]
    return dict(raw, nvidia_smi_query=dict(q, out="\n".join([head] + rows) + "\n"))


# What a plan's probe reads of a coherent SGLang 0.5.17 host (real captured metadata; as many GPUs as the seed's
# ct200), and a plugin for it.
COHERENT = _gpus(probe_raw(), 8)
CAPS = {"sglang_versions": ["0.5.17"]}


def _planned(tmp_path, state):
    inv = load_inventory(str(ROOT / "inventory" / "hosts.yaml"))
    host = inv.hosts["ct200"]
    plugin = build.build_plugin("20261129T083000Z-abc123", _toy_project(tmp_path, CAPS), tmp_path / "w")
    opts = planmod.DeployOptions()
    state = dict(state, configs={s.model: {"config": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}}
                                 for s in host.services})
    return host, planmod.make_plan(host, plugin, [], "20261129T083000Z-abc123", opts, state)


def test_deploy_plan_is_data_with_every_command_as_argv(tmp_path):
    """Kamal's habit: a deploy is a value -- every command that changes the host is an argv list the plan shows
    and this test reads, and the rollback is planned with it."""
    state = {"current": None, "manifest": None, "units": {}, "services": {}, "configs": {}, "overlays": [],
             "venv_trust": "ok", "secrets": "absent", "facts": COHERENT}
    host, p = _planned(tmp_path, state)
    assert p.refused == [] and p.coherence["refused"] == [] and p.coherence["gpu_archs"] == ["sm_90"]
    pay = p.payload
    py = host.vars["venv"] + "/bin/python"         # /opt/sglang/.venv in the seed inventory
    wheel = "/opt/ddtree/releases/20261129T083000Z-abc123/wheels/" + p.manifest["plugin"]["wheel"].split("/")[-1]
    act = pay["activate"]["commands"]
    assert act["install_plugin"] == [py, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps",
                                     "--force-reinstall", "--disable-pip-version-check", "--no-input",
                                     "--no-cache-dir", wheel]
    assert act["undo_plugin"] == [py, "-m", "pip", "uninstall", "--isolated", "--yes", "--disable-pip-version-check",
                                  "--no-input", "toy-pkg"]               # first release: undo = no plugin at all
    assert act["daemon_reload"] == ["systemctl", "daemon-reload"]
    assert act["enable"][:2] == ["systemctl", "enable"] and "sglang-ddtree@gpu7.service" in act["enable"]
    assert [b["restart"] for b in pay["batches"]][0] == ["systemctl", "restart", "--no-block",
                                                         "sglang-ddtree@gpu0.service"]
    assert len(pay["batches"]) == 8 and pay["expect_current"] is None
    assert pay["rollback"]["activate"] is None and pay["rollback"]["stop"] == ["systemctl", "stop"]
    assert pay["stage"]["user"]["useradd"][0] == "useradd" and pay["secrets_file"] == "/etc/ddtree/secrets.env"
    # a host without the router's venv builds it first (from the wheel this release carries), then the plugin;
    # the router comes up before the first GPU restarts
    rv = pay["activate"]["router_venv"]
    assert rv["path"].startswith("/opt/ddtree/router/sglang-router-0.3.2-") and \
        p.files[rv["wheel"]] == routermod.wheel().path.read_bytes()
    assert payload.apply_commands(pay)[:3] == [rv["commands"]["venv"], rv["commands"]["install"],
                                               act["install_plugin"]]
    assert rv["commands"]["venv"] == ["/usr/bin/python3", "-m", "venv", rv["path"] + ".tmp"]
    assert payload.apply_commands(pay)[5] == ["systemctl", "restart", "sglang-router.service"]
    assert len(payload.apply_commands(pay)) == 14 and "sglang-router.service" in act["enable"]
    urls = {f"gpu{i}": f"http://127.0.0.1:{30000 + i}" for i in range(8)}
    assert pay["batches"][0]["drain"] == {"address": "127.0.0.1", "port": 8000, "api_key_file": None,
                                          "timeout": 300, "workers": urls, "expected": sorted(urls.values())}
    assert pay["prune"] == pay["batches"][0]["drain"]  # the router holds these workers, no other
    # a host that has the venv gets no wheel and builds nothing
    _h, p2 = _planned(tmp_path / "c", dict(state, router={"venvs": [rv["path"].rsplit("/", 1)[1]]}))
    assert rv["wheel"] not in p2.files and payload.apply_commands(p2.payload)[0] == act["install_plugin"]
    # the next release rolls back to this one: its wheel, its services
    old = dict(p.manifest, release="20261128T000000Z-000000", content_digest="0" * 64,
               plugin=dict(p.manifest["plugin"], wheel="wheels/toy_pkg-2.0+r0-py3-none-any.whl"))
    _host, q = _planned(tmp_path / "b", dict(state, current=old["release"], manifest=old))
    rb = q.payload["rollback"]["activate"]
    assert rb["release"] == old["release"] and rb["commands"]["install_plugin"][-1] == \
        "/opt/ddtree/releases/20261128T000000Z-000000/wheels/toy_pkg-2.0+r0-py3-none-any.whl"
    assert q.payload["activate"]["commands"]["undo_plugin"][-1].endswith("toy_pkg-2.0+r0-py3-none-any.whl")
    assert q.payload["expect_current"] == old["release"]


def test_plan_refuses_an_untrusted_venv_or_a_readable_secrets_file(tmp_path):
    state = {"current": None, "manifest": None, "units": {}, "services": {}, "configs": {}, "overlays": [],
             "venv_trust": "/opt/sglang/venv/lib/python3.11/site-packages is writable by group",
             "secrets": "/etc/ddtree/secrets.env: has mode 0644; it must be 0600 (or 0400)"}
    _host, p = _planned(tmp_path, state)
    assert any("root will not run it" in r for r in p.refused) and any("0644" in r for r in p.refused)


def test_plan_refuses_an_api_key_file_the_unit_would_refuse(tmp_path):
    """The probe judged the inventory's API-key file as the unit's ExecStartPre will: a bad one is refused at the
    plan, before anything is staged; one the probe did not report is refused too (never assumed fine)."""
    ok = {"current": None, "manifest": None, "units": {}, "services": {}, "configs": {}, "overlays": [],
          "venv_trust": "ok", "secrets": "absent", "facts": COHERENT}
    inv = load_inventory(str(ROOT / "inventory" / "hosts.yaml"))
    keyed = dataclasses.replace(inv.hosts["ct200"], vars=dict(inv.hosts["ct200"].vars, api_key_file="/etc/k.yaml"))
    plugin = build.build_plugin("20261129T083000Z-abc123", _toy_project(tmp_path, CAPS), tmp_path / "w")
    configs = {s.model: {"config": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}}
               for s in keyed.services}

    def plan(**state):
        return planmod.make_plan(keyed, plugin, [], "20261129T083000Z-abc123", planmod.DeployOptions(),
                                 dict(ok, configs=configs, **state))
    assert plan(api_keys={"/etc/k.yaml": "ok"}).refused == []
    assert plan(api_keys={"/etc/k.yaml": "/etc/k.yaml: has mode 0644"}).refused == [
        "API key file: /etc/k.yaml: has mode 0644"]
    assert plan().refused == ["API key file: /etc/k.yaml: not checked by the host"]
    p = plan(api_keys={"/etc/k.yaml": "ok"})
    gates = [g for b in p.payload["batches"] for g in b["gates"].values()]
    assert gates and all(g["api_key_file"] == "/etc/k.yaml" and g["address"] == "127.0.0.1" for g in gates)
    assert p.payload["activate"]["dropin_name"] == "50-ddtree-gpu.conf"


def test_rollback_target_skips_failed_releases():
    rels = ["20260101T000000Z-a", "20260102T000000Z-b", "20260103T000000Z-c"]
    assert changes.rollback_target(rels[2], rels, [rels[1]], None, "h") == rels[0]
    assert changes.rollback_target(rels[2], rels, [], rels[1], "h") == rels[1]
    with pytest.raises(RuntimeError, match="is not on h"):
        changes.rollback_target(rels[2], rels, [], "nope", "h")
