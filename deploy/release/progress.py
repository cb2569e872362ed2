"""A run's lines for people: `[host] message`, one at a time from every host thread, and the lines the agent's
events turn into (each gate, drain, activation, router restart and rollback as it happens)."""
from __future__ import annotations

import threading


class Printer:
    """Line-at-a-time output shared by host threads: `[host] message`."""

    def __init__(self, quiet: bool = False):
        self.lock = threading.Lock()
        self.quiet = quiet
        self.lines: list[str] = []

    def __call__(self, host: str, msg: str) -> None:
        line = f"[{host}] {msg}"
        with self.lock:
            self.lines.append(line)
            if not self.quiet:
                print(line, flush=True)


def canary_text(c: dict | None) -> str:
    """What a passed canary showed, for the gate's line."""
    if not isinstance(c, dict):
        return ""
    return (f", canary {c.get('tokens')} tokens"
            + (f" within {c['max_gap']} nats of the argmax" if c.get("max_gap") is not None else "")
            + (f", floor {c['accept_floor']}" if c.get("accept_floor") is not None else ""))


def gate_line(inst: str, port: int, g: dict) -> str:
    if g.get("ok"):
        steps = g.get("steps", {})
        al = g.get("accept_length")
        return (f"{inst} :{port} gate ok in {g.get('seconds', 0):.1f}s (ready {steps.get('ready', 0):.1f}s, "
                f"{g.get('algorithm')}" + (f", accept length {al}" if al is not None else "")
                + canary_text(g.get("canary")) + ")")
    out = f"{inst} :{port} gate FAILED at {g.get('step')}: {g.get('detail')}"
    tail = [ln for ln in g.get("journal", []) if ln.strip()][-3:]
    return out + "".join(f"\n      | {ln}" for ln in tail)


def drain_line(ev: dict, what: str | None = None, then: str = "restarting") -> str:
    """One drain's line: a GPU's (or `what`: a worker the release does not name) out of the router and its wait;
    an unknown reading (a server that does not answer /metrics) waits to the deadline and says so."""
    inst, first, n = what or ev["instance"], ev.get("in_flight_at_start"), ev.get("in_flight")
    where = "out of the router" if ev.get("removed") else "not in the router"
    if ev.get("previous_url"):
        where += (f" (and its old worker {ev['previous_url']}" if ev.get("previous_removed") else
                  f" (its old worker {ev['previous_url']} was not listed") + ")"
    if ev.get("timed_out") and n is None:
        return (f"{inst} {where}; DRAIN DEADLINE passed after {ev.get('seconds', 0):.1f}s with its in-flight requests "
                f"unknown ({ev.get('detail')}): {then} anyway (any it holds are cut)")
    if ev.get("timed_out"):
        return (f"{inst} {where}; DRAIN DEADLINE passed after {ev.get('seconds', 0):.1f}s with {n} request(s) still "
                f"in flight: {then} anyway (they are cut)")
    return f"{inst} {where}; drained {first or 0} in-flight request(s) in {ev.get('seconds', 0):.1f}s"


def event_printer(host: str, out: Printer, kind: str):
    """Turn the agent's events into the run's lines."""
    def on_event(ev: dict) -> None:
        e = ev.get("event")
        if e == "activated" and kind == "deploy" and ev.get("bundle"):
            out(host, f"release {ev['release']} staged and active ({ev['bundle'] // 1024} KiB, "
                      f"{(ev.get('stage_seconds') or 0) + ev.get('seconds', 0):.1f}s)")
        elif e == "activated":
            out(host, f"release {ev['release']} active ({ev.get('seconds', 0):.1f}s)")
        elif e == "stopped":
            out(host, f"stopped {', '.join(ev['instances'])} (removed or disabled)")
        elif e == "gate":
            out(host, gate_line(ev["instance"], ev["port"], ev["gate"]))
            g = ev["gate"]
            if g.get("ok") and g.get("router"):
                out(host, f"{ev['instance']} back in the router (warm-up {g.get('warmup', {}).get('seconds', 0):.2f}s, "
                          f"healthy in {g['router'].get('seconds', 0):.1f}s)")
        elif e == "drain":
            out(host, drain_line(ev))
        elif e == "stray":
            out(host, drain_line(ev, f"router worker {ev.get('url')} is not in the inventory:", "removed"))
        elif e == "note" and ev.get("message") == "prune-failed":
            out(host, f"WARNING could not read the router's workers to remove those the inventory does not name "
                      f"({ev.get('detail')})")
        elif e == "interrupted":
            out(host, f"took over the lock of an interrupted run ({ev.get('holder')}, {ev.get('command')!r}, since "
                      f"{ev.get('started')}; stopped at step {ev.get('step')!r}; out of the router: "
                      f"{', '.join(ev.get('out') or []) or 'none'}): journaled as interrupted")
        elif e == "note" and ev.get("message") == "drain-failed":
            out(host, f"WARNING could not drain before stopping ({ev.get('detail')}): stopping anyway")
        elif e == "router" and ev.get("phase") == "restarted":
            out(host, f"sglang-router (re)started in {ev.get('seconds', 0):.1f}s")
        elif e == "note" and ev.get("message") == "nothing-restarted":
            out(host, "all services up to date; nothing restarted" if kind != "rollback"
                else "no service differs between the releases; nothing restarted")
        elif e == "rollback" and ev.get("phase") == "start":
            out(host, f"rolling back to {ev['release']}")
        elif e == "rollback" and ev.get("phase") == "done":
            out(host, f"rollback to {ev['release']} {'ok' if ev.get('ok') else 'FAILED'} in {ev['seconds']:.1f}s")
        elif e == "rollback" and ev.get("phase") == "none":
            out(host, f"no previous release to roll back to: stopped {', '.join(ev.get('instances') or [])}")
    return on_event

