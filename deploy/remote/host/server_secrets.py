#!/usr/bin/python3
"""The GPU services' secrets files on a host: checked before every start, and the API key read for the gate.

Two files, both kept by the operator on the host, never in the inventory, a release, a unit, argv or the
journal:

    /etc/ddtree/secrets.env      optional EnvironmentFile (HF_TOKEN=...), read by systemd as root
    api_key_file (inventory)     `api-key: KEY` -- an SGLang `--config` YAML file holding only the API key
                                 (and optionally `admin-api-key: KEY`); systemd copies it with LoadCredential=
                                 into the unit's private credentials directory, SGLang reads that copy

Each must be a regular file (not a symlink) owned by root with no group or other permission bits (0600 or
0400), in a root-owned directory nobody else can write. The key file holds only those keys, each value a
token of 16-512 characters from [A-Za-z0-9._~+/=-] (unquoted it must start with a letter): then PyYAML,
which SGLang uses, and `read_api_key` below read the same string.

As the unit's ExecStartPre (as the service user: lstat needs no read permission on the file):
    server_secrets.py --check /etc/ddtree/secrets.env [--api-key-file PATH --credential %d/sglang-server.yaml]
exits 1 with the reason (never the key) when a file is unsafe or malformed, so the unit does not start.

Stdlib only, one copy: this module is part of the agent's host package (deploy/remote/host), whose release
ops import it to check the files at plan time (release.probe) and before any restart (release.apply) and to read
the key for the health gate (as root); every release carries the same file as bin/server_secrets.py for the
unit's ExecStartPre and the log redactor (site/sitecustomize.py). So it imports nothing of the package.
"""
import argparse
import os
import re
import stat
import sys

KEYS = ("api-key", "admin-api-key")
TOKEN = r"[A-Za-z0-9._~+/=-]{16,512}"
LINE_RE = re.compile(r"(api-key|admin-api-key)[ \t]*:[ \t]*(\"%s\"|'%s'|[A-Za-z]%s)[ \t]*" % (
    TOKEN, TOKEN, TOKEN.replace("{16,512}", "{15,511}")))


class SecretsError(ValueError):
    """A secrets file that is unsafe (owner, mode, type) or malformed; the message never holds the secret."""


def check_owner_mode(path, st=None):
    """Refuse anything but a root-owned regular file without group/other bits, in a safe directory."""
    try:
        st = st or os.lstat(path)
    except FileNotFoundError:
        raise SecretsError("%s: no such file" % path) from None
    except PermissionError:
        raise SecretsError("%s: cannot look at it (its directory must be searchable: 0755 or 0711)" % path) from None
    if stat.S_ISLNK(st.st_mode):
        raise SecretsError("%s: is a symbolic link; a secrets file must be a regular file" % path)
    if not stat.S_ISREG(st.st_mode):
        raise SecretsError("%s: is not a regular file" % path)
    if st.st_uid != 0:
        raise SecretsError("%s: is owned by uid %d; it must be owned by root" % (path, st.st_uid))
    if st.st_mode & 0o077:
        raise SecretsError("%s: has mode %04o; it must be 0600 (or 0400): chmod 600 %s" % (
            path, stat.S_IMODE(st.st_mode), path))
    parent = os.path.dirname(path) or "/"
    try:
        pst = os.stat(parent)
    except OSError as e:
        raise SecretsError("%s: %s" % (parent, e.strerror)) from None
    if pst.st_uid != 0 or pst.st_mode & 0o022:
        raise SecretsError("%s: its directory %s must be owned by root and not group/other-writable" % (
            path, parent))


def parse_key_file(text, where):
    """{'api-key': KEY, ...} from the key file's text; SecretsError (without the key) when malformed."""
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = LINE_RE.fullmatch(line)
        if not m:
            name = line.split(":", 1)[0].strip()
            if name not in KEYS:
                raise SecretsError("%s:%d: only api-key and admin-api-key belong in this file, not %r" % (
                    where, n, name[:40]))
            raise SecretsError("%s:%d: %s must be one token of 16-512 characters from [A-Za-z0-9._~+/=-], "
                               "quoted, or unquoted starting with a letter" % (where, n, name))
        name = m.group(1)
        if name in out:
            raise SecretsError("%s:%d: %s is set twice" % (where, n, name))
        value = m.group(2)
        out[name] = value[1:-1] if value[0] in "\"'" else value
    if "api-key" not in out:
        raise SecretsError("%s: no `api-key: KEY` line" % where)
    return out


def read_api_key(path):
    """The API key from the host's key file (checked first); for the deploy gate, which runs as root."""
    check_owner_mode(path)
    with open(path, encoding="utf-8") as f:
        return parse_key_file(f.read(), path)["api-key"]


def main(argv=None):
    p = argparse.ArgumentParser(description="check the GPU service's secrets files before it starts")
    p.add_argument("--check", metavar="SECRETS_ENV", required=True, help="the optional EnvironmentFile of secrets")
    p.add_argument("--api-key-file", help="the host's API key file (the source of the unit's credential)")
    p.add_argument("--credential", help="the service's copy of it (%%d/sglang-server.yaml)")
    a = p.parse_args(argv)
    try:
        if os.path.lexists(a.check):
            check_owner_mode(a.check)
        if a.api_key_file:
            check_owner_mode(a.api_key_file)
            with open(a.credential or a.api_key_file, encoding="utf-8") as f:
                parse_key_file(f.read(), a.api_key_file)
    except (SecretsError, OSError) as e:
        sys.stderr.write("refusing to start: %s\n" % e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
