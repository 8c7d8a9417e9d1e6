"""The floor of `bench_engine.py`: a decode step's matmuls alone on the
checkpoint's weights (in three layouts), and the attention a step cannot
avoid (torch's over contiguous K/V, and the K/V bytes it must read)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.model.projection import Projection, onednn_applies

#: the anchor tiny Llama's transformers config (bench_engine.py writes it as a checkpoint)
ANCHOR = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=1024, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096,
              # kvlife's byte tokenizer wants its special ids at 256..; the prompts are ids, never text
              bos_token_id=256, eos_token_id=257, pad_token_id=258)


class Floor:
    """The decode step's matmuls alone, on the checkpoint's weights."""

    def __init__(self, directory: Path, device: str = "cpu") -> None:
        from safetensors.torch import load_file

        self.device = torch.device(device)
        #: GB/s at which the K/V bytes of a step are read once (the caller sets the run's sum bandwidth)
        self.read_gbps = float("inf")
        w = load_file(str(Path(directory) / "model.safetensors"), device=str(self.device))
        self.linear: list[list[torch.Tensor]] = []  # checkpoint layout [out, in], one per projection
        self.packed: list[list[torch.Tensor]] = []  # q/k/v and gate/up stacked, stored [in, out]
        for i in range(ANCHOR["num_hidden_layers"]):
            p = f"model.layers.{i}."
            attn = [w[p + f"self_attn.{n}_proj.weight"] for n in "qkvo"]
            mlp = [w[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")]
            self.linear.append(attn + mlp)
            self.packed.append([torch.cat(attn[:3]).t().contiguous(), attn[3].t().contiguous(),
                                torch.cat(mlp[:2]).t().contiguous(), mlp[2].t().contiguous()])
        self.head = w["lm_head.weight"]
        self.head_t = self.head.t().contiguous()
        #: oneDNN's blocked copies of the packed matrices (None where oneDNN does not apply)
        self.blocked: list[Projection] | None = None
        if onednn_applies(self.head.device, self.head.dtype):
            self.blocked = [Projection(t, None, "onednn") for layer in self.packed for t in layer]
            self.blocked.append(Projection(self.head_t, None, "onednn"))
        weights = [t for name, t in w.items() if t.dim() == 2 and name != "model.embed_tokens.weight"]
        self.nbytes = sum(t.numel() * t.element_size() for t in weights)
        self.hidden, self.q, self.mlp = ANCHOR["hidden_size"], ANCHOR["hidden_size"], ANCHOR["intermediate_size"]

    def step_linear(self, x: torch.Tensor) -> torch.Tensor:
        for q, k, v, o, gate, up, down in self.linear:
            a = F.linear(x, q)
            F.linear(x, k)
            F.linear(x, v)
            x = F.linear(a, o)
            g = F.linear(x, gate)
            F.linear(x, up)
            x = F.linear(g, down)
        return F.linear(x, self.head)

    def step_packed(self, x: torch.Tensor) -> torch.Tensor:
        for qkv, o, gate_up, down in self.packed:
            a = torch.mm(x, qkv)[:, : self.q]
            x = torch.mm(a, o)
            g = torch.mm(x, gate_up)[:, : self.mlp]
            x = torch.mm(g, down)
        return torch.mm(x, self.head_t)

    def step_onednn(self, x: torch.Tensor) -> torch.Tensor:
        """`step_packed` through kvlife's projections in the oneDNN layout (torch.mm where kvlife takes it)."""
        assert self.blocked is not None
        for i in range(0, len(self.blocked) - 1, 4):
            qkv, o, gate_up, down = self.blocked[i : i + 4]
            x = o(qkv(x)[:, : self.q])
            x = down(gate_up(x)[:, : self.mlp])
        return self.blocked[-1](x)

    def attention(self, batch: int, context: int, steps: int) -> float:
        """ms of a decode step's attention at its least: per layer, [B, heads, 1, head_dim] queries over
        contiguous K and V of `context` tokens (no paging), the faster of SDPA and matmul-softmax-matmul."""
        heads, dim = ANCHOR["num_attention_heads"], self.hidden // ANCHOR["num_attention_heads"]
        q = torch.randn(batch, heads, 1, dim, device=self.device)
        kv = torch.randn(ANCHOR["num_hidden_layers"], 2, batch, heads, context, dim, device=self.device)

        def sdpa(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v)

        def matmuls(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * dim**-0.5, -1) @ v

        best = []
        for form in (sdpa, matmuls):
            times = []
            for i in range(steps + 3):
                t0 = time.perf_counter()
                for layer in kv:
                    form(layer[0], layer[1])
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            best.append(statistics.median(times[3:]))
        return 1e3 * min(best)

    def run(self, batch: int, context: int, steps: int = 30, kv_bytes: int = 4) -> dict:
        """The floor's step at `batch`, torch's attention over `context` tokens of contiguous K/V, and
        the time to read that K/V once (`kv_bytes` per element: 4 for float32, 2 for a bfloat16 cache)."""
        x = torch.randn(batch, self.hidden, device=self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        out = {}
        variants = [("linear", self.step_linear), ("packed", self.step_packed)]
        if self.blocked is not None:
            variants.append(("onednn", self.step_onednn))
        with torch.inference_mode():
            for name, step in variants:
                for _ in range(3):
                    step(x)
                times = []
                for _ in range(steps):
                    sync()
                    t0 = time.perf_counter()
                    step(x)
                    sync()
                    times.append(time.perf_counter() - t0)
                out[f"{name}_ms"] = 1e3 * statistics.median(times)
        out["step_ms"] = min(out[f"{name}_ms"] for name, _ in variants)
        with torch.inference_mode():
            out["attention_ms"] = self.attention(batch, context, steps)
        head_dim = self.hidden // ANCHOR["num_attention_heads"]  # K and V of every layer
        kv_heads, layers = ANCHOR["num_key_value_heads"], ANCHOR["num_hidden_layers"]
        out["kv_bytes"] = 2 * layers * batch * context * kv_heads * head_dim * kv_bytes
        out["kv_read_ms"] = out["kv_bytes"] / (self.read_gbps * 1e6)  # the bytes once, at the run's sum bandwidth
        return out
