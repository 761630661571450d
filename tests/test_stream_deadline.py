"""The deadline for the first content holds whatever arrives before it (issue 34, item 6): a REAL
loopback server that sends a role delta and then ``{"delta": {"content": null}}`` chunks at a
steady pace gives ``ServerTimeoutError`` on every front-end — the chunks keep the connection
busy, they do not extend the wait. The server sends its answer after a hundred such chunks, so
the old behaviour (that answer, late) fails the test without the test timing anything."""

from __future__ import annotations

import pytest

from tests.test_server_faults import FORMS, _Handler, call, chunk, expect, sse_reply
from trimkit.errors import ServerTimeoutError

pytestmark = pytest.mark.timeout(60)


def null_content_then_answer(h: _Handler, body: dict) -> None:
    sse_reply(chunk(role="assistant"), done=False)(h, body)
    for _ in range(100):
        if h.server.owner.released.wait(0.05):
            return
        h.wfile.write(b'data: {"id": "c1", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": null}, '
                      b'"finish_reason": null}]}\n\n')
        h.wfile.flush()
    h.wfile.write(b"".join(b"data: " + __import__("json").dumps(c).encode() + b"\n\n" for c in (chunk("late"), chunk(finish="stop"))))
    h.wfile.write(b"data: [DONE]\n\n")
    h.wfile.flush()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stream", [True, False])
def test_content_less_chunks_do_not_hold_a_request_past_its_deadline(server, form, stream):
    server.chat(null_content_then_answer)
    out = call(form, server, stream=stream, max_tokens=4)
    err = expect(out, ServerTimeoutError, "no content within the request's deadline")
    assert err.report is not None and err.report.measured_ttft_s is None
    assert not out.chunks or all(not (c["choices"][0]["delta"].get("content") if isinstance(c, dict) else c.choices[0].delta.content)
                                 for c in out.chunks)
