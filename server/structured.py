"""A request's output constraint, from whichever field names it, as one `StructuredOutputs`.

    constraint = read_constraint(body)              # Constraint | None; 400 naming the field
    await check_compiles(constraint)                # 400 naming it when xgrammar cannot

Four spellings lead to the same constraint, as vLLM accepts them: OpenAI's `response_format`
(`text`: none; `json_object`; `json_schema` with `json_schema.schema`), vLLM's
`structured_outputs` object (json, regex, choice, grammar, json_object), the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`, and (chat only) a tool choice that forces a
call (server/tools/). More than one is a 400: which would win is a guess. The constraint is
compiled at the edge too, tokenizer-free (xgrammar's `Grammar.from_*`: microseconds for a small
schema, bounded by MAX_CONSTRAINT_CHARS), on a worker thread so that a large one does not hold
the event loop; the runner compiles it again for the vocabulary.
"""

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.client.pool.structured_outputs import StructuredOutputs
from pagedkv.server.errors import bad_request

# vLLM's `structured_outputs` keys honoured here; others (structural_tag, whitespace_pattern,
# disable_any_whitespace, ...) are refused naming `structured_outputs.<key>`.
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# The older spellings, each the key of StructuredOutputs it sets.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# xgrammar's messages start "[time] /path/file.cc:line: ": the client needs only the reason.
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


@dataclass(frozen=True, slots=True)
class Constraint:
    """A request's constraint and the field of the body it came from (a 400 names it)."""

    outputs: StructuredOutputs
    # The body's field: "response_format", "structured_outputs.json", "guided_regex", "tools"...
    field: str


def read_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """The body's one constraint, or None; a 400 naming the field for a bad or second one."""
    found = [c for c in (_response_format(body.get("response_format")),
                         _structured_outputs(body.get("structured_outputs")),
                         *(_guided(body, name) for name in GUIDED)) if c is not None]
    if len(found) > 1:
        raise bad_request(found[1].field, f"{found[1].field} and {found[0].field} both constrain "
                                          "the output: send one of them")
    return found[0] if found else None


def constraint(field: str, **value: Any) -> Constraint:
    """`StructuredOutputs(**value)` from `field`: its ValueError is a 400 naming the field."""
    try:
        return Constraint(StructuredOutputs(**value), field)
    except (ValueError, TypeError) as exc:
        message = str(exc).replace("structured_outputs.", "", 1)
        raise bad_request(field, f"{field}: {message}") from exc


def schema_text(field: str, schema: object) -> str:
    """A JSON schema (an object, or its JSON text as vLLM also takes it) as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(field, f"{field} is not valid JSON") from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(field, f"{field} must be a JSON schema (an object)")
    return json.dumps(schema)


async def check_compiles(*constraints: Constraint | None) -> None:
    """A 400 naming the first constraint's field that xgrammar cannot compile."""
    found = [c for c in constraints if c is not None]
    if found:
        await asyncio.to_thread(_compile_all, found)


def _compile_all(constraints: list[Constraint]) -> None:
    for found in constraints:
        _compile(found)


def _compile(found: Constraint) -> None:
    import xgrammar

    outputs = found.outputs
    try:
        if outputs.json is not None:
            xgrammar.Grammar.from_json_schema(outputs.json)
        elif outputs.regex is not None:
            xgrammar.Grammar.from_regex(outputs.regex)
        elif outputs.grammar is not None:
            xgrammar.Grammar.from_ebnf(outputs.grammar)
    except RuntimeError as exc:
        reason = _XGRAMMAR_PREFIX.sub("", str(exc).strip())
        raise bad_request(found.field, f"{found.field} cannot be compiled: {reason}") from None


def _response_format(value: object) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return constraint("response_format", json_object=True)
    if kind != "json_schema":
        raise bad_request("response_format.type", "response_format.type must be text, "
                                                  f"json_object or json_schema, not {kind!r}")
    assert isinstance(value, dict)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise bad_request("response_format.json_schema", "response_format.json_schema must be "
                                                         "an object with a name and a schema")
    if not isinstance(spec.get("name"), str):
        raise bad_request("response_format.json_schema.name",
                          "response_format.json_schema.name must be a string")
    field = "response_format.json_schema.schema"
    return constraint(field, json=schema_text(field, spec["schema"]))


def _structured_outputs(value: object) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("structured_outputs", "structured_outputs must be an object")
    for key in value:
        if key not in STRUCTURED_KEYS:
            raise bad_request(f"structured_outputs.{key}", f"structured_outputs.{key} is not "
                              f"supported: pagedkv takes {', '.join(STRUCTURED_KEYS)}")
    given = {key: v for key, v in value.items() if v is not None and v is not False}
    if len(given) != 1:
        raise bad_request("structured_outputs", f"structured_outputs needs exactly one of "
                                                f"{', '.join(STRUCTURED_KEYS)}, got "
                                                f"{sorted(given) or 'none'}")
    key, setting = next(iter(given.items()))
    return _one(f"structured_outputs.{key}", key, setting)


def _guided(body: Mapping[str, Any], name: str) -> Constraint | None:
    value = body.get(name)
    return None if value is None else _one(name, GUIDED[name], value)


def _one(field: str, key: str, value: object) -> Constraint:
    """One constraint of kind `key` (a StructuredOutputs field) from the body's `field`."""
    if key == "json":
        return constraint(field, json=schema_text(field, value))
    if key == "choice":
        if not isinstance(value, list):
            raise bad_request(field, f"{field} must be a list of strings")
        return constraint(field, choice=tuple(value))
    if key == "json_object":
        if value is not True:
            raise bad_request(field, f"{field} must be true")
        return constraint(field, json_object=True)
    return constraint(field, **{key: value})
