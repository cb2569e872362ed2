"""Rendered inventory values are matched whole (issue 9, item 2): a value that reaches a unit file, an
EnvironmentFile, argv or a host path cannot add a line, a directive or a secret. Each case here was accepted
before (paths were only checked with startswith("/"), names with a `$`-anchored re.match that lets a
trailing newline through) and is now refused as `file:line: key: message` before anything runs."""
from __future__ import annotations

import dataclasses
import json

import pytest

from deploy import values
from deploy.inventory import InventoryError, load_inventory
from deploy.release import render
from deploy.release.router import render_env as render_router_env

from test_inventory import GOOD, errors, write  # noqa: E402 (tests/ is on sys.path)

INJECT = "/opt/ddtree/releases\nExecStartPre=+/bin/sh -c 'id > /tmp/pwned'\nUser=root"


def yq(s: str) -> str:
    """A YAML double-quoted scalar for `s` (JSON strings are valid YAML)."""
    return json.dumps(s)


def has(problems, path, line, needle):
    return any(p.startswith(f"{path}:{line}: ") and needle in p for p in problems)


@pytest.mark.parametrize("key", ["release_root", "venv"])
def test_unit_directive_injection_through_a_path_is_refused(tmp_path, key):
    text = GOOD.replace("  venv: /opt/v\n", f"  venv: /opt/v\n  {key}: {yq(INJECT)}\n") if key != "venv" \
        else GOOD.replace("  venv: /opt/v\n", f"  venv: {yq(INJECT)}\n")
    problems = errors(tmp_path, text)
    assert has(problems, tmp_path / "inv.yaml", 4 if key == "venv" else 5, f"vars.{key}: must be an absolute path"), \
        problems
    assert "\n" not in "".join(problems)  # the message shows the value escaped, one problem per line


def test_what_the_injection_would_have_rendered(tmp_path):
    """Why it matters: rendered as before, the value adds [Service] directives (root shell, User=root).
    The renderer now refuses such a host even when it was built without the inventory loader."""
    inv = load_inventory(write(tmp_path, GOOD))
    host = dataclasses.replace(inv.hosts["a"], vars=dict(inv.hosts["a"].vars, release_root=INJECT))
    with pytest.raises(render.RenderError, match="release_root: must be an absolute path"):
        render.render_unit(host)
    host = dataclasses.replace(inv.hosts["a"], vars=dict(inv.hosts["a"].vars, venv=INJECT))
    with pytest.raises(render.RenderError, match="venv: must be an absolute path"):
        render.render_unit(host)


@pytest.mark.parametrize("snippet, line, needle", [
    ("  service_user: \"root\\n\"\n", 5, "vars.service_user: must be a user name"),
    ("  service_user: \"sglang\\n\"\n", 5, "vars.service_user: must be a user name"),
    ("  service_user: root\n", 5, "vars.service_user: must be a non-root user name"),
    ("  model: \"/models/m\\n\"\n", 5, "vars.model: must be an absolute path"),
    ("  model: /models/../etc\n", 5, "must not contain '.' or '..' components"),
    ("  model: /models/$HOME\n", 5, "vars.model: must be an absolute path"),
    ("  model: /models/%i\n", 5, "vars.model: must be an absolute path"),
    ("  draft_model: \"/d\\r\"\n", 5, "vars.draft_model: must be an absolute path"),
    ("  release_root: /opt\n", 5, "must be at least two levels deep"),
    ("  served_model_name: \"q\\nExecStart=/bin/sh\"\n", 5, "vars.served_model_name: must be a model name"),
    ("  managed: [torch, \"x\\ny\"]\n", 5, "vars.managed: must be a distribution name pattern"),
    ("  wheelhouse: [/w, \"/w\\n\"]\n", 5, "vars.wheelhouse: must be an absolute path"),
    ("  env: {A: \"1\\nUser=root\"}\n", 5, "vars.env: A: value"),
    ("  env: {A: 'say \"hi'}\n", 5, "vars.env: A: value"),
    ("  env: {A: \"${HOME}\"}\n", 5, "vars.env: A: value"),
    ("  env: {\"A\\nB\": x}\n", 5, "is not a valid variable name"),
    ("  env: {SGLANG_DDTREE_CHAIN_STEP: eagle}\n", 5, "SGLANG_DDTREE_CHAIN_STEP: must be one of dflash, plugin"),
    ("  listen_address: \"127.0.0.1\\n\"\n", 5, "vars.listen_address: must be an IP address"),
    ("  listen_address: localhost\n", 5, "vars.listen_address: must be an IP address"),
    ("  listen_address: \"fe80::1%eth0\"\n", 5, "vars.listen_address: must be an IP address"),
    ("  listen_address: 0.0.0.0\n", 5, "0.0.0.0 is reachable from other machines: host a also needs api_key_file"),
    ("  api_key_file: etc/key.yaml\n", 5, "vars.api_key_file: must be an absolute path"),
])
def test_rendered_values_are_fullmatched(tmp_path, snippet, line, needle):
    problems = errors(tmp_path, GOOD.replace("  venv: /opt/v\n", "  venv: /opt/v\n" + snippet))
    assert has(problems, tmp_path / "inv.yaml", line, needle), problems


