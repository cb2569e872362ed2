"""`provision` and `undo`: the per-host run around the pure plan, on the agent runtime (deploy/remote).

Calls (each one agent call over the host's SSH connection, or an OpenSSH stream for wheel bytes):
  all hosts, in parallel   facts.probe as root (1), with the private staging listing on targets
  reference, once          provision.scan of the distributions to ship (1, read-only, no lock; with the smoke
                           import of their modules, no CUDA, no bytecode written: part of the plan), a RECORD
                           rebuild when no original wheel exists (1, under the host lock), OpenSSH downloads
                           into the control cache (each wheel checked before it is cached)
  each target, in parallel lock.acquire (1), OpenSSH uploads into the private staging directory (resumable,
                           sha256 on arrival), provision.apply (1: wheels and venv checked again, backup, pip
                           offline from the private copies, smoke import judged against the reference's,
                           restore on failure), facts.probe
                           (1: converged?), lock.release (1)
Commands that change a target (pip install/uninstall, the smoke import) are built by deploy/remote/commands.py
and shown before the question.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from rich.console import Console
from rich.text import Text

from .. import facts as factsmod
from ..inventory import Host, Inventory
from ..remote import commands
from ..remote.client import ROOT_STATE, AgentError, Remote
from ..remote.client import lock_holder as holder
from ..ssh import open_checked, run_per_host
from . import transfer
from .cache import CacheError, WheelCache
from .plan import Plan, human, make_plan, render

LOCK_TTL = 180.0   # a provision that stops calling (its control machine died) frees the host after this


class ProvisionError(RuntimeError):
    pass


# ---------------------------------------------------------------- commands: built pure, run by the agent

def venv_python(host: Host) -> str:
    return commands.venv_python(host.venv)


def staged_path(state: str, sha256: str, filename: str) -> str:
    return f"{state}/provision/incoming/{sha256}/{filename}"


def apply_payload(host: Host, plan: Plan, pid: str, state: str = ROOT_STATE) -> dict:
    """The pure description of one host's change: staged wheels, the command prefixes, what to remove."""
    py = venv_python(host)
    install = [{"name": i.name, "version": i.reference, "sha256": plan.sources[i.name]["sha256"],
                "filename": plan.sources[i.name]["filename"]} for i in plan.installs]
    return {"id": pid, "venv": host.venv, "install": install, "remove": [i.name for i in plan.removals],
            "commands": {"pip_install": commands.pip_install(py), "pip_uninstall": commands.pip_uninstall(py),
                         "smoke": commands.smoke(py)},
            "allow_pth": {i.name: plan.sources[i.name].get("pth") or [] for i in plan.installs},
            "cuda_init": True, "smoke": True, "reference_smoke": dict(plan.reference_smoke)}


def planned_commands(host: Host, plan: Plan, state: str = ROOT_STATE) -> list[list[str]]:
    """The commands the agent will run on `host` for `plan`, as they will run (the confirmation shows them)."""
    py = venv_python(host)
    out = []
    if plan.installs:
        out.append(commands.pip_install(py, [staged_path(state, plan.sources[i.name].get("sha256") or "<rebuilt>",
                                                         plan.sources[i.name].get("filename") or f"{i.name}.whl")
                                             for i in plan.installs]))
    if plan.removals:
        out.append(commands.pip_uninstall(py, [i.name for i in plan.removals]))
    if plan.installs:
        out.append(commands.smoke(py) + ["<modules of the installed distributions>", "cuda|nocuda"])
    return out


# ---------------------------------------------------------------- report

@dataclass
class HostReport:
    host: str
    status: str                 # in-sync | planned | provisioned | blocked | failed | unreachable | undone
    ok: bool
    plan: Plan | None = None
    error: str | None = None
    sent_bytes: int = 0
    seconds: float = 0.0
    details: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)   # from the apply: modules failing on the reference too

    def to_json(self) -> dict:
        return {"host": self.host, "status": self.status, "ok": self.ok, "error": self.error,
                "warnings": self.warnings,
                "sent_bytes": self.sent_bytes, "seconds": round(self.seconds, 2),
                "plan": self.plan.to_json() if self.plan else None, "details": self.details}


