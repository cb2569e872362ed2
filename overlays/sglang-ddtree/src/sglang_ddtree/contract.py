"""The DDTree serving contract: modes, their SGLang algorithms, the environment, the budget, and the server's
command line. The one place each of these is written.

Pure and stdlib-only (no SGLang, torch or package-relative import), so that the same file is imported by

* the plugin (``sglang_ddtree.contract``: the validator, the transient servers of smoke and bench),
* the control side (``deploy.contract``, a symbolic link to this file: the toolkit ships the plugin's source and
  builds its wheel from it, so it reads the contract of the plugin it deploys, never the copy some venv has
  installed),
* the host agent (``ddtree_agent.contract``, the same link under ``deploy/remote/host``, carried in the zipapp),

and none of them can disagree with another about a name or a bound. ``capabilities.json`` declares the same
names to tools that read a wheel without importing it; a test holds it equal to this module.

Modes
-----
``linear``: SGLang's builtin DFLASH (one draft chain per step). ``dflash`` is its name in the plugin's bench and
smoke, where it is measured next to ``plain`` (no speculation; never deployed).
``shadow-linear``: DDTREE builds the tree and reports what it would have accepted, but commits through the chain
verifier (safe on any model). ``tree-verify``: DDTREE verifies the whole tree in one target forward.
``auto`` (inventory only): `fab deploy` gives the service the mode and budget `fab bench` measured fastest.

Budget
------
The node budget B is the number of tree nodes; tree-verify verifies ``D = B + 1`` tokens (the bonus root plus B
nodes: ``--speculative-num-draft-tokens``). In shadow-linear D stays the DFlash block and B travels only in
:data:`BUDGET_ENV`. The bound is ``1 <= B <= 511`` (:data:`BUDGET_MAX`): neither SGLang nor the plugin's
validator caps D, but 511 is the largest budget whose per-step tree the plugin builds with its GPU kernel
(``tree_kernels``: the best-first pop packs parent slot, rank, subtree size and preorder into 10-bit fields of one
64-bit key, with 1000 as the unpopped sentinel). A larger budget falls back to the torch reference builder every
step, which is not the path that was served or measured, so the toolkit does not deploy, smoke or bench it.

Budget schedule
---------------
A tree-verify server may take a schedule instead of one budget: a mapping from batch-size thresholds to a budget
or :data:`CHAIN`, e.g. ``{1: 127, 4: 31, 16: 15, 64: chain}`` (batch sizes 1-3 verify a tree of 127 nodes, 4-15
of 31, 16-63 of 15, 64 and more one branch of the drafter's block, verified as DFLASH verifies it: ``D = block``).
Thresholds are ascending integers starting at 1, budgets within the bound above and non-increasing (``chain``
ranks below every budget, and a schedule starts with a budget). Its canonical text, what :data:`BUDGET_ENV`
carries, is ``1:127,4:31,16:15,64:chain`` (:func:`budget_text`); entries that repeat the previous budget are
dropped, and a schedule of one entry is that plain budget, which stays valid everywhere. The server's
``--speculative-num-draft-tokens`` is the schedule's largest width (:func:`draft_tokens`): SGLang sizes its verify
buffers and KV reservation by it. A step takes the entry of its batch size; where the target's verify graphs are
captured per bucket (SGLang 0.5.17), the entry of the graph bucket SGLang pads the batch to, the width that bucket
was captured at. Shadow-linear reports what one budget would accept: it takes a plain budget.

Server command line
-------------------
:func:`sglang_args` and :func:`sglang_env` are the only builders of a DDTree/DFLASH server's SGLang arguments and
environment: the systemd unit's (``deploy/release/render.py``) and the transient servers' of smoke, bench and
serve_matrix (``sglang_ddtree.servers``). Every server passes ``--attention-backend triton --page-size 1``: DDTREE
tree-verify needs Triton's per-forward tree mask and one KV slot per page (``config``), SGLang's Hopper default
(FA3) is not in the trimmed sglang-kernel the fleet installs, and the servers that were measured ran so. An
inventory can still override either with ``extra_args`` (argparse keeps the last value).

Tensor parallelism
------------------
A server over several GPUs (``gpus`` of more than one index) runs SGLang with ``--tp-size`` = their count, sees
exactly those GPUs (``CUDA_VISIBLE_DEVICES=0,1,2,3`` numbered as nvidia-smi numbers them), and is given its TP
group's rendezvous ports (``--dist-init-addr 127.0.0.1:P --nccl-port P+1``) from :func:`tp_ports`: a pure
function of the host's TP port base and the group's first GPU, so two groups on one host (which share no GPU)
never share a port, and a restart never waits on a random port another server took. The group talks over
loopback (``NCCL_SOCKET_IFNAME=lo``: NCCL's bootstrap sockets stay inside the unit's IPAddressAllow=localhost).
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- modes
LINEAR = "linear"
SHADOW_LINEAR = "shadow-linear"
TREE_VERIFY = "tree-verify"
AUTO = "auto"
DFLASH = "dflash"  # the bench/smoke name of LINEAR
PLAIN = "plain"  # no speculative decoding: measured, never deployed

#: What the toolkit deploys, simplest first (`mode: auto`'s tie order).
MODES = (LINEAR, SHADOW_LINEAR, TREE_VERIFY)
#: What an inventory may write.
INVENTORY_MODES = MODES + (AUTO,)
#: What the plugin serves (``SGLANG_DDTREE_MODE``), its default first.
PLUGIN_MODES = (TREE_VERIFY, SHADOW_LINEAR)
DEFAULT_PLUGIN_MODE = TREE_VERIFY
#: What the plugin's bench measures (``linear`` is accepted as ``dflash``).
BENCH_MODES = (PLAIN, DFLASH, TREE_VERIFY, SHADOW_LINEAR)
#: What the plugin's smoke test and its transient servers run.
SMOKE_MODES = (TREE_VERIFY, SHADOW_LINEAR, LINEAR, PLAIN)
SERVER_MODES = (TREE_VERIFY, SHADOW_LINEAR, LINEAR, DFLASH, PLAIN)
#: The modes that take a node budget (the plugin's).
BUDGETED_MODES = PLUGIN_MODES
#: linear = dflash: the deploy's name and the bench's name of SGLang's own DFLASH chain.
ALIASES = {LINEAR: DFLASH}

# ----------------------------------------------------------------------------- SGLang and the plugin
ALGORITHM_DDTREE = "DDTREE"
ALGORITHM_DFLASH = "DFLASH"
PLUGIN_NAME = "ddtree"  # entry point in group sglang.srt.plugins
PLUGIN_ALLOWLIST_ENV = "SGLANG_PLUGINS"
MODE_ENV = "SGLANG_DDTREE_MODE"
BUDGET_ENV = "SGLANG_DDTREE_BUDGET"
OVERLAP_ENV = "SGLANG_DDTREE_OVERLAP"  # "1": tree-verify on SGLang's overlap scheduler where it can run (opt-in)
OVERLAP_ON = ("1", "on", "true", "yes")  # the values of OVERLAP_ENV read as asked
ATTENTION_BACKEND = "triton"
PAGE_SIZE = 1

# ----------------------------------------------------------------------------- budget
BUDGET_MIN = 1
BUDGET_MAX = 511  # the plugin's GPU tree kernel's largest budget (module docstring)


def bench_name(mode: str) -> str:
    """The bench's name of a mode (``linear`` -> ``dflash``); other names unchanged."""
    return ALIASES.get(mode, mode)


