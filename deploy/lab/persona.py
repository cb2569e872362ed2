"""GPU personas for lab hosts: the files the nvidia-smi stand-in replays.

`h200-1gpu` is the real capture from an H200 host (lab/personas/h200-1gpu, from
shared/fixtures/gpu-hosts). `h200-8gpu` is DERIVED from it too: eight of that H200 on NVSwitch (NV18 between
every pair in `nvidia-smi topo -m`), the lab's tensor-parallel host. `rtxpro6000-8gpu` is DERIVED from that capture: the same driver and
CUDA banner, with eight RTX PRO 6000 Blackwell (sm_120) GPUs in place of the H200. No capture of
such a host exists here; the derived files say so in DERIVED.txt.
"""
from __future__ import annotations

import hashlib
import re
import uuid
from pathlib import Path

CAPTURES = Path(__file__).resolve().parents[2] / "lab" / "personas"
FILES = ("nvidia-smi.txt", "nvidia-smi-q.xml", "query-gpu.csv", "topo.txt")

RTXPRO = {"name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "memory_mib": 97887, "compute_cap": "12.0",
          "count": 8, "power": "600W"}
# An HGX H200 board: eight H200 on NVSwitch (every pair NV18 in `nvidia-smi topo -m`), GPUs 0-3 on NUMA node 0,
# 4-7 on node 1: the lab's tensor-parallel host.
H200X8 = {"name": "NVIDIA H200", "memory_mib": 143771, "compute_cap": "9.0", "count": 8, "power": "700W",
          "link": "NV18", "numa": lambda i: i // 4, "cpus": lambda i: "0-47,96-143" if i < 4 else "48-95,144-191"}


def capture(name: str = "h200-1gpu") -> dict[str, str]:
    return {f: (CAPTURES / name / f).read_text() for f in FILES}


def _uuid(seed: str) -> str:
    return "GPU-" + str(uuid.UUID(hashlib.sha256(seed.encode()).hexdigest()[:32]))


def _bus(i: int) -> str:
    return f"00000000:{0x01 + 0x20 * i:02X}:00.0"


def derive_multi_gpu(src: dict[str, str], spec: dict = RTXPRO, seed: str = "lab") -> dict[str, str]:
    """Derive an N-GPU persona of another model from a one-GPU capture, keeping its formats."""
    n, name, mem, cap = spec["count"], spec["name"], spec["memory_mib"], spec["compute_cap"]
    gpus = [(i, _uuid(f"{seed}-{i}"), _bus(i)) for i in range(n)]

    # query-gpu.csv: same header, one row per GPU.
    header, row = src["query-gpu.csv"].strip().splitlines()[:2]
    cells = [c.strip() for c in row.split(",")]
    rows = []
    for i, u, bus in gpus:
        c = list(cells)
        c[0], c[1], c[2], c[4], c[5], c[6] = str(i), u, name, f"{mem} MiB", cap, bus
        c[7] = str(1650000000000 + i)
        rows.append(", ".join(c))
    csv_text = "\n".join([header] + rows) + "\n"

    # nvidia-smi.txt: the banner as captured, one 3-line block per GPU with the same column widths.
    lines = src["nvidia-smi.txt"].splitlines()
    first = next(k for k, line in enumerate(lines) if re.match(r"^\|\s+0\s+NVIDIA", line))
    sep = lines[first + 3]
    w1 = len(lines[first].split("|")[1])
    short = name.replace("NVIDIA ", "NVIDIA ") if len(name) <= 26 else name[:23] + "..."
    block = []
    for i, _u, bus in gpus:
        block += [
            "|" + f"   {i}  {short:<26}     On".ljust(w1 - 1)[: w1 - 1].ljust(w1) + "|" + f"   {bus} Off ".ljust(24) + "|" + "Off".rjust(21) + " |",
            "|" + f" N/A   31C    P8             32W / {spec['power']:>5}".ljust(w1) + "|" + f"       1MiB / {mem}MiB ".rjust(24) + "|" + "0%      Default".rjust(21) + " |",
            "|" + " " * w1 + "|" + " " * 24 + "|" + "Disabled".rjust(21) + " |",
            sep,
        ]
    last = first + 4
    smi_text = "\n".join(lines[:first] + block + lines[last:]) + "\n"

    # nvidia-smi -q -x: the <gpu> element repeated, with this persona's identity.
    xml = src["nvidia-smi-q.xml"]
    m = re.search(r"(\t<gpu id=\"[^\"]+\">.*?</gpu>\n)", xml, re.S)
    one = m.group(1)
    blocks = []
    for i, u, bus in gpus:
        b = one.replace(cells[6], bus).replace(cells[1], u)
        b = re.sub(r"<product_name>.*?</product_name>", f"<product_name>{name}</product_name>", b)
        b = re.sub(r"<minor_number>\d+</minor_number>", f"<minor_number>{i}</minor_number>", b)
        b = b.replace(cells[4].replace(" MiB", "") + " MiB", f"{mem} MiB")
        blocks.append(b)
    xml_text = xml[: m.start()] + "".join(blocks) + xml[m.end():]
    xml_text = re.sub(r"<attached_gpus>\d+</attached_gpus>", f"<attached_gpus>{n}</attached_gpus>", xml_text)

    # the header's first cell is empty (the row names' column), as in the captures: "\t\x1b[4mGPU0\tGPU1..."
    topo_head = "\t".join(["", "\x1b[4mGPU%d" % 0] + [f"GPU{i}" for i in range(1, n)] + ["CPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m"])
    link = spec.get("link", "NODE")
    numa, cpus = spec.get("numa", lambda i: 0), spec.get("cpus", lambda i: "0-15")
    topo_rows = ["GPU%d\t" % i + "\t".join(" X " if j == i else link for j in range(n))
                 + f"\t{cpus(i)}\t{numa(i)}\t\tN/A" for i in range(n)]
    legend = src["topo.txt"].split("\n\n", 1)[1] if "\n\n" in src["topo.txt"] else ""
    topo_text = "\n".join([topo_head] + topo_rows) + "\n\n" + legend
    return {"nvidia-smi.txt": smi_text, "nvidia-smi-q.xml": xml_text, "query-gpu.csv": csv_text,
            "topo.txt": topo_text,
            "DERIVED.txt": f"DERIVED persona: {n}x {name} (sm_{cap.replace('.', '')}), generated by "
                           f"deploy/lab/persona.py from the real h200-1gpu capture. Not a capture.\n"}


def persona_files(kind: str, seed: str) -> dict[str, str]:
    if kind == "h200-1gpu":
        return capture("h200-1gpu") | {"SOURCE.txt": "Real capture from an H200 host (shared/fixtures/gpu-hosts).\n"}
    if kind == "rtxpro6000-8gpu":
        return derive_multi_gpu(capture("h200-1gpu"), RTXPRO, seed)
    if kind == "h200-8gpu":
        return derive_multi_gpu(capture("h200-1gpu"), H200X8, seed)
    raise ValueError(f"unknown GPU persona {kind!r}")
