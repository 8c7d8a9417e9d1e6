"""Health a router can trust (readiness on /health, liveness on /live, a dead loop exits serve 1), the
discovery routes SGLang Model Gateway reads, /flush_cache, and the metrics the Endpoint Picker scrapes."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import EngineConfig
from engine.runtime.loop import DecodeLoop
from engine.serve.server import ServerSettings, serve
from engine.testing import FaultInjector
from http_helpers import StepGate, leak_once, serving


def _samples(text: str) -> dict[str, float]:
    """name -> value of every unlabelled-by-state sample (the first one of each name)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, sample.value)
    return values


class TestProbes:
    @pytest.mark.asyncio
    async def test_ready_and_alive(self):
        """A serving engine is ready and alive; neither probe needs the API key."""
        async with serving(ServerSettings(api_key="k")) as (_, client):
            ready, live = await client.get("/health"), await client.get("/live")
        assert ready.status_code == 200 and ready.json() == {"status": "ok"}
        assert live.status_code == 200 and live.json() == {"status": "alive"}

    @pytest.mark.asyncio
    async def test_a_leak_makes_it_unready_but_alive(self):
        """After an idle leak check fails, /health is 503 'leaking' while /live stays 200."""
        faults = FaultInjector(fail_release={"kv"}, release_leaks=True)
        async with serving(faults=faults, leak_check="log") as (engine, client):
            await leak_once(engine, client)
            ready, live = await client.get("/health"), await client.get("/live")
        assert ready.status_code == 503 and ready.json()["reason"] == "leaking" and ready.json()["detail"]
        assert live.status_code == 200

    @pytest.mark.asyncio
    async def test_a_dead_loop_makes_serve_exit_1(self, monkeypatch, assert_engines_leave_pools_whole):
        """serve() returns 1 within a bound once the engine's loop dies, with no signal sent."""

        async def broken(loop) -> None:  # the fault: a bug in the loop itself, not in a hook
            raise RuntimeError("a bug in the loop")

        monkeypatch.setattr(DecodeLoop, "iteration", broken)
        config = EngineConfig(model="null", page_size=4, num_kv_pages=64, max_running=2, max_context=64,
                              use_entry_points=False, leak_check="log")
        with anyio.fail_after(20):
            code = await serve(config, "127.0.0.1", 0)
        (engine,) = assert_engines_leave_pools_whole
        engine._expect_dead = True
        assert code == 1 and isinstance(engine.errored, RuntimeError)


class TestDiscovery:
    @pytest.mark.asyncio
    async def test_model_and_server_info(self):
        """/model_info and /server_info (and their /get_ names) carry what the gateway registers."""
        async with serving(ServerSettings(served_model_name="tiny-served")) as (engine, client):
            info, old_info = (await client.get("/model_info")).json(), (await client.get("/get_model_info")).json()
            server = (await client.get("/server_info")).json()
            old_server = (await client.get("/get_server_info")).json()
        assert info == old_info and server == old_server
        assert info["served_model_name"] == server["served_model_name"] == "tiny-served"
        assert info["model_path"] is None and info["is_generation"] is True  # a built-in model has no files
        assert server["tp_size"] == server["dp_size"] == 1 and server["disaggregation_mode"] == "null"
        assert server["max_running_requests"] == engine.config.max_running
        assert server["page_size"] == engine.config.page_size and server["kv_events"] is None
        assert server["kv_cache_dtype"] == engine.config.kv_cache_dtype == "auto"

    @pytest.mark.asyncio
    async def test_flush_cache(self):
        """/flush_cache frees the idle prefix cache: the same prompt then hits nothing."""
        body = {"input_ids": list(range(1, 30)), "sampling_params": {"max_new_tokens": 2}}
        async with serving() as (engine, client):
            await client.post("/generate", json=body)
            warm = (await client.post("/generate", json=body)).json()["meta_info"]["cached_tokens"]
            flushed = (await client.post("/flush_cache")).json()
            cold = (await client.post("/generate", json=body)).json()["meta_info"]["cached_tokens"]
            vllm_name = (await client.post("/reset_prefix_cache")).json()
        assert warm > 0 and cold == 0
        assert flushed["flushed"] is True and flushed["pages_freed"] > 0 and flushed["pages_in_use"] == 0
        assert vllm_name["flushed"] is True


