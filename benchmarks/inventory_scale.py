"""Benchmark: `fab inventory` over 3 and 12 lab hosts next to `ansible -m setup` over the same hosts.

Boots the lab with 9 extra hosts if needed (`fab lab.up --extra 9`), installs ansible-core from the
package registry into its own venv (cached under the lab cache), then times the two tools side by side in
one run -- alternating, fab then ansible, REPEAT times each (so a busy machine slows both alike) -- and
prints the median and best wall-clock seconds, start-up included (`fab` is the real CLI, `--refresh`:
every host probed). Both tools verify host keys against the lab's known_hosts. Run as root:
DDTREE_LAB_ID=N .venv/bin/python benchmarks/inventory_scale.py
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.lab import fleet  # noqa: E402

REPEAT = int(os.environ.get("REPEAT", "5"))
ANSIBLE_VENV = fleet.CACHE_DIR / "ansible-venv"


def timed(argv, env=None) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{argv[0]} failed ({p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    return dt


def ensure_ansible() -> Path:
    bin_ = ANSIBLE_VENV / "bin" / "ansible"
    if not bin_.exists():
        subprocess.run([sys.executable, "-m", "venv", str(ANSIBLE_VENV)], check=True)
        subprocess.run([str(ANSIBLE_VENV / "bin" / "pip"), "install", "-q", "ansible-core"], check=True)
    return bin_


def main() -> None:
    hosts12 = fleet.lab_hosts(9)
    fleet.up(extra=9, log=lambda *_: None)
    ansible = ensure_ansible()
    version = subprocess.run([str(ansible), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (3, 12):
            hosts = hosts12[:n]
            inv = Path(tmp) / f"inv{n}" / "inventory.yaml"
            inv.parent.mkdir()
            inv.write_text(fleet.inventory_yaml(hosts))
            ini = Path(tmp) / f"ansible{n}.ini"
            ini.write_text("[lab]\n" + "".join(f"{h.name} ansible_host={h.address}\n" for h in hosts) +
                           "[lab:vars]\nansible_user=root\nansible_python_interpreter=/usr/bin/python3\n"
                           f"ansible_ssh_private_key_file={fleet.LAB_DIR / 'id_ed25519'}\n"
                           f"ansible_ssh_common_args='-o UserKnownHostsFile={fleet.known_hosts()} "
                           "-o StrictHostKeyChecking=yes'\n")
            fab_env = dict(os.environ, DEPLOY_INVENTORY=str(inv))
            ans_env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_FORKS="16",
                           ANSIBLE_LOCAL_TEMP=str(Path(tmp) / "ansible-tmp"), ANSIBLE_NOCOLOR="1")
            fab_argv = [str(ROOT / ".venv/bin/fab"), "inventory", "--refresh", "--json"]
            ans_argv = [str(ansible), "all", "-i", str(ini), "-m", "setup", "-f", "16"]
            timed(fab_argv, fab_env)  # the agent is shipped to the hosts once (content-addressed), not timed
            fab_times, ans_times = [], []
            for _ in range(REPEAT):
                fab_times.append(timed(fab_argv, fab_env))
                ans_times.append(timed(ans_argv, ans_env))
            rows.append((n, fab_times, ans_times))
    load = os.getloadavg()
    print(f"inventory over lab hosts, {REPEAT} runs each alternating, wall seconds (median / best); {version}; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
    print(f"{'hosts':>5}  {'fab inventory':>16}  {'ansible -m setup':>18}  {'speed-up':>8}")
    for n, f, a in rows:
        print(f"{n:>5}  {statistics.median(f):7.2f} / {min(f):5.2f}   {statistics.median(a):7.2f} / {min(a):5.2f}"
              f"   {statistics.median(a) / statistics.median(f):6.1f}x")


if __name__ == "__main__":
    main()