@dataclass
class Report:
    hosts: list[HostReport]
    fetched_bytes: int = 0
    events: list[str] = field(default_factory=list)
    seconds: float = 0.0
    phases: dict = field(default_factory=dict)   # seconds per phase: facts, scan, build, fetch, hosts

    @property
    def ok(self) -> bool:
        return all(h.ok for h in self.hosts)

    @property
    def sent_bytes(self) -> int:
        return sum(h.sent_bytes for h in self.hosts)

    def to_json(self) -> dict:
        return {"ok": self.ok, "fetched_bytes": self.fetched_bytes, "sent_bytes": self.sent_bytes,
                "seconds": round(self.seconds, 2), "events": self.events,
                "phases": {k: round(v, 2) for k, v in self.phases.items()},
                "hosts": [h.to_json() for h in self.hosts]}


@dataclass
class Options:
    dry_run: bool = False
    yes: bool = False
    parallel: int | None = None
    cache: WheelCache | None = None
    console: Console | None = None
    confirm: Callable[[str], bool] | None = None      # None: ask on a terminal, refuse without one
    progress: bool | None = None                      # None: when stderr is a terminal
    hooks: dict = field(default_factory=dict)         # test hooks: 'put_progress'(host, ssh Popen, nbytes)
    quiet: bool = False
    state_dir: str = ROOT_STATE                       # the agent's private state: staging, backups, the lock
    command: str = "fab provision"


# ---------------------------------------------------------------- progress

class _Progress:
    """rich progress bars on stderr for transfers (a line per wheel when stderr is no terminal)."""

    def __init__(self, enabled: bool, console: Console):
        self.enabled = enabled
        self.console = console
        self.bar = None
        self._lock = threading.Lock()
        if enabled:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)
            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True),
                                transient=False)
            self.bar.start()

    def task(self, label: str, total: int):
        if self.bar:
            tid = self.bar.add_task(label, total=total)
            return lambda n: self.bar.advance(tid, n)
        return None

    def note(self, msg: str):
        if not self.enabled:
            with self._lock:
                self.console.print(msg, highlight=False, markup=False)  # holds host strings: never markup

    def stop(self):
        if self.bar:
            self.bar.stop()


# ---------------------------------------------------------------- provision

def _new_id(host: str) -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{host}-{os.getpid()}"


def ref_accept(inv: Inventory) -> list[str]:
    """The reference's `accept_unmet` patterns: its unmet requirements provision does not block on."""
    return list(inv.reference.vars.get("accept_unmet") or ())


