"""The secrets files' checks (deploy/remote/host/server_secrets.py, the unit's ExecStartPre and the gate's key
reader): owner, mode, type and directory of real files, and the key file's format -- which must read the
same under PyYAML (what SGLang's --config uses) as under the host's stdlib parser. No message holds a key."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from deploy.remote.host import server_secrets as ss

from helpers import KEY, public_dir, secret_file


@pytest.fixture
def secret_dir(tmp_path):
    return public_dir(tmp_path / "ddtree")


def make(d, name="api-key.yaml", text=f"api-key: {KEY}\n", mode=0o600):
    return secret_file(d, name, text, mode)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="owner checks need root to create root-owned files")


@needs_root
def test_a_root_0600_key_file_is_read(secret_dir):
    assert ss.read_api_key(make(secret_dir)) == KEY
    assert ss.read_api_key(make(secret_dir, mode=0o400)) == KEY


@needs_root
@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606])
def test_group_or_other_bits_are_refused(secret_dir, mode):
    p = make(secret_dir, mode=mode)
    with pytest.raises(ss.SecretsError, match=f"has mode {mode:04o}; it must be 0600") as ei:
        ss.read_api_key(p)
    assert KEY not in str(ei.value)


@needs_root
def test_symlink_other_owner_and_unsafe_directory_are_refused(secret_dir, tmp_path):
    real = make(secret_dir, "real.yaml")
    os.symlink(real, secret_dir / "link.yaml")
    with pytest.raises(ss.SecretsError, match="is a symbolic link"):
        ss.read_api_key(str(secret_dir / "link.yaml"))
    p = make(secret_dir, "nobody.yaml")
    os.chown(p, 65534, 65534)
    with pytest.raises(ss.SecretsError, match="owned by uid 65534; it must be owned by root"):
        ss.read_api_key(p)
    os.chmod(secret_dir, 0o775)
    with pytest.raises(ss.SecretsError, match="must be owned by root and not group/other-writable"):
        ss.read_api_key(real)
    os.chmod(secret_dir, 0o755)
    os.mkdir(secret_dir / "d")
    with pytest.raises(ss.SecretsError, match="is not a regular file"):
        ss.check_owner_mode(str(secret_dir / "d"))
    with pytest.raises(ss.SecretsError, match="no such file"):
        ss.read_api_key(str(secret_dir / "missing.yaml"))


@pytest.mark.parametrize("text, match", [
    ("api_key: Kx9fTq2LmZ7wP4sR8vB1nY6h\n", "only api-key and admin-api-key"),  # SGLang 0.5.23 rejects --api_key
    ("host: 0.0.0.0\napi-key: Kx9fTq2LmZ7wP4sR8vB1nY6h\n", "only api-key and admin-api-key"),
    ("api-key: short\n", "one token of 16-512"),
    ("api-key: 0x1234567890abcdef12\n", "one token of 16-512"),     # PyYAML would read an int
    ("api-key: 1234_5678_9012_3456\n", "one token of 16-512"),      # PyYAML 1.1: an int too
    ("api-key: Kx9fTq2L mZ7wP4sR8vB1nY6h\n", "one token of 16-512"),
    ("api-key: \"Kx9fTq2LmZ7wP4sR8vB1nY6h\n", "one token of 16-512"),
    ("api-key: Kx9fTq2LmZ7wP4sR8vB1nY6h\napi-key: Kx9fTq2LmZ7wP4sR8vB1nY6h\n", "set twice"),
    ("# nothing\n", "no `api-key: KEY` line"),
    ("admin-api-key: Kx9fTq2LmZ7wP4sR8vB1nY6h\n", "no `api-key: KEY` line"),
])
def test_malformed_key_files_are_refused_without_showing_the_key(text, match):
    with pytest.raises(ss.SecretsError, match=match) as ei:
        ss.parse_key_file(text, "/etc/ddtree/api-key.yaml")
    assert "Kx9fTq2L" not in str(ei.value) and "1234567890abcdef" not in str(ei.value)


@pytest.mark.parametrize("value", [KEY, f'"{KEY}"', f"'{KEY}'", '"0x1234567890abcdef12"', "'1234_5678_9012_3456'",
                                   '"-9fTq2LmZ7wP4sR8vB1nY6h"', "abc+def/ghi=jkl~mno.pq-rs_tu", '"yes" ',
                                   "a" * 512])
def test_host_parser_and_pyyaml_read_the_same_key(value):
    text = f"api-key: {value}\n"
    if value.strip() == '"yes"':
        with pytest.raises(ss.SecretsError):
            ss.parse_key_file(text, "k")
        return
    ours = ss.parse_key_file(text, "k")["api-key"]
    assert yaml.safe_load(text)["api-key"] == ours and isinstance(ours, str)


@needs_root
def test_execstartpre_check_exit_codes(secret_dir):
    env = make(secret_dir, "secrets.env", "HF_TOKEN=hf_x\n")
    key = make(secret_dir)
    run = lambda *a: subprocess.run([sys.executable, "-I", ss.__file__, *a], capture_output=True, text=True)
    assert run("--check", env, "--api-key-file", key).returncode == 0
    assert run("--check", str(secret_dir / "absent.env")).returncode == 0  # the secrets env file is optional
    os.chmod(env, 0o644)
    r = run("--check", env)
    assert r.returncode == 1 and "refusing to start" in r.stderr and "0644" in r.stderr and "hf_x" not in r.stderr
    os.chmod(env, 0o600)
    cred = make(secret_dir, "cred.yaml", "api-key: x\n")  # the service's copy is what is parsed
    r = run("--check", env, "--api-key-file", key, "--credential", cred)
    assert r.returncode == 1 and "one token of 16-512" in r.stderr
    r = run("--check", env, "--api-key-file", str(secret_dir / "none.yaml"))
    assert r.returncode == 1 and "no such file" in r.stderr
