"""kvq plugin for the turboquant method (skeleton: the method lands with its own issue)."""


def kvq_register(register):
    """Entry point ``turboquant``: registers nothing yet."""
