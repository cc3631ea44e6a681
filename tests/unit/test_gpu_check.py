"""bench/gpu_check.py (make gpu-check) on CPU: the plan and its time budget, the random configurations, the
allocator terms, the report's format, and the dry run itself (every CUDA step a recorded skip). The CUDA steps'
runner is replaced by a test double here (`fake_run`): its outcomes are made up to drive the bookkeeping, they are
not results. No wall-clock number is asserted: only the plan's arithmetic on the recorded lesson times."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gc():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lesson_times():
    return json.loads((ROOT / "data" / "lesson_times.json").read_text())


def test_lesson_phase_packs_longest_first(gc):
    assert gc.lesson_phase_s([10, 10, 10, 10], 2) == 20
    assert gc.lesson_phase_s([30, 10, 10, 10], 2) == 30
    assert gc.lesson_phase_s([5, 4, 3], 1) == 12
    with pytest.raises(ValueError, match="workers"):
        gc.lesson_phase_s([1], 0)


@pytest.mark.parametrize("profile", ["small-gpu", "big-gpu"])
def test_plan_fits_the_budget_at_each_gpu_profile(gc, lesson_times, profile):
    plan = gc.make_plan(profile, lesson_times)
    check = gc.check_plan(plan)
    lessons = plan.lessons()
    assert len(lessons) == len(lesson_times["lessons"]) and all(s.limit_s == plan.lesson_limit_s for s in lessons)
    assert {s.name for s in plan.fixed()} == {name for name, *_ in gc.FIXED}
    # worst case: every fixed step at its limit, the lessons in rounds of `workers` at the per-lesson limit
    rounds = -(-len(lessons) // plan.workers)
    worst = sum(s.limit_s for s in plan.fixed()) + rounds * plan.lesson_limit_s + gc.MARGIN_S
    assert check["worst_case_s"] == pytest.approx(worst) and worst <= gc.BUDGET_S and check["fits"]
    assert check["expected_s"] <= check["worst_case_s"]
    assert check["likely_cut"] == [s.name for s in plan.steps if s.estimate_s > s.limit_s]


def test_a_budget_without_room_for_lessons_is_refused(gc, lesson_times):
    with pytest.raises(ValueError, match="no time left for the lessons"):
        gc.make_plan("big-gpu", lesson_times, budget_s=200)
    with pytest.raises(ValueError, match="profile"):
        gc.make_plan("cpu", lesson_times)


def test_estimates_name_their_basis(gc):
    entry = {"notebook": "x.ipynb", "cpu": {"seconds": 50.0}, "big-gpu": {"seconds": 12.5, "finished": True,
                                                                           "machine": {"gpu": "FIXTURE GPU"}}}
    assert gc.lesson_estimate(entry, "big-gpu") == (12.5, "measured at big-gpu (FIXTURE GPU)")
    secs, basis = gc.lesson_estimate(entry, "small-gpu")
    assert secs == 50.0 and basis.startswith("stand-in: the cpu profile")
    assert gc.lesson_estimate({}, "small-gpu")[1].startswith("allotment")
    # a previous real run's seconds replace the allotment (a fixture report, not a measurement)
    fixture = {"dry_run": False, "device": {"name": "FIXTURE GPU"},
               "steps": [{"name": "estimator", "status": "passed", "seconds": 33.0}]}
    est = gc.step_estimates(fixture)
    assert est["estimator"] == (33.0, "measured by gpu_check on FIXTURE GPU")
    assert est["budgets"][1].startswith("allotment")
    assert gc.step_estimates(dict(fixture, dry_run=True))["estimator"][1].startswith("allotment")
    fixture["steps"].append({"name": "lesson 07", "status": "timeout", "seconds": 37.0})
    assert gc.step_estimates(fixture)["lesson 07"] == (37.0, "lower bound: cut at its limit by gpu_check on FIXTURE GPU")
    plan = gc.make_plan("big-gpu", {"lessons": {"07": {"notebook": "07_x.ipynb", "cpu": {"seconds": 5.0}}}}, fixture)
    assert plan.lessons()[0].estimate_s == 37.0


def test_random_configurations_are_reproducible_and_valid(gc):
    from labkit.estimate import Recipe
    from labkit.models.gpt import GPTConfig

    a, b = gc.draw_configs(gc.MIN_CONFIGS, seed=3), gc.draw_configs(gc.MIN_CONFIGS, seed=3)
    assert a == b and len(a) >= 20 and a != gc.draw_configs(gc.MIN_CONFIGS, seed=4)
    for c in a:
        model = GPTConfig(**c["model"]) if isinstance(c["model"], dict) else c["model"]
        Recipe.of(model, c["batch"], c["seq"], dtype=c["dtype"], optimizer=c["optimizer"], checkpoint=c["checkpoint"],
                  device="cuda")  # raises on an invalid combination
    assert len({c["dtype"] for c in a}) > 1 and len({c["optimizer"] for c in a}) > 1
    assert all(c["model"]["n_embd"] <= 768 for c in gc.draw_configs(50, big=False) if isinstance(c["model"], dict))
    assert {c["dtype"] for c in gc.draw_configs(50, bf16=False)} <= {"fp32", "mixed-fp16", "fp16"}
    with pytest.raises(ValueError):
        gc.draw_configs(0)


def test_allocator_terms_add_up(gc):
    t = gc.allocator_terms(10_000, 1_536, 8 * 2**20)
    assert t["predicted"] == 10_000 + 1_536 + 8 * 2**20 == sum(t["terms"].values())
    assert "rounding to 512 B blocks" in t["terms"]


def test_pytest_tail_is_parsed(gc):
    tail = "FAILED tests/gpu/test_x.py::test_a - assert 1 == 2\n===== 1 failed, 12 passed, 3 skipped in 4.2s ====="
    got = gc.parse_pytest_tail(tail)
    assert got["counts"] == {"failed": 1, "passed": 12, "skipped": 3}
    assert got["failed"] == ["FAILED tests/gpu/test_x.py::test_a - assert 1 == 2"]
    cut = ("tests/gpu/test_x.py::test_a PASSED [ 10%]\ntests/gpu/test_x.py::test_b FAILED [ 20%]\n"
           "tests/gpu/test_x.py::test_c SKIPPED (needs two GPUs) [ 30%]\n")  # stopped before its last line
    got = gc.parse_pytest_tail(cut)
    assert got["counts"] == {"passed": 1, "failed": 1, "skipped": 1} and got["failed"] == [
        "tests/gpu/test_x.py::test_b FAILED [ 20%]"]
    nbval = "notebooks/01_x.ipynb::Cell 0 PASSED [  3%]\nnotebooks/01_x.ipynb::Cell 1 PASSED [  6%]\n"
    assert gc.parse_pytest_tail(nbval)["counts"] == {"passed": 2}


def fake_run(gc):
    """A TEST DOUBLE for the CUDA runner: made-up outcomes that drive the bookkeeping, not measurements."""
    def run(step):
        if step.name == "estimator":
            return gc.step_result(step, "failed", 1.0, {"configurations": 20}, ["#3: fake failure"])
        if step.name == "nccl":
            raise RuntimeError("fake runner crash")
        if step.name == "lesson 05":
            return gc.step_result(step, "timeout", step.limit_s, failures=["fake cut"])
        return gc.step_result(step, "passed", 1.0, {"fake": True})
    return run


def test_execute_never_stops_at_a_failure(gc, lesson_times):
    plan = gc.make_plan("big-gpu", lesson_times)
    results = gc.execute(plan, run=fake_run(gc))
    assert [r["name"] for r in results] == [s.name for s in plan.steps]
    status = {r["name"]: r["status"] for r in results}
    assert status["estimator"] == "failed" and status["nccl"] == "failed" and status["lesson 05"] == "timeout"
    assert status["fp8"] == "passed" and status["lesson 13"] == "passed"  # steps after the failures still ran
    crash = next(r for r in results if r["name"] == "nccl")
    assert "fake runner crash" in crash["failures"][0]
    rep = gc.check_report(gc.build_report({"name": "FIXTURE"}, {"torch": "x"}, [gc.check_plan(plan)], results,
                                          dry_run=False))
    assert rep["failed"] == ["estimator", "nccl", "lesson 05"] and rep["counts"]["timeout"] == 1
    md = gc.summary_markdown(rep)
    assert "FAILURE: #3: fake failure" in md and all(f"| {s.name} |" in md for s in plan.steps)


def test_report_format_is_checked(gc, lesson_times):
    plan = gc.make_plan("small-gpu", lesson_times)
    results = gc.execute(plan, skip="dry run: no CUDA device")
    rep = gc.build_report({"kind": "cpu"}, {}, [gc.check_plan(plan)], results, dry_run=True)
    gc.check_report(rep)
    bad = json.loads(json.dumps(rep))
    bad["steps"][1]["reason"] = ""
    with pytest.raises(ValueError, match="skipped without a reason"):
        gc.check_report(bad)
    with pytest.raises(ValueError, match="lacks 'plans'"):
        gc.check_report({k: v for k, v in rep.items() if k != "plans"})
    with pytest.raises(ValueError, match="status"):
        gc.step_result(plan.steps[0], "fine")


def test_dry_run_writes_the_report_and_exits_0(gc, tmp_path, capsys):
    """What `make gpu-check` does on a machine without CUDA (and `--dry-run` anywhere): the CI hook."""
    assert gc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    rep = gc.check_report(json.loads((tmp_path / "report.json").read_text()))
    assert rep["dry_run"] and {p["profile"] for p in rep["plans"]} == set(gc.GPU_PROFILES)
    assert all(p["fits"] for p in rep["plans"])
    for r in rep["steps"]:
        assert r["status"] == ("passed" if r["name"] == "device" else "skipped"), r
    text = (tmp_path / "summary.md").read_text()
    assert text.startswith("# gpu-check: dry run") and "| lesson 00 | skipped |" in text
    assert "fits" in capsys.readouterr().out


def test_run_limited_stops_a_command_at_its_limit(gc):
    rc, _, _ = gc.run_limited(["python3", "-c", "import time; time.sleep(60)"], 0.5)
    assert rc is None
    rc, _, tail = gc.run_limited(["python3", "-c", "print('done')"], 30)
    assert rc == 0 and "done" in tail


def test_the_tests_gpu_runner_reports_pytest_counts(gc, lesson_times):
    """The real tests-gpu runner, here where every GPU test skips: a pass with the skip count, no failure."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA this would run the whole GPU tier")
    step = next(s for s in gc.make_plan("small-gpu", lesson_times).fixed() if s.name == "tests-gpu")
    r = gc.run_tests_gpu(step)
    assert r["status"] == "passed" and r["failures"] == [], r
    assert r["figures"]["pytest"]["skipped"] >= 13 and "passed" not in r["figures"]["pytest"]
    files = gc.gpu_test_files()
    assert files[-1] == "tests/gpu/test_cuda_memory.py" and len(files) == len(list((ROOT / "tests/gpu").glob("test_*.py")))


