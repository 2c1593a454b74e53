"""Retrieval quality on the real wiki-18 sample: a labelled query set and recall@k.

`LABELLED_QUERIES` holds natural questions written by reading the 1000 passages of
``wiki18_sample.jsonl`` (ids "0".."999"): each is answered by exactly one passage, named by its id. Most
come from single-passage articles; the last four ask about one passage of a multi-passage article, which is
harder. Notebook 01 and the retrieval tests use them:

    recall_at_k(retriever, LABELLED_QUERIES, k=3)     # fraction of questions whose passage is in the top 3
    answer_ranks(retriever, LABELLED_QUERIES, k=10)   # 1-based rank of each answer passage, None if absent
"""

from __future__ import annotations

from collections.abc import Sequence

from scope_lib.retrieval.api import Retriever

#: (question, id of the one passage of wiki18_sample.jsonl that answers it)
LABELLED_QUERIES: list[tuple[str, str]] = [
    ("Which lobbyist for Genentech and Roche died in July 2015?", "0"),
    ("Who was the ethnologist and philologist of the United States Exploring Expedition under Charles Wilkes?",
     "1"),
    ("Which town's fortress were the Portuguese required to build under the 1648 treaty after the siege of "
     "Muscat?", "2"),
    ("Which Iowa highway was originally designated Primary Road No. 60 between Des Moines and Goldfield?", "6"),
    ("Where were the knock-out stages of the 2012 PDC World Youth Championship played?", "10"),
    ("Which Trinidadian historian wrote the 'Back in Time' column for the Trinidad Guardian?", "13"),
    ("Which concrete arch dam in the Superstition Mountains impounds the Salt River to form Apache Lake?", "14"),
    ("Which women's basketball coach is the sister of Virginia Cavaliers coach Tony Bennett?", "17"),
    ("Which Scottish-American actress born in Glasgow starred in The Eagle Has Two Heads in the West End?", "18"),
    ("Which stellar-mass black hole is eclipsed by its companion star every 3.45 days?", "38"),
    ("Why did engine tappets stop using rollers against the camshaft?", "45"),
    ("Which bridge on the Isle of Man TT course lies between the 6th and 7th mile markers?", "55"),
    ("Who invented low energy electron microscopy in 1962?", "79"),
    ("Which road junction in the northern Sinai was fought over in the 1948, 1956 and 1967 wars?", "86"),
    ("Which Rudy Clark song did George Harrison cover on his album Cloud Nine?", "89"),
    ("Which Egyptian town on the Gulf of Suez lies about 200 km from Cairo?", "100"),
    ("When did Edlington railway station open to passengers?", "110"),
    ("Which Australian ground orchid has a single greenish-cream flower with pale red stripes?", "111"),
    ("Who became CEO of Telenor Norway in September 2011?", "115"),
    ("Which saint born in Corneto-Tarquinia in 1672 has a statue in St. Peter's Basilica?", "126"),
    ("Where are the floats for the New Orleans Mardi Gras parades built?", "130"),
    ("What was the last song Izumi Sakai recorded before she died?", "730"),
    ("Which art installation of weathered steel boats stands along Portland's MAX Orange Line?", "588"),
    ("Which Middletown, Connecticut high school building was converted into apartments?", "795"),
    ("Which pop rock band from Tempe, Arizona formed as a successor to the Gin Blossoms?", "812"),
    ("Which Liverpool dock built by George Fosbery Lyster lies between Gladstone Dock and Alexandra Dock?",
     "616"),
    ("Which Oakland University psychologist edits the journal Evolutionary Psychology?", "589"),
    ("On board which ship was the US-Japan Treaty of Amity and Commerce signed in 1858?", "329"),
    ("Which Flemish liberal party did Hugo Coveliers found in 2005?", "863"),
    ("Which dye was involved in the 1981 Spanish toxic oil syndrome?", "764"),
    ("Where has Peter Lampe of Heidelberg directed archaeological campaigns since 2001?", "505"),
    ("Why do Russian Orthodox Christians keep a portion of the blessed bread through the year?", "694"),
    # one passage of a multi-passage article
    ("When did the composer Sorabji die, and where was he cremated?", "182"),
    ("Which cricketer collapsed after coughing up blood before a NSW match against Queensland in Brisbane?",
     "62"),
    ("Which company laid down the light cruiser USS San Diego in Quincy, Massachusetts in 1940?", "249"),
    ("Which composer-pianists influenced Sorabji's writing for the piano?", "205"),
]


def answer_ranks(retriever: Retriever, questions: Sequence[tuple[str, str]] = LABELLED_QUERIES,
                 k: int = 10) -> list[int | None]:
    """The 1-based rank of each question's answer passage in the top k (None when absent); one batched
    search for all questions."""
    hits = retriever.search([q for q, _ in questions], k)
    ranks: list[int | None] = []
    for (_, answer_id), found in zip(questions, hits, strict=True):
        ids = [h.id for h in found]
        ranks.append(ids.index(answer_id) + 1 if answer_id in ids else None)
    return ranks


def recall_at_k(retriever: Retriever, questions: Sequence[tuple[str, str]] = LABELLED_QUERIES,
                k: int = 3) -> float:
    """Fraction of questions whose answer passage is among the top k hits."""
    if not questions:
        raise ValueError("recall_at_k needs at least one labelled question")
    ranks = answer_ranks(retriever, questions, k)
    return sum(r is not None for r in ranks) / len(ranks)
