from trimkit.messages import Chunk
from trimkit.planning.values import MIN_SENTENCES, excerpts_of, text_idf

SENTENCES = [
    "The archive opened in 1950.",
    "Its first director was Mara Voss.",
    "The reading room seats forty people.",
    "The flood of 1962 damaged the basement stacks.",
    "Repairs took two years.",
    "A new wing opened in 1971.",
    "Visitors need a card.",
    "The archive closes on Sundays.",
]
CHUNK = Chunk(" ".join(SENTENCES), id="arch", score=0.5, metadata={"source": "a.txt"})
OTHER = Chunk("The museum flood exhibit opened later. The basement is dry.", id="m")


def test_the_best_matching_sentence_is_kept_with_its_neighbours_in_order():
    idf = text_idf("When did the flood damage the basement stacks?", [CHUNK.text, OTHER.text])
    first, *rest = excerpts_of(CHUNK, idf)
    assert first.spans == ((3, 5),)
    # read as text: an ellipsis where sentences were left out, and no bookkeeping for the model to echo
    assert first.chunk.text == "… " + " ".join(SENTENCES[2:5]) + " …"
    assert first.chunk.id == "arch" and first.chunk.score == 0.5
    assert first.chunk.metadata == {"source": "a.txt", "excerpt": {"spans": [[3, 5]], "sentences": 8}}
    assert CHUNK.metadata == {"source": "a.txt"}  # the caller's chunk is untouched
    assert 0 < first.value_share < 1
    for longer in rest:  # each next excerpt adds sentences and keeps more of the value
        assert len(longer.chunk.text) > len(first.chunk.text) and longer.value_share > first.value_share


def test_separate_runs_are_joined_with_an_ellipsis():
    idf = text_idf("Who was the first director, and when did the new wing open?", [CHUNK.text, OTHER.text])
    excerpts = excerpts_of(CHUNK, idf)
    last = excerpts[-1]
    assert len(last.spans) == 2 and " … " in last.chunk.text


def test_an_excerpt_is_only_the_chunks_sentences_and_ellipses():
    idf = text_idf("Who was the first director, and when did the new wing open?", [CHUNK.text, OTHER.text])
    for ex in excerpts_of(CHUNK, idf):
        parts = [p for p in ex.chunk.text.split("…") if p.strip()]
        kept = [" ".join(SENTENCES[a - 1 : b]) for a, b in ex.spans]
        assert [p.strip() for p in parts] == kept
        assert "excerpt" not in ex.chunk.text and "(" not in ex.chunk.text
        # an ellipsis at an edge exactly where sentences were left out there
        assert ex.chunk.text.startswith("…") == (ex.spans[0][0] > 1)
        assert ex.chunk.text.endswith("…") == (ex.spans[-1][1] < len(SENTENCES))


def test_no_excerpt_without_a_match_or_for_a_short_chunk():
    assert excerpts_of(CHUNK, text_idf("Tell me about penguins", [CHUNK.text])) == []
    short = Chunk(" ".join(SENTENCES[: MIN_SENTENCES - 1]), id="s")
    assert excerpts_of(short, text_idf("Who was the first director?", [short.text])) == []


def test_an_excerpt_is_always_shorter_than_its_chunk():
    idf = text_idf("archive 1950 director reading flood repairs wing visitors Sundays", [CHUNK.text])
    for ex in excerpts_of(CHUNK, idf, max_excerpts=5):
        assert len(ex.spans) and sum(b - a + 1 for a, b in ex.spans) <= len(SENTENCES) - 2
