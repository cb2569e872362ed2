"""Releases: build (plugin wheel, overlays, units), gated rolling restarts with automatic rollback, status.

render.py and hybrid.py are pure; build.py builds locally; rollout.py plans hosts and drives them through the
agent runtime's release ops (deploy/remote/host/release.py); status.py gathers and prints fleet state.
"""
