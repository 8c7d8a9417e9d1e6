"""Small builders shared by the engine tests."""

from __future__ import annotations

from engine.config import EngineConfig


def small_config(**overrides) -> EngineConfig:
    """A fast engine: small pools, small pages, the built-in tiny model."""
    fields = dict(page_size=4, num_kv_pages=256, max_running=8, max_context=256, max_prefill_tokens=64,
                  use_entry_points=False)
    fields.update(overrides)
    return EngineConfig(**fields)


async def collect(stream) -> list:
    """Every output of a stream, in order."""
    return [output async for output in stream]


def abort_when_step_sees(engine, request_id: str, state) -> None:
    """Queue an abort for `request_id` the first time a model step ends with it in `state`."""
    from states import FinishReason

    def observer(batch, output):
        request = engine.loop.requests.get(request_id)
        if request is not None and request.state is state and "abort_sent" not in request.extras:
            request.extras["abort_sent"] = True
            engine.loop.pending_aborts.append((request_id, FinishReason.ABORT))

    engine.loop.step_observers.append(observer)
