"""Transient SGLang servers on one GPU: what to start, how to start it, and how to stop it.

Shared by :mod:`sglang_ddtree_tools.smoke` (the lossless smoke test) and :mod:`sglang_ddtree_tools.bench` (throughput and
latency), so that both build the same command line, size their pools the same way and always tear their servers
down the same way:

* :class:`ServerSpec` / :func:`server_argv` / :func:`server_env`: the pure part (tested on CPU against SGLang's own
  argument parser);
* :class:`Server`: a ``systemd-run`` unit (runtime-capped, optionally as another user) where systemd runs, else a
  process session killed as a group (``--launcher process``: a GPU box without systemd); a process server also
  gets ``PR_SET_PDEATHSIG`` so that a caller killed with SIGKILL does not leave it holding the GPU;
* :func:`wait_healthy`, :func:`post` / :func:`get`: the HTTP side, stdlib only;
* GPU facts: :func:`gpu_device_problem` (no GPU device: say so), :func:`gpu_memory_mib`, :func:`gpu_name` and the
  ``--mem-fraction-static`` rule (:func:`shared_gpu_fraction`, :func:`server_mem_fraction`).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Dict, List, Optional

from sglang_ddtree import contract
from sglang_ddtree.contract import BUDGET_ENV, MODE_ENV, OVERLAP_ENV, PLAIN, PLUGIN_ALLOWLIST_ENV, TREE_VERIFY
from .hostload import group_pids, stat_fields

MODES = contract.SERVER_MODES  # linear = dflash: SGLang's own DFLASH chain
DEFAULT_BLOCK = 8  # the chain modes' DFlash block where a spec gives none
# Flags only a transient server passes (flag -> how many values follow it): its pools, sized to share a GPU, token
# ids in and out, no grammar, eager prefill. They size and feed the server; what it serves is the contract's, the
# same as a deployed unit's (tests/test_contract.py compares the two for every mode).
HARNESS_FLAGS = {"--skip-tokenizer-init": 0, "--grammar-backend": 1, "--cuda-graph-backend-prefill": 1,
                 "--cuda-graph-max-bs-decode": 1, "--context-length": 1, "--max-running-requests": 1,
                 "--mem-fraction-static": 1, "--max-total-tokens": 1, "--max-mamba-cache-size": 1}

__all__ = [
    "MODES", "ServerSpec", "server_argv", "server_env", "load_service_env", "gpu_device_problem", "shared_gpu_fraction", "lost_port_race",
    "parse_cpus", "cpu_list",
    "server_mem_fraction", "gpu_memory_mib", "gpu_name", "free_port", "Server", "post", "get", "wait_healthy",
    "map_concurrent",
]


@dataclass(frozen=True)
class ServerSpec:
    """One transient server: what to serve and how."""

    mode: str  # one of MODES
    target: str
    drafter: Optional[str] = None
    budget: int = 15  # B (tree-verify: its verify width is contract.draft_tokens; shadow-linear: the would-be tree's)
    # --speculative-dflash-block-size: the chain width (dflash, shadow-linear; DEFAULT_BLOCK where None) and the
    # drafter's block in tree-verify (None there: the drafter's own)
    block: Optional[int] = None
    mem_fraction: Optional[float] = 0.12  # None: SGLang's own default
    max_running: int = 8
    # Pool caps: a transient server sizes its KV / recurrent-state pools by these, not by the memory it finds free,
    # so it can share a GPU with other servers (SGLang derives its pools from the memory free at start-up).
    max_total_tokens: Optional[int] = None
    max_mamba_cache: Optional[int] = None
    context_length: int = 2048
    # CUDA graphs: off by default (smoke proves correctness, not speed); on = SGLang's own decode graph backend,
    # captured up to cuda_graph_max_bs requests (prefill stays eager: a benchmark compares decode steps).
    cuda_graph: bool = False
    cuda_graph_max_bs: Optional[int] = None
    extra_args: tuple = ()  # appended last: a flag given here wins over the one set above (argparse keeps the last)

    @property
    def chain_block(self) -> Optional[int]:
        """The DFlash block this server is given (None: plain, or tree-verify with the drafter's own)."""
        if self.mode == PLAIN or (self.mode == TREE_VERIFY and self.block is None):
            return None
        return self.block if self.block is not None else DEFAULT_BLOCK

    @property
    def draft_tokens(self) -> Optional[int]:
        """The verify width D (``contract.draft_tokens``): B + 1 in tree-verify, the chain block otherwise, None
        for plain."""
        return contract.draft_tokens(self.mode, self.budget, self.chain_block)


def server_argv(python: str, spec: ServerSpec, port: int, host: str = "127.0.0.1") -> List[str]:
    """``python -m sglang.launch_server ...`` for ``spec`` on ``host:port``: the contract's server
    (:func:`sglang_ddtree.contract.sglang_args`, what a deployed unit runs) and this server's own pool caps."""
    if spec.mode not in MODES:
        raise ValueError(f"unknown mode {spec.mode!r}; choose one of {MODES}")
    if spec.mode != PLAIN and not spec.drafter:
        raise ValueError(f"mode {spec.mode} needs a drafter")
    argv = [python, "-m", "sglang.launch_server"] + contract.sglang_args(
        spec.mode, spec.target, spec.drafter, budget=spec.budget, block=spec.chain_block, host=host, port=port,
        decode_graphs=spec.cuda_graph)
    argv += ["--skip-tokenizer-init", "--grammar-backend", "none", "--cuda-graph-backend-prefill", "disabled"]
    if spec.cuda_graph and spec.cuda_graph_max_bs:
        argv += ["--cuda-graph-max-bs-decode", str(spec.cuda_graph_max_bs)]
    argv += ["--context-length", str(spec.context_length), "--max-running-requests", str(spec.max_running)]
    if spec.mem_fraction is not None:
        argv += ["--mem-fraction-static", str(spec.mem_fraction)]
    if spec.max_total_tokens:
        argv += ["--max-total-tokens", str(spec.max_total_tokens)]
    if spec.max_mamba_cache:
        argv += ["--max-mamba-cache-size", str(spec.max_mamba_cache)]
    return argv + list(spec.extra_args)


def server_env(spec: ServerSpec, gpu: int, base: Optional[Dict[str, str]] = None,
               python: Optional[str] = None, service: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The server's environment: ``base`` (default: this process's), then ``service`` (the deployed service's own
    inventory ``env``, which its unit sets: a transient server of that GPU runs as the service does), then the
    contract's (:func:`sglang_ddtree.contract.sglang_env`: its one GPU, the plugin allow-list, DDTREE's mode and
    budget: these win) and, given the server's ``python``, the PATH a deployed unit has
    (:func:`sglang_ddtree.contract.server_path`: its venv's bin first, where FlashInfer's JIT finds ``ninja``)."""
    env = dict(os.environ if base is None else base)
    env.update(service or {})
    env["PYTHONUNBUFFERED"] = "1"
    if python:
        env["PATH"] = contract.server_path(os.path.dirname(os.path.dirname(os.path.abspath(python))))
    for k in (MODE_ENV, BUDGET_ENV):
        env.pop(k, None)
    env.update(contract.sglang_env(spec.mode, spec.budget, gpu))
    return env


def load_service_env(path: Optional[str]) -> Dict[str, str]:
    """``--service-env FILE``: a JSON object of the GPU's service environment (names to strings; the host agent
    checked and wrote it); {} without a file. Raises ValueError on anything else."""
    if not path:
        return {}
    with open(path) as fh:
        doc = json.load(fh)
    if not (isinstance(doc, dict) and all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                          and isinstance(v, str) for k, v in doc.items())):
        raise ValueError(f"{path}: the service environment must map variable names to strings")
    return doc


def gpu_device_problem(gpu: int, dev: str = "/dev") -> Optional[str]:
    """Why this host cannot serve a model on ``gpu`` (None when it can)."""
    missing = [p for p in (f"{dev}/nvidiactl", f"{dev}/nvidia{gpu}") if not os.path.exists(p)]
    if missing:
        return (f"no GPU device {' or '.join(missing)} on this host: it serves a real model on a "
                "real GPU and cannot run here (a CPU lab host has an nvidia-smi stand-in, not a GPU)")
    return None


def shared_gpu_fraction(used_mib: float, total_mib: float, headroom_mib: float = 4096) -> float:
    """``--mem-fraction-static`` for a pool-capped server on a GPU where ``used_mib`` is already taken: SGLang
    budgets ``free - total * (1 - fraction)``, so the fraction must cover what others use plus headroom."""
    return min(0.97, max(0.1, math.ceil(1000 * (used_mib + headroom_mib) / total_mib) / 1000))  # up: never short


def server_mem_fraction(used_mib: float, total_mib: float, weights_mib: float, kv_mib: float = 4096) -> float:
    """The same rule for a server whose weights are not negligible: what others use, the weights with a quarter
    on top (activations, the drafter's buffers), and ``kv_mib`` for the (capped) pools."""
    return shared_gpu_fraction(used_mib, total_mib, headroom_mib=1.25 * weights_mib + kv_mib)


def _nvidia_smi(gpu: int, fields: str) -> List[str]:
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits", "-i", str(gpu)],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return [x.strip() for x in out.strip().splitlines()[0].split(",")]


def gpu_memory_mib(gpu: int) -> tuple:
    """(used, total) MiB of one GPU from nvidia-smi."""
    used, total = (float(x) for x in _nvidia_smi(gpu, "memory.used,memory.total"))
    return used, total


def gpu_name(gpu: int) -> str:
    try:
        return _nvidia_smi(gpu, "name")[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


# ----------------------------------------------------------------------------- servers
def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lost_port_race(error: str) -> bool:
    """Whether a server failed its start because the port :func:`free_port` found was taken before it bound it
    (another process starting servers beside this one; on the H200, two matrices side by side): uvicorn's
    ``[Errno 98] error while attempting to bind on address ...: address already in use``. Such a start is
    retried on a new port; any other failure is the server's own."""
    return "[Errno 98]" in error and "address already in use" in error


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def parse_cpus(spec: str) -> List[int]:
    """A CPU list as systemd's ``AllowedCPUs=`` and ``taskset -c`` write it (``0-3,8,10-11``) -> sorted CPU ids.
    Raises ValueError on anything else (empty parts, reversed ranges, non-numbers, more than 4096)."""
    out = set()
    for part in str(spec).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {spec!r}: write it as 0-3,8,10-11")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b >= 4096:
            raise ValueError(f"bad CPU list {spec!r}: range {part!r}")
        out.update(range(a, b + 1))
    return sorted(out)


def cpu_list(cpus) -> str:
    """Sorted CPU ids -> the compact ``0-3,8`` form."""
    cpus, parts = sorted(set(cpus)), []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


#: The cache directory (under /var/cache) of a transient server run as another user (Server's ``user``).
TRANSIENT_CACHE = contract.TRANSIENT_CACHE


class Server:
    """A transient server: a ``systemd-run`` unit (runtime-capped, stopped on exit)
    where systemd runs, else a process session killed as a group."""

    ENV_KEEP = ("CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", PLUGIN_ALLOWLIST_ENV, MODE_ENV,
                BUDGET_ENV,
                "PATH", "HOME", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "PYTHONPATH",
                "SGLANG_DDTREE_GLUE_GRAPHS", OVERLAP_ENV) + tuple(
        # the JIT caches (the host agent points them at a copy of the service's; bench --cold-warm at a run's own)
        k for k, _d in contract.JIT_CACHE_ENV + (contract.XDG_CACHE_ENV,))

    def __init__(self, argv, env, log_path, launcher="auto", runtime_max_s=1800, user=None, unit=None, cpus=None,
                 keep=()):
        """``cpus``: CPU ids every process of the server is pinned to (``AllowedCPUs=`` of the unit, or the
        process's affinity, which its children inherit); None leaves the scheduler's choice. ``keep``: names of
        ``env`` a ``systemd-run`` unit gets besides :attr:`ENV_KEEP` (the service's own environment)."""
        self.argv, self.env, self.log_path = argv, env, log_path
        self.keep = frozenset(keep)
        self.cpus = sorted(set(cpus)) if cpus else None
        self.unit_name = unit
        self.launcher = launcher if launcher != "auto" else (
            "systemd-run" if shutil.which("systemd-run") and os.path.isdir("/run/systemd/system") else "process")
        self.runtime_max_s, self.user = runtime_max_s, user
        self.proc = None
        self.unit = None
        self._cgroup: Optional[str] = None  # the unit's control group, once systemd said it (pids)

    def start(self) -> None:
        if self.launcher == "systemd-run":
            self.unit = self.unit_name or f"ddtree-smoke-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
            keep = {k: v for k, v in self.env.items() if k in self.ENV_KEEP or k in self.keep}
            argv = ["systemd-run", f"--unit={self.unit}", "--collect", "--quiet",
                    f"--property=RuntimeMaxSec={self.runtime_max_s}", f"--property=StandardOutput=file:{self.log_path}",
                    f"--property=StandardError=file:{self.log_path}", "--property=KillMode=control-group"]
            if self.user:
                # another user's server: not root's HOME (a cache written under /root is refused to it), but a
                # cache directory systemd makes for that user and keeps between runs (Triton's and FlashInfer's
                # default caches live under HOME; kept, the next transient server starts warm)
                argv += [f"--uid={self.user}", f"--property=CacheDirectory={TRANSIENT_CACHE}"]
                keep["HOME"] = f"/var/cache/{TRANSIENT_CACHE}"
                keep.setdefault("XDG_CACHE_HOME", f"/var/cache/{TRANSIENT_CACHE}/xdg")
            if self.cpus:
                argv.append(f"--property=AllowedCPUs={cpu_list(self.cpus)}")
            argv += [f"--setenv={k}={v}" for k, v in sorted(keep.items())] + ["--"] + list(self.argv)
            subprocess.run(argv, check=True, timeout=30, capture_output=True, text=True)
        else:
            log = open(self.log_path, "ab")
            cpus = self.cpus

            def child_setup():  # between fork and exec: no Python objects shared with the parent's threads
                _die_with_parent()
                if cpus:
                    os.sched_setaffinity(0, cpus)

            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         start_new_session=True,
                                         preexec_fn=child_setup if sys.platform.startswith("linux") else None)

    def alive(self) -> bool:
        if self.unit:
            r = subprocess.run(["systemctl", "is-active", "--quiet", self.unit], timeout=10)
            return r.returncode == 0
        return self.proc is not None and self.proc.poll() is None

    def stop_wrapped(self, timeout: float = 30) -> bool:
        """For a server started under a wrapper (py-spy): SIGTERM to the wrapper's children - the server, which
        shuts down as it would alone - and wait for the wrapper, which writes what it recorded when its target
        exits (SIGINT to the wrapper itself only where it has no child left; py-spy then kills its target).
        :meth:`stop` then ends whatever is left of the session. False where nothing ran or it did not exit."""
        if self.unit or self.proc is None or self.proc.poll() is not None:
            return False
        try:
            kids = child_pids(self.proc.pid)
            for k in kids:
                os.kill(k, signal.SIGTERM)
            if not kids:
                self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=timeout)
            return True
        except (ProcessLookupError, subprocess.TimeoutExpired):
            return False

    def stop(self) -> None:
        if self.unit:
            subprocess.run(["systemctl", "stop", self.unit], timeout=60, capture_output=True)
            return
        if self.proc is None:
            return
        # the whole session (start_new_session: its id is the leader's pid), also when the leader has exited
        # and left children (a wrapper interrupted first, a server whose scheduler outlived its main process)
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(pgid):
                    return
                time.sleep(0.1)

    def pids(self) -> List[int]:
        """The server's live processes: its unit's control group (systemd-run), else its session's process group
        (the process launcher starts it in a new session: every process it forks stays in the group)."""
        if self.unit:
            if self._cgroup is None:  # a unit's control group is fixed for its life: asked once, not every level
                r = subprocess.run(["systemctl", "show", "--property=ControlGroup", "--value", self.unit],
                                   capture_output=True, text=True, timeout=10)
                cg = r.stdout.strip()
                # a path systemd gave; still checked whole before it names a file
                if r.returncode != 0 or not cg.startswith("/") or ".." in cg.split("/") or "\x00" in cg:
                    return []
                self._cgroup = cg
            try:
                with open(os.path.join("/sys/fs/cgroup", self._cgroup.lstrip("/"), "cgroup.procs")) as fh:
                    return sorted(int(x) for x in fh.read().split() if x.isdigit())
            except OSError:
                return []
        if self.proc is None:
            return []
        return group_pids(self.proc.pid)

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                lines = [ln for ln in fh.read().splitlines() if ln.strip()]
            return "\n".join(lines[-n:])
        except OSError:
            return ""


