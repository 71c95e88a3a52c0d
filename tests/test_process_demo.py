"""`make demo` keeps working: the narrated session against a real pagedkvd exits 0."""

import subprocess
import sys


def test_demo_runs_the_scripted_session_and_stops_the_daemon() -> None:
    result = subprocess.run([sys.executable, "-m", "pagedkv.client.demo"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "pagedkvd is SERVING (gRPC health)." in out
    assert "32 from the prefix cache" in out  # the second prompt reused 2 full blocks
    assert "copy-on-write: block" in out  # the fork's shared last block was copied
    assert "pagedkvd exited with status 0; its pool file is gone." in out
