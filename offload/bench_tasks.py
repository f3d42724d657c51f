"""The fixed prompts of ``offload bench``, one per task, in the spirit of llama.cpp's
spec-bench tasks (code / extract / story).

The shipped model is trained only on the Python standard library, so every prompt is
Python source, and each task keeps the character its name has in spec-bench:

- ``code``: continue a function in the middle of a statement — code completion;
- ``extract``: a docstring holds a table of facts and the code below starts turning it
  into a dict — structured, table-like output that leans on the prompt, as extraction does;
- ``story``: free prose, as a class docstring describing what the class is about.

(What the under-trained shipped model makes of them: code, then docstring prose for
``code``; rows of a string table for ``extract``; docstring prose for ``story``. Greedy
decoding of it drifts into loops after a few dozen tokens, which drafts easily.)
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
            if name.endswith(suffix):
                found.append(''',
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
    "story": '''class Mailbox:
    """A group of messages in a particular place.

    A mailbox keeps its messages in a file or a directory. When a message is
    added, it''',
}
