"""Inventory report: facts of many hosts side by side, drift from the reference host highlighted."""
from __future__ import annotations

import time
from collections import Counter
from datetime import datetime

from rich.table import Table
from rich.text import Text

from .facts import incoherent, split_local


def terminal_console():
    """A console as wide as the terminal, or COLUMNS when the output is not one (rich's own rule); never wider."""
    from rich.console import Console
    return Console()


def wide_console(renderable):
    """A console wide enough that `renderable` (a --wide table) prints without wrapping a cell."""
    from rich.console import Console
    from rich.measure import Measurement
    probe = Console(width=1000)
    return Console(width=max(Console().width, Measurement.get(probe, probe.options, renderable).maximum))


def _age(facts: dict) -> str:
    s = time.time() - datetime.fromisoformat(facts["gathered_at"]).timestamp()
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h"


def gpu_summary(facts: dict) -> str:
    nv = facts.get("nvidia") or {}
    gpus = nv.get("gpus") or []
    if not nv:
        return "no nvidia-smi"
    if not gpus:
        return f"error: {nv.get('error') or 'no GPUs'}"
    kinds = Counter((g["name"].replace("NVIDIA ", "").replace(" Server Edition", ""), g["sm"], g["memory_mib"])
                    for g in gpus)
    return ", ".join(f"{n}x {name} {sm} {round(mem / 1024)}G" for (name, sm, mem), n in kinds.items())


def row_values(facts: dict) -> dict[str, str | None]:
    """The comparable values of one host, by column; None where the host has no such fact."""
    nv = facts.get("nvidia") or {}
    venv = facts.get("venv") or {}
    t = facts.get("torch") or {}
    pk = facts.get("packages") or {}
    return {
        "driver": nv.get("driver"),
        "cuda": nv.get("cuda"),
        "gpus": gpu_summary(facts),
        "os": f"{(facts.get('os') or {}).get('id')} {(facts.get('os') or {}).get('version_id')}",
        "glibc": (facts.get("os") or {}).get("glibc"),
        "python": f"{venv.get('python')} {venv.get('abi')}" if venv.get("python") else ("no venv" if venv else None),
        "torch": t.get("version"),
        "abi": {True: "cxx11", False: "pre-cxx11", None: "?"}[t.get("cxx11_abi")] if t else None,
        "archs": " ".join(a.replace("sm_", "") for a in t.get("arch_list") or []) or None,
        "triton": pk.get("triton"),
        "sglang": pk.get("sglang"),
        "sglang-kernel": pk.get("sglang-kernel"),
        "flashinfer": pk.get("flashinfer-python"),
        "dists": str(len(venv.get("distributions") or {})) if venv.get("distributions") is not None else None,
        "coherent": coherent_cell(facts),
    }


def coherent_cell(facts: dict) -> str | None:
    """'ok', or what is wrong ('2 unmet', 'native', '2 unmet, native'); None when the distributions were not
    read. 'unmet' counts pip check's lines (unmet and conflicting requirements, wheels of another platform)."""
    c = facts.get("coherence")
    if not c:
        return None
    if c["ok"]:
        return "ok"
    bad = []
    if not c["pip_check"]["ok"]:
        bad.append(f"{len(c['pip_check']['reasons'])} unmet")
    if c.get("native") and not c["native"]["ok"]:
        bad.append("native")
    return ", ".join(bad)


COLUMNS = ["driver", "cuda", "gpus", "os", "glibc", "python", "torch", "abi", "archs", "triton", "sglang",
           "sglang-kernel", "flashinfer", "dists", "coherent"]


