"""`UserError`: the one base class of every error a user can cause and fix.

A bad flag, a file that is not there, a config that cannot run, a checkpoint
of the wrong shape: each module raises its own subclass (`DataError`,
`ConfigError`, `CheckpointError`, ...), each with a one-line message that
says what to do, and each also derives from the built-in type a caller would
expect (ValueError, OSError, RuntimeError), so `except ValueError` in user
code keeps working. A command catches `UserError` and nothing else
(`cli.reported`): an error of any other type is a bug and keeps its traceback.
This module imports nothing, so every layer can use it.
"""


class UserError(Exception):
  """An error raised on purpose, with a one-line message saying what to do."""
