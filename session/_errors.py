"""The one refusal of a setting: every check of what a person typed or chose raises it, with a message the app
shows as it is (and the command line prints after ``error:``)."""

from __future__ import annotations


class SettingsError(ValueError):
    """A setting the user typed that cannot be used; the message says why."""
