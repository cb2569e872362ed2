"""Pure rendering of what a release puts on a host: per-GPU argv, environment files, the template unit.

Nothing here touches the network or the host. Every command is an argv list; the unit's ExecStart is
`<launcher> $SGLANG_ARGS` and the per-GPU EnvironmentFile carries SGLANG_ARGS, so `service_argv()` is
exactly the argv systemd will run (tests feed it to SGLang 0.5.23's own parser).

The DDTree plugin's contract (overlays/sglang-ddtree/src/sglang_ddtree/plugin.py, names from its
capabilities.json): the algorithm is `DDTREE`; the mode (tree-verify | shadow-linear) is the environment
variable SGLANG_DDTREE_MODE and the node budget B is SGLANG_DDTREE_BUDGET. In tree-verify the verify width
`--speculative-num-draft-tokens` is D = B + 1 (bonus + B nodes, must agree with the budget variable) and
decode CUDA graphs are off; in shadow-linear D stays the DFlash block size. The plugin is allow-listed with
SGLANG_PLUGINS. Tests run the rendered argv + env through SGLang's parser and the plugin's own resolver.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import jinja2

from ..inventory import Host, Service

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "systemd"
UNIT_TEMPLATE = "sglang-ddtree@.service.j2"
ENV_TEMPLATE = "gpu.env.j2"
UNIT_FILE = "sglang-ddtree@.service"
UNIT_PREFIX = "sglang-ddtree@"
SECRETS_FILE = "/etc/ddtree/secrets.env"
SYSTEM_PYTHON = "/usr/bin/python3"

# --- the plugin's contract (see module docstring) ---
PLUGIN_NAME = "ddtree"            # entry-point name in group sglang.srt.plugins, allow-listed by SGLANG_PLUGINS
MODE_ENV = "SGLANG_DDTREE_MODE"   # tree-verify | shadow-linear
BUDGET_ENV = "SGLANG_DDTREE_BUDGET"  # the node budget B
ALGORITHM = {"linear": "DFLASH", "shadow-linear": "DDTREE", "tree-verify": "DDTREE"}

ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRET_KEY_RE = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|CREDENTIAL|PRIVATE_KEY)", re.I)
RESERVED_ENV = {"CUDA_VISIBLE_DEVICES", "SGLANG_ARGS", "SGLANG_PORT", "SGLANG_PLUGINS", MODE_ENV, BUDGET_ENV}


class RenderError(ValueError):
    """A service whose settings cannot be rendered safely (names the host, GPU and setting)."""


def unit_name(instance: str) -> str:
    return f"{UNIT_PREFIX}{instance}.service"


def launcher_argv(host: Host) -> list[str]:
    """What ExecStart runs before $SGLANG_ARGS: SGLang from the managed venv, or the lab stand-in."""
    if host.vars.get("server", "sglang") == "labserver":
        return [SYSTEM_PYTHON, f"{host.vars['release_root']}/current/labserver/server.py"]
    return [f"{host.vars['venv']}/bin/python", "-m", "sglang.launch_server"]


def server_args(svc: Service) -> list[str]:
    """SGLang's command line for one GPU service (without the launcher)."""
    where = f"{svc.host} gpu{svc.gpu}"
    if not svc.model:
        raise RenderError(f"{where}: no model path (set vars.model in the inventory)")
    args = ["--model-path", svc.model]
    if svc.served_model_name:
        args += ["--served-model-name", svc.served_model_name]
    args += ["--host", "0.0.0.0", "--port", str(svc.port)]
    if not svc.draft_model:
        raise RenderError(f"{where}: mode {svc.mode} needs a draft model (vars.draft_model)")
    args += ["--speculative-algorithm", ALGORITHM[svc.mode], "--speculative-draft-model-path", svc.draft_model,
             "--speculative-dflash-block-size", str(svc.block_size)]
    if svc.mode == "tree-verify":
        # D = B + 1 verify tokens; SGLang 0.5.23 captures the DFlash-family verify graph with a causal mask,
        # so the plugin requires decode CUDA graphs off in tree-verify (it refuses otherwise).
        args += ["--speculative-num-draft-tokens", str(svc.budget + 1), "--cuda-graph-backend-decode", "disabled"]
    # shadow-linear commits through the DFlash chain: D stays the block size; B travels in the budget env.
    args += list(svc.extra_args)
    for a in args:
        if not a or re.search(r"[\s'\"\\$%;`]", a):
            raise RenderError(f"{where}: argument {a!r} is empty or has whitespace, quotes, '$', '%' or ';' "
                              "(systemd splits $SGLANG_ARGS on whitespace; put such values in a config file)")
    return args


