"""The audit record (one serializer, one parser), its sinks, reading and suggesting."""
