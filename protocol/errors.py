"""The one exception for input that must not reach the optimizer."""

from __future__ import annotations

__all__ = ["FragmentError"]


class FragmentError(ValueError):
    """Bytes or a record that fail validation.

    ``reason`` is a short machine-readable tag (``"bad_checksum"``, ``"truncated"``, ``"forged"``,
    ...): transports count rejections by it, so keep the set of reasons small and stable.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
