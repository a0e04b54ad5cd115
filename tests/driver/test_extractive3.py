"""`pycompactor/extractive-3`: every line a true statement of one reply, with its subject.

The demo sample's two failures the article names (a NAV read as current, a dropped
instruction) and the fee lines that named no fund, then properties over any input and
over the whole evaluation corpus, then the frontier against whole-sentence selection,
then one real worker pass.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pycompactor.cli.evaluate import read_corpus
from pycompactor.cli.sample import sample_turns
from pycompactor.models import Pair
from pycompactor.quality import fidelity
from pycompactor.quality.qualifiers import sentences, statements, unwrap
from pycompactor.summarizers.baseline import select
from pycompactor.summarizers.extractive import MAX_SUMMARY_CHARS
from pycompactor.summarizers.extractive2 import extract
from pycompactor.summarizers.extractive3 import (
    DEFAULT_TARGET,
    EXTRACTIVE3_MODEL,
    Extractive3Summarizer,
    entry_term,
    subject,
    summarize_replies,
    telegraph,
)
from pycompactor.summarizers.openai_compatible import make_summarizer
from pycompactor.summarizers.outcomes import Reply
from tests.workerkit import complete_verdict

Conn = psycopg.Connection[Any]
ASCII_WS = " \t\n\r\f\v"
_WORDS = re.compile(r"\w+")
_LINE = re.compile(r"^([a-j])\) (.*)$")
# A reply that states nothing a summary keeps: the nine beside the one a test is about.
FILLER = "Ordinary entries follow here with nothing to add about them at all. " * 6


def size(text: str) -> int:
    return len(text.encode("utf-8"))


def sample_replies() -> list[str]:
    return [assistant for _, assistant in sample_turns()[:10]]


def lines_by_label(summary: str) -> dict[str, str]:
    found = {}
    for line in summary.split("\n"):
        match = _LINE.match(line)
        assert match, f"every line is labelled a)-j): {line!r}"
        found[match.group(1)] = match.group(2)
    return found


# --- the demo sample: what extractive-2 lost ---------------------------------------


def test_the_fee_lines_name_their_fund() -> None:
    replies = sample_replies()
    lines = lines_by_label(summarize_replies(replies))
    fee_lines = {label: text for label, text in lines.items() if "ongoing fee" in text}
    assert len(fee_lines) >= 5
    for label, text in fee_lines.items():
        fund = subject(replies["abcdefghij".index(label)])
        assert fund is not None
        assert fund in text, (fund, text)
    # extractive-2 wrote the same figures with no fund beside them.
    old = extract(replies).text
    assert any("ongoing fee" in s and not any(f in s for f in
               ("Northwind", "Harbor", "Lotus", "Cedar")) for s in sentences(old))


def test_the_nav_caveat_and_the_risk_instruction_survive() -> None:
    lines = lines_by_label(summarize_replies(sample_replies()))
    nav = lines["b"]
    assert "2026-10-09" in nav
    assert "10.37" in nav
    assert "Harbor Bond Index" in nav
    assert "not current NAV" in nav
    assert "will not infer default risk preference" in lines["a"]
    old = extract(sample_replies()).text
    assert "not current" not in old
    assert "risk preference" not in old


def test_a_caveat_is_kept_with_what_it_governs_for_every_fund() -> None:
    """Replies 1 and 6 give two funds' NAVs, each followed by the same words "it is not
    the current NAV": written once, the second NAV would read as current."""
    lines = lines_by_label(summarize_replies(sample_replies()))
    for label, fund in (("b", "Harbor Bond Index"), ("g", "Lotus Asia Growth")):
        assert f"On 2026-10-09 NAV of {fund} was" in lines[label]
        assert lines[label].endswith("it is not current NAV, which needs fresh quote.")
    replies = [f"Fund {name} had a NAV of {nav} on 2026-10-09. It is not the current NAV."
               for name, nav in zip("ABCDEFGHIJ", range(10, 20), strict=True)]
    summary = summarize_replies(replies, 0.2)
    for sentence in sentences(summary):
        if "not current NAV" in sentence:
            continue
        # Every NAV the summary states has its caveat right after it.
        assert summary.split(sentence, 1)[1].lstrip().startswith("It is not current NAV"), \
            sentence


