"""Text in and out: tokenizer loading (a checkpoint's tokenizer.json and tokenizer_config.json),
chat-template rendering that matches transformers', and incremental detokenization for streams.

May import `tokenizers` and `jinja2` only (never transformers, never the engine or server).
"""

from freetoken.tokenizer.detokenizer import IncrementalDetokenizer
from freetoken.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
