"""EngineConfig and SamplingParams: frozen, validated at construction.

Every validation error names the field and the limit (`InvalidConfig` for
the engine, `InvalidRequest` for a request's sampling parameters), with the
validators of `states.validation`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs

from engine.errors import InvalidConfig, InvalidRequest
from engine.speculative.config import SpeculativeConfig
from engine.structured.config import StructuredConfig
from engine.structured.constraint import Constraint, constraint_from
from hisparse.config import HiSparseConfig
from resources.contract import ResourceHookProtocol
from resources.plugins import PluginContext
from states.validation import (
    int_at_least,
    is_bool,
    is_int,
    is_number,
    number_above,
    number_at_least,
    one_of,
    optional_int_at_least,
    require,
)

#: The most logprob alternatives a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20
#: The most sequences one request may ask for.
MAX_N = 64


def _tuple_if_sequence(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


@runtime_checkable
class RemotePrefillSettings(Protocol):
    """What the engine config reads of `engine.disagg.RemotePrefill` (the link settings live with
    the links, above this module, so the config names them by what it needs of them)."""

    @property
    def peers(self) -> tuple[str, ...]:
        """The prefill servers' bootstrap addresses."""

    def validate_against(self, engine_config: EngineConfig) -> None:
        """Raise InvalidConfig if the settings do not fit this engine config."""


#: a plugin resource hook (used as is), or a factory `factory(PluginContext) -> hook` (docs/plugins.md)
ResourceSource = ResourceHookProtocol | Callable[[PluginContext], ResourceHookProtocol]


@attrs.frozen
class SamplingParams:
    """How to sample one request. `temperature=0` is greedy; `top_k=0` is off.

    - `stop_token_ids`: token ids that end the request (besides the model's EOS
      unless `ignore_eos`); `stop`: strings that end it, matched on the
      detokenized text across token boundaries and left out of the output.
    - `logprobs`: None, or how many top alternatives to report with each new
      token's log probability (0: the sampled token's only).
    - `n`: sequences to generate from one prompt (the prompt's KV is computed
      once and shared); a seeded request draws sequence i from seed + i.
    - `detokenize`: False skips text entirely (ids only; `stop` needs text).
    - `speculative`: False opts this request out of the engine's speculative
      decoding (a request that asks for `logprobs` never speculates).
    - `prompt_logprobs`: None, or how many top alternatives to report with each
      prompt token's log probability (vLLM's field; the first entry is None).
      They come from the forward pass that computes the prompt: such a request
      computes its whole prompt even when the prefix cache holds it.
    - `constraint`: None, or an `engine.Constraint` the output must match (a
      JSON schema, any JSON object, a regex, a choice, a Lark grammar;
      docs/structured.md). A dict of its fields is converted (the wire form).
    """

    max_new_tokens: int = attrs.field(default=16, validator=int_at_least(1, InvalidRequest))
    temperature: float = attrs.field(default=0.0)
    top_p: float = attrs.field(default=1.0)
    top_k: int = attrs.field(default=0, validator=int_at_least(0, InvalidRequest))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple_if_sequence)
    stop: tuple[str, ...] = attrs.field(default=(), converter=lambda v: (v,) if isinstance(v, str)
                                        else _tuple_if_sequence(v))
    ignore_eos: bool = attrs.field(default=False, validator=is_bool(InvalidRequest))
    seed: int | None = attrs.field(default=None)
    logprobs: int | None = attrs.field(default=None)
    n: int = attrs.field(default=1)
    detokenize: bool = attrs.field(default=True, validator=is_bool(InvalidRequest))
    #: when the engine speculates (`EngineConfig.speculative`), whether this request does
    speculative: bool = attrs.field(default=True, validator=is_bool(InvalidRequest))
    prompt_logprobs: int | None = attrs.field(default=None)
    constraint: Constraint | None = attrs.field(default=None, converter=constraint_from)

    def __attrs_post_init__(self) -> None:
        p = "SamplingParams"
        require(is_number(self.temperature) and self.temperature >= 0, InvalidRequest, f"{p}.temperature",
                "a finite number >= 0", self.temperature)
        require(is_number(self.top_p) and 0 < self.top_p <= 1, InvalidRequest, f"{p}.top_p", "a number in (0, 1]",
                self.top_p)
        require(isinstance(self.stop_token_ids, tuple) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                InvalidRequest, f"{p}.stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        require(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop), InvalidRequest,
                f"{p}.stop", "a list of non-empty strings", self.stop)
        require(not self.stop or self.detokenize, InvalidRequest, f"{p}.stop", "empty when detokenize is False",
                self.stop)
        require(self.top_k < 2**63, InvalidRequest, f"{p}.top_k", "an integer >= 0 and < 2**63 (0: no limit)",
                self.top_k)
        require(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63), InvalidRequest, f"{p}.seed",
                "None or an integer >= 0 and < 2**63", self.seed)
        require(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                InvalidRequest, f"{p}.logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        require(self.prompt_logprobs is None or (is_int(self.prompt_logprobs)
                                                 and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                InvalidRequest, f"{p}.prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]",
                self.prompt_logprobs)
        require(is_int(self.n) and 1 <= self.n <= MAX_N, InvalidRequest, f"{p}.n", f"an integer in [1, {MAX_N}]",
                self.n)
        require(self.constraint is None or isinstance(self.constraint, Constraint), InvalidRequest,
                f"{p}.constraint", "None or an engine.Constraint", self.constraint)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@attrs.frozen
