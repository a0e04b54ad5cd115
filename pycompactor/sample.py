"""A 45-pair sample conversation of a fund-research assistant (used by `pycompactor demo`).

Fees, a corrected investment horizon, NAV figures from different dates, and some replies
in Chinese, so that byte counts differ from character counts.
"""

from __future__ import annotations

from typing import Any

CONVERSATION_ID = "demo-fund-research"

_FUNDS = ["Northwind Global Equity", "Harbor Bond Index", "Lotus Asia Growth", "Cedar Dividend"]
_NAV_DATES = ["2026-10-02", "2026-10-09", "2026-10-16", "2026-10-23", "2026-10-30"]


def _turn(i: int) -> tuple[str, str]:
    fund = _FUNDS[i % len(_FUNDS)]
    date = _NAV_DATES[i % len(_NAV_DATES)]
    nav = 10 + (i * 37 % 500) / 100
    fee = 0.15 + (i * 7 % 60) / 100
    if i == 0:
        return (
            "I want to invest for about 10 years. Please do not assume a risk preference for me.",
            "Understood: a 10-year horizon, and I will not infer a default risk preference. "
            "We can compare funds by fees, tracking and drawdowns first.",
        )
    if i == 12:
        return (
            "Correction: my horizon is 5 years, not 10.",
            "Noted: the investment horizon is now 5 years (corrected from 10 years). "
            "Shorter horizons make drawdown and bond allocation more important.",
        )
    if i % 5 == 3:
        return (
            f"{fund} 的费用是多少？",
            f"{fund} 的管理费为 {fee:.2f}%，托管费为 0.05%。截至 {date}，单位净值为 {nav:.2f}。"
            "请注意这是历史净值，不是当前净值。",
        )
    if i % 5 == 1:
        return (
            f"What is the NAV of {fund}?",
            f"On {date} the NAV of {fund} was {nav:.2f} USD. That figure is dated {date}; "
            "it is not the current NAV, which needs a fresh quote.",
        )
    return (
        f"How does {fund} compare on fees? (question {i})",
        f"{fund} charges an ongoing fee of {fee:.2f}% per year and no entry fee. "
        f"Over a 5-year horizon that is about {fee * 5:.2f}% in total before returns. "
        f"The fund's NAV on {date} was {nav:.2f}.",
    )


def sample_turns(pairs: int = 45) -> list[tuple[str, str]]:
    return [_turn(i) for i in range(pairs)]


def load_sample(conn: Any, conversation_id: str = CONVERSATION_ID, pairs: int = 45) -> int:
    """Insert the sample into compaction_source (one run, user + assistant message per turn)."""
    with conn.transaction(), conn.cursor() as cur:
        cur.execute(
            "INSERT INTO compaction_source.conversations (conversation_id) VALUES (%s)",
            (conversation_id,),
        )
        for i, (user, assistant) in enumerate(sample_turns(pairs)):
            run_id = f"{conversation_id}/run-{i:03d}"
            cur.execute(
                "INSERT INTO compaction_source.runs (run_id, conversation_id, status, created_at)"
                " VALUES (%s, %s, 'completed', now())",
                (run_id, conversation_id),
            )
            cur.executemany(
                "INSERT INTO compaction_source.messages"
                " (message_id, conversation_id, run_id, role, status, content, seq, created_at)"
                " VALUES (%s, %s, %s, %s, 'completed', %s, %s, now())",
                [
                    (f"{run_id}/u", conversation_id, run_id, "user", user, 2 * i),
                    (f"{run_id}/a", conversation_id, run_id, "assistant", assistant, 2 * i + 1),
                ],
            )
    return pairs
