"""Fleet inventory: one YAML file describes hosts, GPUs, services and shared variables.

Everything is validated before any connection is made; each error names `file:line` and the key.
Variables resolve from most general to most specific: fleet `vars` < each group's `vars` (in file
order) < the host's `vars` < the per-GPU `services` entry.

Services are keyed by GPU index: every GPU of a host runs one server unless a `services` entry groups several
GPUs into one tensor-parallel server (`services: {0: {gpus: [0, 1, 2, 3], tp: 4}}`), keyed by the group's lowest
GPU, whose other GPUs then run nothing else. A GPU belongs to at most one service; `tp` (when written) equals the
number of GPUs; the group's rendezvous ports (contract.tp_ports of the host's `tp_port_base`) may not meet another
listener of the host. Where the model's config.json is readable here, its attention heads are checked against tp
(the deploy plan checks them again from the host, with the GPUs' interconnect: deploy/release/hostfit.py).

Which file: `DEPLOY_INVENTORY=path` in the environment, else `inventory/hosts.yaml`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from . import canary, contract, modes, tp as tpmod, values
from .yamlpos import PosDict, PosList, YamlPosError, load_yaml

DEFAULT_INVENTORY = "inventory/hosts.yaml"


class InventoryError(ValueError):
    """All validation problems of one inventory file, each as `file:line: key: message`."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid inventory:\n  " + "\n  ".join(problems))


