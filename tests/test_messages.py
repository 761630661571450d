"""Chat messages and RAG chunks: validation, turns and chunk placement."""

from __future__ import annotations

import copy

import pytest

from trimkit.errors import InvalidChunkError, InvalidInputError, InvalidMessageError
from trimkit.messages import Chunk, coerce_chunks, last_user_index, message_text, render_rag_question, turn_spans, validate_messages

TOOL_CALL = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]


# -- validate_messages --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": TOOL_CALL},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
        ({"role": "user", "content": ""},),  # a tuple is a list too; empty text is allowed
    ],
    ids=["user", "system+user", "parts", "tool-calls", "function-call", "tuple"],
)
def test_valid_messages_pass(messages):
    validate_messages(messages)


@pytest.mark.parametrize(
    "messages, says",
    [
        ("hello", "must be a list"),
        (b"hello", "must be a list"),
        ({"role": "user", "content": "hi"}, "must be a list"),
        (None, "must be a list"),
        (42, "must be a list"),
        ([], "empty"),
        (["hi"], "messages[0] must be a dict"),
        ([{"role": "user", "content": "a"}, None], "messages[1] must be a dict"),
        ([{"content": "hi"}], "messages[0] has no 'role'"),
        ([{"role": "robot", "content": "hi"}], "unknown role 'robot'"),
        ([{"role": ["user"], "content": "hi"}], "unknown role ['user']"),
        ([{"role": "User", "content": "hi"}], "unknown role 'User'"),
        ([{"role": "user"}], "messages[0] (user) has no 'content'"),
        ([{"role": "user", "content": None}], "content None"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}], "messages[1] (assistant) has content None"),
        ([{"role": "user", "content": "q"}, {"role": "tool", "content": None, "tool_calls": TOOL_CALL}], "messages[1] (tool) has content None"),
        ([{"role": "user", "content": 42}], "content must be str"),
        ([{"role": "user", "content": ["text"]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"text": "no type"}]}], "'type'"),
        ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "no user message"),
    ],
    ids=[
        "str", "bytes", "dict", "none", "int", "empty", "str-item", "none-item", "no-role", "unknown-role",
        "list-role", "capitalised-role",
        "no-content", "user-none-content", "assistant-none-without-tool-calls", "tool-none-content",
        "int-content", "part-not-dict", "part-without-type", "no-user",
    ],
)
def test_invalid_messages_raise_a_useful_error(messages, says):
    with pytest.raises(InvalidMessageError) as info:
        validate_messages(messages)
    assert says in str(info.value)
    assert isinstance(info.value, InvalidInputError) and isinstance(info.value, ValueError)


def test_validation_does_not_change_the_messages():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": TOOL_CALL}]
    before = copy.deepcopy(messages)
    validate_messages(messages)
    assert messages == before


# -- message_text and last_user_index -----------------------------------------------------------


def test_message_text_includes_text_parts_and_tool_calls():
    assert message_text({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}) == "a"
    assert message_text({"role": "assistant", "content": None, "tool_calls": TOOL_CALL}) == 'weather({"city": "Oslo"})'


def test_last_user_index_finds_the_last_user_message():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert last_user_index(msgs) == 2
    with pytest.raises(InvalidMessageError):
        last_user_index([{"role": "system", "content": "s"}])


# -- coerce_chunks ------------------------------------------------------------------------------


def test_strings_become_chunks_with_positional_ids():
    chunks = coerce_chunks(["alpha", "beta"])
    assert [(c.text, c.id, c.score) for c in chunks] == [("alpha", "chunk-0", None), ("beta", "chunk-1", None)]


def test_dicts_keep_their_id_and_score():
    chunks = coerce_chunks([{"text": "alpha", "id": "doc-7", "score": 0.9}, {"text": "beta", "id": 12}, {"text": "gamma"}])
    assert [(c.id, c.score) for c in chunks] == [("doc-7", 0.9), ("12", None), ("chunk-2", None)]


def test_a_dict_with_id_none_gets_a_positional_id():
    assert coerce_chunks([{"text": "alpha", "id": None}])[0].id == "chunk-0"


def test_chunk_objects_keep_their_id_or_get_one():
    named = Chunk("alpha", score=1.0, id="mine")
    anonymous = Chunk("beta")
    out = coerce_chunks([named, anonymous])
    assert out[0] is named
    assert out[1].id == "chunk-1" and out[1].text == "beta"
    assert anonymous.id is None  # the caller's object is unchanged


