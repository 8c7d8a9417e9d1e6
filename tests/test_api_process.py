"""The HTTP layer split from the engine (`kvlife serve --api-process`), its two sides in this process: the
front answers generation as the engine's own server does, passes every other route through, carries the
engine's refusals, and a client leaving, an /abort or a lost bridge all end in the engine's own release."""

from __future__ import annotations

import re

import anyio
import pytest

from engine import SamplingParams
from engine.errors import EngineClosed, EngineDead, EngineOverloaded, InvalidConfig, InvalidRequest
from engine.serve.settings import ServerSettings
from engine.serve.api_wire import OutputViews, pack_error, pack_output, unpack_error
from engine.testing import FaultInjector
from helpers import assert_pools_whole
from http_helpers import api_serving, parse_sse

PROMPT = [5, 6, 7, 8, 9]
TIMINGS = ("queue_time", "time_to_first_token", "e2e_latency", "id", "cached_tokens")  # the second run hits the prefix cache


def _without_timings(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in TIMINGS}


async def _sse(client, path: str, body: dict) -> list:
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        return parse_sse([line async for line in response.aiter_lines()])


class TestGenerationThroughTheFront:
    @pytest.mark.asyncio
    async def test_generate_answers_as_the_engines_own_server(self):
        """Greedy ids through the front equal the engine's server's and the embedded API's; the
        streamed events carry the same tokens and final meta_info."""
        async with api_serving() as (engine, front, _, direct):
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
            via_front = (await front.post("/generate", json=body)).json()
            via_engine = (await direct.post("/generate", json=body)).json()
            events = await _sse(front, "/generate", {**body, "stream": True})
            embedded = [o async for o in engine.generate(PROMPT, SamplingParams(max_new_tokens=12,
                                                                                   ignore_eos=True))]
        assert via_front["output_ids"] == via_engine["output_ids"] == embedded[-1].token_ids
        assert len(via_front["output_ids"]) == 12
        assert _without_timings(via_front["meta_info"]) == _without_timings(via_engine["meta_info"])
        assert events[-1] == "[DONE]"
        assert [t for e in events[:-1] for t in e["token_ids"]] == via_front["output_ids"]
        assert events[-2]["finished"] and events[-2]["meta_info"]["finish_reason"] == "length"

    @pytest.mark.asyncio
    async def test_openai_routes_and_n(self):
        """/v1/completions with n=2 and /v1/chat/completions, whole and streamed, as the engine's server."""
        async with api_serving() as (_, front, _, direct):
            completion = {"model": "tiny", "prompt": "abc", "max_tokens": 6, "n": 2, "temperature": 0}
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
            answers = [(await c.post(path, json=b)).json() for path, b in
                       (("/v1/completions", completion), ("/v1/chat/completions", chat)) for c in (front, direct)]
            streamed = await _sse(front, "/v1/chat/completions", {**chat, "stream": True})
        front_cmpl, direct_cmpl, front_chat, direct_chat = answers
        assert [c["text"] for c in front_cmpl["choices"]] == [c["text"] for c in direct_cmpl["choices"]]
        assert len(front_cmpl["choices"]) == 2 and front_cmpl["usage"] == direct_cmpl["usage"]
        assert front_chat["choices"][0]["message"] == direct_chat["choices"][0]["message"]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed[:-1] if e["choices"])
        assert text == front_chat["choices"][0]["message"]["content"] and streamed[-1] == "[DONE]"

    @pytest.mark.asyncio
    async def test_other_routes_are_the_engine_servers_answers(self):
        """Ops, token and unknown routes pass through: status and body as the engine's server gives them."""
        async with api_serving() as (_, front, _, direct):
            for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                       ("GET", "/live", None), ("POST", "/tokenize", {"prompt": "hello"}),
                                       ("GET", "/no/such/route", None), ("POST", "/abort", {"rid": "nobody"})):
                a = await front.request(method, path, json=body)
                b = await direct.request(method, path, json=body)
                assert (a.status_code, a.json()) == (b.status_code, b.json()), path
            metrics = await front.get("/metrics?x=1")
        assert metrics.status_code == 200 and "kvlife:" in metrics.text


