"""The chat tab's conversation events: which conversation is shown, the list and its search,
New chat, rename, Delete and Clear (both undoable) and export. A mixin of ChatTab
(app/ui/chat_tab.py), which lays out the components these handlers fill."""

from __future__ import annotations

import html

import gradio as gr

from app.conversation import Conversation
from app.settings_rules import page_text
from app.ui import readout
from app.ui.chat_replies import session_of
from engine.errors import QuickdraftError


class ConversationEvents:
    """Opening, listing, searching, renaming, deleting, clearing, undoing and exporting."""

    @property
    def view_outputs(self) -> list:
        return [self.conv_id, self.chatbot, self.conv_list, self.title_box, self.system,
                self.readout, self.plots, self.compare_out, self.export_file, self.undo_row,
                self.undo_note, self.undo_id]

    def _conversation(self, conv_id: str) -> Conversation:
        """The open conversation, or a new one when there is none (or it was deleted)."""
        try:
            return self.service.store.get(conv_id) if conv_id else self.service.store.new()
        except QuickdraftError:
            return self.service.store.new()

    def _choices(self, conv_id: str, query: str = "") -> gr.Radio:
        convs = self.service.store.list(query)
        shown = conv_id if any(c.id == conv_id for c in convs) else None
        return gr.Radio(choices=[(c.title, c.id) for c in convs], value=shown)

    def show(self, conv: Conversation) -> dict:
        """Everything the view shows for `conv` (any undo offer withdrawn)."""
        self.service.store.remember(last_conversation=conv.id)
        replies = [m for m in conv.messages if m["role"] == "assistant"]
        return {self.conv_id: conv.id, self.chatbot: conv.turns(),
                self.conv_list: self._choices(conv.id), self.title_box: conv.title,
                self.system: conv.system, self.compare_out: "",
                self.readout: readout.saved_readout(replies[-1]) if replies else "",
                self.plots: gr.Row(visible=False),
                self.export_file: gr.DownloadButton(visible=False),
                self.undo_row: gr.Row(visible=False), self.undo_id: ""}

    def open_conv(self, target, current):
        try:
            return self.show(self.service.store.get(target))
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return self.show(self._conversation(current))

    def new_conv(self, conv_id, system):
        """A new conversation; the open one is reused while it is still empty."""
        try:
            system = page_text("the system prompt", system)
            current = self.service.store.get(conv_id) if conv_id else None
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return {}
        if current is not None and not current.messages:
            return self.show(current)
        return self.show(self.service.store.new(system=system))

    def search(self, query, conv_id):
        try:
            return self._choices(conv_id, page_text("the search", query, limit=200))
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return gr.skip()

    def rename(self, conv_id, title):
        try:
            self.service.store.rename(conv_id, page_text("the name", title))
        except QuickdraftError as exc:
            gr.Warning(str(exc))
        return self._choices(conv_id)

    def delete(self, conv_id, request: gr.Request):
        """Delete the open conversation, offering Undo; show the newest one left."""
        try:
            gone = self.service.store.get(conv_id)
            self.service.replies.delete(conv_id, session_of(request))
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return {}
        remaining = self.service.store.list()
        out = self.show(remaining[0] if remaining else self.service.store.new())
        return out | self._undo_offer(f"Deleted “{gone.title}”.", conv_id)

    def clear(self, conv_id, request: gr.Request):
        """The chat's Clear: forget the conversation's messages (the model will not see them
        again), offering Undo."""
        try:
            conv = self.service.replies.clear(conv_id, session_of(request))
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return {}
        return self.show(conv) | self._undo_offer("Cleared this chat.", conv_id)

    def undo(self, undo_id):
        try:
            return self.show(self.service.store.undo(undo_id))
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return {self.undo_row: gr.Row(visible=False)}

    def _undo_offer(self, what: str, conv_id: str) -> dict:
        return {self.undo_row: gr.Row(visible=True), self.undo_id: conv_id,
                self.undo_note: f'<span class="qd-note">{html.escape(what)}</span>'}

    def export(self, conv_id, fmt):
        try:
            path = self.service.store.export(conv_id, fmt)
        except QuickdraftError as exc:
            gr.Warning(str(exc))
            return gr.DownloadButton(visible=False)
        return gr.DownloadButton(f"Download {path.name}", value=str(path), visible=True)