def _is_port(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 65535


def _in_range(lo, hi):
    def check(v):
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

    check.__doc__ = f"an integer in [{lo}, {hi}]"
    return check


def _budget(v):
    """A node budget, or a budget schedule (a mapping batch size -> budget or chain: contract.parse_budget)."""
    if isinstance(v, dict):
        try:
            contract.parse_budget(dict(v))
        except ValueError as e:
            return f"budget schedule {dict(v)!r}: {e}"
        return True
    return _in_range(modes.BUDGET_MIN, modes.BUDGET_MAX)(v)


def _str_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _each(item_check, desc: str):
    """A list whose every item passes `item_check` (problems point at the item's own line)."""
    def check(v):
        if not isinstance(v, list):
            return f"must be {desc}, got {v!r}"
        return [(i, p) for i, x in enumerate(v) if (p := item_check(x))]
    return check


def _env_map(v):
    if not isinstance(v, dict):
        return f"must be a mapping of names to strings, got {v!r}"
    out = []
    for k, x in v.items():
        if not isinstance(x, (str, int, float)) or isinstance(x, bool):
            out.append((k, f"{k}: must be a string or a number, got {x!r}"))
        elif p := (values.env_key(k) or values.env_value(x)):
            out.append((k, f"{k}: {p}" if not p.startswith(repr(k)) else p))
        elif k == contract.CHAIN_STEP_ENV and (p := _chain_step_problem(x)):
            out.append((k, f"{k}: {p}"))
    return out


def _chain_step_problem(x) -> str | None:
    """What the plugin would refuse at start in this value of CHAIN_STEP_ENV (its own parser decides)."""
    try:
        contract.parse_chain_step(str(x))
    except ValueError:
        return (f"must be one of {', '.join(contract.CHAIN_STEPS)} (which step serves a budget schedule's chain "
                f"entries), got {values._show(str(x))}")
    return None


def _api_key_file(v):
    return None if v is None else values.abs_path(v)


ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# The host's router (sglang-router.service): its keys, each with its check and description. A scope's `router`
# mapping is merged key by key over the wider scopes' (fleet < groups < host), not replaced whole.
ROUTER_KEYS = {
    "enabled": (lambda v: isinstance(v, bool), "true or false"),
    "port": (_is_port, "a TCP port (1-65535)"),
    "metrics_port": (_is_port, "a TCP port (1-65535)"),
    "drain_timeout": (_in_range(0, 7200), "seconds, an integer in [0, 7200]"),
    # how long the router holds a request no worker can take (a one-GPU host's restart) before answering 503
    "hold_secs": (_in_range(0, 3600), "seconds, an integer in [0, 3600]"),
    "policy": (lambda v: v in ROUTER_POLICIES, "one of " + ", ".join(ROUTER_POLICIES)),
}
DEFAULT_ROUTER = {"enabled": True, "port": 8000, "metrics_port": 29000, "drain_timeout": 300, "hold_secs": 90,
                  "policy": "cache_aware"}


def _router_map(v):
    if not isinstance(v, dict):
        return f"must be a mapping with keys {', '.join(ROUTER_KEYS)}, got {v!r}"
    out = []
    for k, x in v.items():
        if k not in ROUTER_KEYS:
            out.append((k, f"{k}: unknown key (allowed: {', '.join(sorted(ROUTER_KEYS))})"))
            continue
        check, desc = ROUTER_KEYS[k]
        if not check(x):
            out.append((k, f"{k}: must be {desc}, got {x!r}"))
    return out


# key -> (check, description). A check returns True/None (fine), False (must be <description>), a message,
# or a list of (item index or key, message) for list and mapping items. Shared variables may appear in fleet,
# group, host and service scope. Every string that is rendered into a unit, an environment file or argv, or
# used as a path on a host, is matched whole against a strict pattern (deploy/values.py).
VARS: dict[str, tuple] = {
    "venv": (values.abs_path, "an absolute path"),
    "model": (values.abs_path, "an absolute path"),
    "draft_model": (values.abs_path, "an absolute path"),
    "served_model_name": (values.served_model_name, "a model name"),
    "mode": (lambda v: v in modes.INVENTORY_MODES, "one of " + ", ".join(modes.INVENTORY_MODES)),
    # the concurrent requests a service is sized for: what `mode: auto` picks the mode and budget for
    # (or `all`: every load, and mode auto deploys the budget schedule fab bench proposes)
    "concurrency": (lambda v: v == modes.CONCURRENCY_ALL or _in_range(modes.CONCURRENCY_MIN, modes.CONCURRENCY_MAX)(v),
                    f"an integer in [{modes.CONCURRENCY_MIN}, {modes.CONCURRENCY_MAX}] or {modes.CONCURRENCY_ALL!r}"),
    # one node budget, or a schedule by batch size ({1: 127, 4: 31, 64: chain}: tree-verify; the contract's rules)
    "budget": (_budget, f"an integer in [{modes.BUDGET_MIN}, {modes.BUDGET_MAX}] or a schedule "
                        f"{{batch size: budget or {contract.CHAIN}}}"),
    "block_size": (_in_range(modes.BLOCK_SIZE_MIN, modes.BLOCK_SIZE_MAX),
                   f"an integer in [{modes.BLOCK_SIZE_MIN}, {modes.BLOCK_SIZE_MAX}]"),
    # decode CUDA graphs (SGLang's own); in tree-verify only where the plugin's adapter for the host's SGLang
    # captures the verify graph with the tree mask (capabilities.json tree_verify_cuda_graphs; the plan checks)
    "cuda_graphs": (lambda v: isinstance(v, bool), "true or false"),
    "base_port": (_is_port, "a TCP port (1-65535)"),
    "extra_args": (_each(values.extra_arg, "a list of strings"), "a list of strings"),
    "env": (_env_map, "a mapping of names to strings"),
    "service_user": (values.service_user, "a non-root user name"),
    "release_root": (values.deep_abs_path, "an absolute path"),
    "releases_keep": (_in_range(1, 100), "an integer in [1, 100]"),
    "max_unavailable": (_in_range(1, 64), "an integer in [1, 64]"),
    "start_timeout": (_in_range(1, 7200), "seconds, an integer in [1, 7200]"),
    "gate_timeout": (_in_range(1, 3600), "seconds, an integer in [1, 3600]"),
    "managed": (_each(values.dist_pattern, "a list of distribution name patterns"),
                "a list of distribution name patterns"),
    "wheelhouse": (_each(values.abs_path, "a list of absolute paths"), "a list of absolute paths"),
    # the reference's unmet requirements (by the dependency's name) that provision accepts, as warnings
    "accept_unmet": (_each(values.dist_pattern, "a list of distribution name patterns"),
                     "a list of distribution name patterns"),
    # what ExecStart runs: SGLang from the venv, or the lab's named stand-in (deploy/labserver) on CPU lab hosts
    "server": (lambda v: v in ("sglang", "labserver"), "'sglang' or 'labserver'"),
    # where each server listens (--host); anything but loopback needs an API key (checked per host below)
    "listen_address": (values.listen_address, "an IP address"),
    # the host's root-only 0600 file holding `api-key: KEY` (SGLang --config YAML), or null for no key
    "api_key_file": (_api_key_file, "an absolute path or null"),
    # the host's one endpoint: sglang-router on listen_address in front of its GPU services (then on loopback)
    "router": (_router_map, "a mapping"),
    # the rollout gate's canary (deploy/canary.py): held prompts, tokens, margin, accept_floor, enabled
    "canary": (canary.check, "a mapping"),
    # expected seconds from a restart to /health 200, instead of deploy/startup.py's table (the gate's start
    # timeout and the rollout estimate follow it)
    "start_seconds": (_in_range(1, 7200), "seconds, an integer in [1, 7200]"),
    # where a host's TP groups' rendezvous ports start (contract.tp_ports: base + 2 * the group's first GPU)
    "tp_port_base": (_is_port, "a TCP port (1-65535)"),
}


def _gpu_index_list(v):
    if not isinstance(v, list) or not v:
        return f"must be a non-empty list of GPU indices, got {v!r}"
    out = [(i, f"GPU index {x!r} must be an integer in [0, 63]") for i, x in enumerate(v)
           if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < 64]
    seen = set()
    for i, x in enumerate(v):
        if x in seen:
            out.append((i, f"GPU index {x} is listed twice"))
        seen.add(x)
    return out


SERVICE_KEYS = {"port": (_is_port, "a TCP port (1-65535)"), "enabled": (lambda v: isinstance(v, bool), "true or false"),
                # a tensor-parallel service: its GPUs (the entry's key is the lowest), their count, and whether a
                # group without peer-to-peer between its GPUs (nvidia-smi topo -m: NODE/SYS) is accepted
                "gpus": (_gpu_index_list, "a list of GPU indices"),
                "tp": (_in_range(1, 64), "an integer in [1, 64]"),
                "accept_no_p2p": (lambda v: isinstance(v, bool), "true or false")}
SERVICE_VARS = ("model", "draft_model", "served_model_name", "mode", "budget", "block_size", "extra_args", "env",
                "concurrency", "cuda_graphs")
DEFAULT_VARS = {
    "venv": "/opt/sglang/venv",
    "mode": modes.DEFAULTS["mode"],
    "budget": modes.DEFAULTS["budget"],
    "block_size": modes.DEFAULTS["block_size"],
    "cuda_graphs": True,
    "base_port": 30000,
    "extra_args": [],
    "env": {},
    "service_user": "sglang",
    "release_root": "/opt/ddtree/releases",
    "releases_keep": 5,
    "max_unavailable": 1,
    "start_timeout": 1800,
    "gate_timeout": 120,
    "managed": ["torch", "triton", "sglang", "sglang-kernel", "flashinfer*", "nvidia-*", "cuda-*", "sglang-ddtree"],
    "wheelhouse": [],
    "accept_unmet": [],
    "server": "sglang",
    "listen_address": "127.0.0.1",
    "api_key_file": None,
    "router": DEFAULT_ROUTER,
    "tp_port_base": contract.TP_PORT_BASE,
}
SSH_KEYS = {
    "user": (values.ssh_user, "a user name"),
    "port": (_is_port, "a TCP port (1-65535)"),
    "known_hosts": (values.local_path, "a path"),
    "identity_file": (values.local_path, "a path"),
    "connect_timeout": (_in_range(1, 600), "seconds, an integer in [1, 600]"),
    "connect_retries": (_in_range(0, 5), "new connections after sshd cut a handshake, an integer in [0, 5]"),
}
SETTINGS_KEYS = {
    "parallel": (_in_range(1, 256), "an integer in [1, 256]"),
    "facts_ttl": (_in_range(0, 86400 * 30), "seconds, an integer >= 0"),
}
HOST_KEYS = {"address", "user", "port", "gpus", "vars", "services", "groups"}
TOP_KEYS = {"fleet", "reference", "ssh", "settings", "vars", "groups", "hosts"}


@dataclass(frozen=True)
class Service:
    """One SGLang server on its GPU(s): `gpu` is the first (lowest) of `gpus`, which name the service
    (`instance`); more than one GPU is a tensor-parallel group (`tp` = their count)."""

    host: str
    gpu: int
    port: int
    model: str | None
    draft_model: str | None
    served_model_name: str | None
    mode: str
    budget: int | contract.BudgetSchedule  # one node budget, or a schedule by batch size (tree-verify)
    block_size: int
    extra_args: tuple = ()
    env: tuple = ()  # sorted (name, value) pairs: hashable and printable
    enabled: bool = True
    listen: str = "127.0.0.1"  # --host: the host's listen_address
    concurrency: int | str | None = None  # the concurrent requests it is sized for (mode auto picks for it), or "all"
    auto: str | None = None  # set by `fab deploy` when the mode and budget came from `mode: auto`: why (bench)
    cuda_graphs: bool = True  # SGLang's decode CUDA graphs (tree-verify: where the plugin's adapter supports them)
    # where each of its values came from, "file:line: key" (gpu, port, model, draft_model): what a plan-time
    # refusal of that value names
    where: dict = field(default_factory=dict, hash=False, compare=False)
    gpus: tuple = ()  # every GPU of the service, lowest first ((gpu,) when not given)
    tp_port: tuple | None = None  # a TP group's (dist-init, NCCL) ports: contract.tp_ports
    accept_no_p2p: bool = False  # a TP group over GPUs without peer-to-peer is deployed anyway

    def __post_init__(self):
        if not self.gpus:
            object.__setattr__(self, "gpus", (self.gpu,))
        elif self.gpus[0] != self.gpu:
            raise ValueError(f"{self.host}: a service's gpu {self.gpu} must be the first of its gpus {self.gpus}")

    @property
    def instance(self) -> str:
        """The service's name on the host (sglang-ddtree@<instance>): its first GPU's, for a TP group too."""
        return f"gpu{self.gpu}"

    @property
    def tp(self) -> int:
        return len(self.gpus)


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    user: str
    port: int
    gpus: tuple[int, ...]
    vars: dict = field(hash=False, compare=False, default_factory=dict)
    services: tuple[Service, ...] = ()
    groups: tuple[str, ...] = ()
    # where its host-level values came from, "file:line: key" (router.port, router.metrics_port)
    where: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def venv(self) -> str:
        return self.vars["venv"]


@dataclass
class Inventory:
    path: str
    fleet: str
    reference_name: str
    hosts: dict[str, Host]
    groups: dict[str, tuple[str, ...]]
    ssh: dict
    settings: dict

    @property
    def reference(self) -> Host:
        return self.hosts[self.reference_name]

    def select(self, names: str | list[str] | None) -> list[Host]:
        """Hosts by comma list or list of names or group names; None means every host."""
        if names is None or names == "" or names == []:
            return list(self.hosts.values())
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",") if n.strip()]
        out: list[Host] = []
        for n in names:
            if n in self.hosts:
                picked = [self.hosts[n]]
            elif n in self.groups:
                picked = [self.hosts[h] for h in self.groups[n]]
            else:
                known = ", ".join(sorted(self.hosts) + sorted(self.groups))
                raise InventoryError([f"{self.path}: unknown host or group {n!r} (known: {known})"])
            out += [h for h in picked if h not in out]
        return out

    def ssh_path(self, key: str) -> str | None:
        """An ssh path setting, expanded (~ and relative to the inventory file's folder)."""
        v = self.ssh.get(key)
        if not v:
            return None
        v = os.path.expanduser(v)
        return v if os.path.isabs(v) else str(Path(self.path).parent / v)