class TestRefusals:
    @pytest.mark.asyncio
    async def test_bad_bodies_are_refused_in_the_front_before_the_engine(self):
        async with api_serving() as (engine, front, _, _direct):
            bad = await front.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}})
            not_json = await front.post("/generate", content=b"{nope")
            submitted = engine.stats.submitted
        assert bad.status_code == 400 and "max_new_tokens" in bad.json()["error"]["message"]
        assert not_json.status_code == 400
        assert submitted == 0  # nothing reached the engine, nothing was allocated

    @pytest.mark.asyncio
    async def test_the_engines_refusal_of_a_rid_in_flight_crosses_as_a_400(self):
        """The engine refuses a second request under a rid in flight (InvalidRequest from its own
        check, carried back over the bridge); the route answers 400 naming rid, as in one process."""
        slow = FaultInjector(fail_step=lambda ids: __import__("time").sleep(0.01))
        async with api_serving(faults=slow) as (_, front, _, direct):
            body = {"input_ids": PROMPT, "rid": "same", "stream": True, "sampling_params": {"max_new_tokens": 200}}
            async with front.stream("POST", "/generate", json=body) as first:
                lines = first.aiter_lines()  # NOTE: held: a dropped iterator's finalizer closes the response
                async for line in lines:
                    if line.startswith("data: "):
                        break
                again = await front.post("/generate", json={**body, "stream": False})
                on_engine = await direct.post("/generate", json={**body, "stream": False})
                aborted = await front.post("/abort", json={"rid": "same"})
                rest = parse_sse([line async for line in lines])
        assert aborted.status_code == 200 and rest[-2]["meta_info"]["finish_reason"] == "abort"
        assert again.status_code == on_engine.status_code == 400
        assert again.json()["error"] == on_engine.json()["error"]


    @pytest.mark.asyncio
    async def test_constraints_compile_in_the_engine_and_their_refusals_name_the_field(self):
        """A grammar compiles in the engine's process (the front waits for its "ready"); one that cannot is
        the same 400 naming the body's field as in one process, and the next request is served."""
        bad = {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}}
        regex = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "regex": "[0-9]{3}-[a-z]{2}"}}
        async with api_serving() as (engine, front, _, direct):
            refused = await front.post("/v1/chat/completions", json=bad)
            refused_here = await direct.post("/v1/chat/completions", json=bad)
            constrained = await front.post("/generate", json=regex)
            failures = engine.structured_stats.compiles.compile_failures
        assert refused.status_code == refused_here.status_code == 400
        assert refused.json()["error"]["param"] == refused_here.json()["error"]["param"] == "response_format"
        assert constrained.status_code == 200 and re.fullmatch("[0-9]{3}-[a-z]{2}", constrained.json()["text"])
        assert failures == 1  # compiled once in the engine's process; the second refusal was a cache hit

    @pytest.mark.asyncio
    async def test_an_api_key_is_checked_in_the_front_and_passed_through(self):
        settings = ServerSettings(api_key="k3y")
        async with api_serving(settings) as (_, front, _, _direct):
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
            without = await front.post("/generate", json=body)
            passed_on_without = await front.get("/v1/models")
            keyed = {"Authorization": "Bearer k3y"}
            with_key = await front.post("/generate", json=body, headers=keyed)
            passed_on_with = await front.get("/v1/models", headers=keyed)
            health = await front.get("/health")
        assert without.status_code == passed_on_without.status_code == 401
        assert with_key.status_code == passed_on_with.status_code == health.status_code == 200

    def test_the_setting_must_be_a_bool(self):
        with pytest.raises(InvalidConfig, match="ServerSettings.api_process"):
            ServerSettings(api_process="yes")

    def test_the_cli_sets_it_and_a_prefill_server_refuses_it(self, capsys):
        from engine.cli.main import build_parser, main
        from engine.cli.serve_command import server_settings_from_args

        args = build_parser().parse_args(["serve", "--api-process"])
        assert server_settings_from_args(args).api_process is True
        assert server_settings_from_args(build_parser().parse_args(["serve"])).api_process is False
        assert main(["serve", "--disaggregation", "prefill", "--api-process"]) == 2
        assert "--api-process: not for --disaggregation prefill" in capsys.readouterr().err


