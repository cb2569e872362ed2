"""ExecStart of sglang-router.service: the real SGLang router (PyPI sglang-router, its Rust core), with the host's
API key read from the unit's credential instead of the command line.

    <router venv>/bin/python -I bin/router_launch.py [--api-key-credential NAME] -- ROUTER-ARGS...

ROUTER-ARGS are parsed by the router's own parser (sglang_router.router_args.RouterArgs.add_cli_args /
from_cli_args, what `sglang-router launch` and `python -m sglang_router.launch_router` use), then the Rust router
is started exactly as sglang_router.launch_router.launch_router does (`_validate_router_args()`,
`Router.from_args(args).start()`). Two differences, both on purpose:

- The router takes its API key only as `--api-key KEY` (visible in ps, /proc/PID/cmdline and the journal's
  start line). Here the key comes from `$CREDENTIALS_DIRECTORY/NAME` (the host's api_key_file, `api-key: KEY`,
  copied there by systemd's LoadCredential=) and is set on the parsed arguments in this process: it never
  appears in argv. With a key, clients must send `Authorization: Bearer KEY`, and the workers of
  `--worker-urls` get the same key (they are the host's own GPU services, which use the same file).
- launch_router.py imports the Python debugging balancer (mini_lb: aiohttp, fastapi, uvicorn, orjson) and
  setproctitle at import time; the Rust router needs none of them, so the router venv holds only the
  sglang-router wheel (installed --no-deps) and this launcher does not import that module.

Stdlib only besides sglang_router; the key file's grammar is the agent's own (server_secrets.py, next to this
file in the release's bin/).
"""
import argparse
import importlib.util
import os
import sys


def read_key(name):
    """The API key from the unit's credential NAME (parsed with server_secrets.parse_key_file)."""
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        raise SystemExit("router_launch: --api-key-credential given but the unit has no credentials directory")
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("_ddtree_server_secrets", os.path.join(here, "server_secrets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = os.path.join(directory, name)
    try:
        with open(path, encoding="utf-8") as f:
            return mod.parse_key_file(f.read(), path)["api-key"]
    except (OSError, mod.SecretsError) as exc:  # the message never holds the key
        raise SystemExit("router_launch: refusing to start: %s" % exc)


def split_argv(argv):
    own, rest = argv, []
    if "--" in argv:
        i = argv.index("--")
        own, rest = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="router_launch")
    p.add_argument("--api-key-credential", help="credential name holding `api-key: KEY`")
    return p.parse_args(own), rest


def router_args(rest, api_key=None):
    """The router's own parse of ROUTER-ARGS (sglang_router.router_args), the key set in-process."""
    from sglang_router.router_args import RouterArgs
    p = argparse.ArgumentParser(prog="sglang-router")
    RouterArgs.add_cli_args(p, use_router_prefix=False)
    args = RouterArgs.from_cli_args(p.parse_args(rest), use_router_prefix=False)
    if api_key is not None:
        args.api_key = api_key
    return args


def main(argv=None):
    own, rest = split_argv(list(sys.argv[1:] if argv is None else argv))
    if any(a == "--api-key" or a.startswith("--api-key=") for a in rest):
        raise SystemExit("router_launch: refusing --api-key on the command line (use --api-key-credential)")
    key = read_key(own.api_key_credential) if own.api_key_credential else None
    args = router_args(rest, key)
    from sglang_router.router import Router
    args._validate_router_args()
    Router.from_args(args).start()  # blocks until the router stops (SIGTERM: its graceful shutdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
