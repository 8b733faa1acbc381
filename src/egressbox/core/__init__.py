"""The pure floor: hosts, addresses, rules, the policy and the decision; no I/O."""

# Compiled by mypyc (setup.py reads this tuple from the source, never importing it):
# host text, the address table, the rules and the decision.
COMPILED = ("hosts", "addresses", "rules", "decide")
# Pure: no module here imports an event loop, sockets, threads or processes
# (tests/test_imports.py holds it).
PURE = True
