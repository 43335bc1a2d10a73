"""The prompt of a chat turn: the conversation rendered by the model's chat template, and where the
rendered conversation ends in it, the position whose decode state a later turn resumes from
(engine/snapshots.py)."""
from __future__ import annotations


def offers_preserve_thinking(tokenizer) -> bool:
    """Whether the chat template reads `preserve_thinking` (Qwen3.6's keeps earlier turns' thinking with it)."""
    return "preserve_thinking" in (getattr(tokenizer, "chat_template", None) or "")


def build_prompt(tokenizer, messages: list[dict], think: bool, keep_thinking: bool = False,
                 tools: list[dict] | None = None, prefix: str = "") -> tuple[list[int], tuple]:
    """The prompt ids for the next reply, and the positions worth a snapshot of the decode state
    (engine/snapshots.py): where the rendered conversation ends, before the generation prompt. The
    next turn's prompt goes on from there even when the template drops this reply's thinking.

    `tools` (OpenAI function definitions) are rendered by the template; `prefix` is text the reply
    starts with, written for the model (chat/tools.py forced_prefix)."""
    extra = {"preserve_thinking": True} if keep_thinking and offers_preserve_thinking(tokenizer) else {}
    if tools:
        extra["tools"] = tools
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=think, **extra))
    history = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=think, **extra))
    if prefix:
        ids += tokenizer.encode(prefix)
    return ids, ((len(history),) if 0 < len(history) < len(ids) and ids[:len(history)] == history else ())


def fewest_tokens(tokenizer, texts) -> int:
    """A lower bound on the tokens of these texts, known without encoding them: a text of n bytes
    is at least n / (the longest token's bytes) tokens. 0 where the tokenizer does not say."""
    longest = getattr(tokenizer, "longest_token", None)
    if not isinstance(longest, int) or longest < 1:
        return 0
    return sum(len(t.encode("utf-8", "replace")) for t in texts) // longest
