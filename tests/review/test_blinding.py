"""The instruction a rater reads says nothing of the round, and what is left is measured: the issue's phrases are
dropped, and the classifier finds a leak where there is one and none where there is none."""

import random

import pytest

from medbanana.review.blinding import LEAKAGE_WARNING, blind_instruction, leakage_warning, round_leakage

LEAKS = ["This time make the opacity larger.", "Round 3: Add a small effusion.", "Try again with softer margins.",
         "The judge said the lesion was too faint.", "Unlike the previous attempt, keep the ribs.",
         "Compared with the last round, reduce the contrast.", "The lesion is still visible; remove it completely.",
         "Revised instruction: Add an effusion.", "Based on the feedback, blend the border."]


@pytest.mark.parametrize("leak", LEAKS)
def test_sentences_about_history_never_reach_the_rater(leak):
    shown = blind_instruction(f"Add a small effusion at the right base. {leak} Keep everything else unchanged.")
    for word in ("time", "Round", "again", "judge", "previous", "last", "still", "Revised", "feedback"):
        assert word not in shown, (leak, shown)
    assert shown.startswith("Add a small effusion at the right base.") and shown.endswith("unchanged.")


def test_the_leak_classifier_sees_a_leak_and_no_leak():
    rng = random.Random(0)
    body = ["Add a small effusion.", "Add a faint opacity in the left lung.", "Remove the nodule.",
            "Add edema with soft margins.", "Remove the lesion completely."]
    texts, rounds, groups = [], [], []
    for n in range(60):
        later = n % 2 == 1
        texts.append(rng.choice(body) + (" Make it larger this time." if later else ""))
        rounds.append(2 if later else 1)
        groups.append(f"source-{n // 2}")
    leaky, how = round_leakage(texts, rounds, groups)
    assert leaky > 0.9 and "grouped by source" in how and leakage_warning(leaky)
    blind, _ = round_leakage([blind_instruction(t) for t in texts], rounds, groups)
    assert blind <= LEAKAGE_WARNING and not leakage_warning(blind)
    assert round_leakage(texts[:3], rounds[:3], groups[:3])[0] is None  # too few of each round to measure
