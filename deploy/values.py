"""Strict checks for inventory values that end up in unit files, environment files, argv or host paths.

An inventory is hostile input: a value rendered into a systemd unit or EnvironmentFile can add directives
("\\nExecStartPre=+/bin/sh -c ...\\nUser=root" in a path), and a name check with `$` accepts a trailing
newline ("root\\n"). So every check here matches the WHOLE value with re.fullmatch over a small character
set: no whitespace or control characters where they mean nothing, none of the characters systemd or an
EnvironmentFile interpret (`$` expansion, `%` specifiers, quotes, backslash escapes, `;`).

Each check returns None when the value is fine, else a message (the inventory loader prefixes file:line
and the key). Pure functions, no I/O.
"""
from __future__ import annotations

import ipaddress
import re

# One path component: no whitespace, quotes, `$`, `%`, `\\`, `;`, control or non-ASCII characters.
_COMPONENT = r"[A-Za-z0-9._+@-]+"
ABS_PATH_RE = re.compile(rf"(?:/{_COMPONENT})+")
PATH_MAX = 1024
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}")          # a Debian/useradd system user name
SSH_USER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")
HOSTNAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")      # inventory host names (also unit comments)
GROUP_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}")
FLEET_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}")
DNS_RE = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?")
SERVED_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")
DIST_PATTERN_RE = re.compile(r"[A-Za-z0-9*?][A-Za-z0-9._*?\[\]-]{0,127}")
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
# An argv word in $SGLANG_ARGS: systemd splits that variable on whitespace and interprets quotes, `\\`, `$`
# and `%`; an EnvironmentFile also treats `#`/`;` at a line start as comments. Printable ASCII without those.
ARG_RE = re.compile(r"[A-Za-z0-9_.,:/=+@^~!&*()\[\]{}|<>?-]{1,4096}")
# An EnvironmentFile value: printable ASCII, single inner spaces allowed (systemd strips outer ones, so they
# are refused), no quotes, backslash or `$` (the file parser unquotes, unescapes and expands those).
ENV_VALUE_RE = re.compile(r"(?:[!#%&(-\[\]-_a-~]+(?: [!#%&(-\[\]-_a-~]+)*)?")

# Words that make a command-line flag a secret: its value would be visible in ps, /proc/PID/cmdline, the
# unit's journal and sudo's log. "token" alone is common in harmless flags (--speculative-token-map), so
# it counts only after a word that makes it a credential (--hf-token, --auth-token, --token).
SECRET_WORDS = {"key", "apikey", "secret", "secrets", "password", "passwd", "passphrase", "credential",
                "credentials", "bearer", "cookie"}
TOKEN_OWNERS = {"", "hf", "hub", "auth", "access", "api", "bearer", "github", "gh", "session", "refresh", "id"}
# Flags the deploy tool sets itself (or must never be overridden): --host/--port decide who can reach the
# server, --config is where the API key comes from. argparse accepts any unambiguous prefix of a flag
# (allow_abbrev), so a prefix of one of these is refused too.
RESERVED_FLAGS = ("--host", "--port", "--config", "--api-key", "--admin-api-key", "--model-path",
                  "--served-model-name", "--speculative-algorithm", "--speculative-draft-model-path",
                  "--speculative-dflash-block-size", "--speculative-num-draft-tokens", "--ssl-keyfile-password",
                  # a TP service's group: its size is its GPUs' count, its ports come from contract.tp_ports
                  "--tp-size", "--tensor-parallel-size", "--dist-init-addr", "--nccl-init-addr", "--nccl-port")
# SGLang flags of their own that happen to be a prefix of a reserved one (an exact flag is never expanded);
# tests check this against SGLang's real parser: every other such prefix is an alias of the reserved flag.
OWN_FLAGS = {"--ssl-keyfile"}


def _show(v) -> str:
    return repr(v) if len(repr(v)) <= 80 else repr(v)[:77] + "..."


def abs_path(v) -> str | None:
    """An absolute path of plain components (no '.', '..', '//', trailing '/', whitespace or specials)."""
    if not isinstance(v, str):
        return f"must be an absolute path, got {_show(v)}"
    if len(v) > PATH_MAX:
        return f"must be an absolute path of at most {PATH_MAX} characters"
    if not ABS_PATH_RE.fullmatch(v):
        return (f"must be an absolute path of letters, digits and . _ + @ - (no whitespace, control characters, "
                f"quotes, '$', '%', '\\' or ';'), got {_show(v)}")
    if any(p in (".", "..") for p in v.split("/")[1:]):
        return f"must not contain '.' or '..' components, got {_show(v)}"
    return None


def deep_abs_path(v) -> str | None:
    """An absolute path at least two levels deep (its parent is not '/'): release_root, whose parent holds state."""
    p = abs_path(v)
    if p is None and v.count("/") < 2:
        return f"must be at least two levels deep (its parent directory holds the lock and journal), got {_show(v)}"
    return p


