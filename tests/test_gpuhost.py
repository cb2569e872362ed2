"""The GPU lab's host layer (deploy/lab/gpuhost.py): what it adds to a machine's root, and what it never touches.

Built from a small dpkg tree whose programs are this machine's real ELF binaries and libraries, so the library
closure is the dynamic linker's real one."""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from deploy.lab import gpuhost
from deploy.remote.host.elfsyms import read_elf

LIBDIR = "usr/lib/x86_64-linux-gnu"


def _real(soname: str) -> Path:
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"):
        p = Path(d) / soname
        if p.exists():
            return p.resolve()
    pytest.skip(f"{soname} not on this machine")


def _program() -> tuple[Path, list[str]]:
    """A real dynamically linked program of this machine and what it needs (DT_NEEDED)."""
    for cand in ("/usr/bin/ssh", "/usr/bin/ls", "/bin/ls"):
        if os.path.exists(cand):
            needed = read_elf(cand, symbols=False)["needed"]
            if len(needed) >= 2:
                return Path(cand), needed
    pytest.skip("no dynamically linked program with two or more needs here")


@pytest.fixture
def trees(tmp_path):
    """base: a dpkg tree whose package 'openssh-server' holds one real program (as /usr/sbin/sshd, recorded as
    /usr/sbin/sshd and its merged-/usr twin /sbin/sshd-twin), every library it needs, a unit and its enablement
    link; machine: a root that has the first of those libraries only."""
    prog, needed = _program()
    base, machine = tmp_path / "base", tmp_path / "machine"
    (base / "var/lib/dpkg/info").mkdir(parents=True)
    (base / LIBDIR).mkdir(parents=True)
    (base / "usr/sbin").mkdir(parents=True)
    (base / "usr/lib/systemd/system").mkdir(parents=True)
    (base / "etc/systemd/system/multi-user.target.wants").mkdir(parents=True)
    os.symlink("usr/sbin", base / "sbin")
    shutil.copy(prog, base / "usr/sbin/sshd")
    shutil.copy(prog, base / "usr/sbin/sshd-twin")
    for so in needed:
        shutil.copy(_real(so), base / LIBDIR / so)
    (base / "usr/lib/systemd/system/ssh.service").write_text("[Service]\nExecStart=/usr/sbin/sshd -D\n")
    os.symlink("/lib/systemd/system/ssh.service", base / "etc/systemd/system/multi-user.target.wants/ssh.service")
    os.symlink("/lib/systemd/system/gone.service", base / "etc/systemd/system/multi-user.target.wants/gone.service")
    (base / "var/lib/dpkg/info/openssh-server.list").write_text(
        "/.\n/usr\n/usr/sbin\n/usr/sbin/sshd\n/sbin/sshd-twin\n/lib/systemd/system/ssh.service\n")
    (machine / LIBDIR).mkdir(parents=True)
    (machine / "usr/bin").mkdir(parents=True)
    os.symlink("usr/bin", machine / "bin")
    shutil.copy(_real(needed[0]), machine / LIBDIR / needed[0])
    (machine / "usr/sbin").mkdir()
    (machine / "usr/sbin/sshd-twin").write_text("the machine's own\n")
    return base, machine, needed


def test_normal_resolves_merged_usr():
    assert gpuhost.normal("/lib/systemd/systemd") == "usr/lib/systemd/systemd"
    assert gpuhost.normal("/sbin/init") == "usr/sbin/init"
    assert gpuhost.normal("/bin") == "usr/bin"
    assert gpuhost.normal("/etc/ssh/sshd_config") == "etc/ssh/sshd_config"


def test_layer_adds_what_the_machine_lacks_and_never_replaces(trees, tmp_path):
    base, machine, needed = trees
    layer = tmp_path / "layer"
    got = gpuhost.build_layer(base, machine, layer, log=lambda *_: None)
    # the program, its unit and the unit's enablement link are added; the dangling link is not
    assert (layer / "usr/sbin/sshd").read_bytes() == (base / "usr/sbin/sshd").read_bytes()
    assert (layer / "usr/lib/systemd/system/ssh.service").exists()
    assert os.readlink(layer / "etc/systemd/system/multi-user.target.wants/ssh.service").endswith("ssh.service")
    assert not os.path.lexists(layer / "etc/systemd/system/multi-user.target.wants/gone.service")
    # the machine's own file at a path the package also has stays the machine's: the layer holds nothing there
    assert not os.path.lexists(layer / "usr/sbin/sshd-twin")
    # libraries: the ones the machine lacks come from the base, the one it has does not
    assert not os.path.lexists(layer / LIBDIR / needed[0])
    for so in needed[1:]:
        assert os.path.lexists(layer / LIBDIR / so), so
    assert got["libraries"] >= len(needed) - 1
    # merged /usr: nothing at the top that would hide the machine's bin -> usr/bin link
    assert sorted(os.listdir(layer)) == ["etc", "usr"]


def test_machine_with_its_own_systemd_and_sshd_gets_no_layer(trees, tmp_path):
    base, machine, _ = trees
    (machine / "usr/lib/systemd").mkdir(parents=True)
    (machine / "usr/lib/systemd/systemd").write_text("")
    (machine / "usr/sbin/sshd").write_text("")
    layer = tmp_path / "layer"
    assert gpuhost.build_layer(base, machine, layer, log=lambda *_: None) == {"files": 0, "libraries": 0}
    assert list(layer.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_device_nodes_are_nvidia_char_devices_only(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    for name, minor in (("nvidia0", 0), ("nvidia1", 1), ("nvidiactl", 255), ("nvidia-uvm", 0)):
        os.mknod(dev / name, 0o600 | stat.S_IFCHR, os.makedev(195 if "uvm" not in name else 511, minor))
    (dev / "nvidia-caps").mkdir()
    (dev / "nvidia-fake").write_text("a regular file is no device")
    (dev / "sda").write_text("")
    got = [Path(p).name for p in gpuhost.device_nodes(dev)]
    assert got == ["nvidia-caps", "nvidia-uvm", "nvidia0", "nvidia1", "nvidiactl"]
    assert gpuhost.gpu_count(dev) == 2
