"""GPU lab hosts: lab hosts whose root is this machine's own OS, so that its GPU stack runs in them.

A CPU lab host boots the lab's Debian base. A host that must serve on a real GPU needs what the GPU machine
has installed and proven: its driver's user libraries, its CUDA, its Python and the torch built for it. On
a GPU VM those are the machine's own root (the lent H200: Ubuntu 24.04, Python 3.12, torch in
/opt/torch/.venv, glibc 2.39), which the Debian base can neither run nor hold. So a GPU lab host's root is an
overlayfs whose lowest layer is the machine's root, read-only, and whose writes go to the host's own upper
layer (a tmpfs: the machine's root cannot hold an overlay's upper layer inside itself).

Such a machine may have no systemd or sshd at all (the H200 VM's PID 1 is not systemd). A layer between the
two adds the lab base's systemd, dbus, OpenSSH, sudo and iproute2 (Debian bookworm: built for glibc 2.36, so
they run on any newer glibc), file by file, only where the machine has no file at that path: the layer adds,
it never replaces what the machine has. The shared libraries those programs need and the machine lacks come
from the base too (the DT_NEEDED closure, resolved as the dynamic linker would). A machine that has its
own systemd keeps it.

The GPU is bound in as it is: every /dev/nvidia* node, /dev/nvidia-caps, and the driver's library folder
(read-only), with ld.so told where the driver's libraries are, and nvidia-smi on PATH. systemd-nspawn runs
with `--system-call-filter=bpf`, so that the host's systemd can attach the device-cgroup programs that enforce
a unit's DevicePolicy/DeviceAllow (without it nspawn's own filter refuses bpf() and no device rule applies).
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from ..remote.host.elfsyms import ElfError, read_elf

# What a host needs to be a host of this toolkit (systemd as PID 1, sshd with key auth, sudo for the operator
# user, iproute2's ss for the port checks). Their files come from the lab base's dpkg records.
LAYER_PACKAGES = ("systemd", "systemd-sysv", "libpam-systemd", "libnss-systemd", "dbus", "dbus-bin",
                  "dbus-daemon", "dbus-system-bus-common", "dbus-session-bus-common", "libdbus-1-3",
                  "openssh-server", "openssh-client", "openssh-sftp-server", "sudo", "iproute2", "procps")
# Written by those packages' maintainer scripts (not in their dpkg records): sshd's configuration (ucf) and the
# unit enablement links (deb-systemd-helper) the base has for them.
MAINTAINER_FILES = ("etc/ssh/sshd_config",)
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu", "usr/lib64", "lib64", "usr/lib", "lib")
# merged /usr: a package's /lib/... is /usr/lib/... on both sides
_MERGED = {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "usr/lib64"}
DRIVER_DIR = Path(os.environ.get("DDTREE_GPULAB_DRIVER_DIR", "/usr/local/nvidia"))
LDCONF = "etc/ld.so.conf.d/ddtree-lab-nvidia.conf"
# The machine's venv that the GPU lab manages (inventory/gpulab.yaml's venv): root runs its python only when no
# file in it is writable by group or others (the toolkit's venv trust rule), so the lab takes those bits off.
MACHINE_VENV = os.environ.get("DDTREE_GPULAB_VENV", "/opt/torch/.venv")


def normal(path: str) -> str:
    """A package path without its leading '/', with merged-/usr top directories resolved."""
    rel = path.strip().lstrip("/")
    top, _, rest = rel.partition("/")
    if top in _MERGED:
        return _MERGED[top] + ("/" + rest if rest else "")
    return rel


def has_systemd(machine: Path) -> bool:
    return any((machine / p).exists() for p in ("usr/lib/systemd/systemd", "lib/systemd/systemd"))


def package_files(base: Path, packages=LAYER_PACKAGES) -> list[str]:
    """Every regular file and symlink the base's dpkg records for these packages (normalised paths)."""
    out: set[str] = set()
    info = base / "var/lib/dpkg/info"
    for pkg in packages:
        lst = info / f"{pkg}.list"
        if not lst.exists():
            lst = info / f"{pkg}:amd64.list"
        if not lst.exists():
            continue
        for line in lst.read_text().splitlines():
            rel = normal(line)
            if not rel or rel == ".":
                continue
            src = base / rel
            if src.is_symlink() or src.is_file():
                out.add(rel)
    return sorted(out)


def enablement_links(base: Path, files: list[str]) -> list[str]:
    """The base's /etc/systemd/system links (enabled units, aliases, masks) that point at a unit in `files`, or
    mask with /dev/null."""
    have = set(files)
    out = []
    for p in sorted((base / "etc/systemd/system").rglob("*")):
        if not p.is_symlink():
            continue
        target = os.readlink(p)
        if target == "/dev/null" or normal(target) in have:
            out.append(str(p.relative_to(base)))
    return out


def _copy(base: Path, layer: Path, rel: str) -> None:
    src, dst = base / rel, layer / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        if not dst.is_symlink():
            os.symlink(os.readlink(src), dst)
    else:
        shutil.copy2(src, dst)


def _find_lib(root: Path, soname: str, extra: tuple[str, ...] = ()) -> str | None:
    """The root-relative path where the dynamic linker would find `soname` under `root`, or None."""
    for d in extra + LIB_DIRS:
        if os.path.lexists(root / d / soname):
            return f"{d}/{soname}"
    return None