def deploy_name(mode: str) -> str:
    """The deploy's name of a bench mode (``dflash`` -> ``linear``); other names unchanged."""
    return {v: k for k, v in ALIASES.items()}.get(mode, mode)


def is_ddtree(mode: str) -> bool:
    """Whether the plugin serves ``mode`` (and so reads a budget)."""
    return mode in PLUGIN_MODES


def algorithm(mode: str) -> str | None:
    """``--speculative-algorithm`` of a mode (None: plain, no speculation)."""
    if mode in PLUGIN_MODES:
        return ALGORITHM_DDTREE
    if mode in (LINEAR, DFLASH):
        return ALGORITHM_DFLASH
    if mode == PLAIN:
        return None
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(SERVER_MODES)}")


def budget_problem(budget, mode: str | None = None) -> str | None:
    """Why ``budget`` is not a node budget (or, in ``mode`` tree-verify or unknown, a budget schedule) the toolkit
    serves; None when it is."""
    if is_schedule(budget):
        try:
            b = parse_budget(budget)
        except ValueError as e:
            return f"is not a valid schedule: {e}"
        if isinstance(b, BudgetSchedule) and mode is not None and mode != TREE_VERIFY:
            return f"is a schedule ({b}), which only {TREE_VERIFY} serves; {mode} takes one budget"
        return None
    if type(budget) is not int or not BUDGET_MIN <= budget <= BUDGET_MAX:
        return f"must be an integer in [{BUDGET_MIN}, {BUDGET_MAX}] or a schedule (batch size: budget or {CHAIN})"
    return None