class TestEndings:
    @pytest.mark.asyncio
    async def test_a_client_leaving_aborts_the_request_in_the_engine(self):
        slow = FaultInjector(fail_step=lambda ids: __import__("time").sleep(0.01))
        async with api_serving(faults=slow) as (engine, front, _, _direct):
            body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 200}}
            async with front.stream("POST", "/generate", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break
            with anyio.fail_after(10):
                while engine.stats.finishes.get(("normal", "ABORT"), 0) == 0:
                    await anyio.sleep(0.01)
            await engine.wait_idle(5)
            assert_pools_whole(engine)

    @pytest.mark.asyncio
    async def test_abort_by_rid_ends_a_stream_served_by_the_front(self):
        slow = FaultInjector(fail_step=lambda ids: __import__("time").sleep(0.01))
        async with api_serving(faults=slow) as (engine, front, _, _direct):
            body = {"input_ids": PROMPT, "rid": "victim", "stream": True, "sampling_params": {"max_new_tokens": 200}}
            async with front.stream("POST", "/generate", json=body) as response:
                lines = response.aiter_lines()
                async for line in lines:
                    if line.startswith("data: "):
                        break
                aborted = await front.post("/abort", json={"rid": "victim"})
                rest = parse_sse([line async for line in lines])
        assert aborted.json() == {"rid": "victim", "aborted": True}
        assert rest[-1] == "[DONE]" and rest[-2]["meta_info"]["finish_reason"] == "abort"

    @pytest.mark.asyncio
    async def test_a_lost_bridge_aborts_in_the_engine_and_ends_the_fronts_streams(self):
        """The connection ends with a request running: the engine aborts it (pools whole once idle), the
        front's stream raises EngineDead, and new requests are refused with EngineClosed."""
        slow = FaultInjector(fail_step=lambda ids: __import__("time").sleep(0.01))
        async with api_serving(faults=slow) as (engine, _, remote, _direct):
            stream = remote.generate(PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True), request_id="r")
            await stream.accepted()
            first = await stream.__anext__()
            await remote._connection.aclose()  # the API process's side of the socket goes away
            with pytest.raises(EngineDead):
                async for _ in stream:
                    pass
            with pytest.raises(EngineClosed):
                remote.generate(PROMPT, SamplingParams(max_new_tokens=2))
            with anyio.fail_after(10):
                while engine.stats.finishes.get(("normal", "ABORT"), 0) == 0:
                    await anyio.sleep(0.01)
            await engine.wait_idle(5)
            assert_pools_whole(engine)
        assert first.new_token_ids and first.request_id == "r"


class TestWire:
    def test_errors_come_back_as_the_engines_classes(self):
        refused = unpack_error(pack_error(InvalidRequest("request_id", "not in flight", "x")))
        assert isinstance(refused, InvalidRequest) and refused.field == "request_id"
        assert str(refused) == str(InvalidRequest("request_id", "not in flight", "x"))
        for error in (EngineOverloaded("full"), EngineClosed("closed"), EngineDead(RuntimeError("boom"))):
            back = unpack_error(pack_error(error))
            assert type(back) is type(error) and str(back) == str(error)
        assert isinstance(unpack_error(pack_error(KeyError("odd"))), EngineDead)
        assert unpack_error(pack_error(None)) is None

    @pytest.mark.asyncio
    async def test_outputs_rebuild_their_whole_output_views(self):
        """Packed chunks carry only what is new; the views rebuild token_ids and text per sequence."""
        from helpers import small_config
        from engine import Engine

        async with Engine(small_config()) as engine:
            outputs = [o async for o in engine.generate(PROMPT, SamplingParams(max_new_tokens=6, n=2, seed=1,
                                                                                  temperature=1.0))]
        views = OutputViews()
        rebuilt = [views.unpack(pack_output(o)) for o in outputs]
        assert [(o.token_ids, o.text, o.index, o.finished) for o in rebuilt] == \
               [(o.token_ids, o.text, o.index, o.finished) for o in outputs]


