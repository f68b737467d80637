"""A converted request's grammar: what deepseek-recipe's output constraint, the door's response format and the tool
choice make the engine enforce (grammar/ builds and checks the grammars themselves).

- A forced tool call (`forced_tool`, or deepseek-recipe's own): the tool-call block only.
- Tools with `auto` beside a response format: the answer in that format or a tool-call block (OpenAI serves the
  combination; deepseek-recipe refuses it for strict tools, doors/conversation.py `converted`).
- A response format alone: its JSON schema (the client's own, which deepseek-recipe's strict-mode copy would weaken
  by dropping keywords such as minItems), `json_object` or a regex.
- Tools with `auto` alone: held from the block's first DSML token on, strict tools (by name) to their schema, the
  others free; with no strict tool, nothing.
"""

from __future__ import annotations

import json

from deepseek_recipe import ConversationRequest

from deepinfer_server.grammar import (
    ANY_OBJECT,
    CALLS_OPEN,
    DSML,
    SCHEMA_EBNF,
    SCHEMA_JSON,
    SCHEMA_NAMES,
    SCHEMA_REGEX,
    Constraint,
    GrammarCache,
    GrammarError,
    GrammarLimits,
    answer_or_calls_ebnf,
    tool_calls_ebnf,
)
from deepinfer_server.vocabulary import Vocabulary

# The response format a request's answer must take: (SCHEMA_JSON, its schema or None for any object) or
# (SCHEMA_REGEX, the pattern).
AnswerFormat = tuple[int, str | None]


class FormatBesideTools(GrammarError):
    """A response format that cannot stand beside tools: the response format's field is at fault."""


def converted_answer_format(conv: ConversationRequest, schema: str | None) -> AnswerFormat | None:
    """The response format deepseek-recipe's conversion carries (Chat's, Responses'), the client's own `schema`
    preferred; None when the answer is free text."""
    oc = conv.inference_options.output_constraint
    if oc is not None and oc.kind == "json":
        return SCHEMA_JSON, (oc.schema and schema) or oc.schema or None
    if oc is not None and oc.kind == "regex":
        return SCHEMA_REGEX, oc.schema
    # Beside tools deepseek-recipe's constraint is the tools': the format stays in the conversation.
    c = conv.conversation
    if c.response_format == "json_object":
        return SCHEMA_JSON, None
    if c.response_format == "json_schema":
        return SCHEMA_JSON, schema or json.dumps(c.response_schema, separators=(",", ":"), ensure_ascii=False)
    if c.response_format == "regex" and c.response_regex:
        return SCHEMA_REGEX, c.response_regex
    return None


class RequestGrammars:
    """Derives each request's grammar and checks it (compiled, cached in a bounded LRU). Thread-safe."""

    def __init__(self, vocab: Vocabulary, limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()
        self.cache = GrammarCache(self.limits)
        self.think_end_id = vocab.think_end_id
        self.dsml_id = vocab.dsml_id

    def constraint(
        self,
        conv: ConversationRequest,
        forced_tool: str | None,
        parallel_tools: bool,
        answer: AnswerFormat | None,
        strict: frozenset[str] = frozenset(),
    ) -> Constraint | None:
        """The grammar of a request's output, as DeepInfer's so_args carry it, compiled (cached) to check it.
        `answer`: the response format the door reads (`ConversationDoor.answer_format`); `strict`: the strict
        tools' names. Raises GrammarError."""
        oc = conv.inference_options.output_constraint
        stage = conv.parsing_options.thinking_initial_stage
        # Constrained from `</think>` on while the output starts in the reasoning.
        in_reasoning = stage is not None and stage.starts_in_reasoning()
        after_think: tuple[int, ...] = (self.think_end_id,) if in_reasoning else ()
        kind = oc.kind if oc is not None else None
        tools = json.loads(oc.schema) if oc is not None and kind in ("tool_call", "tool_call_required") else []
        if forced_tool is not None or kind == "tool_call_required":
            if forced_tool:
                tools = [t for t in tools if (t.get("function") or t).get("name") == forced_tool]
            # deepseek-recipe's own forced call (thinking off) opens the block in the prompt; otherwise the grammar
            # opens it, after the reasoning.
            opened = kind == "tool_call_required" and conv.parsing_options.starts_in_tool_calls
            grammar = tool_calls_ebnf(tools, "" if opened else CALLS_OPEN, parallel_tools, self.limits)
            return self._checked(SCHEMA_EBNF, grammar, () if opened else after_think)
        names = [str((t.get("function") or t).get("name")) for t in tools]
        free = frozenset(n for n in names if n not in strict)
        if tools and answer is not None:
            answer_type, answer_schema = answer
            if answer_type == SCHEMA_REGEX:
                raise FormatBesideTools("a regex response format cannot be combined with tools")
            grammar = answer_or_calls_ebnf(answer_schema, tools, parallel_tools, self.limits, free)
            return self._checked(SCHEMA_EBNF, grammar, after_think)
        if answer is not None:
            answer_type, answer_schema = answer
            return self._checked(answer_type, answer_schema or ANY_OBJECT, after_think)
        if tools and len(free) < len(tools):
            # The text before the block, and whether to call at all, stay free.
            grammar = tool_calls_ebnf(tools, CALLS_OPEN.split(DSML, 1)[1], parallel_tools, self.limits, free)
            return self._checked(SCHEMA_EBNF, grammar, (self.dsml_id,))
        return None

    def raw(self, schema_type: int, schema: str) -> Constraint:
        """A grammar a request names itself, held from the first output token (`/generate`'s `json_schema` or
        `regex`, after a raw prompt). Raises GrammarError."""
        return self._checked(schema_type, schema, ())

    def _checked(self, schema_type: int, schema: str, triggers: tuple[int, ...]) -> Constraint:
        self.cache.check(SCHEMA_NAMES[schema_type], schema)
        return Constraint(schema_type, schema, triggers)
