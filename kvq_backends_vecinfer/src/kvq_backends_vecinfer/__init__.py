"""kvq plugin for the vecinfer method (skeleton: the method lands with its own issue)."""


def kvq_register(register):
    """Entry point ``vecinfer``: registers nothing yet."""
