"""Request ids: the client's name of a request, carried from the HTTP edge to the runner and the
daemon, which log it beside their sequence lines (runner.proto's SequenceStep.request_id,
kvpool.proto's AllocateRequest.request_id).

    check_request_id("abc-123")          # None: fine
    check_request_id("a\\nb")             # "request_id must be 1 to 128 of [A-Za-z0-9._:-] ..."
    listed(["a", "b", ..., "k"])         # "a,b,c,d,e,f,g,h +3 more"

An id is 1 to MAX_REQUEST_ID_CHARS letters, digits or `._:-` (vLLM's are 32 hex digits, a UUID
36 characters), so it cannot forge a log field or fill the log; "" means none. Torch-free: the
server, the runner and the daemon share the one rule.
"""

import re
from collections.abc import Iterable

# Longest request id kept (vLLM's are 32 hex digits; a UUID is 36 characters).
MAX_REQUEST_ID_CHARS = 128
# Ids a log line names at most (a step's or a session's); the rest are counted.
MAX_LOGGED_IDS = 8
REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def plausible(request_id: str) -> bool:
    """Whether `request_id` is an id as the module docstring defines it ("" is not)."""
    return REQUEST_ID.fullmatch(request_id) is not None


def check_request_id(request_id: str, field: str = "request_id") -> str | None:
    """What is wrong with `request_id` as a wire field named `field` ("" = none is fine), or
    None. The message never echoes the id: it may be anything a client sent."""
    if not request_id or plausible(request_id):
        return None
    return (f"{field} must be 1 to {MAX_REQUEST_ID_CHARS} of [A-Za-z0-9._:-] "
            f"(got {len(request_id)} characters), or empty for none")


def listed(request_ids: Iterable[str]) -> str:
    """Distinct ids for one log field, in order: at most MAX_LOGGED_IDS, then how many more
    ("a,b +3 more"); "" for none. Anything that is not an id is left out, so no line ever
    carries what a client sent unchecked."""
    ids = [request_id for request_id in dict.fromkeys(request_ids) if plausible(request_id)]
    shown = ",".join(ids[:MAX_LOGGED_IDS])
    more = len(ids) - MAX_LOGGED_IDS
    return f"{shown} +{more} more" if more > 0 else shown
