"""Refusals: the errors a person can act on (a bad flag value, a model that is not cached, an address
that is taken or may not be opened without keys, a peer that does not answer). Each says what was
refused and what to do, in one line. The CLI prints such an error as `starsd: error: ...` and exits
2; anything else that escapes a command is a bug and keeps its traceback."""


class StarsdError(Exception):
    """A refusal: its message is meant for the person running starsd."""


class SettingError(StarsdError, ValueError):
    """A setting or an input that cannot be used (a flag's value, a prompt set's name, a file's content).
    A ValueError too, so code that validates values off the wire or over HTTP catches it as one."""


class Unavailable(StarsdError, RuntimeError):
    """Something outside the arguments refused: an address in use, a peer that does not answer, a
    child process that exited before it was ready."""