def test_the_fund_of_a_the_fund_sentence_is_on_its_line() -> None:
    """"The fund's NAV on 2026-10-30 was 11.48." reads under the fund it belongs to."""
    lines = lines_by_label(summarize_replies(sample_replies()))
    assert "Fund's NAV on 2026-10-30 was 11.48." in lines["e"]
    assert lines["e"].startswith("Northwind Global Equity")


def test_a_correction_is_stated_as_one() -> None:
    replies = [f"Release {i} notes follow. It has ordinary fixes and nothing else." * 4
               for i in range(10)]
    replies[6] = ("Correction: I listed these entries under 15.17; that is incorrect. "
                  "They are from 15.16, not 15.17. " + replies[6])
    summary = summarize_replies(replies, 0.05)
    assert "Correction: I listed these entries under 15.17;" in summary
    assert "They are from 15.16, not 15.17." in summary


def test_a_figure_that_points_back_is_kept_with_the_fee_it_restates() -> None:
    """"Over a 5-year horizon that is about 1.25% in total" restates the fee before it:
    alone, 1.25% would be a figure of no fund's fee."""
    replies = [f"Fund {name} charges an ongoing fee of 0.2{i}% per year and no entry fee. "
               f"Over a 5-year horizon that is about 1.{i}0% in total before returns."
               for i, name in enumerate("ABCDEFGHIJ")]
    for target in (0.1, 0.2, 0.4):
        summary = summarize_replies(replies, target)
        for line in summary.split("\n"):
            if "horizon" in line:
                assert "ongoing fee of 0.2" in line, (target, line)


def test_a_parenthesis_that_points_back_is_kept_with_what_it_governs() -> None:
    """"(This consideration does not apply to non-B-tree indexes.)" alone denies what the
    reply never said: it limits the sentence before it."""
    first = "B-tree index pages that have become completely empty are reclaimed for re-use. "
    second = "(This consideration does not apply to non-B-tree indexes.)"
    replies = [FILLER + first + second] + [FILLER] * 9
    for target in (0.005, 0.02, 0.1, 0.4):
        summary = summarize_replies(replies, target)
        assert ("does not apply" in summary) == ("completely empty" in summary), (target, summary)
    assert "does not apply" in summarize_replies(replies, 0.4)


def test_a_sentence_with_an_abbreviation_in_parentheses_is_written_whole() -> None:
    """Split at "vs.", the reply's sentence leaves "POSIX) are treated slightly differently
    by systemd, so ... not removed ...", a caveat about nothing the line names."""
    ipc = ("- Different types of IPC objects (shared memory vs. semaphores, System V vs."
           " POSIX) are treated slightly differently by systemd, so one might observe that"
           " some IPC resources are not removed in the same way as others.")
    replies = [FILLER + "\n" + ipc] + [FILLER] * 9
    for target in (0.005, 0.02, 0.1, 0.4):
        summary = summarize_replies(replies, target)
        assert ("not removed" in summary) == ("Different types of IPC objects" in summary), \
            (target, summary)
    assert "(shared memory vs. semaphores, System V vs. POSIX)" in summarize_replies(replies, 0.4)


