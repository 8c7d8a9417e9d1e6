"""Speculative decoding benchmark: kvlife's prompt lookup against transformers' own
prompt-lookup assisted generation, batch 1, one checkpoint, one process.

    python benchmarks/bench_speculative.py [--prompts 4] [--new-tokens 128] [--draft-tokens 4]
        [--hf-draft-tokens K] [--ngram 3] [--repeat 3] [--threads 1] [--device cpu]
        [--out bench-results/speculative.json]

1. One checkpoint, the anchor tiny Llama of `bench_engine.py` (hidden 256, 4
   layers, vocab 32,000, fp32, random weights from `torch.manual_seed(0)`),
   written by `save_pretrained` and loaded by both in this process, one torch
   thread each (`--threads`).
2. A repetitive workload: `--prompts` templated prompts (records of the same
   field tokens with varying values, 8 records of 6 fields, 144 tokens), greedy,
   `--new-tokens` new tokens each, one request at a time. A model with random
   weights does not copy its prompt: its greedy output falls into loops, which a
   prompt lookup over prompt and output so far predicts. Both systems look up
   in the same tokens.
3. Four runs per prompt and repeat, back to back in a rotating order (the pair
   of runs a ratio compares is a few hundred ms apart): transformers `generate()` plain
   and with `prompt_lookup_num_tokens=--hf-draft-tokens` (default
   `--draft-tokens`), `max_matching_ngram_size=--ngram`; kvlife plain and with
   `SpeculativeConfig(num_tokens=--draft-tokens, ngram_max=--ngram)`.
   tok/s = new tokens / wall time of one prompt (prefill included); each ratio
   is taken per prompt and repeat, and the table shows median and range.
4. Acceptance: kvlife's from `RequestOutput.speculation`; transformers' from
   its model's forward calls (each decode forward's input is the last token plus
   the candidates: drafts = input - 1, accepted = new tokens - forwards).
5. Greedy ids of all four are compared on every repeat.

Prints a table (median and range over prompts x repeats) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import ANCHOR, PAGE, write_checkpoint  # noqa: E402
from benchmarks.machine import add_device_option, fmt, header, loadavg, machine_info, median_range  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402
from engine.logging import configure_logging  # noqa: E402


def templated_prompts(count: int, records: int = 8, fields: int = 6) -> list[list[int]]:
    """Records `field value 13` x fields, x records: the same field tokens, varying values."""
    prompts = []
    for i in range(count):
        rng = random.Random(i)
        names = [rng.randrange(300, ANCHOR["vocab_size"]) for _ in range(fields)]
        prompt: list[int] = []
        for _ in range(records):
            for name in names:
                prompt += [name, rng.randrange(300, ANCHOR["vocab_size"]), 13]
        prompts.append(prompt)
    return prompts


class HFRun:
    """transformers' `generate()`, plain or with prompt lookup; counts the model's forwards."""

    def __init__(self, directory: Path, device: str) -> None:
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.device = torch.device(device)
        self.model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).to(self.device).eval()
        self.inputs: list[int] = []
        forward = self.model.forward

        def counted(*args, **kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                self.inputs.append(ids.shape[1])
            return forward(*args, **kwargs)

        self.model.forward = counted

    def run(self, prompts: list[list[int]], new_tokens: int, lookup: dict | None) -> dict:
        from transformers import GenerationConfig

        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  eos_token_id=None, pad_token_id=0, **(lookup or {}))
        ids_out, drafts, accepted = [], 0, 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            for prompt in prompts:
                self.inputs = []
                ids = torch.tensor([prompt], device=self.device)
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
                ids_out.append(out[0, len(prompt):].tolist())
                decode = self.inputs[1:]  # the first forward is the prefill
                drafts += sum(n - 1 for n in decode)
                accepted += new_tokens - 1 - len(decode)
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "ids": ids_out, "drafts": drafts, "accepted": accepted}


async def kvlife_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outs = []
    t0 = time.perf_counter()
    for prompt in prompts:
        outs.append(await engine.complete(prompt, params))
    wall = time.perf_counter() - t0
    await engine.wait_idle(30)
    engine.check_memory()
    stats = [o.speculation for o in outs if o.speculation is not None]
    return {"wall_s": wall, "ids": [o.token_ids for o in outs],
            "drafts": sum(s.draft_tokens for s in stats), "accepted": sum(s.accepted_tokens for s in stats),
            "steps": sum(s.steps for s in stats)}


def kvlife_config(directory: Path, prompts: list[list[int]], new_tokens: int, spec: SpeculativeConfig | None,
                  device: str = "cpu") -> EngineConfig:
    longest = max(len(p) for p in prompts) + new_tokens + 32
    return EngineConfig(model=str(directory), device=device, max_running=1, num_kv_pages=-(-longest // PAGE) + 4,
                        max_context=longest, page_size=PAGE, prefix_cache=False, use_entry_points=False,
                        speculative=spec)


async def main(args: argparse.Namespace) -> dict:
    configure_logging("warning")
    torch.set_num_threads(args.threads)
    prompts = templated_prompts(args.prompts)
    spec = SpeculativeConfig(num_tokens=args.draft_tokens, ngram_max=args.ngram)
    hf_tokens = args.hf_draft_tokens or args.draft_tokens
    lookup = {"prompt_lookup_num_tokens": hf_tokens, "max_matching_ngram_size": args.ngram}
    info = machine_info(args.device)
    print(header(info))
    print(f"threads {torch.get_num_threads()}; {len(prompts)} prompts x {len(prompts[0])} tokens, "
          f"{args.new_tokens} new tokens, batch 1; drafts: kvlife {args.draft_tokens}, transformers {hf_tokens}; "
          f"n-gram <= {args.ngram}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = write_checkpoint(Path(tmp))
        hf = HFRun(directory, args.device)
        async with Engine(kvlife_config(directory, prompts, args.new_tokens, None, args.device)) as plain, \
                Engine(kvlife_config(directory, prompts, args.new_tokens, spec, args.device)) as speculative:
            runs = {
                "hf": lambda ps: hf.run(ps, args.new_tokens, None),
                "hf_lookup": lambda ps: hf.run(ps, args.new_tokens, lookup),
                "kvlife": lambda ps: kvlife_run(plain, ps, args.new_tokens),
                "kvlife_spec": lambda ps: kvlife_run(speculative, ps, args.new_tokens),
            }
            await kvlife_run(plain, prompts[:1], 8)  # warm-up
            await kvlife_run(speculative, prompts[:1], 8)
            hf.run(prompts[:1], 8, lookup)
            repeats: list[dict] = []
            names = list(runs)
            for r in range(args.repeat):
                # NOTE: prompt by prompt, the four runs back to back in a rotating order: the ratios
                # pair runs a few hundred ms apart, so a load swing on the shared machine hits both
                for i, prompt in enumerate(prompts):
                    result: dict = {}
                    for name in names[(r + i) % 4:] + names[: (r + i) % 4]:
                        out = runs[name]([prompt])
                        result[name] = await out if hasattr(out, "__await__") else out
                    result["ids_equal"] = all(result[n]["ids"] == result["hf"]["ids"] for n in names)
                    result["loadavg"] = loadavg()
                    repeats.append(result)
    tokens = args.new_tokens  # per run: one prompt
    rows = {name: median_range([tokens / rep[name]["wall_s"] for rep in repeats]) for name in names}
    ratio = median_range([rep["hf_lookup"]["wall_s"] / rep["kvlife_spec"]["wall_s"] for rep in repeats])
    plain_ratio = median_range([rep["hf"]["wall_s"] / rep["kvlife"]["wall_s"] for rep in repeats])
    total = {n: {k: sum(rep[n][k] for rep in repeats) for k in ("drafts", "accepted")}
             for n in ("hf_lookup", "kvlife_spec")}
    accept = {n: total[n]["accepted"] / total[n]["drafts"] if total[n]["drafts"] else 0.0 for n in total}
    steps = sum(rep["kvlife_spec"]["steps"] for rep in repeats)
    per_step = tokens * len(repeats) / steps if steps else 0.0
    print(f"\n| run | tok/s (median, range) | acceptance | drafts / accepted |")
    print("|---|---|---|---|")
    for name, label in (("hf", "transformers generate()"), ("hf_lookup", "transformers prompt lookup"),
                        ("kvlife", "kvlife"), ("kvlife_spec", "kvlife prompt lookup")):
        extra = (f"{accept[name]:.2f} | {total[name]['drafts']} / {total[name]['accepted']}"
                 if name in accept else "- | -")
        print(f"| {label} | {fmt(rows[name])} | {extra} |")
    print(f"\nkvlife prompt lookup / transformers prompt lookup: {fmt(ratio, 2)}x "
          f"(plain: {fmt(plain_ratio, 2)}x); kvlife tokens per step {per_step:.2f}; "
          f"greedy ids equal in every repeat: {all(r['ids_equal'] for r in repeats)}; "
          f"load {', '.join(r['loadavg'] for r in repeats)}")
    report = {"machine": info, "args": vars(args), "tok_s": rows, "ratio_vs_hf_lookup": ratio,
              "ratio_plain": plain_ratio, "acceptance": accept, "kvlife_tokens_per_step": per_step,
              "ids_equal": all(r["ids_equal"] for r in repeats),
              "loadavg": [r["loadavg"] for r in repeats]}
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--hf-draft-tokens", type=int, default=None,
                        help="transformers' prompt_lookup_num_tokens (default: --draft-tokens)")
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench-results/speculative.json"))
    add_device_option(parser)
    arguments = parser.parse_args()
    result = anyio.run(main, arguments)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {arguments.out}")
