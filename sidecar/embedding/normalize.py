"""Text normalisation before embedding (and before exact cache keys, which reuse it).

Two prompts that a person reads as the same text should give the same vector and the
same key. `normalize_text` does, in order:

1. Line breaks: CRLF, CR, NEL (U+0085), LINE SEPARATOR (U+2028) and PARAGRAPH SEPARATOR
   (U+2029) become "\\n".
2. Removes the characters in `REMOVED_RANGES` (table below): invisible characters that
   change no meaning for a reader but change tokens, and are a favourite way to hide
   text from a person ("ASCII smuggling" with tag characters, bidi overrides):
   - C0 and C1 control characters (category Cc) except TAB and LF;
   - every format character (category Cf): zero-width space / joiners (U+200B-U+200D),
     word joiner and invisible operators (U+2060-U+2064), bidi marks, embeddings,
     overrides and isolates (U+200E, U+200F, U+061C, U+202A-U+202E, U+2066-U+2069),
     byte order mark / ZWNBSP (U+FEFF), soft hyphen (U+00AD), Mongolian vowel
     separator (U+180E), interlinear annotation marks, tag characters (U+E0001,
     U+E0020-U+E007F) and the rest of Cf as of Unicode 14;
   - lone surrogates (U+D800-U+DFFF), which JSON can carry but UTF-8 cannot;
   - other invisibles: combining grapheme joiner (U+034F), variation selectors
     (U+FE00-U+FE0F, U+E0100-U+E01EF), Hangul fillers (U+115F, U+1160, U+3164, U+FFA0).
3. Superscripts and subscripts are written out, not flattened: one becomes "^" or "_" and
   its plain character, a run of them the same with its characters in brackets (2³ -> 2^3,
   x²ⁿ -> x^(2n), H₂O -> H_2O, 2ˣ -> 2^x), since NFKC alone would make 2³ and 23, or x² and
   x2, one text (SUPERSCRIPT_RANGES, SUBSCRIPT_RANGES; the ordinal indicators ª º, and ™ ℠,
   whose plain form is two letters, are left to NFKC).
4. Unicode NFKC (compatibility composition): compatibility variants become their plain
   character: full-width and half-width forms, ligatures (ﬁ -> fi), non-breaking and
   ideographic spaces, circled and parenthesised numbers (① -> 1), vulgar fractions
   (½ -> 1⁄2), styled mathematical letters (ℌ, 𝐇 -> H), unit signs (㎏ -> kg), roman
   numerals (Ⅻ -> XII). A question that turns on such a difference is merged with its
   plain spelling (the semantic tier would match them anyway).
   No kept character maps onto a removed one under NFKC (tests check every code
   point), so one removal pass before it is enough and the function is idempotent.
5. Strips whitespace at both ends. Inner whitespace is kept as it is: it matters in
   code, and the tokenizer ignores it anyway.

Everything else is kept: letters of every script, emoji, private-use and unassigned
code points (the tokenizer maps what it does not know to [UNK]). Pure function; no
lower-casing (the tokenizer does that for this model).
"""
from __future__ import annotations

import re
import unicodedata

# (first, last) code points, inclusive. Written out rather than derived from
# unicodedata at import so that the list is reviewable and does not move with the
# Python version; tests check it still covers every Cc/Cf/Cs code point.
REMOVED_RANGES: tuple[tuple[int, int], ...] = (
    (0x0000, 0x0008), (0x000B, 0x001F),  # C0 controls but TAB (09) and LF (0A)
    (0x007F, 0x009F),                    # DEL and C1 controls
    (0x00AD, 0x00AD),                    # soft hyphen
    (0x034F, 0x034F),                    # combining grapheme joiner
    (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F),
    (0x0890, 0x0891), (0x08E2, 0x08E2),  # Arabic/Syriac format marks, Arabic letter mark
    (0x115F, 0x1160),                    # Hangul choseong/jungseong fillers
    (0x180E, 0x180E),                    # Mongolian vowel separator
    (0x200B, 0x200F),                    # ZWSP, ZWNJ, ZWJ, LRM, RLM
    (0x202A, 0x202E),                    # bidi embeddings and overrides
    (0x2060, 0x2064), (0x2066, 0x206F),  # word joiner, invisible operators, isolates
    (0x3164, 0x3164),                    # Hangul filler
    (0xD800, 0xDFFF),                    # surrogates
    (0xFE00, 0xFE0F),                    # variation selectors
    (0xFEFF, 0xFEFF),                    # byte order mark / zero-width no-break space
    (0xFFA0, 0xFFA0),                    # half-width Hangul filler
    (0xFFF9, 0xFFFB),                    # interlinear annotation marks
    (0x110BD, 0x110BD), (0x110CD, 0x110CD), (0x13430, 0x1343F), (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),                  # Kaithi, Egyptian, shorthand, musical format marks
    (0xE0001, 0xE0001), (0xE0020, 0xE007F),  # language tag and tag characters
    (0xE0100, 0xE01EF),                  # variation selectors supplement
)

