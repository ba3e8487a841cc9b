"""The daemon, `cgad-node join`: the member engine on the wall clock and the network, with
snapshots to join by, checkpoints, and what a node shows (admin API, dashboard, metrics, status)."""
