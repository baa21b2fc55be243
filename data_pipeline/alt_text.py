"""Alt-text captions for the cluttered digits (``shards.captions=alt_text``).

Web alt-text (CC3M, CC12M) names the main object among words that say nothing about the
picture, and often names nothing at all. These captions do the same for a canvas of digit
``label``: with probability :data:`NAMED_SHARE` a phrasing from :data:`NAMED` names the
digit, as a word ("seven") or a numeral ("7"), often with a phrase from :data:`FILLERS`
(a place, a credit, a hashtag); otherwise a phrasing from :data:`UNNAMED` names nothing
(file names, "untitled", a trip), some of them with numbers that are not the digit.
None names a colour, a size or a position: the caption's only signal about the image
is the digit, when it is named.
"""

from __future__ import annotations

import numpy as np

from data_pipeline.digits import DIGIT_NAMES

NAMED_SHARE = 0.8  # captions that name the digit; the rest name nothing
NUMERAL_SHARE = 0.4  # of those, the digit as a numeral ("7") rather than a word ("seven")
FILLER_SHARE = 0.5  # of those, a filler phrase appended
NAMED = [  # {d}: the digit as a word or a numeral
    "{d}",
    "close-up of a {d}",
    "a {d} drawn on a sticky note",
    "{d} in an old school notebook",
    "my daughter's first {d}",
    "the number {d}, hand lettered",
    "vintage {d} from a shop sign",
    "free printable {d} worksheet",
    "big {d} for the kids' room",
    "handwriting sample: {d}",
    "a quick sketch of {d}",
    "{d} painted on the door of our flat",
]
FILLERS = ["photo by Marta", "taken in Porto", "#handwriting", "#throwback",
           "best viewed large", "all rights reserved", "on sale now", "summer 2016",
           "via the school blog", "shot on my phone"]
UNNAMED = ["IMG_{n}.jpg", "untitled", "no description available", "click to enlarge",
           "view from the kitchen table", "our weekend in Lyon", "DSC{n}", "screenshot",
           "image", "photo taken last spring", "scan {n}", "thumbnail, page {p} of 12"]


def alt_text(rng: np.random.Generator, label: int) -> str:
    """One alt-text caption of a canvas showing digit ``label``, drawn from ``rng``."""
    if rng.random() >= NAMED_SHARE:
        phrasing = UNNAMED[int(rng.integers(len(UNNAMED)))]
        return phrasing.format(n=int(rng.integers(1000, 10_000)), p=int(rng.integers(1, 13)))
    digit = str(label) if rng.random() < NUMERAL_SHARE else DIGIT_NAMES[label]
    caption = NAMED[int(rng.integers(len(NAMED)))].format(d=digit)
    if rng.random() < FILLER_SHARE:
        caption += ", " + FILLERS[int(rng.integers(len(FILLERS)))]
    return caption
