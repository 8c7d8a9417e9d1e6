"""A runtime's role: how its requests are admitted and what their first token leads to.

The same loop, planner, scheduler and step applier drive every role; the role
only says:

- `admit_into`: PREFILLING (the engine computes the prompt), or TRANSFERRING
  (the decode role: a prefill elsewhere computes it and the KV is copied in);
- `after_prefill`: where a request goes from PREBUILT when its first token
  does not end it: DECODING, STAGING with HiSparse, or None in the prefill
  role, whose requests always end with their first token (QUEUED ->
  PREFILLING -> PREBUILT -> FINISHED: the job is the prompt's KV and one
  token, which the prefill role's hooks send);
- `transfer_job`: the decode role's accessor of a TRANSFERRING request's job;
- `transfer_unavailable`: the decode role's "why no prefill can take a job now"
  (`PrefillClient.unavailable`): while it says why, the requests that would
  need a job finish TRANSFER_FAILED instead of pre-allocating KV;
- `followers_transfer`: whether the other sequences of an n > 1 request are
  admitted as their leader is, instead of prefilling only the tail past the
  leader's published prompt pages (HiSparse's decode role: the KV lands in
  host rows, so no device page is published to share);
- `admission_takes_pages`: whether admitting into `admit_into` takes a request
  slot and KV pages (not for HiSparse's decode role, whose transfer lands in
  host rows).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from engine.disagg.decode.kv_transfer_hook import TransferJob
from states import Request, RequestState

S = RequestState


@attrs.frozen
class Role:
    name: str = "single"
    admit_into: RequestState = S.PREFILLING
    after_prefill: RequestState | None = S.DECODING
    transfer_job: Callable[[Request], TransferJob] | None = None
    transfer_unavailable: Callable[[], str | None] | None = None
    followers_transfer: bool = False
    admission_takes_pages: bool = True

    def admits(self, request: Request, leader: Request) -> RequestState:
        """The state `request` is admitted into (`leader`: the first sequence of its submission)."""
        if request.local_prefill:  # issue 21: its KV (a session's) or its prompt logprobs live here
            return S.PREFILLING
        if request.shares_prompt and request is not leader and not self.followers_transfer:
            return S.PREFILLING  # it prefills only the tail past the leader's published prompt pages
        return self.admit_into

    def takes_pages(self, request: Request, leader: Request) -> bool:
        """Whether admitting `request` takes a request slot and KV pages."""
        return self.admission_takes_pages or self.admits(request, leader) is S.PREFILLING
