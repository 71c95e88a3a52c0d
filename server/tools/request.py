"""A chat request's `tools` and `tool_choice`, checked, as one `ToolPlan`.

    plan = read_tools(body, parser="hermes")    # parser: --tool-call-parser, when auto is on

- The tools reach the chat template (`apply_chat_template(..., tools=...)`) unless there are
  none; each is `{"type": "function", "function": {"name", "description"?, "parameters"?}}`,
  its parameters a JSON schema (compiled at the edge: a 400 names the tool).
- `tool_choice` "none": the template sees the tools, the output is text. "required": the output
  is constrained to a JSON array of `{"name", "parameters"}` calls, one of the tools each
  (vLLM's schema). A named function: constrained to that tool's parameters. "auto" (the default
  with tools): the model chooses; its output is read by the server's parser, and without
  `--enable-auto-tool-choice --tool-call-parser` it is refused, as vLLM refuses it.
- `parallel_tool_calls: false` allows one call: "required"'s array has at most one item, and
  "auto" keeps the first call the parser finds (true, the default: every call is kept).
- `strict: true` on a function is honoured only where the call is constrained ("required", a
  named function); with "auto" nothing enforces it, so it is refused.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.server.errors import bad_request
from pagedkv.server.structured import Constraint, constraint, schema_text
from pagedkv.server.tools.calls import CallReader, FirstCallOnly
from pagedkv.server.tools.forced import NamedReader, RequiredReader
from pagedkv.server.tools.parsers import PARSERS

# Most tools one request may declare (OpenAI's bound).
MAX_TOOLS = 128
# OpenAI's function names: letters, digits, underscores and dashes, at most 64.
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
# A tool without parameters takes an empty object (vLLM's rule).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's tools ask of the template, the sampler and the answer."""

    # The tools as the template takes them; None: no tools.
    tools: list[dict[str, Any]] | None
    # "none", "auto", "required" or "function" (the named one).
    choice: str = "none"
    # The function a named choice forces.
    name: str | None = None
    # The constraint that forces the call ("required", a named function); else None.
    constraint: Constraint | None = None
    # Each tool's parameters schema, compiled at the edge so that a bad one is a 400.
    schemas: tuple[Constraint, ...] = ()
    # The parser that reads "auto" output (--tool-call-parser).
    parser: str | None = None
    # parallel_tool_calls: more than one call per answer (OpenAI's default).
    parallel: bool = True

    def reader(self) -> CallReader | None:
        """A reader of one choice's output into content and calls; None: the output is text."""
        if self.choice == "required":
            return RequiredReader()
        if self.choice == "function":
            assert self.name is not None, "a named choice names its function"
            return NamedReader(self.name)
        if self.choice == "auto" and self.parser is not None:
            reader = PARSERS[self.parser]()
            return reader if self.parallel else FirstCallOnly(reader)
        return None

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" when "auto" made calls, or "required" ended them; else as is (a
        named function's answer says "stop", as OpenAI's does)."""
        if called and (self.choice == "auto" or (self.choice == "required"
                                                 and reason == "stop")):
            return "tool_calls"
        return reason


def read_tools(body: Mapping[str, Any], parser: str | None) -> ToolPlan:
    """The body's tools and tool_choice, checked (400 naming the field)."""
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):
        raise bad_request("tools", f"tools must be a list of at most {MAX_TOOLS} tools")
    functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(tools or [])]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tools", "tools: two tools have the same name")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if functions else "none"
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", "parallel_tool_calls must be true or false")
    plan = ToolPlan(tools or None, parser=parser, parallel=parallel, schemas=tuple(
        constraint(f"tools[{i}].function.parameters", json=schema_text(
            f"tools[{i}].function.parameters", f["parameters"]))
        for i, f in enumerate(functions) if f.get("parameters") is not None))
    if choice == "none":
        return plan
    if not functions:
        raise bad_request("tool_choice", "tool_choice needs tools: send the tools it chooses "
                                         "from, or tool_choice none")
    if choice == "auto":
        if parser is None:
            raise bad_request("tool_choice", '"auto" tool choice requires '
                                             "--enable-auto-tool-choice and --tool-call-parser "
                                             "to be set")
        _refuse_strict(functions)
        return ToolPlan(plan.tools, "auto", None, None, plan.schemas, parser, parallel)
    if choice == "required":
        return ToolPlan(plan.tools, "required", None,
                        constraint("tool_choice", json=schema_text(
                            "tool_choice", required_schema(functions, parallel))), plan.schemas)
    name = _named(choice)
    if name not in names:
        raise bad_request("tool_choice.function.name", f"tool_choice.function.name: no tool "
                                                       f"is named {name!r}")
    parameters = functions[names.index(name)].get("parameters") or NO_PARAMETERS
    return ToolPlan(plan.tools, "function", name, constraint("tool_choice", json=schema_text(
        "tool_choice", parameters)), plan.schemas)


def required_schema(functions: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for "required": a non-empty array of calls (one at most unless
    `parallel`), each one of the tools by name with its parameters; the tools' `$defs` are
    lifted to the top, where their `$ref`s ("#/$defs/...") point (two tools defining one name
    differently: a 400)."""
    items = []
    defs: dict[str, Any] = {}
    for index, function in enumerate(functions):
        parameters = dict(function.get("parameters") or NO_PARAMETERS)
        for def_name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(def_name, definition) != definition:
                raise bad_request(f"tools[{index}].function.parameters", f"tools define "
                                  f"$defs.{def_name} twice, differently: rename one")
        items.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _function(tool: object, path: str) -> dict[str, Any]:
    """A tool's function, checked."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"{path}.type", f'{path}.type must be "function" (the only kind)')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{path}.function", f"{path}.function must be an object")
    for key in function:
        if key not in FUNCTION_KEYS:
            raise bad_request(f"{path}.function.{key}", f"{path}.function.{key} is not a field "
                                                        f"of a function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"{path}.function.name", f"{path}.function.name must be 1 to 64 "
                                                    "letters, digits, underscores or dashes")
    if not isinstance(function.get("description", ""), str | None):
        raise bad_request(f"{path}.function.description", f"{path}.function.description "
                                                           "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{path}.function.parameters", f"{path}.function.parameters must be "
                                                          "a JSON schema (an object)")
    if function.get("strict") not in (None, True, False):
        raise bad_request(f"{path}.function.strict", f"{path}.function.strict must be true or "
                                                      "false")
    return function


def _refuse_strict(functions: list[dict[str, Any]]) -> None:
    for index, function in enumerate(functions):
        if function.get("strict"):
            raise bad_request(f"tools[{index}].function.strict", f"tools[{index}].function."
                              'strict needs tool_choice "required" or a named function: with '
                              '"auto" nothing constrains the arguments')


def _named(choice: object) -> str:
    """The function a `{"type": "function", "function": {"name": ...}}` choice names."""
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                         '{"type": "function", "function": {"name": ...}}')
    return str(function["name"])
