"""Reading tool calls out of generated text, in the format of the model's chat template.

Three formats, one parser each:
  hermes   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes, Qwen 2/2.5/3,
           and kaon's default for templates that know no tools: docs/serving.md)
  llama3   `{"name": ..., "parameters": {...}}`, calls separated by ";" (Llama 3.1-3.3's JSON tool calls)
  mistral  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`

Each parser finds the calls' JSON bodies in the text; the rest is shared. `parse` reads a
finished text; `partial` reads a growing one for streaming, and returns only what can no longer
change, so what a stream sends adds up to what `parse` returns at the end. Text that does not
parse as calls of the offered functions stays text. The grammars that force a call in these
formats (tool_choice "required" or a named function) are in tool_grammar.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3", "mistral")


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as the model wrote it


@dataclass(slots=True)
class PartialCall:
    """A call as far as a stream may send it: the name once whole, then a growing prefix of the arguments."""

    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    content: str | None  # the text outside the calls (None when there is none)
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    name = ""
    marker = ""  # where calls begin; the text before it is content
    args_key = "arguments"

    def bodies(self, tail: str) -> list[str]:
        """The calls' JSON texts after the marker (the last one possibly unfinished)."""
        raise NotImplementedError

    def write(self, calls: list[ToolCall]) -> str:
        """Calls as this format writes them (for a history the chat template cannot render itself)."""
        raise NotImplementedError

    def _call_json(self, call: ToolCall) -> str:
        return f'{{"name": {json.dumps(call.name)}, "{self.args_key}": {call.arguments or "{}"}}}'

    def split(self, text: str) -> tuple[str, str | None]:
        """(content, the text from the marker on, or None when no call has begun)."""
        at = text.find(self.marker)
        return (text, None) if at < 0 else (text[:at], text[at + len(self.marker):])

    def parse(self, text: str, names: set[str], cut: bool = False) -> Parsed:
        """The calls of a finished text; if any body is not a call of one of `names`, it is all text.
        A text `cut` at max_tokens keeps its whole calls: an unfinished last one is dropped."""
        content, tail = self.split(text)
        if tail is None:
            return Parsed(text)
        bodies = self.bodies(tail)
        if cut and bodies:
            end = value_end(bodies[-1])
            bodies = bodies[:-1] if end is None else bodies[:-1] + [bodies[-1][:end]]
        calls = [_whole_call(body, self.args_key) for body in bodies]
        valid = [c for c in calls if c is not None and c.name in names]
        if not valid or len(valid) < len(calls):
            return Parsed(text)
        return Parsed(content.rstrip() or None, valid)

    def partial(self, text: str) -> tuple[str, list[PartialCall] | None]:
        """(content safe to send, calls begun so far or None): the marker's possible beginning is held back,
        and trailing whitespace, which a reply with calls drops from its content."""
        content, tail = self.split(text)
        if tail is None:
            return _hold_back(text, self.marker).rstrip(), None
        return content.rstrip(), [_partial_call(body, self.args_key) for body in self.bodies(tail)]


class HermesParser(ToolParser):
    name, marker = "hermes", "<tool_call>"

    def bodies(self, tail: str) -> list[str]:
        return [part.split("</tool_call>", 1)[0].strip() for part in tail.split(self.marker)]

    def write(self, calls: list[ToolCall]) -> str:
        return "\n".join(f"{self.marker}\n{self._call_json(c)}\n</tool_call>" for c in calls)


class Llama3Parser(ToolParser):
    name, marker, args_key = "llama3", "<|python_tag|>", "parameters"

    def split(self, text: str) -> tuple[str, str | None]:
        # Llama 3 writes a call as the whole reply, a JSON object, with or without the python tag.
        stripped = text.lstrip().removeprefix(self.marker).lstrip()
        return ("", stripped) if stripped.startswith("{") else (text, None)

    def partial(self, text: str) -> tuple[str, list[PartialCall] | None]:
        stripped = text.lstrip()
        if not stripped or self.marker.startswith(stripped):
            return "", None  # could still become a call
        return super().partial(text)

    def bodies(self, tail: str) -> list[str]:
        return _objects(tail, separators=";")

    def write(self, calls: list[ToolCall]) -> str:
        return "; ".join(self._call_json(c) for c in calls)


