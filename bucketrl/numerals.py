"""Numbers as Arabic-script text writes them, rewritten the way the math reward reads them (ASCII).

A model answering in Arabic writes ``\\boxed{٤٢}``, ``\\boxed{٤٫٥}`` or ``\\boxed{١٬٠٠٠}``, often with a bidi
mark that its tokenizer or the dataset's editor inserted (``\\u200f-٣``: the minus shows on the correct side of
right-to-left text only with it). Compared as written, each of those scores 0 against the reference ``42``,
``4.5`` or ``1000``, and GRPO learns that Arabic numerals are wrong. :func:`normalise_numerals` rewrites:

- every decimal digit of any script (Unicode category Nd: Eastern Arabic ٠-٩ U+0660-0669, Persian ۰-۹
  U+06F0-06F9, Devanagari, ...) to its ASCII digit, so mixed digits (``4٢``) read as one number;
- the Arabic decimal separator ``٫`` (U+066B) to ``.`` and the Arabic thousands separator ``٬`` (U+066C) to
  ``,`` (the reward drops a comma only between groups of three digits);
- the Arabic comma ``،`` to ``, `` (a list separator, never a thousands separator: the space keeps it from
  joining two numbers), the Arabic question mark ``؟`` and semicolon ``؛`` to their ASCII forms, ``٪`` to ``%``;
- U+2212 MINUS SIGN and the small and full-width hyphen-minus to ``-``;
- no-break spaces to a plain space;
- and deletes the bidi controls (RLM U+200F, LRM U+200E, ALM U+061C, the embeddings U+202A-202E and isolates
  U+2066-2069) and the tatweel U+0640 (a stretch in the letters' joining line, never a character of the number).

The rewrite applies to the whole text (prompt words are untouched, only the characters above change), so the
reference answer goes through the same function as the completion.
"""

from __future__ import annotations

import re
import unicodedata

# Invisible: they only steer the direction the text is shown in, or stretch a letter.
BIDI_CONTROLS = "\u200e\u200f\u061c\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
TATWEEL = "\u0640"
ARABIC_DECIMAL_SEPARATOR = "\u066b"
ARABIC_THOUSANDS_SEPARATOR = "\u066c"

_TABLE = str.maketrans(
    {
        **dict.fromkeys(BIDI_CONTROLS + TATWEEL),
        ARABIC_DECIMAL_SEPARATOR: ".",
        ARABIC_THOUSANDS_SEPARATOR: ",",
        "\u060c": ", ",  # ، Arabic comma
        "\u061b": ";",  # ؛ Arabic semicolon
        "\u061f": "?",  # ؟ Arabic question mark
        "\u066a": "%",  # ٪ Arabic percent sign
        "\u2212": "-",  # − minus sign
        "\ufe63": "-",  # ﹣ small hyphen-minus
        "\uff0d": "-",  # － full-width hyphen-minus
        "\u00a0": " ",
        "\u202f": " ",  # narrow no-break space (a thousands separator in some locales)
    }
)
# Python's \d is Unicode's Nd; these are the ones that are not ASCII.
_NON_ASCII_DIGIT = re.compile(r"(?![0-9])\d")


def _ascii_digit(m: re.Match[str]) -> str:
    return str(unicodedata.decimal(m.group()))


def normalise_numerals(text: str) -> str:
    """``text`` with Arabic-script numbers, separators, minus signs and bidi marks in ASCII (see the module
    docstring); any other character is kept as it is."""
    text = text.translate(_TABLE)
    if text.isascii():
        return text
    return _NON_ASCII_DIGIT.sub(_ascii_digit, text)


EASTERN_DIGITS = "٠١٢٣٤٥٦٧٨٩"


def eastern(n: int) -> str:
    """``n`` (>= 0) in Eastern Arabic digits."""
    return "".join(EASTERN_DIGITS[int(d)] for d in str(n))
