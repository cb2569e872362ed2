"""The calls a rollout makes to a host's agent: the read-only `release.probe` (and the plan made from it), the one
transactional `release.apply` per host with its events printed as they come, and -- after a lost link -- the
outcome the agent journaled (`release.outcome`): the agent finishes or rolls back on its own."""
from __future__ import annotations

import time

from .. import contract
from .. import facts as factsmod
from ..inventory import Host, Inventory
from ..remote.client import AgentError, LinkLost, Remote
from ..ssh import open_checked
from . import build, hostfit
from .layout import host_args
from .payload import apply_deadline
from .plan import DeployOptions, HostPlan, make_plan
from .progress import Printer, event_printer

PROBE_DEADLINE = 120.0
SILENCE = 45.0          # heartbeats come every 10 s: this long without a word means the link is gone


class HostLocked(RuntimeError):
    def __init__(self, h: dict):
        age = time.time() - float(h.get("started_ts") or time.time())
        super().__init__(f"locked by {h.get('holder')} running {h.get('command')!r} since {h.get('started')} "
                         f"({age / 60:.1f} min ago, pid {h.get('pid')}); wait, or `--break-lock` if that run is dead")


def probe(remote: Remote, host: Host, **extra) -> dict:
    """The host's release state, read-only; it also checks the secrets env file and the API-key files (the
    inventory's and those of the manifests it reads) as the unit's start check will."""
    keyfile = host.vars.get("api_key_file")
    return remote.call("release.probe", host_args(host) | {"api_key_files": [keyfile] if keyfile else []} | extra,
                       deadline=PROBE_DEADLINE)


def check_lock(host: Host, state: dict, break_lock: bool) -> None:
    """A plan refuses a host another live run holds (the apply would refuse it anyway)."""
    lk = state.get("lock")
    if lk and not break_lock and not lk.get("stale"):
        raise HostLocked(lk)


def run_host(inv: Inventory, remote: Remote, host: Host, payload: dict, lock: dict, out: Printer, kind: str,
             data: bytes = b"") -> dict:
    """One release.apply call: the transaction runs on the host; its events print as they come. A lost link is
    followed by reading the outcome from the host's journal once it answers again."""
    last: list[str] = []

    def tee(name: str, msg: str) -> None:  # the host's last line: what its agent last reported
        last[:] = [msg]
        out(name, msg)
    on_event = event_printer(host.name, tee, kind)
    try:
        return remote.call("release.apply", payload, deadline=apply_deadline(host, payload), lock=lock, data=data,
                           on_event=on_event, silence=SILENCE)
    except AgentError as exc:
        if exc.kind == "locked":
            raise HostLocked(exc.reply.get("holder") or {}) from None
        if exc.kind == "no-reply":  # the agent process died (killed) while the link stayed up
            how = exc.message.removeprefix("the agent gave no answer ")
            raise AgentError("agent-died", f"the host's agent died during {kind} without an answer {how}; its last "
                                           f"report: {last[0] if last else 'none (it died before its first step)'}. "
                                           f"The host may be left mid-{kind}: `fab status` shows what is out; the "
                                           f"next deploy, restart or rollback of it finishes it first") from None
        if not isinstance(exc, LinkLost):
            raise
        out(host.name, f"LINK LOST during {kind}: {exc.message}; the host's agent finishes or rolls back on its own")
        return outcome_after_loss(inv, host, lock["token"], exc.message)


def outcome_after_loss(inv: Inventory, host: Host, token: str, why: str, wait: float = 120.0) -> dict:
    """Reconnect and read what the host did with the run `token` (its journal entry), for up to `wait` s."""
    end = time.monotonic() + wait
    last = why
    while time.monotonic() < end:
        conn = None
        try:
            conn = open_checked(inv, host)
            r = Remote(conn, host.name).call("release.outcome", host_args(host) | {"token": token},
                                                               deadline=30)
            if r.get("entry") and not r.get("running"):
                j = r["entry"]
                return {"ok": bool(j.get("ok")), "error": f"link lost ({why}); on the host: {j.get('event')}"
                        + (f": {j.get('error')}" if j.get("error") else ""), "restarted": j.get("restarted") or [],
                        "rolled_back": bool(j.get("rollback_ok")),
                        "rollback": {"release": j.get("rolled_back_to"), "ok": j.get("rollback_ok"),
                                     "seconds": j.get("rollback_seconds") or 0} if j.get("rolled_back_to") else None,
                        "link_lost": True, "journal": j}
            last = "still running on the host"
        except Exception as exc:  # still unreachable: try again until `wait` is over
            last = f"{type(exc).__name__}: {exc}"
        finally:
            if conn is not None:
                conn.close()
        time.sleep(3)
    return {"ok": False, "link_lost": True, "restarted": [],
            "error": f"link lost ({why}); outcome unknown ({last}): the host's agent finishes or rolls back on its "
                     f"own and journals it -- `fab status --history 5` shows it once the host answers"}


def plan_host(conn, host: Host, plugin: build.Plugin, overlays: list[dict], release: str, opts: DeployOptions,
              rendered: tuple | None = None) -> HostPlan:
    """Read the host (no lock) and plan it (`rendered`: its build.host_files, when already made)."""
    remote = Remote(conn, host.name)
    models = sorted({s.model for s in host.services if s.mode == contract.TREE_VERIFY and s.enabled and s.model}
                    # a TP group's model and drafter: their attention heads against tp (hostfit.tp_refusals)
                    | {m for s in host.services if s.enabled and s.tp > 1 for m in (s.model, s.draft_model) if m})
    state = probe(remote, host, instances=[s.instance for s in host.services], models=models,
                  overlays=[{k: o[k] for k in ("package", "version", "path", "sha256", "new_sha256")}
                            for o in overlays],
                  facts={"budget": factsmod.PROBE_BUDGET, "import_torch": False}, **hostfit.probe_args(host))
    check_lock(host, state, opts.break_lock)
    return make_plan(host, plugin, overlays, release, opts, state, rendered)


