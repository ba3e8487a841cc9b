"""One peer of the swarm: config, CLI, model and data, inner trainer, outer loop, checkpoints."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cgad-node")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
