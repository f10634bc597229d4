"""The verifier's hand-written pairs (handwritten.jsonl, and the news and caption files kept for
training experiments): well formed, about half rewordings, and apart from the held-out chat
suites (scripts/drop_chat_overlap.py), so no chat figure is measured on a near-copy of a
training pair."""
import pytest

from scripts import drop_chat_overlap

DATA = drop_chat_overlap.TEST_DIRS[0].parent
FILES = ("handwritten.jsonl", "handwritten-news.jsonl", "handwritten-captions.jsonl")
# The image's test stage has no data/ folder (the Dockerfile does not copy it).
pytestmark = pytest.mark.skipif(not (DATA / FILES[0]).exists(), reason="data/semantic is not in this tree")


def _pairs(name: str = FILES[0]):
    return drop_chat_overlap.load_jsonl(DATA / name)


@pytest.mark.parametrize("name", FILES)
def test_pairs_are_well_formed_and_about_half_rewordings(name):
    pairs = _pairs(name)
    assert len(pairs) >= 800
    for p in pairs:
        assert set(p) == {"a", "b", "label", "kind", "lang"}, p
        assert p["label"] in (0, 1) and p["a"].strip() and p["b"].strip() and p["a"] != p["b"], p
    assert len({(p["a"], p["b"]) for p in pairs}) == len(pairs)
    assert 0.4 <= sum(p["label"] for p in pairs) / len(pairs) <= 0.6
    assert len({p["lang"] for p in pairs}) >= 8


@pytest.mark.parametrize("name", FILES)
def test_no_pair_is_near_a_held_out_chat_text(name):
    test = drop_chat_overlap.test_texts()
    assert len(test) > 4000, "a held-out chat suite is missing"
    index = drop_chat_overlap.Index(test)
    near = [i for i, p in enumerate(_pairs(name))
            if max(index.highest(p["a"]), index.highest(p["b"])) > drop_chat_overlap.LIMIT]
    assert near == [], f"{len(near)} training pairs near a chat-test text (lines {near[:10]})"


def test_overlap_is_the_char_5gram_jaccard():
    index = drop_chat_overlap.Index(["How do I reverse a list in Python?"])
    assert index.highest("how do i  reverse a list in python?") == 1.0   # case and spaces do not count
    assert index.highest("How do I reverse a list in Python") > 0.5
    assert index.highest("What is the capital of Peru?") < 0.1
