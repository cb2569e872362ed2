"""Keeps the API key out of the GPU service's journal: imported by every Python process of the service.

SGLang 0.5.17 and 0.5.23 log their resolved server arguments at INFO when they start
(sglang/srt/entrypoints/engine.py: `logger.info(f"server_args={...}")`), and those include api_key and
admin_api_key in clear -- however the key was given, `--config` included. The unit puts the release's `site/`
folder (this file, as `sitecustomize.py`) on PYTHONPATH when the host has an API key; Python imports it at
start-up in the server and in every process SGLang spawns (they inherit the environment). It reads the keys
from the unit's own credential ($CREDENTIALS_DIRECTORY/sglang-server.yaml, readable by the service user only)
and installs a log-record factory that replaces their text with `<redacted>` in every record, which survives
SGLang's `logging.basicConfig(force=True)` (that replaces handlers, not the factory).

Does nothing without the credential. Stdlib only; never raises (a broken redactor must not stop the server --
but then nothing is redacted, which the lab test would show).
"""
import importlib.util
import logging
import os

CREDENTIAL = "sglang-server.yaml"
MASK = "<redacted>"


def _parser():
    here = os.path.dirname(os.path.abspath(__file__))
    # in a release: ../bin; in the repo: the agent's host package, where the file lives
    for d in (os.path.join(here, os.pardir, "bin"), os.path.join(here, os.pardir, "remote", "host")):
        path = os.path.join(d, "server_secrets.py")
        if os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_ddtree_server_secrets", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod.parse_key_file
    return None


def keys_from_credential(directory=None):
    directory = directory or os.environ.get("CREDENTIALS_DIRECTORY")
    parse = _parser() if directory else None
    if not parse:
        return []
    path = os.path.join(directory, CREDENTIAL)
    try:
        with open(path, encoding="utf-8") as f:
            return sorted(set(parse(f.read(), path).values()), key=len, reverse=True)
    except (OSError, ValueError):
        return []


def redact(text, keys):
    for k in keys:
        text = text.replace(k, MASK)
    return text


def install(keys):
    """Wrap the log-record factory: a record whose message holds a key gets the message with it masked."""
    if not keys:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is logging's business, not ours
            return record
        if any(k in message for k in keys):
            record.msg, record.args = redact(message, keys), ()
        return record

    logging.setLogRecordFactory(factory)


try:
    install(keys_from_credential())
except Exception:  # noqa: BLE001 - see the module docstring
    pass