def inventory_path(explicit: str | None = None) -> str:
    return explicit or os.environ.get("DEPLOY_INVENTORY") or DEFAULT_INVENTORY


class _Checker:
    def __init__(self, path: str):
        self.path = path
        self.problems: list[str] = []

    def err(self, line: int, key: str, msg: str) -> None:
        self.problems.append(f"{self.path}:{line}: {key}: {msg}")

    def mapping(self, node, where: str, line: int) -> PosDict | None:
        if node is None:
            node = PosDict()
            node.line = line
        if not isinstance(node, dict):
            self.err(line, where, f"must be a mapping, got {type(node).__name__}")
            return None
        return node

    def known(self, node: PosDict, allowed, where: str) -> None:
        for k in node:
            if k not in allowed:
                hint = ", ".join(sorted(map(str, allowed)))
                self.err(node.line_of(k), f"{where}.{k}" if where else str(k), f"unknown key (allowed: {hint})")

    def typed(self, node: PosDict, table: dict, where: str) -> dict:
        out = {}
        for k, v in node.items():
            if k in table:
                check, desc = table[k]
                if self.check(node, k, v, check, desc, f"{where}.{k}"):
                    out[k] = list(v) if isinstance(v, list) else (dict(v) if isinstance(v, dict) else v)
        return out

    def check(self, node: PosDict, k, v, check, desc: str, key: str) -> bool:
        """Run one check (see VARS); report its problems at the value's line, or at each bad item's line."""
        r = check(v)
        if r is True or r is None or r == []:
            return True
        if r is False:
            self.err(node.line_of(k), key, f"must be {desc}, got {v!r}")
        elif isinstance(r, str):
            self.err(node.line_of(k), key, r)
        else:
            for item, msg in r:
                line = v.line_of(item) if isinstance(v, (PosList, PosDict)) else node.line_of(k)
                self.err(line, key, msg)
        return False