def test_none_is_no_chunks():
    assert coerce_chunks(None) == ()


def test_duplicate_ids_are_disambiguated():
    out = coerce_chunks([{"text": "a", "id": "x"}, {"text": "b", "id": "x"}, Chunk("c", id="x")])
    ids = [c.id for c in out]
    assert ids[0] == "x"
    assert len(set(ids)) == 3
    assert [c.text for c in out] == ["a", "b", "c"]


def test_a_disambiguated_id_never_collides_with_a_given_one():
    out = coerce_chunks([{"text": "a", "id": "x#2"}, {"text": "b", "id": "x"}, {"text": "c", "id": "x"}, {"text": "d", "id": "x#2#2"}])
    assert len({c.id for c in out}) == 4


def test_a_string_id_that_collides_with_a_positional_one_is_disambiguated():
    out = coerce_chunks([{"text": "a", "id": "chunk-1"}, "b"])
    assert len({c.id for c in out}) == 2


def test_coerce_chunks_does_not_mutate_its_input():
    chunk = Chunk("gamma")
    given = ["alpha", {"text": "beta", "id": "b"}, chunk]
    before = copy.deepcopy(given)
    coerce_chunks(given)
    assert given == before
    assert given[2] is chunk and chunk.id is None


@pytest.mark.parametrize(
    "chunks, says",
    [
        ("one string", "must be a list"),
        ({"text": "a"}, "must be a list"),
        (42, "must be a list"),
        (["ok", ""], "rag_chunks[1]"),
        (["   \n"], "empty"),
        ([{"id": "x"}], "has no 'text'"),
        ([{"text": ""}], "empty"),
        ([{"text": 42}], "must be a str"),
        ([{"text": "a", "score": "high"}], "score"),
        ([{"text": "a", "score": float("nan")}], "score"),
        ([{"text": "a", "score": float("inf")}], "score"),
        ([{"text": "a", "score": True}], "score"),
        ([42], "rag_chunks[0] must be str, Chunk or dict"),
        ([None], "rag_chunks[0] must be str, Chunk or dict"),
    ],
    ids=[
        "str", "dict", "int", "empty-second", "blank", "no-text", "empty-text", "int-text", "str-score",
        "nan-score", "inf-score", "bool-score", "int-item", "none-item",
    ],
)
def test_bad_chunks_raise_a_useful_error(chunks, says):
    with pytest.raises(InvalidChunkError) as info:
        coerce_chunks(chunks)
    assert says in str(info.value)


def test_numpy_scores_from_a_retriever_become_plain_floats():
    import numpy as np

    chunks = coerce_chunks([Chunk("a", score=np.float32(0.5)), {"text": "b", "score": np.float64(0.25)}, {"text": "c", "score": 3}])
    assert [c.score for c in chunks] == [0.5, 0.25, 3.0]
    assert all(type(c.score) is float for c in chunks)


def test_a_chunk_refuses_empty_text_and_bad_scores_when_made():
    with pytest.raises(InvalidChunkError):
        Chunk("")
    with pytest.raises(InvalidChunkError):
        Chunk("a", score=float("nan"))


# -- turn_spans ---------------------------------------------------------------------------------


def test_turns_start_at_user_messages_and_skip_system_messages():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "u3"},
    ]
    assert turn_spans(msgs) == [(1, 3), (3, 5), (5, 6)]


def test_tool_calls_and_their_results_share_one_turn():
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": TOOL_CALL},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "thanks"},
    ]
    spans = turn_spans(msgs)
    assert spans == [(1, 5), (5, 6)]
    assert not any(s <= 0 < e for s, e in spans)  # the system message is in no turn


def test_a_system_message_between_turns_belongs_to_no_turn():
    msgs = [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "developer", "content": "new rules"},
        {"role": "user", "content": "u2"},
    ]
    spans = turn_spans(msgs)
    assert spans == [(0, 2), (3, 4)]


def test_messages_before_the_first_user_message_form_their_own_turn():
    msgs = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "hello, how can I help?"}, {"role": "user", "content": "u"}]
    assert turn_spans(msgs) == [(1, 2), (2, 3)]


