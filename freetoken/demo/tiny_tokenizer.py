"""The tiny checkpoints' tokenizer: a byte-level BPE trained on corpus.txt, in Qwen3's style.

It is built like Qwen2/Qwen3's tokenizer.json (NFC normaliser, Qwen's split regex, byte-level
alphabet, no BOS), so the runtime meets the same structure it meets on real checkpoints, and its
added tokens copy Qwen3's: the three ChatML specials, and <think>/<tool_call>/<tool_response>
as plain added tokens (special=False) so that decode keeps them. Training is deterministic: the
trainer orders its initial alphabet and breaks ties between merges by the pair itself.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

DEMO_DIR = Path(__file__).parent
BPE_VOCAB_SIZE = 1900   # byte alphabet (256) + merges; the added tokens come after
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PLAIN_ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                      "</tool_response>")
EOS_TOKEN, PAD_TOKEN = "<|im_end|>", "<|endoftext|>"
# Qwen2/Qwen3's pre-tokenisation regex: contractions, letter runs with one leading non-letter,
# single digits, punctuation runs, newlines, spaces.
SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


# The chat template's variants, which differ only in the generation prompt (the last block):
#   qwen3     Qwen3's: the model opens <think> itself; enable_thinking=false writes an empty block.
#   thinking  always-on thinking (Qwen3-Thinking-2507 style): the prompt opens the think block;
#             there is no switch.
#   graded    the prompt opens the think block unless enable_thinking=false, and a
#             reasoning_effort is announced in a system turn before the answer.
_GENERATION_PROMPTS = {
    "thinking": """{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n<think>\\n' -}}
{%- endif -%}
""",
    "graded": """{%- if add_generation_prompt -%}
    {%- if reasoning_effort is defined and reasoning_effort -%}
        {{- '<|im_start|>system\\nReasoning effort: ' + reasoning_effort + '<|im_end|>\\n' -}}
    {%- endif -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- else -%}
        {{- '<think>\\n' -}}
    {%- endif -%}
{%- endif -%}
""",
}
CHAT_TEMPLATES = ("qwen3", *_GENERATION_PROMPTS)
_SPLIT = "{#- The generation prompt: the template variants of tiny_tokenizer.py replace from here on. -#}\n"


def chat_template(variant: str = "qwen3") -> str:
    source = (DEMO_DIR / "chat_template.jinja").read_text(encoding="utf-8")
    if variant == "qwen3":
        return source
    if variant not in _GENERATION_PROMPTS:
        raise ValueError(f"unknown chat template {variant!r}; choose from {', '.join(CHAT_TEMPLATES)}")
    return source.split(_SPLIT)[0] + _SPLIT + _GENERATION_PROMPTS[variant]


@functools.lru_cache(maxsize=None)
def tokenizer_json() -> str:
    """tokenizer.json's text. Cached: training takes ~0.1 s and every tiny checkpoint shares it."""
    tok = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = (DEMO_DIR / "corpus.txt").read_text(encoding="utf-8")
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    return tok.to_str(pretty=True)


def tokenizer_config(tok: Tokenizer, model_max_length: int, template: str = "qwen3") -> dict:
    """tokenizer_config.json, with the keys transformers reads (and writes for Qwen3)."""
    added = {}
    for token_id, token in sorted(tok.get_added_tokens_decoder().items()):
        added[str(token_id)] = {"content": token.content, "lstrip": token.lstrip,
                                "normalized": token.normalized, "rstrip": token.rstrip,
                                "single_word": token.single_word, "special": token.special}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": chat_template(template),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        # The generic class: transformers builds it from tokenizer.json alone (v4 and v5).
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def build_tokenizer() -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json())


def write_tokenizer(out_dir: Path, model_max_length: int, template: str = "qwen3") -> None:
    """Write tokenizer.json and tokenizer_config.json (with the named chat template) into out_dir."""
    (out_dir / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    config = tokenizer_config(build_tokenizer(), model_max_length, template)
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
