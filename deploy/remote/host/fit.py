"""What a deploy plan checks an inventory against, read on the host (release.probe; nothing changes): which
process listens on each TCP port the inventory wants, and whether each model path is a model directory.

The control side judges (deploy/release/hostfit.py): a port another service or sshd listens on, or a model
path that is not a directory with a config.json, is refused before anything is staged or restarted.
"""
import json
import os
import socket
import sys

TCP_TABLES = (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6))
LISTEN = "0A"
CONFIG_MAX = 4 << 20    # bytes of a model's config.json read (real ones are a few KiB)
MAX_OWNERS = 8          # processes named per listening socket (a pre-forked server has many)


def _address(hexaddr, family):
    """/proc/net/tcp's local address (32-bit words in host byte order) -> its text form."""
    raw = bytes.fromhex(hexaddr)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    text = socket.inet_ntop(family, raw)
    return text[7:] if text.startswith("::ffff:") and "." in text else text  # an IPv4-mapped address


def listening(ports, tables=TCP_TABLES):
    """{port: [{"address", "inode"}]} of the TCP sockets in LISTEN state on `ports`, in this network
    namespace."""
    want = set(int(p) for p in ports)
    out = {}
    for path, family in tables:
        try:
            with open(path) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) < 10 or f[3] != LISTEN:
                continue
            addr, _, port = f[1].rpartition(":")
            try:
                port = int(port, 16)
                if port in want:
                    out.setdefault(port, []).append({"address": _address(addr, family), "inode": int(f[9])})
            except ValueError:
                continue
    return out


def unit_of(pid, proc="/proc"):
    """The systemd unit (service, socket or scope) a process runs in, from its cgroup path; None if unknown."""
    try:
        with open(os.path.join(proc, str(pid), "cgroup")) as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    paths = [ln.split(":", 2)[2] for ln in lines if ln.count(":") >= 2 and
             (ln.startswith("0::") or ":name=systemd:" in ln)]
    for path in paths:
        for part in reversed(path.split("/")):
            if part.endswith((".service", ".socket", ".scope")):
                return part
    return None


def owners(inodes, proc="/proc"):
    """{inode: [{"pid", "comm", "unit"}]}: the processes holding each socket (read as root: every process)."""
    want = set(inodes)
    out = {}
    if not want:
        return out
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        fd_dir = os.path.join(proc, pid, "fd")
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                link = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if not link.startswith("socket:["):
                continue
            try:
                inode = int(link[8:-1])
            except ValueError:
                continue
            if inode in want and len(out.get(inode, [])) < MAX_OWNERS:
                try:
                    with open(os.path.join(proc, pid, "comm")) as fh:
                        comm = fh.read().strip()[:64]
                except OSError:
                    comm = None
                if not any(o["pid"] == int(pid) for o in out.get(inode, [])):
                    out.setdefault(inode, []).append({"pid": int(pid), "comm": comm, "unit": unit_of(pid, proc)})
    return out


def listeners(ports):
    """{port (text): [{"address", "pid", "comm", "unit"}]}: who listens on each of `ports` (a socket whose
    process could not be found has pid None)."""
    socks = listening(ports)
    who = owners([s["inode"] for ss in socks.values() for s in ss])
    out = {}
    for port, ss in sorted(socks.items()):
        for s in ss:
            for o in who.get(s["inode"]) or [{"pid": None, "comm": None, "unit": None}]:
                out.setdefault(str(port), []).append(dict(o, address=s["address"]))
    return out


def model_dir(path):
    """"ok" when `path` is a directory holding a readable config.json with a JSON object, else why not."""
    if not os.path.isdir(path):
        return "%s: %s" % (path, "no such directory" if not os.path.lexists(path) else "not a directory")
    cfg = os.path.join(path, "config.json")
    try:
        with open(cfg, "rb") as fh:
            data = fh.read(CONFIG_MAX + 1)
    except OSError as exc:
        return "%s: not a model directory (%s)" % (path, "no config.json" if not os.path.lexists(cfg)
                                                  else "config.json: %s" % (exc.strerror or exc))
    if len(data) > CONFIG_MAX:
        return "%s: config.json is larger than %d bytes" % (cfg, CONFIG_MAX)
    try:
        doc = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        return "%s: not JSON (%s)" % (cfg, str(exc)[:200])
    if not isinstance(doc, dict):
        return "%s: not a JSON object" % cfg
    return "ok"