def provision(inv: Inventory, names: str | list[str] | None, opts: Options | None = None) -> Report:
    opts = opts or Options()
    console = opts.console or Console()
    cache = opts.cache or WheelCache()
    t_start = time.time()
    ref = inv.reference
    targets = [h for h in inv.select(names) if h.name != ref.name]
    reports: dict[str, HostReport] = {}
    for h in inv.select(names):
        if h.name == ref.name:
            console.print(Text(f"{h.name} is the reference host; skipped", style="dim"))
    if not targets:
        return Report([], seconds=time.time() - t_start)

    # 1. facts of the reference and every target (targets with their staging listing), in parallel, read-only
    def gather_any(conn, host):
        return factsmod.gather(conn, host, root=True, staged=host.name != ref.name, state_dir=opts.state_dir,
                               previous=factsmod.previous_facts(inv.path, host))

    phases: dict[str, float] = {}
    t = time.time()
    results = run_per_host(inv, [ref] + targets, gather_any, opts.parallel, label="facts")
    phases["facts"] = time.time() - t
    ref_res, tgt_res = results[0], results[1:]
    if not ref_res.ok:
        return Report([HostReport(r.host, "failed", False, error=f"reference {ref.name} unavailable: "
                                  f"{ref_res.kind}: {ref_res.error}") for r in tgt_res], seconds=time.time() - t_start)
    ref_facts = ref_res.value
    factsmod.save_facts(inv.path, ref_facts)
    gathered: dict[str, dict] = {}
    for r in tgt_res:
        if r.ok:
            gathered[r.host] = r.value
            factsmod.save_facts(inv.path, r.value)
        else:
            reports[r.host] = HostReport(r.host, "unreachable" if r.kind == "unreachable" else "failed", False,
                                         error=f"{r.kind}: {r.error}", seconds=r.seconds)

    # 2. classify; scan the reference for what any target needs (one read-only call)
    pre = {n: make_plan(ref_facts, g, inv.hosts[n].vars["managed"], accept_unmet=ref_accept(inv))
           for n, g in gathered.items()}
    # a host already blocked (an incoherent reference blocks them all) needs nothing from the reference: no scan
    needed = sorted({(i.name, i.reference) for p in pre.values() if not p.blocked for i in p.installs})
    scan: dict = {}
    ref_conn = None
    try:
        if needed:
            t = time.time()
            ref_conn = open_checked(inv, ref)
            scan = Remote(ref_conn, ref.name, opts.state_dir).call(
                "provision.scan", {"venv": ref.venv, "dists": [{"name": n, "version": v} for n, v in needed],
                                   "wheelhouse": ref.vars.get("wheelhouse") or [],
                                   "commands": {"smoke": commands.smoke(venv_python(ref))}},
                deadline=1800, silence=45)["dists"]
            phases["scan"] = time.time() - t
        plans = {n: make_plan(ref_facts, g, inv.hosts[n].vars["managed"], scan, g.get("stage"),
                              accept_unmet=ref_accept(inv))
                 for n, g in gathered.items()}
        for name in [h.name for h in targets if h.name in plans]:
            if not opts.quiet:
                render(plans[name], console)
        for name, p in plans.items():
            if p.blocked:
                reports[name] = HostReport(name, "blocked", False, plan=p,
                                           error="; ".join(f"{b.code}: {b.message}" for b in p.blockers))
            elif p.empty:
                reports[name] = HostReport(name, "in-sync", True, plan=p)
            elif opts.dry_run:
                reports[name] = HostReport(name, "planned", True, plan=p)
        todo = [h for h in targets if h.name in plans and h.name not in reports]
        if not todo:
            return _finish(targets, reports, 0, cache, t_start, phases)
        if not _confirmed(opts, console, todo, plans):
            for h in todo:
                reports[h.name] = HostReport(h.name, "not-confirmed", False, plan=plans[h.name],
                                             error="not confirmed (no terminal to ask on: pass --yes)")
            return _finish(targets, reports, 0, cache, t_start, phases)

        # 3. wheels: rebuild where no original exists, then fetch into the control cache
        prog = _Progress(opts.progress if opts.progress is not None else sys.stderr.isatty(), console)
        try:
            if ref_conn is None:
                ref_conn = open_checked(inv, ref)
            t = time.time()
            fetched = _ensure_cached(inv, ref_conn, ref, scan, todo, plans, cache, prog, phases, opts)
            phases["wheels"] = time.time() - t
        finally:
            prog.stop()
    finally:
        if ref_conn is not None:
            ref_conn.close()

    # 4. each target in parallel: lock, upload, apply, verify convergence, unlock
    prog = _Progress(opts.progress if opts.progress is not None else sys.stderr.isatty(), console)
    t = time.time()
    try:
        res = run_per_host(inv, todo, lambda conn, host: _apply_host(conn, host, plans[host.name], ref_facts,
                                                                     cache, prog, opts, inv),
                           opts.parallel, label="")
    finally:
        prog.stop()
    phases["hosts"] = time.time() - t
    for r in res:
        if r.ok:
            reports[r.host] = r.value
            reports[r.host].seconds = r.seconds
        else:
            reports[r.host] = HostReport(r.host, "unreachable" if r.kind == "unreachable" else "failed", False,
                                         plan=plans.get(r.host), error=f"{r.kind}: {r.error}", seconds=r.seconds)
    return _finish(targets, reports, fetched, cache, t_start, phases)


def _finish(targets, reports, fetched, cache, t_start, phases=None) -> Report:
    return Report([reports[h.name] for h in targets if h.name in reports], fetched_bytes=fetched,
                  events=list(cache.events), seconds=time.time() - t_start, phases=phases or {})


