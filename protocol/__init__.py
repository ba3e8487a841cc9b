"""Everything that leaves a node's process: wire messages, DHT records, tensor codecs, transports."""

from cgad.protocol.errors import FragmentError

__all__ = ["FragmentError"]