def load_inventory(path: str | None = None) -> Inventory:
    """Read and validate an inventory file; raise InventoryError listing every problem found."""
    path = inventory_path(path)
    if not os.path.exists(path):
        raise InventoryError([f"{path}: no such inventory file (set DEPLOY_INVENTORY or create it)"])
    try:
        doc = load_yaml(path)
    except YamlPosError as exc:
        raise InventoryError([str(exc)]) from None
    return parse_inventory(doc, path)


def parse_inventory(doc, path: str) -> Inventory:
    c = _Checker(path)
    if not isinstance(doc, dict):
        raise InventoryError([f"{path}:1: the file must be a mapping with 'hosts' and 'reference'"])
    c.known(doc, TOP_KEYS, "")
    for req in ("hosts", "reference"):
        if req not in doc:
            c.err(doc.line or 1, req, "required key is missing")

    ssh = c.typed(c.mapping(doc.get("ssh"), "ssh", doc.line_of("ssh")) or PosDict(), SSH_KEYS, "ssh")
    if isinstance(doc.get("ssh"), dict):
        c.known(doc["ssh"], SSH_KEYS, "ssh")
    settings_node = c.mapping(doc.get("settings"), "settings", doc.line_of("settings")) or PosDict()
    c.known(settings_node, SETTINGS_KEYS, "settings")
    settings = {"parallel": 16, "facts_ttl": 600} | c.typed(settings_node, SETTINGS_KEYS, "settings")

    fleet_vars = _vars(c, doc.get("vars"), "vars", doc.line_of("vars"))

    hosts_node = c.mapping(doc.get("hosts"), "hosts", doc.line_of("hosts")) or PosDict()
    if isinstance(doc.get("hosts"), dict) and not hosts_node:
        c.err(doc.line_of("hosts"), "hosts", "at least one host is required")

    groups: dict[str, tuple[str, ...]] = {}
    group_vars: dict[str, dict] = {}
    groups_node = c.mapping(doc.get("groups"), "groups", doc.line_of("groups")) or PosDict()
    for gname, gnode in groups_node.items():
        where = f"groups.{gname}"
        g = c.mapping(gnode, where, groups_node.line_of(gname))
        if g is None:
            continue
        c.known(g, {"hosts", "vars"}, where)
        members = g.get("hosts", [])
        if not _str_list(members):
            c.err(g.line_of("hosts"), f"{where}.hosts", "must be a list of host names")
            members = []
        for i, m in enumerate(members):
            if m not in hosts_node:
                c.err(members.line_of(i) if isinstance(members, PosList) else g.line, f"{where}.hosts",
                      f"{m!r} is not a host of this inventory")
        if not isinstance(gname, str) or not values.GROUP_RE.fullmatch(gname):
            c.err(groups_node.line_of(gname), where, f"group names are letters, digits, '_', '.', '-', got {gname!r}")
        if gname in hosts_node:
            c.err(groups_node.line_of(gname), where, "a group cannot have the name of a host")
        groups[gname] = tuple(m for m in members if m in hosts_node)
        group_vars[gname] = _vars(c, g.get("vars"), f"{where}.vars", g.line_of("vars"))

    hosts: dict[str, Host] = {}
    addresses: dict[tuple, str] = {}
    for hname, hnode in hosts_node.items():
        where = f"hosts.{hname}"
        hline = hosts_node.line_of(hname)
        if not isinstance(hname, str) or not values.HOSTNAME_RE.fullmatch(hname):
            c.err(hline, where, f"host names are lower-case letters, digits and '-', got {hname!r}")
        h = c.mapping(hnode, where, hline)
        if h is None:
            continue
        c.known(h, HOST_KEYS, where)
        address = h.get("address")
        if problem := values.address(address):
            c.err(h.line_of("address") if "address" in h else hline, f"{where}.address", problem)
            address = ""
        user = h.get("user", ssh.get("user", "root"))
        if "user" in h and (problem := values.ssh_user(user)):
            c.err(h.line_of("user"), f"{where}.user", problem)
        port = h.get("port", ssh.get("port", 22))
        if not _is_port(port):
            c.err(h.line_of("port"), f"{where}.port", f"must be a TCP port (1-65535), got {port!r}")
            port = 22
        if address and (address, port) in addresses:
            c.err(h.line_of("address"), f"{where}.address", f"{address}:{port} is also host {addresses[(address, port)]}")
        addresses[(address, port)] = hname

        gpus = _gpus(c, h, where)
        member_of = tuple(g for g, ms in groups.items() if hname in ms)
        extra_groups = h.get("groups", [])
        if not _str_list(extra_groups):
            c.err(h.line_of("groups"), f"{where}.groups", "must be a list of group names")
            extra_groups = []
        for g in extra_groups:
            if g not in groups_node:
                c.err(h.line_of("groups"), f"{where}.groups", f"unknown group {g!r}")
            elif g not in member_of:
                groups[g] = groups.get(g, ()) + (hname,)
                member_of += (g,)
        resolved = _merged(dict(DEFAULT_VARS), fleet_vars)
        for g in groups_node:  # file order, so later groups win
            if g in member_of:
                resolved = _merged(resolved, group_vars.get(g, {}))
        resolved = _merged(resolved, _vars(c, h.get("vars"), f"{where}.vars", h.line_of("vars")))
        _check_exposure(c, resolved, [(h.get("vars"), f"{where}.vars")]
                        + [(groups_node[g].get("vars"), f"groups.{g}.vars") for g in reversed(list(groups_node))
                           if g in member_of and isinstance(groups_node[g], dict)] + [(doc.get("vars"), "vars")],
                        hline, hname)
        origins = {}
        for node, scope in [(doc.get("vars"), "vars")] + [
                (groups_node[g].get("vars"), f"groups.{g}.vars") for g in groups_node
                if g in member_of and isinstance(groups_node[g], dict)] + [(h.get("vars"), f"{where}.vars")]:
            origins.update(_origins(path, node, scope))
        services = _services(c, h, where, hname, gpus, resolved, hline, origins)
        router = resolved["router"]
        if router["enabled"]:
            taken = {s.port: f"GPU {s.gpu}" for s in services}
            for key in ("port", "metrics_port"):
                if router[key] in taken:
                    c.err(hline, f"{where}.router.{key}", f"port {router[key]} is also used by {taken[router[key]]} "
                                                          f"on {hname}")
                taken[router[key]] = f"router.{key}"
        hosts[hname] = Host(hname, address, user, port, gpus, resolved, services, member_of,
                            {k: origins.get(k, f"{path}:{hline}: {where} (default {k})")
                             for k in ("router.port", "router.metrics_port")})

    ref = doc.get("reference")
    if "reference" in doc and (not isinstance(ref, str) or ref not in hosts_node):
        c.err(doc.line_of("reference"), "reference", f"{ref!r} is not one of the listed hosts ({', '.join(map(str, hosts_node))})")
    fleet = doc.get("fleet", Path(path).stem)
    if "fleet" in doc and (not isinstance(fleet, str) or not values.FLEET_RE.fullmatch(fleet)):
        c.err(doc.line_of("fleet"), "fleet", f"must be a name (letters, digits, '_', '.', '-'), got {fleet!r}")
    if c.problems:
        raise InventoryError(c.problems)
    return Inventory(path, fleet, ref, hosts, groups, ssh, settings)


