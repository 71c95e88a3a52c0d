"""What a sequence's output must match: vLLM's `StructuredOutputsParams`, torch-free.

    SamplingParams(structured_outputs=StructuredOutputs(json='{"type": "object"}'))

Exactly one constraint is set. The runner compiles it for the model's vocabulary (xgrammar,
vLLM's default engine) and masks each step's logits to the tokens the constraint still allows;
a constraint the engine cannot compile is refused naming the field. The server maps OpenAI's
`response_format`, vLLM's `structured_outputs` and the older `guided_*` fields, and tool calls
with `tool_choice` "required" or a named function, onto this one type.
"""

import json
from dataclasses import dataclass

# Bounds on one constraint's text (bounded work per call: a compile is CPU time in the runner).
MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_CHOICES = 256


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One output constraint; validated on construction (ValueError naming the field)."""

    # A JSON schema, as JSON text: the output is one JSON value the schema accepts.
    json: str | None = None
    # A regular expression the whole output matches.
    regex: str | None = None
    # The output is exactly one of these strings.
    choice: tuple[str, ...] | None = None
    # An EBNF grammar (xgrammar's dialect, GBNF-like) with a `root` rule.
    grammar: str | None = None
    # The output is one JSON object, any schema (OpenAI's `response_format: json_object`).
    json_object: bool = False

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar")
                      if getattr(self, name) is not None] + (["json_object"]
                                                             if self.json_object else [])
        if len(set_fields) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, "
                             f"grammar, json_object; got {set_fields or 'none'}")
        for name in ("json", "regex", "grammar"):
            text = getattr(self, name)
            if text is not None and (not isinstance(text, str) or not text
                                     or len(text) > MAX_CONSTRAINT_CHARS):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string of at "
                                 f"most {MAX_CONSTRAINT_CHARS} characters")
        if self.json is not None:
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
        if self.choice is not None:
            choice = tuple(self.choice)
            if (not choice or len(choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in choice)
                    or sum(map(len, choice)) > MAX_CONSTRAINT_CHARS):
                raise ValueError(f"structured_outputs.choice must be 1 to {MAX_CHOICES} "
                                 f"non-empty strings of at most {MAX_CONSTRAINT_CHARS} "
                                 f"characters in all")
            object.__setattr__(self, "choice", choice)
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be True or False")

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"