class MistralParser(ToolParser):
    name, marker = "mistral", "[TOOL_CALLS]"

    def bodies(self, tail: str) -> list[str]:
        return _objects(tail.lstrip().removeprefix("["), separators=",]")

    def write(self, calls: list[ToolCall]) -> str:
        return self.marker + "[" + ", ".join(self._call_json(c) for c in calls) + "]"


_BY_NAME = {cls.name: cls for cls in (HermesParser, Llama3Parser, MistralParser)}


def parser_named(name: str) -> ToolParser:
    return _BY_NAME[name]()


def parser_for_template(template: str | None) -> ToolParser:
    """The format a chat template writes tool calls in; Hermes for templates that know no tools."""
    source = template or ""
    if "[TOOL_CALLS]" in source:
        return MistralParser()
    if "<|python_tag|>" in source or "ipython" in source:
        return Llama3Parser()
    return HermesParser()


# ---- JSON scanning -----------------------------------------------------------------------


def value_end(text: str) -> int | None:
    """The end of the JSON object or array `text` starts with (past its closing bracket), or None
    while it is unfinished."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _objects(text: str, separators: str) -> list[str]:
    """The JSON objects of `text` in order, separated by whitespace and `separators`."""
    out: list[str] = []
    i = 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i >= len(text) or text[i] != "{":
            return out
        end = value_end(text[i:])
        if end is None:
            return out + [text[i:]]
        out.append(text[i:i + end])
        i += end


def _string_end(text: str, start: int) -> int | None:
    """The end of the JSON string that opens at `start` (past its closing quote), or None while unfinished."""
    escaped = False
    for i in range(start + 1, len(text)):
        if escaped:
            escaped = False
        elif text[i] == "\\":
            escaped = True
        elif text[i] == '"':
            return i + 1
    return None


def _member_value_end(text: str, start: int) -> int | None:
    """The end of the JSON value at `start`, or None while it may still grow."""
    if text[start] in "{[":
        end = value_end(text[start:])
        return None if end is None else start + end
    if text[start] == '"':
        return _string_end(text, start)
    end = start  # a number or a literal: it ends where the object goes on
    while end < len(text) and text[end] not in ",} \t\r\n":
        end += 1
    return None if end == len(text) else end


def _members(body: str) -> dict[str, tuple[int, int | None]]:
    """The top-level members of the JSON object `body` begins, in any order, as far as written:
    key -> (start, end) of its value's text, end None for the one still being written."""
    members: dict[str, tuple[int, int | None]] = {}
    if not body.startswith("{"):
        return members
    i = 1
    while True:
        while i < len(body) and (body[i].isspace() or body[i] == ","):
            i += 1
        if i >= len(body) or body[i] != '"':
            return members
        key_end = _string_end(body, i)
        if key_end is None:
            return members
        key = json.loads(body[i:key_end])
        i = key_end
        while i < len(body) and (body[i].isspace() or body[i] == ":"):
            i += 1
        if i >= len(body):
            return members
        end = _member_value_end(body, i)
        members[key] = (i, end)
        if end is None:
            return members
        i = end


def _arguments_member(members: dict, args_key: str) -> tuple[int, int | None] | None:
    return members.get(args_key, members.get("arguments"))


def _partial_call(body: str, args_key: str) -> PartialCall:
    """The name once whole, whatever the order of the keys; then the arguments object as far as written
    (arguments written before the name come all at once with it; arguments written as a string, once whole)."""
    whole = _whole_call(body, args_key)
    if whole is not None:
        return PartialCall(whole.name, whole.arguments)
    members = _members(body)
    name = members.get("name")
    if name is None or name[1] is None or body[name[0]] != '"':
        return PartialCall()
    arguments = _arguments_member(members, args_key)
    if arguments is None or body[arguments[0]] != "{":
        return PartialCall(json.loads(body[name[0]:name[1]]), "")
    start, end = arguments
    return PartialCall(json.loads(body[name[0]:name[1]]), body[start:end])


def _whole_call(body: str, args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    written = _arguments_member(_members(body), args_key)
    if written is not None and body[written[0]] == "{":  # exactly as written: a stream's fragments add up to it
        return ToolCall(obj["name"], body[written[0]:written[1]])
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _hold_back(text: str, marker: str) -> str:
    """`text` less any tail that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return text[:-size]
    return text