def test_names_and_addresses_with_a_trailing_newline(tmp_path):
    p = errors(tmp_path, GOOD.replace("    address: 10.0.0.2\n", "    address: \"h2.example\\n\"\n"))
    assert has(p, tmp_path / "inv.yaml", 16, "hosts.b.address: not an IP address or DNS name"), p
    p = errors(tmp_path, GOOD.replace("  a:\n", "  \"a\\n\":\n").replace("[a, b]", "[b]")
               .replace("reference: a", "reference: b"))
    assert has(p, tmp_path / "inv.yaml", 12, "host names are lower-case letters"), p
    p = errors(tmp_path, GOOD.replace("    gpus: 2\n", "    gpus: 2\n    user: \"deploy\\n\"\n"))
    assert has(p, tmp_path / "inv.yaml", 15, "hosts.a.user: must be a user name"), p
    p = errors(tmp_path, GOOD.replace("  g:\n", "  \"g\\n\":\n"))
    assert has(p, tmp_path / "inv.yaml", 8, "group names are"), p
    p = errors(tmp_path, GOOD.replace("fleet: t\n", "fleet: \"t\\n[red]x\"\n"))
    assert has(p, tmp_path / "inv.yaml", 1, "fleet: must be a name"), p


@pytest.mark.parametrize("arg", ["--api-key", "--api-key=sk-live-123", "--admin-api-key", "--hf-token",
                                 "--ssl-keyfile-password", "--token", "--watermark-key", "--auth-token=x",
                                 "--api-ke", "--host", "--host=0.0.0.0", "--hos", "--port", "--config",
                                 "--conf", "--model-path"])
def test_secret_and_reserved_flags_in_extra_args_are_refused_at_their_line(tmp_path, arg):
    text = GOOD.replace("3: {port: 31000, mode: linear}",
                        f"3:\n        port: 31000\n        extra_args:\n          - --context-length\n"
                        f"          - '4096'\n          - {yq(arg)}\n          - x")
    problems = errors(tmp_path, text)
    flag = arg.split("=")[0]
    assert has(problems, tmp_path / "inv.yaml", 25, f"hosts.b.services.3.extra_args: {flag} "), problems
    assert len(problems) == 1 and "sk-live" not in problems[0]


@pytest.mark.parametrize("arg", ["--tokenizer-path", "--speculative-token-map", "--bucket-time-to-first-token",
                                 "--ssl-keyfile", "--max-total-tokens", "--context-length", "--hostname-x",
                                 "--mem-fraction-static=0.8", "-1", "/models/chat.jinja"])
def test_harmless_flags_pass(tmp_path, arg):
    text = GOOD.replace("  venv: /opt/v\n", f"  venv: /opt/v\n  extra_args: [{yq(arg)}]\n")
    assert load_inventory(write(tmp_path, text)).hosts["a"].services[0].extra_args == (arg,)


def test_listen_address_default_and_api_key_file(tmp_path):
    inv = load_inventory(write(tmp_path, GOOD))
    assert inv.hosts["a"].vars["listen_address"] == "127.0.0.1" and inv.hosts["a"].vars["api_key_file"] is None
    assert {s.listen for h in inv.hosts.values() for s in h.services} == {"127.0.0.1"}
    text = GOOD.replace("    vars: {budget: 8}\n",
                        "    vars: {budget: 8, listen_address: 10.0.0.2, api_key_file: /etc/ddtree/api-key.yaml}\n")
    inv = load_inventory(write(tmp_path, text))
    # with the host's router (the default) the router listens there and the GPU servers on loopback only
    assert [s.listen for s in inv.hosts["b"].services] == ["127.0.0.1"] * 3
    assert "--host 10.0.0.2 " in render_router_env(inv.hosts["b"])
    inv = load_inventory(write(tmp_path, text.replace("{budget: 8, ", "{budget: 8, router: {enabled: false}, ")))
    assert [s.listen for s in inv.hosts["b"].services] == ["10.0.0.2"] * 3
    assert inv.hosts["a"].vars["listen_address"] == "127.0.0.1"
    # the problem is reported where the address was set: here the group's vars
    p = errors(tmp_path, GOOD.replace("vars: {budget: 32}", "vars: {budget: 32, listen_address: '::'}"))
    assert has(p, tmp_path / "inv.yaml", 10, "groups.g.vars.listen_address: :: is reachable"), p


