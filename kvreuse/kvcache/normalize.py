"""`cache.normalize_input`: canonicalise text so that equal-looking prompts become equal tokens.

Applied to the text the model receives (each chat message), not only to a hash key: otherwise the
cached K/V would belong to different tokens than the ones being served.
"""

from __future__ import annotations

import re
import unicodedata

_SPACE_RUNS = re.compile(r"[ \t\u00a0\u3000]+")
_TRAILING_SPACE = re.compile(r"[ \t]+$", re.MULTILINE)


def normalize_text(text: str) -> str:
    """NFKC (full-width letters, digits and punctuation to half-width), CRLF and CR to LF, runs of
    spaces and tabs to one space, trailing spaces of each line removed."""
    text = unicodedata.normalize("NFKC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _SPACE_RUNS.sub(" ", text)
    return _TRAILING_SPACE.sub("", text)
