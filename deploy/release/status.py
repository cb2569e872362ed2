"""`fab status` and `fab logs`: one read-only agent call per host (no lock), then pure row building and printing."""
from __future__ import annotations

from ..inventory import Host, Inventory
from ..remote.client import Remote
from ..remote.host import metrics as metricsmod
from ..ssh import run_per_host
from . import render
from . import router as routermod
from .layout import host_args

DEADLINE = 60.0


def gather(inv: Inventory, hosts: list[Host], journal_n: int = 5) -> list[dict]:
    def one(conn, host):
        return Remote(conn, host.name).call("release.status", host_args(host) | {
            "instances": [s.instance for s in host.services], "journal_n": journal_n,
            "ports": {s.instance: s.port for s in host.services}}, deadline=DEADLINE)
    out = []
    for r in run_per_host(inv, hosts, one, label="status"):
        out.append({"host": r.host, "ok": r.ok, "error": r.error, "kind": r.kind, "state": r.value})
    return out


def live(text: str | None) -> dict:
    """The serving figures of one server's /metrics text (prometheus_client's parser, metrics.serving)."""
    if not text:
        return {}
    try:
        return metricsmod.serving(text)
    except metricsmod.MetricsError as exc:
        return {"metrics_error": str(exc)}


def router_cell(view: dict | None, port: int | None) -> str:
    """The router's view of one GPU's worker: in/healthy, in/UNHEALTHY, OUT, or why it is unknown."""
    if view is None:
        return "-"
    if not view.get("alive"):
        return f"router down ({view.get('detail')})"
    if "workers" not in view:
        return f"unknown ({view.get('error')})"
    w = view["workers"].get(f"http://127.0.0.1:{port}")
    return "OUT" if w is None else ("in/healthy" if w["healthy"] else "in/UNHEALTHY")


def rows(gathered: list[dict], hosts: dict[str, Host], previous: dict | None = None, seconds: float | None = None
         ) -> list[dict]:
    """One row per host and GPU: unit state, port, health, mode, release, unsafe override, lock, last deploy, and
    the live figures: tokens/s (SGLang's gen_throughput; with `previous` rows from `seconds` ago, the generated-token
    counter's rate instead), running and queued requests, accept length, the router's view of the worker."""
    out = []
    for g in gathered:
        h = hosts[g["host"]]
        if not g["ok"]:
            out.append({"host": g["host"], "gpu": None, "error": f"{g['kind']}: {g['error']}"})
            continue
        st = g["state"]
        man = st.get("manifest") or {}
        lock = st.get("lock")
        deploys = [j for j in st.get("journal", []) if j.get("event", "").startswith(("deploy", "rollback"))]
        last = deploys[-1] if deploys else None
        insts = list(dict.fromkeys([s.instance for s in h.services] + list(man.get("services", {}))))
        for inst in insts:
            ms = man.get("services", {}).get(inst, {})
            inv_svc = next((s for s in h.services if s.instance == inst), None)
            u = st["units"].get(inst, {})
            rec = st.get("services", {}).get(inst, {})
            code = st["health"].get(inst)
            fig = live((st.get("metrics") or {}).get(inst))
            port = ms.get("port", inv_svc.port if inv_svc else None)
            tps = fig.get("tokens_per_s")
            prev = (previous or {}).get((g["host"], inst)) or {}
            if seconds and fig.get("generation_tokens") is not None and prev.get("generation_tokens") is not None:
                tps = max(0.0, (fig["generation_tokens"] - prev["generation_tokens"]) / seconds)
            out.append({
                "host": g["host"], "gpu": ms.get("gpu", inv_svc.gpu if inv_svc else None), "instance": inst,
                # every GPU of the service (a TP group is one service over its GPUs)
                "gpus": list(ms.get("gpus") or (inv_svc.gpus if inv_svc else [ms.get("gpu")])),
                "unit": render.unit_name(inst),
                "state": f"{u.get('ActiveState', '?')}/{u.get('SubState', '?')}",
                "restarts": int(u.get("NRestarts") or 0),
                "port": ms.get("port", inv_svc.port if inv_svc else None),
                "health": "ok" if code == 200 else ("down" if code is None else str(code)),
                "mode": ms.get("mode"), "algorithm": ms.get("algorithm"),
                "release": st.get("current"), "running_release": rec.get("release"),
                "accept_length": fig.get("accept_length") if fig.get("accept_length") is not None
                else rec.get("accept_length"),
                "tokens_per_s": None if tps is None else round(tps, 2),
                "running": None if fig.get("running") is None else int(fig["running"]),
                "queued": None if fig.get("queued") is None else int(fig["queued"]),
                "generation_tokens": fig.get("generation_tokens"), "requests_total": fig.get("requests"),
                "metrics_error": fig.get("metrics_error"),
                "router": router_cell(st.get("router_view"), port),
                "unsafe": bool(man.get("unsafe", {}).get(inst)),
                "unsafe_reason": man.get("unsafe", {}).get(inst),
                "plugin": st.get("plugin_installed"),
                "lock": f"{lock.get('holder')} ({lock.get('command')}, since {lock.get('started')})" if lock else None,
                "lock_stale": lock.get("stale") if lock else None, "lock_step": lock.get("step") if lock else None,
                "enabled": bool(ms.get("enabled", True)) if ms else bool(inv_svc and inv_svc.enabled),
                "last_deploy": (f"{last.get('event')} {last.get('release')} {last.get('time')}"
                                + (" (rolled back)" if last.get("rolled_back_to") else "")) if last else None,
            })
    return out