def service_listen(resolved: dict) -> str:
    """Where a GPU server listens: loopback when the host's router is its one endpoint (the router listens on
    listen_address), else listen_address."""
    return "127.0.0.1" if (resolved.get("router") or {}).get("enabled") else resolved["listen_address"]


def _check_exposure(c: _Checker, resolved: dict, scopes: list, hline: int, hname: str) -> None:
    """A server reachable from other machines must ask for an API key: a listen address other than loopback
    needs api_key_file. Reported where listen_address was set (the most specific scope that sets it)."""
    listen = resolved.get("listen_address")
    if values.listen_address(listen) or values.is_loopback(listen) or resolved.get("api_key_file"):
        return
    for node, where in scopes:
        if isinstance(node, dict) and "listen_address" in node:
            c.err(node.line_of("listen_address"), f"{where}.listen_address",
                  f"{listen} is reachable from other machines: host {hname} also needs api_key_file (a root-only "
                  "0600 file on the host holding `api-key: KEY`), or listen on 127.0.0.1")
            return
    c.err(hline, f"hosts.{hname}", "listen_address is not loopback and no api_key_file is set")


def _merged(resolved: dict, scope: dict) -> dict:
    """`scope`'s variables over `resolved`'s; `router` and `canary` key by key (a host's `router: {port: 8001}`
    keeps the fleet's other router settings)."""
    out = resolved | scope
    if "router" in scope:
        out["router"] = dict(resolved.get("router") or {}) | scope["router"]
    if "canary" in scope:
        out["canary"] = dict(resolved.get("canary") or {}) | scope["canary"]
    return out