def test_turns_cover_every_non_system_message_once_in_order():
    msgs = [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "tool", "user", "assistant", "user")]
    covered = [i for s, e in turn_spans(msgs) for i in range(s, e)]
    assert covered == [1, 2, 3, 4, 5, 6]


# -- render_rag_question ------------------------------------------------------------------------


def test_chunks_come_before_the_question():
    text = render_rag_question("What is trimkit?", coerce_chunks(["first passage", "second passage"]))
    assert text.index("[1] first passage") < text.index("[2] second passage") < text.index("What is trimkit?")
    assert "chunk-" not in text  # an id trimkit made up is never shown to the model
    assert text.endswith("Question: What is trimkit?")


def test_without_chunks_the_question_is_unchanged():
    assert render_rag_question("What?", ()) == "What?"


def test_custom_templates_are_used():
    text = render_rag_question("Q?", coerce_chunks(["a", "b"]), template="{chunks}|{question}", chunk_template="{n}:{text}")
    assert text == "1:a\n\n2:b|Q?"


# -- issue 8, item 7: shapes that used to crash past validation ---------------------------------


def _with(extra: dict, role: str = "assistant", content=None) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": role, "content": content, **extra}, {"role": "user", "content": "again"}]


@pytest.mark.parametrize(
    "messages, says",
    [
        (_with({"tool_calls": "call it"}), "messages[1].tool_calls must be a list"),
        (_with({"tool_calls": {"function": {"name": "f"}}}), "messages[1].tool_calls must be a list"),
        (_with({"tool_calls": ["call it"]}), "messages[1].tool_calls[0] must be a dict"),
        (_with({"tool_calls": [{"id": "c"}]}), "messages[1].tool_calls[0] has no 'function'"),
        (_with({"tool_calls": [{"function": "weather"}]}), "messages[1].tool_calls[0].function must be a dict"),
        (_with({"tool_calls": [{"function": ["weather"]}]}), "messages[1].tool_calls[0].function must be a dict"),
        (_with({"tool_calls": [{"function": {"arguments": "{}"}}]}), "tool_calls[0].function.name must be a str"),
        (_with({"tool_calls": [{"function": {"name": ["f"], "arguments": "{}"}}]}), "tool_calls[0].function.name must be a str"),
        (_with({"tool_calls": [{"function": {"name": "f", "arguments": {"city": "Oslo"}}}]}), "function.arguments must be a str"),
        (_with({"tool_calls": [{"id": 7, "function": {"name": "f"}}]}), "tool_calls[0].id must be a str"),
        (_with({"function_call": "f()"}), "messages[1].function_call must be a dict"),
        (_with({"function_call": [1]}), "messages[1].function_call must be a dict"),
        (_with({"function_call": {"name": 3}}), "function_call.name must be a str"),
        ([{"role": "user", "content": "hi", "name": ["alice"]}], "messages[0].name must be a str"),
        ([{"role": "user", "content": "hi", "name": {"n": 1}}], "messages[0].name must be a str"),
        (_with({"tool_call_id": ["c1"]}, role="tool", content="sunny"), "messages[1].tool_call_id must be a str"),
        ([{"role": "user", "content": [{"type": ["text"], "text": "hi"}]}], "content[0].type must be a str"),
        ([{"role": "user", "content": [{"type": "text", "text": 42}]}], "content[0] is a text part without a str 'text'"),
        ([{"role": "user", "content": [{"type": "text"}]}], "content[0] is a text part without a str 'text'"),
    ],
    ids=[
        "tool-calls-str", "tool-calls-dict", "tool-call-str", "tool-call-no-function", "function-str", "function-list",
        "function-no-name", "function-name-list", "arguments-dict", "call-id-int", "function-call-str", "function-call-list",
        "function-call-name-int", "name-list", "name-dict", "tool-call-id-list", "part-type-list", "text-part-int",
        "text-part-missing",
    ],
)
def test_wrongly_shaped_tool_fields_raise_invalid_message_error(messages, says):
    before = copy.deepcopy(messages)
    with pytest.raises(InvalidMessageError) as info:
        validate_messages(messages)
    assert says in str(info.value)
    assert messages == before


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "hi", "name": "alice"}],
        [{"role": "user", "content": "hi", "name": None, "tool_calls": None, "function_call": None, "tool_call_id": None}],
        _with({"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}]}),
        _with({"function_call": {"name": "f", "arguments": "{}"}}),
        _with({"tool_call_id": "c1"}, role="tool", content="sunny"),
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "hi"}]}],
    ],
    ids=["name", "none-fields", "call-without-arguments", "function-call", "tool-call-id", "image-part"],
)
def test_well_formed_tool_fields_pass(messages):
    validate_messages(messages)


