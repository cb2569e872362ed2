"""Benchmark: what the coherence facts (every distribution's requirements, the native-extension report) cost
`fab inventory` over the 3 lab hosts, next to `ansible -m setup` over the same hosts.

Three cases, alternating REPEAT times (the real CLI, `--refresh --json`, start-up included):
  steady      the hosts' caches and the control side's last facts hold: no metadata or ELF file is read, the
              distribution list does not travel, the verdicts are not made again (what a fleet sees run after run);
  no-facts    no facts on the control side (a fresh checkout, or a changed venv): the list travels, pip check's
              verdict is made;
  cold        neither, and the hosts' caches removed (the first probe after a change): every METADATA file and
              the ELF files of torch/lib and sgl_kernel are read.
The hosts are the lab's (`fab lab.up`; its ELF files are small stand-ins: on a real torch 2.11/2.14 install the
uncached native check reads about 1 GB of torch/lib's symbol tables, ~0.25 s warm, ~1 s from a cold page cache).
ansible-core comes from the lab cache's venv (benchmarks/inventory_scale.py installs it). Run as root:
DDTREE_LAB_ID=N .venv/bin/python benchmarks/inventory_coherence.py
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.inventory_scale import ensure_ansible, timed  # noqa: E402
from deploy.lab import fleet  # noqa: E402

REPEAT = int(os.environ.get("REPEAT", "7"))
CASES = ("steady", "no-facts", "cold")


def drop_host_caches(hosts) -> None:
    for h in hosts:
        subprocess.run(["ssh", "-i", str(fleet.control_key()), "-o", f"UserKnownHostsFile={fleet.known_hosts()}",
                        "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", f"root@{h.address}",
                        "rm -f /var/lib/ddtree/cache-dists.json /var/lib/ddtree/cache-native.json"], check=True,
                       capture_output=True, timeout=60)


def main() -> None:
    fleet.up(log=lambda *_: None)
    hosts = fleet.lab_hosts(0)[:3]
    ansible = ensure_ansible()
    times: dict[str, list[float]] = {c: [] for c in CASES + ("ansible",)}
    with tempfile.TemporaryDirectory() as tmp:
        inv = Path(tmp) / "inventory.yaml"
        inv.write_text(fleet.inventory_yaml(hosts))
        ini = Path(tmp) / "ansible.ini"
        ini.write_text("[lab]\n" + "".join(f"{h.name} ansible_host={h.address}\n" for h in hosts) +
                       "[lab:vars]\nansible_user=root\nansible_python_interpreter=/usr/bin/python3\n"
                       f"ansible_ssh_private_key_file={fleet.LAB_DIR / 'id_ed25519'}\n"
                       f"ansible_ssh_common_args='-o UserKnownHostsFile={fleet.known_hosts()} "
                       "-o StrictHostKeyChecking=yes'\n")
        fab_env = dict(os.environ, DEPLOY_INVENTORY=str(inv))
        ans_env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING="True", ANSIBLE_FORKS="16",
                       ANSIBLE_LOCAL_TEMP=str(Path(tmp) / "ansible-tmp"), ANSIBLE_NOCOLOR="1")
        fab = [str(ROOT / ".venv/bin/fab"), "inventory", "--refresh", "--json"]
        facts = inv.parent / "facts"
        timed(fab, fab_env)  # ships the agent (content-addressed, once) and fills every cache: not timed
        for _ in range(REPEAT):
            times["steady"].append(timed(fab, fab_env))
            shutil.rmtree(facts)
            times["no-facts"].append(timed(fab, fab_env))
            shutil.rmtree(facts)
            drop_host_caches(hosts)
            times["cold"].append(timed(fab, fab_env))
            times["ansible"].append(timed([str(ansible), "all", "-i", str(ini), "-m", "setup", "-f", "16"], ans_env))
    load = os.getloadavg()
    print(f"fab inventory over 3 lab hosts, {REPEAT} runs each alternating, wall seconds (median / best); "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end")
    a = statistics.median(times["ansible"])
    for case, v in times.items():
        label = "ansible -m setup" if case == "ansible" else f"fab inventory, {case}"
        ratio = "" if case == "ansible" else f"   {a / statistics.median(v):.1f}x faster than ansible"
        print(f"{label:28} {statistics.median(v):6.2f} / {min(v):5.2f}{ratio}")


if __name__ == "__main__":
    main()
