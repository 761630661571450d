"""Invariants of the generated RAG QA set behind ``benchmarks/rag_answer_kept.py`` (no model runs)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests._bench import load_benchmark

rag_qa = load_benchmark("rag_qa")


@pytest.fixture(scope="module")
def requests_():
    return rag_qa.generate(seed=7, n=36)


def test_deterministic_from_seed(requests_):
    again = rag_qa.generate(seed=7, n=36)
    assert json.dumps(again, sort_keys=True) == json.dumps(requests_, sort_keys=True)
    other = rag_qa.generate(seed=8, n=36)
    assert json.dumps(other, sort_keys=True) != json.dumps(requests_, sort_keys=True)


def test_shapes(requests_):
    for r in requests_:
        assert 4 <= r["n_turns"] <= 30
        assert 8 <= len(r["chunks"]) <= 16
        msgs = r["messages"]
        assert msgs[0]["role"] == "system"
        assert msgs[-1] == {"role": "user", "content": r["question"]}
        assert sum(1 for m in msgs[1:-1] if m["role"] == "user") == r["n_turns"]
        sizes = [rag_qa.estimate_tokens(c["text"]) for c in r["chunks"]]
        assert min(sizes) >= 30 and max(sizes) <= 480, sizes
        assert max(sizes) >= 2 * min(sizes)  # uneven lengths
    # every form and order shows up
    assert {r["chunk_mode"] for r in requests_} == {"scored", "unscored", "plain"}
    assert {r["order"] for r in requests_} == {"ranked", "shuffled"}


def test_answer_sentence_unique_and_mid_chunk(requests_):
    answers = [r["answer_sentence"] for r in requests_]
    assert len(set(answers)) == len(answers)
    for r in requests_:
        ans = r["answer_sentence"]
        holders = [i for i, c in enumerate(r["chunks"]) if ans in c["text"]]
        assert holders == [r["answer_index"]]
        assert r["chunks"][r["answer_index"]]["kind"] == "answer"
        sents = rag_qa.sentences(r["chunks"][r["answer_index"]]["text"])
        assert sents.count(ans) == 1
        pos = sents.index(ans)
        assert 0 < pos < len(sents) - 1, (pos, len(sents))
        # nowhere else in the request, and no other request's chunks carry it
        assert ans not in rag_qa.message_texts(r["messages"])
        assert not rag_qa.answer_in(r["messages"], r)
        for other in requests_:
            if other is not r:
                assert all(ans not in c["text"] for c in other["chunks"])


def test_distractors_share_the_question_wording(requests_):
    for r in requests_:
        q = rag_qa.content_words(r["question"])
        surname, ptype = r["entity"].split(" ", 1)
        near = [c for c in r["chunks"] if c["kind"].startswith("near")]
        assert len(near) >= 3
        for c in near:
            words = rag_qa.content_words(c["text"])
            assert surname.lower() in words or ptype.lower() in words
            assert len(q & words) >= 3, (r["question"], c["text"][:200])
        assert any(c["kind"] == "near_same_entity" and r["entity"] in c["text"] for c in near)


def test_scores_and_orders(requests_):
    ranks = Counter()
    for r in requests_:
        scores = [c["score"] for c in r["chunks"]]
        if r["chunk_mode"] == "scored":
            assert all(isinstance(s, float) for s in scores)
            assert len(set(scores)) == len(scores)
            by_score = sorted(range(len(scores)), key=lambda i: -scores[i])
            rank = by_score.index(r["answer_index"]) + 1
            assert rank == r["answer_score_rank"] and 1 <= rank <= 4
            ranks[rank] += 1
            if r["order"] == "ranked":
                assert scores == sorted(scores, reverse=True)
        else:
            assert all(s is None for s in scores)
        ids = [c["id"] for c in r["chunks"]]
        if r["chunk_mode"] == "plain":
            assert all(i is None for i in ids)
            assert all(isinstance(c, str) for c in rag_qa.rag_chunks(r))
        else:
            assert len(set(ids)) == len(ids)
    assert len(ranks) >= 2  # the answer is not always the top score
    assert any(r["answer_index"] > 0 for r in requests_ if r["order"] == "shuffled")


def test_tool_turns_well_formed(requests_):
    n_tool_turns = 0
    call_ids = set()
    for r in requests_:
        msgs = r["messages"]
        for i, m in enumerate(msgs):
            assert m["role"] in ("system", "user", "assistant", "tool")
            assert "content" in m
            if m.get("tool_calls"):
                n_tool_turns += 1
                assert m["role"] == "assistant" and m["content"] is None
                assert msgs[i - 1]["role"] == "user"
                for call in m["tool_calls"]:
                    assert call["type"] == "function" and call["function"]["name"] == "lookup_record"
                    args = json.loads(call["function"]["arguments"])
                    assert set(args) == {"entity", "record_type"}
                    assert (r["id"], call["id"]) not in call_ids
                    call_ids.add((r["id"], call["id"]))
                results = msgs[i + 1 : i + 1 + len(m["tool_calls"])]
                assert [x["role"] for x in results] == ["tool"] * len(m["tool_calls"])
                assert [x["tool_call_id"] for x in results] == [c["id"] for c in m["tool_calls"]]
                assert all(json.loads(x["content"])["found"] is True for x in results)
                after = msgs[i + 1 + len(m["tool_calls"])]
                assert after["role"] == "assistant" and isinstance(after["content"], str)
            elif m["role"] == "tool":
                prev = next(x for x in reversed(msgs[:i]) if x["role"] != "tool")
                assert prev.get("tool_calls") and m["tool_call_id"] in {c["id"] for c in prev["tool_calls"]}
            elif m["role"] != "system":
                assert isinstance(m["content"], str) and m["content"].strip()
    assert n_tool_turns >= len(requests_)  # some tool turns in most conversations