def child_pids(pid: int) -> List[int]:
    """The live children of ``pid`` (Linux: /proc/PID/task/*/children, else a scan of /proc's stat files)."""
    kids: List[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids += [int(x) for x in fh.read().split()]
        return sorted(set(kids))
    except OSError:
        pass
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        f = _stat_fields(d)
        if f and f[1] == str(pid):  # ppid: field 4, the second after the command's parentheses
            kids.append(int(d))
    return sorted(kids)


def _stat_fields(pid: str) -> Optional[List[str]]:
    """/proc/PID/stat's fields after the command (state, ppid, pgrp, ...), None where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return stat_fields(fh.read())
    except OSError:
        return None


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie does not count: in a container whose init does not
    reap, a server's exited scheduler would otherwise keep its group "alive" for the whole wait."""
    if os.path.isdir("/proc/self"):
        return bool(group_pids(pgid))
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member runs as another user: still there
        return True


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def wait_healthy(base: str, server: Server, timeout: float) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            with urllib.request.urlopen(base + "/health", timeout=3) as r:
                if r.status == 200:
                    return time.time() - t0
        except (urllib.error.URLError, OSError):
            pass
        if not server.alive():
            tail = server.log_tail()
            raise RuntimeError(f"server exited during start-up: {failure_line(tail) or 'no error in its log'}\n{tail}")
        time.sleep(1)
    tail = server.log_tail()
    raise RuntimeError(f"server not healthy after {timeout:.0f}s: {failure_line(tail) or 'no error in its log'}\n{tail}")


_FAILURE_RE = re.compile(r"^\s*(?:\[[^\]]*\]\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Exit)\b.*)$")


def failure_line(log: str) -> str:
    """The last exception line of a server's log (``RuntimeError: Not enough memory ...``), '' when it has none:
    what a failed start-up's one-line message names (the log's last line is SGLang's process-tree kill)."""
    for line in reversed(log.splitlines()):
        m = _FAILURE_RE.match(line)
        if m and ":" in m.group(1):
            return m.group(1).strip()[:400]
    return ""


def map_concurrent(fn, items, concurrency: int) -> list:
    """``[fn(i, item) for ...]`` with ``concurrency`` calls in flight (threads taking the next item in order);
    results in item order. The joins are bounded, so Ctrl-C reaches the main thread."""
    import threading

    out: list = [None] * len(items)
    lock = threading.Lock()
    nxt = [0]

    def worker():
        while True:
            with lock:
                i = nxt[0]
                nxt[0] += 1
            if i >= len(items):
                return
            out[i] = fn(i, items[i])

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(concurrency, len(items))))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    return out
