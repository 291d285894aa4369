"""The MBLT plugin's layout and start-up rules for Qwen2-VL / Qwen3-VL releases (issue 14 §1):
``vision_*`` / ``text_*`` keys with the shared unprefixed keys forwarded to both roles (an explicit
prefixed key wins), the refused unprefixed ``mxq_path``, the text MXQ's keys driving the scheduler,
the static release's ``--limit-mm-per-prompt``, the unsupported multimodal model type, and the
per-request rules the platform answers with HTTP 400. No vLLM engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.config.multimodal import ImageDummyOptions, MultiModalDummyOptions, VideoDummyOptions  # noqa: E402
from vllm.multimodal.inputs import PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

from vllm_npu.mblt import platform as mplatform  # noqa: E402
from vllm_npu.mblt import settings  # noqa: E402
from vllm_npu.mblt.platform import MbltPlatform, MbltRequestError  # noqa: E402

ARTIFACT = {
    "model_type": "mobilint-qwen3_vl",
    "is_dynamic": False,
    "vision_config": {"mxq_path": "vision.mxq", "dev_no": 0, "core_mode": "single", "max_batch_size": 1},
    "text_config": {"mxq_path": "text.mxq", "dev_no": 1, "core_mode": "global8", "max_batch_size": 4,
                    "npu_prefill_chunk_size": 256},
}


def _ov(raw=None):
    return settings.parse_loader_extra_config(raw)


def test_role_views_from_the_release():
    art, ov = settings.vlm_role_view(ARTIFACT, _ov(), "text")
    assert (art["mxq_path"], art["dev_no"], art["core_mode"], art["max_batch_size"]) == ("text.mxq", 1, "global8", 4)
    assert ov.dev_no is None and ov.core_mode is None
    assert settings.resolve_max_batch_size(ov, art) == 4
    assert settings.resolve_prefill_chunk(art, "global8", 4)[0] == 128  # batch clamp
    art, _ = settings.vlm_role_view(ARTIFACT, _ov(), "vision")
    assert (art["mxq_path"], art["dev_no"], art["core_mode"]) == ("vision.mxq", 0, "single")


def test_shared_keys_are_forwarded_and_prefixed_keys_win():
    raw = {"dev_no": 2, "core_mode": "multi", "max_batch_size": 2, "npu_prefill_chunk_size": 64,
           "text_core_mode": "global4", "vision_dev_no": 3, "text_mxq_path": "t2.mxq", "vision_target_device": "aries2"}
    t_art, t_ov = settings.vlm_role_view(ARTIFACT, _ov(raw), "text")
    assert (t_ov.dev_no, t_ov.core_mode, t_ov.max_batch_size) == ((2,), "global4", 2)
    assert (t_art["mxq_path"], t_art["npu_prefill_chunk_size"]) == ("t2.mxq", 64)
    v_art, v_ov = settings.vlm_role_view(ARTIFACT, _ov(raw), "vision")
    assert (v_ov.dev_no, v_ov.core_mode, v_art["mxq_path"], v_art["target_device"]) == ((3,), "multi", "vision.mxq",
                                                                                       "aries2")
    # config.json's top-level prefixed keys win over the sub-config, lose to the loader
    art = {**ARTIFACT, "text_max_batch_size": 8}
    assert settings.resolve_max_batch_size(*reversed(settings.vlm_role_view(art, _ov(), "text"))) == 8
    assert settings.resolve_max_batch_size(*reversed(settings.vlm_role_view(art, _ov({"text_max_batch_size": 3}),
                                                                            "text"))) == 3
    # a prefixed target kind beats the shared other kind
    _a, ov = settings.vlm_role_view(ARTIFACT, _ov({"target_clusters": ["0:0"], "vision_target_cores": ["0:1:2"]}),
                                    "vision")
    assert (ov.target_cores, ov.target_clusters) == (("0:1:2",), None)
    with pytest.raises(settings.MbltConfigError, match="the vision MXQ's layout .*dev_no=-1"):
        settings.vlm_role_view(ARTIFACT, _ov({"vision_dev_no": -1}), "vision")


def test_mxq_path_is_the_text_mxq_and_unprefixed_mxq_path_is_refused():
    assert settings.mxq_path_of("/r", ARTIFACT, _ov()) == "/r/text.mxq"
    assert settings.mxq_path_of("/r", ARTIFACT, _ov({"text_mxq_path": "t9.mxq"})) == "/r/t9.mxq"
    with pytest.raises(settings.MbltConfigError, match="use vision_mxq_path and/or text_mxq_path"):
        settings.mxq_path_of("/r", ARTIFACT, _ov({"mxq_path": "x.mxq"}))


def test_scheduler_plan_follows_the_text_mxq():
    art, ov = settings.vlm_role_view(ARTIFACT, _ov(), "text")
    plan = settings.plan_scheduler(art, ov, user_max_num_seqs=None, user_max_num_batched_tokens=None,
                                   user_block_size=None, user_enable_prefix_caching=None)
    assert (plan.max_num_seqs, plan.prefill_chunk, plan.core_mode, plan.enable_prefix_caching) == (4, 128, "global8",
                                                                                                  True)


def _vllm_config(limits=None, family="qwen3_vl"):
    mm = SimpleNamespace(limit_per_prompt=MultiModalDummyOptions(limits or {}))
    return SimpleNamespace(model_config=SimpleNamespace(model="/nonexistent", multimodal_config=mm)), mm


def test_static_release_limits(monkeypatch):
    monkeypatch.delenv("NPU_HARNESS_TARGET", raising=False)
    cfg, mm = _vllm_config()
    assert mplatform._vlm_rules(cfg, dict(ARTIFACT), _ov()) is False  # the config's flag (no MXQ readable here)
    assert (mm.limit_per_prompt["image"].count, mm.limit_per_prompt["video"].count) == (1, 0)
    cfg, mm = _vllm_config({"image": ImageDummyOptions(count=1), "video": VideoDummyOptions(count=0)})
    mplatform._vlm_rules(cfg, dict(ARTIFACT), _ov())
    for limits, named in (({"image": ImageDummyOptions(count=2)}, "image=2"),
                          ({"video": VideoDummyOptions(count=1)}, "video=1")):
        cfg, _mm = _vllm_config(limits)
        with pytest.raises(settings.MbltConfigError, match=f"--limit-mm-per-prompt {named}: a static-vision Mobilint "
                                                           "Qwen3-VL release takes exactly one image and no video"):
            mplatform._vlm_rules(cfg, dict(ARTIFACT), _ov())
    cfg, mm = _vllm_config({"image": ImageDummyOptions(count=5), "video": VideoDummyOptions(count=2)})
    assert mplatform._vlm_rules(cfg, {**ARTIFACT, "is_dynamic": True}, _ov()) is True  # dynamic: as given
    assert (mm.limit_per_prompt["image"].count, mm.limit_per_prompt["video"].count) == (5, 2)
    q2 = {**ARTIFACT, "model_type": "mobilint-qwen2_vl", "dynamic_vision": True}
    with pytest.raises(settings.MbltConfigError, match="image=5: a dynamic-vision Mobilint Qwen2-VL release takes "
                                                       "exactly one image"):
        mplatform._vlm_rules(cfg, q2, _ov())  # Qwen2-VL: one image, dynamic or not
    with pytest.raises(settings.MbltConfigError, match="vision_mxq_path and/or text_mxq_path"):
        mplatform._vlm_rules(cfg, dict(ARTIFACT), _ov({"mxq_path": "m.mxq"}))


def _inputs(placeholders, kwargs=None):
    return {"type": "multimodal", "prompt_token_ids": [1, 2, 3], "mm_placeholders": placeholders,
            "mm_kwargs": kwargs or {}}


@pytest.fixture
def serving(monkeypatch):
    def set_(family, dynamic):
        monkeypatch.setattr(MbltPlatform, "_serving_vlm", (family, dynamic))
        monkeypatch.setattr(MbltPlatform, "_vlm_sessions", None)
        monkeypatch.setattr(MbltPlatform, "_eagle3_engine", classmethod(lambda cls: False))
    return set_


def test_request_rules_answer_400(serving):
    serving("qwen2_vl", False)
    one = {"image": [PlaceholderRange(offset=3, length=64)]}
    MbltPlatform.validate_request(_inputs(one), SamplingParams())
    for ph, text in (({"image": [PlaceholderRange(3, 64), PlaceholderRange(80, 64)]}, "got 2 image features"),
                     ({"video": [PlaceholderRange(3, 64)]}, "does not support video inputs")):
        with pytest.raises(MbltRequestError, match=text) as err:
            MbltPlatform.validate_request(_inputs(ph), SamplingParams())
        assert err.value.parameter == "multi_modal_data"
    # a session keeps its image position; text-only turns pass
    turn = SamplingParams(extra_args={"session_id": "s1"})
    MbltPlatform.validate_request(_inputs(one), turn)
    MbltPlatform.validate_request({"type": "token", "prompt_token_ids": [1]}, turn)
    MbltPlatform.validate_request(_inputs(one), turn)
    with pytest.raises(MbltRequestError, match="requires a fixed image-token position. session_id=s1"):
        MbltPlatform.validate_request(_inputs({"image": [PlaceholderRange(9, 64)]}), turn)
    MbltPlatform.validate_request(_inputs({"image": [PlaceholderRange(9, 64)]}), SamplingParams())  # no session


def test_dynamic_request_rules(serving):
    serving("qwen3_vl", True)
    ph = {"image": [PlaceholderRange(3, 64)], "video": [PlaceholderRange(70, 64)]}
    grid = {"image_grid_thw": SimpleNamespace(data=np.array([1, 16, 16]))}
    vgrid = {"video_grid_thw": SimpleNamespace(data=np.array([4, 64, 64]))}
    MbltPlatform.validate_request(_inputs(ph, {"image": [grid], "video": [vgrid]}), SamplingParams())
    big = {"image_grid_thw": SimpleNamespace(data=np.array([1, 96, 64]))}
    with pytest.raises(MbltRequestError, match="6144 total for one encoder call.*limit of 4096"):
        MbltPlatform.validate_request(_inputs(ph, {"image": [big]}), SamplingParams())
