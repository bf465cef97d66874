"""``--help`` that shows each option's default once, on every ``stree`` subcommand.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` even where the help text already says the
default (``(default: MODEL_DIR) (default: None)``) and shows nothing for options without help text. This formatter
appends the default only where the help does not say it, also to options without help, and leaves out defaults that
say nothing (None, False, an empty list, a flag's).
"""

from __future__ import annotations

import argparse
import copy


def shows_default(action: argparse.Action) -> bool:
    """Whether ``--help`` should state this action's default."""
    if not action.option_strings or action.nargs == 0:  # positionals, flags, --help
        return False
    default = action.default
    if default is None or default is False or default is argparse.SUPPRESS:
        return False
    return not (isinstance(default, (list, tuple, str)) and len(default) == 0)


def says_default(help_text: str | None) -> bool:
    return help_text is not None and ("(default" in help_text or "%(default)" in help_text)


class DefaultsOnceFormatter(argparse.HelpFormatter):
    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and shows_default(action):
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if says_default(text) or not shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def parsers_under(parser: argparse.ArgumentParser):
    """``parser`` and every subcommand parser below it, depth first."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases map to the same parser once
                yield from parsers_under(child)


def use_defaults_once(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and all its subcommands the ``DefaultsOnceFormatter``."""
    for p in parsers_under(parser):
        p.formatter_class = DefaultsOnceFormatter
