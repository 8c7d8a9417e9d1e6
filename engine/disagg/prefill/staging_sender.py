"""Deprecated module: the prefill server's sender is `engine.disagg.prefill.link_sender.LinkSender`
(it sends from the KV pages where it can, and stages only where it must). `StagingSender` is
kept as its alias for a release."""

from __future__ import annotations

from engine.disagg.prefill.link_sender import LinkSender

StagingSender = LinkSender

__all__ = ["StagingSender"]
