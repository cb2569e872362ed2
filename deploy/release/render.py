"""Pure rendering of what a release puts on a host: per-GPU argv, environment files, the template unit.

Nothing here touches the network or the host. Every command is an argv list; the unit's ExecStart is
`<launcher> $SGLANG_ARGS` and the per-GPU EnvironmentFile carries SGLANG_ARGS, so `service_argv()` is
exactly the argv systemd will run (tests feed it to SGLang 0.5.23's own parser).

What a service's SGLang server is given (its algorithm, verify width, attention backend, page size, the plugin's
mode and budget variables) comes from the plugin's contract (deploy.contract, the plugin's
sglang_ddtree/contract.py): `contract.sglang_args` and `contract.sglang_env` are the one builder of a server,
shared with the plugin's transient smoke and bench servers. This module adds what only a unit has: the served
model name, metrics, the inventory's extra_args and env, the JIT caches. Tests run the rendered argv + env through
SGLang's parser and the plugin's own resolver.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import jinja2

from .. import contract, values
from ..inventory import Host, Service

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "systemd"
UNIT_TEMPLATE = "sglang-ddtree@.service.j2"
ENV_TEMPLATE = "gpu.env.j2"
UNIT_FILE = "sglang-ddtree@.service"
UNIT_PREFIX = "sglang-ddtree@"
SECRETS_FILE = "/etc/ddtree/secrets.env"
SYSTEM_PYTHON = "/usr/bin/python3"
# The API key reaches the service as a systemd credential of this name (SGLang's --config wants a .yaml suffix);
# systemd 252 puts it at /run/credentials/<unit>/<name>, which is what %d/<name> expands to in the unit.
CREDENTIAL = "sglang-server.yaml"
DROPIN_TEMPLATE = "gpu-devices.conf.j2"
GPU_DROPIN = "50-ddtree-gpu.conf"
# NVIDIA's shared nodes every CUDA process opens (as nvidia-container-toolkit exposes them); /dev/nvidiaN per GPU.
NVIDIA_SHARED_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
# A TP group's drop-in also allows the NVSwitch fabric's nodes (/dev/nvidia-nvswitchctl, /dev/nvidia-nvswitchN on
# HGX hosts), by the driver's char major in /proc/devices: nothing where the host has no NVSwitch.
NVSWITCH_DEVICE_CLASS = "char-nvidia-nvswitch"
# What NCCL writes outside the cache directory: its shared-memory transport and proxy buffers (/dev/shm/nccl-*).
NCCL_WRITABLE = ("/dev/shm",)
STOP_TIMEOUT = 60  # s: the unit's stop timeout (a one-GPU server's SIGTERM shutdown)
TP_TEARDOWN_S = 10  # s per GPU of a TP group: its scheduler processes' own exit after the main process's drain

# --- the plugin's contract (see module docstring) ---
PLUGIN_NAME = contract.PLUGIN_NAME
MODE_ENV = contract.MODE_ENV
BUDGET_ENV = contract.BUDGET_ENV
ALGORITHM = {m: contract.algorithm(m) for m in contract.MODES}

SECRET_KEY_RE = re.compile("(" + "|".join(contract.SECRET_NAME_MARKERS) + ")", re.I)  # contract.secret_name
# JIT caches: under the unit's CacheDirectory (/var/cache/sglang-ddtree/gpuN, kept by systemd across restarts),
# one folder per payload (plugin source + overlays + launcher: what a release changes in the code that compiles),
# so a restart or a rollback to the same payload finds its kernels compiled, and a new payload never picks up
# another's. The variables and folder names are the contract's (transient bench/smoke servers seed theirs from
# these folders).
CACHE_ROOT = contract.JIT_CACHE_ROOT
CACHE_ENV = contract.JIT_CACHE_ENV
RESERVED_ENV = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NCCL_SOCKET_IFNAME", "SGLANG_ARGS", "SGLANG_HOST", "SGLANG_PORT",
                contract.PLUGIN_ALLOWLIST_ENV, "PYTHONPATH", MODE_ENV, BUDGET_ENV} | {k for k, _d in CACHE_ENV}
# Flags only a unit passes (what is served is the same as a transient bench/smoke server's of the same service):
# the name the router and clients use, and the /metrics the drain and `fab status` read.
UNIT_FLAGS = {"--served-model-name": 1, "--enable-metrics": 0}  # flag -> how many values follow it


class RenderError(ValueError):
    """A service whose settings cannot be rendered safely (names the host, GPU and setting)."""


def unit_name(instance: str) -> str:
    return f"{UNIT_PREFIX}{instance}.service"


def credential_path(instance: str) -> str:
    """Where systemd 252 puts the API-key credential for this instance (`%d/<CREDENTIAL>` in the unit)."""
    return f"/run/credentials/{unit_name(instance)}/{CREDENTIAL}"


def _check_host(host: Host) -> None:
    """The host values a unit renders, matched whole again (a Host may be built without the inventory loader)."""
    v = host.vars
    for key, check in (("release_root", values.deep_abs_path), ("venv", values.abs_path),
                       ("service_user", values.service_user), ("listen_address", values.listen_address),
                       ("api_key_file", lambda x: None if x is None else values.abs_path(x))):
        if problem := check(v.get(key, "127.0.0.1" if key == "listen_address" else None)):
            raise RenderError(f"{host.name}: {key}: {problem}")


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
    if not svc.draft_model:
        raise RenderError(f"{where}: mode {svc.mode} needs a draft model (vars.draft_model)")
    if svc.mode not in contract.MODES:
        raise RenderError(f"{where}: mode {svc.mode!r} is not one of {', '.join(contract.MODES)}")
    if contract.is_ddtree(svc.mode) and (problem := contract.budget_problem(svc.budget, svc.mode)):
        raise RenderError(f"{where}: budget {problem}")
    # The contract's server (contract.sglang_args). Decode CUDA graphs in tree-verify: the plugin's SGLang 0.5.17
    # adapter captures the target's verify graph with the tree mask (it ran so on an H200); with other versions it
    # refuses graphs, and the plan refuses the host first (coherence.tree_graph_refusal) unless the service says
    # cuda_graphs: false.
    if svc.tp > 1 and svc.tp_port is None:
        raise RenderError(f"{where}: a TP group of {svc.tp} GPUs without its ports (contract.tp_ports)")
    args = contract.sglang_args(svc.mode, svc.model, svc.draft_model, budget=svc.budget, block=svc.block_size,
                                host=svc.listen, port=svc.port, decode_graphs=svc.cuda_graphs, tp=svc.tp,
                                tp_port=svc.tp_port)
    if svc.served_model_name:
        args += ["--served-model-name", svc.served_model_name]
    # --enable-metrics: SGLang's Prometheus /metrics, which the drain and `fab status` read
    args += ["--enable-metrics"]
    for a in svc.extra_args:  # no secrets, no flag the deploy tool sets (the inventory loader says file:line)
        if problem := values.extra_arg(a):
            raise RenderError(f"{where}: extra_args: {problem}")
    args += list(svc.extra_args)
    if problem := values.listen_address(svc.listen):
        raise RenderError(f"{where}: listen_address: {problem}")
    for a in args:
        if not values.ARG_RE.fullmatch(a):
            raise RenderError(f"{where}: argument {a!r} is empty or has whitespace, control characters, quotes, "
                              "'$', '%', '#', ';' or '\\' (systemd splits $SGLANG_ARGS on whitespace; put such "
                              "values in a config file)")
    return args


def decode_cuda_graphs(svc: Service) -> bool:
    """Whether the rendered server runs SGLang's decode CUDA graphs (what `mode: auto` matches bench runs by):
    off when its argv disables them (tree-verify today, or the service's own extra_args), else on."""
    args = server_args(svc)
    off = False
    for i, a in enumerate(args):  # argparse keeps the last value given
        if a == "--disable-cuda-graph":
            off = True
        elif a == "--cuda-graph-backend-decode" and i + 1 < len(args):
            off = args[i + 1] == "disabled"
        elif a.startswith("--cuda-graph-backend-decode="):
            off = a.split("=", 1)[1] == "disabled"
    return not off


def plugin_contract(caps: dict | None) -> dict:
    """Names the plugin declares in its capabilities.json, with the defaults above where it declares none."""
    caps = caps or {}
    return {"plugin": (caps.get("entry_point") or {}).get("name") or PLUGIN_NAME,
            "allowlist_env": caps.get("plugin_allowlist_env") or contract.PLUGIN_ALLOWLIST_ENV,
            "mode_env": caps.get("mode_env") or MODE_ENV, "budget_env": caps.get("budget_env") or BUDGET_ENV}


def cache_dirs(svc: Service, cache_key: str) -> list[tuple[str, str]]:
    """The JIT cache variables of one service for one payload (see CACHE_ENV)."""
    base = f"{CACHE_ROOT}/{svc.instance}/{cache_key[:16]}"
    return [(k, f"{base}/{d}") for k, d in CACHE_ENV]


def service_env(svc: Service, caps: dict | None = None, cache_key: str | None = None) -> list[tuple[str, str]]:
    """The per-GPU EnvironmentFile, in order. Inventory `env` comes last; secrets are refused.

    `caps` is the plugin's capabilities.json: its entry-point name, mode and budget variables are used;
    `cache_key` (the payload digest) names the JIT cache folder."""
    where = f"{svc.host} gpu{svc.gpu}"
    c = plugin_contract(caps)
    # the contract's environment (contract.sglang_env: the GPU, as nvidia-smi numbers it so index N is /dev/nvidiaN
    # of the unit's device drop-in, then DDTREE's allow-list, mode and budget), under the names the wheel declares
    named = {contract.PLUGIN_ALLOWLIST_ENV: c["allowlist_env"], contract.MODE_ENV: c["mode_env"],
             contract.BUDGET_ENV: c["budget_env"]}
    base = contract.sglang_env(svc.mode, svc.budget, svc.gpus)
    n = 3 if svc.tp > 1 else 2  # the GPUs (and a TP group's NCCL interface) first
    env = base[:n] + [("SGLANG_HOST", svc.listen), ("SGLANG_PORT", str(svc.port)),
                      ("SGLANG_ARGS", " ".join(server_args(svc)))]
    if cache_key:
        env += cache_dirs(svc, cache_key)
    for k, v in base[n:]:
        if named.get(k, k):
            env.append((named.get(k, k), c["plugin"] if k == contract.PLUGIN_ALLOWLIST_ENV else v))
    reserved = RESERVED_ENV | {c["allowlist_env"], c["mode_env"]} | ({c["budget_env"]} if c["budget_env"] else set())
    for k, v in svc.env:
        if values.env_key(k):
            raise RenderError(f"{where}: env {k!r} is not a valid variable name")
        if k in reserved:
            raise RenderError(f"{where}: env {k} is set by the deploy tool; use the inventory's own settings")
        if SECRET_KEY_RE.search(k):
            raise RenderError(f"{where}: env {k} looks like a secret; secrets never go into releases or units: "
                              f"put it in {SECRETS_FILE} on the host (mode 0600)")
        if problem := values.env_value(v):
            raise RenderError(f"{where}: env {k}: {problem}")
        env.append((k, v))
    return env


def service_argv(host: Host, svc: Service) -> list[str]:
    """The full argv systemd runs for this service (ExecStart with $SGLANG_ARGS split as systemd does, and
    `--config %d/sglang-server.yaml` expanded where the host has an API key)."""
    key = ["--config", credential_path(svc.instance)] if host.vars.get("api_key_file") else []
    return launcher_argv(host) + server_args(svc) + key


def _jinja() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)


