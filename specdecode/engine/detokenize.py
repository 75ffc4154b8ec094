"""The text of a growing completion, decoded a few tokens at a time: a round costs O(its tokens), not O(length).

Decoding the whole completion every round is quadratic over a long answer. As vLLM's incremental
detokenizer does, each new token decodes a short window that starts a few tokens back, so a character
split over several byte tokens, or a tokenizer that treats a sequence's first token specially, is decoded
in context; what the window adds beyond its already-known prefix is appended once it ends in a complete
character. The text equals `tokenizer.decode(ids, skip_special_tokens=True)` (tested on the real
tokenizer). Stop strings are searched only in the part that is new since the last search.
"""


class IncrementalText:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # complete characters only
        self.prefix = 0  # the window starts here (token index)
        self.read = 0  # ids before this are in `text`
        self.searched = 0  # characters of `text` already searched for stop strings
        self.stop_at: int | None = None  # where the first stop string starts, once found

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _pending(self) -> str:
        known = self._decode(self.ids[self.prefix : self.read])
        return self._decode(self.ids[self.prefix :])[len(known) :]

    def append(self, token: int) -> None:
        self.ids.append(token)
        new = self._pending()
        if new and not new.endswith("\ufffd"):
            self.text += new
            self.prefix, self.read = self.read, len(self.ids)
        if self.stop_at is None and self.stop:
            start = max(0, self.searched - max(len(s) for s in self.stop) + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            self.stop_at = min(hits) if hits else None
            self.searched = len(self.text)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.append(token)

    def visible(self, final: bool = False) -> str:
        """The text cut before the first stop string; `final` adds an unfinished last character (as U+FFFD)."""
        if self.stop_at is not None:
            return self.text[: self.stop_at]
        return self.text + self._pending() if final else self.text
