"""The lab: a fleet of real Debian hosts on one machine, like kind is for Kubernetes.

Each host is `systemd-nspawn --boot` (real systemd as PID 1, real sshd with key auth) on an
overlayfs over one cached debootstrap base, in its own network namespace joined by a veth pair to a
private bridge. Its host key is generated at creation and written to the lab's known_hosts, so the
toolkit verifies host keys against the lab exactly as against a real fleet.

Needs root, debootstrap, systemd-container (systemd-nspawn) and iproute2.
State: $DDTREE_LAB_DIR (default /var/lib/ddtree-lab); base cache: $DDTREE_LAB_CACHE
(default /var/cache/ddtree-lab). `down()` also sweeps what a crashed run left behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from . import gpuhost, persona
from .wheels import build_lab_wheels, dist_info_dirname, find_meta, load_closure, write_dist_info

# DDTREE_LAB_ID (0-9) runs several labs side by side on one machine (one per work tree): each id has its
# own subnet, bridge, namespaces, veths and state directory. Id 0 is the default and keeps the names that
# inventory/lab.yaml and CI's leftover check use.
LAB_ID = int(os.environ.get("DDTREE_LAB_ID", "0") or 0)
if not 0 <= LAB_ID <= 9:
    raise ValueError(f"DDTREE_LAB_ID must be 0-9, got {LAB_ID}")
_SUFFIX = "" if LAB_ID == 0 else str(LAB_ID)
LAB_DIR = Path(os.environ.get("DDTREE_LAB_DIR", f"/var/lib/ddtree-lab{_SUFFIX}"))
CACHE_DIR = Path(os.environ.get("DDTREE_LAB_CACHE", "/var/cache/ddtree-lab"))
SUBNET = f"10.231.{77 + LAB_ID}"
GATEWAY = f"{SUBNET}.1"
BRIDGE = f"ddtlab{LAB_ID}"
NETNS_PREFIX = f"ddtl{_SUFFIX}-"
VETH_PREFIX = f"v{_SUFFIX or 'l'}-"
VENV = "/opt/sglang/venv"
SUDO_USER = "deploy"  # every lab host also has this non-root user with passwordless sudo
SUITE = "bookworm"
BASE_PACKAGES = ["systemd", "systemd-sysv", "dbus", "openssh-server", "python3-venv", "iproute2", "procps",
                 "rsync", "sudo"]
BASE_ID = hashlib.sha256(" ".join([SUITE, "minbase"] + BASE_PACKAGES + ["v2"]).encode()).hexdigest()[:12]
STANDIN = Path(__file__).with_name("nvidia_smi_standin.py")


class LabError(RuntimeError):
    pass


@dataclass(frozen=True)
class LabHost:
    name: str
    octet: int
    persona: str
    torch_tag: str
    root: str = "base"  # "base": the lab's Debian base; "machine": this machine's own root, with its GPUs (gpuhost)

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.octet}"

    @property
    def netns(self) -> str:
        return NETNS_PREFIX + self.name

    @property
    def veth(self) -> str:
        return VETH_PREFIX + self.name

    @property
    def gpus(self) -> int:
        if self.root == "machine":
            return gpuhost.gpu_count()
        return 1 if self.persona == "h200-1gpu" else 8


BUILTIN = (LabHost("ct129", 129, "rtxpro6000-8gpu", "cu130"),
           LabHost("ct200", 200, "rtxpro6000-8gpu", "cu128"),
           LabHost("h200", 90, "h200-1gpu", "cu130"))
MAX_EXTRA = 40
# The tensor-parallel host (`fab lab.up --tp`): eight H200 on NVSwitch (persona h200-8gpu), with TP services in
# inventory/lab-tp.yaml.
TP_HOSTS = (LabHost("ct208", 208, "h200-8gpu", "cu130"),)
# The GPU lab (`fab lab.up --gpu`, on a machine with an NVIDIA GPU): a reference host and a drifted one, both over
# this machine's own root with its GPUs bound in (deploy/lab/gpuhost.py says how and why). Their own inventory:
# inventory/gpulab.yaml.
GPU_HOSTS = (LabHost("gpu-ref", 10, "machine", "machine", "machine"),
             LabHost("gpu-drift", 11, "machine", "machine", "machine"))
# The machine's root as this process sees it ("/", or where a control chroot has it bound) and the folder a host
# gets read-only as /models (the served models; none by default).
MACHINE_ROOT = Path(os.environ.get("DDTREE_GPULAB_MACHINE", "/"))
GPU_MODELS = os.environ.get("DDTREE_GPULAB_MODELS", "")


def lab_hosts(extra: int = 0) -> list[LabHost]:
    """The seed-named hosts plus `extra` more of the ct200 kind (ct201, ct202, ...) for scale tests."""
    if not 0 <= extra <= MAX_EXTRA:
        raise LabError(f"extra hosts must be in [0, {MAX_EXTRA}]")
    return list(BUILTIN) + [LabHost(f"ct{201 + i}", 201 + i, "rtxpro6000-8gpu", "cu128") for i in range(extra)]


def _run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    if check and p.returncode != 0:
        raise LabError(f"{' '.join(argv[:6])}{' ...' if len(argv) > 6 else ''} failed ({p.returncode}): {p.stderr.strip()[-800:]}")
    return p


def preflight() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab needs root (systemd-nspawn, network namespaces, overlayfs)")
    needs = ("systemd-nspawn", "ip", "ssh-keygen")
    if not (base_path() / ".ddtree-lab-base").exists():
        needs = ("debootstrap",) + needs  # only to build the base once
    missing = [b for b in needs if not shutil.which(b)]
    if missing:
        raise LabError(f"missing tools: {', '.join(missing)} (apt-get install debootstrap systemd-container "
                       f"iproute2 openssh-client)")


# ------------------------------------------------------------------ base image

def _apt_mirror() -> str | None:
    """The Debian mirror this machine's apt already uses (so the lab needs no other network)."""
    for f in [Path("/etc/apt/sources.list")] + sorted(Path("/etc/apt/sources.list.d").glob("*")):
        try:
            text = f.read_text()
        except OSError:
            continue
        for m in re.finditer(r"^URIs:\s*(\S+)", text, re.M):
            if "security" not in m.group(1):
                return m.group(1)
        for m in re.finditer(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", text, re.M):
            if "security" not in m.group(1):
                return m.group(1)
    return None


def base_path() -> Path:
    return CACHE_DIR / f"base-{SUITE}-{BASE_ID}"


def ensure_base(log=print) -> tuple[Path, float | None]:
    """Build the Debian base root once (debootstrap minbase + systemd, sshd, python3-venv); cached.

    Returns the path and the build time in seconds (None when it was cached). Built in a temporary
    folder and renamed into place, so an interrupted build never leaves a half base behind.
    """
    base = base_path()
    if (base / ".ddtree-lab-base").exists():
        return base, None
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = CACHE_DIR / f".building-{BASE_ID}"
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"building Debian {SUITE} base (debootstrap, about a minute) ...")
    t0 = time.time()
    argv = ["debootstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES), SUITE, str(tmp)]
    mirror = _apt_mirror()
    if mirror:
        argv.append(mirror)
    p = _run(argv, check=False)
    if p.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise LabError(f"debootstrap failed: {(p.stdout + p.stderr).strip()[-1500:]}")
    # Per-host identity is made per host: no shared host keys or machine-id in the base.
    for k in (tmp / "etc/ssh").glob("ssh_host_*"):
        k.unlink()
    (tmp / "etc/machine-id").write_text("")
    (tmp / "etc/ssh/sshd_config.d/ddtree-lab.conf").write_text(
        "HostKey /etc/ssh/ssh_host_ed25519_key\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nUseDNS no\n")
    # A lab host has no consoles to serve; keep boots fast and quiet.
    for unit in ("getty@tty1.service", "console-getty.service"):
        (tmp / "etc/systemd/system" / unit).unlink(missing_ok=True)
        (tmp / "etc/systemd/system" / unit).symlink_to("/dev/null")
    (tmp / ".ddtree-lab-base").write_text(json.dumps({"suite": SUITE, "packages": BASE_PACKAGES, "id": BASE_ID}))
    tmp.rename(base)
    seconds = time.time() - t0
    log(f"base built in {seconds:.1f}s at {base}")
    return base, seconds


# ------------------------------------------------------------------ per-host pieces

def host_dir(h: LabHost) -> Path:
    return LAB_DIR / "hosts" / h.name


def control_key() -> Path:
    key = LAB_DIR / "id_ed25519"
    if not key.exists():
        LAB_DIR.mkdir(parents=True, exist_ok=True)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ddtree-lab-control", "-f", str(key)])
    return key


def known_hosts() -> Path:
    return LAB_DIR / "known_hosts"


def _mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mounts") as fh:
        return any(line.split()[1] == target for line in fh)


def _pid(h: LabHost) -> int | None:
    try:
        pid = int((host_dir(h) / "pid").read_text())
        os.kill(pid, 0)
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        return pid if b"systemd-nspawn" in cmd else None
    except (OSError, ValueError):
        return None


def _ensure_bridge() -> None:
    if _run(["ip", "link", "show", BRIDGE], check=False).returncode != 0:
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{GATEWAY}/24", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])


def _ensure_netns(h: LabHost) -> None:
    if not Path(f"/run/netns/{h.netns}").exists():
        _run(["ip", "netns", "add", h.netns])
    if _run(["ip", "link", "show", h.veth], check=False).returncode != 0:
        _run(["ip", "link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.netns])
    _run(["ip", "link", "set", h.veth, "master", BRIDGE, "up"])
    ns = ["ip", "-n", h.netns]
    if h.address not in _run(ns + ["addr", "show", "eth0"]).stdout:
        _run(ns + ["addr", "add", f"{h.address}/24", "dev", "eth0"])
    _run(ns + ["link", "set", "eth0", "up"])
    _run(ns + ["link", "set", "lo", "up"])
    _run(ns + ["route", "replace", "default", "via", GATEWAY])


def _mount(h: LabHost, base: Path) -> Path:
    d = host_dir(h)
    root = d / "root"
    lower = str(base)
    if h.root == "machine":  # the layer over the machine's root; both below a tmpfs (gpuhost's docstring)
        lower = f"{_gpu_layer(base)}:{MACHINE_ROOT}"
    for sub in ("upper", "work", "root"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    if not _mounted(root):
        _run(["mount", "-t", "overlay", "overlay", "-o",
              f"lowerdir={lower},upperdir={d / 'upper'},workdir={d / 'work'}", str(root)])
    return root


def _gpu_layer(base: Path) -> Path:
    """The systemd/sshd layer of the GPU lab's hosts, built once per lab on the lab's tmpfs."""
    hosts = LAB_DIR / "hosts"
    hosts.mkdir(parents=True, exist_ok=True)
    if not _mounted(hosts):  # an overlay's layers cannot live inside its lowest layer's filesystem
        _run(["mount", "-t", "tmpfs", "-o", "mode=0700", "ddtree-gpulab", str(hosts)])
    layer = hosts / ".layer"
    if not (layer / ".done").exists():
        shutil.rmtree(layer, ignore_errors=True)
        gpuhost.build_layer(base, MACHINE_ROOT, layer)
        (layer / ".done").write_text("")
    return layer


# Model folders on lab hosts hold only config.json (no weights: the lab's SGLang stand-in serves no model).
# The deploy's hybrid-model gate reads them, as it reads the real ones on a GPU host.
LAB_MODELS = {
    "Qwen3-8B": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                 "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "vocab_size": 151936, "torch_dtype": "bfloat16"},
    "Qwen3-8B-DFlash-b16": {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
                            "num_hidden_layers": 5, "hidden_size": 4096, "vocab_size": 151936},
    "Qwen3-Next-80B-A3B": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                           "num_hidden_layers": 48, "full_attention_interval": 4, "vocab_size": 151936,
                           "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12},
}


def _lab_models(root: Path) -> None:
    for name, config in LAB_MODELS.items():
        d = root / "models" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (root / "models" / "README").write_text("Lab model folders: config.json only, no weights (ddtree-deploy lab).\n")


def _identity(h: LabHost, root: Path) -> None:
    """Host name, addresses, host key and the control key's authorized_keys, written into the overlay."""
    (root / "etc/hostname").write_text(h.name + "\n")
    (root / "etc/hosts").write_text(f"127.0.0.1 localhost\n{h.address} {h.name}\n")
    hk = root / "etc/ssh/ssh_host_ed25519_key"
    if not hk.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{h.name}", "-f", str(hk)])
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(str(control_key()) + ".pub").read_text())
    os.chmod(ssh_dir / "authorized_keys", 0o600)


# The GPU lab's routers listen on their host's address (inventory/gpulab.yaml: listen_address, api_key_file), so
# the control side can put load through them; an address reachable from outside needs the router's API key.
GPU_API_KEY_FILE = "/etc/ddtree/api-key.yaml"  # on each GPU host, root-only: what inventory/gpulab.yaml names


def gpu_api_key() -> str:
    """The GPU lab's router API key, made once and kept root-only on the control side (LAB_DIR/api-key): the
    load generator and the hosts' key files read the same one."""
    path = LAB_DIR / "api-key"
    if not path.exists():
        import secrets
        LAB_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip()


def _api_key_file(root: Path) -> None:
    """The router's API key file on a GPU host, root-only: YAML `api-key: "KEY"` (quoted: a key may start with a
    digit or a dash)."""
    target = root / GPU_API_KEY_FILE.lstrip("/")
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f'api-key: "{gpu_api_key()}"\n')
    os.chmod(target, 0o600)


def _machine_id(h: LabHost) -> str:
    return hashlib.sha256(f"ddtree-lab {LAB_ID} {h.name}".encode()).hexdigest()[:32]


def _sudo_user_script() -> str:
    """A non-root operator with passwordless sudo, as on fleets where root cannot log in."""
    return (f"useradd -m -s /bin/bash {SUDO_USER}; install -d -m 700 -o {SUDO_USER} -g {SUDO_USER} "
            f"/home/{SUDO_USER}/.ssh; install -m 600 -o {SUDO_USER} -g {SUDO_USER} /root/.ssh/authorized_keys "
            f"/home/{SUDO_USER}/.ssh/authorized_keys; echo '{SUDO_USER} ALL=(ALL) NOPASSWD: ALL' "
            f"> /etc/sudoers.d/{SUDO_USER}; chmod 440 /etc/sudoers.d/{SUDO_USER}")


def _prepare_machine(h: LabHost, root: Path) -> None:
    """First boot only of a GPU host: identity, users, the driver's libraries known to ld.so (gpuhost)."""
    _identity(h, root)
    _api_key_file(root)
    (root / "etc/machine-id").write_text(_machine_id(h) + "\n")
    script = "set -e; " + "; ".join(gpuhost.prepare_root(root) + [_sudo_user_script()])
    _run(["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--private-network",
          f"--uuid={_machine_id(h)}", *gpuhost.bind_args(), "-D", str(root), "/bin/sh", "-c", script])
    (host_dir(h) / "host.json").write_text(json.dumps(asdict(h)))


def _prepare(h: LabHost, root: Path, wheels: dict[str, Path]) -> None:
    """First boot only: identity, keys, GPU persona and the managed venv, written into the overlay."""
    d = host_dir(h)
    _identity(h, root)
    pdir = root / "usr/local/share/lab-gpu-persona"
    pdir.mkdir(parents=True, exist_ok=True)
    for name, text in persona.persona_files(h.persona, h.name).items():
        (pdir / name).write_text(text)
    smi = root / "usr/bin/nvidia-smi"
    shutil.copyfile(STANDIN, smi)
    os.chmod(smi, 0o755)
    # The managed venv with a torch build matching the persona (ct200: the seed's +cu128 drift), and
    # sglang-kernel 0.4.5 (what SGLang 0.5.17 pins), installed by pip from lab wheels.
    stage = root / "var/tmp/lab-wheels"
    stage.mkdir(parents=True, exist_ok=True)
    picked = [wheels[f"torch-{h.torch_tag}"], wheels["triton"], wheels["sglang-kernel-0.4.5"]]
    for w in picked:
        shutil.copyfile(w, stage / w.name)
    script = (f"set -e; python3 -m venv {VENV}; {VENV}/bin/pip install -q --no-index --no-deps "
              + " ".join(f"/var/tmp/lab-wheels/{w.name}" for w in picked) + "; rm -rf /var/tmp/lab-wheels; "
              + _sudo_user_script())
    _run(["systemd-nspawn", "--quiet", "--register=no", "--keep-unit", "--private-network",
          "-D", str(root), "/bin/sh", "-c", script])
    # Everything else of the real SGLang 0.5.17 closure, metadata-only (real pins, no code), but what the
    # venv already has (its own pip and setuptools stay). Copied by cp: no Python work per host.
    site = _site_packages(root)
    present = {canonicalize_name(d.name.split("-")[0]) for d in site.glob("*.dist-info")}
    todo = [str(d) for d in sorted(wheels["closure"].glob("*.dist-info"))
            if canonicalize_name(d.name.split("-")[0]) not in present]
    _run(["cp", "-a", *todo, str(site)])
    _lab_models(root)
    (d / "host.json").write_text(json.dumps(asdict(h)))


def _site_packages(root: Path) -> Path:
    found = sorted(root.glob(VENV.lstrip("/") + "/lib/python3*/site-packages"))
    if len(found) != 1:
        raise LabError(f"{root}: expected one site-packages in {VENV}, found {len(found)}")
    return found[0]


# ------------------------------------------------------------------ drift knobs

# The drift knobs (fab lab.drift HOST KIND) are data in drifts.py, which `fab` reads without importing this module.
from .drifts import DRIFTS  # noqa: E402


def _ssh_argv(h: LabHost, command: str) -> list[str]:
    return ["ssh", "-i", str(control_key()), "-o", f"UserKnownHostsFile={known_hosts()}",
            "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
            f"root@{h.address}", command]


def _host(name: str) -> LabHost:
    p = LAB_DIR / "hosts" / name / "host.json"
    if not p.exists():
        raise LabError(f"no lab host {name!r} (fab lab.up)")
    h = LabHost(**json.loads(p.read_text()))
    if _pid(h) is None:
        raise LabError(f"lab host {name} is not running (fab lab.up)")
    return h


def _swap_sglang(site: Path, version: str) -> None:
    """Replace the metadata-only sglang distribution by another captured version's (atomically per dir)."""
    meta = find_meta(load_closure(), "sglang", version)
    new = site / dist_info_dirname("sglang", version)
    tmp = site / f".lab-drift-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    write_dist_info(tmp, meta)
    for old in site.glob("sglang-*.dist-info"):
        shutil.rmtree(old)
    (tmp / new.name).rename(new)
    tmp.rmdir()


def set_drift(name: str, kind: str, log=print) -> str:
    """Apply a drift knob (DRIFTS) to a running lab host's managed venv; returns the previous kind.

    Every knob starts from the host as lab.up built it, whatever changed it since (`fab provision`, which copies
    the reference's torch build onto ct200, a test, an operator): the lab-built distributions (torch of the host's
    persona, triton, sglang-kernel) go back to their as-built versions through the venv's own pip (uninstall by
    RECORD, install the lab wheel), except what the knob drifts; sglang's metadata-only distribution is swapped in
    place."""
    if kind not in DRIFTS:
        raise LabError(f"unknown drift {kind!r}; one of: {', '.join(DRIFTS)}")
    h = _host(name)
    state = host_dir(h) / "drift"
    before = state.read_text().strip() if state.exists() else "coherent"
    wheels = build_lab_wheels(CACHE_DIR / f"wheels{_SUFFIX}")
    root = host_dir(h) / "root"
    site = _site_packages(root)
    kernel = "0.4.10" if kind == "sglang-kernel-0.4.10" else "0.4.5"
    want = [wheels[f"torch-{h.torch_tag}"], wheels["triton"], wheels[f"sglang-kernel-{kernel}"]]
    todo = []
    for whl in want:
        dist, version, _build, _tags = parse_wheel_filename(whl.name)
        have = sorted(d.name for d in site.glob(f"{dist.replace('-', '_')}-*.dist-info"))
        if have != [dist_info_dirname(dist, str(version))]:
            todo.append(whl)
    if todo:
        stage = root / "var/tmp/lab-drift"
        stage.mkdir(parents=True, exist_ok=True)
        for whl in todo:
            shutil.copyfile(whl, stage / whl.name)
        p = _run(_ssh_argv(h, f"{VENV}/bin/pip install -q --no-index --no-deps --force-reinstall "
                              "--disable-pip-version-check " + " ".join(f"/var/tmp/lab-drift/{w.name}" for w in todo)
                              + "; rc=$?; rm -rf /var/tmp/lab-drift; exit $rc"), check=False, timeout=120)
        if p.returncode != 0:
            raise LabError(f"{name}: installing {', '.join(w.name for w in todo)} failed: "
                           f"{p.stderr.strip()[-800:]}")
    sglang = kind.split("-", 1)[1] if kind.startswith("sglang-0.") else "0.5.17"
    if not (site / dist_info_dirname("sglang", sglang)).is_dir() or \
            len(list(site.glob("sglang-*.dist-info"))) != 1:
        _swap_sglang(site, sglang)
    state.write_text(kind + "\n")
    log(f"{name}: drift {before} -> {kind}" + (f" (reinstalled {', '.join(w.name for w in todo)})" if todo else ""))
    return before


def _boot(h: LabHost, root: Path) -> int:
    d = host_dir(h)
    log = open(d / "console.log", "ab")
    extra = []
    if h.root == "machine":
        extra = gpuhost.nspawn_args(_machine_id(h)) + ([f"--bind-ro={GPU_MODELS}:/models"] if GPU_MODELS else [])
    p = subprocess.Popen(["systemd-nspawn", "--boot", "--register=no", "--keep-unit", f"--machine={h.name}",
                          f"--network-namespace-path=/run/netns/{h.netns}", "--console=passive", *extra,
                          "-D", str(root)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    (d / "pid").write_text(str(p.pid))
    return p.pid


def _wait_ssh(h: LabHost, timeout: float = 60) -> None:
    """Wait until sshd answers with its banner (systemd has reached it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if _pid(h) is None:
            tail = (host_dir(h) / "console.log").read_text(errors="replace")[-800:]
            raise LabError(f"{h.name}: systemd-nspawn exited during boot:\n{tail}")
        try:
            with socket.create_connection((h.address, 22), timeout=2) as s:
                s.settimeout(3)
                if s.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.3)
    raise LabError(f"{h.name}: sshd did not answer on {h.address}:22 within {timeout:.0f}s")


def _wait_booted(h: LabHost, timeout: float = 180) -> None:
    """Wait until the host's systemd has finished booting (``systemctl is-system-running --wait``), then hand it
    over only once it is running.

    sshd answers early in the boot, but until systemd-user-sessions has run, PAM's nologin refuses every login but
    root's ("System is booting up"), so a host handed over at its banner can turn the sudo user away. A boot that
    finishes degraded (a unit that could not start, e.g. when its cgroup could not be made) gets each failed unit
    started once more, as an operator would, and one whose logins are still closed gets systemd-user-sessions
    started again; a host still refusing logins after that fails `lab.up` with its failed units and
    systemd-user-sessions' status. What was started again, and what failed again, goes to stderr."""
    script = f"timeout {int(timeout)} systemctl is-system-running --wait"
    p = _run(_ssh_argv(h, script), check=False, timeout=timeout + 15)
    state = p.stdout.strip()
    if state not in ("running", "degraded"):
        jobs = _run(_ssh_argv(h, "systemctl list-jobs --no-pager | head -20; ls -l /run/nologin 2>&1"),
                    check=False, timeout=30)
        raise LabError(f"{h.name}: systemd did not finish booting within {timeout:.0f}s (state {state or '?'}: "
                       f"{p.stderr.strip()[-300:]}):\n{jobs.stdout}")
    # Each failed unit started once more; then, if logins are still closed, systemd-user-sessions (whose start
    # is what opens them) once more too.
    retry = ("for u in $(systemctl list-units --failed --plain --no-legend | awk '{print $1}'); do "
             "echo \"started again: $u\"; systemctl reset-failed \"$u\"; systemctl start \"$u\" || "
             "echo \"failed again: $u\"; done; if [ -e /run/nologin ]; then "
             "echo 'logins still closed: systemd-user-sessions started again'; "
             "systemctl restart systemd-user-sessions; fi")
    p = _run(_ssh_argv(h, retry), check=False, timeout=120)
    if p.stdout.strip():
        print(f"lab: {h.name}: boot finished {state}: " + "; ".join(p.stdout.strip().splitlines()), file=sys.stderr)
    closed = _run(_ssh_argv(h, "test ! -e /run/nologin || cat /run/nologin"), check=False, timeout=30).stdout.strip()
    if closed:
        status = _run(_ssh_argv(h, "systemctl --failed --plain --no-legend; "
                                   "systemctl status --no-pager -n 5 systemd-user-sessions 2>&1 | head -20"),
                      check=False, timeout=30)
        raise LabError(f"{h.name}: boot finished {state}, and its logins are still closed after systemd-user-sessions "
                       f"ran again (/run/nologin: {closed!r}):\n{p.stdout.strip()}\n{status.stdout}")


def _write_known_hosts() -> None:
    lines = []
    for d in sorted((LAB_DIR / "hosts").glob("*/host.json")):
        h = LabHost(**json.loads(d.read_text()))
        pub = d.parent / "upper/etc/ssh/ssh_host_ed25519_key.pub"
        if pub.exists():
            kt, key = pub.read_text().split()[:2]
            lines.append(f"{h.address} {kt} {key}")
    tmp = known_hosts().with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(known_hosts())


def up(extra: int = 0, log=print, gpu: bool = False, tp: bool = False) -> dict:
    """Bring up every lab host that is not running (idempotent). Returns timings for the report.

    gpu: the GPU lab's hosts (GPU_HOSTS) instead of the CPU lab's, on a machine with an NVIDIA GPU. tp: the CPU
    lab's hosts and its tensor-parallel host (TP_HOSTS)."""
    preflight()
    if gpu and not gpuhost.device_nodes():
        raise LabError("the GPU lab needs an NVIDIA GPU on this machine (no /dev/nvidia* device)")
    t0 = time.time()
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    base, base_seconds = ensure_base(log)
    wheels = None if gpu else build_lab_wheels(CACHE_DIR / f"wheels{_SUFFIX}")
    control_key()
    _ensure_bridge()
    hosts = list(GPU_HOSTS) if gpu else lab_hosts(extra) + (list(TP_HOSTS) if tp else [])
    todo = [h for h in hosts if _pid(h) is None]
    if gpu:
        _gpu_layer(base)  # once, before the hosts that share it

    def bring(h: LabHost) -> str:
        _ensure_netns(h)
        root = _mount(h, base)
        fresh = not (host_dir(h) / "host.json").exists()
        if fresh:
            _prepare_machine(h, root) if h.root == "machine" else _prepare(h, root, wheels)
        _boot(h, root)
        return "created" if fresh else "booted"

    t1 = time.time()
    with ThreadPoolExecutor(max_workers=4) as pool:
        actions = dict(zip([h.name for h in todo], pool.map(bring, todo)))
    _write_known_hosts()
    for h in todo:
        _wait_ssh(h)
    for h in todo:
        _wait_booted(h)
    report = {"hosts": {h.name: actions.get(h.name, "running") for h in hosts},
              "base_build_seconds": base_seconds, "boot_seconds": round(time.time() - t1, 2),
              "total_seconds": round(time.time() - t0, 2), "known_hosts": str(known_hosts()),
              "identity_file": str(control_key())}
    return report


def _stop_pid(pid: int, timeout: float = 15) -> None:
    try:
        os.kill(pid, signal.SIGTERM)  # nspawn forwards it as an orderly poweroff of the container
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def down(log=print) -> dict:
    """Remove every container, mount, namespace, veth and the bridge the lab made; the base cache stays.

    Works from the system's state, not only from our records, so it also cleans up after a crash.
    """
    removed = {"containers": 0, "mounts": 0, "netns": 0, "links": 0}
    lab = str(LAB_DIR)
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"systemd-nspawn") and any(a.startswith((lab + "/").encode()) for a in cmd):
            pids.add(int(proc.name))
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(_stop_pid, pids))
    removed["containers"] = len(pids)
    with open("/proc/self/mounts") as fh:
        mounts = [line.split()[1] for line in fh if line.split()[1].startswith(lab + "/")]
    for m in sorted(mounts, key=len, reverse=True):
        if _run(["umount", m], check=False).returncode != 0:
            _run(["umount", "-l", m], check=False)
        removed["mounts"] += 1
    for ns in _run(["ip", "netns", "list"], check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(NETNS_PREFIX):
            _run(["ip", "netns", "delete", name], check=False)
            removed["netns"] += 1
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        m = re.match(r"^\d+:\s+([^:@]+)", line)
        if m and (m.group(1).startswith(VETH_PREFIX) or m.group(1) == BRIDGE):
            _run(["ip", "link", "delete", m.group(1)], check=False)
            removed["links"] += 1
    for p in Path("/run/systemd/nspawn/propagate").glob("*") if Path("/run/systemd/nspawn/propagate").exists() else []:
        shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(LAB_DIR, ignore_errors=True)
    return removed


def status() -> list[dict]:
    """One row per lab host: running?, address, persona, torch tag, sshd answering."""
    rows = []
    for d in sorted((LAB_DIR / "hosts").glob("*/host.json")):
        h = LabHost(**json.loads(d.read_text()))
        pid = _pid(h)
        ssh_ok = False
        if pid:
            try:
                with socket.create_connection((h.address, 22), timeout=1) as s:
                    s.settimeout(2)
                    ssh_ok = s.recv(8).startswith(b"SSH-")
            except OSError:
                pass
        drift = host_dir(h) / "drift"
        rows.append({"host": h.name, "address": h.address, "state": "running" if pid else "stopped", "pid": pid,
                     "sshd": ssh_ok, "persona": h.persona, "gpus": h.gpus, "torch": f"2.11.0+{h.torch_tag}",
                     "drift": drift.read_text().strip() if drift.exists() else "coherent"})
    return rows


# What `journal` shows: every warning or worse, and sshd's own lines (a dropped connection "past MaxStartups", a
# cut or timed-out handshake are logged at info), less a login's routine lines, logged for every login.
ROUTINE = re.compile(r"pam_env\(|pam_unix\((sshd|sudo):session\)|pam_limits\(|: Accepted publickey for |"
                     r": Received disconnect from |: Disconnected from |\(command continued\)|COMMAND=")


def journal(names: list[str] | None = None, lines: int = 25) -> dict[str, list[str]]:
    """Per running lab host, the last `lines` of its journal's warnings and sshd lines, routine logins left out.

    Read from outside, in the host's own namespaces (nsenter into its init), so an sshd that cannot answer
    does not hide why. For CI's record when a run failed (.ci/run prints it before tearing the lab down)."""
    out: dict[str, list[str]] = {}
    for d in sorted((LAB_DIR / "hosts").glob("*/host.json")):
        h = LabHost(**json.loads(d.read_text()))
        if names and h.name not in names:
            continue
        pid = _pid(h)
        init = _run(["pgrep", "-o", "-P", str(pid)], check=False).stdout.strip() if pid else ""
        if not init.isdigit():
            out[h.name] = ["(not running)"]
            continue
        kept: set[str] = set()
        for match in (["-p", "warning"], ["-t", "sshd"]):
            p = _run(["nsenter", "-t", init, "-m", "-u", "-i", "-n", "-p", "journalctl", "--no-pager", "-q", "-b",
                      "-o", "short-iso-precise", *match], check=False, timeout=30)
            if p.returncode != 0:
                kept.add(f"(journalctl {' '.join(match)}: {p.stderr.strip()[-300:]})")
            kept.update(ln[:300] for ln in p.stdout.splitlines() if not ROUTINE.search(ln))
        out[h.name] = sorted(kept)[-lines:]  # ISO timestamps sort in time order
    return out


def inventory_yaml(hosts: list[LabHost], reference: str = "ct129") -> str:
    """An inventory file for these lab hosts (inventory/lab.yaml is this for the builtin three)."""
    lines = ["# Generated by deploy.lab.fleet.inventory_yaml", "fleet: lab", f"reference: {reference}",
             "ssh:", "  user: root", f"  known_hosts: {known_hosts()}", f"  identity_file: {LAB_DIR / 'id_ed25519'}",
             "vars:", f"  venv: {VENV}", "hosts:"]
    for h in hosts:
        lines += [f"  {h.name}:", f"    address: {h.address}", f"    gpus: {h.gpus}"]
    return "\n".join(lines) + "\n"


def lab_inventory_path() -> Path:
    """The inventory of this lab: inventory/lab.yaml for lab id 0; for another id, a copy of it with this
    lab's addresses and key paths, written next to the lab's state (so tests and fab use the same file)."""
    src = Path(__file__).resolve().parents[2] / "inventory" / "lab.yaml"
    if LAB_ID == 0:
        return src
    text = src.read_text().replace("/var/lib/ddtree-lab/", f"{LAB_DIR}/").replace("10.231.77.", f"{SUBNET}.")
    LAB_DIR.mkdir(parents=True, exist_ok=True)
    dst = LAB_DIR / "lab.yaml"
    if not dst.exists() or dst.read_text() != text:
        tmp = dst.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(dst)
    return dst
