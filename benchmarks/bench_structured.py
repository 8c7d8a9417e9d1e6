"""Structured-output benchmark: constrained against unconstrained decode, and grammar compiles, one
checkpoint, one process.

    python benchmarks/bench_structured.py [--batches 1 8 32] [--rounds 3] [--new-tokens 64]
        [--schemas 50] [--threads 1] [--device cpu] [--out bench-results/structured.json]

1. One checkpoint: the anchor tiny Llama's shape (hidden 256, 4 layers, 4 heads / 4 KV heads, MLP
   1024, vocab 32,000, fp32, random weights, seed 0) with a 32,000-token byte-level BPE tokenizer
   trained here on this Python's standard library sources (the `tokenizers` library; no download),
   so llguidance's masks cover a real-sized vocabulary.
2. Decode, per batch size B and round: B requests of 32 random prompt ids, `--new-tokens` greedy
   tokens each with `ignore_eos`, submitted together; once unconstrained and once constrained by a
   grammar that opens a JSON string and never requires it to close (every token is masked, inside
   a JSON string: the widest masks JSON has, for the whole run). The order alternates between rounds. *step ms* is the median
   interval between consecutive decode steps of B rows (the loop's whole step: plan, forward,
   masks, sampling, the per-token grammar check, outputs); *overhead* = constrained / unconstrained
   - 1 within one round, its median over rounds quoted. *masks ms* is the masks' work per step
   (llguidance: consuming the last token and computing the mask, every row), *check ms* the
   grammar's per-token check on the loop's thread. *CPU overhead* is
   the same ratio of the process's CPU time over the run (all threads: less sensitive to other
   processes on the machine than wall time).
3. Compiles: `--schemas` random JSON schemas (tests/structured_schemas.py), each submitted twice:
   the first compiles (its time inside the compile thread, and `compile()`'s wall time with the
   thread hop), the second is a cache hit. The counts are the engine's (`structured_stats`).

Prints the tables with the load average and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import anyio
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the random schemas the tests use

from benchmarks.machine import add_device_option, fmt, header, loadavg, machine_info, median_range  # noqa: E402
from engine import Constraint, Engine, EngineConfig, SamplingParams  # noqa: E402
from engine.logging import configure_logging  # noqa: E402
from structured_schemas import random_schema  # noqa: E402

VOCAB = 32000
PAD, BOS, EOS = 0, 1, 2
#: a JSON object whose string value is never closed (the grammar cannot require it to end): every
#: decode step is constrained, inside a JSON string (the widest masks JSON has), for the whole run
OPEN_STRING = Constraint.lark('start: "{\\"text\\": \\"" /[^"\\\\\\x00-\\x1f]*/\n')


def write_checkpoint(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.model.checkpoint import save_checkpoint
    from engine.model.llama import LlamaModel
    from engine.model.model_config import ModelConfig

    config = ModelConfig.tiny(vocab_size=VOCAB, num_kv_heads=4, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
                              image_token_id=None, vision=None, max_position_embeddings=4096)
    save_checkpoint(LlamaModel.from_seed(config, seed=0), config, directory)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts):
        texts.append(path.read_text(errors="replace"))
        size += len(texts[-1])
        if size > 8_000_000:
            break
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(texts, trainer)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                 "pad_token": "<pad>"}))
    return directory


class Timed:
    """Wraps a callable, adding up the time spent inside it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __call__(self, *args):
        t0 = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


async def decode_run(engine: Engine, batch: int, new_tokens: int, constrained: bool, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(32)] for _ in range(batch)]
    constraint = OPEN_STRING if constrained else None
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, constraint=constraint)
    steps: list[float] = []
    observer = lambda seqs, out: steps.append(time.perf_counter()) if (  # noqa: E731
        len(seqs) == batch and all(s.num_tokens == 1 for s in seqs)) else None
    engine.loop.step_observers.append(observer)
    masks, check = engine.parts.runner.token_masks, engine.loop.finisher.token_checks
    timed_masks, timed_check = Timed(masks._fill), Timed(check[0])  # the masks' work; the loop's check
    masks._fill, check[0] = timed_masks, timed_check
    cpu = time.process_time()
    try:
        async with anyio.create_task_group() as tg:
            for prompt in prompts:
                tg.start_soon(engine.complete, prompt, params)
        cpu = time.process_time() - cpu
    finally:
        engine.loop.step_observers.remove(observer)
        del masks._fill
        check[0] = timed_check.fn
    await engine.wait_idle(30)
    engine.check_memory()
    intervals = [b - a for a, b in zip(steps, steps[1:])]
    n = max(1, len(intervals))
    return {"step_ms": 1e3 * statistics.median(intervals), "steps": len(steps), "cpu_s": cpu,
            "masks_ms": 1e3 * timed_masks.seconds / n, "check_ms": 1e3 * timed_check.seconds / n}


