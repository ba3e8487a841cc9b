"""The one exception for input that must not reach the optimizer."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["FragmentError"]


class FragmentError(ValueError):
    """Bytes or a record that fail validation.

    ``reason`` is a short machine-readable tag (``"bad_checksum"``, ``"truncated"``, ``"forged"``,
    ...): transports count rejections by it, so keep the set of reasons small and stable.
    """

    def __init__(self, reason: str, detail: str = "", blamed: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
        # a download that failed: the holders at fault (peer id -> "bad_hash": bytes of its own
        # that failed the signed hash; "slow": slower than the download needed), not the others
        self.blamed: Mapping[str, str] = dict(blamed or {})