def _confirmed(opts: Options, console: Console, todo: list[Host], plans: dict[str, Plan]) -> bool:
    """Show the commands each host will run, then ask. Ctrl-C or end of input at the question is a no: nothing
    was locked or changed yet, so nothing is left behind."""
    if opts.yes:
        return True
    if not opts.quiet:
        for h in todo:
            console.print(Text.assemble((h.name, "bold"), " will run (as root, under the host lock):"),
                          highlight=False)
            for argv in planned_commands(h, plans[h.name], opts.state_dir):
                console.print("  " + commands.shown(argv), highlight=False, markup=False)
    question = (f"apply {sum(len(plans[h.name].changes) for h in todo)} change(s) on "
                f"{', '.join(h.name for h in todo)}?")
    try:
        if opts.confirm is not None:
            return opts.confirm(question)
        if not sys.stdin.isatty():
            console.print("[yellow]no terminal to confirm on: nothing changed (pass --yes to apply)[/]")
            return False
        from ..prompt import ask_yes_no
        return ask_yes_no(question)
    except (KeyboardInterrupt, EOFError):  # raised by a caller-supplied confirm
        console.print("\n[yellow]not confirmed: nothing changed, no host locked[/]")
        return False


def _ensure_cached(inv: Inventory, ref_conn, ref: Host, scan: dict, todo: list[Host], plans: dict[str, Plan],
                   cache: WheelCache, prog: _Progress, phases: dict, opts: Options) -> int:
    """Every wheel some target still needs, verified in the control cache. Returns bytes fetched."""
    need = sorted({i.name for h in todo for i in plans[h.name].installs})
    remote = Remote(ref_conn, ref.name, opts.state_dir)
    rebuild = [n for n in need if not (scan[n].get("source") or {}).get("sha256")]
    if rebuild:
        t0 = time.time()
        lock = dict(holder(opts.command + " (rebuild)"), mode="once")
        built = remote.call("provision.build", {"venv": ref.venv, "dists": [{"name": n} for n in rebuild]},
                            deadline=3600, lock=lock, silence=45)["dists"]
        for n in rebuild:
            b = built[n]
            if b.get("error"):
                raise ProvisionError(f"rebuilding {n} on {ref.name}: {b['error']}")
            scan[n]["source"] = {"kind": "rebuilt", "path": b["path"], "sha256": b["sha256"], "size": b["size"],
                                 "filename": b["filename"]}
        phases["build"] = time.time() - t0
        prog.note(f"rebuilt {len(rebuild)} wheel(s) on {ref.name} from RECORD in {phases['build']:.1f}s")
    for h in todo:  # the sources now known: fill the plans (and whether the target has them already)
        p = plans[h.name]
        for i in p.installs:
            src = scan[i.name]["source"]
            staged = src["sha256"] in p.staged_shas
            p.sources[i.name] = dict(p.sources.get(i.name, {}), **{k: v for k, v in src.items() if k != "path"},
                                     staged=bool(staged), pth=scan[i.name].get("pth") or [])
    fetched = 0
    wanted = sorted({i.name for h in todo for i in plans[h.name].installs
                     if not plans[h.name].sources[i.name]["staged"]})
    t_fetch = 0.0
    for attempt in (1, 2):
        missing = [n for n in wanted if cache.get(scan[n]["source"]["sha256"]) is None]
        if not missing:
            break
        items = []
        for n in missing:
            src = scan[n]["source"]
            try:
                items.append((src["path"], cache.part_path(src["sha256"], src["filename"]), src["size"]))
            except CacheError as exc:
                raise ProvisionError(f"{n} from {ref.name}: {exc}") from None
        t0 = time.time()
        cb = prog.task(f"{ref.name} -> cache  {len(items)} wheel(s)", sum(size for _p, _pt, size in items))
        st = transfer.fetch(remote, inv, ref, items, cb)
        t_fetch += time.time() - t0
        fetched += st.bytes
        prog.note(f"fetched {len(items)} wheel(s) from {ref.name}: {human(st.bytes)} in {st.seconds:.1f}s"
                  + (f" ({human(st.rate)}/s)" if st.seconds else "")
                  + (f" (resumed at {human(st.resumed_from)})" if st.resumed_from else ""))
        t0 = time.time()
        for n in missing:
            src = scan[n]["source"]
            try:
                cache.commit(src["sha256"], src["filename"], scan[n].get("pth") or [])
            except CacheError as exc:
                cache.events.append(str(exc))
                if attempt == 2:
                    raise ProvisionError(f"{n}: {exc}") from None
        phases["cache_check"] = phases.get("cache_check", 0.0) + time.time() - t0
    phases["fetch"] = t_fetch
    return fetched


