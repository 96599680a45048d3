"""The error mechanism: a reason's record (`Reason`), the registry that finds a record by its
code, and the values every check returns (`problems`). The reasons themselves are the
packages' own (`converter.reasons.Code`, `adapter.reasons.AdapterCode`); a call site imports
its code from there and `problem`/`fatal` from here."""

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
from .registry import RECORDS, reason

__all__ = [
    "EXIT_BUG",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "RECORDS",
    "Fatal",
    "Message",
    "Problem",
    "Reason",
    "count_codes",
    "exit_code",
    "facts_of",
    "fatal",
    "message",
    "problem",
    "reason",
    "root_problems",
    "rules",
    "suppressed_codes",
    "template_names",
]
