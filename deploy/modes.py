"""Speculative decoding modes the toolkit deploys, and the ranges of their parameters.

The modes, their SGLang algorithms, the linear = dflash alias, the plugin's environment names, the node budget's
bounds and D = B + 1 are the plugin's contract (deploy.contract, the plugin's sglang_ddtree/contract.py, read by
the control side, the host agent and the plugin alike); this module re-exports what the inventory and the CLI use
and adds the toolkit's own ranges and defaults.
"""
from __future__ import annotations

from .contract import AUTO, BUDGET_MAX, BUDGET_MIN, INVENTORY_MODES, MODES, TREE_VERIFY  # noqa: F401

CONCURRENCY_MIN, CONCURRENCY_MAX = 1, 4096
# `concurrency: all` (with `mode: auto`): sized for every load, so fab deploy gives it the budget schedule fab bench
# proposes (deploy/bench.py choose_schedule)
CONCURRENCY_ALL = "all"
# DFlash block size (draft tokens per block) used by the drafter in every mode.
BLOCK_SIZE_MIN, BLOCK_SIZE_MAX = 2, 64

DEFAULTS = {"mode": TREE_VERIFY, "budget": 64, "block_size": 16}