# Every lesson cell that branches on CUDA -> the GPU tests that run its CUDA branch (file::test), or why none is
# needed. A new CUDA-only cell fails test_every_cuda_only_cell_has_a_gpu_test until it is listed here with a test.
LESSON_CELL_TESTS = {
    ("01", "cell-25"): ["test_cuda_memory.py::test_real_budget_out_of_memory_is_a_result"],
    ("01", "cell-27"): ["test_lesson_cells_gpu.py::test_lesson01_allocator_view"],
    ("01", "cell-34-allocator-code"): [
        "test_lesson_cells_gpu.py::test_lesson01_allocator_recording_is_measured_in_a_fresh_process"],
    ("02", "cell-30"): ["test_fp8_gpu.py::test_scaled_mm_matches_emulation",
                        "test_fp8_gpu.py::test_fp8_linear_real_and_emulated_agree"],
    ("03", "cell-19"): ["test_lesson_cells_gpu.py::test_lesson03_offload_on_a_side_stream_keeps_the_gradients"],
    ("04", "cell-13"): ["test_lesson_cells_gpu.py::test_lesson04_accumulation_under_a_real_budget"],
    ("05", "cell-28"): ["test_lesson_cells_gpu.py::test_lesson05_ledger_and_allocator_agree_per_optimizer"],
    ("07", "738dfcd6"): ["test_lesson_cells_gpu.py::test_lesson07_bitsandbytes_linear4bit_on_cuda"],
    ("08", "2ebefe53"): ["test_lesson_cells_gpu.py::test_lesson08_bitsandbytes_paging_under_a_cap"],
    ("08", "05c46f24"): ["test_cuda_memory.py::test_peft_estimate_within_5_percent_of_max_memory_allocated"],
    ("12", "cell-34"): ["test_cnn_allocator.py::test_allocator_reserves_at_least_the_peak"],
    ("13", "4138e6cc"): "not CUDA-only: the guard only adds use_cpu=True on a CPU; the export runs the same on both",
}
CUDA_GUARD = r'^(if|elif) .*(KIND [!=]= "cuda"|torch\.cuda\.is_available\(\)|fp8_gemm_available)'


def test_every_cuda_only_cell_has_a_gpu_test():
    import re

    found = set()
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code" and re.search(CUDA_GUARD, "".join(cell["source"]), re.M):
                found.add((nb.name[:2], cell["id"]))
    assert found == set(LESSON_CELL_TESTS), (found - set(LESSON_CELL_TESTS), set(LESSON_CELL_TESTS) - found)
    for tests in LESSON_CELL_TESTS.values():
        for t in ([] if isinstance(tests, str) else tests):
            file, name = t.split("::")
            text = (ROOT / "tests" / "gpu" / file).read_text()
            assert f"def {name}(" in text and "pytest.mark.gpu" in text, t


def test_no_gpu_test_asserts_a_wall_clock_number():
    for f in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        text = f.read_text()
        for clock in ("perf_counter", "time.time(", "time.monotonic", "elapsed_time", "enable_timing"):
            assert clock not in text, f"{f.name} reads a clock ({clock}): GPU tests assert results, not times"


def test_the_device_is_read_in_a_child_process(gc):
    """A real run reads the device in a child, so the parent never starts CUDA (its context would sit in the
    measurements); here the child's answer equals this process's."""
    assert gc.device_and_versions_in_child() == gc.device_and_versions()
