"""The agent runtime that runs on fleet hosts."""
