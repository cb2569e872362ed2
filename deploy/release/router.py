"""The host's router: the real SGLang router (PyPI `sglang-router`, pinned in requirements/router.txt) as one hardened
unit per host (`sglang-router.service`) listening on the host's listen_address, in front of its GPU services (which
then listen on loopback only). Pure rendering and the drain's spec; nothing here touches a host.

- The wheel: scripts/bootstrap downloads the pinned wheel into `.whl/` (CI has registry access, lab hosts have
  none); `wheel()` finds it and checks its sha256 against the pin. It travels in a release bundle only to a host
  that has no router venv for it yet; the agent builds `<state_dir>/router/<name>-<version>-<sha12>/` from it once
  (`python3 -m venv`, pip --no-index --no-deps), atomically, and every release using that wheel shares it.
- The arguments (sglang-router 0.3.2's flags, verified against its own parser in tests/toolkit/test_router.py):
  `--host/--port` the host's endpoint, `--worker-urls` every enabled GPU service on loopback (so a router that
  restarts comes back with every worker), `--prometheus-host 127.0.0.1` (its default is 0.0.0.0), health checks
  every 1 s with 2 failures to drop a worker (a killed server stops receiving within ~3 s; the router's default
  is 60 s x 3), the inventory's `policy`, and the hold (`retry_policy`): a request that no worker can take --
  the router holds none while a one-GPU host restarts its server, or while a dropped worker is not yet back -- is
  retried with a capped backoff for the inventory's `hold_secs` before the client gets a 503.
- Drain: the agent removes a GPU's worker through the router's API (`DELETE /workers/{id}`), waits for the server's
  own counters (sglang:num_running_reqs + num_queue_reqs on its /metrics) to reach 0 within `drain_timeout`, and
  after the gate and one warm-up request adds it back (`POST /workers {"url", "api_key"}`): drain_spec() is what it
  needs, built from the manifest.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from .. import values
from ..inventory import Host
from . import render

REPO = render.REPO
PIN_FILE = REPO / "requirements" / "router.txt"
WHEELHOUSE = REPO / ".whl"
UNIT_TEMPLATE = "sglang-router.service.j2"
UNIT = "sglang-router.service"
ENV_FILE = "router/router.env"
LAUNCHER = Path(__file__).with_name("router_launch.py")
HEALTH_INTERVAL = 1     # s between the router's health checks of a worker
HEALTH_FAILURES = 2     # consecutive failures before it stops routing to one
SHUTDOWN_GRACE = 30     # s the router waits for in-flight requests when it stops
# The hold's backoff between a request's attempts: RETRY_INITIAL_MS x RETRY_MULTIPLIER^k, capped at RETRY_MAX_MS,
# each scaled by a random factor within 1 +- RETRY_JITTER. The cap keeps a held request at most ~1 s behind its
# worker's return; an attempt with no worker to pick costs the router nothing but the pick.
RETRY_INITIAL_MS = 100
RETRY_MULTIPLIER = 2.0
RETRY_MAX_MS = 1000
RETRY_JITTER = 0.1


class RouterError(RuntimeError):
    pass


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str
    version: str
    sha256: str

    @property
    def venv_name(self) -> str:
        return f"sglang-router-{self.version}-{self.sha256[:12]}"


def pin(text: str | None = None) -> tuple[str, str]:
    """(version, sha256) of `sglang-router==V --hash=sha256:H` in requirements/router.txt."""
    text = PIN_FILE.read_text() if text is None else text
    m = re.search(r"(?m)^sglang-router==([0-9][0-9A-Za-z.+-]*)\s+--hash=sha256:([0-9a-f]{64})\s*$", text)
    if not m:
        raise RouterError(f"{PIN_FILE}: no `sglang-router==VERSION --hash=sha256:HEX` line")
    return m.group(1), m.group(2)


def wheel(wheelhouse: Path = WHEELHOUSE) -> Wheel:
    """The pinned router wheel from the wheelhouse, its sha256 checked."""
    version, sha = pin()
    found = sorted(Path(wheelhouse).glob(f"sglang_router-{version}-*.whl"))
    if not found:
        raise RouterError(f"no sglang_router-{version}-*.whl in {wheelhouse}: run scripts/bootstrap (it downloads "
                          f"the pinned wheel), or set router.enabled: false in the inventory")
    for p in found:
        if hashlib.sha256(p.read_bytes()).hexdigest() == sha:
            return Wheel(p, p.name, version, sha)
    raise RouterError(f"{found[0]}: sha256 differs from the pin in {PIN_FILE}")


def settings(host: Host) -> dict:
    return host.vars.get("router") or {"enabled": False}


def enabled(host: Host) -> bool:
    return bool(settings(host).get("enabled"))


def venv_path(host: Host, w: Wheel) -> str:
    return f"{render.state_dir(host)}/router/{w.venv_name}"


def worker_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def backoffs_ms(attempts: int, jitter: float = 0.0) -> list[float]:
    """The waits between `attempts` attempts of one request (sglang-router's exponential backoff: the k-th wait is
    RETRY_INITIAL_MS x RETRY_MULTIPLIER^k capped at RETRY_MAX_MS), each scaled by (1 + jitter)."""
    waits, w = [], float(RETRY_INITIAL_MS)
    for _ in range(attempts - 1):
        waits.append(min(w, RETRY_MAX_MS) * (1.0 + jitter))
        w = min(w * RETRY_MULTIPLIER, RETRY_MAX_MS)
    return waits


def retry_policy(hold_secs: int) -> dict:
    """The router's retry settings for a hold of `hold_secs`: the fewest attempts whose waits, each at its shortest
    (jitter -RETRY_JITTER), add up to at least the hold. sglang-router counts the first try among its
    `retry_max_retries` and retries a response of 408, 429 or 5xx -- its own 503 "no available workers" among
    them -- picking a worker afresh each time; 0 holds nothing (one attempt)."""
    if not isinstance(hold_secs, int) or isinstance(hold_secs, bool) or hold_secs < 0:
        raise ValueError(f"hold_secs must be a non-negative integer, got {hold_secs!r}")
    attempts, total = 1, 0.0
    for w in backoffs_ms(hold_secs * 10 + 2, -RETRY_JITTER):  # more waits than any hold needs (each >= 90 ms)
        if total >= hold_secs * 1000:
            break
        total += w
        attempts += 1
    return {"max_retries": attempts, "initial_backoff_ms": RETRY_INITIAL_MS, "max_backoff_ms": RETRY_MAX_MS,
            "backoff_multiplier": RETRY_MULTIPLIER, "jitter_factor": RETRY_JITTER}


def router_args(host: Host, workers: bool = True) -> list[str]:
    """The router's command line (sglang-router 0.3.2 flags), without the API key (the launcher sets it)."""
    r = settings(host)
    listen = host.vars.get("listen_address", "127.0.0.1")
    if problem := values.listen_address(listen):
        raise render.RenderError(f"{host.name}: listen_address: {problem}")
    urls = [worker_url(s.port) for s in host.services if s.enabled] if workers else []
    args = ["--host", listen, "--port", str(r["port"]), "--policy", r["policy"],
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(r["metrics_port"]),
            "--health-check-interval-secs", str(HEALTH_INTERVAL), "--health-failure-threshold", str(HEALTH_FAILURES),
            "--health-check-timeout-secs", "2", "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE),
            "--log-level", "info"]
    retry = retry_policy(r.get("hold_secs", 0))
    args += ["--retry-max-retries", str(retry["max_retries"]),
             "--retry-initial-backoff-ms", str(retry["initial_backoff_ms"]),
             "--retry-max-backoff-ms", str(retry["max_backoff_ms"]),
             "--retry-backoff-multiplier", str(retry["backoff_multiplier"]),
             "--retry-jitter-factor", str(retry["jitter_factor"])]
    if urls:
        args += ["--worker-urls", *urls]
    for a in args:
        if not values.ARG_RE.fullmatch(a):
            raise render.RenderError(f"{host.name}: router argument {a!r} has characters systemd would interpret")
    return args


