"""A chat as a Markdown document: the system prompt, each turn, thinking folded in <details>."""
from __future__ import annotations

import re
import time
from pathlib import Path


def chat_markdown(title: str, model: str, system: str, turns, now: float | None = None) -> str:
    """turns: (role, content, thinking, footer) tuples in order."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(now if now is not None else time.time()))
    out = [f"# {title}", "", f"*{model} · exported {when}*", ""]
    if system.strip():
        out += ["## System", "", system.strip(), ""]
    for role, content, thinking, footer in turns:
        out += [f"## {'You' if role == 'user' else 'Assistant'}", ""]
        if thinking.strip():
            out += ["<details><summary>Thinking</summary>", "", thinking.strip(), "", "</details>", ""]
        out += [content.strip(), ""]
        if footer:
            out += [f"*{footer}*", ""]
    return "\n".join(out)


def export_path(folder: Path, title: str, now: float | None = None) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "chat"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return folder / f"mtpchat-{slug}-{stamp}.md"
