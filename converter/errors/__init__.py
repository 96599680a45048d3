"""Reasons and problems: each reason one record (`reasons_*`), `Code` built from them, and
the values every check returns (`problems`). Import from here: `from .errors import Code,
fatal, problem`."""

from ..text import Size, human_size, plural, repair_command
from .codes import CONSEQUENCES, RECORDS, Code, reason
from .problems import (
    Fatal,
    Problem,
    count_codes,
    exit_code,
    facts_of,
    fatal,
    message,
    problem,
    root_problems,
    rules,
    suppressed_codes,
    template_names,
)
from .reason import (
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_PROBLEMS,
    EXIT_TERMINATED,
    EXIT_USAGE,
    Message,
    Reason,
)

__all__ = [
    "CONSEQUENCES",
    "EXIT_BUG",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "RECORDS",
    "Code",
    "Fatal",
    "Message",
    "Problem",
    "Reason",
    "Size",
    "count_codes",
    "exit_code",
    "facts_of",
    "fatal",
    "human_size",
    "message",
    "plural",
    "problem",
    "reason",
    "repair_command",
    "root_problems",
    "rules",
    "suppressed_codes",
    "template_names",
]
