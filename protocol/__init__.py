"""Everything that leaves a node's process: wire messages, DHT records, tensor codecs, transports."""
