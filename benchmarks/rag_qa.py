"""A generated RAG question-answering set for a records-assistant chat (issue 7's benchmark).

``generate(seed, n)`` returns ``n`` requests, deterministic from ``seed``. Each request is a
chat of a system prompt, 4–30 earlier turns (some of them tool turns: an assistant message with
``tool_calls``, the ``tool`` result answering it, then the assistant's reply, in the OpenAI
message format) and a last user message holding the question; plus 8–16 retrieved chunks of
uneven length (about 40–400 tokens) in the retriever's order:

- one **answer chunk** that holds the **answer sentence** — unique in the whole set (it carries
  a unique file reference), never its chunk's first or last sentence, and found nowhere else
  in the request, so "was the answer kept?" is a string-containment test on the messages sent;
- **near distractors** that share the question's wording: the same entity with another fact
  of the same kind ("first granted" instead of "last renewed"), or the same kind of fact about
  an entity that shares a name with the question's (the "Varnow bakery" for the "Varnow
  tannery");
- **unrelated** record extracts.

Requests cycle through three chunk forms — ``scored`` (``Chunk`` with the retriever's score;
a noisy retriever: the answer chunk's score rank is 1–4, uniformly), ``unscored`` (``Chunk``
with an id, no score) and ``plain`` (bare strings) — and two retriever orders: ``ranked``
(by score, or for unscored chunks the answer at position 1–4 behind near distractors) and
``shuffled`` (any position). Nothing here knows how trimkit ranks or trims.

Sizes are estimated without a tokenizer (:func:`estimate_tokens`); the benchmark counts them
exactly with the model's own tokenizer.

    python benchmarks/rag_qa.py [--seed 7] [--n 32]    # prints a summary and one request
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from typing import Any

__all__ = [
    "SYSTEM",
    "TOOLS",
    "generate",
    "estimate_tokens",
    "rag_chunks",
    "sentences",
    "content_words",
    "message_texts",
    "answer_in",
]

SYSTEM = (
    "You are the records assistant of the Calder County Records Office. Answer questions about "
    "leases, surveys, sales, insurance, permits, claims and inspections from the retrieved record "
    "extracts, the conversation and the lookup_record tool. Quote the file reference of every "
    "fact you give. If the extracts do not hold the answer, say so plainly."
)

#: The tool the assistant called in earlier turns (OpenAI function-tool schema; not sent).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup_record",
            "description": "Look up an indexed record by entity and record type.",
            "parameters": {
                "type": "object",
                "properties": {"entity": {"type": "string"}, "record_type": {"type": "string"}},
                "required": ["entity", "record_type"],
            },
        },
    }
]

_SURNAMES = (
    "Varnow Ashcombe Pellow Tressider Quillan Marrable Dunmore Holloway Kestrel Brannock Ellery "
    "Fenwick Gorrell Hathaway Ingram Jessop Lanyon Merriot Norcott Orrin Penhale Rosewarne Sallow "
    "Treloar Upcott Wendron Yelland Carnsew Dowling Eddowes Frayne Gilbart Hocking Jago Kitto"
).split()
_TYPES = (
    "tannery boatyard mill bakery chapel warehouse forge granary schoolhouse ropewalk smithy inn "
    "dairy quarry brewery printworks sawmill chandlery"
).split()
_STREETS = [
    "Mill Lane", "Quay Street", "Harbour Row", "Chapel Hill", "Fore Street", "Tanner's Walk",
    "Station Road", "Market Square", "Ropewalk Terrace", "Bridge End", "Church Lane", "Wharf Road",
]
_FIRST = "Agnes Bartholomew Clara Edmund Florence Gideon Harriet Isaac Josiah Leonora Matthias Nell Obadiah Prudence Silas Tamsin Walter Winifred".split()
_COMPANIES = [
    "Calder Mutual Fire Office", "Western Counties Assurance", "Harbour & Shire Insurance",
    "Norcott Provident Society", "Union Fire Assurance", "Tamar Valley Mutual",
]
_FINDINGS = [
    "a cracked chimney stack and loose roof slates", "rotten joists under the loading floor",
    "an unguarded millrace and worn sluice gates", "faulty flue linings in the drying room",
    "blocked drains along the north wall", "a leaning gable end that needed shoring",
    "damp in the cellar stores and a failed lintel", "exposed wiring in the engine house",
]
_MONTHS = "January February March April May June July August September October November December".split()
_COLLECTIONS = [
    "the Harbour Board minutes", "the parish rate books", "the Quarter Sessions rolls",
    "the tithe apportionment", "the borough valuation lists", "the estate correspondence",
    "the county surveyor's letter books", "the magistrates' licensing registers",
]

#: Kinds of fact a question asks for. ``a``: the answer sentence; ``near``: sentences with the
#: same wording and another fact (same entity); ``tool``: the record type a tool call names.
ATTRIBUTES: list[dict[str, Any]] = [
    {
        "name": "lease_renewal", "expect": "date", "tool": "lease",
        "q": ["When was the lease on the {E} last renewed?", "On what date was the lease on the {E} last renewed, and under which file?"],
        "a": "The lease on the {E} was last renewed on {date}, recorded under file {code}.",
        "near": [
            "The lease on the {E} was first granted on {date}, recorded under file {code}.",
            "An application to renew the lease on the {E} was withdrawn on {date}, file {code}.",
            "The rent under the lease on the {E} was last revised on {date} to {price} a year, file {code}.",
        ],
    },
    {
        "name": "survey_signer", "expect": "person", "tool": "survey",
        "q": ["Who signed the boundary survey of the {E}?", "Which surveyor signed the boundary survey of the {E}?"],
        "a": "The boundary survey of the {E} was signed by {person} on {date}, reference {code}.",
        "near": [
            "The boundary survey of the {E} was disputed by {person} on {date}, reference {code}.",
            "A first draft of the boundary survey of the {E} was drawn by {person} in {year}, reference {code}.",
            "The boundary survey of the {E} was witnessed by {person}, reference {code}.",
        ],
    },
    {
        "name": "sale_price", "expect": "price", "tool": "sale",
        "q": ["What price did the {E} sell for in its last recorded sale?", "How much was paid for the {E} at its last recorded sale?"],
        "a": "At its last recorded sale the {E} went to {person} for {price}, entry {code}.",
        "near": [
            "At its first recorded sale the {E} went to {person} for {price}, entry {code}.",
            "The reserve price at the last recorded auction of the {E} was {price}, entry {code}.",
            "The sale of the {E} to {person} for {price} fell through in {year}, entry {code}.",
        ],
    },
    {
        "name": "fire_insurer", "expect": "company", "tool": "insurance",
        "q": ["Which company insured the {E} against fire?", "Who insured the {E} against fire?"],
        "a": "The {E} was insured against fire by the {company} under policy {code}.",
        "near": [
            "The {company} declined to insure the {E} against fire in {year}, letter {code}.",
            "The {E} was insured against flood by the {company} under policy {code}.",
            "The fire insurance on the {E} lapsed in {year} when the {company} premium went unpaid, file {code}.",
        ],
    },
    {
        "name": "extension_permit", "expect": "code", "tool": "permit",
        "q": ["What was the permit number for the extension to the {E}?", "Under which permit was the extension to the {E} approved?"],
        "a": "The extension to the {E} was approved under permit {code} on {date}.",
        "near": [
            "A second extension to the {E} was refused under permit {code} on {date}.",
            "The demolition permit for the old extension to the {E} was {code}, issued on {date}.",
            "Plans for an extension to the {E} were lodged as application {code} on {date}.",
        ],
    },
    {
        "name": "flood_claim", "expect": "price", "tool": "claim",
        "q": ["How much was paid on the flood damage claim for the {E}?", "What was the settlement of the flood damage claim for the {E}?"],
        "a": "The flood damage claim for the {E} was settled at {price} on {date}, claim {code}.",
        "near": [
            "The flood damage claim for the {E} was first assessed at {price} on {date}, claim {code}.",
            "A storm damage claim for the {E} was settled at {price} on {date}, claim {code}.",
            "The flood damage claim for the {E} was appealed by {person} in {year}, claim {code}.",
        ],
    },
    {
        "name": "inspection_finding", "expect": "finding", "tool": "inspection",
        "q": ["What did the last safety inspection of the {E} find?", "What was found at the last safety inspection of the {E}?"],
        "a": "The last safety inspection of the {E} found {finding}, report {code}.",
        "near": [
            "The first safety inspection of the {E} found {finding}, report {code}.",
            "A follow-up to the safety inspection of the {E} in {year} found the repairs complete, report {code}.",
            "The safety inspection of the {E} planned for {year} was postponed by {person}, report {code}.",
        ],
    },
    {
        "name": "ownership_transfer", "expect": "person", "tool": "transfer",
        "q": ["Who took ownership of the {E} at the last transfer?", "To whom did the {E} pass at the last transfer?"],
        "a": "At the last transfer the {E} passed to {person} on {date}, deed {code}.",
        "near": [
            "At the first recorded transfer the {E} passed to {person} on {date}, deed {code}.",
            "A proposed transfer of the {E} to {person} was never completed, deed {code}.",
            "At the last transfer of the yard beside the {E} it passed to {person} on {date}, deed {code}.",
        ],
    },
]

#: Neutral sentences a record extract is padded with. ``{E}`` is the extract's subject.
_FILLER = [
    "The {E} stood on {street} for most of the last century.",
    "Clerks noted that the ledger pages for {year} were badly water-stained.",
    "A copy of the original deed for the {E} is held in box {n} of the county series.",
    "The entry is written in the hand of {person}, who kept the register from {year}.",
    "Several pages in this part of {collection} were rebound in {year}.",
    "Neighbours on {street} complained about noise from the {E} more than once.",
    "The building was extended at the rear after a change of use.",
    "Later annotations in pencil give a different spelling of the owner's name.",
    "The index card for this item was misfiled under {street} until {year}.",
    "A sketch plan in the margin shows the {E} with a yard to the south.",
    "The ratepayer at the {E} in {year} is listed as {person}.",
    "Correspondence about the drains behind the {E} runs to {n} letters.",
    "Some figures in the valuation column were corrected in red ink.",
    "The clerk's summary of this file was written in {month} {year}.",
    "The {E} appears in {collection} under two different numbers.",
    "A photograph of the frontage, taken in {year}, is kept with the file.",
    "The entry was checked against {collection} when the index was compiled.",
    "Access to the {E} was from {street} by a narrow lane that is now closed.",
    "A pencil note records that {person} inspected the papers in {month} {year}.",
    "The water supply was taken from a well in the yard until {year}.",
    "Part of the site was let separately as a store for several years.",
    "The ledger gives the occupier's trade as {trade}.",
    "The surrounding plots on {street} changed hands many times over the period.",
    "An earlier catalogue described this bundle as uncatalogued miscellanea.",
    "Ownership of the adjoining wall was never settled in the papers.",
    "The file was microfilmed in {year} and the film is reel {n}.",
    "Boundary stones along {street} are mentioned but not measured.",
    "The {E} was assessed for the poor rate at {price} in {year}.",
    "The register for {year} is incomplete, with {n} pages missing.",
    "The entry has been cross-referenced to {collection}.",
]
_TRADES = ["tanner", "shipwright", "miller", "baker", "carrier", "smith", "innkeeper", "brewer", "printer", "sawyer", "chandler", "dairyman"]

_WORD = re.compile(r"\w+|[^\w\s]")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_STOP = frozenset(
    "a an and are as at be by can could did do does for from had has have how i if in into is it its me my of on or "
    "our she he so than that the their them then there these they this to was we were what when where which who whom "
    "why will with would you your".split()
)


def estimate_tokens(text: str) -> int:
    """Rough token count without a tokenizer: words and punctuation × 1.23 (the median ratio
    for Gemma-3's tokenizer on this text; within −20 %/+15 % per chunk)."""
    return math.ceil(len(_WORD.findall(text)) * 1.23)


def sentences(text: str) -> list[str]:
    """The sentences of a generated chunk (they all end in '.' and start with a capital)."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def content_words(text: str) -> set[str]:
    """Lower-cased words of ``text`` without a short stopword list."""
    return {w for w in re.findall(r"[a-z0-9']+", text.lower()) if w not in _STOP}


def message_texts(messages: Sequence[dict[str, Any]]) -> str:
    """All text a message list carries (contents, text parts, tool-call arguments)."""
    out: list[str] = []
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(p.get("text", "") for p in c if isinstance(p, dict))
        for call in m.get("tool_calls") or []:
            out.append(call.get("function", {}).get("arguments", ""))
    return "\n".join(out)


def answer_in(messages: Sequence[dict[str, Any]], request: dict[str, Any]) -> bool:
    """True when the request's answer sentence is in ``messages`` (the messages sent)."""
    return request["answer_sentence"] in message_texts(messages)


def rag_chunks(request: dict[str, Any], chunk_cls: Any = None) -> list[Any]:
    """The request's chunks as a caller passes them: bare strings (``plain``), or ``chunk_cls``
    (``trimkit.Chunk``) with an id, and a score when ``scored``. With ``chunk_cls=None``, dicts
    with ``text``/``id``/``score`` (JSON-friendly; ``trimkit`` accepts them too)."""
    out: list[Any] = []
    for c in request["chunks"]:
        if request["chunk_mode"] == "plain":
            out.append(c["text"])
        elif chunk_cls is None:
            out.append({"text": c["text"], "id": c["id"], "score": c["score"]})
        else:
            out.append(chunk_cls(text=c["text"], id=c["id"], score=c["score"]))
    return out


# --------------------------------------------------------------------------------------------
class _Gen:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.codes: set[str] = set()

    def code(self, prefix: str) -> str:
        while True:
            c = f"{prefix}-{self.rng.randint(1000, 9999)}-{self.rng.choice('ABCDEFGHJKLMNPRSTUVWXY')}"
            if c not in self.codes:
                self.codes.add(c)
                return c

    def person(self) -> str:
        return f"{self.rng.choice(_FIRST)} {self.rng.choice(_SURNAMES)}"

    def date(self) -> str:
        return f"{self.rng.randint(1, 28)} {self.rng.choice(_MONTHS)} {self.rng.randint(1871, 1968)}"

    def price(self) -> str:
        return f"£{self.rng.randint(3, 480) * 5:,}"

    def slots(self, entity: str, prefix: str = "RC") -> dict[str, Any]:
        r = self.rng
        return {
            "E": entity, "date": self.date(), "code": self.code(prefix), "price": self.price(), "person": self.person(),
            "year": r.randint(1871, 1968), "company": r.choice(_COMPANIES), "finding": r.choice(_FINDINGS),
            "street": r.choice(_STREETS), "n": r.randint(2, 96), "collection": r.choice(_COLLECTIONS),
            "month": r.choice(_MONTHS), "trade": r.choice(_TRADES),
        }

    def fill(self, template: str, entity: str, prefix: str = "RC") -> str:
        return template.format(**self.slots(entity, prefix))

    def filler(self, entity: str, k: int, avoid: set[str]) -> list[str]:
        """``k`` neutral sentences about ``entity``, no template twice until all were used."""
        out: list[str] = []
        pool: list[int] = []
        while len(out) < k:
            if not pool:
                pool = list(range(len(_FILLER)))
                self.rng.shuffle(pool)
            s = self.fill(_FILLER[pool.pop()], entity)
            if s not in avoid:
                avoid.add(s)
                out.append(s)
        return out

    def chunk_text(self, subject: str, target_tokens: int, special: list[str], *, middle: str | None = None) -> tuple[str, int]:
        """A record extract about ``subject`` of about ``target_tokens`` tokens holding the
        ``special`` sentences anywhere and ``middle`` (if any) neither first nor last.
        Returns the text and the index of ``middle`` among its sentences (-1 if none)."""
        fixed = special + ([middle] if middle else [])
        have = sum(estimate_tokens(s) for s in fixed)
        body: list[str] = []
        avoid: set[str] = set(fixed)
        pool = self.filler(subject, 3 * len(_FILLER), avoid)  # templates in a random order, each once per round
        while have < target_tokens or (middle and len(body) < 2):
            s = pool[len(body)]
            body.append(s)
            have += estimate_tokens(s) + 1
        for s in special:
            body.insert(self.rng.randint(0, len(body)), s)
        pos = -1
        if middle:
            pos = self.rng.randint(1, len(body) - 1)  # not first (0), not last (len after insert - 1)
            body.insert(pos, middle)
        return " ".join(body), pos


def _expected(attr: dict[str, Any], slots: dict[str, Any]) -> str:
    """The short fact the answer sentence holds, as the sentence writes it: a date, person,
    price, company, permit number, or an inspection finding without its leading article."""
    value = str(slots[attr["expect"]])
    if attr["expect"] == "finding":
        value = re.sub(r"^(?:a|an|the) ", "", value)
    return value


def _log_uniform(rng: random.Random, lo: float, hi: float) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _entity(rng: random.Random, used: set[str]) -> tuple[str, str, str]:
    while True:
        s, t = rng.choice(_SURNAMES), rng.choice(_TYPES)
        if f"{s} {t}" not in used:
            used.add(f"{s} {t}")
            return s, t, f"{s} {t}"


def _history(g: _Gen, n_turns: int, entity: str, attr: dict[str, Any], others: list[str], turn_tokens: tuple[int, int]) -> list[dict[str, Any]]:
    """``n_turns`` earlier turns about other records (and other facts of this entity), about a
    quarter of them tool turns. Never the question's own fact."""
    r = g.rng
    msgs: list[dict[str, Any]] = []
    call_no = 0
    for t in range(n_turns):
        # earlier questions: other entities, or this entity's other kinds of fact
        if r.random() < 0.25:
            ent, a = entity, r.choice([x for x in ATTRIBUTES if x["name"] != attr["name"]])
        else:
            ent, a = r.choice(others), r.choice(ATTRIBUTES)
        question = g.fill(r.choice(a["q"]), ent)
        lead = r.choice(["", "Thanks. ", "Next one: ", "Another question. ", "Right, and ", "Could you check this? "])
        user = (lead + (question[0].lower() + question[1:] if lead.endswith("and ") else question)).strip()
        fact = g.fill(a["a"], ent, prefix="H" + a["tool"][0].upper())
        extra = " ".join(g.filler(ent, r.randint(0, max(0, (r.randint(*turn_tokens) - 40) // 14)), set()))
        if r.random() < 0.28:
            call_no += 1
            call_id = f"call_{t:02d}{call_no:02d}"
            args = json.dumps({"entity": ent, "record_type": a["tool"]})
            result = json.dumps({"found": True, "entity": ent, "record_type": a["tool"], "extract": fact, "notes": extra or "none"})
            msgs += [
                {"role": "user", "content": user},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "lookup_record", "arguments": args}}]},
                {"role": "tool", "tool_call_id": call_id, "content": result},
                {"role": "assistant", "content": f"The record lookup says: {fact}"},
            ]
        else:
            reply = f"{fact} {extra}".strip() if r.random() < 0.8 else "I could not find that in the extracts I have; the lookup found no matching record either."
            msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return msgs


def generate(
    seed: int = 7,
    n: int = 32,
    *,
    turns: tuple[int, int] = (4, 30),
    chunks: tuple[int, int] = (8, 16),
    chunk_tokens: tuple[int, int] = (40, 400),
    turn_tokens: tuple[int, int] = (30, 60),
    max_prompt_tokens: int = 3500,
) -> list[dict[str, Any]]:
    """``n`` requests, deterministic from ``seed`` (see the module docstring).

    Each request is a dict: ``id``, ``messages`` (system, history, the question last),
    ``question``, ``chunks`` (retriever order; each ``text``, ``id`` (None for ``plain``),
    ``score`` (None unless ``scored``), ``kind``: answer | near_same_entity |
    near_same_fact | unrelated), ``answer_index`` (position in ``chunks``),
    ``answer_sentence``, ``expected_answer`` (the short fact the answer sentence holds, as it
    writes it: a date, person, price, company, permit number or inspection finding) and its
    ``expected_kind``, ``answer_score_rank`` (1-based, ``scored`` only), ``chunk_mode``,
    ``order``, ``entity``, ``attribute``, ``n_turns``.

    ``max_prompt_tokens`` caps the estimated untrimmed prompt: chunk lengths are scaled down
    (not below ``chunk_tokens[0]``) when history and chunks together would exceed it.
    """
    rng = random.Random(seed)
    g = _Gen(rng)
    modes = ("scored", "unscored", "plain")
    orders = ("ranked", "shuffled")
    used: set[str] = set()
    requests = []
    for i in range(n):
        mode = modes[i % 3]
        order = orders[(i // 3) % 2]
        surname, ptype, entity = _entity(rng, used)
        attr = ATTRIBUTES[rng.randrange(len(ATTRIBUTES))]
        prefix = "".join(w[0] for w in attr["name"].split("_")).upper()
        question = rng.choice(attr["q"]).format(E=entity)
        # entities that share a word with the question's (for near distractors) and unrelated ones
        kin = [f"{surname} {t}" for t in _TYPES if t != ptype] + [f"{s} {ptype}" for s in _SURNAMES if s != surname]
        others = [f"{s} {t}" for s in _SURNAMES for t in _TYPES if s != surname and t != ptype]
        n_turns = rng.randint(*turns)
        history = _history(g, n_turns, entity, attr, others, turn_tokens)
        n_chunks = rng.randint(*chunks)
        n_near = rng.randint(3, min(6, n_chunks - 2))
        targets = [_log_uniform(rng, *chunk_tokens) for _ in range(n_chunks)]
        # uneven for sure: at least one short and one long extract (which ones is random)
        short, long_ = rng.sample(range(n_chunks), 2)
        targets[short] = rng.randint(chunk_tokens[0], 2 * chunk_tokens[0])
        targets[long_] = rng.randint(chunk_tokens[1] * 5 // 8, chunk_tokens[1])
        hist_tokens = estimate_tokens(SYSTEM + question + message_texts(history)) + 8 * len(history)
        room = max_prompt_tokens - hist_tokens - 12 * n_chunks
        if sum(targets) > room:  # scale down (the short one stays short, none below the minimum)
            scale = max(room - targets[short], chunk_tokens[0] * (n_chunks - 1)) / (sum(targets) - targets[short])
            targets = [t if k == short else max(chunk_tokens[0], int(t * scale)) for k, t in enumerate(targets)]
            targets[long_] = max(targets[long_], 4 * chunk_tokens[0])  # still long: uneven whatever the history
        # the answer chunk
        slots = g.slots(entity, prefix)  # the same draws as g.fill(attr["a"], entity, prefix)
        answer = attr["a"].format(**slots)
        expected = _expected(attr, slots)
        ans_text, ans_pos = g.chunk_text(entity, max(targets[0], 60), [], middle=answer)
        items = [{"text": ans_text, "kind": "answer", "answer_sentence_index": ans_pos}]
        near_templates = list(attr["near"])
        rng.shuffle(near_templates)
        for j in range(n_near):
            if j % 2 == 0:  # same entity, same wording, another fact
                tmpl = near_templates[(j // 2) % len(near_templates)]
                sent, subject, kind = g.fill(tmpl, entity, prefix), entity, "near_same_entity"
            else:  # the same kind of fact about an entity sharing a name with the question's
                subject = rng.choice(kin)
                sent, kind = g.fill(attr["a"], subject, prefix), "near_same_fact"
            text, _ = g.chunk_text(subject, targets[1 + j], [sent])
            items.append({"text": text, "kind": kind})
        for j in range(n_chunks - 1 - n_near):
            subject = rng.choice(others)
            a = rng.choice([x for x in ATTRIBUTES if x["name"] != attr["name"]])
            text, _ = g.chunk_text(subject, targets[1 + n_near + j], [g.fill(rng.choice([a["a"], *a["near"]]), subject)])
            items.append({"text": text, "kind": "unrelated"})
        # the retriever: a score rank 1–4 for the answer, near distractors tend to score higher
        rank = rng.randint(1, 4)
        rest = items[1:]
        rng.shuffle(rest)
        rest.sort(key=lambda c: (c["kind"] == "unrelated") + rng.random() * 1.2)
        by_score = rest[: rank - 1] + [items[0]] + rest[rank - 1 :]
        score = rng.uniform(0.78, 0.9)
        for c in by_score:
            c["score"] = round(score, 4) if mode == "scored" else None
            score -= rng.uniform(0.004, 0.05)
        if order == "ranked":
            listed = by_score
        else:
            listed = list(by_score)
            rng.shuffle(listed)
        for k, c in enumerate(listed):
            c["id"] = None if mode == "plain" else f"rec-{i:02d}-{k:02d}"
        answer_index = next(k for k, c in enumerate(listed) if c["kind"] == "answer")
        messages = [{"role": "system", "content": SYSTEM}, *history, {"role": "user", "content": question}]
        requests.append({
            "id": f"q{i:02d}",
            "messages": messages,
            "question": question,
            "chunks": listed,
            "answer_index": answer_index,
            "answer_sentence": answer,
            "expected_answer": expected,
            "expected_kind": attr["expect"],
            "answer_score_rank": rank if mode == "scored" else None,
            "chunk_mode": mode,
            "order": order,
            "entity": entity,
            "attribute": attr["name"],
            "n_turns": n_turns,
        })
    return requests


def main() -> int:
    import argparse
    import statistics

    ap = argparse.ArgumentParser(description="print a summary of the generated RAG QA set")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--n", type=int, default=32)
    args = ap.parse_args()
    reqs = generate(args.seed, args.n)
    for r in reqs:
        sizes = [estimate_tokens(c["text"]) for c in r["chunks"]]
        hist = estimate_tokens(message_texts(r["messages"]))
        print(f"{r['id']} {r['chunk_mode']:8s} {r['order']:8s} turns {r['n_turns']:2d} (~{hist:4d} tok)  chunks {len(sizes):2d} "
              f"~{min(sizes)}–{max(sizes)} tok (sum {sum(sizes)})  answer at {r['answer_index'] + 1}  {r['attribute']}")
    allsizes = [estimate_tokens(c["text"]) for r in reqs for c in r["chunks"]]
    print(f"chunk sizes (estimated): median {statistics.median(allsizes)}, min {min(allsizes)}, max {max(allsizes)}")
    r = reqs[0]
    print(json.dumps({k: v for k, v in r.items() if k != "messages"}, indent=1)[:3000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