def cell(value, style: str = ""):
    """A table cell holding a host's string as plain text: rich never reads markup in it, so `[...]` in an error
    cannot crash the table and `[green]` in a state cannot fake one."""
    from rich.text import Text
    return Text("" if value is None else str(value), style=style)


def _state(r: dict) -> tuple[str, str]:
    """A GPU row's state text (with its restarts) and colour: green only when running and healthy."""
    state = r["state"] + (f" ({r['restarts']} restarts)" if r["restarts"] else "")
    return state, "green" if r["state"].startswith("active/running") and r["health"] == "ok" else "red"


def _release(r: dict) -> str:
    rel = r["release"] or "-"
    if r["running_release"] and r["running_release"] != r["release"]:
        rel += f" (running {r['running_release']})"
    return rel


def _figures(r: dict) -> list:
    return [cell("-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.1f}"),
            cell("-" if r.get("running") is None else r["running"]),
            cell("-" if r.get("queued") is None else r["queued"]),
            cell(_accept(r.get("accept_length")))]


def _accept(v) -> str:
    """An accept length for the table: two decimals (the JSON keeps the server's figure as it is)."""
    if v is None:
        return "-"
    try:
        return f"{float(v):.2f}"
    except (TypeError, ValueError):
        return str(v)


def _router(r: dict):
    rc = r.get("router") or "-"
    return cell(rc, "green" if rc == "in/healthy" else ("" if rc == "-" else "red"))


def status_table(rs: list[dict], wide: bool = False):
    """The `fab status` table, one line per GPU, fit for a 100-column terminal: state, health, the router's view,
    tokens/s, running and queued requests, accept length, mode. The host's release, its lock, its last deploy and
    every problem are said under the table (`notes`); `wide` puts them all in columns instead. Every value from a
    host (state, error, release, lock, journal) is plain text."""
    from rich.table import Table
    if wide:
        t = Table(title="sglang-ddtree services")
        for col in ("host", "gpu", "state", "port", "health", "router", "tok/s", "run", "queue", "accept", "mode",
                    "release", "unsafe", "lock", "last deploy"):
            t.add_column(col)
        for r in rs:
            if r.get("error"):
                t.add_row(cell(r["host"]), cell("-"), cell(r["error"], "red"), *[cell("")] * 12)
                continue
            state, color = _state(r)
            t.add_row(cell(r["host"]), cell(gpu_cell(r)), cell(state, color), cell(r["port"]), cell(r["health"], color),
                      _router(r), *_figures(r), cell(r["mode"] or "-"), cell(_release(r)),
                      cell("HYBRID-UNSAFE" if r["unsafe"] else "", "bold red"), cell(r["lock"] or ""),
                      cell(r["last_deploy"] or ""))
        return t
    t = Table(title="sglang-ddtree services", box=None, pad_edge=False, title_justify="left", header_style="bold")
    for col in ("host", "gpu", "state", "health", "router", "tok/s", "run", "queue", "accept", "mode"):
        t.add_column(col, no_wrap=True, overflow="ellipsis",
                     justify="right" if col in ("gpu", "tok/s", "run", "queue", "accept") else "left")
    for r in rs:
        if r.get("error"):
            t.add_row(cell(r["host"]), cell("-"), cell(r["error"], "red"), *[cell("")] * 7)
            continue
        state, color = _state(r)
        t.add_row(cell(r["host"]), cell(gpu_cell(r)), cell(r["state"], color), cell(r["health"], color), _router(r),
                  *_figures(r), cell(r["mode"] or "-", "bold red" if r["unsafe"] else ""))  # why: in the notes
    return t


