"""The doors: one module per wire protocol, each with its conversion from deepseek-recipe and its decoder.

- `chat`: OpenAI Chat Completions; `responses`: OpenAI Responses; `messages`: Anthropic Messages. deepseek-recipe
  converts their requests into one conversation, and the rest of their path is shared (`conversation`). Responses
  and Messages send named events (`events`).
- `completions`: OpenAI's legacy Completions, a raw prompt with a path of its own.
- `generate`: SGLang's native `/generate`, a raw prompt (text or token IDs) per sequence, in SGLang's shapes.

The codec knows the doors only through `DOORS`, keyed by the protocol code Rust sends (rust/doors/
`Spec::CODE`), and the `Door` interface (`base`). Adding a door: a module here with a `Door` subclass (usually a
`ConversationDoor`), its entry below, and its Rust side (a module in rust/doors/ and its `Door` variant).
"""

from __future__ import annotations

from deepinfer_server.doors.base import Door
from deepinfer_server.doors.chat import ChatDoor
from deepinfer_server.doors.completions import CompletionsDoor
from deepinfer_server.doors.generate import GenerateDoor
from deepinfer_server.doors.messages import MessagesDoor
from deepinfer_server.doors.responses import ResponsesDoor

DOORS: dict[int, Door] = {
    door.code: door for door in (ChatDoor(), CompletionsDoor(), MessagesDoor(), ResponsesDoor(), GenerateDoor())
}

__all__ = ["DOORS", "ChatDoor", "CompletionsDoor", "Door", "GenerateDoor", "MessagesDoor", "ResponsesDoor"]
