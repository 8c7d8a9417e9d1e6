"""`kvlife serve`'s options for running behind routers: vLLM metric names and KV cache events.

    --vllm-metric-names                 also export vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...
    --kv-events-endpoint tcp://127.0.0.1:5557   publish KV cache events (needs the `kv-events` extra)
    --kv-events-replay-endpoint E|none  the replay socket (default tcp://127.0.0.1:5558)
    --kv-events-connect                 dial a subscriber that binds (llm-d's central indexer)
    --kv-events-topic T                 every message's topic (llm-d: kv@<pod-ip>:<port>@<model>)
    --kv-events-hash-seed S             the first page's parent seed (default vllm-none-hash)
    --kv-events-buffer-steps N          batches kept for replay (default 10000)

Validated by `engine.kv_events.settings.KVEventsConfig` (exit 2 naming the field).
"""

from __future__ import annotations

import argparse
from typing import Any

from engine.cli.options import CLIError, int_at_least


def add_router_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("router options (docs/scaling.md)")
    group.add_argument("--vllm-metric-names", action="store_true",
                       help="also export the metrics routers read under vLLM's names (vllm:num_requests_waiting, ...)")
    group.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                       help="publish KV cache events on this ZeroMQ endpoint, e.g. tcp://127.0.0.1:5557 "
                            "(needs the kv-events extra; default: off)")
    group.add_argument("--kv-events-replay-endpoint", default="tcp://127.0.0.1:5558", metavar="ENDPOINT",
                       help="the replay socket, or 'none' (default: tcp://127.0.0.1:5558)")
    group.add_argument("--kv-events-connect", action="store_true",
                       help="connect to a subscriber that binds instead of binding the endpoint")
    group.add_argument("--kv-events-topic", default="", help="the topic of every message (default: empty)")
    group.add_argument("--kv-events-hash-seed", default="vllm-none-hash",
                       help="seed of the chained page hash (default: vllm-none-hash, as vLLM 0.33.0)")
    group.add_argument("--kv-events-buffer-steps", type=int_at_least(1), default=10_000,
                       help="batches kept for replay (default: 10000)")


def kv_events_from_args(args: argparse.Namespace) -> Any:
    """The KVEventsConfig `kvlife serve` publishes with, or None when --kv-events-endpoint is not given."""
    if getattr(args, "kv_events_endpoint", None) is None:
        return None
    from engine.kv_events.settings import KVEventsConfig

    replay = args.kv_events_replay_endpoint
    return KVEventsConfig(endpoint=args.kv_events_endpoint, replay_endpoint=None if replay == "none" else replay,
                          connect=args.kv_events_connect, topic=args.kv_events_topic,
                          hash_seed=args.kv_events_hash_seed, buffer_steps=args.kv_events_buffer_steps)


def refuse_router_options_for_prefill(args: argparse.Namespace) -> None:
    """A prefill server (--disaggregation prefill) is reached by decodes, not routers: these options would
    do nothing there, so they are refused instead of ignored."""
    given = [flag for flag, on in (("--vllm-metric-names", getattr(args, "vllm_metric_names", False)),
                                   ("--kv-events-endpoint", getattr(args, "kv_events_endpoint", None) is not None))
             if on]
    if given:
        raise CLIError(f"{', '.join(given)}: not for --disaggregation prefill (a prefill server is reached by "
                       "decode servers, not routers; give it to the decode server)")