def _apply_host(conn, host: Host, plan: Plan, ref_facts: dict, cache: WheelCache, prog: _Progress,
                opts: Options, inv: Inventory) -> HostReport:
    rep = HostReport(host.name, "failed", False, plan=plan)
    remote = Remote(conn, host.name, opts.state_dir)
    lock = dict(holder(opts.command), ttl=LOCK_TTL)
    try:
        remote.call("lock.acquire", lock, deadline=30)
    except AgentError as exc:
        if exc.kind == "locked":
            h = exc.reply.get("holder") or {}
            rep.error = (f"locked by {h.get('holder')} running {h.get('command')!r} since {h.get('started')}; "
                         f"nothing changed")
            return rep
        raise
    held = {"token": lock["token"], "mode": "held"}
    try:
        return _apply_locked(remote, host, plan, ref_facts, cache, prog, opts, inv, rep, held)
    finally:
        try:
            remote.call("lock.release", {"token": lock["token"]}, deadline=30)
        except AgentError as exc:  # the lock then expires by itself (LOCK_TTL)
            rep.details["unlock_error"] = str(exc)


def _apply_locked(remote, host, plan, ref_facts, cache, prog, opts, inv, rep, held) -> HostReport:
    parts = ((plan.stage or {}).get("parts") or {})
    uploads = [(i.name, plan.sources[i.name]) for i in plan.installs if not plan.sources[i.name].get("staged")]
    t_put = time.time()
    for attempt in (1, 2):
        if not uploads:
            break
        items = []
        for _name, src in uploads:
            local = cache.get(src["sha256"])
            if local is None:
                raise ProvisionError(f"{src['filename']} vanished from the control cache")
            p = parts.get(src["sha256"]) or {}
            offset = p["size"] if attempt == 1 and p.get("filename") == src["filename"] and p["size"] < src["size"] \
                else 0
            items.append({"local": str(local), "sha256": src["sha256"], "filename": src["filename"],
                          "size": src["size"], "offset": offset})
            if offset:
                rep.details.setdefault("resumed", {})[src["filename"]] = offset
        cb = prog.task(f"cache -> {host.name}  {len(items)} wheel(s)", sum(i["size"] for i in items))
        hook = opts.hooks.get("put_progress")
        started = None
        if hook:
            procs: list = []
            started = procs.append
            inner = cb
            # the newest stream: a stream sshd cut in its handshake is made again (transfer.send)
            cb = (lambda n, _i=inner, _p=procs: (_i and _i(n), hook(host, _p[-1] if _p else None, n)))
        res, st = transfer.send(remote, inv, host, items, held, cb, started)
        rep.sent_bytes += st.bytes
        prog.note(f"{host.name}: sent {len(items)} wheel(s) {human(st.bytes)} in {st.seconds:.1f}s"
                  + (f" ({human(st.rate)}/s)" if st.seconds else ""))
        bad = [(n, s) for n, s in uploads if (res.get(s["sha256"]) or {}).get("status") != "ok"]
        if not bad:
            break
        rep.details.setdefault("rejected_on_arrival", []).extend(
            f"{s['filename']} ({(res.get(s['sha256']) or {}).get('status', 'not sent')})" for _n, s in bad)
        if attempt == 2:
            raise ProvisionError("sha256 check on arrival failed twice for " + ", ".join(s["filename"] for _n, s in bad))
        uploads = bad  # sent again from the start
    rep.details["put_seconds"] = round(time.time() - t_put, 2)
    payload = apply_payload(host, plan, _new_id(host.name), opts.state_dir)
    t = time.time()
    out = remote.call("provision.apply", payload, deadline=3600, lock=held, silence=45)
    rep.details["apply_seconds"] = round(time.time() - t, 2)
    rep.details["backup"] = out.get("backup")
    rep.details["steps"] = [{k: s.get(k) for k in ("step", "rc", "seconds")} for s in out.get("steps", [])]
    if not out.get("ok"):
        failed = [s for s in out.get("steps", []) if s.get("rc")]
        tail = (failed[0].get("output") or "").strip().splitlines()[-6:] if failed else []
        rep.error = (out.get("error") or "apply failed") + ("; " + " | ".join(tail) if tail else "")
        if out.get("backup"):
            rep.error += ("; environment restored from the backup" if out.get("restored")
                          else f"; RESTORE INCOMPLETE: {out.get('restore_error')}")
        rep.details["restored"] = out.get("restored")
        return rep
    rep.details["smoke_modules"] = out.get("smoke_modules")
    rep.warnings = [str(w) for w in out.get("warnings") or []]
    # verify convergence from fresh facts
    t = time.time()
    after = factsmod.gather(remote.conn, host, root=True, state_dir=opts.state_dir,
                            previous=factsmod.previous_facts(inv.path, host))
    factsmod.save_facts(inv.path, after)
    rep.details["verify_seconds"] = round(time.time() - t, 2)
    again = make_plan(ref_facts, after, host.vars["managed"], accept_unmet=ref_accept(inv))
    if not again.empty:
        rep.error = "did not converge: " + ", ".join(f"{i.name} {i.status}" for i in again.changes)
        return rep
    rep.status, rep.ok = "provisioned", True
    return rep


