"""Confinement of child processes: host probing, Landlock, seccomp and namespaces.

Irreversible steps (restrict_self, loading a seccomp filter, unshare) only ever run in a child
process.
"""
