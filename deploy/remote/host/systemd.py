"""Read-only systemd queries (unit states, journal lines). Commands that change units come from the control
machine as argv (deploy/remote/commands.py); these only look."""
from .proc import run

UNIT_PREFIX = "sglang-ddtree@"


def unit(inst):
    return "%s%s.service" % (UNIT_PREFIX, inst)


def parse_show(out):
    """`systemctl show --property ...` of several units -> {Id: {property: value}}."""
    states, cur = {}, {}
    for line in (out + "\n").splitlines() + [""]:
        if not line.strip():
            if cur.get("Id"):
                states[cur["Id"]] = cur
            cur = {}
            continue
        k, _, v = line.partition("=")
        cur[k] = v
    return states


PROPS = "Id,ActiveState,SubState,NRestarts,ExecMainStatus,UnitFileState,InvocationID,MainPID"


def named_states(units, timeout=30):
    """{unit name: properties} of whole unit names (sglang-router.service)."""
    if not units:
        return {}
    states = parse_show(run(["systemctl", "show", "--property", PROPS] + list(units), timeout)["out"])
    return dict((u, states.get(u, {})) for u in units)


def unit_states(insts, timeout=30):
    if not insts:
        return {}
    states = named_states([unit(i) for i in insts], timeout)
    return dict((i, states.get(unit(i), {})) for i in insts)


def journal_lines(inst, n=20, since=None, timeout=60, unit_name=None):
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "-n", str(int(n)), "-u", unit_name or unit(inst)]
    if since:
        argv += ["--since", since]
    return run(argv, timeout)["out"].splitlines()