def render_unit(host: Host) -> str:
    _check_host(host)
    v = host.vars
    listen = v.get("listen_address", "127.0.0.1")
    return _jinja().get_template(UNIT_TEMPLATE).render(
        unit_name=UNIT_FILE, release_root=v["release_root"], state_dir=state_dir(host),
        service_user=v["service_user"], exec_start=" ".join(launcher_argv(host)), system_python=SYSTEM_PYTHON,
        start_timeout=v["start_timeout"], stop_timeout=STOP_TIMEOUT, restart_sec=10,
        start_limit_interval=max(600, 3 * v["start_timeout"]), start_limit_burst=3, secrets_file=SECRETS_FILE,
        api_key_file=v.get("api_key_file"), credential=CREDENTIAL, listen_address=listen,
        loopback=values.is_loopback(listen), shared_devices=NVIDIA_SHARED_DEVICES, gpu_dropin=GPU_DROPIN,
        server_path=contract.server_path(v["venv"]))


def gpu_devices(svc: Service) -> list[str]:
    """The device nodes of this service's own GPU(s): every GPU of a TP group, no other."""
    return [f"/dev/nvidia{g}" for g in svc.gpus]


def stop_timeout(svc: Service, drain_timeout: int | None = None) -> int:
    """TimeoutStopSec of a service. A TP group stops as one server: KillMode=mixed sends SIGTERM to SGLang's main
    process alone, which drains its requests (SGLang's tokenizer manager) and then ends its TP scheduler processes
    itself; systemd's SIGKILL reaches the group only past this timeout, which covers the router's drain_timeout
    (what the main process may still be finishing) plus TP_TEARDOWN_S per GPU. One GPU: the unit's STOP_TIMEOUT."""
    if svc.tp == 1:
        return STOP_TIMEOUT
    return max(STOP_TIMEOUT, int(drain_timeout or 0)) + TP_TEARDOWN_S * svc.tp


