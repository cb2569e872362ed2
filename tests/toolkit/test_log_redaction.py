"""SGLang logs its resolved server arguments at INFO, api_key included (sglang/srt/entrypoints/engine.py,
`logger.info(f"server_args={...}")`, 0.5.17 and 0.5.23), so an API key passed any way -- `--config` too --
would reach the service's journal. The release's site/sitecustomize.py (on PYTHONPATH in a keyed unit) masks it.
Shown here with SGLang 0.5.23's own argument resolution and logger set-up (the line engine.py writes), and with
the lab stand-in; each first shows the key leaking without the redactor, so the test can fail."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
from helpers import KEY  # noqa: E402


@pytest.fixture
def release(tmp_path):
    """A release's bin/ and site/ as the unit sees them, and the unit's credentials directory."""
    (tmp_path / "rel" / "bin").mkdir(parents=True)
    (tmp_path / "rel" / "site").mkdir()
    shutil.copy(ROOT / "deploy/remote/host/server_secrets.py", tmp_path / "rel/bin/server_secrets.py")
    shutil.copy(ROOT / "deploy/release/sitecustomize.py", tmp_path / "rel/site/sitecustomize.py")
    creds = tmp_path / "creds"
    creds.mkdir(mode=0o700)
    (creds / "sglang-server.yaml").write_text(f"api-key: {KEY}\nadmin-api-key: 'Adm1n{KEY}'\n")
    os.chmod(creds / "sglang-server.yaml", 0o400)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 512, '
        '"vocab_size": 1000, "max_position_embeddings": 2048, "head_dim": 64, "torch_dtype": "bfloat16"}')
    return tmp_path


ENGINE_LINE = """
import logging, sys
from sglang.srt.server_args import prepare_server_args
from sglang.srt.sampling.watermarking.core import redact_watermark_secrets
sa = prepare_server_args(sys.argv[1:])  # itself calls logging.basicConfig(..., force=True)
# configure_logger(sa) (sglang/srt/utils/common.py) does this too, then quiets hf_hub/httpx loggers (needs
# huggingface_hub, which the CPU test venv lacks):
logging.basicConfig(level=getattr(logging, sa.log_level.upper()), format="[%(asctime)s] %(message)s",
                    datefmt="%Y-%m-%d %H:%M:%S", force=True)
# engine.py: logger.info(f"server_args={_server_args_for_logging(server_args)}"), where
# _server_args_for_logging(s) = redact_watermark_secrets(s.resolved_dict())
logging.getLogger("sglang.srt.entrypoints.engine").info(f"server_args={redact_watermark_secrets(sa.resolved_dict())}")
"""


def run_sglang(release, redactor: bool) -> str:
    pytest.importorskip("sglang.srt.server_args", reason="sglang 0.5.23 not installed (requirements)")
    env = dict(os.environ, CREDENTIALS_DIRECTORY=str(release / "creds"))
    env.pop("PYTHONPATH", None)
    if redactor:
        env["PYTHONPATH"] = str(release / "rel" / "site")
    r = subprocess.run([sys.executable, "-c", ENGINE_LINE, "--model-path", str(release / "m"), "--device", "cpu",
                        "--skip-tokenizer-init", "--config", str(release / "creds" / "sglang-server.yaml")],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def test_sglang_logs_the_key_and_the_release_redactor_masks_it(release):
    leaked = run_sglang(release, redactor=False)
    assert "server_args=" in leaked and KEY in leaked  # SGLang 0.5.23 itself, as it starts
    masked = run_sglang(release, redactor=True)
    assert "server_args=" in masked and KEY not in masked
    assert "'api_key': '<redacted>'" in masked and "'admin_api_key': '<redacted>'" in masked


def test_the_lab_stand_in_leaks_like_sglang_and_is_masked_the_same_way(release):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["/usr/bin/python3", str(ROOT / "deploy/labserver/server.py"), "--model-path", "/m", "--port", str(port),
            "--config", str(release / "creds" / "sglang-server.yaml")]
    outs = []
    for site in (None, release / "rel" / "site"):
        env = {"PATH": "/usr/bin:/bin", "CREDENTIALS_DIRECTORY": str(release / "creds"),
               "LABSERVER_FAIL_AT_START": "1"}  # log the start-up line, then exit
        if site:
            env["PYTHONPATH"] = str(site)
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "server_args=" in r.stderr, r.stderr
        outs.append(r.stderr)
    assert KEY in outs[0] and KEY not in outs[1] and "<redacted>" in outs[1]


def test_keys_from_the_credential_and_nothing_without_one(release, monkeypatch):
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    from deploy.release import sitecustomize as sc
    assert sc.keys_from_credential() == []
    assert sc.keys_from_credential(str(release / "creds")) == [f"Adm1n{KEY}", KEY]  # longest first
    assert sc.redact(f"a {KEY} Adm1n{KEY} b", sc.keys_from_credential(str(release / "creds"))) == \
        "a <redacted> <redacted> b"
    (release / "creds" / "sglang-server.yaml").chmod(0o600)
    (release / "creds" / "sglang-server.yaml").write_text("api-key: short\n")  # malformed: nothing, no crash
    assert sc.keys_from_credential(str(release / "creds")) == []
