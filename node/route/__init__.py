"""The head's route: the session streams, the client that carries out its state's decisions (probes, plans, new sessions), the backend that replays into a new route, and opening one."""
