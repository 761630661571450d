"""The differential standard tests (test_langchain_standard.py) compare their two arms' outcomes:
each phase's report goes to the module's ``record_outcome``. Only for the tests of this folder."""

from __future__ import annotations

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    record = getattr(getattr(item, "module", None), "record_outcome", None)
    if record is not None:
        record(item, outcome.get_result())