@pytest.mark.parametrize(
    "messages",
    [
        _with({"tool_calls": [{"function": "weather"}]}),
        _with({"function_call": "f()"}),
        [{"role": "user", "content": "hi", "name": ["alice"]}],
    ],
    ids=["function-str", "function-call-str", "name-list"],
)
def test_planning_with_a_budget_refuses_bad_tool_fields_before_any_work(messages):
    """These raised AttributeError / TypeError ('unhashable type') from deep inside the planner."""
    from tests._planner_helpers import PROFILE, tokenizer
    from trimkit.planning.planner import plan

    before = copy.deepcopy(messages)
    with pytest.raises(InvalidMessageError):
        plan(messages, ttft_budget_s=0.5, profile=PROFILE, tokenizer=tokenizer())
    assert messages == before


@pytest.mark.parametrize("score", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"])
def test_a_score_too_large_for_a_float_is_an_invalid_chunk(score):
    with pytest.raises(InvalidChunkError, match="score"):
        coerce_chunks([{"text": "a", "score": score}])
    with pytest.raises(InvalidChunkError, match="score"):
        Chunk("a", score=score)


def test_a_chunk_id_must_be_a_string():
    with pytest.raises(InvalidChunkError, match="id"):
        Chunk("a", id=["x"])
    assert coerce_chunks([{"text": "a", "id": ["x"]}])[0].id == "['x']"  # a dict's id is made a str


@pytest.mark.parametrize(
    "template, chunk_template, says",
    [
        ("Q: {question}", "[{id}] {text}", "{chunks}"),
        ("{chunks}", "[{id}] {text}", "{question}"),
        ("no fields", "[{id}] {text}", "{chunks} or {question}"),
        ("{chunks}\n{question}", "[{id}]", "{text}"),
        ("{chunks}\n{{question}}", "[{id}] {text}", "{question}"),  # an escaped brace is no field
        (None, "[{id}] {text}", "must be a str"),
        ("{chunks}{question}", b"{text}", "must be a str"),
    ],
    ids=["no-chunks", "no-question", "neither", "no-text", "escaped", "none", "bytes"],
)
def test_a_rag_template_without_its_text_fields_is_refused(template, chunk_template, says):
    from trimkit.messages import check_rag_templates

    with pytest.raises(InvalidInputError) as info:
        check_rag_templates(template, chunk_template)
    assert says in str(info.value)


def test_rag_templates_with_conversions_and_formats_still_pass():
    from trimkit.messages import check_rag_templates

    check_rag_templates("{chunks!s}\n---\n{question:>3}", "{n}. {text!s} ({id})")


def test_planning_with_a_template_that_drops_the_chunks_is_refused():
    """It used to send no chunk text at all and report nothing removed."""
    from tests._planner_helpers import PROFILE, tokenizer
    from trimkit.planning.planner import plan

    with pytest.raises(InvalidInputError, match="chunks"):
        plan([{"role": "user", "content": "q"}], ttft_budget_s=5.0, profile=PROFILE, tokenizer=tokenizer(),
             rag_chunks=["the answer is 42"], rag_template="Answer: {question}")


def test_chunks_without_an_id_are_named_in_reports_and_numbered_in_the_prompt():
    given = ["plain passage", {"text": "dict passage"}, Chunk("chunk passage"), Chunk("named passage", id="doc-7"),
             {"text": "dict with id", "id": 12}]
    chunks = coerce_chunks(given)
    assert [c.id for c in chunks] == ["chunk-0", "chunk-1", "chunk-2", "doc-7", "12"]  # what reports name
    text = render_rag_question("Q?", chunks)
    for shown in ("[1] plain passage", "[2] dict passage", "[3] chunk passage", "[doc-7] named passage", "[12] dict with id"):
        assert shown in text
    assert "chunk-" not in text
    # equal chunks stay equal whatever they show; a caller's own label is kept
    assert Chunk("x", id="a", label="1") == Chunk("x", id="a")
    assert coerce_chunks([Chunk("x", label="source A")])[0].label == "source A"
