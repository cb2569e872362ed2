#!/usr/bin/python3
"""ExecStartPost of sglang-ddtree@.service: wait until the server on --host/--port answers GET /health with 200.

Keeps the unit "activating" while the model loads, so `systemctl status` tells loading from serving and
TimeoutStartSec bounds the load. --host is the listen address (0.0.0.0 / :: are reached on loopback). /health
needs no API key in SGLang (0.5.17 and 0.5.23 exempt /health*), so this never reads one. Stdlib only; runs as
the service user inside the unit's sandbox.
"""
import argparse
import ipaddress
import os
import sys
import time
import urllib.request


def url(host, port, path):
    ip = ipaddress.ip_address(host)
    if ip.is_unspecified:
        ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
    return "http://%s:%d%s" % ("[%s]" % ip if ip.version == 6 else ip, port, path)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--timeout", type=float, default=1800)
    a = p.parse_args()
    deadline = time.monotonic() + a.timeout
    main_pid = int(os.environ.get("MAINPID") or 0)  # systemd sets it for ExecStartPost
    while time.monotonic() < deadline:
        if main_pid and not os.path.exists("/proc/%d" % main_pid):
            print("server process %d exited before it was ready" % main_pid, file=sys.stderr)
            return 1
        try:
            with urllib.request.urlopen(url(a.host, a.port, "/health"), timeout=5) as r:
                if r.status == 200:
                    return 0
        except OSError:
            pass
        time.sleep(0.5)
    print(f"server on port {a.port} not ready after {a.timeout:.0f}s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
