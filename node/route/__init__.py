"""The head's ring client: route session, return legs, keeper (failover), backend, one generation."""
