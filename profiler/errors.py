"""InputError, in a module below every other (spec.py's parsers, the GPU table, the store raise it) so that none of
them need import another for it."""


class InputError(ValueError):
    """Bad input from the user: the CLI prints the message as one line and exits with code 2."""
