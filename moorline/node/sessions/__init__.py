"""Live sessions: delivery to connected clients and the recently-applied message cache."""