CHAIN = "chain"  # a schedule's entry: one branch of the drafter's block (D = block), as DFLASH verifies it


class BudgetSchedule:
    """A budget per batch size (module docstring, *Budget schedule*): ``entries`` is ``((threshold, budget or
    CHAIN), ...)``, validated by :func:`parse_budget`. Immutable and hashable; ``str()`` is its canonical text."""

    __slots__ = ("entries",)

    def __init__(self, entries):
        object.__setattr__(self, "entries", tuple((int(t), b) for t, b in entries))

    def __setattr__(self, name, value):
        raise AttributeError("BudgetSchedule is immutable")

    def __eq__(self, other):
        return isinstance(other, BudgetSchedule) and self.entries == other.entries

    def __hash__(self):
        return hash(self.entries)

    def __repr__(self):
        return f"BudgetSchedule({str(self)!r})"

    def __str__(self):
        return ",".join(f"{t}:{b}" for t, b in self.entries)

    def as_mapping(self) -> dict:
        """``{threshold: budget or "chain"}`` (what an inventory writes)."""
        return dict(self.entries)

    def budget_for(self, batch: int):
        """The budget (or :data:`CHAIN`) of a step of ``batch`` requests: the entry of the largest threshold
        ``<= batch``."""
        if type(batch) is not int or batch < 1:
            raise ValueError(f"batch size must be an integer >= 1, got {batch!r}")
        out = self.entries[0][1]
        for t, b in self.entries:
            if t > batch:
                break
            out = b
        return out

    @property
    def largest_budget(self) -> int:
        """The budget at batch size 1 (the schedule's largest node budget)."""
        return self.entries[0][1]

    @property
    def has_chain(self) -> bool:
        return any(b == CHAIN for _, b in self.entries)


def _schedule_items(value):
    """``(threshold, budget)`` pairs of a mapping or of schedule text (``1:127,4:31``), unvalidated."""
    if isinstance(value, BudgetSchedule):
        return list(value.entries)
    if isinstance(value, dict):
        return list(value.items())
    items = []
    for part in str(value).split(","):
        t, sep, b = part.strip().partition(":")
        if not sep:
            raise ValueError(f"schedule entry {part.strip()!r} is not THRESHOLD:BUDGET")
        t, b = t.strip(), b.strip()
        items.append((int(t) if t.isdigit() else t, int(b) if b.isdigit() else b))
    return items


def parse_budget(value):
    """A node budget (``int``) or a :class:`BudgetSchedule` from an int, its text (``"127"``), a mapping
    (``{1: 127, 4: 31, 64: "chain"}``) or schedule text (``"1:127,4:31,64:chain"``). Canonical: entries that
    repeat the previous budget are dropped, and a schedule of one entry is returned as its plain budget.
    Raises ``ValueError`` saying what is wrong."""
    if type(value) is int:
        if not BUDGET_MIN <= value <= BUDGET_MAX:
            raise ValueError(f"budget {value} must be an integer in [{BUDGET_MIN}, {BUDGET_MAX}]")
        return value
    if isinstance(value, str) and ":" not in value:
        v = value.strip()
        if not v.isdigit():
            raise ValueError(f"budget {value!r} is neither an integer nor a schedule THRESHOLD:BUDGET,...")
        return parse_budget(int(v))
    if not isinstance(value, (dict, str, BudgetSchedule)):
        raise ValueError(f"budget must be an integer or a schedule (batch size: budget or {CHAIN}), got {value!r}")
    items = _schedule_items(value)
    if not items:
        raise ValueError("a budget schedule needs at least one entry")
    out, prev_t, prev_b = [], 0, None
    for t, b in items:
        if type(t) is not int or t < 1:
            raise ValueError(f"schedule threshold {t!r} must be an integer >= 1 (a batch size)")
        if t <= prev_t:
            raise ValueError(f"schedule thresholds must ascend: {t} after {prev_t}")
        if not prev_t and t != 1:
            raise ValueError(f"a schedule starts at batch size 1, got {t}")
        if b != CHAIN and (type(b) is not int or not BUDGET_MIN <= b <= BUDGET_MAX):
            raise ValueError(f"schedule budget at {t} must be an integer in [{BUDGET_MIN}, {BUDGET_MAX}] "
                             f"or {CHAIN!r}, got {b!r}")
        if t == 1 and b == CHAIN:
            raise ValueError(f"a schedule starts with a node budget at batch size 1 ({CHAIN} at every batch size "
                             "is mode linear)")
        if prev_b is not None and (prev_b == CHAIN and b != CHAIN or b != CHAIN and b > prev_b):
            raise ValueError(f"schedule budgets must not increase with the batch size: {b} at {t} after {prev_b}")
        if b != prev_b:
            out.append((t, b))
        prev_t, prev_b = t, b
    return out[0][1] if len(out) == 1 else BudgetSchedule(out)


