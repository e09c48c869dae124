"""What the agent tells people: events (kinds, listeners, JSON lines), Prometheus metrics, the status file.

Nothing here changes what the agent does; every sink is fed from the agent's event stream."""
