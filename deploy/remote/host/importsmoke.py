"""The smoke import of provision: every top-level module of the distributions it ships, imported in the venv's
python, judged against the same import on the reference.

The child program (CODE) imports each module in turn and writes one JSON line per module to its own copy of
stdout ({"module": m, "error": null} or {"module": m, "error": "ModuleNotFoundError: No module named 'x'"});
everything the imported modules print goes to stderr, so stdout holds those lines only. A module whose import
ends the process (a crash, os._exit) leaves it and every later module without a line: `parse` reports them as
failed. The reference runs the same program at plan time (provision.scan); the target passes when every module
that imports on the reference imports there too (`judge`). Pure functions but the child; stdlib only.
"""
import json

ERROR_CHARS = 300     # an exception line is cut here: the output stays bounded whatever a module raises
LINE_CHARS = 200 + 2 * ERROR_CHARS  # the most one well-formed line takes (module name + error, JSON-escaped)

CODE = ("import importlib, json, os, sys, traceback\n"
        "out = os.fdopen(os.dup(1), 'w')\n"
        "os.dup2(2, 1)\n"                    # what the modules print goes to stderr; stdout is the report
        "mods = json.loads(sys.argv[1])\n"
        "failed = set()\n"
        "for m in mods:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "        err = None\n"
        "    except BaseException as e:\n"
        "        lines = traceback.format_exception_only(type(e), e)\n"
        "        err = (lines[-1].strip() if lines else type(e).__name__)[:%d]\n"
        "        failed.add(m)\n"
        "    out.write(json.dumps({'module': m, 'error': err}) + '\\n')\n"
        "    out.flush()\n"
        "if sys.argv[2] == 'cuda' and 'torch' not in failed:\n"  # a torch that fails to import is judged above
        "    import torch\n"
        "    torch.cuda.init()\n"
        "    print('cuda devices', torch.cuda.device_count())\n"
        "print('imported', len(mods) - len(failed), 'of', len(mods), 'modules')\n") % ERROR_CHARS


def output_cap(modules):
    """The stdout the child may write for `modules` (run()'s capture limit)."""
    return LINE_CHARS * (len(modules) + 4)


def parse(out, modules, rc=0, timed_out=False):
    """The child's stdout -> {module: None (imported) or its exception line}, for exactly `modules`. Lines that are
    not a report of one of them are ignored; a module with no line failed: the first one is where the process
    ended (exit `rc`, or the deadline), the others were not reached."""
    got = {}
    wanted = set(modules)
    for line in (out or "").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("module") not in wanted or obj["module"] in got:
            continue
        err = obj.get("error")
        got[obj["module"]] = None if err is None else str(err)[:ERROR_CHARS]
    first = None
    for m in modules:
        if m in got:
            continue
        if first is None:
            first = m
            got[m] = ("the import did not finish before the deadline" if timed_out
                      else "the import ended the smoke process (exit %s)" % rc)
        else:
            got[m] = "not reached: the smoke process ended at %s" % first
    return dict((m, got[m]) for m in modules)


def judge(target, reference):
    """The target's smoke results against the reference's ({module: None or exception line} each): a module that
    fails on the target fails the apply unless it fails on the reference too (then it is a warning). A module the
    reference did not report must import. Returns {imported, failed_on_both, failed}."""
    reference = reference or {}
    both, failed = {}, {}
    for m, err in sorted(target.items()):
        if err is None:
            continue
        if reference.get(m) is not None:
            both[m] = err
        else:
            failed[m] = err
    return {"imported": sorted(m for m, e in target.items() if e is None), "failed_on_both": both,
            "failed": failed}


def listed(failures):
    """'anthropic (ModuleNotFoundError: No module named 'httpx2')', ... for a {module: error} map."""
    return ", ".join("%s (%s)" % (m, e) for m, e in sorted(failures.items()))


def warnings(verdict):
    """One line per module that failed on the target and on the reference alike."""
    return ["fails on the reference too: %s" % listed({m: e}) for m, e in sorted(verdict["failed_on_both"].items())]


def failure(verdict):
    """The apply's error when a module fails on the target only; None when none does."""
    if not verdict["failed"]:
        return None
    return "smoke import failed on the target, not on the reference: %s" % listed(verdict["failed"])


def checked_reference(obj):
    """A reference smoke map from the control machine: {module name: None or a string}; raises ValueError."""
    if obj is None:
        return {}
    if not isinstance(obj, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, str))
                                            for k, v in obj.items()):
        raise ValueError("reference_smoke must map module names to null or an error line")
    return dict((k, None if v is None else v[:ERROR_CHARS]) for k, v in obj.items())
