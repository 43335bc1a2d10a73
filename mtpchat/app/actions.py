"""What each key (and command palette entry) does. Mixed into ChatApp."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from textual.app import SystemCommand
from textual.markup import escape

from mtpchat.app.chat import ChatLog, Composer, MessageView, copyable_blocks
from mtpchat.app.commands import CHAT_ONLY, COMMANDS
from mtpchat.app.errors import NO_MTP
from mtpchat.app.export import chat_markdown, export_path
from mtpchat.chat.prompt import (effort_label, keeps_thinking_by_default, next_effort, offers_preserve_thinking,
                                  reasoning_efforts)
from mtpchat.app.race import LANES, RaceScreen
from mtpchat.app.screens import CodePickScreen, SamplingScreen, SessionsScreen, SystemPromptScreen
from mtpchat.app.store import decode_spans


FIXED_ON_SERVER = {"toggle_mtp", "draft_up", "draft_down", "race"}


class ChatActions:
    # --- helpers ---
    def _chat(self) -> ChatLog:
        return self.query_one(ChatLog)

    def _views(self) -> list[MessageView]:
        return self._chat().views()

    def _engine_ready(self) -> bool:
        if self.engine is None:
            self.notice(self.load_error or "the model is still loading; try again in a moment",
                        "error" if self.load_error else "warning")
            return False
        return True

    def _when_idle(self, fn) -> None:
        """Run fn now, or stop the reply and run fn once its thread has ended."""
        if self.busy:
            self._pending = fn
            self.action_stop()
        else:
            self.call_later(fn)

    def _prompt_messages(self, views=None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system.strip() else []
        for v in views if views is not None else self._views():
            if v.content or v.role == "user":
                msgs.append({"role": v.role, "content": v.content})
                if v.role == "assistant" and v.thinking:
                    # the template decides: Qwen's drop it from earlier turns unless preserve_thinking
                    msgs[-1]["reasoning_content"] = v.thinking
        return msgs

    def check_action(self, action: str, parameters) -> bool | None:
        if action in CHAT_ONLY and self.screen is not self.screen_stack[0]:
            return False
        return True

    def _fixed_here(self) -> bool:
        """On a server, MTP, the draft count and the race were set at its launch: a key for them
        says so, rather than doing nothing."""
        if self.engine is not None and self.engine.fixed:
            self.notice(f"{self.engine.fixed}; the race needs MTP switched per request, so it runs only "
                        "on a local model", "warning")
            return True
        return False

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for c in COMMANDS:
            if c.id != "theme":
                # the keys escaped: "[f4]" alone would read as a markup tag and vanish
                keys = escape(f"[{' / '.join(c.keys.split(','))}]")
                yield SystemCommand(c.title, f"{escape(c.help)}  {keys}", lambda a=c.action: self.run_action(a))

    # --- sending ---
    def _claim(self) -> None:
        """Mark a reply as under way from its first step, before the views it awaits are mounted."""
        if not self.busy:     # a stop pressed from here on reaches _start_generation
            self.busy = True
            self._stop.clear()

    async def on_composer_submitted(self, event: Composer.Submitted) -> None:
        if self.engine is None and self.load_error is None and event.text.strip():
            self._queued = event.text       # sent by on_engine_ready; the text stays in the box till then
            self.query_one(Composer).border_subtitle = "queued: goes out when the model is ready"
            self.notice("the model is still loading: this message goes out as soon as it is ready")
            return
        if not self._engine_ready():
            return
        if self.busy:
            self.notice("a reply is still streaming: press Esc to stop it", "warning")
            return
        self._claim()
        self.query_one(Composer).clear()
        text = event.text.strip()
        mid = self._save("user", text)
        await self._chat().add(MessageView("user", text, message_id=mid))
        await self._start_reply()

    async def _start_reply(self) -> None:
        self._claim()
        messages = self._prompt_messages()
        view = await self._chat().add(MessageView("assistant", tint=self.tint, thinking_live=self.think))
        view.set_footer("generating…")
        self._chat().anchor()
        self._reply_view = view
        self.telemetry.new_reply()
        self._begin([("chat", messages, None)])

    # --- engine switches (live: the running reply picks them up at its next step) ---
    def action_stop(self) -> None:
        if self.busy:
            self._stop.set()
            if self.engine is not None:
                self.engine.cancel()

    def action_toggle_mtp(self) -> None:
        if not self._engine_ready() or self._fixed_here():
            return
        if not self.engine.mtp_available:
            self.notice(NO_MTP, "warning")
            return
        self.engine.mtp = not self.engine.mtp
        self.notice(f"MTP on, {self.engine.draft_tokens} draft tokens" if self.engine.mtp else "MTP off")
        self.redraw(force=True)

    def _set_k(self, delta: int) -> None:
        if not self._engine_ready() or self._fixed_here():
            return
        k_max = self.engine.k_max
        k = min(max(self.engine.draft_tokens + delta, 1), k_max)
        if k == self.engine.draft_tokens:
            why = (f"the most the engine takes ({k_max} drafts a step: the MTP head predicts one token ahead, "
                   "so drafts chained further are rarely kept and cost more than they gain)" if delta > 0 else
                   "the fewest a drafting step carries (MTP off, ctrl+t, drafts none)")
            self.notice(f"draft tokens stay at {k}: {why}", "warning")
            return
        self.engine.draft_tokens = k
        self.notice(f"{k} draft tokens per step" + ("" if self.engine.mtp else " (MTP is off)"))
        self.redraw(force=True)

    def action_draft_up(self) -> None:
        self._set_k(+1)

    def action_draft_down(self) -> None:
        self._set_k(-1)

    def action_toggle_think(self) -> None:
        self.think = not self.think
        self.notice("thinking on for the next reply" if self.think else "thinking off for the next reply")
        self.redraw(force=True)

    def action_cycle_effort(self) -> None:
        if not self._engine_ready():
            return
        tok = self.engine.tokenizer
        if not reasoning_efforts(tok):
            self.notice("this model's chat template has no reasoning_effort: thinking is on or off (f5)", "warning")
            return
        self.think, self.effort = next_effort(tok, self.think, self.effort)
        level = effort_label(tok, self.think, self.effort)
        self.notice(f"reasoning effort {level} for the next reply" if self.think else "thinking off for the next reply")
        self.redraw(force=True)

    def action_toggle_keep_thinking(self) -> None:
        if self.engine is not None and not offers_preserve_thinking(self.engine.tokenizer):
            self.notice("this model's chat template has no preserve_thinking: earlier replies' thinking is "
                        "always left out of the prompt", "warning")
            return
        trained = self.engine is not None and keeps_thinking_by_default(self.engine.tokenizer)
        keep = self.keep_thinking if self.keep_thinking is not None else trained
        self.keep_thinking = not keep
        self.notice("earlier replies' thinking stays in the prompt (preserve_thinking)"
                    + (", as the model was trained" if trained else "") if self.keep_thinking
                    else "earlier replies' thinking is left out of the prompt"
                    + ("" if trained else ", as the model was trained"))

    def action_toggle_tint(self) -> None:
        self.tint = not self.tint
        for v in self._views():
            if v.role == "assistant":
                v.set_tint(self.tint)
        self.notice("tint: accepted drafts in green" if self.tint else "tint off")

    # --- history ---
    def action_regenerate(self) -> None:
        if self._engine_ready():
            self._when_idle(self._regenerate)

    async def _regenerate(self) -> None:
        views = self._views()
        if not views:
            self.notice("nothing to regenerate yet", "warning")
            return
        if views[-1].role == "assistant":
            await self._drop(views[-1:])
        await self._start_reply()

    def action_edit_last(self) -> None:
        self._when_idle(self._edit_last)

    def on_composer_edit_last(self, event: Composer.EditLast) -> None:
        self.action_edit_last()

    async def _edit_last(self) -> None:
        views = self._views()
        users = [i for i, v in enumerate(views) if v.role == "user"]
        if not users:
            self.notice("no message to edit yet", "warning")
            return
        text = views[users[-1]].content
        await self._drop(views[users[-1]:])
        composer = self.query_one(Composer)
        composer.text = text
        composer.move_cursor(composer.document.end)
        composer.focus()

    async def _drop(self, views) -> None:
        for v in views:
            if v.message_id is not None:
                self.store.delete_message(v.message_id)
            await v.remove()

    def action_new_chat(self) -> None:
        self._when_idle(self._new_chat)

    async def _new_chat(self) -> None:
        await self._chat().clear()
        self.session_id, self.session_title = None, "new chat"
        self.system = self.default_system
        self.telemetry.load_session([])
        self.telemetry.new_reply()
        if self.engine is not None:
            self.engine.reset()
        self.query_one(Composer).focus()
        self.redraw(force=True)

    def action_sessions(self) -> None:
        def chosen(sid):
            if sid is not None:
                self._when_idle(lambda: self.open_session(sid))
        self.push_screen(SessionsScreen(self.store, self.session_id, now=self.now), chosen)

    async def open_session(self, sid: int) -> None:
        row = self.store.session(sid)
        if row is None:
            self.notice("that chat no longer exists", "warning")
            return
        await self._chat().clear()
        self.session_id, self.session_title, self.system = row.id, row.title, row.system
        rows = self.store.messages(sid)
        for r in rows:
            footer = (r.stats or {}).get("footer", "")
            await self._chat().add(MessageView(r.role, r.content, r.thinking, decode_spans(r.content, r.spans),
                                               footer, self.tint, r.id))
        self.telemetry.load_session([r.stats for r in rows if r.role == "assistant" and r.stats])
        self.telemetry.new_reply()
        if self.engine is not None:
            self.engine.reset()
        self._chat().anchor()
        self.redraw(force=True)
        if rows and rows[-1].role == "user":     # the app stopped (a crash, a kill) before the reply came
            self.notice("the last message has no reply: ctrl+r answers it, ctrl+l takes it back to edit", "warning")

    # --- settings ---
    def action_system_prompt(self) -> None:
        def saved(text):
            if text is None:
                return
            self.system = text
            if self.session_id is not None:
                self.store.set_system(self.session_id, text)
            self.notice("system prompt saved for this chat")
        self.push_screen(SystemPromptScreen(self.system), saved)

    def action_sampling(self) -> None:
        def saved(s):
            if s is not None:
                self.sampling = s
                self.notice(f"sampling: {s.summary()}")
        self.push_screen(SamplingScreen(self.sampling), saved)

    # --- race ---
    def action_race(self) -> None:
        if not self._engine_ready() or self._fixed_here():
            return
        if not self.engine.mtp_available:
            self.notice(NO_MTP + "; nothing to race", "warning")
            return
        if self.busy:
            self.notice("a reply is still streaming: press Esc to stop it first", "warning")
            return
        views = self._views()
        users = [i for i, v in enumerate(views) if v.role == "user"]
        if not users:
            self.notice("send a message first: the race reruns your last prompt", "warning")
            return
        messages = self._prompt_messages(views[:users[-1] + 1])
        self.push_screen(RaceScreen(self.engine.draft_tokens))
        # greedy on both sides: MTP leaves greedy output unchanged, so both write the same reply and
        # the speedup is the same work done faster (sampled, they would write different replies)
        self._begin([(LANES[0], messages, False), (LANES[1], messages, True)],
                    sampling=replace(self.sampling, temperature=0.0))

    # --- copy and export ---
    def _picked(self) -> MessageView | None:
        focused = self.focused
        if isinstance(focused, MessageView):
            return focused
        replies = [v for v in self._views() if v.role == "assistant" and v.content]
        return replies[-1] if replies else None

    def action_copy_message(self) -> None:
        view = self._picked()
        if view is None:
            self.notice("no message to copy yet", "warning")
            return
        self.copy_to_clipboard(view.content)
        self.notice(f"copied the message ({len(view.content)} characters)")

    def action_copy_code(self) -> None:
        view = self._picked()
        blocks = copyable_blocks(view.content) if view else []
        if not blocks:
            self.notice("no code block in that message", "warning")
            return

        def copy(i):
            if i is not None:
                self.copy_to_clipboard(blocks[i])
                self.notice(f"copied code block {i + 1} ({len(blocks[i].splitlines())} lines)")
        copy(0) if len(blocks) == 1 else self.push_screen(CodePickScreen(blocks), copy)

    def action_export(self) -> None:
        views = self._views()
        if not views:
            self.notice("nothing to export yet", "warning")
            return
        turns = [(v.role, v.content, v.thinking, v.footer) for v in views]
        text = chat_markdown(self.session_title, self.model_name, self.system, turns, self.now())
        path = export_path(self.export_dir or Path.cwd(), self.session_title, self.now())
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            self.notice(f"could not write {path} ({exc.strerror}): check the folder is writable", "error")
            return
        self.export_written = path
        self.notice(f"chat exported to {path}")
