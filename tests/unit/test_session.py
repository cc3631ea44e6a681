"""labkit.setup / quiet_known_warnings: exactly the known third-party messages are hidden, nothing else."""

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import labkit
from labkit import session

BNB = "bitsandbytes.backends.cpu.ops"
BNB_FORMAT = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. "
              "Please make sure you already `pip install kernels` and the kernels >= 0.11.1")  # bitsandbytes' call
TF = session.KNOWN_WARNINGS[0]


@pytest.fixture
def quiet_logs():
    """quiet_known_warnings() for the test; the logging filters it adds are removed afterwards."""
    before = {k.logger: list(logging.getLogger(k.logger).filters) for k in session.KNOWN_LOGS}
    yield
    for name, filters in before.items():
        logging.getLogger(name).filters[:] = filters


def warned(module, message, category):
    """What reaches the user when `module` warns `message` (a list of 0 or 1 warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        labkit.quiet_known_warnings()
        warnings.warn_explicit(message, category, "somefile.py", 1, module=module, registry={})
    return caught


def test_the_known_warning_is_hidden_and_everything_else_shows(quiet_logs):
    assert warned(TF.module, TF.message, TF.category) == []
    shown = [
        warned("labkit.something", TF.message, TF.category),  # same words, another module
        warned(TF.module, TF.message, DeprecationWarning),  # another category
        warned(TF.module, TF.message + " And more.", TF.category),  # a changed message
        warned(TF.module, "`other_thing` is deprecated and will be removed in v6.", TF.category),
        warned("__main__", "an unrelated warning", UserWarning),
    ]
    assert [len(c) for c in shown] == [1] * len(shown)


def test_the_filters_do_not_outlive_catch_warnings_and_are_added_once(quiet_logs):
    with warnings.catch_warnings():
        n = len(warnings.filters)
        labkit.quiet_known_warnings()
        labkit.quiet_known_warnings()
        assert len(warnings.filters) == n + len(session.KNOWN_WARNINGS)
    logger = logging.getLogger(BNB)
    assert sum(isinstance(f, session._HideKnownRecords) for f in logger.filters) == 1


UNTRUSTED = ("Kernel repository 'kernels-community/quantization-bitsandbytes' could not verify publisher trust "
             "status. Set trust_remote_code=True or add the repository ID to the trust_remote_code allowlist to "
             "allow loading kernels from untrusted sources.")


def test_the_known_log_record_is_hidden_and_everything_else_shows(quiet_logs, caplog):
    labkit.quiet_known_warnings()
    missing = ModuleNotFoundError("No module named 'kernels'", name="kernels")
    with caplog.at_level(logging.DEBUG):
        logging.getLogger(BNB).warning(BNB_FORMAT, missing)  # the known one
        logging.getLogger(BNB).warning(BNB_FORMAT, UNTRUSTED)  # the known one where `kernels` is installed
        logging.getLogger(BNB).warning(BNB_FORMAT, RuntimeError("hub unreachable"))  # the same call, another cause
        logging.getLogger(BNB).error(BNB_FORMAT, missing)  # another level
        logging.getLogger("bitsandbytes.cextension").warning(BNB_FORMAT, missing)  # another logger
        logging.getLogger(BNB).warning("something else went wrong")
    assert [(r.name, r.levelname, r.getMessage()[-40:]) for r in caplog.records] == [
        (BNB, "WARNING", (BNB_FORMAT % RuntimeError("hub unreachable"))[-40:]),
        (BNB, "ERROR", (BNB_FORMAT % missing)[-40:]),
        ("bitsandbytes.cextension", "WARNING", (BNB_FORMAT % missing)[-40:]),
        (BNB, "WARNING", "something else went wrong"),
    ]


def test_importing_bitsandbytes_after_setup_prints_no_known_message():
    """In a fresh interpreter: the message bitsandbytes logs on AVX512-BF16 CPUs stays hidden."""
    code = "import labkit; labkit.quiet_known_warnings(); import bitsandbytes"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "gemm_4bit_forward" not in run.stderr


def test_setup_returns_smoke_profile_device_and_kind(monkeypatch, quiet_logs):
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    monkeypatch.setenv("LABKIT_DEVICE", "cpu")
    with warnings.catch_warnings():
        smoke, profile, device, kind = labkit.setup()
    assert (smoke, profile.name, device, kind) == (True, "smoke", torch.device("cpu"), "cpu")
    monkeypatch.delenv("LABKIT_SMOKE")
    with warnings.catch_warnings():
        lesson = labkit.setup()
    assert lesson.smoke is False and lesson.profile.name == "cpu" and lesson.kind == "cpu"


def test_setup_measures_on_the_cpu_on_mps(monkeypatch, quiet_logs):
    import labkit.device

    monkeypatch.setattr(labkit.device, "pick_device", lambda prefer=None: torch.device("mps"))
    monkeypatch.setattr(labkit.device, "describe",
                        lambda device=None: labkit.device.DeviceInfo("mps", "Apple GPU", 16 << 30, True, False, None, 8))
    monkeypatch.delenv("LABKIT_SMOKE", raising=False)
    with warnings.catch_warnings():
        lesson = labkit.setup()
    assert lesson.device == torch.device("cpu") and lesson.kind == "cpu" and lesson.profile.name == "cpu"


def test_torchdata_set_vital_notice_is_hidden_where_torchdata_raises_it():
    """The real call (lesson 12's reference loader): torchdata's StatefulDataLoader calls torch.set_vital, which
    torch 2.13 answers with a warning; shown without the filter, hidden with it."""
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    def run(quiet: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if quiet:
                labkit.quiet_known_warnings()
            list(StatefulDataLoader(list(range(4)), batch_size=2))
        return [str(w.message) for w in caught if "set_vital" in str(w.message)]

    shown = run(quiet=False)
    if not shown:
        pytest.skip("this torch / torchdata pair does not warn about set_vital")
    assert shown == ["'set_vital' is deprecated, please do not call"]
    assert run(quiet=True) == []
