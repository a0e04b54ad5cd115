"""A 45-pair sample conversation of a fund-research assistant (used by `pycompactor demo`).

Fees, a corrected investment horizon, NAV figures from different dates, and some replies
in Chinese, so that byte counts differ from character counts. The first ten replies also
carry the long background explanations an assistant gives early in a conversation, so
the first range holds more than 6,000 characters and the demo shows a summary that is
shorter than its source (later replies are short: an extractive summary keeps them whole).
"""

from __future__ import annotations

from typing import Any

from pycompactor import store

CONVERSATION_ID = "demo-fund-research"

_FUNDS = ["Northwind Global Equity", "Harbor Bond Index", "Lotus Asia Growth", "Cedar Dividend"]
_NAV_DATES = ["2026-10-02", "2026-10-09", "2026-10-16", "2026-10-23", "2026-10-30"]

# Background without figures: the kind of text a summary may drop first.
_BACKGROUND_EN = (
    "Ongoing charges are taken from the fund's assets every day, so they never appear as a "
    "separate bill, but they reduce every return you see.",
    "Entry and exit fees matter less over long horizons, while ongoing charges compound "
    "against you for as long as you hold the fund.",
    "Index funds usually charge less than actively managed funds, because tracking an index "
    "needs no research team picking securities.",
    "A published net asset value is always the price of a particular valuation date and "
    "should be read together with that date.",
    "Comparing two funds is only fair when their figures come from the same date and the "
    "same share class.",
    "Drawdowns describe how far a fund fell from a previous peak, which matters more when "
    "you may need the money at a fixed point in time.",
    "Bond funds tend to move less than equity funds, but they are exposed to interest rate "
    "changes and to the credit quality of their issuers.",
    "None of this is a recommendation: it is background so that later comparisons read "
    "the same way for every fund.",
)
_BACKGROUND_ZH = (
    "持续费用每天从基金资产中扣除，因此不会单独出现在账单上，但会降低您看到的每一笔回报。"
    "长期持有时，申购费和赎回费的影响较小，而持续费用会在整个持有期内不断累积。"
    "指数基金的费用通常低于主动管理基金，因为跟踪指数不需要研究团队挑选证券。"
    "公布的单位净值总是对应某个估值日期，阅读时应当同时注意这个日期。"
    "只有在数据来自同一日期、同一份额类别时，比较两只基金才是公平的。"
    "以上内容仅为背景说明，并不构成投资建议。"
)


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


def _background(i: int) -> str:
    """A long explanation for the first ten replies (Chinese where the reply is)."""
    if i % 5 == 3:
        return _BACKGROUND_ZH
    n = len(_BACKGROUND_EN)
    return " ".join(_BACKGROUND_EN[(i + k) % n] for k in range(n))


def sample_turns(pairs: int = 45) -> list[tuple[str, str]]:
    turns = []
    for i in range(pairs):
        user, assistant = _turn(i)
        if i < 10:
            assistant = f"{assistant}\n\n{_background(i)}"
        turns.append((user, assistant))
    return turns


def load_sample(conn: Any, conversation_id: str = CONVERSATION_ID, pairs: int = 45) -> int:
    """Insert the sample into compaction_source (one run, user + assistant message per turn)."""
    with conn.transaction():
        store.ensure_conversation(conn, conversation_id)
        for i, (user, assistant) in enumerate(sample_turns(pairs)):
            run_id = f"{conversation_id}/run-{i:03d}"
            store.insert_run(conn, run_id, conversation_id, "completed")
            store.insert_messages(conn, [
                store.MessageRow(f"{run_id}/u", conversation_id, run_id, "user", "completed",
                                 user, 2 * i),
                store.MessageRow(f"{run_id}/a", conversation_id, run_id, "assistant",
                                 "completed", assistant, 2 * i + 1),
            ])
    return pairs
