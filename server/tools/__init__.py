"""Tool calls in /v1/chat/completions, as vLLM offers them: the request's tools and tool_choice
(request.py), and the readers that find calls in the output (calls.py; hermes.py for
`tool_choice: "auto"` with `--tool-call-parser hermes`, forced.py for "required" and a named
function, whose output a constraint shapes)."""
