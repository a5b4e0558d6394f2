"""The read side: read-only SQL on any backend, the saved queries, and the read endpoint the sink serves on its store."""
