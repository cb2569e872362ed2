#!/usr/bin/python3
"""ExecStartPost of sglang-ddtree@.service: wait until the server on --port answers GET /health with 200.

Keeps the unit "activating" while the model loads, so `systemctl status` tells loading from serving and
TimeoutStartSec bounds the load. Stdlib only; runs as the service user.
"""
import argparse
import os
import sys
import time
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser()
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
            with urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=5) as r:
                if r.status == 200:
                    return 0
        except OSError:
            pass
        time.sleep(0.5)
    print(f"server on port {a.port} not ready after {a.timeout:.0f}s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
