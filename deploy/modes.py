"""Speculative decoding modes the toolkit deploys, and the ranges of their parameters.

One place for these so that inventory validation, unit rendering and the CLI agree.
"""
from __future__ import annotations

# linear: SGLang's builtin DFLASH (one chain per step).
# shadow-linear: DDTree builds the tree and reports what it would have accepted, but commits
#                through the chain verifier (safe to run on any model).
# tree-verify: DDTree verifies the whole tree in one target pass.
MODES = ("linear", "shadow-linear", "tree-verify")
# auto (inventory only): `fab deploy` gives the service the mode and budget that `fab bench` measured fastest on
# its host, for the plugin being deployed and the service's model, at the service's `concurrency` (deploy/bench.py).
AUTO = "auto"
INVENTORY_MODES = MODES + (AUTO,)
CONCURRENCY_MIN, CONCURRENCY_MAX = 1, 4096

# DDTree node budget B (the tree has B nodes plus the bonus token: D = B + 1 draft tokens).
BUDGET_MIN, BUDGET_MAX = 1, 512
# DFlash block size (draft tokens per block) used by the drafter in every mode.
BLOCK_SIZE_MIN, BLOCK_SIZE_MAX = 2, 64

DEFAULTS = {"mode": "tree-verify", "budget": 64, "block_size": 16}
