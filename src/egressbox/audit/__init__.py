"""The audit record (one serializer, one parser), its sinks, reading and suggesting."""

# Compiled by mypyc (setup.py reads this tuple from the source, never importing it):
# one record per decision, before the reply.
COMPILED = ("record",)
