"""The programs a person runs: the swarm CLI, bootstrap, trainer, monitor, local launcher."""