class EngineConfig:
    """Everything an Engine needs. Defaults run the built-in tiny model on CPU.

    `max_context` (prompt + output tokens per request) defaults to the most the
    KV pool and the model allow: min(pool tokens, the model's
    max_position_embeddings). Any value works with any `page_size`: the token
    table is rounded up to whole pages. `starvation_timeout` is how long a
    request that could fit may wait for memory before the engine reports it
    (`memory.starved`, `Engine.health()`). `admission_window` (seconds, 0 = off) is
    how long the loop waits, after a step that finished requests and left slots free,
    for new submissions to join the next step (a client over the network resubmits a
    moment after its answer, and would otherwise wait a whole step; like vLLM's
    scheduler delay). Off by default: on the 2-core development VM a 2 ms window
    caught no resubmission of the HTTP benchmark's clients (docs/http.md).
    `inline_step_tokens`: a step of at most this many tokens runs on the event loop's
    thread instead of the loop's step thread (`engine.runtime.step_thread`; the hop
    there and back costs 0.1-0.4 ms, about 10% of a small decode step); larger steps,
    and every step under fault injection, run on the step thread so the loop keeps
    answering meanwhile. 0 = always the thread. A decode run (`decode_steps`) always
    takes the thread. `inline_step_ms`: on a CPU, a step
    expected to end within this many milliseconds (its tokens times the seconds per
    token of the recent larger steps) runs inline too: there the hand-offs and the two
    threads' contention for the GIL cost more than the loop's answering during the step
    is worth (`engine.runtime.inline_rule`; docs/benchmarks.md). 0 = tokens alone decide.
    `weight_layout`: how the projections' weights are packed at load
    (`engine.model.projection`): "packed" (``[in, out]`` for `torch.mm`, no
    copy), "onednn" (also a oneDNN blocked copy: CPU, float32 or bfloat16 only;
    1.6-8x faster matmuls on the development CPU, twice the weight memory) or
    "auto" (onednn where it applies, else packed).
    `greedy_head`: where a greedy step's tokens come from (`engine.model.greedy_head`):
    "auto" (a verified bfloat16 copy of the LM head where it applies: CPU, a float32
    model in the onednn layout, native bfloat16 matmuls; the float32 head elsewhere),
    "verified" (refused where it does not apply) or "full" (always the float32 head).
    `native_kernels`: kvlife's own CPU kernels for the decode step (`engine.model.native_kernels`:
    decode attention that reads paged K/V in place, the residual add with RMSNorm, RoPE, SwiGLU):
    "auto" (where they apply: a CPU device, a float32 model and a C++ compiler to build them on
    first use; torch's ops elsewhere), "on" (refused where they do not apply or cannot be built)
    or "off" (torch's ops alone).
    `decode_steps`: the most model steps a batch of plain decode rows runs back to back
    before the loop plans again (a decode run: `engine.runtime.decode_runs`, like vLLM's
    multi-step scheduling). Each later step takes the tokens the step before sampled; the
    loop applies and streams them after the run, so the host work between steps (about a
    tenth of a step at batch 1 on a CPU) is paid once per run. The price: tokens reach a
    stream in bursts of up to this many (a submission, an abort or a landed transfer ends a
    run on the step thread after its current step), and a row that stops inside a run computes the
    run's remaining tokens for nothing.
    Runs only while no request waits to be admitted. 1 (the default) = every step planned.
    Not with `speculative` (its verify steps already take several tokens) nor `hisparse`.
    `kv_cache_dtype`: the dtype of the KV cache's pages, "auto" (the default: the model's
    dtype), "float32", "float16" or "bfloat16". A float32 model with a bfloat16 cache (like
    vLLM's ``--kv-cache-dtype``) holds twice the tokens in the same memory and reads half the
    bytes per decode step; the model still computes in float32, each new K and V row is
    rounded to bfloat16 when stored and read back as float32 (the native CPU attention kernel
    widens each row it reads in place). Outputs then differ from a float32 cache's by that rounding. Both
    ends of a prefill/decode link must store the same dtype (the handshake refuses a mismatch).
    Not with `hisparse` unless "auto". A speculative draft model's own KV keeps its dtype.
    """

    model: str = attrs.field(default="tiny")
    device: str = attrs.field(default="cpu")
    #: on CUDA, decode steps replay CUDA graphs, one per batch bucket, captured at startup
    #: (`engine.model.decode_graphs`, docs/gpu.md); no effect on other devices
    cuda_graphs: bool = attrs.field(default=True, validator=is_bool(), kw_only=True)
    #: "auto": float32 for the built-in models, a checkpoint's own torch_dtype
    dtype: str = attrs.field(default="auto", validator=one_of("auto", "float32", "float16", "bfloat16"))
    #: the dtype the KV cache is stored in ("auto": the model's); see `kv_cache_dtype` above
    kv_cache_dtype: str = attrs.field(default="auto", validator=one_of("auto", "float32", "float16", "bfloat16"),
                                      kw_only=True)
    seed: int = attrs.field(default=0, validator=int_at_least(0))
    page_size: int = attrs.field(default=16, validator=int_at_least(1))
    num_kv_pages: int = attrs.field(default=1024, validator=int_at_least(2))
    max_running: int = attrs.field(default=64, validator=int_at_least(1))
    max_context: int | None = attrs.field(default=None, validator=optional_int_at_least(2))
    #: prefill tokens per step; beside decode rows a full chunk is trimmed (by at most half) so that the
    #: step's rows end on a size class, the row counts CPU projections run without padding (scheduler.py)
    max_prefill_tokens: int = attrs.field(default=512, validator=int_at_least(1))
    max_queued: int = attrs.field(default=4096, validator=int_at_least(1))
    prefix_cache: bool = attrs.field(default=True, validator=is_bool())
    hisparse: HiSparseConfig | None = attrs.field(default=None)
    disaggregation: str = attrs.field(default="none", validator=one_of("none", "decode"))
    #: decode role: prefill servers in other processes (an engine.disagg.RemotePrefill); None: in-process prefill
    remote_prefill: RemotePrefillSettings | None = attrs.field(default=None)
    leak_check: str = attrs.field(default="raise", validator=one_of("raise", "log", "off"))
    resources: tuple[ResourceSource, ...] = attrs.field(default=(), converter=_tuple_if_sequence)
    use_entry_points: bool = attrs.field(default=True, validator=is_bool())
    fence_timeout: float = attrs.field(default=30.0, validator=number_above(0))
    starvation_timeout: float = attrs.field(default=30.0, validator=number_above(0))
    admission_window: float = attrs.field(default=0.0, validator=number_at_least(0))
    inline_step_tokens: int = attrs.field(default=8, validator=int_at_least(0))
    inline_step_ms: float = attrs.field(default=20.0, validator=number_at_least(0))
    decode_steps: int = attrs.field(default=1, validator=int_at_least(1))
    mm_cache_bytes: int = attrs.field(default=64 << 20, validator=int_at_least(1))
    #: speculative decoding (an engine.speculative.SpeculativeConfig; docs/speculative.md); None: off
    speculative: SpeculativeConfig | None = attrs.field(default=None, kw_only=True)
    #: how grammars of constrained requests are compiled and bounded (docs/structured.md)
    structured: StructuredConfig = attrs.field(factory=StructuredConfig)
    # -- issue 21: scheduling and sessions (docs/scheduling.md)
    #: seconds of waiting worth one priority step (None: strict priority, the lowest class may starve)
    priority_aging: float | None = attrs.field(default=60.0)
    #: sessions open at once (0: no sessions, and no session hooks)
    max_sessions: int = attrs.field(default=64, validator=int_at_least(0))
    #: a session's lease: it closes this long after its latest activity (a turn or its opening)
    session_idle_timeout: float = attrs.field(default=300.0, validator=number_above(0))
    #: the most KV pages one session keeps locked (None: a whole max_context)
    session_max_pages: int | None = attrs.field(default=None, validator=optional_int_at_least(0))
    weight_layout: str = attrs.field(default="auto", validator=one_of("auto", "packed", "onednn"))
    greedy_head: str = attrs.field(default="auto", validator=one_of("auto", "verified", "full"))
    native_kernels: str = attrs.field(default="auto", validator=one_of("auto", "on", "off"))

    def __attrs_post_init__(self) -> None:
        p = "EngineConfig"
        require(isinstance(self.model, str) and self.model != "", InvalidConfig, f"{p}.model",
                "'tiny', 'tiny-moe' or a checkpoint directory", self.model)
        require(isinstance(self.device, str) and self.device != "", InvalidConfig, f"{p}.device",
                "a torch device string such as 'cpu' or 'cuda'", self.device)
        require(self.max_context is None or self.max_context <= self.pool_tokens, InvalidConfig, f"{p}.max_context",
                f"None or <= (num_kv_pages - 1) * page_size = {self.pool_tokens}", self.max_context)
        require(self.seed < 2**63, InvalidConfig, f"{p}.seed", "an integer < 2**63", self.seed)
        require(self.priority_aging is None or (is_number(self.priority_aging) and self.priority_aging > 0),
                InvalidConfig, f"{p}.priority_aging", "None or a finite number of seconds > 0", self.priority_aging)
        require(self.weight_layout != "onednn" or self.device.split(":")[0] == "cpu", InvalidConfig, f"{p}.weight_layout",
                "'auto' or 'packed' on a device other than 'cpu'", self.weight_layout)
        require(self.native_kernels != "on" or self.device.split(":")[0] == "cpu", InvalidConfig,
                f"{p}.native_kernels", "'auto' or 'off' on a device other than 'cpu'", self.native_kernels)
        # NOTE: the window holds every running request back: a long one would stall them all
        require(self.admission_window <= 0.1, InvalidConfig, f"{p}.admission_window",
                "a finite number in [0, 0.1] (seconds)", self.admission_window)
        require(isinstance(self.resources, tuple) and all(callable(r) or hasattr(r, "release")
                                                          for r in self.resources),
                InvalidConfig, f"{p}.resources", "a list of resource hooks or hook factories", self.resources)
        require(self.hisparse is None or isinstance(self.hisparse, HiSparseConfig), InvalidConfig, f"{p}.hisparse",
                "None or a HiSparseConfig", self.hisparse)
        if self.hisparse is not None:
            self.hisparse.validate_against(self, self.context_bound)
        require(self.speculative is None or isinstance(self.speculative, SpeculativeConfig), InvalidConfig,
                f"{p}.speculative", "None or an engine.speculative.SpeculativeConfig", self.speculative)
        require(self.speculative is None or self.hisparse is None, InvalidConfig, f"{p}.speculative",
                "None when hisparse is set (sparse decode attends one query per request)", self.speculative)
        require(self.decode_steps <= 64, InvalidConfig, f"{p}.decode_steps", "an integer in [1, 64]",
                self.decode_steps)
        require(self.decode_steps == 1 or (self.speculative is None and self.hisparse is None), InvalidConfig,
                f"{p}.decode_steps", "1 when speculative or hisparse is set (they run decode steps of their own)",
                self.decode_steps)
        require(self.kv_cache_dtype == "auto" or self.hisparse is None, InvalidConfig, f"{p}.kv_cache_dtype",
                "'auto' when hisparse is set (its host pool and index keep the model's dtype)", self.kv_cache_dtype)
        require(isinstance(self.structured, StructuredConfig), InvalidConfig, f"{p}.structured",
                "an engine.StructuredConfig", self.structured)
        require(self.remote_prefill is None or isinstance(self.remote_prefill, RemotePrefillSettings), InvalidConfig,
                f"{p}.remote_prefill", "None or an engine.disagg.RemotePrefill", self.remote_prefill)
        if self.remote_prefill is not None:
            self.remote_prefill.validate_against(self)

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool can hold (page 0 is reserved)."""
        return (self.num_kv_pages - 1) * self.page_size

    @property
    def context_bound(self) -> int:
        """`max_context` if set, else the pool's tokens (the model may lower it further)."""
        return self.max_context if self.max_context is not None else self.pool_tokens
