"""`fab provision`: reconcile a host's managed Python distributions with the reference host's.

plan.py (pure plan and blockers), drivers.py (driver table), agent.py (the remote program),
wheels.py (RECORD repack and checks), cache.py (control-side wheel cache), transfer.py (SFTP),
overlay.py (the per-host run: stage, back up, install offline, verify; and undo).
"""