@pytest.mark.parametrize("second", [
    "but if the freed memory had been reused, the likely result would be garbage.",
    "see Section 9.6 for the 2 rules.",
    "for example 3 of them are rejected.",
])
def test_a_clause_after_a_semicolon_or_a_lowercase_start_is_never_written_alone(
        second: str) -> None:
    """The half of a statement the sentence split leaves after ";" (or a split that
    cut a sentence short) is written with the half before it, or not at all: "no
    visible ill effect" alone says the opposite of the reply."""
    first = "In production builds there would often be no visible ill effect; "
    replies = [FILLER + first + second] + [FILLER] * 9
    for target in (0.005, 0.02, 0.1, 0.4):
        summary = summarize_replies(replies, target)
        assert ("no visible ill effect" in summary) == (telegraph(second)[:12] in summary), \
            (target, summary)


@pytest.mark.parametrize(("first", "second"), [
    # the condition "Otherwise" negates is the sentence before
    ("Set hot_standby on the primary as well.",
     "Otherwise, queries will not be allowed on the standby."),
    ("If the option is given, the server binds to port 5433.",
     "In that case it never listens on 5432."),
    # the alternative an "Or" fragment continues
    ("The format is zip or tar, and tar is the default since 3.12.",
     "Or any other registered format, if none was given."),
    # the comparison "either" makes
    ("These actions would typically fail, which is why UPDATE skips them.",
     "MERGE should not run them either."),
    # an ordinal before the pointer
    ("The visibility map tracks which pages are all-visible.",
     "Second, it never needs the heap for such pages."),
])
def test_a_sentence_that_opens_by_depending_on_the_one_before_is_never_written_alone(
        first: str, second: str) -> None:
    """A sentence whose opening or close makes it the second half of the one before
    ("Otherwise, queries will not be allowed …" after an unrelated sentence reads as the
    condition the reply did not state) is written with it, or not at all."""
    replies = [f"{FILLER}{first} {second} {FILLER}"] + [FILLER] * 9
    for target in (0.01, 0.02, 0.05, 0.4):
        summary = summarize_replies(replies, target)
        assert (telegraph(second)[:16] in summary) <= (telegraph(first)[:16] in summary), \
            (target, summary)
    assert telegraph(second)[:16] in summarize_replies(replies, 0.4)


def test_a_sentence_wrapped_across_lines_is_written_whole() -> None:
    """A docstring wraps at 72 columns: "you may not use the Popen constructor's stdin
    argument" alone forbids what the reply forbids only "if you use this argument"."""
    wrapped = ("subprocess.run: Run command with arguments.\n\n"
               "If you use this argument\nyou may not use the Popen constructor's \"stdin\""
               " argument, as\nit will be used internally. By default, stdout and stderr"
               " are not captured, and those attributes\nwill be None.\n")
    for target in (0.1, 0.4, 1.0):
        summary = summarize_replies([wrapped] + [FILLER] * 9, target)
        assert "may not use" not in summary or "If you use this argument you may not use" \
            in summary, summary
        assert "not captured" not in summary or "those attributes will be None." in summary
    assert "not captured" in summarize_replies([wrapped] + [FILLER] * 9, 1.0)


def test_telegraph_keeps_an_article_inside_an_abbreviation() -> None:
    assert telegraph("Seconds since the Epoch, in UTC (a.k.a. GMT).") == \
        "Seconds since Epoch, in UTC (a.k.a. GMT)."


