"""Words that carry no question of their own: the same-question checks and token alignment
both skip them (sidecar/cache/equivalence.py, sidecar/cache/alignment.py). The list is the
lexicon's `stopwords` table (sidecar/cache/lexicon.toml)."""

from sidecar.cache.lexicon import lexicon

STOPWORDS = lexicon().words["stopwords"]
