"""The one error type of data prep.

Every problem a user can fix (a missing file, a bad setting, a vocab without special tokens) is
raised as a `PrepError` with a one-line message that names the problem and the fix; the
`bert-prep` entry point prints it as ``bert-prep: error: <message>`` and exits with status 2,
without a traceback.  Anything else escaping is a bug in bert-prep, and keeps its traceback.
"""


class PrepError(Exception):
    """A user-fixable problem with the corpus, the tokenizer or the prep config."""
