"""The runner's session table keeps each session's model (what the runner checks a step's
session against) past the session's entry, bounded: a client between two requests holds no
sequence, and its next request must not cost another daemon call to learn its model again."""

from pagedkv.model_runner.engine.sessions import SessionTable


def test_a_sessions_model_outlives_its_idle_entry_and_goes_when_it_ends() -> None:
    table = SessionTable(max_idle=2)
    entry = table.enter("s1")
    table.learn_model("s1", "base")
    table.leave("s1", entry)  # no sequence: the entry goes
    assert table.get("s1") is None and table.model("s1") == "base"
    entry = table.enter("s1")
    entry.ended = True  # the daemon said the session is gone
    table.leave("s1", entry)
    assert table.model("s1") is None


def test_the_models_kept_are_bounded_least_recently_used_first() -> None:
    table = SessionTable(max_idle=2)
    table.learn_model("a", "base")
    table.learn_model("b", "tuned")
    assert table.model("a") == "base"  # a is now the most recently used
    table.learn_model("c", "base")
    assert (table.model("a"), table.model("b"), table.model("c")) == ("base", None, "base")
    table.forget_all()
    assert table.model("a") is None
