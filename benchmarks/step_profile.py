"""Where a decode step of the anchor model goes: the matmuls (the floor), the
small ops around them, and attention, replayed in one process.

    python benchmarks/step_profile.py [--batches 1 8 32 128] [--context 160] [--steps 60]
        [--weight-layout auto] [--native-kernels auto] [--kv-cache-dtype float32] [--threads 1] [--device cpu] [--out bench-results/step_profile.json] [--ops]

The anchor model of `bench_engine.py` (the same config and seed, built by
kvlife with random weights, no transformers needed), packed as the engine
packs it, one decode step of B sequences of `--context` tokens on scattered
16-token pages, replayed back to back (so caches are what they are in the
engine: the weights stream through and evict the KV). Three replays, each
the median of `--steps` steps of this thread's CPU time (`time.thread_time`,
so time the scheduler gives to other processes on a shared machine is not
counted; memory bandwidth they take still is; on CUDA, wall time with a
synchronize after each step):

- *step*: the forward pass (attention planned for the step) and the greedy argmax;
- *no attention*: the same with an attention that returns its queries;
- *floor*: the step's matmuls alone, through the model's own projections.

small ops = no attention - floor; attention = step - no attention. `--ops`
also prints torch.profiler's top ops of one step. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.machine import add_device_option, header, loadavg, machine_info, write_results  # noqa: E402
from engine.model.attention import AttentionMetadata, PagedAttention  # noqa: E402
from engine.model.llama import LlamaModel  # noqa: E402
from engine.model.model_config import ModelConfig  # noqa: E402
from engine.model.loading import install_native_kernels as install  # noqa: E402
from engine.model.native_kernels import NativeKernels, kernels_for  # noqa: E402
from engine.model.sampling import argmax_rows  # noqa: E402
from resources.kv_buffers import KVBuffers  # noqa: E402

PAGE = 16
ANCHOR = ModelConfig(vocab_size=32000, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64,
                     intermediate_size=1024, tie_word_embeddings=False, max_position_embeddings=4096)


class _Queries:
    """An attention that attends nothing: returns its queries."""

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q


def _decode_step(model: LlamaModel, batch: int, context: int, kernel: NativeKernels | None,
                 kv_dtype: torch.dtype = torch.float32):
    """The step's inputs and a function running it (the forward and the argmax)."""
    gen = torch.Generator().manual_seed(batch)
    device = model.device
    per = -(-context // PAGE)
    kv = KVBuffers(num_layers=ANCHOR.num_layers, num_pages=batch * per + 1, page_size=PAGE,
                   num_kv_heads=ANCHOR.num_kv_heads, head_dim=ANCHOR.head_dim, dtype=kv_dtype, device=device)
    for layer in range(ANCHOR.num_layers):
        kv.k[layer].copy_(torch.randn(kv.k[layer].shape, generator=gen))
        kv.v[layer].copy_(torch.randn(kv.v[layer].shape, generator=gen))
    pages = (torch.randperm(batch * per, generator=gen) + 1).view(batch, per).to(device)
    positions = torch.full((batch,), context - 1, device=device)
    out_locs = pages[:, (context - 1) // PAGE] * PAGE + (context - 1) % PAGE
    ids = torch.randint(0, ANCHOR.vocab_size, (batch,), generator=gen).to(device)
    meta = AttentionMetadata(out_locs=out_locs, q_lens=[1] * batch, kv_lens=[context] * batch, kv_pages=pages,
                             page_size=PAGE)

    def step() -> torch.Tensor:
        return argmax_rows(model(ids, positions, PagedAttention(kv, meta, kernel=kernel)))

    def without_attention() -> None:
        argmax_rows(model(ids, positions, _Queries()))

    return step, without_attention


def _floor(model: LlamaModel, batch: int):
    """The step's matmuls alone, through the model's packed projections."""
    x = torch.randn(batch, ANCHOR.hidden_size, device=model.device)
    hidden, mlp = ANCHOR.num_heads * ANCHOR.head_dim, ANCHOR.intermediate_size
    layers = [(layer.self_attn.qkv, layer.self_attn.o, layer.gate_up, layer.down) for layer in model._layers]
    head = model._head
    assert head is not None

    def floor() -> None:
        y = x
        for qkv, o, gate_up, down in layers:
            y = o(qkv(y)[:, :hidden])
            y = down(gate_up(y)[:, :mlp])
        head(y)

    return floor


def _ms(fn, steps: int, device: torch.device) -> float:
    """Median ms of `fn`: this thread's CPU time, or wall time to a synchronize on CUDA."""
    cuda = device.type == "cuda"
    clock = time.perf_counter if cuda else time.thread_time
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        t0 = clock()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(clock() - t0)
    return 1e3 * statistics.median(times)


def profile_batch(model: LlamaModel, batch: int, context: int, steps: int, ops: bool,
                  kernel: NativeKernels | None = None, kv_dtype: torch.dtype = torch.float32) -> dict:
    step, without_attention = _decode_step(model, batch, context, kernel, kv_dtype)
    floor = _floor(model, batch)
    replays = []
    for _ in range(3):
        replays.append({name: _ms(fn, steps, model.device) for name, fn in
                        (("step", step), ("no_attention", without_attention), ("floor", floor))})
    row: dict = {"batch": batch, "replays": replays, "load": loadavg()}
    for name in ("step", "no_attention", "floor"):
        row[f"{name}_ms"] = statistics.median(r[name] for r in replays)
    row["small_ops_ms"] = row["no_attention_ms"] - row["floor_ms"]
    row["attention_ms"] = row["step_ms"] - row["no_attention_ms"]
    if ops:
        from torch.profiler import profile

        with profile() as prof:
            step()
        top = [e for e in prof.events() if e.cpu_parent is None]
        row["top_level_ops"] = len(top)
        print(f"--- batch {batch}: {len(top)} top-level ops in one step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--context", type=int, default=160, help="tokens per sequence (the engine run's middle)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--weight-layout", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ops", action="store_true", help="also print torch.profiler's top ops of one step")
    parser.add_argument("--native-kernels", default="auto", choices=["auto", "on", "off"],
                        help="EngineConfig.native_kernels: kvlife's CPU kernels for attention, norms and RoPE")
    parser.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the dtype of the K/V buffers (EngineConfig.kv_cache_dtype; the model stays float32)")
    add_device_option(parser)
    parser.add_argument("--out", default="bench-results/step_profile.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine_info(args.device)
    print(header(info), flush=True)
    model = LlamaModel.from_seed(ANCHOR, 0, device=args.device)
    model.pack(args.weight_layout)
    kernel = kernels_for(args.native_kernels, model.device, torch.float32)
    install(model, kernel)
    rows = []
    with torch.inference_mode():
        for batch in args.batches:
            rows.append(profile_batch(model, batch, args.context, args.steps, args.ops, kernel,
                                      getattr(torch, args.kv_cache_dtype)))
    print(f"\nweight layout {model.weight_layout}, native kernels {'on' if kernel else 'off'}, K/V {args.kv_cache_dtype}, "
          f"context {args.context}; ms per step, median of 3 replays; "
          f"load at end {loadavg()}")
    print(f"{'batch':>5} | {'step':>8} | {'floor':>8} | {'small ops':>9} | {'attention':>9} | x floor")
    for r in rows:
        print(f"{r['batch']:>5} | {r['step_ms']:>8.2f} | {r['floor_ms']:>8.2f} | {r['small_ops_ms']:>9.2f} | "
              f"{r['attention_ms']:>9.2f} | {r['floor_ms'] / r['step_ms']:.2f}")
    results = {"machine": info, "weight_layout": model.weight_layout, "native_kernels": kernel is not None,
               "context": args.context, "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}
    return write_results(args.out, results)


if __name__ == "__main__":
    main()
