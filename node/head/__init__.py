"""The head's logic without sockets: engine, drafters, verifier, adaptive τ, window controller, sampling, setup, streaming."""
