"""The K3 board questions (``npu_conformance.ime2_board``) and their scenarios (issue 15, section 2).

The board run can only answer a question if its hand-made cases give different outputs for
different answers. Checked here without a board:

* every question's cases tell all its values apart, and an instruction question's expectation
  does not depend on the options it is not about;
* the register-layout model's ``spec`` is ``npusim.q4x32.execute_hp``;
* under QEMU the SIGILL emulator, switched to each option value, is classified as that value
  (so the cases distinguish the values on a running instruction, not only in numpy);
* this project's op, through the child process the fork's op also uses, shows its own choices;
* the answers file merges answers and ``npusim.q4x32`` reads it back;
* where the fork's op is not installed the reason says so in one line, and on ``ime2-hw`` every
  board scenario exists and skips with a one-line reason.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import numpy as np
import pytest

import npusim.q4x32 as q
from npu_conformance import ime2_board, qemu_ime2

HP = ime2_board.hp_questions()
OPS = ime2_board.op_questions()
ALL = HP + OPS


def _qemu_missing() -> str | None:
    reason = qemu_ime2.missing_reason()
    if reason is None and not qemu_ime2.probe_path().is_file():
        reason = f"the emulator probe {qemu_ime2.probe_path()} is not built: {qemu_ime2.BUILD_COMMAND}"
    return reason


needs_qemu = pytest.mark.skipif(_qemu_missing() is not None, reason=_qemu_missing() or "")


@pytest.mark.parametrize("question", ALL, ids=lambda x: x.name)
def test_cases_tell_every_pair_of_values_apart(question):
    expected = ime2_board.expectations(question)
    assert ime2_board.separation(question, expected) > 0
    for value in question.values:  # the model's own output is classified as its value
        verdict = ime2_board.classify(question, expected[value][0], expected)
        assert verdict.value == value, verdict.detail


@pytest.mark.parametrize("question", HP, ids=lambda x: x.name)
def test_hp_answers_do_not_depend_on_the_other_options(question):
    for value, alternatives in ime2_board.expectations(question).items():
        for alt in alternatives[1:]:
            np.testing.assert_array_equal(alt, alternatives[0], err_msg=f"{question.name}={value}")


def test_layout_cases_hold_one_non_zero_element_per_operand():
    for case in ime2_board.layout_question().cases:
        insn = q.decode_hp(case.word)
        assert np.count_nonzero(case.regs[insn.vs1]) == 1 and np.count_nonzero(case.regs[insn.vs2]) == 1


def test_layout_spec_is_execute_hp():
    rng = np.random.default_rng(7)
    for sgn in ("u", "us", "su", "ss"):
        for imm3, vscale in ((0, 0), (5, 1)):
            regs = rng.integers(0, 256, (32, 128), dtype=np.uint8)
            for r in (16, 0, 1):
                regs[r] = np.exp2(rng.uniform(-6, 6, 64)).astype(np.float16).view(np.uint8)
            word = q.encode_hp(16, 8, 12, imm3=imm3, vscale=vscale, signedness=sgn)
            want = q.execute_hp(word, regs, rounding="unfused", dot="fp16", overflow="inf")[16].view("<u2")
            np.testing.assert_array_equal(ime2_board.layout_model(word, regs, "spec"), want)
    with pytest.raises(ValueError, match="layout='diagonal' is not one of spec"):
        ime2_board.layout_model(word, regs, "diagonal")


def test_reinterpret_qweight_orders():
    codes = np.arange(32, dtype=np.uint8)[None, :] % 16
    ours = q.qweight_from_codes(codes).reshape(1, 1, 16)
    assert np.array_equal(ime2_board.reinterpret_qweight(ours, "adjacent_low_first"), ours)
    ggml = q.qweight_to_ggml(ours)
    assert np.array_equal(ime2_board.reinterpret_qweight(ggml, "ggml"), ours)
    swapped = ((ours >> 4) | (ours << 4)).astype(np.uint8)
    assert np.array_equal(ime2_board.reinterpret_qweight(swapped, "adjacent_high_first"), ours)
    with pytest.raises(ValueError, match="order='j_j16'"):
        ime2_board.reinterpret_qweight(ours, "j_j16")


def test_classify_needs_a_unique_exact_match_for_hp():
    question = ime2_board.rounding_question()
    expected = ime2_board.expectations(question)
    observed = expected["fused"][0].copy()
    assert ime2_board.classify(question, observed, expected).value == "fused"
    observed[0, 0] ^= 1  # one last-bit difference: neither value
    verdict = ime2_board.classify(question, observed, expected)
    assert verdict.value is None and "none of unfused, fused matches" in verdict.detail


def test_classify_op_uses_the_margin():
    question = ime2_board.m4_question()
    expected = ime2_board.expectations(question)
    grouped, rowwise = expected["grouped"][0], expected["rowwise"][0]
    near = [g + 1e-3 for g in grouped]
    assert ime2_board.classify(question, near, expected).value == "grouped"
    middle = [(g + r) / 2 for g, r in zip(grouped, rowwise)]
    assert ime2_board.classify(question, middle, expected).value is None


# ---------------------------------------------------------------------------------------------
# the instruction questions on the emulator


@needs_qemu
@pytest.mark.parametrize("option", ["rounding", "dot", "overflow"])
def test_the_emulator_is_classified_as_its_configured_option(option):
    question = {x.name: x for x in HP}[option]
    expected = ime2_board.expectations(question)
    for value in question.values:
        files = ime2_board.run_hp_qemu(question.cases, env={qemu_ime2.EMU_ENV[option]: value})
        verdict = ime2_board.classify(question, ime2_board.outputs_of(question.cases, files), expected)
        assert verdict.value == value, verdict.detail


@needs_qemu
def test_the_emulator_shows_the_spec_layout_and_keeps_subnormals():
    for question in (ime2_board.layout_question(), ime2_board.subnormals_question()):
        files = ime2_board.run_hp_qemu(question.cases)
        verdict = ime2_board.classify(question, ime2_board.outputs_of(question.cases, files))
        assert verdict.value == question.values[0], verdict.detail


# ---------------------------------------------------------------------------------------------
# the op questions through the child process


def _host_kernel_missing() -> str | None:
    try:
        from vllm_npu.ime2 import kernel

        kernel.load_library()
    except Exception as exc:  # noqa: BLE001
        return f"the host IME2 kernel is not usable: {exc}"
    return None


@pytest.mark.skipif(_host_kernel_missing() is not None, reason=_host_kernel_missing() or "")
def test_our_op_through_the_child_shows_our_choices(tmp_path):
    choices = {"qweight_nibbles": "adjacent_low_first", "m4": "grouped", "order": "hi_lo"}
    cases = [c for question in OPS for c in question.cases]
    outputs = ime2_board.run_op_child("ours", cases, ai_cores=False, workdir=tmp_path)
    at = 0
    for question in OPS:
        got = outputs[at: at + len(question.cases)]
        at += len(question.cases)
        verdict = ime2_board.classify(question, got)
        assert verdict.value == choices[question.name], verdict.detail


@pytest.mark.skipif(os.path.exists("/proc/set_ai_thread"), reason="a K3: the fence would succeed")
def test_the_child_fence_fails_clearly_off_a_k3(tmp_path):
    case = OPS[2].cases[0]
    with pytest.raises(ime2_board.BoardRunError, match=r"--ai-cores: cannot write the process id to "
                                                        r"/proc/set_ai_thread|sched_setaffinity"):
        ime2_board.run_op_child("ours", [case], ai_cores=True, workdir=tmp_path)


def test_fork_op_reason_when_vllm_lacks_it(monkeypatch, tmp_path):
    lib = tmp_path / "_C.abi3.so"
    lib.write_bytes(b"\0" * 4096 + b"int4_scaled_mm_cpu\0")
    monkeypatch.setattr(ime2_board, "_vllm_c_libraries", lambda: [lib])
    monkeypatch.setattr(ime2_board, "_fork_reason", [])
    reason = ime2_board.fork_op_missing_reason()
    assert reason == ("torch.ops._C.ime2_hp_gemm_cpu does not exist: _C.abi3.so of the installed vllm do not "
                      "define it (the opensolvers/vllm k3-a100-ime2 fork is not installed)")
    monkeypatch.setattr(ime2_board, "_vllm_c_libraries", lambda: [])
    monkeypatch.setattr(ime2_board, "_fork_reason", [])
    assert "vllm is not installed" in ime2_board.fork_op_missing_reason()


def test_fork_op_is_not_installed_here():
    reason = ime2_board.fork_op_missing_reason()
    if reason is None:
        pytest.skip("the fork's op is installed here")
    assert "torch.ops._C.ime2_hp_gemm_cpu does not exist" in reason and "\n" not in reason


# ---------------------------------------------------------------------------------------------
# the answers file


def test_answer_book_merges_and_npusim_reads_it(tmp_path):
    book = ime2_board.AnswerBook.for_target(tmp_path, "ime2-hw")
    assert book.path.name == q.options.ANSWERS_FILE
    rounding, order, layout = ime2_board.rounding_question(), ime2_board.order_question(), ime2_board.layout_question()
    book.record(rounding, ime2_board.Verdict("fused", {"unfused": 4.0, "fused": 0.0}, "rounding = fused"),
                scenario="hp[rounding]")
    book.record(order, ime2_board.Verdict("lo_hi", {"hi_lo": float("inf"), "lo_hi": 0.0}, "order = lo_hi"),
                scenario="fork_op[order]")
    book.record(layout, ime2_board.Verdict("spec", {"spec": 0.0}, "layout = spec"), scenario="hp[layout]")
    data = book.load()
    assert data["target"] == "ime2-hw" and set(data["answers"]) == {"rounding", "order", "layout"}
    assert data["answers"]["order"]["distance"] == {"hi_lo": None, "lo_hi": 0.0}
    assert q.load_answers(book.path) == {"rounding": "fused", "order": "lo_hi"}
    book.record(rounding, ime2_board.Verdict(None, {"unfused": 3.0, "fused": 2.0}, "rounding: none"),
                scenario="hp[rounding]")
    with pytest.raises(q.AnswersError, match="the board showed none of unfused, fused for 'rounding'"):
        q.load_answers(book.path)
    assert list(tmp_path.iterdir()) == [book.path]  # no lock or temporary file left behind


def test_answer_book_of_another_target_starts_afresh(tmp_path):
    path = tmp_path / "ime2-board-answers.json"
    path.write_text(json.dumps({"schema": 1, "target": "ime2-qemu", "answers": {"dot": {"value": "exact"}}}))
    book = ime2_board.AnswerBook(path, "ime2-hw")
    book.record(ime2_board.overflow_question(), ime2_board.Verdict("inf", {}, "overflow = inf"), scenario="x")
    assert set(book.load()["answers"]) == {"overflow"}


# ---------------------------------------------------------------------------------------------
# the scenarios on ime2-hw here


@pytest.mark.skipif(platform.machine() == "riscv64", reason="checks the skip off a K3")
def test_board_scenarios_exist_and_skip_on_ime2_hw_with_one_line_reasons(tmp_path):
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "npu_conformance.scenarios.test_ime2_board",
           "--target", "ime2-hw", "--report", str(tmp_path), "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    names = {r["scenario"] for r in report["results"]}
    assert {f"ime2_board.hp[{n}]" for n in ("rounding", "dot", "overflow", "subnormals", "layout")} <= names
    assert {f"ime2_board.fork_op[{n}]" for n in ("qweight_nibbles", "m4", "order")} <= names
    for r in report["results"]:
        assert r["status"] == "skipped" and r["message"] and "\n" not in r["message"], r
    assert not (tmp_path / "ime2-board-answers.json").exists()


@needs_qemu
def test_ime2_tile_scenario_follows_switched_defaults(tmp_path):
    """With NPUSIM_Q4X32 switching rounding to fused, the IME2 tile scenario sets the emulator to
    fused too, so the emulated kernel still equals the (now fused) model."""
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "npu_conformance.scenarios.test_ime2_tiles",
           "--target", "ime2-qemu", "--report", str(tmp_path), "-q", "-p", "no:cacheprovider",
           "-k", "ime2_path_matches and 4x512x64"]
    env = {**os.environ, q.options.ENV_DEFAULTS: '{"rounding": "fused"}'}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["status"] for r in report["results"]] == ["pass"]