class TestEndpointPickerMetrics:
    @pytest.mark.asyncio
    async def test_gauges_parse_and_follow_the_load(self):
        """The queued, running and KV-usage gauges, and the cache info, under both names; they rise under
        load and fall back when idle."""
        gate = StepGate()
        async with serving(ServerSettings(vllm_metric_names=True), faults=FaultInjector(fail_step=gate),
                           max_running=2) as (engine, client):
            idle = _samples((await client.get("/metrics")).text)
            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(lambda i=i: client.post("/generate", json={
                        "input_ids": [i + 1] * 40, "sampling_params": {"max_new_tokens": 4}}))
                await gate.wait_entered()
                with anyio.fail_after(10):
                    while sum(engine.requests_by_state().values()) < 5:
                        await anyio.sleep(0.01)
                busy = _samples((await client.get("/metrics")).text)
                gate.open()
            await engine.wait_idle(10)
            after = _samples((await client.get("/metrics")).text)
        for prefix in ("kvlife:", "vllm:"):
            usage = "kv_cache_usage_ratio" if prefix == "kvlife:" else "kv_cache_usage_perc"
            assert idle[f"{prefix}num_requests_waiting"] == 0 and idle[f"{prefix}{usage}"] == 0
            waiting, running = busy[f"{prefix}num_requests_waiting"], busy[f"{prefix}num_requests_running"]
            assert waiting + running == 5 and waiting >= 3 and 1 <= running <= 2
            assert 0 < busy[f"{prefix}{usage}"] <= 1
            assert after[f"{prefix}num_requests_waiting"] == after[f"{prefix}num_requests_running"] == 0
            assert after[f"{prefix}{usage}"] == 0
        text = (await _text_of_cache_info(engine))
        assert 'block_size="4"' in text and 'num_gpu_blocks="256"' in text

    @pytest.mark.asyncio
    async def test_every_documented_vllm_name_is_exported(self):
        """Each family the metrics table of docs/http.md gives a vLLM name for is there under it."""
        async with serving(ServerSettings(vllm_metric_names=True)) as (_, client):
            await client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
            text = (await client.get("/metrics")).text
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("vllm:")}
        for family in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc", "cache_config_info",
                       "prompt_tokens_total", "generation_tokens_total", "request_success_total",
                       "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                       "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                       "e2e_request_latency_seconds_count", "request_queue_time_seconds_count",
                       "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                       "spec_decode_num_accepted_tokens_total"):
            assert f"vllm:{family}" in names, family

    @pytest.mark.asyncio
    async def test_vllm_names_only_with_the_switch(self):
        async with serving() as (_, client):
            text = (await client.get("/metrics")).text
        assert "kvlife:num_requests_waiting" in text and "vllm:" not in text


async def _text_of_cache_info(engine) -> str:
    from engine.serve.router_metrics import cache_config_info

    family = cache_config_info(engine, "tiny")
    return " ".join(f'{k}="{v}"' for k, v in family.samples[0].labels.items())


class TestKVEventsServed:
    @pytest.mark.anyio
    async def test_a_served_engine_publishes_its_cache(self):
        """With ServerSettings.kv_events, /server_info names the bound endpoints and a subscriber sees the
        pages a request leaves in the cache."""
        from engine.kv_events import KVEventsConfig, KVEventSubscriber, block_hashes

        settings = ServerSettings(kv_events=KVEventsConfig(endpoint="tcp://127.0.0.1:0",
                                                           replay_endpoint="tcp://127.0.0.1:0", topic="kv@test"))
        prompt = list(range(1, 30))
        async with serving(settings) as (engine, client):
            info = (await client.get("/server_info")).json()["kv_events"]
            view = KVEventSubscriber(info["endpoint"], replay_endpoint=info["replay_endpoint"], topic="kv@test")
            try:
                await client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
                with anyio.fail_after(10):
                    while not set(block_hashes(prompt, engine.config.page_size)) <= view.blocks:
                        await anyio.to_thread.run_sync(view.poll, 0.05)
                        if not view.blocks:
                            await anyio.to_thread.run_sync(view.replay)
            finally:
                view.close()
        assert info["endpoint"].startswith("tcp://127.0.0.1:") and not info["endpoint"].endswith(":0")
        assert info["topic"] == "kv@test" and info["block_size"] == engine.config.page_size


class TestRouterOptions:
    def test_options_build_the_settings(self):
        """--vllm-metric-names and --kv-events-* become ServerSettings fields; without an endpoint, no events."""
        from engine.cli.main import build_parser
        from engine.cli.serve_command import server_settings_from_args

        plain = server_settings_from_args(build_parser().parse_args(["serve"]))
        assert plain.kv_events is None and plain.vllm_metric_names is False
        args = build_parser().parse_args(["serve", "--vllm-metric-names",
                                          "--kv-events-endpoint", "tcp://127.0.0.1:6000",
                                          "--kv-events-replay-endpoint", "none", "--kv-events-connect",
                                          "--kv-events-topic", "kv@pod@m", "--kv-events-buffer-steps", "7"])
        settings = server_settings_from_args(args)
        events = settings.kv_events
        assert settings.vllm_metric_names and events.endpoint == "tcp://127.0.0.1:6000" and events.connect
        assert events.replay_endpoint is None and events.topic == "kv@pod@m" and events.buffer_steps == 7

    def test_a_bad_endpoint_is_one_line_and_exit_2(self, capsys):
        from engine.cli.main import main

        assert main(["serve", "--kv-events-endpoint", "http://127.0.0.1:1"]) == 2
        err = capsys.readouterr().err
        assert "KVEventsConfig.endpoint" in err and "Traceback" not in err

    def test_a_prefill_server_refuses_router_options(self, capsys):
        from engine.cli.main import main

        assert main(["serve", "--disaggregation", "prefill", "--kv-events-endpoint", "tcp://127.0.0.1:1"]) == 2
        assert "--kv-events-endpoint: not for --disaggregation prefill" in capsys.readouterr().err
