"""Sockets and the event loop: resolving, dialling pinned addresses, relaying."""
