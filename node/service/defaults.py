"""The service's defaults, in a module without imports so `dsd-node --help` can show them at once."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_CONCURRENT = 4  # block peers admit 8 sessions per head by default (ServerLimits.max_sessions_per_peer)
DEFAULT_QUEUE = 16  # requests that may wait for a slot before the service answers 429
DEFAULT_MAX_TOKENS = 512  # completion tokens of a request without max_tokens (and at most what the context leaves)
DEFAULT_REFRESH_S = 15.0  # seconds between background surveys of the swarm
DEFAULT_MAX_BODY_MB = 8.0  # a 131072-token context with every character escaped (\uXXXX, 4 a token) is 3 MiB
DEFAULT_BODY_TIMEOUT_S = 10.0  # a body may take this long plus a second per 64 KiB: slow links pass, dribbles do not
DEFAULT_MAX_PER_CLIENT = 0  # no fixed cap: one client may fill an idle server; when full, it gives way (fair share)