def is_schedule(budget) -> bool:
    """Whether ``budget`` is a schedule (a :class:`BudgetSchedule`, a mapping or schedule text), not one budget."""
    return isinstance(budget, (BudgetSchedule, dict)) or (isinstance(budget, str) and ":" in budget)


def budget_text(budget) -> str:
    """The canonical text of a budget or schedule: what :data:`BUDGET_ENV` carries (``"127"``,
    ``"1:127,4:31,16:15,64:chain"``)."""
    return str(parse_budget(budget))


def budgets_word(budgets) -> str:
    """Budgets and schedules as one ``--budgets`` word of the tools' bench: ``,`` between node budgets, ``;``
    between items where a schedule (which holds commas of its own) is among them (``31;1:127,4:31``)."""
    items = [b if type(b) is int else budget_text(b) for b in budgets]
    return (";" if any(type(b) is not int for b in items) else ",").join(map(str, items))


def budget_for(budget, batch: int):
    """The budget (int or :data:`CHAIN`) a step of ``batch`` requests uses: ``budget`` itself when it is one int."""
    b = parse_budget(budget)
    return b.budget_for(batch) if isinstance(b, BudgetSchedule) else b


def step_width(budget, batch: int, block: int | None) -> int:
    """The verify width D of a step of ``batch`` requests: :func:`tree_width` of its budget, or the drafter
    ``block`` for :data:`CHAIN`."""
    b = budget_for(budget, batch)
    if b == CHAIN:
        if block is None:
            raise ValueError(f"a schedule with {CHAIN} needs the drafter's block size (its width)")
        return int(block)
    return tree_width(b)


def schedule_widths(budget, block: int | None) -> dict:
    """``{threshold: D}`` of a budget or schedule (one entry, at 1, for a plain budget)."""
    b = parse_budget(budget)
    entries = b.entries if isinstance(b, BudgetSchedule) else ((1, b),)
    return {t: step_width(b, t, block) for t, _ in entries}


def largest_budget(budget) -> int:
    """The largest node budget of a budget or schedule (the one at batch size 1)."""
    b = parse_budget(budget)
    return b.largest_budget if isinstance(b, BudgetSchedule) else b


def tree_width(budget: int) -> int:
    """D = B + 1: the tokens of a tree of ``budget`` nodes with its bonus root (tree-verify's verify width)."""
    return budget + 1


def draft_tokens(mode: str, budget, block: int | None) -> int | None:
    """``--speculative-num-draft-tokens`` D: :func:`tree_width` in tree-verify (a schedule's largest width), the
    DFlash block in the chain modes, None for plain."""
    if mode == TREE_VERIFY:
        if is_schedule(budget):
            return max(schedule_widths(budget, block).values())
        return tree_width(budget)
    return None if mode == PLAIN else block


def budget_of(num_draft_tokens: int) -> int:
    """The node budget B of a tree-verify width D."""
    return num_draft_tokens - 1


def overlap_asked(value) -> bool:
    """Whether an :data:`OVERLAP_ENV` value asks for the overlap scheduler."""
    return str(value or "").strip().lower() in OVERLAP_ON


# ----------------------------------------------------------------------------- a schedule's chain entries
#: Which step serves a budget schedule's chain entries: SGLang's own DFLASH step (:data:`CHAIN_STEP_DFLASH`: the
#: same drafts, verify and accept as a DFLASH server, at its speed) or the plugin's tree step over a one-branch
#: tree (:data:`CHAIN_STEP_PLUGIN`). Unset: the adapter's default (capabilities.json's dflash_chain_step).
CHAIN_STEP_ENV = "SGLANG_DDTREE_CHAIN_STEP"
CHAIN_STEP_DFLASH = DFLASH
CHAIN_STEP_PLUGIN = "plugin"
CHAIN_STEPS = (CHAIN_STEP_DFLASH, CHAIN_STEP_PLUGIN)


