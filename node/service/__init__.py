"""The head as an HTTP service (`dsd-node serve`): an OpenAI-compatible API, metrics, and hooks for the swarm page."""
