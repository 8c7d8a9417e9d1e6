"""Small builders shared by the engine tests."""

from __future__ import annotations

from engine.config import EngineConfig


def small_config(**overrides) -> EngineConfig:
    """A fast engine: small pools, small pages, the built-in tiny model."""
    fields = dict(page_size=4, num_kv_pages=256, max_running=8, max_context=256, max_prefill_tokens=64,
                  use_entry_points=False)
    fields.update(overrides)
    return EngineConfig(**fields)


class Clock:
    """A hand-set monotonic clock for machines and fences."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def collect(stream) -> list:
    """Every output of a stream, in order."""
    return [output async for output in stream]


def live_request(engine, request_id: str):
    """The live request with this id (one sequence), or None."""
    return next((r for r in engine.loop.requests() if r.request_id == request_id), None)


def abort_when_step_sees(engine, request_id: str, state) -> None:
    """Abort `request_id` the first time a model step ends with it in `state`."""
    sent: set[str] = set()

    def observer(batch, output):
        request = live_request(engine, request_id)
        if request is not None and request.state is state and request_id not in sent:
            sent.add(request_id)
            engine.loop.abort(request_id)

    engine.loop.finisher.step_observers.append(observer)
