"""Split a streamed reply into its thinking and its answer.

Qwen's generation prompt may already open `<think>` (thinking on), so the reply can start inside the
thinking block and only ever show `</think>`. Tags can arrive split across pushes ("</thi" + "nk>"),
so a possible tag prefix at the end of a push is held back until the next push or `flush()`.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_think(tokenizer, ids: list[int]) -> bool:
    """True when the prompt ends inside an open thinking block.

    Looks for the <think> / </think> token ids, so a user who types "<think>" (encoded as plain
    characters) cannot flip it; falls back to the text of the prompt's tail.
    """
    start, end = getattr(tokenizer, "think_start_id", None), getattr(tokenizer, "think_end_id", None)
    if start is None:
        text = tokenizer.decode(ids[-8:])
        return text.rfind(OPEN) > text.rfind(CLOSE)
    for t in reversed(ids):
        if t == start:
            return True
        if t == end:
            return False
    return False


class ThinkSplitter:
    def __init__(self, inside: bool = False):
        self.inside = inside
        self.seen_think = inside
        self._held = ""
        self._trim = False   # after </think>: drop the newlines before the answer's first character

    def push(self, text: str) -> tuple[str, str]:
        """Feed text; returns (thinking delta, answer delta)."""
        text = self._held + text
        self._held = ""
        think, answer = [], []
        while text:
            tag = CLOSE if self.inside else OPEN
            i = text.find(tag)
            if i < 0:
                keep = _partial_suffix(text, tag)
                self._held = text[len(text) - keep:]
                text = text[:len(text) - keep]
            part, text = (text, "") if i < 0 else (text[:i], text[i + len(tag):])
            if self.inside:
                think.append(part)
            else:
                answer.append(self._trimmed(part))
            if i >= 0:
                self.inside = not self.inside
                self.seen_think = True
                self._trim = not self.inside
        return "".join(think), "".join(answer)

    def _trimmed(self, part: str) -> str:
        if self._trim:
            part = part.lstrip("\n")
            self._trim = not part
        return part

    def flush(self) -> tuple[str, str]:
        """The held-back text, at the end of the stream."""
        held, self._held = self._held, ""
        return (held, "") if self.inside else ("", self._trimmed(held))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
