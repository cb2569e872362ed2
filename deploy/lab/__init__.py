"""The built-in lab fleet (systemd-nspawn hosts with real systemd and sshd); see fleet.py."""
