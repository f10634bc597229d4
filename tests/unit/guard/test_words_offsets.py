"""A word scan that masks folds the text once: `find` keeps the offsets its fold gives, and
`spans` reads them. Against the spans worked out from a fresh fold_with_offsets, on a sample of
the data prompts in every script (and texts whose fold keeps no offsets)."""
import json
import random

import numpy as np

from bench.guard_data import OURS, SHARED
from sidecar.guard.normalize import fold, fold_keeping_offsets, fold_with_offsets
from sidecar.guard.words import WordMatcher

# Words ordinary prompts hold, in several scripts, so that most texts have something to mask.
WORDS = ["the", "ignore", "password", "is", "de", "la", "微信", "的", "です", "는", "и", "straße", "ﬁle", "İstanbul"]


def sample_texts() -> list[str]:
    rng = random.Random(22)
    texts = []
    for path in sorted(OURS.parent.glob("*.jsonl")) + [SHARED / "guard" / "prompt_injections.jsonl"]:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
        texts += [row["text"] for row in rng.sample(rows, min(150, len(rows))) if isinstance(row.get("text"), str)]
    # Folds that drop characters or change their number, where no offsets are kept.
    texts += ["\x01the\x02 password is", "the\x00 password\u200b is", "ＴＨＥ ﬁle", "e\u0301 the café", "the 😀 微 信", "a\ud800 the", "ß the İ", ""]
    return texts


def test_spans_from_the_kept_offsets_equal_those_from_a_second_fold():
    matcher = WordMatcher([(WORDS, "cjk")])
    masked = 0
    for text in sample_texts():
        found = matcher.find(text)
        assert found.folded == fold(text)
        if found.offsets is not None:
            again, offsets = fold_with_offsets(text)
            assert again == found.folded and np.array_equal(offsets, found.offsets), text
        got = matcher.spans(text, {0}, found)
        assert got == matcher.spans(text, {0}), text          # no `found`: fold_with_offsets
        masked += bool(got)
    assert masked > 300


def test_offsets_are_kept_where_folding_gave_them():
    assert list(fold_keeping_offsets("The Rules")[1]) == list(range(9))
    assert list(fold_keeping_offsets("加 微 信")[1]) == list(range(5))
    assert list(fold_keeping_offsets("ＴＨＥ Ｒｕｌｅｓ")[1]) == list(range(9))
    assert fold_keeping_offsets("the\x00rules")[1] is None          # a control character dropped
    assert fold_keeping_offsets("e\u0301")[1] is None               # NFKC joins the two
