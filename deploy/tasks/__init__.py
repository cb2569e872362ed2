"""The `fab` task collection. Each submodule holds thin tasks: parse arguments, call the library, print.

Submodules register their tasks in TASK_MODULES order; `fabfile.py` exposes `ns`.
"""
from importlib import import_module

from invoke import Collection

# (module, as a namespace?) -- namespaced modules give `fab lab.up`; the others are top-level tasks.
TASK_MODULES = [("inventory", False), ("lab", True), ("provision", False), ("release", False), ("runbook", False),
                ("smoke", False), ("bench", False)]

ns = Collection()
for _name, _namespaced in TASK_MODULES:
    try:
        _mod = import_module(f"{__name__}.{_name}")
    except ModuleNotFoundError as _exc:  # a module not written yet; never hide a broken import inside one
        if _exc.name != f"{__name__}.{_name}":
            raise
        continue
    if _namespaced:
        ns.add_collection(Collection.from_module(_mod), name=_name)
    else:
        for _task in getattr(_mod, "TASKS", []):
            ns.add_task(_task)
