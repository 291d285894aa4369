"""npu_conformance.vllm_server's environment: private cache roots share vLLM's model-info cache."""

from __future__ import annotations

from pathlib import Path

from npu_conformance import vllm_server as vs


def test_the_default_cache_root_follows_vllm_envs_rules(tmp_path):
    assert vs.default_cache_root({"VLLM_CACHE_ROOT": str(tmp_path / "r")}) == tmp_path / "r"
    assert vs.default_cache_root({"XDG_CACHE_HOME": str(tmp_path / "x")}) == tmp_path / "x" / "vllm"
    assert vs.default_cache_root({"HOME": str(tmp_path / "h")}) == tmp_path / "h" / ".cache" / "vllm"


def test_a_private_cache_root_links_only_modelinfos_to_the_shared_root(tmp_path):
    shared, private = tmp_path / "shared", tmp_path / "session" / "cache"
    vs.share_model_infos(private, shared)
    link = private / "modelinfos"
    assert link.is_symlink() and link.resolve() == (shared / "modelinfos").resolve()
    (link / "m-C.json").write_text("{}", encoding="utf-8")
    assert (shared / "modelinfos" / "m-C.json").is_file()
    assert sorted(p.name for p in private.iterdir()) == ["modelinfos"]  # nothing else is shared


def test_an_existing_modelinfos_is_left_alone_and_the_shared_root_is_not_linked_to_itself(tmp_path):
    own = tmp_path / "own" / "modelinfos"
    own.mkdir(parents=True)
    vs.share_model_infos(own.parent, tmp_path / "shared")
    assert own.is_dir() and not own.is_symlink()
    vs.share_model_infos(tmp_path / "shared", tmp_path / "shared")
    assert not (tmp_path / "shared" / "modelinfos").is_symlink()


def test_vllm_env_with_a_private_cache_root_shares_modelinfos(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "default"))
    env = vs.vllm_env("mblt-sim", VLLM_CACHE_ROOT=str(tmp_path / "private"))
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "private")
    assert Path(env["VLLM_CACHE_ROOT"], "modelinfos").resolve() == (tmp_path / "default" / "modelinfos").resolve()
