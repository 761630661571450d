"""``trimkit plan FILE`` on a file that is JSON but not a usable request — nested too deep for the
decoder, an integer over Python's digit limit — prints one line and exits 2, the exit status of
bad input (issue 34, item 15)."""

from __future__ import annotations

import pytest

from tests.test_cli import run


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000,
                                  '{"messages": [{"role": "user", "content": "x"}], "tools": [' + "9" * 5000 + "]}"])
def test_a_request_file_no_request_can_be_read_from_exits_2_with_one_line(tmp_path, body):
    path = tmp_path / "request.json"
    path.write_text(body)
    r = run("plan", str(path), "--budget", "1.0", cache=str(tmp_path / "cache"))
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().startswith("trimkit: error:") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
