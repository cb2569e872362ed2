"""Benchmark: `fab inventory` over 3 and 12 lab hosts next to `ansible -m setup` over the same hosts.

Boots the lab with 9 extra hosts if needed (`fab lab.up --extra 9`), installs ansible-core from the
package registry into its own venv (cached under the lab cache), then times the tools side by side in
one run -- alternating within each round (fab, ansible warm, ansible cold), REPEAT rounds (so a busy machine
slows them alike) -- and prints the median and best wall-clock seconds, start-up included (`fab` is the real
CLI, `--refresh`: every host probed). Both tools verify host keys against the lab's known_hosts
(StrictHostKeyChecking=yes for ansible's ssh, RejectPolicy for fab's paramiko).

Connections, cold and warm:
- fab keeps nothing between runs: every run opens a new SSH connection per host (cold, always). What it keeps
  on a host is its agent zipapp (content-addressed, shipped once; one untimed run first ships it).
- ansible's default ssh arguments carry ControlMaster=auto, ControlPersist=60s: a run leaves one master
  connection per host behind, and runs within a minute reuse it. "ansible warm" is that default: one untimed run
  opens the masters, the timed runs reuse them. "ansible cold" gives each run a fresh, empty control directory,
  so it opens every connection itself, as its first run of the day does; its masters are closed after the run,
  outside the timing. fab / ansible-warm is the conservative ratio, fab / ansible-cold the like-for-like one.

Both tools run with Python free to cache bytecode (PYTHONDONTWRITEBYTECODE removed from their environment;
a session may set it, and then this checkout's modules -- not pip-installed, so never byte-compiled -- would be
compiled again on every fab run, while ansible's installed modules keep the bytecode pip wrote).

Run as root, when the machine is quiet (`uptime`): DDTREE_LAB_ID=N REPEAT=9 .venv/bin/python
benchmarks/inventory_scale.py
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
    p = subprocess.run(argv, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True)
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


def close_masters(control_dir: Path) -> None:
    """Stop the ControlPersist masters an ansible run left in `control_dir` (untimed)."""
    for sock in control_dir.iterdir() if control_dir.is_dir() else ():
        subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "lab-master"],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=10)


def med_best(ts: list[float]) -> str:
    return f"{statistics.median(ts):5.2f} / {min(ts):4.2f}"


def main() -> None:
    hosts12 = fleet.lab_hosts(9)
    fleet.up(extra=9, log=lambda *_: None)
    ansible = ensure_ansible()
    version = subprocess.run([str(ansible), "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    load0 = os.getloadavg()
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
            fab_env = dict(base_env, DEPLOY_INVENTORY=str(inv))
            warm_dir = Path(tmp) / f"cp-warm{n}"
            warm_dir.mkdir(mode=0o700)

            def ans_env(control_dir: Path) -> dict:
                return dict(base_env, ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_FORKS="16",
                            ANSIBLE_LOCAL_TEMP=str(Path(tmp) / "ansible-tmp"), ANSIBLE_NOCOLOR="1",
                            ANSIBLE_SSH_CONTROL_PATH_DIR=str(control_dir))
            fab_argv = [str(ROOT / ".venv/bin/fab"), "inventory", "--refresh", "--json"]
            ans_argv = [str(ansible), "all", "-i", str(ini), "-m", "setup", "-f", "16"]
            # untimed: fab ships its agent to the hosts (once per zipapp hash) and Python caches this checkout's
            # bytecode; ansible opens the masters that its warm runs reuse
            timed(fab_argv, fab_env)
            timed(ans_argv, ans_env(warm_dir))
            fab_t, warm_t, cold_t = [], [], []
            try:
                for i in range(REPEAT):
                    fab_t.append(timed(fab_argv, fab_env))
                    warm_t.append(timed(ans_argv, ans_env(warm_dir)))
                    cold_dir = Path(tmp) / f"cp-cold{n}-{i}"
                    cold_dir.mkdir(mode=0o700)
                    try:
                        cold_t.append(timed(ans_argv, ans_env(cold_dir)))
                    finally:
                        close_masters(cold_dir)
            finally:
                close_masters(warm_dir)
            rows.append((n, fab_t, warm_t, cold_t))
    load = os.getloadavg()
    print(f"inventory over lab hosts, {REPEAT} rounds alternating (fab, ansible warm, ansible cold), wall seconds "
          f"(median / best); {version}; {os.cpu_count()} CPUs, load average "
          f"{load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f} at the start, "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
    print("fab: a new connection per host every run (cold); ansible warm: ControlPersist masters from an earlier "
          "run; ansible cold: fresh control directory each run")
    print(f"{'hosts':>5}  {'fab inventory':>13}  {'ansible warm':>13}  {'ansible cold':>13}  "
          f"{'vs warm':>7}  {'vs cold':>7}")
    for n, f, w, c in rows:
        fm = statistics.median(f)
        print(f"{n:>5}  {med_best(f):>13}  {med_best(w):>13}  {med_best(c):>13}  "
              f"{statistics.median(w) / fm:6.1f}x  {statistics.median(c) / fm:6.1f}x")


if __name__ == "__main__":
    main()
