"""`fab provision`: reconcile a host's managed Python distributions with the reference host's.

plan.py (pure plan and blockers), drivers.py (driver table), wheels.py (the agent's wheel checks, control
side), cache.py (control-side wheel cache), transfer.py (OpenSSH wheel transfers), overlay.py (the per-host
run: stage, back up, install offline, verify; and undo). What runs on the hosts is the agent runtime's
provision ops (deploy/remote/host/provision.py).
"""