def gpu_cell(r: dict) -> str:
    """The GPU column of a service: its index, or a TP group's indices ('0-3' when consecutive, else '0,2')."""
    gpus = [g for g in r.get("gpus") or [r.get("gpu")] if g is not None]
    if len(gpus) <= 1:
        return str(r.get("gpu"))
    if gpus == list(range(gpus[0], gpus[0] + len(gpus))):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(map(str, gpus))


def notes(rs: list[dict]) -> list:
    """What the narrow table leaves out, in words under it: each host's release, lock and last deploy; each
    problem of a GPU (an unreachable host's whole error, restarts, a server still on another release, a
    HYBRID-UNSAFE override, unreadable metrics). Plain text, never markup."""
    from rich.text import Text
    out, seen = [], set()
    for r in rs:
        h = r["host"]
        if r.get("error"):
            out.append(Text.assemble((f"{h}: ", "bold red"), (r["error"], "red")))
            continue
        if h not in seen:
            seen.add(h)
            parts = [f"release {r['release'] or '-'}"]
            if r.get("last_deploy"):
                parts.append(f"last {r['last_deploy']}")
            line = Text.assemble((f"{h}: ", "bold"), "; ".join(parts))
            if r.get("lock"):
                line.append(f"; LOCKED by {r['lock']}", "yellow")
            out.append(line)
        where = f"{h} gpu{r['gpu']}" if r.get("gpu") is not None else f"{h} {r.get('instance')}"
        if r["restarts"]:
            out.append(Text(f"  {where}: restarted {r['restarts']} times by systemd", "red"))
        if r["running_release"] and r["running_release"] != r["release"]:
            out.append(Text(f"  {where}: still running release {r['running_release']}", "yellow"))
        if r["unsafe"]:
            out.append(Text(f"  {where}: HYBRID-UNSAFE ({r.get('unsafe_reason') or 'override'})", "bold red"))
        if r.get("metrics_error"):
            out.append(Text(f"  {where}: metrics unreadable: {r['metrics_error']}", "yellow"))
    return out


def routers(gathered: list[dict], hosts: dict[str, Host] | None = None) -> list[dict]:
    """One row per host with a router: its endpoint, whether it answers, how many workers it holds and how many of
    them are healthy, and (with the inventory's `hosts`) those it holds that the inventory does not name."""
    out = []
    for g in gathered:
        view = (g.get("state") or {}).get("router_view") if g["ok"] else None
        if view is None:
            continue
        ws = view.get("workers")
        h = (hosts or {}).get(g["host"])
        named = {routermod.worker_url(s.port) for s in h.services if s.enabled} if h else None
        out.append({"host": g["host"], "endpoint": f"{view.get('listen')}:{view.get('port')}",
                    "alive": view.get("alive"), "detail": view.get("detail"), "error": view.get("error"),
                    "workers": None if ws is None else len(ws),
                    "healthy": None if ws is None else sum(1 for w in ws.values() if w["healthy"]),
                    "stray": None if ws is None or named is None else sorted(u for u in ws if u not in named)})
    return out


