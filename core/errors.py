"""Faults a user can fix. Raised with one line that names the file, key or URI at fault
and what to do; the entry points print that line (no traceback) and exit with status 1."""

from __future__ import annotations


class RunError(RuntimeError):
    """A fault found at run time (after configuration checks), worded for the user."""
