"""The lab's SGLang stand-in honours the listen address and the API key as SGLang 0.5.23 does, so the lab tests
of both are real: real HTTP on loopback, the stand-in under /usr/bin/python3 with SGLang hidden (stdlib only, as
on the lab hosts), its auth decision compared with SGLang's own decide_request_auth, its --config merge with
SGLang's own ConfigArgumentMerger; and the deploy gate reaching a keyed server on its own address."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from deploy.remote.host import gate as agent

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "deploy" / "labserver" / "server.py"
EXPECT = {"model": "qwen3-8b", "algorithm": "DDTREE"}
from helpers import KEY  # noqa: E402
sys.path.insert(0, str(SERVER.parent))
import server as labserver_module  # noqa: E402  (the stand-in's pure helpers)


def free_port(host="127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture
def start(tmp_path):
    procs = []

    def run(host="127.0.0.1", key_text=None):
        port = free_port(host)
        argv = ["/usr/bin/python3", "-I", str(SERVER), "--model-path", "/models/Qwen3-8B", "--served-model-name",
                "qwen3-8b", "--host", host, "--port", str(port), "--speculative-algorithm", "DDTREE",
                "--speculative-draft-model-path", "/models/d", "--speculative-dflash-block-size", "16"]
        if key_text is not None:
            cfg = tmp_path / "sglang-server.yaml"
            cfg.write_text(key_text)
            argv += ["--config", str(cfg)]
        p = subprocess.Popen(argv, env={"PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        procs.append(p)
        g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=5, address=host,
                       api_key=KEY if key_text else None)
        assert g["ok"], g
        return p, port
    yield run
    for p in procs:
        p.terminate()
        p.wait(5)


def get(host, port, path, key=None, scheme="Bearer", method="GET"):
    headers = {"Authorization": f"{scheme} {key}"} if key else {}
    data = b"{}" if method == "POST" else None
    req = urllib.request.Request(f"http://{host}:{port}{path}", headers=headers, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_api_key_from_config_guards_everything_but_health(start):
    p, port = start(key_text=f"api-key: {KEY}\n")
    h = "127.0.0.1"
    for path in ("/health", "/health_generate", "/ready"):
        assert get(h, port, path)[0] == 200, path
    for path in ("/v1/models", "/server_info", "/get_server_info", "/model_info", "/v1/models/qwen3-8b"):
        assert get(h, port, path) == (401, b'{"error": "Unauthorized"}'), path
        assert get(h, port, path, "wrong-key-0123456789")[0] == 401, path
        assert get(h, port, path, KEY, scheme="Basic")[0] == 401, path
        assert get(h, port, path, KEY)[0] == 200, path
        assert get(h, port, path, KEY, scheme="bearer")[0] == 200, path  # the scheme is case-insensitive
    assert get(h, port, "/generate", method="POST")[0] == 401
    info = json.loads(get(h, port, "/server_info", KEY)[1])
    assert KEY not in json.dumps(info) and "--config" in info["launch_command"]
    # the gate without the key stops at the first guarded step, with the key it passes (the fixture's gate)
    g = agent.gate(port, EXPECT, start_timeout=5, gate_timeout=5)
    assert not g["ok"] and g["step"] == "models" and "HTTP 401" in g["detail"]


def test_no_key_no_guard(start):
    _, port = start()
    assert get("127.0.0.1", port, "/v1/models")[0] == 200


def test_listen_address_is_honoured(start):
    """Listening on 127.0.0.2, it is not on 127.0.0.1; the gate reaches it at its own address (the fixture)."""
    _, port = start(host="127.0.0.2")
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert get("127.0.0.2", port, "/health")[0] == 200
    code, detail = agent.http(port, "GET", "/health", timeout=2)
    assert code is None  # the default 127.0.0.1 finds nothing there


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready", "/metrics", "/v1/models", "/generate",
                                  "/server_info", "/", "/healthz"])
@pytest.mark.parametrize("header", [None, f"Bearer {KEY}", f"bearer {KEY}", f"Bearer {KEY}x", "Bearer", KEY,
                                    f"Token {KEY}", f"Bearer  {KEY}"])
@pytest.mark.parametrize("api_key", [None, KEY])
def test_auth_decision_matches_sglangs(path, header, api_key):
    auth = pytest.importorskip("sglang.srt.utils.auth", reason="sglang 0.5.23 not installed (requirements)")
    real = auth.decide_request_auth(method="GET", path=path, authorization_header=header, api_key=api_key,
                                    admin_api_key=None, auth_level=auth.AuthLevel.NORMAL).allowed
    assert labserver_module.authorized(path, header, api_key) == real


@pytest.mark.parametrize("text", [f"api-key: {KEY}\n", f"# c\napi-key: '{KEY}'\nadmin-api-key: \"A{KEY}\"\n",
                                  "trust-remote-code: true\nlog-level: info\n"])
def test_config_merge_matches_sglangs(tmp_path, text, monkeypatch):
    import argparse
    sa = pytest.importorskip("sglang.srt.server_args", reason="sglang 0.5.23 not installed (requirements)")
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    argv = ["--model-path", "/m", "--config", str(cfg), "--port", "3"]
    p = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(p)
    real = ConfigArgumentMerger(p).merge_config_with_args(argv)
    assert labserver_module.merge_config(argv) == real
    monkeypatch.setitem(sys.modules, "yaml", None)  # the lab hosts' python3 has no PyYAML: the flat reader
    assert labserver_module.merge_config(argv) == real
    for bad in (["--config", str(cfg), "--config", str(cfg)], ["--config"]):
        with pytest.raises(ValueError):
            labserver_module.merge_config(bad)
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="must be YAML"):
        labserver_module.merge_config(["--config", str(tmp_path / "c.json")])
