"""Which model steps run on the event loop's own thread, and which on the loop's step thread.

A step on the step thread (`engine.runtime.step_thread`) lets the loop
answer submissions, aborts, health checks and HTTP streams while the step's
ops run. It costs a hand-off each way, 0.1-0.4 ms on the development VM.
On a CPU it also costs the contention of two threads for one GIL. The step
thread waits up to the interpreter's switch interval for the GIL at every
op boundary while the loop's thread runs Python, and the loop's thread
waits in turn. On a GPU the step mostly waits for the device, with the GIL
released, so the loop's work there is free.

The rule (`EngineConfig.inline_step_tokens`, `EngineConfig.inline_step_ms`):
a step of at most `inline_step_tokens` tokens runs inline, on every device.
On a CPU, so does a step expected to end within `inline_step_ms`. The
expectation is the step's tokens times the seconds per token of the recent
larger steps, an exponential average over the steps that took the thread
or were inlined by this rule. Before any such step has been timed, only the
token count decides. A step much larger than those timed is expected to
take longer per token than it will, so it is not inlined by mistake.

The rule is for single steps. A decode run (`EngineConfig.decode_steps`)
always takes the thread, and the rule learns nothing from it: a run's time
follows its rows and steps, not its tokens (16 steps of one row cost about
16 single steps, far more than 16 tokens of a prefill chunk).

Under fault injection every step runs on the thread (an injected stall
must block that thread, never the loop); `RuntimeLoop` passes zeros then.
"""

from __future__ import annotations

#: weight of the newest step in the average of seconds per token
SMOOTHING = 0.2


class InlineRule:
    """Decides where each step runs, and learns from the steps it times (see the module docstring)."""

    def __init__(self, tokens: int, budget_s: float) -> None:
        self.tokens = tokens
        self.budget_s = budget_s
        #: recent seconds per token of the steps above `tokens` (None: none timed yet)
        self.per_token_s: float | None = None

    def inline(self, num_tokens: int, steps: int = 1) -> bool:
        """Whether a batch of `num_tokens` tokens runs inline: never as a decode run (`steps` > 1)."""
        if steps > 1:
            return False
        if num_tokens <= self.tokens:
            return True
        per_token = self.per_token_s
        return per_token is not None and num_tokens * per_token <= self.budget_s

    def observe(self, num_tokens: int, seconds: float, steps: int = 1) -> None:
        """A step of `num_tokens` tokens took `seconds` (wall time, hand-offs included); a decode run
        (`steps` > 1) teaches nothing."""
        if self.budget_s <= 0 or num_tokens <= self.tokens or steps > 1:
            return
        sample = seconds / num_tokens
        per_token = self.per_token_s
        self.per_token_s = sample if per_token is None else per_token + SMOOTHING * (sample - per_token)
