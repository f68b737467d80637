"""A request ended by `/abort_request` (or a pause that aborts): its decoder is finished with what it has, and the
finish reason says `abort`, as vLLM and SGLang report an aborted request on their OpenAI doors.

deepseek-recipe has no abort among its finish reasons, so the decoder is finished as if the engine had hit the
length limit (the output was cut short: Responses reports `incomplete`, Messages `max_tokens`), and the OpenAI
doors' `finish_reason` is then rewritten as text. `"finish_reason":"` with its quotes unescaped can only be that
key: inside a JSON string the quotes are escaped."""

from __future__ import annotations

import re

from deepinfer_server import _native
from deepinfer_server.decoding import Decoder
from deepinfer_server.engine.base import TokenLogprob

_FINISH_REASON = re.compile(r'"finish_reason":"[a-z_]+"')
ABORT = '"finish_reason":"abort"'


def end(
    decoder: Decoder,
    tokens: list[int],
    logprobs: list[TokenLogprob] | None,
    prompt_logprobs: list[float] | None,
) -> tuple[int, list[str] | str]:
    """The decoder's last output, its finish reason `abort`. A decoder whose protocol has an abort reason of its own
    (`/generate`'s, SGLang's `{"type": "abort"}`) says so with `handles_abort` and is given the abort as it is."""
    if getattr(decoder, "handles_abort", False):
        return decoder.push(tokens, _native.FINISH_ABORT, logprobs, prompt_logprobs)
    state, out = decoder.push(tokens, _native.FINISH_LENGTH, logprobs, prompt_logprobs)
    if isinstance(out, str):
        return state, _FINISH_REASON.sub(ABORT, out)
    return state, [_FINISH_REASON.sub(ABORT, js) for js in out]
