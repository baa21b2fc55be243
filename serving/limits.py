"""What one request to the served encoder may cost, and the settings that bound it.

Every bound is enforced before the work it bounds: the body size before the body is read,
its JSON's nesting and number lengths before MLflow parses it (:mod:`serving.guard`), the
row count and the pixel budget (from the images' headers)
before any image is decoded, each file's size before it is read (:mod:`serving.paths`),
the deadline between rows (:mod:`serving.inputs`). ``docs/reliability.md`` ("Security")
says why each default is what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20


@dataclass(frozen=True)
class ServeLimits:
    """The serving bounds; the defaults are what ``launch/serve.sh`` starts with."""

    max_body_bytes: int = 8 * MIB  # a larger request is answered 413 before it is read
    max_rows: int = 256  # images per request
    max_json_depth: int = 32  # nesting of the JSON body (a valid request nests 4 deep)
    max_number_chars: int = 40  # characters of one JSON number (Python's int parse is quadratic)
    max_pixels: int = 32 * MIB  # pixels decoded per request, judged from the headers
    max_file_bytes: int = 8 * MIB  # one path row's file; all of a request's files: body cap
    deadline_s: float = 30.0  # a request still decoding after this is refused (400)
    concurrent: int = 2  # requests decoding at once; the others wait (to the deadline)
    path_root: str = ""  # path rows read regular files under this directory; "": refused

    def __post_init__(self) -> None:
        for key in ("max_body_bytes", "max_rows", "max_json_depth", "max_number_chars",
                    "max_pixels", "max_file_bytes", "concurrent"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s}")
