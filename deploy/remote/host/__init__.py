"""The host side of the agent runtime: a stdlib-only package shipped to every host as one zipapp.

loader.py   the small program in argv: checks the private state directory, runs (or receives) the zipapp
envelope.py the request/reply framing both sides speak
main.py     the entry point: lock handling, op dispatch, replies; OP_MODULES lists the op modules
registry.py @op registration and the Context every op runs in
fsutil.py, proc.py, locks.py, wheels.py, venv.py, systemd.py, gate.py   shared helpers (one copy each)
probe.py, provision.py, release.py, lockops.py, smoke.py, bench.py   the ops (one module per area)
releasehost.py  what one release.apply works on (ReleaseHost: context, arguments, paths, running a command);
            the release op's steps, one module each: releasedir.py (layout, staging, `current`, what is kept),
            activation.py (the activation transaction), unitfiles.py (unit files and drop-ins), routerunit.py
            (the router unit), services.py (drained, gated restarts and stops), rollback.py, secretcheck.py
dists.py, elfsyms.py   readers of a venv's installed distributions and of native extensions' torch symbols
            (deploy/coherence.py judges what they report; not called by an op yet)

Runs under the host's python3 (3.8 or newer: Debian bookworm 3.11, the GPU hosts' 3.12). The control machine
imports the same modules for their pure helpers (wheel names and checks, the envelope).
"""