def test_subjects_where_a_reply_names_them() -> None:
    assert subject("PostgreSQL 15.2 was released on 2023-02-09; the entries:\n- x") == \
        "PostgreSQL 15.2"
    assert subject("From the PostgreSQL 15 documentation, Numeric Types:\n\n- y") == \
        "Numeric Types"
    assert subject("关于 alter_table，手册页是这样说的：\n・z") == "alter_table"
    assert subject("Lotus Asia Growth charges an ongoing fee of 0.29% per year.") == \
        "Lotus Asia Growth"
    assert subject("Understood: a 10-year horizon.") is None
    # Reference entries (man pages, docstrings): the term the entry defines.
    assert subject("UMask=: Controls the file mode creation mask.") == "UMask="
    assert subject("os.path.join: Join one or more path segments.") == "os.path.join"
    assert subject("-z, --gzip: Filter the archive through gzip.") == "-z, --gzip"
    assert subject("Note: the default is 10.") is None
    # A step number or a date is no subject: the reply may state other steps' or dates'.
    assert subject("Step 1: Install it; step 2 migrates.") is None
    assert subject("2026-10-09: the NAV was 10.37 USD.") is None
    # A lead longer than a term, read up to its colon outside brackets.
    assert subject("-U, --filter-any-user = USER (as: number or name): Display only"
                   " processes with a user id matching that given.") == \
        "-U, --filter-any-user"
    assert subject("\\pset [ option [ value ] ]: This command sets options.") == \
        "\\pset [ option [ value ] ]"
    assert subject("TIME -- CPU Time: Total CPU time the task has used.") == \
        "TIME -- CPU Time"
    assert subject("RuntimeDirectoryMode=, StateDirectoryMode=, CacheDirectoryMode=,"
                   " LogsDirectoryMode=: Specifies the access mode.") == \
        "RuntimeDirectoryMode=, StateDirectoryMode=, CacheDirectoryMode=, LogsDirectoryMode="
    # A man page's name and its description set apart by spaces: not "HOME The".
    assert subject("HOME   The home directory of the current user.") == "HOME"
    assert subject("CDPATH The search path for the cd command.") == "CDPATH"
    assert subject("-D        A list of all double-quoted strings is printed.") == "-D"
    assert subject("--ssl  (FTP IMAP POP3) Warning: this is an insecure option.") == "--ssl"
    assert subject("for name [ [ in [ word ... ] ] ; ] do list ; done: The list of words"
                   " following in is expanded.") == \
        "for name [ [ in [ word ... ] ] ; ] do list ; done"
    assert subject("Correction: I listed these under 15.17; that is incorrect.") is None
    assert subject("The [DHCPServer] section contains settings for the DHCP server, if"
                   " enabled via the DHCPServer= option described above: ServerAddress=:"
                   " Specifies server address.") == "ServerAddress="
    assert subject("Step 1 is done. Then-a: x") is None


def test_a_reply_s_later_line_is_written_under_the_option_its_lead_names() -> None:
    """Man-page entries that differ in their option ("-U" matches any user id, "-u" the
    effective one) each go on to say what "!" does: written without the option it
    belongs to, "display only processes with users not matching" reads as true of any
    option, or of the wrong one."""
    def entry(option: str, scope: str) -> str:
        return (f"{option} = USER (as: number or name): Display processes with a user id"
                f" or user name matching that given, {scope}.\n"
                "Prepending an exclamation point ('!') to the user id or name instructs top"
                f" to display only processes with users not matching the one provided, {scope}.")
    replies = [entry("-U, --filter-any-user", "any user"),
               entry("-u, --filter-only-euser", "effective user")] + [FILLER] * 8
    summary = summarize_replies(replies, 0.4)
    lines = {line[:2]: line for line in summary.splitlines()}
    assert "not matching" in lines["a)"], summary
    assert "not matching" in lines["b)"], summary
    assert lines["a)"].startswith("a) -U, --filter-any-user: Prepending"), summary
    assert lines["b)"].startswith("b) -u, --filter-only-euser"), summary
    # A lead the sentence split cut in two is named once, by its sentence.
    loop = ("for (( expr1 ; expr2 ; expr3 )) ; do list ; done: First, the arithmetic"
            " expression expr1 is evaluated; it may not be empty.")
    written = summarize_replies([loop] + [FILLER] * 9, 1.0)
    assert written.count("do list ; done") == 1, written


