"""SpecFed: worker pool discovery, the worker, the server-side backend, one federated generation."""
