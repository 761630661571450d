"""The same stream gives the same outcome on every front-end, and a redirect is reported as one
(issue 34, items 10 and 11). REAL loopback server, the four front-ends, streamed and not."""

from __future__ import annotations

import pytest

from tests.test_server_faults import FORMS, call, chunk, expect, raw_reply, sse_reply
from trimkit.errors import ServerError, StreamInterruptedError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("stream", [True, False])
def test_done_before_any_content_is_an_interruption_on_every_front_end(server, form, stream):
    server.chat(sse_reply(chunk(role="assistant")))  # a role delta, then [DONE]: nothing was generated
    out = call(form, server, stream=stream)
    err = expect(out, StreamInterruptedError)
    assert err.report is not None and err.report.measured_ttft_s is None


@pytest.mark.parametrize("form", ["url", "url_async"])
@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("status", [301, 302, 307, 308])
def test_a_redirect_is_reported_as_one_with_where_it_points(server, form, stream, status):
    server.chat(raw_reply(b"", status=status, content_type=None, headers={"Location": "http://user:pw@elsewhere.test/v1/chat/completions"}))
    out = call(form, server, stream=stream)
    err = expect(out, ServerError, f"redirected the request (HTTP {status}) to http://***@elsewhere.test/v1/chat/completions")
    assert err.status == status and "pw" not in str(err)
    assert "llama-cpp-python" not in str(err)  # not blamed on an empty stream


@pytest.mark.parametrize("stream", [True, False])
def test_the_report_names_the_model_that_answered_when_it_is_not_the_one_asked_for(server, stream):
    from tests.test_server_faults import make_chat

    chat = make_chat("url", server)
    try:
        server.chat(sse_reply(*[dict(c, model="other-model") for c in (chunk(role="assistant"), chunk("Hello"), chunk(finish="stop"))]))
        out = chat.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], stream=stream)
        if stream:
            list(out)
        r = chat.last_report
        assert r.measurement.server["model"] == "other-model"
        assert any("answered with model 'other-model', not 'm'" in w for w in r.warnings)
        server.chat(sse_reply(chunk(role="assistant"), chunk("Hi"), chunk(finish="stop")))
        chat.chat.completions.create(messages=[{"role": "user", "content": "Hi"}])
        assert not any("answered with model" in w for w in chat.last_report.warnings)
    finally:
        chat.close()
