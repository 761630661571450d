from trimkit.messages import Chunk
from trimkit.planning.values import bm25_scores, rank_chunks, words


def test_words_lowercases_and_drops_stopwords():
    assert words("What is THE Capital of France?") == ["capit", "franc"]


def test_words_are_cut_so_that_forms_of_a_word_match():
    assert words("settlement") == words("settled") == words("settles")


def test_bm25_scores_the_matching_document_highest():
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France exports wine."]
    scores = bm25_scores("capital of France", docs)
    assert scores[0] > scores[2] > scores[1] == 0.0


def test_bm25_rare_terms_weigh_more_than_common_ones():
    docs = ["cat dog", "cat bird", "cat fish"]
    # "cat" is everywhere, "bird" only in one document
    assert bm25_scores("cat bird", docs)[1] > bm25_scores("cat bird", docs)[0] > 0


def test_bm25_term_in_every_document_still_counts_positively():
    assert all(s > 0 for s in bm25_scores("cat", ["cat a", "cat b"]))


def test_bm25_no_documents():
    assert bm25_scores("anything", []) == []


def test_rank_chunks_orders_by_bm25_against_the_question():
    chunks = [Chunk("Bananas are yellow.", id="a"), Chunk("The capital of France is Paris.", id="b")]
    assert [c.id for c in rank_chunks(chunks, "What is the capital of France?")] == ["b", "a"]


def test_rank_chunks_uses_caller_scores_when_every_chunk_has_one():
    chunks = [Chunk("capital France", score=0.1, id="a"), Chunk("bananas", score=0.9, id="b")]
    assert [c.id for c in rank_chunks(chunks, "capital of France", lexical_weight=0.0)] == ["b", "a"]
    assert [c.id for c in rank_chunks(chunks, "unrelated words")] == ["b", "a"]  # no lexical match: scores alone


def test_caller_scores_are_fused_with_the_lexical_match():
    """A noisy retriever ranks the chunk naming the question's entity below a vaguer one."""
    chunks = [
        Chunk("Claims were often settled late in those years.", score=0.9, id="vague"),
        Chunk("Some claims were appealed.", score=0.7, id="other"),
        Chunk("The flood claim for the Hocking inn was settled at 705 pounds.", score=0.8, id="answer"),
    ]
    q = "What was the settlement of the flood claim for the Hocking inn?"
    assert [c.id for c in rank_chunks(chunks, q)][0] == "answer"
    assert [c.id for c in rank_chunks(chunks, q, lexical_weight=0.0)][0] == "vague"


def test_rank_chunks_ignores_partial_scores_and_uses_bm25():
    chunks = [Chunk("bananas", score=0.9, id="a"), Chunk("capital France", id="b")]
    assert [c.id for c in rank_chunks(chunks, "capital of France")] == ["b", "a"]


def test_rank_chunks_ties_keep_the_callers_order():
    chunks = [Chunk("x", id="1"), Chunk("y", id="2"), Chunk("z", id="3")]
    assert [c.id for c in rank_chunks(chunks, "unrelated")] == ["1", "2", "3"]


def test_rank_chunks_empty():
    assert rank_chunks([], "q") == ()