def plugin_contract(caps: dict | None) -> dict:
    """Names the plugin declares in its capabilities.json, with the defaults above where it declares none."""
    caps = caps or {}
    return {"plugin": (caps.get("entry_point") or {}).get("name") or PLUGIN_NAME,
            "allowlist_env": caps.get("plugin_allowlist_env") or "SGLANG_PLUGINS",
            "mode_env": caps.get("mode_env") or MODE_ENV, "budget_env": caps.get("budget_env") or BUDGET_ENV}


def service_env(svc: Service, caps: dict | None = None) -> list[tuple[str, str]]:
    """The per-GPU EnvironmentFile, in order. Inventory `env` comes last; secrets are refused.

    `caps` is the plugin's capabilities.json: its entry-point name, mode and budget variables are used."""
    where = f"{svc.host} gpu{svc.gpu}"
    c = plugin_contract(caps)
    env = [("CUDA_VISIBLE_DEVICES", str(svc.gpu)), ("SGLANG_PORT", str(svc.port)),
           ("SGLANG_ARGS", " ".join(server_args(svc)))]
    if svc.mode != "linear":
        env += [(c["allowlist_env"], c["plugin"]), (c["mode_env"], svc.mode)]
        if c["budget_env"]:
            env.append((c["budget_env"], str(svc.budget)))
    reserved = RESERVED_ENV | {c["allowlist_env"], c["mode_env"]} | ({c["budget_env"]} if c["budget_env"] else set())
    for k, v in svc.env:
        if not ENV_KEY_RE.match(k):
            raise RenderError(f"{where}: env {k!r} is not a valid variable name")
        if k in reserved:
            raise RenderError(f"{where}: env {k} is set by the deploy tool; use the inventory's own settings")
        if SECRET_KEY_RE.search(k):
            raise RenderError(f"{where}: env {k} looks like a secret; secrets never go into releases or units: "
                              f"put it in {SECRETS_FILE} on the host (mode 0600)")
        if "\n" in v or "\r" in v:
            raise RenderError(f"{where}: env {k} has a newline")
        env.append((k, v))
    return env


def service_argv(host: Host, svc: Service) -> list[str]:
    """The full argv systemd runs for this service (ExecStart with $SGLANG_ARGS split as systemd does)."""
    return launcher_argv(host) + server_args(svc)


def _jinja() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def render_unit(host: Host) -> str:
    v = host.vars
    return _jinja().get_template(UNIT_TEMPLATE).render(
        unit_name=UNIT_FILE, release_root=v["release_root"], state_dir=state_dir(host),
        service_user=v["service_user"], exec_start=" ".join(launcher_argv(host)), system_python=SYSTEM_PYTHON,
        start_timeout=v["start_timeout"], stop_timeout=60, restart_sec=10,
        start_limit_interval=max(600, 3 * v["start_timeout"]), start_limit_burst=3, secrets_file=SECRETS_FILE)


def render_env(svc: Service, caps: dict | None = None) -> str:
    return _jinja().get_template(ENV_TEMPLATE).render(host=svc.host, instance=svc.instance, env=service_env(svc, caps),
                                                      secrets_file=SECRETS_FILE)


def state_dir(host: Host) -> str:
    """Where the lock, the audit journal and service records live: the parent of release_root."""
    return str(Path(host.vars["release_root"]).parent)


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def service_digest(unit_text: str, env_text: str, payload_digest: str) -> str:
    """What decides a restart: the unit, this GPU's env file and the payload (plugin source, overlays, launcher)."""
    return sha256("\0".join([unit_text, env_text, payload_digest]))
