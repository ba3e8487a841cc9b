"""The front: the `cgad-node` command line, the demo, export, the swarm monitor, plots, progress."""
