"""The codec's refusals: `Refusal(status, OpenAI error envelope)` (a record Rust defines, rust/codec/seam.rs),
which Rust answers with (re-wrapped for the Messages door), and the table that names the field at fault in
deepseek-recipe's own refusals.

deepseek-recipe refuses a request with a readable message and `param` null. Clients (and OpenAI's SDKs) show
`param`, so the table below reads it back out of the message; a message that names no field keeps `param` null.
"""

from __future__ import annotations

import json
import re

from deepinfer_server._native import Refusal

__all__ = ["Refusal", "error_body", "too_long", "with_param"]


def error_body(
    message: str, etype: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> str:
    """The OpenAI error envelope."""
    return json.dumps({"error": {"message": message, "type": etype, "param": param, "code": code or etype}})


def too_long(max_model_len: int, tokens: str, param: str = "messages") -> str:
    """The envelope of a prompt that leaves no room for the completion (`tokens`: its length, or a lower bound)."""
    return error_body(
        f"This model's maximum context length is {max_model_len} tokens. However, your {param} "
        f"resulted in {tokens} tokens, which leaves no room for the completion. Please reduce the length of "
        f"the {param}.",
        code="context_length_exceeded",
        param=param,
    )


# deepseek-recipe leaves `param` null; its messages name the field in one of these ways: (pattern, the param as a
# template of the pattern's groups, or None for its first group).
_PARAM_IN_MESSAGE = (
    (re.compile(r"^Invalid '([\w.\[\]]+)'"), None),  # Invalid 'stop[0]': empty string...
    (re.compile(r"^Invalid (\w+) value"), None),  # Invalid temperature value, the valid range ...
    (re.compile(r"^\.?((?:messages|input)\[\d+\](?:\.[\w\[\]]+)*)"), None),  # .messages[0].content: ...
    (re.compile(r"^Stop string array too long"), "stop"),
    # The conversation's structure: which message is at fault depends on the others.
    (
        re.compile(r"^(An assistant message with 'tool_calls'|Messages with role 'tool'|Invalid assistant message)"),
        "messages",
    ),
    (
        re.compile(r"^(Duplicate 'call_id'|No tool call found for tool output|No tool output found for tool call)"),
        "input",
    ),
    (re.compile(r"^Duplicate value for '\w+' .* in message\[(\d+)\]", re.S), "messages[{0}]"),
    (re.compile(r"^Invalid json schema"), "response_format"),
    (re.compile(r"^Prompt must contain the word 'json'"), "response_format"),
    (re.compile(r"^Invalid schema for function '[^']*'"), "tools"),
    (re.compile(r"^Invalid tool parameters schema"), "tools"),
    (re.compile(r"^Unsupported custom tool"), "tools"),
    (re.compile(r"^Currently custom tools are not allowed inside a namespace\..* in ([\w.\[\]]+?)\.?$", re.S), None),
    (re.compile(r"^(Cannot use strict tool|response_format should not be used with tools)"), "tools"),
)

_BAD_IMAGE_DATA = re.compile(r"Invalid base64 data|data url", re.I)


def with_param(body: str, schema_param: str = "response_format") -> str:
    """A deepseek-recipe error envelope with `param` filled in from its message, where the message names one.
    `schema_param`: the door's name for its response format (deepseek-recipe says `response_format` for all)."""
    try:
        d = json.loads(body)
        err = d["error"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(err, dict) or err.get("param") is not None:
        return body
    message = str(err.get("message", ""))
    if schema_param != "response_format" and "response_format" in message:
        # deepseek-recipe words every door's refusals in chat's field names: say the one this door has.
        message = err["message"] = message.replace("response_format", schema_param)
        body = json.dumps(d)
    if err.get("code") == "invalid_request_error" and _BAD_IMAGE_DATA.search(message):
        err["code"] = "invalid_image_url"  # the images' own refusals have codes (images.py); this one is the recipe's
    elif err.get("code") == "invalid_request_error" and "uploaded an unsupported image" in message:
        err["code"] = "unsupported_image_type"  # a data URL's media type deepseek-recipe does not take
    for pattern, param in _PARAM_IN_MESSAGE:
        m = pattern.match(message)
        if m:
            err["param"] = param.format(*m.groups()) if param else m.group(1)
            if err["param"] == "response_format":
                err["param"] = schema_param
            return json.dumps(d)
    return body
