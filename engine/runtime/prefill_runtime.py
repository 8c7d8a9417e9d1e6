"""`PrefillRuntime`: the prefill role of the one runtime, driven by decode requests' jobs.

The decode role's in-process prefill is one (the `PrefillClient` of the
decode engine's `kv_transfer` hook, copying into the decode's memory); so is
the heart of `PrefillServer` (staging for its links). Either way the jobs
run on a `RuntimeLoop` with the prefill role's parts: the same intake,
planner, scheduler, batches and step applier as every engine, the prefill
role's hooks (`engine.disagg.prefill.prefill_hooks`) owning the job and the
send, and the loop's own idle leak check.

A job becomes a request ``prefill:<decode request id>`` (its prompt, and the
tokens the decode generated before a retraction as its outputs so far), with
no stream: its hooks answer the job. `cancel` finishes the request with
ABORT (a job not admitted yet is answered at once: nothing ever wrote the
decode's pages for it).
"""

from __future__ import annotations

from typing import Any

import anyio
import attrs
from anyio.abc import TaskStatus

from engine.disagg.decode.kv_transfer_hook import TransferJob, cancel_unstarted
from engine.disagg.prefill.prefill_hooks import JobInbox, why_unsent
from engine.disagg.prefill.send import KVSender
from engine.errors import EngineClosed, EngineDead, EngineOverloaded
from engine.runtime.loop import RuntimeLoop
from engine.runtime.parts import EngineParts
from engine.runtime.table import Submission
from resources.ledger import Ledger, MemoryReport, Owner, Pool, PoolUsage, check_memory, memory_report
from states import FinishReason, Request, RequestMachine

#: the prefix of a prefill request's id
PREFILL_ID = "prefill:"


class PrefillRuntime:
    """A `RuntimeLoop` in the prefill role, fed with `TransferJob`s (see the module docstring)."""

    def __init__(self, parts: EngineParts, *, inbox: JobInbox, sender: KVSender, extra_pools: list[Pool] | None = None,
                 report_prefix: str = "") -> None:
        self.parts = parts
        self.machine: RequestMachine = parts.machine
        self.inbox = inbox
        self.sender = sender
        #: this runtime's pools (its own leak check covers them)
        self.own_pools: list[Pool] = [*parts.pools, *(extra_pools or [])]
        #: the same as a decode engine's memory report shows them ("prefill.kv_pages", ...)
        self.pools: list[Pool] = ([PrefixedPool(report_prefix, pool, parts.ledger) for pool in self.own_pools]
                                  if report_prefix else self.own_pools)
        self.loop = RuntimeLoop(parts, tokenizer=parts.tokenizer, max_context=parts.max_context,
                                check_memory=self.check_memory, memory_report=self.memory_report)
        self._submissions: dict[int, Submission] = {}  # id(job) -> its submission, until released
        self._job_of: dict[Request, int] = {}
        self.loop.gateway.release_observers.append(self._forget)

    # ------------------------------------------------------- PrefillClient
    def submit(self, job: TransferJob) -> None:
        """Run `job`: a prefill request through this runtime; its hooks answer the job."""
        params = job.params
        if hasattr(params, "detokenize"):  # nobody reads its text: no detokenizing, no stop strings
            params = attrs.evolve(params, detokenize=False, stop=())
        asks = getattr(params, "logprobs", None) is not None
        request = Request(f"{PREFILL_ID}{job.request_id}", list(job.prompt_token_ids), params,
                          mm_inputs=list(job.mm_inputs), output_token_ids=list(job.output_token_ids),
                          output_logprobs=[None] * len(job.output_token_ids) if asks else [])
        self.inbox.put(request, job)
        try:
            submission = self.loop.submit_to(request.request_id, [request], None)
        except (EngineOverloaded, EngineClosed, EngineDead) as exc:
            self.inbox.take(request)
            job.resolve("failed", exc)
            return
        self._submissions[id(job)] = submission
        self._job_of[request] = id(job)

    def cancel(self, job: TransferJob) -> None:
        """Give the job up: answered at once if its request was not admitted yet, else as soon
        as nothing writes the decode's pages any more (its request is aborted)."""
        cancel_unstarted(job)
        submission = self._submissions.get(id(job))
        if submission is not None and not all(r.is_finished for r in submission.requests):
            self.loop.table.aborts.append((submission, FinishReason.ABORT))
            self.loop.wake()

    def unavailable(self) -> str | None:
        """Never: the in-process prefill is always there."""
        return None

    @property
    def idle(self) -> bool:
        return self.loop.idle

    @property
    def jobs_in_flight(self) -> dict[int, Submission]:
        """The jobs whose request is not released yet (by job identity)."""
        return self._submissions

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self.loop.bind()  # NOTE: its waiting primitives in the async library running it, whichever built it
        await self.loop.run(task_status=task_status)

    async def close(self) -> None:
        """Finish every job's request with SHUTDOWN (their jobs answered), wait for the sends
        in flight (bounded by their fences), and stop the sending thread."""
        await self.loop.shutdown()
        await anyio.to_thread.run_sync(self.sender.close)

    # --------------------------------------------------------------- memory
    def memory_report(self) -> MemoryReport:
        return memory_report(self.own_pools, self.parts.ledger, idle=self.idle, **self._report_extra())

    def check_memory(self) -> MemoryReport:
        return check_memory(self.own_pools, self.parts.ledger, idle=self.idle, **self._report_extra())

    def _report_extra(self) -> dict[str, Any]:
        loop = self.loop
        return dict(live_requests=loop.num_live, leaks_found=loop.stats.leak_check_failures,
                    last_leak=loop.last_leak, starved=loop.starved())

    def _forget(self, request: Request) -> None:
        """`request` was released (a release observer). A job its `prefill_job` hook never took (a
        request finished before its start succeeded, or at shutdown before it started) is
        answered here, so no job is ever left unanswered."""
        key = self._job_of.pop(request, None)
        if key is not None:
            self._submissions.pop(key, None)
        job = self.inbox.take(request)
        if job is not None and job.outcome is None:
            job.resolve("failed", why_unsent(request, job))


class PrefixedPool:
    """A pool of another runtime (the in-process prefill's) in an engine's memory report: its
    name prefixed, accounted in that runtime's own ledger."""

    def __init__(self, prefix: str, pool: Pool, ledger: Ledger) -> None:
        self.name = prefix + pool.name
        self.pool = pool
        self.ledger = ledger  # NOTE: the report reads held/quarantined from this ledger under `ledger_name`
        self.ledger_name = pool.name

    def stats(self) -> PoolUsage:
        return self.pool.stats()

    def shared_owners(self) -> list[Owner]:
        shared = getattr(self.pool, "shared_owners", None)
        return shared() if shared is not None else []