def drift(ref: dict | None, facts: dict) -> dict[str, str]:
    """Columns where `facts` differs from the reference: 'abi' for a build-tag (ABI) mismatch, 'differs' else."""
    if not ref or ref is facts:
        return {}
    a, b = row_values(ref), row_values(facts)
    out = {}
    for col in COLUMNS:
        if col in ("gpus", "dists", "coherent"):
            continue
        if a[col] != b[col]:
            out[col] = "differs"
    ta, tb = (ref.get("torch") or {}).get("version"), (facts.get("torch") or {}).get("version")
    if ta and tb:
        (pa, la), (pb, lb) = split_local(ta), split_local(tb)
        if pa == pb and la != lb:
            out["torch"] = "abi"
    return out


def endpoint(host) -> str:
    """Where clients reach a host, from the inventory: its router (sglang-router on listen_address:port, the GPU
    servers on loopback behind it), or the GPU servers themselves."""
    if host is None:
        return "-"
    listen = host.vars.get("listen_address", "127.0.0.1")
    r = host.vars.get("router") or {}
    if r.get("enabled"):
        return f"router {listen}:{r['port']} (drain {r['drain_timeout']}s)"
    ports = [s.port for s in host.services if s.enabled]
    return f"GPUs {listen}:{min(ports)}-{max(ports)}" if ports else f"GPUs {listen}"


def _host_label(inv, name: str) -> Text:
    return Text(name + (" ★" if name == inv.reference_name else ""))


def wide_table(inv, facts_by_host: dict[str, dict], errors: dict[str, tuple[str, str]]) -> Table:
    """Every fact of every host, one column each (`fab inventory --wide`): cells wrap where the terminal is narrow.

    Every value from a host or the inventory is a rich Text (plain text): `[...]` in a host's output or error
    is shown as is, never read as markup (a stray `[/x]` would crash the table, `[green]` would fake a style)."""
    ref = facts_by_host.get(inv.reference_name)
    table = Table(title=Text(f"fleet {inv.fleet} — reference {inv.reference_name}"
                             + ("" if ref else " (no facts: drift not shown)")), header_style="bold")
    table.add_column("host")
    for col in COLUMNS:
        table.add_column(col, overflow="fold")
    table.add_column("age")
    table.add_column("endpoint")
    for name, facts in facts_by_host.items():
        vals = row_values(facts)
        marks = drift(ref, facts)
        cells = []
        for col in COLUMNS:
            v = vals[col] or "-"
            style = {"abi": "bold red", "differs": "yellow"}.get(marks.get(col, ""), "")
            if col == "coherent" and vals[col] not in (None, "ok"):
                style = "bold red"
            cells.append(Text(v + (" (ABI≠ref)" if marks.get(col) == "abi" else ""), style=style))
        table.add_row(_host_label(inv, name), *cells, Text(_age(facts)),
                      Text(endpoint(getattr(inv, "hosts", {}).get(name))))
    for name, (kind, err) in errors.items():
        table.add_row(Text(name, style="bold red"), Text(f"{kind}: {err}", style="red"),
                      *[Text("")] * (len(COLUMNS) - 1), Text(""), Text(endpoint(getattr(inv, "hosts", {}).get(name))))
    return table


def gpu_short(facts: dict) -> str:
    """The GPUs of a host in a few characters: count, arch and memory of each kind (`8x sm_120 96G`)."""
    gpus = (facts.get("nvidia") or {}).get("gpus") or []
    if not gpus:
        return gpu_summary(facts)
    kinds = Counter((g["sm"], g["memory_mib"]) for g in gpus)
    return ", ".join(f"{n}x {sm} {round(mem / 1024)}G" for (sm, mem), n in kinds.items())


# (column, header) of the narrow table: what tells two hosts apart at a glance; the rest is in --wide and --json
NARROW = [("gpus", "gpus"), ("driver", "driver"), ("cuda", "cuda"), ("python", "py"), ("torch", "torch"),
          ("sglang", "sglang"), ("sglang-kernel", "kernel"), ("coherent", "coherent")]


