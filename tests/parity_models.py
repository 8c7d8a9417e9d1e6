"""Tiny random checkpoints written by transformers, for the parity tests.

`write_checkpoint(directory, family)` builds a seeded 2-layer model of that
family with transformers, saves it with ``save_pretrained`` (config.json,
generation_config.json, model.safetensors) and writes a small byte-level BPE
tokenizer next to it, built with the `tokenizers` library in the style the
family's real checkpoints use (BOS template, Qwen's no-BOS ByteLevel, ...).
No hub access is needed or attempted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: Token ids of the tokenizer's specials; the models' configs use the same.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = ["<pad>", "<s>", "</s>"]
#: Declared only in tokenizer_config.json (transformers registers it on load).
DECLARED_ONLY = "<|im_end|>"
VOCAB_SIZE = 320  # the tokenizer's 300 tokens + the declared one, rounded up
WINDOW = 8

_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "kvlife decodes tokens and never leaks a page; every request finishes.",
    "paged attention, prefix caching, retraction and sliding windows!",
    "numbers 0123456789 and words: alpha beta gamma delta epsilon.",
] * 4

_QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")

_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
               pad_token_id=PAD_ID, max_position_embeddings=256)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

#: family -> (transformers config class name, extra config fields, tokenizer style)
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", {}, "bos"),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), "bos"),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1), "qwen"),
    "qwen3": ("Qwen3Config", {}, "qwen"),
    "gemma": ("GemmaConfig", {}, "bos"),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW), "bos_eos"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, shared_expert_intermediate_size=48, use_sliding_window=True,
                                         sliding_window=WINDOW, max_window_layers=2, **_MOE), "qwen"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, norm_topk_prob=True, **_MOE), "qwen"),
}

#: Prompts the parity tests run: token ids (two sharing a 12-token prefix, one
#: 21 tokens long so prompt + output runs well past WINDOW) and text (with a
#: special token written inside, and one only tokenizer_config.json declares).
MAX_NEW = 20
_SHARED = [BOS_ID, 40, 41, 42, 43, 50, 51, 60, 61, 62, 63, 64]
ID_PROMPTS = [
    [BOS_ID, 80, 81],
    [BOS_ID, 5, 9, 20, 33, 40, 41, 42, 43, 50, 51, 60, 3, 4, 5, 6, 7, 90, 91, 92, 93],
    _SHARED + [100, 101, 102],
    _SHARED + [110, 111],
]
TEXT_PROMPTS = [
    "hello world, the quick",
    "kvlife decodes tokens</s>and never leaks a page",  # a special token inside the text: one id
    f"numbers 0123 and words{DECLARED_ONLY} alpha beta",
]


#: Llama with each RoPE scaling (rope_parameters as transformers 5 writes them).
ROPE_SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


def write_checkpoint(directory: Path, family: str, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                     rope: dict[str, Any] | None = None, tokenizer: bool = True):
    """Save a seeded tiny `family` model (and tokenizer) under `directory`;
    returns the transformers model, in eval mode and `dtype`."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    class_name, extra, style = FAMILIES[family]
    fields = {**_COMMON, **extra}
    if rope is not None:
        fields["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    config = getattr(transformers, class_name)(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    _randomize(model, seed, gemma=family == "gemma")
    model = model.to(dtype)
    model.save_pretrained(directory)
    if tokenizer:
        write_tokenizer(directory, style)
    return model


def _randomize(model, seed: int, *, gemma: bool) -> None:
    """Weights that make greedy output depend on context: unit-variance
    embeddings, 1/sqrt(fan_in) matrices (larger for Gemma, whose tied,
    sqrt(hidden)-scaled embeddings otherwise just repeat the last token),
    norms near their identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                std = model.config.hidden_size**-0.5 if gemma else 1.0
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif param.dim() >= 2:
                std = (3.0 if gemma else 1.0) * param.shape[-1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif "norm" in name:
                param.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def write_tokenizer(directory: Path, style: str) -> None:
    """A byte-level BPE ``tokenizer.json`` + ``tokenizer_config.json``.

    Styles: ``bos`` (template ``<s> $A``, Llama-3/Mistral/Gemma style),
    ``bos_eos`` (``<s> $A </s>``), ``qwen`` (Qwen's split regex and NFC, no
    BOS, ``<|im_end|>`` declared only in tokenizer_config.json).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.decoder = decoders.ByteLevel()
    if style == "qwen":  # Qwen's own pipeline, which transformers' Qwen2Tokenizer rebuilds whatever the file says
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(_CORPUS, trainer)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                              "pad_token": "<pad>", "model_max_length": 256}
    if style == "qwen":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        config.update(tokenizer_class="Qwen2Tokenizer", bos_token=None, unk_token=None, add_bos_token=False,
                      additional_special_tokens=[DECLARED_ONLY])
    else:
        template = "<s> $A </s>" if style == "bos_eos" else "<s> $A"
        backend.post_processor = processors.TemplateProcessing(
            single=template, pair=f"{template} $B:1", special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)])
        config.update(add_bos_token=True, add_eos_token=style == "bos_eos")
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' ``generate(do_sample=False)`` continuation of `prompt`
    (stopping at the generation config's EOS, as it does), and its per-step
    float32 logits ``[steps, vocab]``."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.cat([step.float() for step in out.logits])


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``[L, vocab]`` over `token_ids` in one forward."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()
