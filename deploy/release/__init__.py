"""Releases: build (plugin wheel, overlays, units), gated rolling restarts with automatic rollback, status.

render.py and hybrid.py are pure; build.py builds locally; agent.py is the stdlib program run on hosts;
rollout.py drives hosts over SSH; status.py gathers and prints fleet state.
"""
