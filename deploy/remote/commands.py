"""Every command that changes a host, built here as an argv list (Kamal's habit): the plan prints them, the
tests assert them, and the agent runs them as given (appending only the private paths and names it verified).
Pure functions; nothing here runs anything."""
from __future__ import annotations

from .host.importsmoke import CODE as SMOKE_CODE


def venv_python(venv: str) -> str:
    return f"{venv}/bin/python"


def pip_install(python: str, wheels: list[str] | tuple = ()) -> list[str]:
    """Install exact wheel files offline (--isolated: no pip.conf or PIP_* setting of the host, such as a
    constraint file or an index, can change what is installed)."""
    return [python, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps", "--force-reinstall",
            "--disable-pip-version-check", "--no-input", "--no-cache-dir"] + list(wheels)


def pip_uninstall(python: str, names: list[str] | tuple = ()) -> list[str]:
    return [python, "-m", "pip", "uninstall", "--isolated", "--yes", "--disable-pip-version-check",
            "--no-input"] + list(names)


def smoke(python: str) -> list[str]:
    """Import every top-level module of the distributions provision ships, one JSON line per module on stdout
    (host/importsmoke.py); the agent appends the module list as JSON and 'cuda' or 'nocuda'. -B: no bytecode
    written (the reference runs it at plan time and stays as it was)."""
    return [python, "-I", "-B", "-c", SMOKE_CODE]


def systemctl(verb: str, units: list[str] | tuple = (), *flags: str) -> list[str]:
    return ["systemctl", verb, *flags, *units]


def useradd(user: str) -> list[str]:
    return ["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
            "--user-group", user]


def shown(argv: list[str]) -> str:
    """An argv as one shell-quoted line, for the plan."""
    import shlex
    return shlex.join(argv)
