"""The ledger of known differences between a vendor plugin's column and ours (issue 19).

A vendor column (``vllm-rbln@rbln-sim``...) runs the same scenarios as our column on the same
simulator. Where it fails one, either its plugin or ours has a bug, or the scenario reads
something only ours provides. Each such failure that is understood is recorded here, with the
evidence its failure message matches and the verdict: which side the seed supports, and why.
``docs/<device>.md`` explains each one at length.

The plugin (:func:`npu_conformance.plugin.pytest_runtest_makereport`) reports a recorded
scenario as ``differs`` when it fails with that evidence. It stays a failure when it fails
otherwise, and a scenario that passes while recorded here fails too, so the ledger cannot go
stale: a vendor release that fixes the difference turns the column red until the entry goes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Difference:
    """One scenario a vendor column fails, understood.

    Attributes:
        column: the vendor column (``vllm-rbln@rbln-sim``).
        scenario: the report's scenario name (``serving.prompt_logprobs``).
        evidence: a regular expression the failure's message must match.
        what: what the vendor plugin does, in one sentence.
        verdict: which side the seed supports (``vendor bug``, ``ours stricter``...) and why.
        docs: where it is explained (``docs/rbln.md#...``).
    """

    column: str
    scenario: str
    evidence: str
    what: str
    verdict: str
    docs: str

    def describe(self) -> str:
        """One line for the report: what, the verdict, and the docs."""
        return f"{self.what} Verdict: {self.verdict} ({self.docs})"


_RBLN = "vllm-rbln@rbln-sim"
_RBLN_DOCS = "docs/rbln.md#the-vendor-column-vllm-rblnrbln-sim"

_MBLT = "vllm-mblt@mblt-sim"
_MBLT_DOCS = "docs/mblt.md#the-vendor-column-vllm-mbltmblt-sim"
_MBLT_LOGGED = ("not a bug on either side as far as the scenario can tell: the outputs equal the golden decoder "
                "(checked first); the scenario's evidence of {what} is a log line of our plugin, and vllm-mblt "
                "logs none at the default level")
_OURS_LOGGED = ("not a bug on either side: the outputs equal the golden decoder (checked first); the scenario's "
                "evidence of {what} is a log line of our plugin, which vllm-rbln does not write")

#: Every known difference.
KNOWN: tuple[Difference, ...] = (
    # ---------------------------------------------------------------- vllm-mblt 0.8.0 on mblt-sim
    Difference(_MBLT, "serving.hostile_input",
               r"(?s)(?<!\d)3 of \d+ hostile requests mishandled:\n"
               r"  huge max_tokens: HTTP 400 but the message does not match .*maximum context length is -\d+ tokens.*"
               r"  n = 10\*\*6: no answer",
               "n = 10**6 is accepted and queues a million sequences: the server stops answering (one request "
               "denies service); huge max_tokens gets a 400 that reports a negative context length.",
               "vLLM 0.11.2's front end, the vLLM vllm-mblt pins (vLLM 0.32, under our plugin, refuses both with a "
               "400 naming the rule); the rest of the cases could not be tried", _MBLT_DOCS),
    Difference(_MBLT, "serving.fault_once_retried",
               r"HTTP 500: .*EngineCore encountered an issue",
               "One failed infer (the simulator's injected InternalError) stops vllm-mblt's engine: the requests in "
               "flight get a 500 and the server exits.",
               "the seed asks for no retry: no wrong token on either side; ours retries the infer once (it "
               "restores the slot's KV first), so a transient device error costs vllm-mblt its server", _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.refuses_oversized_max_model_len",
               r"--max-model-len 512 started; expected a refusal; a 384-token prompt then got HTTP 500 and the "
               r"server was not healthy",
               "vllm-mblt starts with --max-model-len twice the MXQ's KV capacity; a prompt past the capacity then "
               "overflows the MXQ's cache (Model_CacheOverflow, mblt_worker.py:1704) and stops the engine.",
               "vllm-mblt bug: the seed has the worker refuse to start when max_model_len exceeds the loaded MXQs' "
               "capacity (its MoE section), which ours applies to every MXQ; a board raises the same "
               "Model_CacheOverflow", _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.prefix_snapshot_load_and_recompute", r"no snapshot load logged",
               "vllm-mblt answers a 256-token and a 128-token prefix hit with the golden outputs.",
               _MBLT_LOGGED.format(what="loading one snapshot and recomputing below min-hit"), _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.prefix_cost_model_measured[load_cheap]", r"no snapshot decision logged",
               "vllm-mblt answers the prefix probes with the golden outputs; it decides by the same rule "
               "(PrefixCacheCostModel, load_ms < prefill_ms x 0.9).",
               _MBLT_LOGGED.format(what="the load or recompute decision"), _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.prefix_cost_model_measured[load_expensive]", r"no snapshot decision logged",
               "vllm-mblt answers the prefix probes with the golden outputs; it decides by the same rule "
               "(PrefixCacheCostModel, load_ms < prefill_ms x 0.9).",
               _MBLT_LOGGED.format(what="the load or recompute decision"), _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.multi_card_batching", r"no placement on devices \[0, 1\] logged",
               "With dev_no [0, 1] vllm-mblt's outputs equal their solo runs and the golden decoder.",
               _MBLT_LOGGED.format(what="two MXQ instances on two cards"), _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.moe_start_rules", r"--max-model-len 40960 started; expected a refusal",
               "vllm-mblt refuses batch serving and clamps the default max_model_len as ours does, but it also "
               "clamps an explicit --max-model-len 40960 to its constant 4096 for Mixture-of-Experts models "
               "(mblt_platform.py: 'Clamping max_model_len from %d to %d'), so its worker's capacity check never "
               "refuses: the user's explicit value is replaced without an error.",
               "a reading of the seed: ours clamps only the config's declared value to the shared MXQs' capacity "
               "and refuses an explicit larger one ('the worker ... refuses to start when max_model_len exceeds "
               "their capacity', as issue 13 asks); vllm-mblt's constant is the capacity of Qwen3-30B-A3B only",
               _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.moe_placement_overrides", r"assert 'lm_head on device \d; 4 expert workers'",
               "With lm_head_target_cores and num_expert_workers overridden (and an unprefixed dev_no), vllm-mblt's "
               "output equals the golden decoder; it ignores the unprefixed key without a word.",
               _MBLT_LOGGED.format(what="the roles' placement, and of the unprefixed key being unused,"), _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.eagle3_request_refusals",
               r"not refused with a 400 naming it: bad_words \(HTTP 200\)(\n|$)",
               "vllm-mblt refuses the other eleven parameters with a 400 naming each, but serves a /v1/completions "
               "request with bad_words (HTTP 200): vLLM 0.11.2's CompletionRequest has no bad_words field (only "
               "ChatCompletionRequest does), so the value is dropped before its platform's check "
               "(_unsupported_eagle3_sampling, which does list bad_words) can see it.",
               "a vLLM 0.11.2 limit under vllm-mblt, not a rule of its own: the request is answered as if "
               "bad_words had not been sent; vLLM 0.32 passes bad_words of a completion on, and ours refuses it",
               _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.asr_transcription_greedy", r"assert 'n' == 'honey'",
               "vllm-mblt's transcription prompt always opens with a system turn, empty without a `prompt` "
               "(`<|im_start|>system\\n<|im_end|>\\n`, as qwen-asr 0.0.6's _build_messages always sends a system "
               "message); given that prompt its text equals the golden pipeline's ('n' for the 'honey' clip, "
               "forced English; the tiny model is fitted to the prompt without the turn).",
               "a prompt-format choice, not a wrong token: vLLM 0.32's Qwen3-ASR, and ours, emit the system turn "
               "only when a `prompt` is given (vLLM's docstring: as the official SDK does); the seed says the "
               "`prompt` reaches the model as context and nothing of the empty case", _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.asr_long_audio_is_chunked", r"(?s)assert '.*lampnsns.*' == '.*ed lamp honey'",
               "vllm-mblt splits the 38 s clip and joins the chunks' texts as ours does, but each chunk's prompt "
               "has the empty system turn (mblt_serving.asr_transcription_greedy), so the text differs from the "
               "golden pipeline's for the prompt without it.",
               "the same prompt-format choice as mblt_serving.asr_transcription_greedy", _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.asr_endpoint_rules", r"assert 'Clamping max_model_len from' in ",
               "vllm-mblt clamps max_model_len to 2048 (/v1/models says so) but logs nothing of it at the default "
               "level; the rest holds in its own words: /v1/audio/translations gets 400 (\"Qwen3-ASR supports "
               "task_type='transcribe' only\"), two clips 400, the 170 s clip in chat 400 twice (\"The prompt is "
               "2223 tokens, which leaves no room to generate within max_model_len=2048\") and then served by the "
               "transcription endpoint (checked by hand against a vllm-mblt server).",
               _MBLT_LOGGED.format(what="the clamp") + "; the later checks' wording (\"does not translate\", "
               "vLLM 0.32's \"maximum context length (2048)\") is ours", _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.asr_hostile_uploads", r"\('empty', 500, .*Format not recognised",
               "Undecodable uploads (empty, garbage, RIFF not WAVE, text, a truncated FLAC) get HTTP 500 with "
               "libsndfile's message (\"Format not recognised\", \"flac decoder lost sync\"); a truncated WAV, one "
               "declaring a huge length and truncated audio inline in chat get 200 with the text of what is there; "
               "a header-only WAV gets 400 (\"The audio has no samples.\"). None hangs (each under 0.5 s) and the "
               "server stays healthy.",
               "vLLM 0.11.2's front end answers a client's bad file with a 500, and nothing checks the upload "
               "against its header: the seed asks a 4xx for each (ours: vLLM 0.32 and the upload check of "
               "vllm_npu/audio_uploads.py); no hang on either side", _MBLT_DOCS),
    Difference(_MBLT, "mblt_serving.asr_start_rules", r"assert \(2048 == 2048 and True is False\)",
               "vllm-mblt's resolved config clamps max_model_len to 2048 (an explicit 4096 too) but keeps prefix "
               "caching on (by default and with --enable-prefix-caching), resolves max_num_seqs 128 (the release "
               "declares no max_batch_size), accepts --limit-mm-per-prompt audio=2 at start (a request with "
               "two clips still gets 400) and starts with a top-level mxq_path in --model-loader-extra-config "
               "(beside the two absolute paths the lab passes; checked by hand).",
               "ours stricter, no wrong output seen: ours turns prefix caching off for Qwen3-ASR (vLLM 0.32 drops "
               "the audio features of a span its prefix cache covers), resolves one sequence and refuses a "
               "larger clip limit at start; on vllm-mblt's column the same clip sent again and concurrent "
               "requests give the same text (asr_prompt_and_chat, asr_concurrent_requests pass); the unused "
               "top-level key is ignored without a word", _MBLT_DOCS),
    Difference(_MBLT, "mblt_vlm.vlm_image_rules[qwen2_vl]",
               r"\(500, \{'error': \{'message': 'EngineCore encountered an issue",
               "Two images in one request to a static Qwen2-VL release reach vllm-mblt's worker, whose check "
               "(_validate_mobilint_vlm_request_constraints, mblt_worker.py:734-739: \"supports exactly one image in "
               "the initial request, but got 2 image features\") raises RuntimeError inside execute_model; vLLM "
               "0.11.2's engine core treats that as fatal: the request gets HTTP 500 (\"EngineCore encountered an "
               "issue\") and the server exits. The video and session checks (mblt_worker.py:724-728, 747-751) raise "
               "the same way.",
               "vllm-mblt bug: the seed's rule (one image, no video, for static releases) is enforced, but one "
               "client's request stops the server for everyone, where issue 14 asks for a clear error; ours refuses "
               "it in the front end with a 400 naming the count", _MBLT_DOCS),
    Difference(_MBLT, "mblt_vlm.vlm_image_rules[qwen3_vl]",
               r"\(500, \{'error': \{'message': 'EngineCore encountered an issue",
               "Two images in one request to a static Qwen3-VL release reach vllm-mblt's worker, whose check "
               "(_validate_mobilint_vlm_request_constraints, mblt_worker.py:734-739: \"supports exactly one image in "
               "the initial request, but got 2 image features\") raises RuntimeError inside execute_model; vLLM "
               "0.11.2's engine core treats that as fatal: the request gets HTTP 500 (\"EngineCore encountered an "
               "issue\") and the server exits. The video and session checks (mblt_worker.py:724-728, 747-751) raise "
               "the same way.",
               "vllm-mblt bug: the seed's rule (one image, no video, for static releases) is enforced, but one "
               "client's request stops the server for everyone, where issue 14 asks for a clear error; ours refuses "
               "it in the front end with a 400 naming the count", _MBLT_DOCS),
    Difference(_MBLT, "mblt_vlm.vlm_video",
               r"VideoMetadata.__init__\(\) missing 1 required positional argument: 'total_num_frames'",
               "A video sent inline as JPEG frames (a data:video/jpeg URL) to the dynamic Qwen3-VL release gets HTTP "
               "500 before vllm-mblt sees it: vLLM 0.11.2's VideoMediaIO.load_base64 returns the frames with empty "
               "metadata for video/jpeg (vllm/multimodal/video.py:271-279), and its Qwen3-VL processor builds "
               "transformers' VideoMetadata from it (vllm/model_executor/models/qwen3_vl.py:930), which needs "
               "total_num_frames.",
               "a vLLM 0.11.2 limit, not vllm-mblt's: its Qwen3-VL front end cannot take a video/jpeg data URL at "
               "all (vLLM 0.32 fills the metadata); the vendor's own video path (per-frame encoder calls, "
               "transformers-mblt) is not reached, so the scenario says nothing of it", _MBLT_DOCS),
    Difference(_MBLT, "mblt_vlm.vlm_vision_token_cap",
               r"\(400, \{'error': \{'message': \"Failed to apply MobilintQwen3VLSafeProcessor on data=.*"
               r"with kwargs=\{'do_resize': False\}",
               "vllm-mblt clamps the 1536x1536 image and a larger max_pixels override to the 4096-patch limit as "
               "ours does, and refuses do_resize=False with HTTP 400; the message is vLLM 0.11.2's generic \"Failed "
               "to apply MobilintQwen3VLSafeProcessor on data=... with kwargs={'do_resize': False}\" "
               "(vllm/multimodal/processing.py:1088-1093 re-raises without the cause's text), so the vendor's own "
               "ValueError (\"do_resize=False bypasses the 4096-token NPU vision-token ceiling ...\", "
               "transformers_mblt/models/qwen3_vl/processing_qwen3_vl.py:715-723) does not reach the client.",
               "the rule holds on both sides (clamp, 400); the wording differs: vLLM 0.11.2's front end drops the "
               "reason, which the scenario asks the client to see (\"do_resize=False\" and the limit)", _MBLT_DOCS),
    Difference(_MBLT, "mblt_vlm.vlm_start_rules", r"assert '--limit-mm-per-prompt image=2' in ''",
               "vllm-mblt's resolved config accepts --limit-mm-per-prompt image=2 for the static Qwen2-VL release "
               "(nothing checks the limit against the static vision MXQ; a request with two images then stops the "
               "engine, mblt_vlm.vlm_image_rules[qwen2_vl]). Checked by hand: a top-level mxq_path in "
               "--model-loader-extra-config is dropped without a word and the server starts "
               "(_normalize_model_kwargs_for_hf_config, mblt_worker.py:106, 127-146); with dev_no 1 and vision_dev_no 0 "
               "(two simulated cards) it answers with the golden tokens but logs no placement; the batch-compiled "
               "static Qwen3-VL release is refused at load (\"Batched Qwen3-VL text MXQs without a RoPE input are "
               "unsupported\", mblt_worker.py:1588-1598), as by ours.",
               "ours stricter: the seed has a static release take one image, and ours refuses a larger limit and a "
               "top-level mxq_path (the seed: use vision_mxq_path / text_mxq_path) at start; vllm-mblt ignores both "
               "until a request breaks the rule", _MBLT_DOCS),
    Difference(_MBLT, "mblt_vlm.vlm_prefix_cache_lm_only", r"assert 0 == 1\n.*where 0 = _encoded\(",
               "vllm-mblt logs nothing when its worker runs the vision encoder (_build_prompt_embeds, "
               "mblt_worker.py:3196-3200, for every new request: image features are not cached, as the seed says), "
               "so the scenario stops at its first check. Checked by hand past it: the first two requests are "
               "answered, but the repeated image prompt (196 tokens, 128 of them a vLLM prefix-cache hit) stops the "
               "engine: the worker feeds the text MXQ one window of 191 and then 256 tokens, above its compiled "
               "width of 128 (Model_ShapeMismatched at _forward_rows, mblt_worker.py:1704, which passes "
               "npu_prefill_chunk_size=width on the assumption that vLLM sized the step for the MXQ, "
               "mblt_worker.py:1697-1702); every later request gets HTTP 500.",
               "vllm-mblt bug behind a logged-evidence gap: the scenario's evidence of an image being encoded is a "
               "log line of our plugin, which vllm-mblt does not write; past it, a prefix-cache hit on an image "
               "prompt whose prefix exceeds the text MXQ's width stops vllm-mblt's server, where ours serves it "
               "with the golden tokens", _MBLT_DOCS),
    # ---------------------------------------------------------------- vllm-rbln 0.12.0 on rbln-sim
    Difference(_RBLN, "serving.prompt_logprobs",
               r"Refusal\(param='prompt_logprobs'.*500, 'EngineCore encountered an issue",
               "A request with prompt_logprobs kills vllm-rbln's engine: optimum_model_runner.py:1760 "
               "(_get_prompt_logprobs_dict) raises AttributeError: 'RBLNOptimumModelRunner' object has no "
               "attribute 'query_start_loc'; the request gets a 500 and the server exits.",
               "vllm-rbln bug: one request must never stop the server; the compiled prefill returns the last "
               "position's logits only, so the request should be refused with a 400, as ours does",
               _RBLN_DOCS),
    Difference(_RBLN, "serving.hostile_input",
               r"(?s)(?<!\d)6 of \d+ hostile requests mishandled:\n"
               r"  token id out of the vocabulary \(streamed\): HTTP 200 \(expected 400\).*"
               r"  stop_token_ids out of the vocabulary \(streamed\): HTTP 200 \(expected 400\).*"
               r"  logprobs = 1000 \(streamed\): HTTP 200 \(expected 400\).*"
               r"  chat top_logprobs = 1000 \(streamed\): HTTP 200 \(expected 400\).*"
               r"  refused prompt_logprobs \{\"prompt_logprobs\": 1\}: HTTP 500 \(expected 400\).*"
               r"/health is \d+ afterwards",
               "Four streamed requests refused after validation get a 200 with an error event instead of a 400, "
               "and prompt_logprobs stops the server (serving.prompt_logprobs).",
               "the streamed 200s are vLLM 0.30's front end (the vLLM vllm-rbln pins; our plugins add a "
               "middleware that answers 400 before the stream starts); the 500 is vllm-rbln's bug",
               _RBLN_DOCS),
    Difference(_RBLN, "serving.fault_once_retried",
               r"HTTP 500: .*EngineCore encountered an issue",
               "One failed runtime call (the simulator's injected timeout at call 21) stops vllm-rbln's engine: "
               "the requests in flight get a 500 and the server exits.",
               "the seed asks for no retry: no wrong token on either side; ours retries the call once (it "
               "rewrites the same KV), so a transient device error costs vllm-rbln its server and ours nothing",
               _RBLN_DOCS),
    Difference(_RBLN, "rbln_serving.vllm_path_served",
               r"cannot import name 'triton' from 'npusim\.rbln'",
               "--model-impl vllm on a Rebel100 stops at vllm_rbln/v1/attention/ops/triton_attention_naive.py:17, "
               "`from rebel import triton`.",
               "the simulator's gap (the emulator has the bug): npusim.rbln has no rebel.triton, no "
               "rbln_custom_ops attention_naive ops and no torch.rbln device tensors, which this path of "
               "vllm-rbln uses",
               _RBLN_DOCS),
    Difference(_RBLN, "rbln_serving.impl_matrix",
               r"--model-impl vllm on RBLN-CR13 with .*cannot import name 'triton' from 'npusim\.rbln'",
               "Every ATOM case resolves as ours (the same paths, the same refusals word for word); on a Rebel100 "
               "the vllm path's engine config stops at `from rebel import triton` (platform/vllm_impl.py).",
               "the simulator's gap, as rbln_serving.vllm_path_served", _RBLN_DOCS),
    Difference(_RBLN, "rbln_serving.chunked_long_prompt", r"RBLN prefill: 6",
               "vllm-rbln serves the 600-token prompt in 128-token chunks with the golden output, and logs no "
               "chunk count.", _OURS_LOGGED.format(what="5 chunks of 128"), _RBLN_DOCS),
    Difference(_RBLN, "rbln_serving.decode_buckets_and_padding", r"no decode layout logged",
               "vllm-rbln serves 3 concurrent requests with the golden outputs, and logs no decode batch layout.",
               _OURS_LOGGED.format(what="the smallest fitting decoder and its padding"), _RBLN_DOCS),
    Difference(_RBLN, "rbln_serving.prefix_reuse", r"no in-place reuse of 256 tokens logged",
               "vllm-rbln answers the three prompts sharing 256 tokens with the golden outputs, and logs no "
               "prefix reuse.", _OURS_LOGGED.format(what="in-place and copied KV block reuse"), _RBLN_DOCS),
    Difference(_RBLN, "rbln_serving.compile_cache_reuse_and_invalidation", r"'RBLN compile: done in' in",
               "vllm-rbln's three starts (cold, warm, changed --max-num-seqs) give equal, golden outputs; it "
               "logs its cache use in its own words.",
               _OURS_LOGGED.format(what="compile, cache hit and recompile"), _RBLN_DOCS),
    Difference(_RBLN, "rbln_serving.compiled_dir_served", r"'RBLN load: compiled model' in",
               "vllm-rbln serves optimum-rbln's own export with the golden outputs, and logs the load in its "
               "own words.", _OURS_LOGGED.format(what="a load without compiling"), _RBLN_DOCS),
)


def known(column: str, scenario: str) -> Difference | None:
    """The recorded difference of ``scenario`` on ``column``, or None."""
    for d in KNOWN:
        if (d.column, d.scenario) == (column, scenario):
            return d
    return None