_REMOVED = re.compile(
    "[" + "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in REMOVED_RANGES) + "]+")
_LINE_BREAKS = re.compile("\r\n|[\r\x85\u2028\u2029]")


# Every character whose compatibility decomposition is one superscript or subscript character
# (digits, signs, Latin, Greek and other modifier letters, kanbun marks), as code point ranges,
# bar the ordinal indicators ª and º, which NFKC may make a and o; tests check the tables
# against the Unicode database of the running Python.
SUPERSCRIPT_RANGES: tuple[tuple[int, int], ...] = (
    (0x00B2, 0x00B3), (0x00B9, 0x00B9), (0x02B0, 0x02B8), (0x02E0, 0x02E4), (0x10FC, 0x10FC),
    (0x1D2C, 0x1D2E), (0x1D30, 0x1D3A), (0x1D3C, 0x1D4D), (0x1D4F, 0x1D61), (0x1D78, 0x1D78),
    (0x1D9B, 0x1DBF), (0x2070, 0x2071), (0x2074, 0x207F), (0x2C7D, 0x2C7D), (0x2D6F, 0x2D6F),
    (0x3192, 0x319F), (0xA69C, 0xA69D), (0xA770, 0xA770), (0xA7F2, 0xA7F4), (0xA7F8, 0xA7F9),
    (0xAB5C, 0xAB5F), (0xAB69, 0xAB69), (0x10781, 0x10785), (0x10787, 0x107B0), (0x107B2, 0x107BA),
)
SUBSCRIPT_RANGES: tuple[tuple[int, int], ...] = (
    (0x1D62, 0x1D6A), (0x2080, 0x208E), (0x2090, 0x209C), (0x2C7C, 0x2C7C),
)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


_SCRIPT_RUN = re.compile(f"(?P<sup>[{_char_class(SUPERSCRIPT_RANGES)}]+)|[{_char_class(SUBSCRIPT_RANGES)}]+")


def _written_out(run: re.Match) -> str:
    """^3 for ³; ^(2n) for ²ⁿ, so that x²ⁿ (x to the 2n) and x²n (x squared, times n) differ."""
    plain = unicodedata.normalize("NFKC", run.group())
    return ("^" if run.group("sup") else "_") + (plain if len(plain) == 1 else f"({plain})")


# The removed code points below 0x80, for the ASCII fast path.
_ASCII_REMOVED = bytes(c for first, last in REMOVED_RANGES if first < 0x80 for c in range(first, min(last, 0x7F) + 1))


def normalize_text(text: str) -> str:
    """The text as Sluice embeds and keys it; "" when nothing visible is left."""
    if text.isascii():
        # Most prompts: NFKC changes no ASCII character and only controls are removed, so
        # bytes.translate does in ~2 µs what the regular expressions do in ~45 (2 KB prompt).
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        return text.encode("ascii").translate(None, _ASCII_REMOVED).decode("ascii").strip()
    text = _LINE_BREAKS.sub("\n", text)
    text = _REMOVED.sub("", text)
    # Most non-ASCII prompts (accents, CJK, emoji) hold no compatibility character at all:
    # the quick check (~3 µs for 2 KB) spares them both passes.
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", _SCRIPT_RUN.sub(_written_out, text))
    return text.strip()
