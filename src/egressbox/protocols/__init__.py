"""Sans-IO protocol code: bytes in, parsed values, events or reply bytes out.

Nothing in this package may import asyncio, socket, ssl, selectors or
threading (a test scans for it): the asyncio server is glue around these
state machines, so every parser can be tested by feeding it bytes in any
chunking, and fuzzed without a network.
"""

# Compiled by mypyc (setup.py reads this tuple from the source, never importing it):
# the parsers of every request head and handshake, and a tunnel's first bytes.
COMPILED = ("http1", "socks5", "tls")
# Pure: no module here imports an event loop, sockets, threads or processes
# (tests/test_imports.py holds it).
PURE = True