# the values a plan checks against the host's facts (deploy/release/hostfit.py), whose origin each host keeps
ORIGIN_KEYS = ("model", "draft_model", "base_port")


def _origins(path: str, node, where: str) -> dict[str, str]:
    """{key: "file:line: scope.key"} for the ORIGIN_KEYS and router ports a scope's `vars` sets."""
    out = {}
    if not isinstance(node, PosDict):
        return out
    for k in ORIGIN_KEYS:
        if k in node:
            out[k] = f"{path}:{node.line_of(k)}: {where}.{k}"
    r = node.get("router")
    if isinstance(r, PosDict):
        for k in ("port", "metrics_port"):
            if k in r:
                out[f"router.{k}"] = f"{path}:{r.line_of(k)}: {where}.router.{k}"
    return out


def _vars(c: _Checker, node, where: str, line: int) -> dict:
    m = c.mapping(node, where, line)
    if m is None:
        return {}
    c.known(m, VARS, where)
    return c.typed(m, VARS, where)


def _gpus(c: _Checker, h: PosDict, where: str) -> tuple[int, ...]:
    g = h.get("gpus", 0)
    line = h.line_of("gpus")
    if isinstance(g, int) and not isinstance(g, bool):
        if not 0 <= g <= 64:
            c.err(line, f"{where}.gpus", f"a GPU count must be in [0, 64], got {g}")
            return ()
        return tuple(range(g))
    if isinstance(g, list) and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 64 for x in g):
        seen = set()
        for i, x in enumerate(g):
            if x in seen:
                c.err(g.line_of(i) if isinstance(g, PosList) else line, f"{where}.gpus", f"GPU index {x} is listed twice")
            seen.add(x)
        return tuple(sorted(seen))
    c.err(line, f"{where}.gpus", f"must be a GPU count or a list of GPU indices, got {g!r}")
    return ()


def _gpu_lines(c: _Checker, h: PosDict, where: str) -> dict[int, str]:
    """{gpu: "file:line: hosts.H.gpus"}: the line of each listed index (or of the count)."""
    g, line = h.get("gpus", 0), h.line_of("gpus")
    if isinstance(g, PosList):
        return {x: f"{c.path}:{g.line_of(i)}: {where}.gpus" for i, x in enumerate(g) if isinstance(x, int)}
    return {x: f"{c.path}:{line}: {where}.gpus" for x in range(g if isinstance(g, int) else 0)}


