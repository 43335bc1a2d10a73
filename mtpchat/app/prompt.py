"""Moved to mtpchat/chat/prompt.py, which the app, the server and `run` share."""
from mtpchat.chat.prompt import build_prompt, offers_preserve_thinking

__all__ = ["build_prompt", "offers_preserve_thinking"]