class TestFaults:
    @pytest.mark.asyncio
    async def test_a_submission_the_engine_never_answers_is_refused_and_abandoned(self, monkeypatch, tmp_path):
        """A peer that reads but never answers (a stuck engine's process, faked): accepted() gives up after
        ANSWER_TIMEOUT_S with EngineOverloaded (the routes' 503), and the peer is told to abandon it."""
        from engine import Engine
        from engine.serve import remote_engine
        from engine.serve.api_wire import FrameReader
        from helpers import small_config

        monkeypatch.setattr(remote_engine, "ANSWER_TIMEOUT_S", 0.2)
        received: list = []
        listener = await anyio.create_unix_listener(str(tmp_path / "stuck.sock"))

        async def silent_peer(connection) -> None:
            async with connection:
                reader = FrameReader(connection)
                with anyio.move_on_after(5):
                    while len(received) < 2:
                        received.extend(await reader.receive())

        described = remote_engine.EngineDescription.of(Engine(small_config()))
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, silent_peer)
            remote = remote_engine.RemoteEngine(described, await anyio.connect_unix(str(tmp_path / "stuck.sock")))
            tg.start_soon(remote.run)
            stream = remote.generate(PROMPT, SamplingParams(max_new_tokens=2), request_id="r")
            with pytest.raises(EngineOverloaded, match="did not take the request"):
                await stream.accepted()
            with anyio.fail_after(5):
                while len(received) < 2:
                    await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        assert [m[0] for m in received] == ["submit", "abandon"] and received[0][1] == received[1][1]

    @pytest.mark.asyncio
    async def test_a_passed_through_route_whose_engine_server_is_gone_is_a_503(self):
        import httpx

        from engine import Engine
        from engine.serve.api_front import front_app
        from engine.serve.remote_engine import EngineDescription, RemoteEngine
        from engine.serve.uvicorn_runner import bind_socket
        from helpers import small_config

        closed = bind_socket("127.0.0.1", 0)
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there any more
        remote = RemoteEngine(EngineDescription.of(Engine(small_config())), None)  # no bridge: never used here
        settings = ServerSettings(retry_after_s=2)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as passer:
            app = front_app(remote, settings, passer)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
                answer = await client.get("/health")
        assert answer.status_code == 503 and answer.headers["retry-after"] == "2"
        assert "cannot be reached" in answer.json()["error"]["message"]

    @pytest.mark.asyncio
    async def test_a_passed_through_route_the_engine_server_never_answers_is_a_504(self):
        """The engine's server takes the connection and never answers: past the pass-through client's
        timeout the front answers 504 (the engine's process did not answer in time), not a hang or a 200."""
        import httpx

        from engine import Engine
        from engine.serve.api_front import front_app
        from engine.serve.remote_engine import EngineDescription, RemoteEngine
        from engine.serve.uvicorn_runner import bind_socket
        from helpers import small_config

        silent = bind_socket("127.0.0.1", 0)  # listening: the kernel completes the connection, nobody reads
        silent.listen(8)
        try:
            remote = RemoteEngine(EngineDescription.of(Engine(small_config())), None)  # no bridge: never used
            base = f"http://127.0.0.1:{silent.getsockname()[1]}"
            async with httpx.AsyncClient(base_url=base, timeout=0.3) as passer:
                app = front_app(remote, ServerSettings(), passer)
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://front") as client:
                    with anyio.fail_after(10):
                        answer = await client.get("/health_generate")
        finally:
            silent.close()
        assert answer.status_code == 504
        assert "did not answer in time" in answer.json()["error"]["message"]


class TestForward:
    """`RequestStream.forward`, which the bridge reads the engine's streams with."""

    @pytest.mark.asyncio
    async def test_outputs_then_none_reach_the_callable_on_the_loop(self):
        from engine import Engine
        from helpers import small_config

        async with Engine(small_config()) as engine:
            items: list = []
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
            stream.forward(items.append)
            with anyio.fail_after(10):
                while not items or items[-1] is not None:
                    await anyio.sleep(0.01)
            whole = await engine.complete(PROMPT, SamplingParams(max_new_tokens=6, ignore_eos=True))
            await engine.wait_idle(5)
            assert_pools_whole(engine)
        assert [t for o in items[:-1] for t in o.new_token_ids] == whole.token_ids
        assert items[-2].finished and items.count(None) == 1

    @pytest.mark.asyncio
    async def test_a_callable_that_raises_aborts_its_request_and_not_the_loop(self):
        from engine import Engine
        from helpers import small_config

        def deliver(item) -> None:
            seen.append(item)
            if len(seen) == 2:
                raise RuntimeError("the reader broke")

        seen: list = []
        async with Engine(small_config()) as engine:
            stream = engine.generate(PROMPT, SamplingParams(max_new_tokens=60, ignore_eos=True))
            stream.forward(deliver)
            with anyio.fail_after(10):
                while engine.stats.finishes.get(("normal", "ABORT"), 0) == 0:
                    await anyio.sleep(0.01)
            after = await engine.complete(PROMPT, SamplingParams(max_new_tokens=3, ignore_eos=True))
            await engine.wait_idle(5)
            assert_pools_whole(engine)
        assert len(seen) == 2 and len(after.token_ids) == 3
