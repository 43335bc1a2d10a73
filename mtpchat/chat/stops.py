"""Stop strings: the reply ends where one first appears, and none of it is shown.

A stop string can arrive split across tokens, so the tail that could still start one is held back
until the next push shows it is not one, or until `flush()`.
"""
from __future__ import annotations


class StopStrings:
    """Cuts the text at the first stop string; holds back a tail that could still start one."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""
        self.hit = False

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        text = self.held + text
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.hit, self.held = True, ""
            return text[:min(cuts)]
        out = text[:max(len(text) - self.keep, 0)]
        self.held = text[len(out):]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out