def render_env(host: Host) -> str:
    return (f"# {host.name} sglang-router -- rendered by ddtree-deploy. No secrets: the API key comes as a "
            f"credential.\nROUTER_ARGS={' '.join(router_args(host))}\n")


def render_unit(host: Host, w: Wheel) -> str:
    render._check_host(host)
    v = host.vars
    return render._jinja().get_template(UNIT_TEMPLATE).render(
        unit_name=UNIT, host=host.name, release_root=v["release_root"], venv=venv_path(host, w), version=w.version,
        service_user=v["service_user"], system_python=render.SYSTEM_PYTHON, secrets_file=render.SECRETS_FILE,
        api_key_file=v.get("api_key_file"), credential=render.CREDENTIAL, stop_timeout=SHUTDOWN_GRACE + 15)


def files(host: Host, w: Wheel) -> dict[str, bytes]:
    """What a release carries for the router (the wheel itself only when the host lacks its venv: see
    plan.make_plan)."""
    return {f"systemd/{UNIT}": render_unit(host, w).encode(), ENV_FILE: render_env(host).encode(),
            "bin/router_launch.py": LAUNCHER.read_bytes()}


def manifest_entry(host: Host, w: Wheel, router_files: dict[str, bytes]) -> dict:
    """The manifest's `router`: where it listens, how the agent reaches it from the host, the drain deadline, its
    venv and wheel, and the digest that decides whether it restarts (unit, arguments, launcher, wheel). The worker
    list is not in the digest: a GPU added or removed is added to or drained out of the running router through
    its API (a restart would cut every request it holds); router.env keeps the list for its next start."""
    r = settings(host)
    listen = host.vars.get("listen_address", "127.0.0.1")
    return {"enabled": True, "unit": UNIT, "listen": listen, "address": values.connect_address(listen),
            "port": r["port"], "metrics_port": r["metrics_port"], "drain_timeout": r["drain_timeout"],
            "hold_secs": r.get("hold_secs", 0), "policy": r["policy"], "api_key_file": host.vars.get("api_key_file"), "venv": venv_path(host, w),
            "wheel": {"name": w.name, "version": w.version, "sha256": w.sha256, "path": f"wheels/{w.name}"},
            "digest": render.sha256("\0".join([router_files[f"systemd/{UNIT}"].decode(),
                                               " ".join(router_args(host, workers=False)),
                                               render.sha256(router_files["bin/router_launch.py"]), w.sha256]))}


