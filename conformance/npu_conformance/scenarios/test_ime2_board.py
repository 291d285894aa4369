"""IME2 board scenarios: what QEMU cannot prove, answered by one run on a K3 (issue 15, section 2).

Each scenario runs hand-made inputs whose expected outputs differ between the possible answers
of one open question (:mod:`npu_conformance.ime2_board` describes every question and its cases),
then records which answer the run showed: a figure ``shows_<value>`` (1 for the value shown, 0
for the others) in the report, and an entry in the target's answers file in the report
directory (``ime2-board-answers.json`` on ``ime2-hw``, which ``npusim.q4x32`` reads through
``NPUSIM_Q4X32_ANSWERS`` or ``set_defaults_from_answers``; ``ime2-qemu-answers.json`` on
``ime2-qemu``).

* ``hp[<question>]`` (rounding, dot, overflow, subnormals, layout): single ``.hp`` words on whole
  register files. On ``ime2-hw`` the native probe ``npu_ime2_hp_probe --ai-cores`` (no emulator,
  fenced onto the A100 cores) runs them on the matrix unit; it must match one modelled value
  (and the spec's register layout, which the kernel relies on). On ``ime2-qemu`` the SIGILL
  emulator runs them, which shows the emulator's configured options: that proves the plumbing
  and that every question's cases tell its values apart.
* ``fork_op[<question>]`` (qweight_nibbles, m4, order): whole GEMMs through the opensolvers/vllm
  fork's ``torch.ops._C.ime2_hp_gemm_cpu`` where it is installed (a child process fenced as the
  seed does it); skipped with a one-line reason elsewhere.
* ``our_op[<question>]``: the same GEMMs through this project's op under QEMU, which must show
  its own choices (adjacent low-first nibbles, 4-row groups first, high nibble first).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HP_QUESTIONS = ("rounding", "dot", "overflow", "subnormals", "layout")
OP_QUESTIONS = ("qweight_nibbles", "m4", "order")
#: This project's kernel's answers to the op questions (its code: kernels/ime2/src).
OUR_CHOICES = {"qweight_nibbles": "adjacent_low_first", "m4": "grouped", "order": "hi_lo"}


def _question(name: str):
    from npu_conformance import ime2_board

    builders = {q.__name__.removesuffix("_question"): q for q in (
        ime2_board.rounding_question, ime2_board.dot_question, ime2_board.overflow_question,
        ime2_board.subnormals_question, ime2_board.layout_question, ime2_board.qweight_nibbles_question,
        ime2_board.m4_question, ime2_board.order_question)}
    return builders[name]()


def _report_dir(config: pytest.Config) -> Path:
    from npu_conformance.report import DEFAULT_REPORT_DIR

    out = config.getoption("npu_report", default=None)
    return Path(out) if out else config.rootpath / DEFAULT_REPORT_DIR


@pytest.fixture
def answer_book(request, target):
    """The answers file of this target in this run's report directory."""
    from npu_conformance import ime2_board

    return ime2_board.AnswerBook.for_target(_report_dir(request.config), target.name)


def _emulator_value(name: str) -> str:
    """What the SIGILL emulator is configured to show for ``name`` (its environment variables)."""
    import npusim.q4x32 as q
    from npu_conformance import qemu_ime2

    if name in qemu_ime2.EMU_ENV:
        return os.environ.get(qemu_ime2.EMU_ENV[name]) or q.OPTIONS[name][0]
    return {"subnormals": "keep", "layout": "spec"}[name]


def _record(record, answer_book, request, question, verdict) -> None:
    """Figures ``shows_<value>`` and the answers-file entry (under the report's scenario name)."""
    from npu_conformance.results import KEY_SCENARIO

    for value in question.values:
        record.figure(f"shows_{value}", int(verdict.value == value))
    scenario = dict(request.node.user_properties).get(KEY_SCENARIO, request.node.name)
    answer_book.record(question, verdict, scenario=str(scenario))


def _check_tells_apart(record, question, expected) -> None:
    """Figure ``separation`` (hp: outputs; op: max |diff| between two values' expectations)."""
    from npu_conformance import ime2_board

    sep = ime2_board.separation(question, expected)
    if sep != float("inf"):
        record.figure("separation", sep)
    assert sep > 0, f"{question.name}: the cases give the same output for two values (separation {sep})"


@pytest.mark.scenario(devices=("ime2",), name="hp")
@pytest.mark.parametrize("name", HP_QUESTIONS)
def test_hp_question(target, record, answer_book, request, name):
    from npu_conformance import ime2_board

    question = _question(name)
    expected = ime2_board.expectations(question)
    _check_tells_apart(record, question, expected)
    if target.name == "ime2-hw":
        missing = ime2_board.hp_probe_missing_reason()
        if missing:
            pytest.skip(f"{target.name}: {missing}")
        files = ime2_board.run_hp_native(question.cases)
    else:
        files = ime2_board.run_hp_qemu(question.cases)
    verdict = ime2_board.classify(question, ime2_board.outputs_of(question.cases, files), expected)
    _record(record, answer_book, request, question, verdict)
    if target.name == "ime2-qemu":
        assert verdict.value == _emulator_value(name), verdict.detail
    else:
        assert verdict.value is not None, f"the K3 shows none of the modelled values: {verdict.detail}"
        if name == "layout":
            assert verdict.value == "spec", f"the kernel relies on the spec's register layout: {verdict.detail}"


@pytest.mark.scenario(devices=("ime2",), name="fork_op")
@pytest.mark.parametrize("name", OP_QUESTIONS)
def test_fork_op_question(target, record, answer_book, request, tmp_path, name):
    from npu_conformance import ime2_board

    reason = ime2_board.fork_op_missing_reason()
    if reason:
        pytest.skip(reason)
    question = _question(name)
    expected = ime2_board.expectations(question)
    _check_tells_apart(record, question, expected)
    try:
        outputs = ime2_board.run_op_child("fork", question.cases, ai_cores=target.name == "ime2-hw",
                                          workdir=tmp_path)
    except ime2_board.ForkOpMissing as exc:
        pytest.skip(str(exc))
    verdict = ime2_board.classify(question, outputs, expected)
    _record(record, answer_book, request, question, verdict)
    assert verdict.value is not None, f"the fork's op shows none of the modelled values: {verdict.detail}"


@pytest.mark.scenario(devices=("ime2",), name="our_op")
@pytest.mark.parametrize("name", OP_QUESTIONS)
def test_our_op_question(target, record, answer_book, request, name):
    from npu_conformance import ime2_board

    if target.name != "ime2-qemu":
        pytest.skip(f"{target.name}: this project's op answers with its own code (run on ime2-qemu); "
                    f"the board's question is the fork's op (fork_op)")
    question = _question(name)
    expected = ime2_board.expectations(question)
    _check_tells_apart(record, question, expected)
    verdict = ime2_board.classify(question, ime2_board.run_op_qemu(question.cases), expected)
    _record(record, answer_book, request, question, verdict)
    assert verdict.value == OUR_CHOICES[name], verdict.detail