def test_an_option_s_sentences_are_written_under_that_option() -> None:
    """A man page lists options without colons ("-a, --append Add the user to the
    supplementary group(s). Use only with the -G option. -e, --expiredate EXPIRE_DATE
    The date on which …"): "Use only with -G option." under the command alone reads as
    true of every option, "Integers as input are interpreted as days" as true of -a."""
    reply = ("About usermod:\n\n- -a, --append Add the user to the supplementary group(s)."
             " Use only with the -G option. -e, --expiredate EXPIRE_DATE The date on which"
             " the user account will be disabled. Integers as input are interpreted as days"
             " after 1970-01-01. --no-config is not an option of usermod.")
    summary = summarize_replies([reply] + [FILLER] * 9, 0.5)
    assert "-a, --append: Use only with -G option." in summary, summary
    assert "-e, --expiredate: Integers as input" in summary, summary
    assert entry_term("--no-config is not an option of usermod.") is None


def test_a_line_names_its_subject_unless_its_sentence_names_it_as_a_word() -> None:
    """"PR" is not named by "priority", nor "MAIL" by "mail", nor "manpath" by
    "MANDATORY_MANPATH": such a line is written under its subject."""
    for reply, lead in (
            ("PR  --  Priority: The scheduling priority of the task.\nUnder linux, real"
             " time priority is not always preemptible.", "PR: Under linux"),
            ("MAIL   If this parameter is set to a file name, bash informs the user.\n"
             "The default is 60 seconds; mail is checked before each prompt.", "MAIL: Default"),
            ("PR  --  Priority: The scheduling priority.\nThe PR field is not always shown.",
             "PR field is not")):
        summary = summarize_replies([reply] + [FILLER] * 9, 0.4)
        assert summary.startswith(f"a) {lead}"), summary
    # … and is named by it in its telegraphic form ("The" dropped): not twice.
    reply = ("From the PostgreSQL 15 documentation, The Cumulative Statistics System:\n\n"
             "- The view will contain only one row.")
    summary = summarize_replies([reply] + [FILLER] * 9, 1.0)
    assert summary.count("Cumulative Statistics System") == 1, summary


def test_an_entry_that_opens_mid_line_names_the_sentences_after_it() -> None:
    """A man page's note runs into the next entry on one line ("… AF_UNIX sockets.
    ProtectSystem=: Takes a boolean … If true, mounts /usr/ read-only …"): "If true,
    mounts /usr/ read-only" is about ProtectSystem=, and reads so only under its name,
    as the measures read the line (their question's context is the entry)."""
    reply = ("Note that the various options that turn directories read-only do not affect"
             " the ability of programs to connect to AF_UNIX sockets. ProtectSystem=: Takes"
             " a boolean argument or the special values \"full\" or \"strict\". If true,"
             " mounts the /usr/ directory read-only for processes invoked by this unit.")
    for target in (0.2, 0.4, 1.0):
        summary = summarize_replies([reply] + [FILLER] * 9, target)
        assert "If true" in summary, (target, summary)
        line = summary.splitlines()[0]
        assert "ProtectSystem=:" in line[:line.index("If true")], (target, summary)


def test_a_reference_entry_s_default_reads_under_its_option() -> None:
    """A man page's "Defaults to 0022" answers nothing unless it says of which option."""
    replies = [f"Option{i}=: Takes a boolean. Defaults to {i}{i}22 for system units."
               for i in range(1, 10)]
    replies.insert(0, "UMask=: Controls the file mode creation mask. See umask for "
                      "details. Defaults to 0022 for system units.")
    summary = summarize_replies(replies, 0.9)
    assert summary.splitlines()[0] == "a) UMask=: Defaults to 0022 for system units."