def dropin_path(instance: str) -> str:
    """Relative to /etc/systemd/system (and to a release's systemd/ folder)."""
    return f"{UNIT_PREFIX}{instance}.service.d/{GPU_DROPIN}"


def render_dropin(svc: Service, drain_timeout: int | None = None) -> str:
    """The per-service drop-in: DeviceAllow for this service's own GPU(s) (the template unit allows no GPU); a TP
    group's also allows the NVSwitch nodes, keeps /dev/shm writable for NCCL and sets the stop (stop_timeout:
    `drain_timeout` is the host router's)."""
    return _jinja().get_template(DROPIN_TEMPLATE).render(
        unit=unit_name(svc.instance), dropin=GPU_DROPIN, host=svc.host, gpus=",".join(map(str, svc.gpus)),
        devices=gpu_devices(svc), tp=svc.tp, nvswitch=NVSWITCH_DEVICE_CLASS, writable=NCCL_WRITABLE,
        stop_timeout=stop_timeout(svc, drain_timeout))


def render_env(svc: Service, caps: dict | None = None, cache_key: str | None = None) -> str:
    return _jinja().get_template(ENV_TEMPLATE).render(host=svc.host, instance=svc.instance,
                                                      env=service_env(svc, caps, cache_key), secrets_file=SECRETS_FILE)


def state_dir(host: Host) -> str:
    """Where the lock, the audit journal and service records live: the parent of release_root."""
    return str(Path(host.vars["release_root"]).parent)


def sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def service_digest(unit_text: str, env_text: str, payload_digest: str, dropin_text: str = "") -> str:
    """What decides a restart: the unit, this GPU's env file and device drop-in, and the payload (plugin source,
    overlays, launcher)."""
    return sha256("\0".join([unit_text, env_text, payload_digest] + ([dropin_text] if dropin_text else [])))
