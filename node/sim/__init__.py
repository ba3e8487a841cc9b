"""The simulator, `cgad-node simulate`: the member engine on a virtual clock and an in-memory
network with injected delay, loss, bandwidth, stragglers, churn and attackers."""
