"""What a door is to the codec: the interface every wire protocol implements (`Door`), what it works with
(`Context`, the codec's shared parts), what Rust asks (`PrepareInput`) and what it hands back to Rust: `Prepared`
or `Refusal`, records Rust defines (rust/codec/seam.rs) and exports with their stubs in `_native.pyi`.

Rust calls the codec with a protocol code (`_native.DOOR_*`, each door's `Spec::CODE` in rust/doors/); the codec
finds the door registered under it (doors/__init__.py `DOORS`) and calls one of three methods. Nothing else in the
codec tests which door a request came through.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from deepseek_recipe import ConversionOptions

from deepinfer_server._native import Prepared, PrepareInput
from deepinfer_server.images import Images
from deepinfer_server.prompt_encoder import Encoder
from deepinfer_server.refusals import Refusal
from deepinfer_server.request_grammar import RequestGrammars
from deepinfer_server.vocabulary import Vocabulary

__all__ = ["Context", "Door", "PrepareInput", "Prepared", "Prompt", "Refusal"]


@dataclass(frozen=True)
class Context:
    """The codec's parts a door works with. Built once at start-up; thread-safe."""

    vocab: Vocabulary
    options: ConversionOptions  # deepseek-recipe's conversion options (model aliases, default thinking mode)
    encoder: Encoder  # the prompt encoder (conversation -> IDs; raw text -> IDs)
    max_model_len: int
    images: Images | None  # None: image input is refused
    grammars: RequestGrammars


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the engine gets it: its IDs, and the tokens its images take beyond their placeholders."""

    ids: list[int]
    image_tokens: int = 0


class Door(ABC):
    """One wire protocol's part of the codec: from its request body to the engine's prompt and the decoder of its
    output. `body` was validated and normalized by the Rust front end (model checked, developer -> system,
    max_completion_tokens -> max_tokens, unsupported features rejected)."""

    code: ClassVar[int]  # the protocol's code, as Rust sends it: `_native.DOOR_*`
    schema_param: ClassVar[str] = "response_format"  # the request field its response format is in

    @abstractmethod
    def prepare(self, ctx: Context, body: bytes, req: PrepareInput) -> Prepared | Refusal:
        """The request converted and encoded, with its decoder, or `(status, error envelope)`."""

    def check_constraint(
        self, ctx: Context, body: bytes, forced_tool: str | None, parallel_tools: bool
    ) -> Refusal | None:
        """The request's grammar built and checked (compiled, cached for its `prepare`): None, or the refusal of a
        grammar that cannot be enforced. A door without response formats or tools has none."""
        return None

    @abstractmethod
    def prompt_tokens(self, ctx: Context, body: bytes, images: dict[str, bytes] | None) -> Prompt | Refusal:
        """The prompt a request would have (what its `prepare` would count), or why it has none."""
