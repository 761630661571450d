"""Credentials in an endpoint's URL (``http://user:secret@host/v1``) never leave it (issue 34,
item 4): the password is sent as HTTP Basic auth, and nowhere trimkit names the endpoint — the
profile key and the profile file, ``report.model``, ``str(report)``, log lines, the text of
``ServerUnreachableError`` / ``FleetUnavailableError`` — carries it. REAL loopback servers;
URL forms are generated."""

from __future__ import annotations

import base64
import logging

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import trimkit
from tests._server import free_port
from tests.test_server_faults import ASK, GOOD_STREAM, PROFILE, FaultServer, sse_reply
from trimkit._calibration import save_profile
from trimkit.backends.transport import normalize_base_url, redact_url
from trimkit.errors import ServerUnreachableError
from trimkit.fleet import FleetUnavailableError

pytestmark = pytest.mark.timeout(60)
SECRET = "s3cr3t-Pa55"


@pytest.fixture
def server():
    s = FaultServer()
    yield s
    s.close()


def with_userinfo(url: str, user: str = "alice", password: str = SECRET) -> str:
    return url.replace("http://", f"http://{user}:{password}@")


def test_a_password_in_the_url_is_sent_as_basic_auth_and_named_nowhere(server, caplog, isolated_cache):
    seen: list[str | None] = []

    def chat(h, body):
        seen.append(h.headers.get("Authorization"))
        sse_reply(*GOOD_STREAM)(h, body)

    server.chat(chat)
    caplog.set_level(logging.DEBUG, logger="trimkit")
    wrapped = trimkit.wrap_url(with_userinfo(server.base_url), model="m", profile=PROFILE, ttft_budget_s=0.5, summarizer=None)
    try:
        out = wrapped.chat.completions.create(messages=ASK)
        assert out["choices"][0]["message"]["content"] == "Hello there"
        report = wrapped.last_report
        key = wrapped.backend.profile_key()
        path = save_profile(attrs.evolve(PROFILE, key=key))
        stored = path.read_text() + str(path)
        for text in (report.model, str(report), repr(report), str(key), wrapped.backend.base_url, stored, caplog.text):
            assert SECRET not in text
        assert seen == ["Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()]
    finally:
        wrapped.close()


@pytest.mark.slow  # seconds: retries against dead ports, or thousands of inputs
def test_errors_naming_an_unreachable_endpoint_carry_no_password(caplog):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    caplog.set_level(logging.DEBUG, logger="trimkit")
    with pytest.raises(ServerUnreachableError) as one:
        trimkit.wrap_url(with_userinfo(dead), model="m", ttft_budget_s=0.5, retry_deadline_s=0.5, summarizer=None)
    with pytest.raises(FleetUnavailableError) as fleet:
        trimkit.wrap_url([with_userinfo(dead), with_userinfo(f"http://127.0.0.1:{free_port()}/v1")], model="m", ttft_budget_s=0.5,
                         retry_deadline_s=0.5, summarizer=None)
    for text in (str(one.value), str(fleet.value), repr(fleet.value.attempts), caplog.text):
        assert SECRET not in text


_part = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126, blacklist_characters="/?#@[]\\%:"), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(user=_part, password=_part, port=st.integers(1, 65535), path=st.sampled_from(["", "/", "/v1", "/v1/", "/api/v1"]))
@example(user="0", password="0", port=80, path="")  # the default port: dropped by normalization
def test_no_normalized_or_redacted_url_keeps_its_userinfo(user, password, port, path):
    url = f"http://{user}:{password}@example.test:{port}{path}"
    base, root = normalize_base_url(url)
    assert "@" not in base and "@" not in root
    # the default port (80 for http) is dropped by normalization, as httpx does; any other stays
    assert base.startswith("http://example.test" + ("" if port == 80 else f":{port}"))
    assert redact_url(f"failed: {url} (again {url})") == f"failed: http://***@example.test:{port}{path} (again http://***@example.test:{port}{path})"
