"""Every reason code of both packages, for tests that hold a rule over all of them."""

from kimi_w31.adapter.reasons import AdapterCode
from kimi_w31.converter.reasons import Code

ALL_CODES = (*Code, *AdapterCode)


def implied(code) -> set:
    """The members that follow from `code` (its record's `implies`), by value."""
    from kimi_w31.converter.errors import reason

    by_value = {c.value: c for c in ALL_CODES}
    return {by_value[v] for v in reason(code).implies}
