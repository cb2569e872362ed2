"""Moved into the plugin (``sglang_ddtree_tools.profile_step``) so that ``python -m sglang_ddtree_tools.bench --profile-steps``
can profile each server it starts; kept here so ``ddtree_checks.graph_check`` and older commands still import it."""

from sglang_ddtree_tools.profile_step import load_trace, profile_server, summarize_trace  # noqa: F401