def problems(rs: list[dict], router_rows: list[dict]) -> list[str]:
    """Why `fab status` exits 1, one line each: an unreachable host, a GPU service not healthy, an enabled one out
    of its router (or unhealthy in it), a router down or holding workers the inventory does not name, a lock whose
    run is dead (stale: its agent process is gone or it expired)."""
    out, locks = [], {}
    for r in rs:
        if r.get("error"):
            out.append(f"{r['host']}: {r['error']}")
            continue
        name = f"{r['host']}:{r['instance']}"
        if r["health"] != "ok":
            out.append(f"{name} not healthy (/health {r['health']})")
        rc = r.get("router") or "-"
        if r.get("enabled", True) and rc not in ("-", "in/healthy"):
            out.append(f"{name} {'out of the router' if rc == 'OUT' else 'router: ' + rc}")
        if r.get("lock_stale"):
            locks[r["host"]] = (f"{r['host']}: the lock of a dead run: {r['lock']} ({r['lock_stale']}"
                                + (f"; stopped at step {r['lock_step']!r}" if r.get("lock_step") else "")
                                + "): the next deploy, restart or rollback finishes it")
    out += locks.values()
    for rr in router_rows:
        if rr.get("stray"):
            out.append(f"{rr['host']}: the router holds worker(s) the inventory does not name: "
                       f"{', '.join(rr['stray'])}")
        if rr.get("alive") and rr.get("error"):
            out.append(f"{rr['host']}: router: {rr['error']}")
    return out


def router_table(rs: list[dict]):
    from rich.table import Table
    t = Table(title="sglang-router (each host's endpoint)")
    for col in ("host", "endpoint", "state", "workers", "healthy"):
        t.add_column(col)
    for r in rs:
        state = "up" if r["alive"] else f"DOWN ({r['detail']})"
        t.add_row(cell(r["host"]), cell(r["endpoint"]), cell(state + (f"; {r['error']}" if r.get("error") else ""),
                                                            "green" if r["alive"] and not r.get("error") else "red"),
                  cell("-" if r["workers"] is None else r["workers"]), cell("-" if r["healthy"] is None else r["healthy"]))
    return t


def print_table(rs: list[dict], console=None, router_rows: list[dict] | None = None, wide: bool = False) -> None:
    """The GPU table, the notes under it (narrow view) and the router table. The narrow view fits the terminal
    (COLUMNS where the output is not one); --wide prints every column at the width it needs."""
    from ..report import terminal_console, wide_console
    table = status_table(rs, wide=wide)
    console = console or (wide_console(table) if wide else terminal_console())
    console.print(table)
    if not wide:
        for line in notes(rs):
            console.print(line)
    if router_rows:
        console.print(router_table(router_rows))


def logs(inv: Inventory, hosts: list[Host], gpus: list[int] | None, n: int, since: str | None,
         router: bool = False) -> list:
    def one(conn, host):
        insts = [s.instance for s in host.services if gpus is None or any(g in gpus for g in s.gpus)]
        return Remote(conn, host.name).call("release.logs", host_args(host) | {"instances": insts, "n": n,
                                                                                "since": since, "router": router},
                                            deadline=DEADLINE)
    return run_per_host(inv, hosts, one, label="logs")


def journal_line(host: str, j: dict) -> str:
    """One audit-journal entry as a line: time, event, release, who, what was restarted, error."""
    parts = [j.get("time", "?"), host, j.get("event", "?")]
    if j.get("release"):
        parts.append(f"{j.get('previous') or '-'} -> {j['release']}" if "previous" in j else j["release"])
    if j.get("by"):
        parts.append(f"by {j['by']}")
    if j.get("restarted"):
        parts.append("restarted " + ",".join(j["restarted"]))
    if j.get("unsafe"):
        parts.append("HYBRID-UNSAFE " + ",".join(j["unsafe"]))
    if j.get("rolled_back_to"):
        parts.append(f"rolled back to {j['rolled_back_to']}")
    if j.get("error"):
        parts.append(f"error: {j['error']}")
    return "  ".join(parts)
