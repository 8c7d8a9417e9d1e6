"""The disaggregation roles, each an install.

- `DecodeRole`: requests are admitted into TRANSFERRING; the `kv_transfer`
  hook hands each a job for a prefill (`PrefillClient`: the in-process
  prefill runtime, or remote prefill servers) and lands the KV, in the KV
  pages or where an earlier install says (HiSparse's host rows, in which case
  n > 1 followers transfer too and admission takes no KV page).
- `PrefillRole`: requests end with their first token; the `kv_send` hook
  sends their KV through the role's `KVSender`, the `prefill_job` hook
  answers each job on every path, and a job's clock starts at admission.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from engine.disagg.decode.kv_transfer_hook import KVTransferHook, PrefillClient
from engine.disagg.prefill.prefill_hooks import JobInbox, KVSendHook, PrefillJobHook, arm_on_admission
from engine.disagg.prefill.send import KVSender
from engine.runtime.features.base import BuildContext, FeatureInstall, Installed
from resources.ledger import Pool
from states import RequestState

S = RequestState


class DecodeRole:
    def __init__(self, make_client: Callable[[BuildContext], PrefillClient]) -> None:
        self.make_client = make_client

    def install(self, ctx: BuildContext, so_far: Installed) -> FeatureInstall:
        client = self.make_client(ctx)
        landing = so_far.landing
        hook = KVTransferHook(client, ctx.kv_pool, ctx.kv_buffers, ctx.config.fence_timeout, landing=landing)
        role = lambda r: attrs.evolve(  # noqa: E731
            r, name="decode", admit_into=S.TRANSFERRING, transfer_job=KVTransferHook.job,
            transfer_unavailable=client.unavailable, followers_transfer=landing is not None,
            admission_takes_pages=landing is None)
        return FeatureInstall(hooks=[hook], pools=list(client.pools), prefill_client=client, role=role)


class PrefillRole:
    """The prefill role; after its install, `inbox` and `sender` are what `PrefillRuntime` feeds."""

    def __init__(self, make_sender: Callable[[BuildContext], KVSender]) -> None:
        self.make_sender = make_sender
        self.inbox = JobInbox()
        self.sender: KVSender | None = None

    def install(self, ctx: BuildContext, so_far: Installed) -> FeatureInstall:
        self.sender = sender = self.make_sender(ctx)
        pools: list[Pool] = [] if sender.staging is None else [sender.staging]
        return FeatureInstall(hooks=[KVSendHook(sender, ctx.kv_pool), PrefillJobHook(self.inbox)], pools=pools,
                              transition_observers=[arm_on_admission],
                              role=lambda r: attrs.evolve(r, name="prefill", after_prefill=None))
