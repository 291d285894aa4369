"""vllm_npu.rbln.model_impl: ``--model-impl`` on RBLN, the resolution order, ``auto`` and the
refusal of the vllm path on ATOM (rbln.md §3)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from vllm_npu.rbln import model_impl as M
from vllm_npu.rbln.options import OptimumRBLNConfig, RBLNConfig

LEGACY_DEPRECATION = (
    "VLLM_RBLN_USE_VLLM_MODEL is deprecated and will be removed in 0.14.0. Use --model-impl, or "
    "hand additional_config the config class of the path you want, instead.")


def checkpoint(tmp_path: Path, *archs: str) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": list(archs)}))
    return path


def compiled(tmp_path: Path) -> Path:
    path = tmp_path / "compiled"
    path.mkdir()
    (path / "rbln_config.json").write_text("{}")
    (path / "prefill.rbln").write_bytes(b"")
    return path


def resolve(flag="auto", additional_config=None, environ=None, model_path=None, **kw):
    return M.resolve_model_impl(flag, additional_config, environ or {}, model_path, **kw)


# --------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize(("value", "impl"), [
    ("auto", None), (None, None), ("vllm", "vllm"), ("transformers", "optimum"),
    ("optimum", "optimum")])
def test_normalize(value, impl):
    assert M.normalize(value) == impl


def test_aliases():
    assert dict(M.ALIASES) == {"auto": None, "transformers": "optimum", "optimum": "optimum",
                               "vllm": "vllm"}


@pytest.mark.parametrize("value", ["terratorch", "vLLM", "", True, "Auto"])
def test_unsupported_values(value):
    with pytest.raises(M.ModelImplError) as err:
        M.normalize(value)
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (f"unsupported model implementation {value!r}; --model-impl takes "
                              "['auto', 'optimum', 'transformers', 'vllm'] on RBLN")
    with pytest.raises(M.ModelImplError, match="unsupported model implementation"):
        resolve(value)


# --------------------------------------------------------------------------------------------
# (1) the config class, (2) the flag


@pytest.mark.parametrize(("config", "flag", "impl", "selected_by", "remedy"), [
    (RBLNConfig(), "auto", "vllm", "an RBLNConfig additional_config",
     "Pass an OptimumRBLNConfig instead."),
    (RBLNConfig(), "vllm", "vllm", "an RBLNConfig additional_config",
     "Pass an OptimumRBLNConfig instead."),
    (OptimumRBLNConfig(), "auto", "optimum", "an OptimumRBLNConfig additional_config", ""),
    (OptimumRBLNConfig(), "transformers", "optimum", "an OptimumRBLNConfig additional_config", ""),
    (OptimumRBLNConfig(), None, "optimum", "an OptimumRBLNConfig additional_config", ""),
])
def test_a_config_class_names_its_path(config, flag, impl, selected_by, remedy, tmp_path):
    # Wins over everything below it: the inherited path and the model itself.
    env = {M.RESOLVED_ENV: "optimum" if impl == "vllm" else "vllm"}
    r = resolve(flag, config, env, compiled(tmp_path))
    assert (r.impl, r.selected_by, r.remedy) == (impl, selected_by, remedy)
    assert r.log == f"{selected_by} selects the {impl} model path."
    assert r.warnings == ()


@pytest.mark.parametrize(("config", "flag", "flagged", "cls", "given"), [
    (RBLNConfig(), "optimum", "optimum", "RBLNConfig", "vllm"),
    (RBLNConfig(), "transformers", "optimum", "RBLNConfig", "vllm"),
    (OptimumRBLNConfig(), "vllm", "vllm", "OptimumRBLNConfig", "optimum"),
])
def test_a_flag_contradicting_the_config_class(config, flag, flagged, cls, given):
    with pytest.raises(M.ModelImplError) as err:
        resolve(flag, config)
    assert str(err.value) == (
        f"--model-impl names the {flagged} model path and additional_config is an {cls}, which "
        f"holds the {given} one's options. Pass the config class for the path you want, or "
        "leave --model-impl at auto.")


@pytest.mark.parametrize(("flag", "impl", "remedy"), [
    ("vllm", "vllm", "Use --model-impl optimum."), ("optimum", "optimum", ""),
    ("transformers", "optimum", "")])
def test_the_flag_names_a_path(flag, impl, remedy, tmp_path):
    # A mapping additional_config is no class; the flag beats the inherited path and the model.
    r = resolve(flag, {"use_w8a8": True}, {M.RESOLVED_ENV: "vllm" if impl == "optimum" else
                                           "optimum"}, compiled(tmp_path))
    assert (r.impl, r.selected_by, r.remedy) == (impl, f"--model-impl {flag}", remedy)


# --------------------------------------------------------------------------------------------
# (3) the deprecated VLLM_RBLN_USE_VLLM_MODEL against an explicit choice


@pytest.mark.parametrize(("raw", "flag", "config", "legacy", "given"), [
    ("1", "optimum", None, "vllm", "optimum"),
    ("true", "transformers", None, "vllm", "optimum"),
    ("1", "auto", OptimumRBLNConfig(), "vllm", "optimum"),
    ("0", "vllm", None, "optimum", "vllm"),
    ("false", "auto", RBLNConfig(), "optimum", "vllm"),
])
def test_a_disagreeing_legacy_variable_is_refused(raw, flag, config, legacy, given):
    with pytest.raises(M.ModelImplError) as err:
        resolve(flag, config, {M.LEGACY_ENV: raw})
    assert str(err.value) == (
        f"VLLM_RBLN_USE_VLLM_MODEL selects the {legacy!r} model path and model_impl selects "
        f"{given!r}. VLLM_RBLN_USE_VLLM_MODEL is deprecated: unset it and keep --model-impl.")


@pytest.mark.parametrize(("raw", "flag", "impl"), [
    ("1", "vllm", "vllm"), ("TRUE", "vllm", "vllm"), ("0", "optimum", "optimum"),
    ("false", "transformers", "optimum")])
def test_an_agreeing_legacy_variable_warns(raw, flag, impl, rbln_caplog):
    caplog = rbln_caplog
    r = resolve(flag, None, {M.LEGACY_ENV: raw})
    assert (r.impl, r.selected_by) == (impl, f"--model-impl {flag}")
    assert r.warnings == (LEGACY_DEPRECATION,)
    assert [(x.levelno, x.getMessage()) for x in caplog.records] == [
        (logging.WARNING, LEGACY_DEPRECATION), (logging.INFO, r.log)]


# --------------------------------------------------------------------------------------------
# (4) inherited path, then the legacy variable, then auto


def test_the_inherited_path_wins_over_the_legacy_variable(tmp_path):
    r = resolve("auto", {}, {M.RESOLVED_ENV: "optimum", M.LEGACY_ENV: "1"},
                checkpoint(tmp_path, "MixtralForCausalLM"))
    assert (r.impl, r.selected_by, r.remedy, r.warnings) == ("optimum", M.RESOLVED_ENV, "", ())
    r = resolve("auto", {}, {M.RESOLVED_ENV: "vllm"}, compiled(tmp_path))
    assert (r.impl, r.selected_by, r.remedy) == (
        "vllm", "_VLLM_RBLN_RESOLVED_MODEL_IMPL",
        "Start the process that published it on the optimum path.")
    assert r.log == "_VLLM_RBLN_RESOLVED_MODEL_IMPL hands down the vllm model path."


@pytest.mark.parametrize("raw", ["transformers", "auto", "VLLM"])
def test_an_unusable_inherited_path_is_refused(raw):
    with pytest.raises(M.ModelImplError) as err:
        resolve("auto", None, {M.RESOLVED_ENV: raw})
    assert str(err.value) == (
        f"_VLLM_RBLN_RESOLVED_MODEL_IMPL={raw!r} names no model path; the process that starts "
        "this one publishes 'vllm' or 'optimum' there.")


@pytest.mark.parametrize(("raw", "impl"), [("1", "vllm"), ("True", "vllm"), ("0", "optimum"),
                                           (" FALSE ", "optimum")])
def test_the_legacy_variable_alone_selects_the_path(raw, impl, tmp_path):
    r = resolve(None, None, {M.LEGACY_ENV: raw}, compiled(tmp_path))
    assert (r.impl, r.selected_by) == (impl, "VLLM_RBLN_USE_VLLM_MODEL")
    assert r.remedy == ("Unset VLLM_RBLN_USE_VLLM_MODEL." if impl == "vllm" else "")
    assert r.warnings == (LEGACY_DEPRECATION,)


@pytest.mark.parametrize("raw", ["yes", "on", "no", "2", "vllm"])
@pytest.mark.parametrize("flag", [None, "vllm", "optimum"])
def test_a_word_the_vendor_reads_otherwise_is_refused(raw, flag, tmp_path):
    """vllm-rbln reads every word but true/1 as the optimum path: ``yes`` would take the vllm path
    under a looser reading here and the optimum path on the board, so it is refused by name."""
    with pytest.raises(M.ModelImplError) as err:
        resolve(flag, None, {M.LEGACY_ENV: raw}, compiled(tmp_path))
    assert str(err.value) == (f"VLLM_RBLN_USE_VLLM_MODEL={raw!r} is not a switch: expected 1, true (on) "
                              "or 0, false (off)")


def test_auto_takes_a_compiled_directory(tmp_path):
    path = compiled(tmp_path)
    r = resolve("auto", None, {}, path, hf_architectures_reader=pytest.fail)
    assert (r.impl, r.remedy) == ("optimum", "")
    assert r.log == (f"--model-impl auto takes the optimum model path: {path} holds a compiled "
                     "optimum-rbln artifact.")


@pytest.mark.parametrize(("archs", "impl", "log"), [
    (["LlamaForCausalLM"], "optimum",
     "--model-impl auto takes the optimum model path: optimum-rbln runs LlamaForCausalLM."),
    (["Foo", "Qwen3ForSequenceClassification"], "optimum",
     "--model-impl auto takes the optimum model path: optimum-rbln runs "
     "Qwen3ForSequenceClassification."),
    (["MixtralForCausalLM"], "vllm",
     "--model-impl auto takes the vllm model path: optimum-rbln has no implementation for "
     "['MixtralForCausalLM']."),
    ([], "vllm",
     "--model-impl auto takes the vllm model path: optimum-rbln has no implementation for []."),
])
def test_auto_reads_the_architecture(archs, impl, log, tmp_path):
    r = resolve("auto", {}, {}, checkpoint(tmp_path, *archs))
    assert (r.impl, r.selected_by, r.log) == (impl, "the model's architecture", log)
    assert r.remedy == ("Use a model optimum-rbln implements." if impl == "vllm" else "")


def test_auto_with_an_unreadable_config(tmp_path):
    missing = tmp_path / "nowhere"
    r = resolve("auto", None, {}, missing)
    assert (r.impl, r.selected_by, r.remedy) == (
        "vllm", "a model whose config could not be read",
        "Make the config readable, or use --model-impl optimum.")
    assert r.log.startswith(f"--model-impl auto takes the vllm model path: {missing}'s config "
                            "could not be read ([Errno 2] No such file or directory")
    assert r.log.endswith("). Name the path to be sure of it.")

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    assert resolve("auto", None, {}, bad).selected_by == "a model whose config could not be read"


def test_auto_uses_the_given_reader():
    seen = []

    def reader(path):
        seen.append(path)
        if path == "org/unreadable":
            raise ValueError("gated repo")
        return ["GPT2LMHeadModel"] if path == "openai/gpt2" else ["MiniMaxM2ForCausalLM"]

    assert resolve("auto", None, {}, "openai/gpt2", hf_architectures_reader=reader).impl == "optimum"
    assert resolve("auto", None, {}, "m/x", hf_architectures_reader=reader).impl == "vllm"
    r = resolve("auto", None, {}, "org/unreadable", hf_architectures_reader=reader)
    assert r.log == ("--model-impl auto takes the vllm model path: org/unreadable's config could "
                     "not be read (gated repo). Name the path to be sure of it.")
    assert seen == ["openai/gpt2", "m/x", "org/unreadable"]


def test_default_environment_is_os_environ(monkeypatch, tmp_path):
    monkeypatch.delenv(M.RESOLVED_ENV, raising=False)
    monkeypatch.setenv(M.LEGACY_ENV, "1")
    assert M.resolve_model_impl("auto", None, None, compiled(tmp_path)).impl == "vllm"


# --------------------------------------------------------------------------------------------
# Helpers


def test_is_compiled_dir(tmp_path):
    path = compiled(tmp_path)
    assert M.is_compiled_dir(path) and M.is_compiled_dir(str(path))
    (path / "prefill.rbln").unlink()
    assert not M.is_compiled_dir(path)  # rbln_config.json alone is not a compiled model
    (path / "decoder_batch_4.rbln").write_bytes(b"")
    (path / "rbln_config.json").unlink()
    assert not M.is_compiled_dir(path)
    assert not M.is_compiled_dir(tmp_path / "missing")
    assert not M.is_compiled_dir("meta-llama/Llama-3.1-8B") and not M.is_compiled_dir(None)


def test_read_architectures(tmp_path):
    assert M.read_architectures(checkpoint(tmp_path, "A", "B")) == ["A", "B"]
    other = tmp_path / "o"
    other.mkdir()
    (other / "config.json").write_text("{}")
    assert M.read_architectures(other) == []
    (other / "config.json").write_text('{"architectures": "LlamaForCausalLM"}')
    with pytest.raises(ValueError, match="not a list of names"):
        M.read_architectures(other)
    (other / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        M.read_architectures(other)
    with pytest.raises(OSError):
        M.read_architectures(tmp_path / "missing")
    with pytest.raises(OSError):
        M.read_architectures(None)


# --------------------------------------------------------------------------------------------
# The refusal on ATOM


def _vllm_resolutions(tmp_path: Path) -> dict[str, M.Resolution]:
    return {
        "--model-impl vllm": resolve("vllm"),
        "an RBLNConfig additional_config": resolve("auto", RBLNConfig()),
        "_VLLM_RBLN_RESOLVED_MODEL_IMPL": resolve("auto", None, {M.RESOLVED_ENV: "vllm"}),
        "VLLM_RBLN_USE_VLLM_MODEL": resolve("auto", None, {M.LEGACY_ENV: "1"}),
        "the model's architecture": resolve("auto", None, {},
                                            checkpoint(tmp_path, "DeepseekV32ForCausalLM")),
        "a model whose config could not be read": resolve("auto", None, {}, tmp_path / "none"),
    }


PAIRS = [
    ("--model-impl vllm", "Use --model-impl optimum."),
    ("an RBLNConfig additional_config", "Pass an OptimumRBLNConfig instead."),
    ("_VLLM_RBLN_RESOLVED_MODEL_IMPL", "Start the process that published it on the optimum path."),
    ("VLLM_RBLN_USE_VLLM_MODEL", "Unset VLLM_RBLN_USE_VLLM_MODEL."),
    ("the model's architecture", "Use a model optimum-rbln implements."),
    ("a model whose config could not be read",
     "Make the config readable, or use --model-impl optimum."),
]


def test_the_remedy_table():
    assert list(M.REMEDIES.items()) == PAIRS


@pytest.mark.parametrize(("selected_by", "remedy"), PAIRS)
def test_every_refusal_names_what_selected_the_path(selected_by, remedy, tmp_path):
    r = _vllm_resolutions(tmp_path)[selected_by]
    assert (r.impl, r.selected_by, r.remedy) == ("vllm", selected_by, remedy)
    with pytest.raises(M.ModelPathDisabledError) as err:
        M.reject_disabled(r, "RBLN-CA25")
    assert isinstance(err.value, ValueError)
    assert str(err.value) == (f"The vllm model path is not supported on RBLN-CA25; {selected_by} "
                              f"selected it. {remedy}")


def test_the_reference_example():
    with pytest.raises(ValueError) as err:
        M.reject_disabled(resolve("vllm"), "RBLN-CA25")
    assert str(err.value) == ("The vllm model path is not supported on RBLN-CA25; --model-impl "
                              "vllm selected it. Use --model-impl optimum.")


@pytest.mark.parametrize(("device", "flag", "refused"), [
    ("RBLN-CA25", "vllm", True), ("RBLN-CA22", "vllm", True), (" rbln-ca02 ", "vllm", True),
    ("RBLN-CA25", "optimum", False), ("RBLN-CR03", "vllm", False), ("RBLN-CR13", "vllm", False),
    (None, "vllm", False),  # a compile-only worker names its target later
])
def test_which_hosts_refuse(device, flag, refused):
    r = resolve(flag)
    if refused:
        with pytest.raises(M.ModelPathDisabledError, match=device.strip()):
            M.reject_disabled(r, device)
    else:
        assert M.reject_disabled(r, device) is None


def test_the_module_imports_no_vllm_or_torch():
    import subprocess
    import sys

    code = ("import sys, vllm_npu.rbln.model_impl, vllm_npu.rbln.options, "
            "vllm_npu.rbln.architectures, vllm_npu.rbln.device; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vllm', 'torch', 'rebel', 'transformers', 'optimum')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
