"""The shared parts of the benchmarks: one resumable sweep runner."""
