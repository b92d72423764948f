"""The base of every error a user can act on (a missing model, a refused pair, a draft server that
said no). The CLI prints such an error's message without a traceback; anything else is a bug."""


class StarsdError(Exception):
    """An error with a message meant for the person running starsd."""