def inventory_table(inv, facts_by_host: dict[str, dict], errors: dict[str, tuple[str, str]],
                    wide: bool = False) -> Table:
    """One line per host, fit for a 100-column terminal: GPUs, driver, CUDA, Python ABI, torch, SGLang, its
    kernel, coherence and the facts' age. A cell that differs from the reference host is coloured; drift and
    problems are said in words under the table (`problem_lines`); `wide` gives every fact (`wide_table`).

    Every value from a host or the inventory is a rich Text (plain text), never read as markup."""
    if wide:
        return wide_table(inv, facts_by_host, errors)
    ref = facts_by_host.get(inv.reference_name)
    table = Table(title=Text(f"fleet {inv.fleet} — reference {inv.reference_name}"
                             + ("" if ref else " (no facts: drift not shown)")), header_style="bold",
                  box=None, pad_edge=False, title_justify="left")
    names = [_host_label(inv, n).plain for n in [*facts_by_host, *errors]]
    table.add_column("host", no_wrap=True, min_width=max(map(len, names), default=4))
    for _, header in NARROW:
        table.add_column(header, no_wrap=True, overflow="ellipsis")
    table.add_column("age", no_wrap=True)
    for name, facts in facts_by_host.items():
        vals = dict(row_values(facts), gpus=gpu_short(facts))
        if vals["python"] and (facts.get("venv") or {}).get("abi"):
            vals["python"] = facts["venv"]["abi"]
        marks = drift(ref, facts)
        cells = []
        for col, _ in NARROW:
            style = {"abi": "bold red", "differs": "yellow"}.get(marks.get(col, ""), "")
            if col == "coherent" and vals[col] not in (None, "ok"):
                style = "bold red"
            cells.append(Text(vals[col] or "-", style=style))
        table.add_row(_host_label(inv, name), *cells, Text(_age(facts)))
    for name, (kind, err) in errors.items():
        table.add_row(Text(name, style="bold red"), Text(f"{kind}: {err}", style="red"),
                      *[Text("")] * len(NARROW))
    return table


def drift_lines(inv, facts_by_host: dict[str, dict]) -> list[Text]:
    """Each host's drift from the reference host, in words: `ct200: torch 2.11.0+cu128, reference 2.11.0+cu130
    (same release, another build: ABI≠ref)`. Plain text, never markup."""
    ref = facts_by_host.get(inv.reference_name)
    if not ref:
        return [Text(f"no facts from the reference host {inv.reference_name}: drift not shown", style="yellow")] \
            if facts_by_host else []
    a = row_values(ref)
    out = []
    for name, facts in facts_by_host.items():
        marks = drift(ref, facts)
        if not marks:
            continue
        b = row_values(facts)
        parts = [f"{col} {b[col] or '-'}, reference {a[col] or '-'}"
                 + (" (same release, another build: ABI≠ref)" if kind == "abi" else "")
                 for col, kind in marks.items()]
        out.append(Text.assemble((f"{name}: ", "bold"),
                                 (f"differs from {inv.reference_name}: ", "yellow"), "; ".join(parts)))
    return out


def problem_lines(inv, facts_by_host: dict[str, dict], errors: dict[str, tuple[str, str]]) -> list[Text]:
    """What to print under the narrow table: drift in words, hosts that did not answer (the whole error), and
    the reasons behind each flagged `coherent` cell."""
    out = drift_lines(inv, facts_by_host)
    out += [Text.assemble((f"{name}: ", "bold red"), (f"{kind}: {err}", "red")) for name, (kind, err) in errors.items()]
    return out + incoherent_lines(facts_by_host)


def incoherent_lines(facts_by_host: dict[str, dict]) -> list[Text]:
    """The reasons behind each flagged `coherent` cell, to print under the table (plain text, never markup)."""
    out = []
    for host, reasons in incoherent(facts_by_host).items():
        out.append(Text.assemble((f"{host}: INCOHERENT", "bold red"), f" ({len(reasons)} reason(s))"))
        out += [Text(f"  {r}") for r in reasons]
    return out
