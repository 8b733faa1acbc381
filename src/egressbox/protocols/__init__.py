"""Sans-IO protocol code: bytes in, parsed values, events or reply bytes out.

Nothing in this package may import asyncio, socket, ssl, selectors or
threading (a test scans for it): the asyncio server is glue around these
state machines, so every parser can be tested by feeding it bytes in any
chunking, and fuzzed without a network.
"""