def _whole(regex: re.Pattern, what: str):
    """A check that `regex` matches the whole string value; the message says what was expected."""
    def check(v) -> str | None:
        if not isinstance(v, str) or not regex.fullmatch(v):
            return f"must be {what}, got {_show(v)}"
        return None
    return check


user_name = _whole(USER_RE, "a user name ([a-z_][a-z0-9_-]*, at most 32 characters)")
ssh_user = _whole(SSH_USER_RE, "a user name (letters, digits, '_', '.', '-'; at most 32 characters)")
served_model_name = _whole(SERVED_NAME_RE, "a model name (letters, digits and . _ : / @ + -)")
dist_pattern = _whole(DIST_PATTERN_RE, "a distribution name pattern (letters, digits, . _ - and * ? [ ])")


def service_user(v) -> str | None:
    return user_name(v) or ("must be a non-root user name, got 'root'" if v == "root" else None)


def address(v) -> str | None:
    """An SSH address: an IP address or a DNS name."""
    if not isinstance(v, str) or not v:
        return "required: an IP address or DNS name"
    try:
        ipaddress.ip_address(v)
        return None
    except ValueError:
        pass
    return None if DNS_RE.fullmatch(v) else f"not an IP address or DNS name: {_show(v)}"


def listen_address(v) -> str | None:
    """Where a server listens: an IPv4 or IPv6 address literal (0.0.0.0 / :: for every interface)."""
    if isinstance(v, str) and re.fullmatch(r"[0-9A-Fa-f.:]{2,45}", v):
        try:
            ip = ipaddress.ip_address(v)
            if not (ip.is_multicast or (ip.version == 6 and ip.ipv4_mapped)):
                return None
        except ValueError:
            pass
    return f"must be an IP address to listen on (127.0.0.1, ::1, a host address, 0.0.0.0 or ::), got {_show(v)}"


def is_loopback(listen: str) -> bool:
    return ipaddress.ip_address(listen).is_loopback


def connect_address(listen: str) -> str:
    """The address a client on the same host uses to reach a server listening on `listen`."""
    ip = ipaddress.ip_address(listen)
    if ip.is_unspecified:
        return "::1" if ip.version == 6 else "127.0.0.1"
    return str(ip)


def env_key(v) -> str | None:
    if not isinstance(v, str) or not ENV_KEY_RE.fullmatch(v):
        return f"{_show(v)} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)"
    return None


def env_value(v) -> str | None:
    s = str(v)
    if not ENV_VALUE_RE.fullmatch(s):
        return (f"value {_show(s)} has a newline, control character, quote, '\\', '$' or leading/trailing space "
                "(an EnvironmentFile would unquote, unescape or expand it)")
    return None


def flag_name(arg: str) -> str | None:
    """The flag an argv word sets ('--api-key=x' -> '--api-key'); None for a value."""
    return arg.split("=", 1)[0] if arg.startswith("--") and len(arg) > 2 else None


def secret_flag(flag: str) -> bool:
    words = [w for w in re.split(r"[-_]+", flag.lower().lstrip("-")) if w]
    if SECRET_WORDS & set(words):
        return True
    return any(w == "token" and (words[i - 1] if i else "") in TOKEN_OWNERS for i, w in enumerate(words))


def extra_arg(v) -> str | None:
    """One extra SGLang argv word: plain characters, and not a secret or a flag the deploy tool owns."""
    if not isinstance(v, str) or not ARG_RE.fullmatch(v):
        return (f"argument {_show(v)} is empty or has whitespace, control characters, quotes, '$', '%', '#', "
                "';' or '\\' (systemd splits $SGLANG_ARGS on whitespace; put such values in a config file)")
    flag = flag_name(v)
    if flag is None:
        return None
    if secret_flag(flag):
        return (f"{flag} passes a secret on the command line (visible in ps, /proc and the journal): keep API "
                "keys in the api_key_file (a root-only 0600 file the unit passes with LoadCredential=) and "
                "other secrets in /etc/ddtree/secrets.env (0600)")
    for r in RESERVED_FLAGS:
        if r.startswith(flag) and flag not in OWN_FLAGS:  # the flag itself, or an abbreviation argparse would expand to it
            what = "it" if r == flag else f"an abbreviation of {r} (argparse expands it)"
            return f"{flag} is {what}; the deploy tool sets {r} itself from the inventory"
    return None


def local_path(v) -> str | None:
    """A path on the control machine (known_hosts, identity file): any characters but control ones."""
    if not isinstance(v, str) or not v or re.search(r"[\x00-\x1f\x7f]", v):
        return f"must be a path without control characters, got {_show(v)}"
    return None
