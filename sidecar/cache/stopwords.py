"""Words that carry no question of their own: the same-question checks and token alignment
both skip them (sidecar/cache/equivalence.py, sidecar/cache/alignment.py)."""

STOPWORDS = frozenset("""
way ways ever please tell explain exactly actually basically probably simply said say says
told according mr mrs ms dr
a an the and or but if then else so than that this these those there here of in on at to for
from by with about into onto over under through during as is am are was were be been being do
does did doing done have has had having i me my mine myself we us our ours ourselves you your
yours yourself he him his she her hers it its it's itself they them their theirs themselves
what which who whom whose when where why how can could should would will shall may might must
i'm i've i'd i'll you're you've you'd we're we've they're they've he's she's that's there's
what's let's also just very really quite some any all each every both most much many such
other another own same only even still yet again too get got gets getting one ones thing
things someone something anyone anything everyone everything somebody anybody s t
""".split())
