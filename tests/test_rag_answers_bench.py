"""The judge of ``benchmarks/rag_answers.py`` (normalisation, containment, echoed markers) and its
baseline prompts on a counting tokenizer (no model runs)."""

from __future__ import annotations

import pytest

from tests._bench import load_benchmark

bench = load_benchmark("rag_answers")
rag_qa = load_benchmark("rag_qa")


def test_normalise():
    n = bench.normalise
    assert n("  The  Lease\nwas RENEWED.  ") == "the lease was renewed"
    assert n("EP\u20133815\u2014V") == "ep-3815-v"  # en and em dashes
    assert n("\u201cHarbour & Shire\u201d \u2018Insurance\u2019") == "harbour & shire\" 'insurance"
    assert n("12\u00a0March\u20091901") == "12 march 1901"  # no-break and thin spaces
    assert n("(£1,250).") == "£1,250"
    assert n("\uff25\uff30") == "ep"  # full-width letters
    assert n("...") == ""


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("The lease was last renewed on 12 March 1901, recorded under file LR-1234-A.", "12 March 1901"),
        ("12 march 1901", "12 March 1901"),
        ("It was signed by  Clara\nPellow.", "Clara Pellow"),
        ("Permit ep\u20133815\u2013v approved it.", "EP-3815-V"),
        ("The sale price was £1,250.", "£1,250"),
        ("It went for £415, entry SP-5974-B.", "£415"),
        ("Insured by the \u201cCalder Mutual Fire Office\u201d.", "Calder Mutual Fire Office"),
        ("It found an unguarded millrace and worn sluice gates.", "unguarded millrace and worn sluice gates"),
        ("2 March 1901", "2 March 1901"),
    ],
)
def test_is_right(response, expected):
    assert bench.is_right(response, expected)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("The lease was renewed on 12 March 1901.", "2 March 1901"),  # another date that ends the same
        ("It was settled at £125,000.", "£125"),  # a longer number
        ("It was settled at £1,250.", "£250"),
        ("It was settled at £1250.", "£125"),
        ("Renewed on March 12, 1901.", "12 March 1901"),  # not the form the set writes
        ("Signed by Clara Pellowes.", "Clara Pellow"),
        ("I could not find that in the extracts.", "Clara Pellow"),
        ("", "£415"),
        ("anything at all", ""),
        ("anything at all", " . "),
    ],
)
def test_is_wrong(response, expected):
    assert not bench.is_right(response, expected)


def test_every_expected_answer_is_right_against_its_own_sentence():
    reqs = rag_qa.generate(seed=7, n=40, **bench.SET_SHAPE)
    assert {r["expected_kind"] for r in reqs} == {"date", "person", "price", "company", "code", "finding"}
    for r in reqs:
        assert r["expected_answer"]
        assert bench.is_right(r["answer_sentence"], r["expected_answer"]), r
        assert not bench.is_right(r["question"], r["expected_answer"])


def test_echoed_markers():
    e = bench.echoed_markers
    assert e("(excerpt: 1\u20132 of 3) The trawler Morning Wren is the largest") == ["excerpt marker"]
    assert e("(excerpt: sentences 4\u20136 of 12) \u2026") == ["excerpt marker"]
    assert e("As [chunk-3] says, the lease was renewed.") == ["chunk id"]
    assert e("Summary of the earlier conversation: the user asked") == ["summary heading"]
    assert e("Use the following retrieved context to answer.") == ["rag template"]
    assert e("The lease on the Varnow tannery was renewed on 3 May 1902, file LR-1234-A.") == []
    assert e("An excerpt from the deed says\u2026") == []


def test_why_wrong():
    prompt = "The lease was first granted on 4 June 1880, file LR-1111-A. The lease was last renewed on 9 May 1901."
    assert bench.why_wrong("It was renewed.", "9 May 1901", prompt, answer_kept=False) == "answer not sent"
    assert bench.why_wrong("It was renewed on 4 June 1880.", "9 May 1901", prompt, answer_kept=True) == "another fact from the prompt"
    assert bench.why_wrong("It was renewed on 5 July 1999.", "9 May 1901", prompt, answer_kept=True) == "a fact not in the prompt"
    assert bench.why_wrong("I cannot say.", "9 May 1901", prompt, answer_kept=True) == "no fact stated"


class _WordTokenizer:
    """One token per whitespace-separated word of every message's text (and one per message)."""

    def prompt_tokens(self, messages, tools=None):
        return [0] * sum(1 + len(rag_qa.message_texts([m]).split()) for m in messages)


def _prompts():
    from trimkit import Chunk
    from trimkit.messages import coerce_chunks

    req = rag_qa.generate(seed=3, n=1, **bench.SET_SHAPE)[0]
    chunks = list(coerce_chunks(rag_qa.rag_chunks(req, Chunk)))
    return req, bench.Prompts(req, chunks, _WordTokenizer())


def test_baselines_fit_the_token_count():
    req, p = _prompts()
    full = p.build(range(len(p.chunks)), 0)[1]
    target = full * 6 // 10
    fk = p.first_k(target)
    assert fk["tokens"] <= target and fk["dropped_turns"] == 0 and 0 < fk["kept_chunks"] < len(p.chunks)
    assert p.build(range(fk["kept_chunks"] + 1), 0)[1] > target  # the largest k
    do = p.drop_oldest(target)
    assert do["kept_chunks"] == len(p.chunks)
    assert do["tokens"] <= target or do["dropped_turns"] == len(p.turns)
    tm = p.trim_messages(target)
    assert tm["tokens"] <= target
    assert tm["messages"][0] == req["messages"][0]  # include_system
    assert tm["messages"][1]["role"] == "user" if len(tm["messages"]) > 1 else True  # start_on="human"


def test_trim_messages_keeps_everything_that_fits_and_drops_the_question_when_it_cannot():
    req, p = _prompts()
    full_msgs, full = p.build(range(len(p.chunks)), 0)
    whole = p.trim_messages(full)
    assert whole["messages"] == full_msgs and whole["question_sent"]
    system_and_question = p.count([full_msgs[0], full_msgs[-1]])
    none = p.trim_messages(system_and_question - 1)  # the message with every chunk is never cut
    assert not none["question_sent"] and none["messages"] == [full_msgs[0]]


def test_paired_counts_the_discordant_requests_and_their_sign_test():
    def rows(rights):
        return [{"request": f"q{i}", "right": r} for i, r in enumerate(rights)]

    p = bench.paired(rows([1, 1, 0, 0, 1, 0]), rows([1, 0, 1, 1, 1, 1]))
    assert (p["pairs"], p["both_right"], p["only_first"], p["only_second"]) == (6, 2, 1, 3)
    assert p["sign_test_p"] == pytest.approx(2 * (1 + 4) / 16)  # P(X <= 1 | n=4) doubled
    assert bench.paired(rows([1, 0]), rows([1, 0]))["sign_test_p"] == 1.0  # no discordant pair
    assert bench.paired(rows([1] * 8), rows([0] * 8))["sign_test_p"] == pytest.approx(2 / 256)
