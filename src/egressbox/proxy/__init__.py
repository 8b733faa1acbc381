"""The egress proxy: the gate every request passes, and what serves it.

    dns    egressbox's DNS inside a child's namespace (names the policy could admit only)

The listeners, tunnels and plain-HTTP forwarding still live in server.py, connections.py,
forward.py and relay.py at the package's top level.
"""
