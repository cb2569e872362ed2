"""Wheels rebuilt from installed distributions (PEP 427 / PEP 376), and their checks: the control-side face of
the agent's wheel library (deploy/remote/host/wheels.py), which runs on the hosts and here, one copy."""
from __future__ import annotations

from ..remote.host.fsutil import sha256_file
from ..remote.host.wheels import (WHEEL_NAME, WheelError, check_wheel, checked_filename, parse_record,
                                  parse_wheel_filename, record_hash, record_text, repack, verify_record,
                                  wheel_filename, wheel_matches_installed)

__all__ = ["WHEEL_NAME", "WheelError", "check_wheel", "checked_filename", "parse_record", "parse_wheel_filename",
           "record_hash", "record_text", "repack", "sha256_file", "verify_record", "wheel_filename",
           "wheel_matches_installed"]