# ---------------------------------------------------------------- undo

def undo(inv: Inventory, names: str | list[str] | None, opts: Options | None = None,
         backup_id: str | None = None) -> Report:
    """Restore each host's latest applied provision from its backup wheels."""
    opts = opts or Options()
    t0 = time.time()
    targets = [h for h in inv.select(names) if h.name != inv.reference.name]

    def one(conn, host):
        py = venv_python(host)
        out = Remote(conn, host.name, opts.state_dir).call(
            "provision.undo", {"venv": host.venv, "id": backup_id,
                               "commands": {"pip_install": commands.pip_install(py),
                                            "pip_uninstall": commands.pip_uninstall(py), "smoke": commands.smoke(py)}},
            deadline=3600, lock=dict(holder(opts.command + " --undo"), mode="once"), silence=45)
        f = factsmod.gather(conn, host, root=True, state_dir=opts.state_dir,
                            previous=factsmod.previous_facts(inv.path, host))
        factsmod.save_facts(inv.path, f)
        rep = HostReport(host.name, "undone" if out.get("ok") else "failed", bool(out.get("ok")),
                         error=out.get("error"))
        rep.details = {"id": out.get("id"), "restored": out.get("before"),
                       "steps": [{k: s.get(k) for k in ("step", "rc", "seconds")} for s in out.get("steps", [])]}
        return rep

    res = run_per_host(inv, targets, one, opts.parallel)
    for r in res:
        if r.ok:
            r.value.seconds = r.seconds
    reps = [r.value if r.ok else HostReport(r.host, "unreachable" if r.kind == "unreachable" else "failed", False,
                                            error=f"{r.kind}: {r.error}") for r in res]
    return Report(reps, seconds=time.time() - t0)


# ---------------------------------------------------------------- summary

def render_summary(report: Report, console: Console) -> None:
    from rich.table import Table
    t = Table(title="provision summary", title_justify="left")
    for c in ("host", "result", "changes", "sent", "seconds", "error"):
        t.add_column(c)
    for h in report.hosts:
        style = "green" if h.ok else "bold red"
        n = len(h.plan.changes) if h.plan else 0
        if h.status == "undone" and h.details.get("restored"):
            n = len(h.details["restored"])
        # a host's error (and anything else from it) is plain Text: `[...]` in it is shown, never read as markup
        t.add_row(Text(h.host), Text(str(h.status), style=style), str(n), human(h.sent_bytes), f"{h.seconds:.1f}",
                  Text(h.error or ""))
    console.print(t)
    for h in report.hosts:
        for w in h.warnings:
            console.print(Text.assemble((h.host, "bold"), " ", ("warning", "yellow"), f" {w}"))
    for e in report.events:
        console.print(Text(str(e), style="yellow"))
    console.print(f"fetched from reference {human(report.fetched_bytes)}, sent to targets {human(report.sent_bytes)}, "
                  f"{report.seconds:.1f}s")