def _services(c: _Checker, h: PosDict, where: str, hname: str, gpus, resolved: dict,
              hline: int = 1, origins: dict | None = None) -> tuple[Service, ...]:
    snode = c.mapping(h.get("services"), f"{where}.services", h.line_of("services")) or PosDict()
    allowed = set(SERVICE_KEYS) | set(SERVICE_VARS)
    overrides: dict[int, dict] = {}
    for gpu, o in snode.items():
        swhere = f"{where}.services.{gpu}"
        sline = snode.line_of(gpu)
        if not isinstance(gpu, int) or isinstance(gpu, bool):
            c.err(sline, swhere, "service keys are GPU indices (integers)")
            continue
        if gpu not in gpus:
            c.err(sline, swhere, f"GPU {gpu} is not one of this host's GPUs {list(gpus)}")
            continue
        o = c.mapping(o, swhere, sline)
        if o is None:
            continue
        c.known(o, allowed, swhere)
        overrides[gpu] = c.typed(o, SERVICE_KEYS | {k: VARS[k] for k in SERVICE_VARS}, swhere)
        overrides[gpu]["_line"] = sline
        overrides[gpu]["_where"] = {k: f"{c.path}:{o.line_of(k)}: {swhere}.{k}" for k in ("port", "model",
                                                                                           "draft_model") if k in o}
        _group(c, o, overrides[gpu], gpu, gpus, swhere)
    covered = _groups_disjoint(c, overrides, where)
    origins = origins or {}
    gpu_at = _gpu_lines(c, h, where)
    out, ports, auto_told = [], {}, False
    for gpu in gpus:
        if gpu in covered:
            continue  # a GPU of another service's TP group
        o = overrides.get(gpu, {})
        v = resolved | {k: o[k] for k in SERVICE_VARS if k in o}
        port = o.get("port", resolved["base_port"] + gpu)
        if port in ports:
            c.err(o.get("_line", h.line_of("gpus")), f"{where}.services.{gpu}.port",
                  f"port {port} is also used by GPU {ports[port]} on {hname}")
        ports[port] = gpu
        if v["mode"] == modes.AUTO and v.get("concurrency") is None and ("mode" in o or not auto_told):
            # once per host when the host (or a group, or the fleet) set it; at the service when the service did
            line, key = (o["_line"], f"{where}.services.{gpu}") if "mode" in o else (hline, where)
            c.err(line, key, "mode auto needs concurrency: N (the concurrent requests this service is sized "
                  "for: fab deploy gives it the mode and budget fab bench measured fastest at N) or concurrency: "
                  "all (every load: the budget schedule fab bench proposes)")
            auto_told = auto_told or "mode" not in o
        budget = contract.parse_budget(v["budget"]) if isinstance(v["budget"], dict) else v["budget"]
        if isinstance(budget, contract.BudgetSchedule) and v["mode"] not in (modes.TREE_VERIFY, modes.AUTO) \
                and contract.is_ddtree(v["mode"]):
            line, key = (o["_line"], f"{where}.services.{gpu}") if "budget" in o or "mode" in o else (hline, where)
            c.err(line, key, f"budget {budget} is a schedule, which only {modes.TREE_VERIFY} serves; mode "
                  f"{v['mode']} takes one budget")
        group = o.get("_gpus") or (gpu,)
        tp_port = None
        if len(group) > 1:
            tp_port = _tp_port(c, o, resolved, gpu, h, where, hline)
            _local_heads(c, o, v, len(group), where, gpu, hline)
        sw = _service_where(o, origins, gpu_at.get(gpu, f"{c.path}:{hline}: {where}"), gpu)
        if "_gpus_at" in o:
            sw["gpus"] = o["_gpus_at"]
        out.append(Service(hname, gpu, port, v.get("model"), v.get("draft_model"), v.get("served_model_name"),
                           v["mode"], budget, v["block_size"], tuple(v["extra_args"]),
                           tuple(sorted((k, str(x)) for k, x in v["env"].items())), o.get("enabled", True),
                           service_listen(resolved), v.get("concurrency"), cuda_graphs=v["cuda_graphs"],
                           where=sw, gpus=group, tp_port=tp_port, accept_no_p2p=o.get("accept_no_p2p", False)))
    _tp_ports_free(c, out, overrides, resolved, where, hname)
    return tuple(out)