def parse_chain_step(value, default: str = CHAIN_STEP_PLUGIN) -> str:
    """Which step serves a schedule's chain entries: ``value`` (:data:`CHAIN_STEP_ENV`'s, any case; ``default``
    where unset or empty). An unknown value is refused, naming the variable."""
    step = str(value or default).strip().lower()
    if step not in CHAIN_STEPS:
        raise ValueError(f"{CHAIN_STEP_ENV}={value!r} must be one of {', '.join(CHAIN_STEPS)}")
    return step


# ----------------------------------------------------------------------------- the JIT caches
#: Where a deployed service keeps its JIT caches: the unit's CacheDirectory, <root>/<instance>/<payload key>/.
JIT_CACHE_ROOT = "/var/cache/sglang-ddtree"
#: Each JIT cache's variable and its folder under a payload's cache directory. Names from the sources: Triton's
#: TRITON_CACHE_DIR, FlashInfer's FLASHINFER_WORKSPACE_BASE (its JIT cache is $BASE/.cache/flashinfer), SGLang
#: 0.5.17's SGLANG_CACHE_DIR and SGLANG_DG_CACHE_DIR (sglang/srt/environ.py), torch's TORCHINDUCTOR_CACHE_DIR.
JIT_CACHE_ENV = (("TRITON_CACHE_DIR", "triton"), ("FLASHINFER_WORKSPACE_BASE", "flashinfer"),
                 ("SGLANG_CACHE_DIR", "sglang"), ("SGLANG_DG_CACHE_DIR", "deep_gemm"),
                 ("TORCHINDUCTOR_CACHE_DIR", "inductor"))
#: The other cache a transient server is given a folder for (its default caches: Triton's and FlashInfer's
#: fallbacks, torch's kernels) beside :data:`JIT_CACHE_ENV`'s.
XDG_CACHE_ENV = ("XDG_CACHE_HOME", "xdg")
#: The cache directory (under /var/cache) of the transient bench and smoke servers run as the service user.
TRANSIENT_CACHE = "ddtree-transient"
#: Parts of a variable name that mark it a secret (any case): such a variable never goes into a unit, a release or
#: a server's environment by argument; secrets live in a 0600 file on the host.
SECRET_NAME_MARKERS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "API_KEY", "CREDENTIAL", "PRIVATE_KEY")


def secret_name(name: str) -> bool:
    """Whether an environment variable's name looks like a secret's (:data:`SECRET_NAME_MARKERS`)."""
    upper = str(name).upper()
    return any(m in upper for m in SECRET_NAME_MARKERS)


# ----------------------------------------------------------------------------- the server
#: Flags a server's place (not what it serves): the only words in which two servers of one service may differ.
PLACE_FLAGS = ("--host", "--port")
#: How much of its GPU a server takes (memory and pools): a service's are sized for a GPU of its own, so a
#: transient bench server beside it sizes its own instead (:func:`without_pool_flags`).
POOL_FLAGS = ("--mem-fraction-static", "--max-total-tokens", "--max-running-requests", "--context-length",
              "--max-mamba-cache-size", "--cuda-graph-max-bs-decode")


def without_pool_flags(args) -> list:
    """``args`` less every :data:`POOL_FLAGS` flag and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in POOL_FLAGS:
            skip = True
        elif a.split("=", 1)[0] not in POOL_FLAGS:
            out.append(a)
    return out


#: The TP group's rendezvous flags (SGLang 0.5.17 server_args: dist_init_addr, nccl_port, tp_size).
TP_FLAGS = ("--tp-size", "--dist-init-addr", "--nccl-port")
#: Ports :func:`tp_ports` gives each GPU index: a group's two ports live at its first GPU's slot.
TP_PORTS_PER_GPU = 2
#: The TP port base when the inventory names none (``tp_port_base``).
TP_PORT_BASE = 31000
#: The interface NCCL's bootstrap and socket transport use inside one host.
NCCL_SOCKET_IFNAME = "lo"


def tp_ports(base: int, first_gpu: int) -> tuple:
    """``(dist_init_port, nccl_port)`` of the TP group whose lowest GPU index is ``first_gpu`` on a host whose TP
    port base is ``base``: ``base + 2*first_gpu`` and the next. Groups on one host share no GPU, so their first
    GPUs differ and their ports never meet."""
    if type(first_gpu) is not int or first_gpu < 0:
        raise ValueError(f"first GPU {first_gpu!r} must be a GPU index (an integer >= 0)")
    dist = base + TP_PORTS_PER_GPU * first_gpu
    if type(base) is not int or base < 1 or dist + 1 > 65535:
        raise ValueError(f"TP ports {dist}/{dist + 1} (base {base!r}, GPU {first_gpu}) are not TCP ports")
    return dist, dist + 1


def gpu_list(gpus) -> tuple:
    """A server's GPUs as a tuple of distinct indices in the order given (an int is one GPU)."""
    out = (gpus,) if type(gpus) is int else tuple(gpus)
    if not out or any(type(g) is not int or g < 0 for g in out) or len(set(out)) != len(out):
        raise ValueError(f"gpus {gpus!r} must be distinct GPU indices")
    return out


