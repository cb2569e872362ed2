"""The secrets checks root makes before anything restarts: the same checks as the unit's own start check
(server_secrets.py, shipped as the release's bin/server_secrets.py) plus every directory above each file trusted.
The gate gets each API key from here; no key ever leaves the host in a reply."""
import os

from . import server_secrets
from .fsutil import Unsafe, check_path


def check_secrets(secrets_file, key_files=()):
    """The checks the unit's ExecStartPre makes before every start (server_secrets.py: this very module is the
    release's bin/server_secrets.py), made by root before anything restarts, plus every directory above each file
    trusted: the secrets env file, when present, and each API-key file must be root-owned 0600/0400 regular files,
    each key file well-formed. Returns {key file: key} for the gate (never sent back); raises Unsafe, whose
    message never holds a secret."""
    keys = {}
    try:
        if secrets_file and os.path.lexists(secrets_file):
            server_secrets.check_owner_mode(secrets_file)
            check_path(os.path.dirname(secrets_file))
        for f in key_files:
            check_path(os.path.dirname(f))
            keys[f] = server_secrets.read_api_key(f)  # checks the file's owner and mode first
    except (server_secrets.SecretsError, OSError) as exc:
        raise Unsafe(str(exc))
    return keys


def gate_keys(secrets_file, gates):
    """{instance: its API key or None} for these gates, after check_secrets."""
    keys = check_secrets(secrets_file, sorted(set(g["api_key_file"] for g in gates.values() if g.get("api_key_file"))))
    return dict((i, keys.get(g.get("api_key_file"))) for i, g in gates.items())
