"""The dsd-node daemon: block server, head engine, federated worker, CLI."""