def _group(c: _Checker, node: PosDict, o: dict, key: int, host_gpus, swhere: str) -> None:
    """A services entry's TP group into o["_gpus"] (sorted, lowest first), checked: its GPUs are the host's, the
    entry's key is the lowest, `tp` equals their count; `tp` > 1 without `gpus` is refused (say which GPUs)."""
    g, tp = o.get("gpus"), o.get("tp")
    line = node.line_of("gpus") if "gpus" in node else node.line
    if g is None:
        if "gpus" not in node and tp not in (None, 1):
            c.err(node.line_of("tp"), f"{swhere}.tp", f"tp {tp} needs gpus: the {tp} GPU indices of the group "
                  f"(e.g. gpus: {list(range(key, key + tp))})")
        if "accept_no_p2p" in node and "gpus" not in node:
            c.err(node.line_of("accept_no_p2p"), f"{swhere}.accept_no_p2p", "only a TP service (gpus: [...]) "
                  "has peer-to-peer to accept the lack of")
        return
    ok = True
    items = node.get("gpus")  # the file's list (o's is a plain copy): each item's own line
    for i, x in enumerate(g):
        if x not in host_gpus:
            c.err(items.line_of(i) if isinstance(items, PosList) else line, f"{swhere}.gpus",
                  f"GPU {x} is not one of this host's GPUs {list(host_gpus)}")
            ok = False
    if min(g) != key:
        c.err(line, f"{swhere}.gpus", f"a TP service is keyed by its lowest GPU: write it under services.{min(g)} "
              f"(its gpus are {sorted(g)}), not {key}")
        ok = False
    if tp is not None and tp != len(g):
        c.err(node.line_of("tp"), f"{swhere}.tp", f"tp {tp} must equal the number of its gpus ({len(g)}: {list(g)})")
        ok = False
    if ok:
        o["_gpus"] = tuple(sorted(g))
        o["_gpus_at"] = f"{c.path}:{line}: {swhere}.gpus"


def _groups_disjoint(c: _Checker, overrides: dict, where: str) -> set[int]:
    """The GPUs TP groups hold besides their key; a GPU in two services (two groups, or a group and another
    GPU's own entry) is refused at the later entry's line."""
    owner: dict[int, int] = {}
    for key in sorted(overrides, key=lambda k: overrides[k].get("_line", 0)):
        o = overrides[key]
        for x in o.get("_gpus") or (key,):
            if x in owner and owner[x] != key:
                c.err(o.get("_line", 0), f"{where}.services.{key}",
                      f"GPU {x} is already in service {owner[x]}'s gpus: a GPU belongs to one service")
            owner.setdefault(x, key)
    return {x for x, k in owner.items() if x != k}


def _tp_port(c: _Checker, o: dict, resolved: dict, gpu: int, h: PosDict, where: str, hline: int):
    try:
        return contract.tp_ports(resolved["tp_port_base"], gpu)
    except ValueError as exc:
        c.err(o.get("_line", hline), f"{where}.services.{gpu}.gpus", f"{exc} (set vars.tp_port_base lower)")
        return None


def _tp_ports_free(c: _Checker, services: list, overrides: dict, resolved: dict, where: str, hname: str) -> None:
    """A TP group's rendezvous ports may not be another service's HTTP port, or the router's."""
    taken = {s.port: f"GPU {s.gpu}'s port" for s in services}
    r = resolved.get("router") or {}
    if r.get("enabled"):
        taken |= {r["port"]: "router.port", r["metrics_port"]: "router.metrics_port"}
    for s in services:
        for p in s.tp_port or ():
            if p in taken:
                c.err(overrides[s.gpu]["_line"], f"{where}.services.{s.gpu}",
                      f"its TP group's port {p} (tp_port_base {resolved['tp_port_base']} + 2 x GPU {s.gpu}) is "
                      f"also {taken[p]} on {hname}: move base_port, the router or vars.tp_port_base")


def _local_heads(c: _Checker, o: dict, v: dict, tp: int, where: str, gpu: int, hline: int) -> None:
    """tp against the model's attention heads where its config.json is readable on this machine (a model on
    the hosts only is checked by the plan, from the host)."""
    import json
    for key in ("model", "draft_model"):
        path = v.get(key)
        if not path or not os.path.isfile(f"{path}/config.json"):
            continue
        try:
            with open(f"{path}/config.json", encoding="utf-8") as fh:
                problem = tpmod.heads_problem(json.load(fh), tp)
        except (OSError, ValueError) as exc:
            problem = f"not checked: {path}/config.json: {exc}"
        if problem and not problem.startswith("not checked"):
            c.err(o.get("_line", hline), f"{where}.services.{gpu}.tp", f"{key} {path}: {problem}")


def _service_where(o: dict, origins: dict, gpu_at: str, gpu: int) -> dict[str, str]:
    """Where one service's gpu, port, model and draft_model were set: its own `services` entry, else the
    most specific scope's vars (a port from base_port names base_port, or the GPU's line when it is the
    default's)."""
    own = o.get("_where") or {}
    port = own.get("port") or (f"{origins['base_port']} + {gpu}" if "base_port" in origins else
                               f"{gpu_at} (port: the default base_port + {gpu})")
    out = {"gpu": gpu_at, "port": port}
    for k in ("model", "draft_model"):
        if k in own or k in origins:
            out[k] = own.get(k) or origins[k]
    return out
