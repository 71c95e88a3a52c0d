"""Where the tests' fixture files are: model folders (config.json) of several families and a
broken one, read by the geometry, planner and model preset tests."""

from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
