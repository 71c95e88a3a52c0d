"""The tool call parsers `pagedkv serve --tool-call-parser` offers, by vLLM's names.

A parser reads the calls a model writes of its own accord (`tool_choice: "auto"`); each is a
CallReader factory. Add one by its module and a line here.
"""

from collections.abc import Callable

from pagedkv.server.tools.calls import CallReader
from pagedkv.server.tools.hermes import HermesReader

PARSERS: dict[str, Callable[[], CallReader]] = {"hermes": HermesReader}
