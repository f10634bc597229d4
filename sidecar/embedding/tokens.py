"""From a prompt to the token ids the model reads: normalise, tokenize, keep the end.

Why the end: in a chat prompt the question usually comes last, after pasted context,
so when a prompt is longer than the model's limit the tail says more about it.

Tokenizing costs 0.4 to 3.4 s per MB of text (English to Chinese), so a long prompt is
not tokenized whole: `encode_tail` tokenizes a window at the end of it, grown until the
tokens kept all come from words after the window's first one. The first word may be
cut; every later one is whole, and the normaliser and the pre-tokenizer (both local to
a character or a word) see it as they would in the full text. So the ids are the same
as for the whole text, at the cost of a few KB (up to a cap, for texts that are no
prompt, below).
"""
from __future__ import annotations

import unicodedata
from pathlib import Path

from tokenizers import Tokenizer

from sidecar.embedding.errors import ModelLoadError, NothingToEmbed
from sidecar.embedding.normalize import normalize_text

# First window, in characters per token of the limit: English runs 4 to 5 characters a
# token, so most long prompts need one window.
_WINDOW_CHARS_PER_TOKEN = 8
# Last window: past this many characters a token (a 30 KB word, a sea of zero-width
# characters) the text is no prompt, and tokenizing it whole would hold the worker for
# seconds; its end is then tokenized as found, first word cut or not.
_MAX_CHARS_PER_TOKEN = 128
# Past this share of [UNK] tokens a vector says too little about the text to match on.
MAX_UNKNOWN_SHARE = 0.15


def load_tokenizer(path: Path, max_tokens: int) -> Tokenizer:
    """The tokenizer, set to truncate at max_tokens from the left and never pad."""
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises plain Exception on bad JSON
        raise ModelLoadError(f"cannot load tokenizer {path}: {exc}") from exc
    # The file ships with truncation and padding at 128; padding is done per batch here.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_tokens, direction="left")
    return tokenizer


def encode_tail(tokenizer: Tokenizer, text: str, max_tokens: int) -> list[int]:
    """Token ids of normalize_text(text), keeping the end when it is too long.

    Raises NothingToEmbed when nothing is left, or when more than MAX_UNKNOWN_SHARE of the
    tokens are [UNK] (a vector of unknown tokens says little about the prompt, and such
    prompts of one length would match).
    """
    # Trailing whitespace is stripped by the normaliser anyway; left in, a long run of it
    # filled every window and a real question before it had "nothing to embed".
    text = text.rstrip()
    window = max_tokens * _WINDOW_CHARS_PER_TOKEN
    while True:
        start = max(0, len(text) - window)
        normalized = normalize_text(text[start:])
        encoding = tokenizer.encode(normalized)
        if start == 0 or _first_word_dropped(encoding) or window >= max_tokens * _MAX_CHARS_PER_TOKEN:
            break
        window *= 4  # too few words in the window (long words, invisible characters)
    _check_content(tokenizer, encoding, normalized)
    return encoding.ids


def _symbols_only(span: str) -> bool:
    return bool(span) and all(unicodedata.category(c)[0] == "S" for c in span)


def _first_word_dropped(encoding) -> bool:
    """Did truncation drop the window's first (possibly cut) word entirely?"""
    kept = [w for w in encoding.word_ids if w is not None]
    return bool(encoding.overflowing) and bool(kept) and min(kept) > 0


def _check_content(tokenizer: Tokenizer, encoding, normalized: str) -> None:
    content = [i for i, special in zip(encoding.ids, encoding.special_tokens_mask) if not special]
    if not content:
        raise NothingToEmbed("nothing to embed: the text is empty once normalised")
    unknown = tokenizer.token_to_id("[UNK]")
    if unknown is None:
        return
    if content.count(unknown) == len(content):
        raise NothingToEmbed("nothing to embed: the model knows none of the text's tokens")
    # Unknown symbols (emoji, ∑) do not count: two prompts that differ in them alone are told
    # apart by the same-question check's symbol comparison, not by the vector.
    unknown_count = sum(1 for i, (begin, end) in zip(encoding.ids, encoding.offsets)
                        if i == unknown and not _symbols_only(normalized[begin:end]))
    if unknown_count > MAX_UNKNOWN_SHARE * len(content):
        # Most CJK characters are [UNK] to this model: "open the firewall" and "close the
        # firewall" in Chinese embed identically (cosine 1.0). Such prompts get exact hits only.
        raise NothingToEmbed(f"nothing to embed: the model knows too few of the text's tokens "
                             f"({unknown_count} of {len(content)} unknown)")
