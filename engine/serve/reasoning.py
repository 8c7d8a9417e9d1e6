"""Reasoning models' thinking, split from the answer (`--reasoning-parser`), whole or streamed.

    splitter = ReasoningSplitter(initial_state("qwen3", prompt))
    thinking, answer = splitter.feed(delta)          # then splitter.feed("", final=True)

Qwen3 and DeepSeek-R1 write their thinking as ``<think> ... </think>`` before
the answer; it goes to the message's ``reasoning_content`` and the rest to
``content``. Where the output starts is read from the rendered prompt: a
prompt that leaves ``<think>`` open (DeepSeek-R1's template writes it) starts
the output in the thinking; one that ends with a closed, empty block (Qwen3
with ``enable_thinking: false``) starts it in the answer; otherwise ``qwen3``
thinks only when the output opens with ``<think>`` and ``deepseek_r1``
assumes thinking until ``</think>``. A constraint (``response_format``,
tools) applies only after the thinking ends (`Constraint.starts_after`).

While streaming, text that may still be a marker's start is held back until
the next delta decides it, so the thinking and the answer never show a
piece of a marker.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
#: parser -> where the output starts when the prompt does not say
REASONING_PARSERS = {"qwen3": "auto", "deepseek_r1": "reasoning"}


def initial_state(parser: str, prompt: str) -> str:
    """"reasoning", "content" or "auto" (the output decides) for an output after `prompt`."""
    if prompt.rfind(START) > prompt.rfind(END):
        return "reasoning"
    if prompt.rstrip().endswith(END):
        return "content"
    return REASONING_PARSERS[parser]


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` may still be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, state: str) -> None:
        self.state = state
        #: an output that starts in the thinking may still repeat the opening marker
        self._opening = state in ("auto", "reasoning")
        self._pending = ""

    @property
    def thinking(self) -> bool:
        return self.state != "content"

    def feed(self, delta: str, *, final: bool = False) -> tuple[str, str]:
        """(thinking, answer) that `delta` settles."""
        text = self._pending + delta
        self._pending = ""
        reasoning = content = ""
        if self._opening:
            stripped = text.lstrip()
            if stripped.startswith(START):
                text, self.state, self._opening = stripped[len(START):], "reasoning", False
            elif START.startswith(stripped) and not final:
                self._pending = text
                return "", ""
            else:
                self._opening = False
                if self.state == "auto":
                    self.state = "content"
        if self.state == "reasoning":
            at = text.find(END)
            if at >= 0:
                reasoning, text, self.state = text[:at], text[at + len(END):], "content"
            else:
                keep = 0 if final else _held(text, END)
                reasoning, self._pending = text[: len(text) - keep], text[len(text) - keep:]
                return reasoning, ""
        content = text
        return reasoning, content
