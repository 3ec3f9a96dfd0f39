"""kvq plugin for the qjl method (skeleton: the method lands with its own issue)."""


def kvq_register(register):
    """Entry point ``qjl``: registers nothing yet."""