async def compile_run(engine: Engine, count: int) -> dict:
    compiler = engine.parts.structured.compiler
    schemas = [random_schema(random.Random(1000 + i)) for i in range(count)]
    walls = []
    for schema in schemas:
        params = SamplingParams(max_new_tokens=2, constraint=Constraint.json_schema(schema))
        t0 = time.perf_counter()
        stream = engine.generate([BOS, 5, 6], params)
        await stream.ready()
        walls.append(time.perf_counter() - t0)
        async for _ in stream:
            pass
        await engine.complete([BOS, 5, 6], params)  # the same schema again: a cache hit
    inside = list(compiler.stats.compile_seconds)[-count:]
    stats = engine.structured_stats.compiles
    return {"schemas": count, "compile_ms": median_range([1e3 * s for s in inside]),
            "compile_p90_ms": 1e3 * sorted(inside)[int(0.9 * (len(inside) - 1))],
            "ready_wall_ms": median_range([1e3 * w for w in walls]),
            "cache_hits": stats.cache_hits, "cache_misses": stats.cache_misses, "compiles": stats.compiles}


async def main(args: argparse.Namespace) -> dict:
    info = machine_info(args.device)
    print(header(info))
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        directory = write_checkpoint(Path(tmp))
        print(f"checkpoint: anchor shape, vocab {VOCAB}, BPE trained in {time.perf_counter() - t0:.1f} s")
        top = max(args.batches)
        config = EngineConfig(model=str(directory), device=args.device, max_running=top, num_kv_pages=top * 8 + 8, page_size=16,
                              max_context=32 + args.new_tokens + 16, max_prefill_tokens=4096, prefix_cache=False,
                              leak_check="raise", use_entry_points=False)
        async with Engine(config) as engine:
            await decode_run(engine, 2, 8, True, 0)  # warm up: the vocabulary, the lexer, the model
            await decode_run(engine, 2, 8, False, 0)
            rows = []
            for batch in args.batches:
                rounds = []
                for r in range(args.rounds):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    got = {c: await decode_run(engine, batch, args.new_tokens, c, seed=r) for c in order}
                    rounds.append({"free": got[False], "constrained": got[True], "load": loadavg(),
                                   "overhead": got[True]["step_ms"] / got[False]["step_ms"] - 1,
                                   "cpu_overhead": got[True]["cpu_s"] / got[False]["cpu_s"] - 1})
                rows.append({"batch": batch, "rounds": rounds,
                             "free_step_ms": median_range([r["free"]["step_ms"] for r in rounds]),
                             "constrained_step_ms": median_range([r["constrained"]["step_ms"] for r in rounds]),
                             "overhead_pct": median_range([100 * r["overhead"] for r in rounds]),
                             "cpu_overhead_pct": median_range([100 * r["cpu_overhead"] for r in rounds]),
                             "masks_ms": median_range([r["constrained"]["masks_ms"] for r in rounds]),
                             "check_ms": median_range([r["constrained"]["check_ms"] for r in rounds]),
                             "load": rounds[-1]["load"]})
            compiles = await compile_run(engine, args.schemas)
    print(f"\n| batch | unconstrained step ms | constrained step ms | overhead % | CPU overhead % | masks ms/step "
          f"| check ms/step | load |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {fmt(row['free_step_ms'], 2)} | {fmt(row['constrained_step_ms'], 2)} | "
              f"{fmt(row['overhead_pct'], 1)} | {fmt(row['cpu_overhead_pct'], 1)} | {fmt(row['masks_ms'], 3)} | "
              f"{fmt(row['check_ms'], 3)} | {row['load']} |")
    print(f"\ncompiles: {compiles['schemas']} schemas, compile ms (in the thread) {fmt(compiles['compile_ms'], 2)}, "
          f"p90 {compiles['compile_p90_ms']:.2f}; ready wall ms {fmt(compiles['ready_wall_ms'], 2)}; cache hits "
          f"{compiles['cache_hits']}, misses {compiles['cache_misses']}, compiles {compiles['compiles']}; "
          f"load {loadavg()}")
    return {"machine": info, "args": vars(args), "decode": rows, "compiles": compiles, "load_at_end": loadavg()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="bench-results/structured.json")
    add_device_option(parser)
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    configure_logging("warning")
    result = anyio.run(main, arguments)
    out = Path(arguments.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
