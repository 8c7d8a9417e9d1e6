"""Engine benchmark: decode throughput, engine overhead, and transformers side by side.

    python benchmarks/bench_engine.py [--batches 1 8 32 128] [--out bench-results/engine.json]

1. Decode throughput of the tiny model through the whole engine (tokens/s of
   decode steps) at each batch size, 128-token prompts.
2. Engine overhead: the same loop with `model="null"` (NoComputeRunner: the
   pools, tables, machine and batch tensors are real, the forward pass is
   skipped): microseconds of engine work per request per decode step, and
   as a share of the tiny model's step at the same batch.
3. Per-request lifecycle cost (QUEUED -> ... -> RELEASED, one token) with no compute.
4. transformers `generate()` on the same weights, same prompts, when installed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import anyio
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.logging import configure_logging

PROMPT_LEN = 128


def _prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def _config(model: str, batch: int, new_tokens: int) -> EngineConfig:
    per_request = -(-(PROMPT_LEN + new_tokens) // 16) + 1
    return EngineConfig(model=model, max_running=max(batch, 1), num_kv_pages=batch * per_request + 16,
                        max_context=PROMPT_LEN + new_tokens + 16, max_prefill_tokens=4096,
                        prefix_cache=False, leak_check="raise", use_entry_points=False)


async def _decode_run(model: str, batch: int, new_tokens: int) -> dict:
    """Decode steps only: prefill all requests, then time the steps that follow."""
    engine = Engine(_config(model, batch, new_tokens))
    step_times: list[tuple[float, int]] = []
    original_step = engine.loop.runner.step

    def timed_step(seqs):
        t0 = time.perf_counter()
        out = original_step(seqs)
        step_times.append((time.perf_counter() - t0, len(seqs), all(s.num_tokens == 1 for s in seqs)))
        return out

    engine.loop.runner.step = timed_step
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    async with engine:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for prompt in _prompts(batch):
                tg.start_soon(engine.complete, prompt, params)
        wall = time.perf_counter() - t0
        await engine.wait_idle(30)
        engine.check_memory()
    decode = [(dt, n) for dt, n, is_decode in step_times if is_decode and n == batch]
    decode_time = sum(dt for dt, _ in decode)
    loop_decode_tokens = sum(n for _, n in decode)
    return {
        "batch": batch,
        "decode_steps": len(decode),
        "step_ms": 1000 * decode_time / max(len(decode), 1),
        "decode_tokens_per_s": loop_decode_tokens / decode_time if decode_time else None,
        "end_to_end_tokens_per_s": batch * new_tokens / wall,
        "wall_s": wall,
    }


async def _lifecycles(n: int) -> float:
    """µs per request lifecycle (one token, no compute), through the public API."""
    engine = Engine(EngineConfig(model="null", max_running=64, num_kv_pages=512, use_entry_points=False))
    params = SamplingParams(max_new_tokens=1)
    async with engine:
        t0 = time.perf_counter()
        for i in range(0, n, 64):
            async with anyio.create_task_group() as tg:
                for j in range(64):
                    tg.start_soon(engine.complete, [1 + (i + j) % 200, 2, 3, 4], params)
        elapsed = time.perf_counter() - t0
        engine.check_memory()
    return 1e6 * elapsed / n


def _transformers_run(batch: int, new_tokens: int) -> dict | None:
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return None
    from engine.model.checkpoint import save_checkpoint
    from engine.model.model_config import ModelConfig
    from engine.model.llama import LlamaModel

    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.tiny()
        save_checkpoint(LlamaModel.from_seed(config, 0), config, tmp)
        model = LlamaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    ids = torch.tensor(_prompts(batch))
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0)
        wall = time.perf_counter() - t0
    return {"batch": batch, "end_to_end_tokens_per_s": batch * new_tokens / wall, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--lifecycles", type=int, default=2048)
    parser.add_argument("--out", default="bench-results/engine.json")
    args = parser.parse_args()
    configure_logging("warning")
    rows = []
    for batch in args.batches:
        tiny = anyio.run(_decode_run, "tiny", batch, args.new_tokens)
        null = anyio.run(_decode_run, "null", batch, args.new_tokens)
        hf = _transformers_run(batch, args.new_tokens)
        rows.append({
            "batch": batch,
            "tiny": tiny,
            "no_compute": null,
            "engine_us_per_request_step": 1000 * null["step_ms"] / batch,
            "engine_share_of_step": null["step_ms"] / tiny["step_ms"],
            "transformers": hf,
            "speedup_vs_transformers": None if hf is None else
            tiny["end_to_end_tokens_per_s"] / hf["end_to_end_tokens_per_s"],
        })
    lifecycle_us = anyio.run(_lifecycles, args.lifecycles)
    print(f"{'batch':>5} {'step ms':>8} {'decode tok/s':>12} {'e2e tok/s':>10} {'HF tok/s':>9} {'x HF':>6}"
          f" {'engine us/req/step':>19} {'engine share':>12}")
    for r in rows:
        hf = r["transformers"]
        print(f"{r['batch']:>5} {r['tiny']['step_ms']:>8.2f} {r['tiny']['decode_tokens_per_s']:>12.0f}"
              f" {r['tiny']['end_to_end_tokens_per_s']:>10.0f} {hf['end_to_end_tokens_per_s'] if hf else float('nan'):>9.0f}"
              f" {r['speedup_vs_transformers'] or float('nan'):>6.2f} {r['engine_us_per_request_step']:>19.1f}"
              f" {100 * r['engine_share_of_step']:>11.1f}%")
    print(f"request lifecycle through the public API, no compute: {lifecycle_us:.0f} us")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "lifecycle_us": lifecycle_us, "prompt_len": PROMPT_LEN,
                   "new_tokens": args.new_tokens, "torch": torch.__version__,
                   "threads": torch.get_num_threads()}, f, indent=2)


if __name__ == "__main__":
    main()
