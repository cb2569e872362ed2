"""The one agent runtime: every remote operation of ddtree-deploy speaks one protocol through one client.

Control side: zipapp.py builds the host package (deploy/remote/host) into one content-addressed zipapp;
client.py ships it once per host into a root-owned 0700 state directory (/var/lib/ddtree) and then invokes it
by hash over the host's SSH connection, with a deadline on every call, heartbeats for long ones, and OpenSSH's
own transport for bulk bytes; commands.py builds every command that changes a host as an argv list.
"""
