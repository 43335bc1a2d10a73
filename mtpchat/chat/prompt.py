"""The prompt of a chat turn: the conversation rendered by the model's chat template, and where the
rendered conversation ends in it, the position whose decode state a later turn resumes from
(engine/snapshots.py)."""
from __future__ import annotations


def offers_preserve_thinking(tokenizer) -> bool:
    """Whether the chat template reads `preserve_thinking` (Qwen3.6's keeps earlier turns' thinking with it)."""
    return "preserve_thinking" in (getattr(tokenizer, "chat_template", None) or "")


def build_prompt(tokenizer, messages: list[dict], think: bool, keep_thinking: bool = False) -> tuple[list[int], tuple]:
    """The prompt ids for the next reply, and the positions worth a snapshot of the decode state
    (engine/snapshots.py): where the rendered conversation ends, before the generation prompt. The
    next turn's prompt goes on from there even when the template drops this reply's thinking."""
    extra = {"preserve_thinking": True} if keep_thinking and offers_preserve_thinking(tokenizer) else {}
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=think, **extra))
    history = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=think, **extra))
    return ids, ((len(history),) if 0 < len(history) < len(ids) and ids[:len(history)] == history else ())
