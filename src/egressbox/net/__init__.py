"""Sockets and the event loop: resolving, dialling pinned addresses, relaying."""

# Compiled by mypyc (setup.py reads this tuple from the source, never importing it):
# deadlines (three or four a connection), uvloop's transport table, dialling, the relay.
COMPILED = ("deadlines", "eventloop", "dial", "relay")
