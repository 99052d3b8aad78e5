"""What the command lines (``python -m cpsparse``, ``python -m cpsparse.bench``) share."""

import re

import cpsparse

_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)(?:\s*<[^>]*>)?`")


def plain_text(doc):
    """A module docstring as plain text for ``--help`` (no reST markup).

    Roles such as ``:func:`cpsparse.topk_per_row``` keep their target, ``~``
    targets their last name; double backquotes become single quotes.

    Examples
    --------
    >>> from cpsparse._cli import plain_text
    >>> plain_text("calls :func:`cpsparse.topk_per_row` and :class:`~cpsparse.mtp.MTPDrafter`")
    'calls cpsparse.topk_per_row and MTPDrafter'
    >>> plain_text("run ``python -m cpsparse``")
    "run 'python -m cpsparse'"
    """
    def role(match):
        tilde, target = match.group(1), match.group(2).strip()
        return target.rsplit(".", 1)[-1] if tilde else target
    text = _ROLE.sub(role, doc)
    return re.sub(r"``(.+?)``", r"'\1'", text, flags=re.S).strip()


def add_version(parser):
    """Add ``--version`` (prints ``cpsparse X.Y.Z`` and exits) to an argparse parser.

    Examples
    --------
    >>> import argparse
    >>> from cpsparse._cli import add_version
    >>> add_version(argparse.ArgumentParser()).version.startswith("cpsparse ")
    True
    """
    return parser.add_argument("--version", action="version",
                               version=f"cpsparse {cpsparse.__version__}")
