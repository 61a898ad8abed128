"""Language-starvation detector (bnlit/checks/starvation.py): planted stalls caught, healthy runs pass."""

from bnlit.checks.starvation import starvation_message, starved_languages, trend


def test_stalled_language_is_starved_while_another_improves():
    history = {"bn": [9.0, 8.0, 7.9, 7.91, 7.92, 7.93], "en": [9.0, 7.0, 6.0, 5.5, 5.2, 5.0]}
    starved, trends = starved_languages(history, patience=3)
    assert starved == ["bn"]
    assert trends["en"].improved and not trends["bn"].improved
    msg = starvation_message("bn", trends, 3, step=300)
    assert "bn's held-out loss has not improved over the last 3 validations" in msg
    assert "en 6.000 -> 5.000" in msg and "callbacks.starvation.on_starved=warn" in msg


def test_healthy_runs_pass():
    both = {"bn": [9.0, 8.0, 7.5, 7.2, 7.0], "en": [9.0, 7.0, 6.0, 5.5, 5.2]}
    assert starved_languages(both, patience=2)[0] == []
    # both stalled (a learning-rate problem, not a mixture one): nobody is starved relative to another
    flat = {"bn": [9.0, 8.0, 8.0, 8.0], "en": [9.0, 7.0, 7.0, 7.1]}
    assert starved_languages(flat, patience=2)[0] == []
    # one language can never starve
    assert starved_languages({"bn": [9.0, 9.0, 9.0, 9.0]}, patience=2)[0] == []
    # too short a history: no verdict yet
    assert starved_languages({"bn": [9.0, 9.0], "en": [9.0, 8.0]}, patience=2) == ([], {})


def test_min_delta_ignores_noise():
    history = {"bn": [9.0, 8.0, 7.999], "en": [9.0, 8.0, 7.0]}
    assert starved_languages(history, patience=1, min_delta=0.0)[0] == []
    assert starved_languages(history, patience=1, min_delta=0.01)[0] == ["bn"]
    t = trend([4.0, 3.0, 2.0], patience=1, min_delta=0.0)
    assert (t.best_before, t.best_recent, t.first, t.last) == (3.0, 2.0, 4.0, 2.0)
    assert abs(t.relative_change - 1 / 3) < 1e-12