def drain_spec(manifest: dict, services: dict | None = None, previous: dict | None = None) -> dict | None:
    """What the agent needs to take a GPU out of its host's router and put it back; None without a router.
    `services` (default: the manifest's) name the workers: a stopped GPU's are the previous release's. `expected`:
    the workers the router holds once the manifest's release runs (its enabled GPUs), nothing else. `previous`
    (the manifest the host runs now): a GPU whose port changes is served at its old url until it restarts, so its
    drain takes that worker out too."""
    r = manifest.get("router") or {}
    if not r.get("enabled"):
        return None
    services = manifest["services"] if services is None else services
    spec = {"address": r["address"], "port": r["port"], "api_key_file": r.get("api_key_file"),
            "timeout": r["drain_timeout"], "workers": {i: worker_url(s["port"]) for i, s in services.items()},
            "expected": expected_workers(manifest)}
    moved = {i: worker_url(s["port"]) for i, s in ((previous or {}).get("services") or {}).items()
             if i in spec["workers"] and s.get("port") and worker_url(s["port"]) != spec["workers"][i]}
    if moved:
        spec["previous"] = moved
    return spec


def expected_workers(manifest: dict) -> list[str]:
    """The worker urls a router in front of `manifest`'s release holds: one per enabled GPU service."""
    return sorted(worker_url(s["port"]) for s in manifest["services"].values() if s.get("enabled", True))
