"""Errors for image input: each one is a single line naming the file and the cause."""

from __future__ import annotations

from ..errors import MiniappError


class ImageInputError(MiniappError):
    """An attached file that cannot be used as an image (missing, corrupt, too big, not an
    image, or a format we do not accept). The chat reports it and goes on."""

    def __init__(self, source: str, reason: str):
        self.source = source
        self.reason = reason
        super().__init__(f"{source}: {reason}")
