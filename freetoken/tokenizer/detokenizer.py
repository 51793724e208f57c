"""Incremental detokenization: new text per generated token, never half a character.

A byte-level token can hold part of a UTF-8 character (an emoji is often 2-4 tokens), and
decoding such a tail gives U+FFFD. So text is handed out only when the decoded tail does not
end in U+FFFD; until then it is held back. Each step decodes only a short window, not the whole
sequence: ids[prefix:read] is text already handed out (kept as context, since some decoders,
e.g. SentencePiece's, treat a window's first token differently), ids[read:] is pending, and
the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]). Everything handed out,
plus flush() at the end, equals tokenizer.decode(all ids).
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0   # start of the context window
        self.read_offset = 0     # ids before this are handed out as text
        self._prefix_text = ""   # decode(ids[prefix_offset:read_offset]), cached

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids) -> str:
        """Feed one id or a list; returns the text that became complete (may be "").

        A list is taken one id at a time, so an unfinished character at its end holds back
        only itself, not the whole list.
        """
        if isinstance(token_ids, int):
            return self._add_one(token_ids)
        return "".join([self._add_one(i) for i in token_ids])

    def _add_one(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self._decode(self.ids[self.prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            # Nothing new yet (a skipped special token), or the tail is an unfinished character.
            return ""
        new = text[len(self._prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self._prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        return new

    def flush(self) -> str:
        """The end of the stream: hand out what is held back, as one-shot decode would show it
        (an unfinished character really is U+FFFD by now)."""
        if self.read_offset == len(self.ids):
            return ""
        text = self._decode(self.ids[self.prefix_offset:])
        new = text[len(self._prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self._prefix_text = ""
        return new
