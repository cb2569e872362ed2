"""Releases: build (plugin wheel, overlays, units), gated rolling restarts with automatic rollback, status.

render.py and hybrid.py are pure; build.py builds locally. A rollout flows one way: changes.py decides from a
host's probe which GPUs restart, why and in what order; payload.py builds the agent request that carries it out;
plan.py makes one host's deploy plan (a pure value) from both; progress.py prints a run's lines; agentcalls.py is
the one place that calls the host agent (probe, apply, the outcome after a lost link); rollout.py drives deploy,
rollback and restart over the fleet. The agent's side is deploy/remote/host/release.py. status.py gathers and
prints fleet state.
"""