def test_values_module_uses_fullmatch_not_dollar():
    for bad in ("root\n", "sglang\n", "a b", "", "x" * 33):
        assert values.user_name(bad), bad
    assert values.abs_path("/opt/ddtree/releases\n") and values.abs_path("/opt//x") and values.abs_path("/opt/")
    assert values.abs_path("/opt/sglang/.venv") is None and values.abs_path("/models/Qwen3.5-27B") is None
    assert values.connect_address("0.0.0.0") == "127.0.0.1" and values.connect_address("::") == "::1"
    assert values.connect_address("10.1.2.3") == "10.1.2.3"


def test_reserved_flag_prefixes_against_sglangs_real_parser():
    """argparse expands an unambiguous prefix (allow_abbrev), so a prefix of a reserved flag is refused -- unless
    it is a flag of its own in SGLang 0.5.23 (listed in values.OWN_FLAGS); any other real flag that is a prefix
    of a reserved one must be an alias of it (same dest), so refusing it refuses nothing else."""
    import argparse
    sa = pytest.importorskip("sglang.srt.server_args", reason="sglang 0.5.23 not installed (requirements)")
    p = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(p)
    dest = {o: a.dest for a in p._actions for o in a.option_strings}
    for r in values.RESERVED_FLAGS:
        assert r in dest, r
        for f in dest:
            if f != r and r.startswith(f) and f.startswith("--"):
                assert f in values.OWN_FLAGS or dest[f] == dest[r], (f, r)
    for own in values.OWN_FLAGS:
        assert own in dest and values.extra_arg(own) is None


def test_router_settings_merge_per_key_and_are_checked_with_file_lines(tmp_path):
    text = GOOD.replace("  budget: 16\n", "  budget: 16\n  router: {port: 8100, drain_timeout: 45}\n").replace(
        "    vars: {budget: 8}\n", "    vars: {budget: 8, router: {policy: round_robin}}\n")
    inv = load_inventory(write(tmp_path, text))
    assert inv.hosts["a"].vars["router"] == {"enabled": True, "port": 8100, "metrics_port": 29000,
                                             "drain_timeout": 45, "hold_secs": 90, "policy": "cache_aware"}
    assert inv.hosts["b"].vars["router"]["policy"] == "round_robin" and inv.hosts["b"].vars["router"]["port"] == 8100
    path = tmp_path / "inv.yaml"
    bad = GOOD.replace("  budget: 16\n", "  budget: 16\n  router:\n    port: 70000\n    drain_timeout: -1\n"
                                          "    policy: fastest\n    enabled: 'yes'\n    colour: red\n"
                                          "    hold_secs: 3601\n")
    p = errors(tmp_path, bad)
    assert has(p, path, 8, "vars.router: port: must be a TCP port") and has(p, path, 9, "drain_timeout: must be seconds")
    assert has(p, path, 10, "policy: must be one of cache_aware") and has(p, path, 11, "enabled: must be true or false")
    assert has(p, path, 12, "colour: unknown key"), p
    assert has(p, path, 13, "hold_secs: must be seconds, an integer in [0, 3600]"), p
    # the router's port may not be a GPU service's
    p = errors(tmp_path, GOOD.replace("  budget: 16\n", "  budget: 16\n  router: {port: 30001}\n"))
    assert has(p, path, 13, "hosts.a.router.port: port 30001 is also used by GPU 1 on a"), p


@pytest.mark.parametrize("value", ["plugin", "dflash", "DFlash"])
def test_a_chain_step_the_plugin_reads_is_accepted(tmp_path, value):
    """Either step the plugin knows for a schedule's chain entries (any case, as the plugin reads it) loads."""
    text = GOOD.replace("  venv: /opt/v\n", f"  venv: /opt/v\n  env: {{SGLANG_DDTREE_CHAIN_STEP: {value}}}\n")
    inv = load_inventory(write(tmp_path, text))
    assert inv.hosts["a"].vars["env"]["SGLANG_DDTREE_CHAIN_STEP"] == value
