"""Dialogs: the sessions list, the system prompt, sampling settings, and picking a code block."""
from __future__ import annotations

import time
from dataclasses import fields, replace

from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from mtpchat.app.settings import PRESETS, Sampling


class Dialog(ModalScreen):
    BINDINGS = [Binding("escape", "dismiss_none", "Close", id="dialog.close")]

    def action_dismiss_none(self) -> None:
        self.dismiss(None)


class SessionsScreen(Dialog):
    """Pick a chat to reopen (enter) or delete one (d). Dismisses with the session id."""

    BINDINGS = [Binding("d,delete", "delete", "Delete chat", id="sessions.delete")]

    def __init__(self, store, current: int | None, now=time.time):
        super().__init__()
        self.store, self.current, self.now = store, current, now

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Chats  [dim](enter opens · d deletes · esc closes)[/]", classes="dialog-title")
            yield OptionList(id="sessions")

    def on_mount(self) -> None:
        self._fill()

    def _fill(self) -> None:
        ol = self.query_one(OptionList)
        ol.clear_options()
        for s in self.store.sessions():
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(s.updated))
            mark = "● " if s.id == self.current else "  "
            ol.add_option(Option(f"{mark}{escape(s.title)}  [dim]{when} · {s.messages} messages[/]", id=str(s.id)))
        if ol.option_count:
            ol.highlighted = 0
        ol.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_delete(self) -> None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return
        sid = int(ol.get_option_at_index(ol.highlighted).id)
        if sid == self.current and self.app.busy:
            self.app.notify("this chat is still streaming a reply: press Esc in the chat first", severity="warning")
            return
        self.store.delete_session(sid)
        self.app.notify("chat deleted")
        if sid == self.current:
            self.app.call_later(self.app.action_new_chat)
            self.current = None
        self._fill()


class SystemPromptScreen(Dialog):
    """Edit the system prompt of the current chat. Dismisses with the new text."""

    BINDINGS = [Binding("ctrl+s", "save", "Save", id="system.save", priority=True)]

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("System prompt  [dim](ctrl+s saves · esc cancels)[/]", classes="dialog-title")
            yield TextArea(self.text, id="system-text", soft_wrap=True)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.dismiss(None)


_LABELS = {"temperature": "temperature", "top_p": "top p", "top_k": "top k", "min_p": "min p",
           "presence_penalty": "presence penalty", "max_tokens": "max tokens", "seed": "seed (blank = random)"}


class SamplingScreen(Dialog):
    """Edit sampling settings, or start from one of Qwen's presets. Dismisses with a Sampling."""

    # enter in any field applies (ctrl+s is the chat's export: one key, one meaning)

    def __init__(self, sampling: Sampling):
        super().__init__()
        self.sampling = sampling

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Sampling  [dim](presets from the Qwen model card · enter applies · esc cancels)[/]",
                        classes="dialog-title")
            with Horizontal(classes="presets"):
                for i, name in enumerate(PRESETS):
                    yield Button(name, id=f"preset-{i}", compact=True)
            with Grid(classes="fields"):
                for f in fields(Sampling):
                    yield Label(_LABELS[f.name])
                    kind = "integer" if f.name in ("top_k", "max_tokens", "seed") else "number"
                    yield Input(self._text(f.name), type=kind, id=f"f-{f.name}", compact=True)
            yield Static("", id="sampling-error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def _text(self, name: str) -> str:
        v = getattr(self.sampling, name)
        return "" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    def _fill(self, s: Sampling) -> None:
        self.sampling = s
        for f in fields(Sampling):
            self.query_one(f"#f-{f.name}", Input).value = self._text(f.name)

    def read(self) -> tuple[Sampling | None, str | None]:
        values = {}
        for f in fields(Sampling):
            raw = self.query_one(f"#f-{f.name}", Input).value.strip()
            if f.name == "seed" and not raw:
                values[f.name] = None
                continue
            try:
                values[f.name] = int(raw) if f.name in ("top_k", "max_tokens", "seed") else float(raw)
            except ValueError:
                return None, f"{_LABELS[f.name]}: '{raw}' is not a number"
        s = replace(self.sampling, **values)
        return (None, s.check()) if s.check() else (s, None)

    def action_save(self) -> None:
        s, err = self.read()
        if err:
            self.query_one("#sampling-error", Static).update(f"[$error]{err}[/]")
            return
        self.dismiss(s)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        bid = event.button.id or ""
        if bid.startswith("preset-"):
            name = list(PRESETS)[int(bid.split("-")[1])]
            self._fill(replace(PRESETS[name], max_tokens=self.sampling.max_tokens, seed=self.sampling.seed))
        elif bid == "save":
            self.action_save()
        else:
            self.dismiss(None)


class CodePickScreen(Dialog):
    """Several code blocks in the message: pick the one to copy. Dismisses with its index."""

    def __init__(self, blocks: list[str]):
        super().__init__()
        self.blocks = blocks

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label("Copy which code block?", classes="dialog-title")
            yield OptionList(*(Option(self._label(i, b), id=str(i)) for i, b in enumerate(self.blocks)))

    @staticmethod
    def _label(i: int, block: str) -> str:
        first = next((ln for ln in block.splitlines() if ln.strip()), "").strip()
        return f"{i + 1}. {escape(first[:60])}  [dim]({len(block.splitlines())} lines)[/]"

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))