def test_every_entry_s_figure_is_written_under_its_term() -> None:
    """A reply listing entries ("- vacuum_cost_page_miss (integer): … The default value is
    2.") gets each kept sentence under its entry's term, not four bare "Default value is
    N." lines under the chapter's name."""
    names = {"page_hit": "1", "page_miss": "2", "page_dirty": "20", "limit": "200"}
    reply = "Resource Consumption:\n\n" + "\n\n".join(
        f"- vacuum_cost_{name} (integer): The estimated cost charged for {name}. "
        f"The default value is {value}." for name, value in names.items())
    summary = summarize_replies([reply], 0.5)
    assert summary == ("a) Resource Consumption: " + " ".join(
        f"vacuum_cost_{name}: Default value is {value}." for name, value in names.items()))
    assert fidelity.attribution([reply], summary) == fidelity.Score(len(names), len(names))
    assert entry_term("vacuum_cost_limit (integer): The cost.") == "vacuum_cost_limit"
    assert entry_term("Understood: a 10-year horizon.") is None
    # An upper-case name is a term, an upper-case label is not; nor is a section's
    # introduction, whose first entry follows it.
    assert entry_term("HISTSIZE: The number of commands to remember.") == "HISTSIZE"
    assert entry_term("NOTE: this is read once.") is None
    assert entry_term("The [DHCPv4] section configures the DHCPv4 client, if it is enabled"
                      " with the DHCP= setting described above: SendHostname=: When true,"
                      " the hostname is sent.") == "SendHostname="


def test_a_caveat_about_the_entry_is_kept_under_its_term_on_its_own() -> None:
    """"This parameter can only be set at server start." is about the entry its line
    names, not about the sentence before it: kept alone, it is written under the term."""
    entry = ("- opt_x (integer): Sets the thing. Default is 5 units for most of the servers"
             " in any ordinary install of today. This parameter can only be set at server"
             " start.")
    replies = [entry] + [FILLER] * 9
    # Room for the caveat's line, not for the default's sentence with it.
    summary = summarize_replies(replies, 60 / sum(len(r) for r in replies))
    assert summary == "a) opt_x: This parameter can only be set at server start."


def test_a_sentence_several_entries_state_is_written_once_naming_them_all() -> None:
    """Three entries' "This parameter can only be set at server start." are three caveats
    about three options: one sentence naming the three keeps each, for the bytes of one
    sentence and three names, after the reply's other sentences."""
    names = ("max_connections", "shared_buffers", "wal_level")
    reply = "Server Settings:\n" + "\n".join(
        f"- {name} (integer): Sets the {name} of the server. Default is {i}0. This parameter "
        "can only be set at server start." for i, name in enumerate(names, 1))
    summary = summarize_replies([reply], 0.9)
    assert summary == (
        "a) Server Settings: max_connections: Default is 10. shared_buffers: Default is 20."
        " wal_level: Default is 30. max_connections, shared_buffers, wal_level: This"
        " parameter can only be set at server start.")
    assert fidelity.scores([reply], summary) == (fidelity.Score(3, 3), fidelity.Score(3, 3))
    # Written once per entry instead, the three copies would cost what a figure buys.
    assert summary.count("only be set") == 1


def test_a_chinese_sentence_that_ends_on_a_figure_ends_as_chinese() -> None:
    reply = "Cedar Dividend 的管理费为 0.36%，托管费为 0.05%。截至 2026-10-23，单位净值为 11.11。"
    replies = [reply, *["Nothing to add here."] * 9]
    summary = summarize_replies(replies, 0.9)
    assert summary == ("a) Cedar Dividend 的管理费为 0.36%，托管费为 0.05%。"
                       " 截至 2026-10-23，单位净值为 11.11。")
    assert fidelity.attribution(replies, summary) == fidelity.Score(4, 4)


def test_telegraph_restores_spacing_a_dropped_article_leaves() -> None:
    assert telegraph("-1 (the default) means no limit.") == "-1 (default) means no limit."
    assert telegraph("a “just in time” policy") == "“just in time” policy"


