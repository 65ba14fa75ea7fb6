"""The two kinds of error a command reports to the user as one line.

Anything raised as a LowbitError is the user's to fix (bad path, bad option, corrupt file);
the CLI prints its message alone and exits with its code. Other exceptions are bugs.
"""


class LowbitError(Exception):
    """A failure the user can act on; printed as one line, exit code 1."""

    exit_code = 1


class UsageError(LowbitError):
    """A bad command line or option combination; exit code 2."""

    exit_code = 2