def resolve_in(root: Path, rel: str) -> str:
    """Follow a root-relative path's symlinks inside `root` (an absolute target is read from `root`)."""
    for _ in range(16):
        p = root / rel
        if not p.is_symlink():
            return rel
        target = os.readlink(p)
        rel = normal(target) if target.startswith("/") else os.path.normpath(os.path.join(os.path.dirname(rel), target))
        rel = normal(rel)
    return rel


def _runpath_dirs(info: dict) -> tuple[str, ...]:
    return tuple(normal(d) for d in info["runpath"] + info["rpath"] if d.startswith("/"))


def missing_libraries(base: Path, machine: Path, files: list[str]) -> list[str]:
    """The base's libraries (root-relative paths: the soname link and the file it names) that the layer's ELF
    files need and the machine lacks: the DT_NEEDED closure, a library taken from the machine wherever it has
    one (the dynamic linker's search: the object's RUNPATH, then the usual directories)."""
    todo = [rel for rel in files if (base / rel).is_file() and not (base / rel).is_symlink()]
    seen: set[str] = set()
    out: list[str] = []
    while todo:
        rel = todo.pop()
        try:
            info = read_elf(str(base / rel), symbols=False)
        except (ElfError, OSError):
            continue
        extra = _runpath_dirs(info)
        for soname in info["needed"]:
            if soname in seen:
                continue
            seen.add(soname)
            if _find_lib(machine, soname, extra) is not None:
                continue
            found = _find_lib(base, soname, extra)
            if found is None:
                continue  # the dynamic linker says so at boot; nothing here can supply it
            real = resolve_in(base, found)
            for r in (found, real):
                if r not in out and r not in files:
                    out.append(r)
            todo.append(real)
    return out


def build_layer(base: Path, machine: Path, layer: Path, log=print) -> dict:
    """Write the systemd/sshd layer for hosts over `machine` into `layer` (empty when the machine has its own
    systemd and sshd). Returns what it holds, for the lab's report."""
    layer.mkdir(parents=True, exist_ok=True)
    if has_systemd(machine) and (machine / "usr/sbin/sshd").exists():
        log(f"gpu lab: {machine} has its own systemd and sshd; no layer")
        return {"files": 0, "libraries": 0}
    files = package_files(base)
    files += [rel for rel in MAINTAINER_FILES if (base / rel).is_file()] + enablement_links(base, files)
    files = [rel for rel in files if not os.path.lexists(machine / rel)]
    libs = [rel for rel in missing_libraries(base, machine, files) if not os.path.lexists(machine / rel)]
    for rel in files + libs:
        _copy(base, layer, rel)
    log(f"gpu lab: layer of {len(files)} files from the base's {', '.join(LAYER_PACKAGES[:5])}... and "
        f"{len(libs)} libraries the machine lacks")
    return {"files": len(files), "libraries": len(libs), "library_names": sorted(Path(p).name for p in libs)}


def device_nodes(dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA character devices to bind into a host (all GPUs, control, UVM, caps)."""
    out = []
    for p in sorted(dev.glob("nvidia*")):
        try:
            mode = p.lstat().st_mode
        except OSError:
            continue
        if stat.S_ISCHR(mode) or (stat.S_ISDIR(mode) and p.name == "nvidia-caps"):
            out.append(str(p))
    return out


def gpu_count(dev: Path = Path("/dev")) -> int:
    return sum(1 for p in dev.glob("nvidia[0-9]*") if p.name[6:].isdigit())


def bind_args() -> list[str]:
    """systemd-nspawn binds of the machine's GPU: its device nodes, and the driver's folder read-only."""
    args = [f"--bind={n}" for n in device_nodes()]
    if DRIVER_DIR.is_dir():
        args.append(f"--bind-ro={DRIVER_DIR}")
    return args


def nspawn_args(machine_id: str) -> list[str]:
    """systemd-nspawn arguments that boot a host with the machine's GPUs (see the module docstring)."""
    return ["--system-call-filter=bpf", "--link-journal=no", f"--uuid={machine_id}"] + bind_args()


def prepare_root(root: Path) -> list[str]:
    """First boot only, the GPU-specific part of a host's root: ld.so finds the driver's libraries, nvidia-smi is
    on PATH. Returns the shell commands to run inside the host (before boot) to finish it (users, ld cache)."""
    (root / LDCONF).parent.mkdir(parents=True, exist_ok=True)
    (root / LDCONF).write_text(f"{DRIVER_DIR}/lib64\n{DRIVER_DIR}/lib\n")
    smi = DRIVER_DIR / "bin/nvidia-smi"
    link = root / "usr/bin/nvidia-smi"
    if smi.exists() and not os.path.lexists(link):
        os.symlink(str(smi), link)
    return ["ldconfig",
            # OpenSSH's privilege separation user and dbus's, as their packages' maintainer scripts would make them
            "getent passwd sshd >/dev/null || useradd -r -d /run/sshd -s /usr/sbin/nologin sshd",
            "getent passwd messagebus >/dev/null || useradd -r -d /nonexistent -s /usr/sbin/nologin messagebus",
            "mkdir -p /run/sshd /var/log/journal",
            f"[ ! -d {MACHINE_VENV} ] || find {MACHINE_VENV} -perm /022 ! -type l -exec chmod go-w {{}} +"]