def test_telegraph_keeps_the_space_before_a_mark_that_opens_a_token() -> None:
    # A dot or a question mark that starts a file name, an operator or an accessor is no
    # sentence end: "without.NN", "-Tdvi./foo.1x.gz" and "jsonbcol?|" name nothing.
    assert telegraph("files (without the .NN suffix) go.") == "files (without .NN suffix) go."
    assert telegraph("Run groff -Tdvi ./foo.1x.gz now.") == "Run groff -Tdvi ./foo.1x.gz now."
    assert telegraph("It supports the .* and .** accessors.") == \
        "It supports .* and .** accessors."
    assert telegraph("Use jsonbcol ?| array['a'].") == "Use jsonbcol ?| array['a']."
    assert telegraph("It ends in the .log, then the .") == "It ends in .log, then."


def test_telegraph_keeps_the_spacing_the_reply_wrote() -> None:
    # Only the gap a dropped word leaves closes up; a space the reply put before a mark
    # is part of what it says ("::10.2.3.4" is an address, ",," an operator).
    assert telegraph("Addresses such as ::10.2.3.4 or ::ffff:10.4.3.2 are mapped.") == \
        "Addresses such as ::10.2.3.4 or ::ffff:10.4.3.2 are mapped."
    assert telegraph("The ^^ and ,, expansions convert each character.") == \
        "^^ and ,, expansions convert each character."
    assert telegraph("The value of the , option is 5 .") == "Value of, option is 5 ."
    # A word set in marks is a name, not an article.
    assert telegraph("All bits are used if *a* is a str.") == "All bits are used if *a* is str."
    assert telegraph("Pass `a` as the first argument.") == "Pass `a` as first argument."


def test_telegraph_drops_articles_and_keeps_every_qualifier_and_figure() -> None:
    assert telegraph("- However, the NAV is not the current one: 10.37 as of 2026-10-09.") \
        == "NAV is not current one: 10.37 as of 2026-10-09."
    assert telegraph("Fix incorrect NFC recomposition for Hangul U+11A7 (TBASE).") == \
        "Fix incorrect NFC recomposition for Hangul U+11A7 (TBASE)."
    assert telegraph("It is 10 a .5 wide") == "It is 10 .5 wide"


# --- properties -------------------------------------------------------------------------

_word = st.sampled_from(["the", "fund", "not", "no longer", "only", "a", "unlikely",
                         "NAV", "基金", "不再", "仅", "净值", "The fund's", "🙂", "é", "."])
_number = st.one_of(
    st.integers(0, 10**9).map(str),
    st.builds(lambda a, b: f"{a}.{b:02d}", st.integers(0, 999), st.integers(0, 99)),
    st.dates().map(lambda d: d.isoformat()),
)
_end = st.sampled_from([". ", "! ", "? ", "。", "！", "？", "\n", "; ", "\n- ", ": "])
_sentence = st.builds(lambda ws, e: " ".join(ws) + e,
                      st.lists(st.one_of(_word, _number), min_size=1, max_size=14), _end)
_reply = st.builds("".join, st.lists(_sentence, min_size=1, max_size=8))
_any_text = st.text(
    alphabet=st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=1, max_size=2000,
).filter(lambda t: bool(t.strip(ASCII_WS)))
_replies = st.lists(st.one_of(_reply, _any_text), min_size=10, max_size=10)


def from_one_sentence(replies: list[str], summary: str) -> None:
    """Every summary sentence's words, in order, are words of one sentence of the reply
    its line names (a sentence broken across lines read as one), after that reply's
    carried subject or the term of the reply's entry it comes from."""
    for label, text in lines_by_label(summary).items():
        reply = replies["abcdefghij".index(label)]
        topic = subject(reply)
        if topic and text.startswith(f"{topic}: "):
            text = text[len(topic) + 2:]
        sources = [_WORDS.findall(s.lower()) for s in statements(unwrap(reply))]
        # An entry opens a line or a sentence within one.
        terms = {entry_term(sentence) for line in unwrap(reply).splitlines()
                 for sentence in statements(_MARKER.sub("", line.strip()))}
        for piece in sentences(text):
            # An entry's term, or the terms of the entries that share the sentence.
            while term := next((t for t in terms if t and piece.startswith((f"{t}: ",
                                                                             f"{t}, "))), None):
                piece = piece[len(term) + 2:]
            words = _WORDS.findall(piece.lower())
            assert any(is_subsequence(words, source) for source in sources), piece


