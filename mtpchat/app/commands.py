"""Key bindings and the command palette entries, both from one table.

Every binding has an id, so a keymap file (`keymap.toml` in the data directory, lines like
`toggle_mtp = "f2"`) can move it. Keys avoid what terminals or the composer already use; every
action is also reachable by name from the command palette (ctrl+p).
"""
from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class Command:
    id: str
    keys: str
    action: str
    short: str          # footer label
    title: str          # command palette title
    help: str
    footer: bool = True
    priority: bool = False    # f6 / f7 are the composer's own select keys: the app must see them first


COMMANDS = (
    Command("stop", "escape", "stop", "Stop", "Stop generating", "Stop the reply that is streaming"),
    Command("toggle_mtp", "ctrl+t,f2", "toggle_mtp", "MTP", "Toggle MTP",
            "Turn speculative decoding with the MTP head on or off (takes effect at the next step)"),
    Command("draft_up", "f4,alt+up", "draft_up", "k+", "More draft tokens", "Draft one more token per step"),
    Command("draft_down", "f3,alt+down", "draft_down", "k-", "Fewer draft tokens",
            "Draft one token fewer per step"),
    Command("toggle_think", "f5,ctrl+g", "toggle_think", "Think", "Toggle thinking",
            "Ask the model to think before answering, or not (next reply)"),
    Command("cycle_effort", "alt+e", "cycle_effort", "Effort", "Reasoning effort",
            "Cycle the reasoning effort of the next reply: off, low, medium, xhigh (where the model's chat "
            "template takes reasoning_effort, as Qwen3.8's does)", footer=False),
    Command("toggle_keep_thinking", "alt+k", "toggle_keep_thinking", "Keep think", "Keep thinking in history",
            "Keep earlier replies' thinking in the prompt (the template's preserve_thinking), or leave it out as "
            "the model was trained", footer=False),
    Command("regenerate", "ctrl+r", "regenerate", "Regen", "Regenerate", "Replace the last reply with a new one"),
    Command("edit_last", "ctrl+l", "edit_last", "Edit", "Edit last message",
            "Take the last message and its reply back into the composer", footer=False),
    Command("new_chat", "ctrl+n", "new_chat", "New", "New chat", "Start a new chat"),
    Command("sessions", "ctrl+o", "sessions", "Chats", "Chats", "Open, or delete, a saved chat"),
    Command("race", "f8", "race", "Race", "Race MTP off vs on",
            "Run the last prompt with MTP off, then on, side by side, and show the speedup"),
    Command("system_prompt", "f6", "system_prompt", "System", "System prompt",
            "Edit the system prompt of this chat", footer=False, priority=True),
    Command("sampling", "f7", "sampling", "Sampling", "Sampling settings",
            "Temperature, top-p, top-k, min-p, presence penalty, max tokens, seed; Qwen's presets", footer=False,
            priority=True),
    Command("copy_message", "f9", "copy_message", "Copy", "Copy message",
            "Copy the selected message (or the last reply) to the clipboard", footer=False),
    Command("copy_code", "f10", "copy_code", "Copy code", "Copy code block",
            "Copy a code block of the selected message (or the last reply)", footer=False),
    Command("export", "ctrl+s", "export", "Export", "Export chat to Markdown",
            "Write this chat to a Markdown file in the current directory", footer=False),
    Command("toggle_tint", "f11", "toggle_tint", "Tint", "Tint tokens by provenance",
            "Colour accepted draft tokens differently from the target's own tokens", footer=False),
    Command("theme", "f12", "change_theme", "Theme", "Theme", "Pick a colour theme", footer=False),
)

# f4 and f3 share one place in the footer ("f4 f3 k±"), so that at 80 columns every key shown fits
DRAFTS = Binding.Group("k±", compact=True)
BINDINGS = [Binding(c.keys, c.action, c.short, show=c.footer, id=c.id, tooltip=c.help, priority=c.priority,
                    group=DRAFTS if c.id in ("draft_up", "draft_down") else None)
            for c in COMMANDS]

# actions that only make sense on the chat screen (not inside a dialog or the race)
CHAT_ONLY = {"toggle_think", "cycle_effort", "toggle_keep_thinking", "regenerate", "edit_last", "new_chat", "sessions", "race", "system_prompt",
             "sampling", "copy_message", "copy_code", "export", "toggle_tint"}
