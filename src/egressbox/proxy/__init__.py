"""The egress proxy: one gate every request passes, and what serves it.

    gate       the decision and its audit record for every request of every listener;
               ProxyState, shared by every connection
    tunnel     a client connection until it is a tunnel (the dial, the TLS name check, the relay)
    listeners  the HTTP (CONNECT and plain forwarding) and SOCKS5 listeners' protocols
    forward    plain HTTP forwarding, request by request
    server     EgressProxy: listeners, limits, drain, reload
    dns        the DNS a child's namespace asks (names the policy could admit only)
    approval   approval on a miss: the questions a decider answers (deny, once, session)

Imports run one way: server -> listeners -> forward -> tunnel -> gate -> approval (a test
fails on a cycle).
"""

# Compiled by mypyc (setup.py reads this tuple from the source, never importing it):
# the per-connection glue: decision, gate, tunnels, listeners, forwarding, the server.
COMPILED = ("check", "tls_check", "gate", "tunnel", "listeners", "forward", "server")
