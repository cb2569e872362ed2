"""Host-side library of the agent runtime (stdlib only)."""
