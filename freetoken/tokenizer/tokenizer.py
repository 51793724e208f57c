"""Tokenizer: a checkpoint's tokenizer.json plus what tokenizer_config.json says around it.

Reads a Hugging Face checkpoint folder the way transformers (v5) does, so ids, text and chat
prompts match it exactly: tokenizer.json is the whole encoder/decoder; tokenizer_config.json
names the special tokens and holds the chat template; chat_template.jinja (and named templates
in additional_chat_templates/) take precedence over the config's template; special_tokens_map.json
only fills tokens the config leaves unset. No BOS/EOS is added unless asked, and
clean_up_tokenization_spaces is not applied: transformers v5 skips it for BPE models too.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

from freetoken.tokenizer.chat_template import render_chat

# transformers' named special tokens, in its order (which all_special_ids follows).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")


GIL_FREE_CHARS = 16_384     # longer texts tokenize without holding the GIL


class Tokenizer:
    def __init__(self, backend: _Backend, config: dict, chat_template: str | dict | None = None,
                 name_or_path: str = ""):
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self._add_missing_tokens(config.get("added_tokens_decoder") or {})
        # e.g. {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}: unset ones are absent,
        # as in transformers' special_tokens_map, which templates receive as variables.
        self.special_tokens_map = {k: s for k in NAMED_SPECIAL_TOKENS
                                   if (s := _token_str(config.get(k))) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra = extra.values() if isinstance(extra, dict) else extra
        self.extra_special_tokens = [s for s in map(_token_str, extra) if s is not None]
        self.all_special_ids = self._special_ids()
        self._special_id_set = frozenset(self.all_special_ids)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}: FreeToken reads Hugging Face fast-tokenizer files "
                f"(tokenizer.json); convert the tokenizer with transformers' save_pretrained, or "
                f"run without a tokenizer (token ids in, token ids out)")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception
            raise ValueError(f"cannot parse {tok_file}: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        for key, value in special_map.items():
            if config.get(key) is None:
                config[key] = value
        return cls(backend, config, _chat_template(folder, config), name_or_path=str(folder))

    def _add_missing_tokens(self, added_tokens_decoder: dict) -> None:
        # Added tokens the config lists but tokenizer.json lacks (transformers adds them too).
        for token_id, spec in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0])):
            content = spec.get("content") if isinstance(spec, dict) else None
            if content is None or self.backend.token_to_id(content) is not None:
                continue
            token = AddedToken(content, special=bool(spec.get("special")),
                               normalized=bool(spec.get("normalized", not spec.get("special"))),
                               lstrip=bool(spec.get("lstrip")), rstrip=bool(spec.get("rstrip")),
                               single_word=bool(spec.get("single_word")))
            if spec.get("special"):
                self.backend.add_special_tokens([token])
            else:
                self.backend.add_tokens([token])

    def _special_ids(self) -> list[int]:
        # Named tokens, then the extra ones, then any other token tokenizer.json marks special
        # (decode(skip_special_tokens=True) drops exactly those marked special).
        names = [*self.special_tokens_map.values(), *self.extra_special_tokens]
        ids = [i for i in map(self.backend.token_to_id, names) if i is not None]
        ids += [i for i, t in sorted(self.backend.get_added_tokens_decoder().items()) if t.special]
        return list(dict.fromkeys(ids))

    # -- ids <-> text ----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) > GIL_FREE_CHARS:
            # encode_batch releases the GIL (encode holds it: seconds for megabytes of text,
            # while the event loop could not run); the same ids.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (logprobs report them): part of a UTF-8 character for a
        byte-level token that splits one, where decode() would give U+FFFD. Byte-level BPE maps
        its alphabet back to bytes, SentencePiece's <0xNN> and "▁" are a byte and a space;
        added tokens and other vocabularies are their text's UTF-8."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        kind = self._decoder_kind
        if kind == "ByteLevel":
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    @functools.cached_property
    def _added_ids(self) -> frozenset:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _decoder_kind(self) -> str | None:
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
        if "ByteLevel" in kinds:
            return "ByteLevel"
        if "ByteFallback" in kinds or "Metaspace" in kinds:
            return "sentencepiece"
        return None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_id_set

    @property
    def vocab_size(self) -> int:
        """All tokens, added ones included (transformers' len(tokenizer), not its vocab_size).
        A model's embedding table may be larger still: ids past this decode to nothing."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.backend.id_to_token(i) for i in self.all_special_ids]

    def _named_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    # -- chat ------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template text: an explicit one, else the checkpoint's ("tool_use" when tools are
        given and the checkpoint names one, else "default")."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"{self.name_or_path} has several chat templates and no default: "
                             f"{sorted(templates)}")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError(f"{self.name_or_path or 'this tokenizer'} has no chat template "
                             f"(tokenizer_config.json's chat_template or chat_template.jinja)")
        return templates

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True,
                            tokenize: bool = False, *, chat_template: str | None = None,
                            documents=None, **template_kwargs):
        """The prompt text (or its ids when tokenize) that transformers' apply_chat_template gives
        for the same arguments. template_kwargs (enable_thinking, ...) reach the template next
        to the special-token strings (bos_token, eos_token, ...), and win over them."""
        source = self.get_chat_template(chat_template, tools)
        context = {**self.special_tokens_map, **template_kwargs}
        text = render_chat(source, messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt, **context)
        # The template writes the special tokens itself: none are added around the prompt.
        return self.encode(text, add_special_tokens=False) if tokenize else text


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_str(value) -> str | None:
    # A special token in a config is a string, or an AddedToken dict {"content": ..., ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _chat_template(folder: Path, config: dict) -> str | dict | None:
    """The checkpoint's template(s): a string, or {name: template} when it has several."""
    template = config.get("chat_template")
    if isinstance(template, list):       # [{"name": ..., "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            files[f.stem] = f.read_text(encoding="utf-8")
    if list(files) == ["default"]:
        return files["default"]
    return files or template
