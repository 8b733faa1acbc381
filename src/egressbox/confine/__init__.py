"""Confinement of child processes: host probing, Landlock, seccomp and namespaces.

Its face is confine/face.py: face.plan(request, facts) -> Plan, pure, and face.launch(plan) ->
Launched. (The name `confine.plan` is the module of the plan's types, confine/grants.py, which
the probe and the policy tables import; the face's functions live beside it.)

Irreversible steps (restrict_self, loading a seccomp filter, unshare) only ever run in a child
process.
"""
