"""The fixed prompts of ``offload bench``, one per task, in the spirit of llama.cpp's
spec-bench tasks (code / extract / story).

The shipped model is trained only on the Python standard library, so every prompt is
Python source, and each task keeps the character its name has in spec-bench:

- ``code``: continue a function — ordinary code completion;
- ``extract``: a docstring holds a table of facts and the code below starts turning it into
  a dict — the continuation mostly copies spans from the prompt, as extraction and
  summarisation do (the easiest text to draft);
- ``story``: free prose, as a module docstring of notes and history — the least
  predictable text.
"""
from __future__ import annotations

TASKS: dict[str, str] = {
    "code": '''import os
import sys


def find_modules(top, suffix=".py"):
    """Return the sorted paths of the files under *top* whose names end with *suffix*."""
    found = []
    for dirpath, dirnames, filenames in os.walk(top):
        for name in filenames:
''',
    "extract": '''"""HTTP status codes and their reason phrases.

    100 Continue
    200 OK
    201 Created
    204 No Content
    301 Moved Permanently
    304 Not Modified
    400 Bad Request
    401 Unauthorized
    403 Forbidden
    404 Not Found
    500 Internal Server Error
    503 Service Unavailable
"""

# Every status code of the table above with its reason phrase.
REASONS = {
    100: 'Continue',
''',
    "story": '''"""Notes on the history of this module.

This module began as a small helper that read configuration files for the mail
tools. Over the years it grew, one request at a time, until it''',
}
