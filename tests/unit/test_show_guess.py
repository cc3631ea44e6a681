"""show_guess: guess, prediction and measurement side by side; never raises on a missing or bad guess."""

from labkit.exercises import show_guess


def test_no_guess_says_so_and_shows_the_prediction(capsys):
    assert show_guess("peak", None, 3 * 2**30, unit=2**30, unit_name="GiB") is False
    out = capsys.readouterr().out
    assert "prediction 3 GiB" in out and "did not write a guess" in out


def test_a_close_guess_and_a_far_one(capsys):
    assert show_guess("peak", 3.3, 3 * 2**30, 2.9 * 2**30, unit=2**30, unit_name="GiB") is True
    out = capsys.readouterr().out
    assert "measurement 2.9 GiB" in out and "within 20 %" in out
    assert show_guess("peak", 12, 3 * 2**30, unit=2**30, unit_name="GiB") is True
    assert "4x the prediction" in capsys.readouterr().out and True
    show_guess("share", 0.1, 0.25)
    assert "under-counted" in capsys.readouterr().out


def test_a_guess_that_is_not_a_number(capsys):
    assert show_guess("peak", "three", 3.0) is False
    assert "expected a number" in capsys.readouterr().out