def sglang_args(mode: str, model: str, draft_model: str | None, *, budget, block: int | None,
                host: str, port: int, decode_graphs: bool, tp: int = 1, tp_port: tuple | None = None) -> list:
    """SGLang's arguments (after ``python -m sglang.launch_server``) that decide what a server of ``mode`` serves
    and where: the model, the speculative algorithm and its widths (``budget``: one budget or a
    :class:`BudgetSchedule`, whose largest width is D), the attention backend and page size, and the
    decode CUDA graphs. A deployed unit and a transient bench/smoke server both start from these; each appends
    its own (the unit: the served model name, metrics and the inventory's extra_args; the transient server: its
    pool caps). ``tp`` > 1: ``--tp-size`` and, where ``tp_port`` (:func:`tp_ports`) is given, the group's
    rendezvous ports (a transient server without them lets SGLang pick free ones)."""
    algo = algorithm(mode)
    if type(tp) is not int or tp < 1:
        raise ValueError(f"tp {tp!r} must be an integer >= 1")
    args = ["--model-path", model, "--host", host, "--port", str(port),
            "--attention-backend", ATTENTION_BACKEND, "--page-size", str(PAGE_SIZE)]
    if algo is not None:
        if not draft_model:
            raise ValueError(f"mode {mode} needs a draft model")
        if is_ddtree(mode) and (problem := budget_problem(budget, mode)):
            raise ValueError(f"budget {budget!r} {problem}")
        args += ["--speculative-algorithm", algo, "--speculative-draft-model-path", draft_model]
        if block is not None:  # the chain modes' width D (SGLang's DFLASH and the plugin read D from it)
            args += ["--speculative-dflash-block-size", str(block)]
        if mode == TREE_VERIFY:
            args += ["--speculative-num-draft-tokens", str(draft_tokens(mode, budget, block))]
    if not decode_graphs:
        args += ["--cuda-graph-backend-decode", "disabled"]
    if tp > 1:
        args += ["--tp-size", str(tp)]
        if tp_port is not None:
            dist, nccl = tp_port
            args += ["--dist-init-addr", f"127.0.0.1:{dist}", "--nccl-port", str(nccl)]
    return args


def server_path(venv: str) -> str:
    """``PATH`` of a server of the venv ``venv``: the venv's bin first (FlashInfer's JIT runs the venv's ``ninja``;
    without it a server dies at its first JIT build), then the system's."""
    return f"{venv.rstrip('/')}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"


def sglang_env(mode: str, budget, gpu) -> list:
    """The environment a server of ``mode`` needs on its GPU(s) ``gpu`` (an index, or the TP group's indices), in
    order: the GPUs (numbered as nvidia-smi numbers them, so index N is /dev/nvidiaN), NCCL's interface for a TP
    group (:data:`NCCL_SOCKET_IFNAME`) and, for DDTREE, the plugin allow-list, the mode and the budget (or
    schedule: :func:`budget_text`)."""
    gpus = gpu_list(gpu)
    env = [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", ",".join(map(str, gpus)))]
    if len(gpus) > 1:
        env += [("NCCL_SOCKET_IFNAME", NCCL_SOCKET_IFNAME)]
    if is_ddtree(mode):
        if problem := budget_problem(budget, mode):
            raise ValueError(f"budget {budget!r} {problem}")
        env += [(PLUGIN_ALLOWLIST_ENV, PLUGIN_NAME), (MODE_ENV, mode), (BUDGET_ENV, budget_text(budget))]
    return env
