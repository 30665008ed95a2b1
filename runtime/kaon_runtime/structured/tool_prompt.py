"""Tools and tool calls into chat messages, for chat templates that do not render them.

A template that uses `tools` gets them as HF's apply_chat_template(tools=...) passes them (a
list of OpenAI tool objects), and assistant `tool_calls` with their arguments as objects. A
template that does not (SmolLM2's, many older ones) would drop them silently, so the messages
are rewritten first, in the Hermes convention most open models are trained on: the tools are
described in the system message, an assistant's calls become `<tool_call>` text in its
content, and a tool's result becomes a user message in `<tool_response>` tags.
"""
from __future__ import annotations

import json

from kaon_runtime.structured.tool_parsers import ToolCall, ToolParser

TOOLS_PROMPT = """# Tools

You can call functions to help answer the user. Their signatures, one JSON object per line:
<tools>
{tools}
</tools>

To call a function, reply with its name and arguments as a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` and assistant `tool_calls` itself."""
    return template is not None and "tools" in template and "tool_calls" in template


def prepare_messages(messages: list[dict], tools: list[dict] | None, template: str | None,
                     parser: ToolParser) -> list[dict]:
    """The messages to render: as given (arguments as objects) for a template that knows tools,
    else with tools and calls written out as text (the module's docstring)."""
    if knows_tools(template):
        return [_with_argument_objects(m) for m in messages]
    out = [_as_text(m, parser) for m in messages]
    if tools:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _as_text(message: dict, parser: ToolParser) -> dict:
    role, content = message["role"], message.get("content") or ""
    if role == "assistant" and message.get("tool_calls"):
        calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
        return {"role": "assistant", "content": "\n".join(filter(None, [content, parser.write(calls)]))}
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": role, "content": content}


def _with_argument_objects(message: dict) -> dict:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except (TypeError, json.JSONDecodeError):
            pass  # a template that wants text gets the text
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}
