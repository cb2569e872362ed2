"""The errors of an agent call, in a module of their own so that the SSH layer (deploy.ssh), which the client
uses, can catch them without importing the client."""
from __future__ import annotations


class AgentError(RuntimeError):
    """A failed agent call, with a short kind ('timeout', 'link-lost', 'locked', 'unsafe', 'sudo', ...)."""

    def __init__(self, kind: str, message: str, reply: dict | None = None):
        super().__init__(f"{kind}: {message}" if kind not in message[:len(kind) + 2] else message)
        self.kind, self.message, self.reply = kind, message, reply or {}


class LinkLost(AgentError):
    """The link died. `handshake_cut`: OpenSSH's `ssh` said sshd ended the connection during its handshake, before
    anything ran on the host or a byte moved (ssh.openssh_handshake_cut): a new stream may be made at once."""

    handshake_cut = False
