"""Stop strings are found wherever they fall, including across the text of two steps."""
from __future__ import annotations

import pytest

from llmtower.engine.stop_checker import StopChecker, StopMatch


def feed(checker: StopChecker, chunks: list[str]) -> tuple[str, StopMatch | None]:
    text = ""
    for chunk in chunks:
        text += chunk
        match = checker.check(text, len(chunk))
        if match:
            return text[:match.truncate_to], match
    return text, None


def test_stop_string_within_one_step():
    assert feed(StopChecker(["STOP"]), ["hello ", "xSTOPy"]) == ("hello x", StopMatch("STOP", 7))


def test_stop_string_straddling_steps():
    text, match = feed(StopChecker(["</answer>"]), ["42 </", "ans", "wer> trailing"])
    assert text == "42 " and match.stop == "</answer>"


def test_include_stop_str_in_output():
    text, match = feed(StopChecker(["END"], include_stop_str_in_output=True), ["ab E", "NDcd"])
    assert text == "ab END" and match.stop == "END"


def test_the_stop_string_that_ends_first_wins():
    # As if the text had come one character at a time: "o" is complete before "lo w".
    text, match = feed(StopChecker(["world", "lo w", "o"]), ["hel", "lo world"])
    assert (text, match.stop) == ("hell", "o")
    text, match = feed(StopChecker(["abc", "ab"]), ["xabc"])
    assert (text, match.stop) == ("x", "ab")
    # Ending together: the longer one (it starts first) cuts the text.
    text, match = feed(StopChecker(["bc", "abc"]), ["xabc"])
    assert (text, match.stop) == ("x", "abc")


def test_old_text_is_not_searched_again():
    checker = StopChecker(["ab"])
    # "ab" lies entirely in text checked before (when stop strings were not active yet).
    assert checker.check("ab" + "x" * 10, 3) is None


def test_no_stop_strings_means_no_holdback():
    checker = StopChecker([])
    assert checker.holdback == 0 and checker.check("anything", 8) is None
    assert StopChecker(["a", "abcd"]).holdback == 3


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError, match="empty string"):
        StopChecker(["ok", ""])