_MARKER = re.compile(r"^(?:[-*•]\s+|・\s*)")


def is_subsequence(words: list[str], source: list[str]) -> bool:
    it = iter(source)
    return all(any(w == s for s in it) for w in words)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_replies, st.one_of(st.just(DEFAULT_TARGET), st.floats(0.01, 1.0)))
def test_valid_deterministic_no_figure_invented_no_sentence_glued(
        replies: list[str], target: float) -> None:
    summary = summarize_replies(replies, target)
    assert summarize_replies(list(replies), target) == summary
    assert summary.strip(ASCII_WS)
    assert "\x00" not in summary
    assert len(summary) <= MAX_SUMMARY_CHARS
    assert not fidelity.invented(replies, summary)
    if "\n" in summary or _LINE.match(summary):
        assert size(summary) <= max(1, int(target * sum(size(r) for r in replies)))
        from_one_sentence(replies, summary)


@pytest.fixture(scope="module")
def corpus_ranges() -> list[list[str]]:
    ranges = []
    for conversation in read_corpus(seed=0):
        pairs = conversation.pairs
        for k in range(0, len(pairs) - 29, 10):
            ranges.append([p.assistant_content for p in pairs[k:k + 10]])
    return ranges


def test_every_corpus_line_is_one_reply_sentence_and_invents_nothing(
        corpus_ranges: list[list[str]]) -> None:
    took = []
    for replies in corpus_ranges:
        started = time.perf_counter()
        summary = summarize_replies(replies)
        took.append(time.perf_counter() - started)
        from_one_sentence(replies, summary)
        assert not fidelity.invented(replies, summary)
        assert len(summary) <= MAX_SUMMARY_CHARS
    # Generous against a loaded machine: the bench reports the real figure.
    assert statistics.median(took) < 0.25


def test_at_or_above_whole_sentence_selection_in_attribution(
        corpus_ranges: list[list[str]]) -> None:
    """The frontier (compression against attribution): at each target the bench tries,
    extractive-3 answers at least as many questions as naive whole-sentence selection in
    no more bytes, on every fourth corpus range."""
    sampled = corpus_ranges[::4]
    for target in (0.2, 0.3, 0.4):
        ours = theirs = 0
        our_bytes = their_bytes = 0
        for replies in sampled:
            mine, naive = summarize_replies(replies, target), select(replies, target)
            ours += fidelity.attribution(replies, mine).kept
            theirs += fidelity.attribution(replies, naive).kept
            our_bytes += size(mine)
            their_bytes += size(naive)
        assert ours >= theirs, (target, ours, theirs)
        assert our_bytes <= their_bytes * 1.01, (target, our_bytes, their_bytes)


# --- the summarizer in the worker's hands --------------------------------------------------


def test_made_by_its_model_id_and_target() -> None:
    summarizer = make_summarizer(EXTRACTIVE3_MODEL, extractive_target=0.2)
    assert isinstance(summarizer, Extractive3Summarizer)
    assert summarizer.model == EXTRACTIVE3_MODEL
    assert summarizer.target == 0.2
    with pytest.raises(ValueError, match="target"):
        Extractive3Summarizer(0.0)


def test_summarizer_returns_a_normal_stop(conn: Conn) -> None:
    pairs = [Pair(i, f"r{i}", f"u{i}", f"user {i}", f"a{i}", text)
             for i, text in enumerate(sample_replies())]
    outcome = Extractive3Summarizer().summarize(pairs)
    assert isinstance(outcome, Reply)
    assert outcome.finish_reason == "stop"
    assert outcome.tool_call_count == 0
    assert complete_verdict(conn, outcome) == "completed"
