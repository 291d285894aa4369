"""The ``npu-harness`` command: ``conformance``, ``doctor``, ``alias``, ``make-model``, ``mxq compile``.

Device issues add their own subcommands (``mxq compile``...) in :func:`build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from npu_conformance.report import DEFAULT_REPORT_DIR


def _cmd_conformance(args: argparse.Namespace) -> int:
    import pytest

    from npu_conformance import report as report_mod
    from npu_conformance import targets as tg

    names = args.target or tg.env_targets() or [tg.SIM_ALIAS]
    try:
        tg.expand(names)
        worker_args(args.pytest_args)
    except (tg.UnknownTargetError, ValueError) as exc:
        print(f"npu-harness conformance: {exc}", file=sys.stderr)
        return 2
    if args.vendor:
        columns = tg.vendor_columns(names)
        if not columns:
            print(f"npu-harness conformance: --vendor: no vendor column runs on {', '.join(tg.expand(names))} "
                  f"(vendor columns: {', '.join(n for n, t in tg.TARGETS.items() if t.kind == 'vendor')})",
                  file=sys.stderr)
            return 2
        code = _build_vendor_envs(columns)
        if code:
            return code
        names = [*names, *columns]
    out = Path(args.report)
    pytest_args = ["--pyargs", "npu_conformance.scenarios", "-p", "no:cacheprovider",
                   "--report", str(out), "-q", "-rN"]
    for name in names:
        pytest_args += ["--target", name]
    pytest_args += worker_args(args.pytest_args)
    pytest_args += args.pytest_args
    code = pytest.main(pytest_args)
    if code == pytest.ExitCode.NO_TESTS_COLLECTED or not (out / "report.json").exists():
        print("npu-harness conformance: no scenario ran; no report written", file=sys.stderr)
        return 1
    print()
    print(report_mod.format_text(report_mod.load(out)))
    print(f"\nreport: {out / 'report.json'}, {out / 'report.md'}")
    return int(code)


#: The variable that sets how many pytest-xdist workers ``conformance`` (and ``./dev test``) run.
WORKERS_ENV = "NPU_HARNESS_TEST_WORKERS"
DEFAULT_WORKERS = 2


def worker_args(pytest_args: Sequence[str], environ: dict[str, str] | None = None) -> list[str]:
    """The pytest-xdist arguments of a conformance run: ``-n N --dist loadfile`` (the lab-aware
    scheduler splits the scenarios by target and module, :mod:`npu_conformance.xdist_scheduling`),
    N from ``NPU_HARNESS_TEST_WORKERS`` (default 2; ``0``: one process, no xdist); none when the
    user's own ``pytest_args`` choose (``-n``, ``--numprocesses``, ``-p no:xdist``) or pytest-xdist
    is not installed.

    Raises:
        ValueError: ``NPU_HARNESS_TEST_WORKERS`` is not a whole number >= 0 (the message names it).
    """
    import importlib.util
    import os

    env = os.environ if environ is None else environ
    for i, a in enumerate(pytest_args):
        if a in ("-n", "--numprocesses") or a.startswith(("-n", "--numprocesses=", "--dist")):
            return []
        if a == "-p" and i + 1 < len(pytest_args) and pytest_args[i + 1] == "no:xdist":
            return []
    raw = env.get(WORKERS_ENV, "").strip() or str(DEFAULT_WORKERS)
    if not raw.isdigit():
        raise ValueError(f"{WORKERS_ENV}={raw!r}: expected a whole number of workers >= 0 (0: no xdist)")
    n = int(raw)
    if n == 0 or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(n), "--dist", "loadfile"]


def _build_vendor_envs(columns: list[str]) -> int:
    """Build (or find cached) the environments of ``columns``; 0, or 2 after printing why not."""
    import os

    from npu_conformance import vendor_envs

    for column in columns:
        env = vendor_envs.by_column(column)
        if os.environ.get(env.override_var):
            continue  # an environment built elsewhere
        try:
            where, built = env.build()
        except vendor_envs.VendorEnvError as exc:
            print(f"npu-harness conformance --vendor: {exc}", file=sys.stderr)
            return 2
        print(f"{column}: {'built' if built else 'cached'} {env.plugin} environment {where}", flush=True)
    return 0


def _cmd_vendor_env(args: argparse.Namespace) -> int:
    from npu_conformance import vendor_envs

    env = vendor_envs.VENDOR_ENVS[args.name]
    try:
        where, built = env.build(Path(args.out) if args.out else None, force=args.force)
    except vendor_envs.VendorEnvError as exc:
        print(f"npu-harness vendor-env {args.name}: {exc}", file=sys.stderr)
        return 2
    print(f"{env.plugin} environment {'built' if built else 'already built (same lock)'}: {where}")
    if args.out:
        print(f"use it with: export {env.override_var}={where}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from npu_conformance import targets as tg

    required = args.require or []
    unknown = [n for n in required if n not in tg.TARGETS]
    if unknown:
        print(f"npu-harness doctor: unknown target {unknown[0]!r}; expected one of: "
              f"{', '.join(tg.TARGETS)}", file=sys.stderr)
        return 2
    from npu_conformance.host import host_lines

    lines = host_lines()
    width = max(len(label) for label, _ in lines) + 1
    for label, text in lines:
        print(f"{label + ':':<{width}} {text}")
    print()
    for name in tg.TARGETS:
        avail = tg.availability(name)
        state = "available  " if avail.available else "unavailable"
        print(f"{name:<11} {state} {avail.reason}")
    missing = [n for n in required if not tg.availability(n).available]
    for name in missing:
        print(f"npu-harness doctor: required target {name} is unavailable: "
              f"{tg.availability(name).reason}", file=sys.stderr)
    return 1 if missing else 0


def _cmd_alias(args: argparse.Namespace) -> int:
    import sysconfig

    from npusim import alias

    try:
        site = alias.site_packages_of(Path(args.env)) if args.env else Path(sysconfig.get_paths()["purelib"])
        if args.alias_command == "install":
            print(f"alias start-up hook written to {alias.install_pth(site)}")
        elif args.alias_command == "remove":
            removed = alias.remove_pth(site)
            print(f"alias start-up hook removed: {removed}" if removed else f"no alias start-up hook in {site}")
        else:
            for name in alias.ALIASES:
                print(f"alias {name}: {alias.status(name).describe()}")
            hook = alias.installed_pth(site)
            print(f"alias hook: {'installed ' + str(hook) if hook else 'not installed in ' + str(site)}")
    except OSError as exc:
        print(f"npu-harness alias {args.alias_command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_make_model(args: argparse.Namespace) -> int:
    from npusim import tinymodel

    try:
        if args.arch == "qwen3_asr":
            if args.eagle3:
                raise ValueError("--eagle3 needs --arch llama, qwen2 or qwen3, not qwen3_asr")
            from npusim.tinymodel.asr import build_qwen3_asr

            path = build_qwen3_asr(Path(args.out), seed=args.seed)
        elif args.arch in ("qwen2_vl", "qwen3_vl"):
            if args.eagle3:
                raise ValueError(f"--eagle3 needs --arch llama, qwen2 or qwen3, not {args.arch}")
            from npusim.tinymodel.vlm import build_qwen2_vl, build_qwen3_vl

            build_vlm = build_qwen2_vl if args.arch == "qwen2_vl" else build_qwen3_vl
            path = build_vlm(Path(args.out), seed=args.seed)
        elif args.eagle3:
            from npusim.tinymodel.eagle3 import build_eagle3

            path = build_eagle3(Path(args.out), base_arch=args.arch, seed=args.seed)
        else:
            path = tinymodel.build(args.arch, Path(args.out), seed=args.seed)
    except ImportError as exc:
        print(f"npu-harness make-model: {exc} (install the 'models' extra)", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"npu-harness make-model: {exc}", file=sys.stderr)
        return 2
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    what = f"{args.arch} EAGLE-3 base + draft (draft in {path / 'eagle3_draft'})" if args.eagle3 else f"{args.arch} model"
    print(f"{what} (seed {args.seed}) written to {path} ({total / 1e6:.2f} MB)")
    return 0


def _parse_chunk(text: str) -> int | dict:
    """``--prefill-chunk-size``: an integer or a JSON object; raises ValueError naming the text."""
    import json

    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--prefill-chunk-size {text!r} must be an integer or a JSON object") from None
    if not isinstance(value, (int, dict)) or isinstance(value, bool):
        raise ValueError(f"--prefill-chunk-size {text!r} must be an integer or a JSON object")
    return value


def _asr_refusals(args: argparse.Namespace) -> str | None:
    """Why the ``mxq compile`` flags given cannot build a Qwen3-ASR release (None: they can).

    Every flag of the MoE and EAGLE-3 groups and a ``--max-batch-size`` other than 1 is refused,
    named with the reason.
    """
    given = [flag for flag, on in (
        ("--max-batch-size", args.max_batch_size != 1), ("--moe-devices", args.moe_devices is not None),
        ("--moe-unpacked", args.moe_unpacked), ("--moe-last-only", args.moe_last_only),
        ("--moe-declare-output-order", args.moe_declare_output_order), ("--eagle3", args.eagle3),
        ("--eagle3-tree", args.eagle3_tree is not None), ("--eagle3-draft", args.eagle3_draft is not None),
    ) if on]
    why = {"--max-batch-size": f"--max-batch-size {args.max_batch_size}: a Qwen3-ASR release's decoder MXQ is "
                               "compiled for batch 1 and its config declares no max_batch_size (serve it with "
                               "--max-num-seqs 1)"}
    reasons = [why.get(f, f"{f}: {'Mixture-of-Experts' if f.startswith('--moe') else 'EAGLE-3'} options do not "
                          "apply to a Qwen3-ASR checkpoint") for f in given]
    return "; ".join(reasons) if reasons else None


def _is_asr_checkpoint(hf_dir: Path) -> bool:
    """Whether ``hf_dir/config.json`` declares a Qwen3-ASR checkpoint (model_type qwen3_asr)."""
    import json

    from npusim.mxq.compile import ASR_TYPES

    try:
        raw = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") in ASR_TYPES


def _checkpoint_type(hf_dir: Path) -> str | None:
    """``hf_dir/config.json``'s ``model_type`` (None: unreadable)."""
    import json

    try:
        raw = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return raw.get("model_type") if isinstance(raw, dict) else None


def _vlm_options(args: argparse.Namespace) -> dict:
    """The ``--vision*`` / ``--text-layout`` flags given, as ``compile_artifact``'s ``vlm`` options."""
    given = {"vision": args.vision, "text_layout": args.text_layout, "vision_layout": args.vision_layout,
             "vision_output_order": args.vision_output_order, "vision_max_patches": args.vision_max_patches}
    return {k: v for k, v in given.items() if v is not None}


def _vlm_refusals(args: argparse.Namespace) -> str | None:
    """Why the ``mxq compile`` flags given cannot build a Qwen2-VL / Qwen3-VL release (None: they can)."""
    given = [flag for flag, on in (
        ("--moe-devices", args.moe_devices is not None), ("--moe-unpacked", args.moe_unpacked),
        ("--moe-last-only", args.moe_last_only), ("--moe-declare-output-order", args.moe_declare_output_order),
        ("--eagle3", args.eagle3), ("--eagle3-tree", args.eagle3_tree is not None),
        ("--eagle3-draft", args.eagle3_draft is not None),
    ) if on]
    reasons = [f"{f}: {'Mixture-of-Experts' if f.startswith('--moe') else 'EAGLE-3'} "
               "options do not apply to a Qwen2-VL / Qwen3-VL release" for f in given]
    return "; ".join(reasons) if reasons else None


def _cmd_mxq_compile(args: argparse.Namespace) -> int:
    from npusim.llm import CheckpointError, UnsupportedModelError
    from npusim.mxq.compile import VLM_TYPES, compile_artifact

    asr = _is_asr_checkpoint(Path(args.hf_dir))
    refused = _asr_refusals(args) if asr else None
    if refused:
        print(f"npu-harness mxq compile: {args.hf_dir} is a Qwen3-ASR checkpoint: {refused}", file=sys.stderr)
        return 2
    vlm_type = _checkpoint_type(Path(args.hf_dir))
    vlm = vlm_type in VLM_TYPES
    refused = _vlm_refusals(args) if vlm else None
    if refused:
        print(f"npu-harness mxq compile: {args.hf_dir} is a {vlm_type} checkpoint: {refused}", file=sys.stderr)
        return 2
    if asr and _vlm_options(args):
        print(f"npu-harness mxq compile: {args.hf_dir} is a Qwen3-ASR checkpoint: the --vision* / --text-layout "
              "options apply to Qwen2-VL / Qwen3-VL checkpoints only", file=sys.stderr)
        return 2
    try:
        path = compile_artifact(
            Path(args.hf_dir), Path(args.out), max_batch_size=args.max_batch_size,
            max_cache_size=args.max_cache_size, max_width=args.max_width, core_mode=args.core_mode,
            prefill_chunk_size=_parse_chunk(args.prefill_chunk_size), output_logits=args.output_logits,
            memory_flexible=not args.memory_fixed, hub_proxy=args.hub_proxy, moe=_moe_options(args),
            eagle3=_eagle3_options(args), vlm=_vlm_options(args) or None,
        )
    except (ValueError, OSError, CheckpointError, UnsupportedModelError) as exc:
        print(f"npu-harness mxq compile: {exc}", file=sys.stderr)
        return 2
    except NotImplementedError as exc:
        print(f"npu-harness mxq compile: not built: {exc}", file=sys.stderr)
        return 2
    moe = (path / "mxq" / "lm_head.mxq").is_file()
    family = {"qwen2_vl": "Qwen2-VL", "qwen3_vl": "Qwen3-VL"}.get(vlm_type or "")
    kind = (f"{family} release: vision.mxq, text.mxq" if vlm else
            "Qwen3-ASR release: audio_encoder.mxq, decoder.mxq" if asr else
            "Mixture-of-Experts release: mxq/" if moe else
            "EAGLE-3 release: mxq/base.mxq, draft.mxq, fc.mxq" if (path / "mxq" / "fc.mxq").is_file() else "model.mxq")
    print(f"MXQ artifact written to {path} ({kind}, config.json, model.safetensors)")
    return 0


def _moe_options(args: argparse.Namespace) -> dict:
    """The ``--moe-*`` flags given, as ``compile_artifact``'s ``moe`` options."""
    given = {"devices": args.moe_devices, "packed": False if args.moe_unpacked else None,
             "last_only": True if args.moe_last_only else None,
             "declare_output_order": True if args.moe_declare_output_order else None}
    return {k: v for k, v in given.items() if v is not None}


def _eagle3_options(args: argparse.Namespace) -> dict | None:
    """``compile_artifact``'s ``eagle3`` options from ``--eagle3`` / ``--eagle3-*`` (None: none given)."""
    opts: dict = {}
    if args.eagle3_tree is not None:
        opts.update(zip(("tree_depth", "tree_top_k", "num_assistant_tokens"), args.eagle3_tree))
    if args.eagle3_draft is not None:
        opts["draft_dir"] = args.eagle3_draft
    return opts if (opts or args.eagle3) else None


def _cmd_rbln_architectures(args: argparse.Namespace) -> int:
    from vllm_npu.rbln.architectures import format_listing

    print(format_listing(args.device, args.impl))
    return 0


def _cmd_rbln_compile(args: argparse.Namespace) -> int:
    from vllm_npu.rbln import aot_compile as aot

    try:
        aot.compile_model(
            args.hf_dir, args.out, max_model_len=args.max_model_len, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, npu=args.npu,
            decoder_batch_sizes=aot.parse_batch_sizes(args.decoder_batch_sizes),
            optimum_overrides=aot.parse_overrides(args.optimum_overrides))
    except (aot.AotInputError, aot.AotCompileError) as exc:
        print(f"npu-harness rbln compile: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, aot.AotInputError) else 1
    return 0


def _cmd_ime2_build_driver(args: argparse.Namespace) -> int:
    """``npu-harness ime2 build-driver``: :func:`npu_conformance.qemu_ime2.build_driver`.

    Prints ``riscv64 IME2 driver: <path>`` on success or when it is already built (nothing with
    ``--quiet``); a progress line on stderr before a build. Exit 2 with the reason on stderr when
    it cannot be built (a missing tool named with its Debian package, make's output).
    """
    import os

    from npu_conformance import qemu_ime2
    from vllm_npu.ime2.sources import KernelSourcesMissingError, kernel_source_dir

    try:
        if not args.quiet and (args.force or not qemu_ime2.is_built()):
            print(f"npu-harness ime2 build-driver: cross-building the riscv64 driver from {kernel_source_dir()} "
                  f"into {qemu_ime2.build_dir()}", file=sys.stderr)
        path = qemu_ime2.build_driver(force=args.force)
    except (qemu_ime2.DriverBuildError, KernelSourcesMissingError, OSError) as exc:
        print(f"npu-harness ime2 build-driver: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"riscv64 IME2 driver: {path}")
        override = os.environ.get(qemu_ime2.DRIVER_ENV)
        if override and Path(override) != path:
            print(f"npu-harness ime2 build-driver: note: ${qemu_ime2.DRIVER_ENV}={override} is set, so the "
                  "ime2-qemu target runs that driver instead", file=sys.stderr)
    return 0


def _cmd_ime2_predict(args: argparse.Namespace) -> int:
    """``npu-harness ime2 predict``: the SM10 board performance model (:mod:`npusim.q4x32.perf`).

    ``--gemm K N M``: predicted time and GOP/s of one Ime2HpGemm on ``--cores`` A100 cores (1, as
    the seed's GEMM table) with the split of the time; ``--model M``: predicted prompt and decode
    tokens/s of the seed's run on ``--path``; ``--table``: every row of the seed's three tables,
    the visible rows with their measured value and error; ``--params``: the fitted parameters.
    Exit 2 with the value and the rule on stderr for bad input (no traceback).
    """
    from npusim.q4x32 import perf

    if not (args.gemm or args.model or args.table or args.params):
        print("npu-harness ime2 predict: give --gemm K N M, --model NAME_OR_CONFIG, --table or --params",
              file=sys.stderr)
        return 2
    try:
        if args.params:
            print(perf.format_params())
        if args.gemm:
            k, n, m = args.gemm
            g = perf.predict_gemm(k, n, m, cores=args.cores)
            c = perf.instruction_counts(k, n, m, cores=args.cores)
            print(f"IME2 GEMM K={k} N={n} M={m} on {args.cores} A100 core(s): {g.gops:.2f} GOP/s, "
                  f"{g.seconds * 1e6:.1f} us")
            print(f"  passes {c.passes} ({c.hp} .hp, {c.weight_bytes} weight bytes): {g.pass_seconds * 1e6:.1f} us "
                  f"(.hp issue and weight streaming, not separable on the visible rows)")
            print(f"  row epilogue ({c.row_passes} row passes): {g.row_seconds * 1e6:.1f} us; scalar tail "
                  f"({c.tail_columns} columns): {g.tail_seconds * 1e6:.1f} us; call: {g.call_seconds * 1e6:.1f} us")
            print(f"  bound: {g.bound}")
        if args.model:
            cfg = perf.resolve_model(args.model)
            t = perf.predict_tokens(cfg, args.path)
            cores = "eight A100 cores" if args.path == "ime2" else "seven X100 cores"
            print(f"{cfg.name} on the {args.path} path ({cores}), prompt {t.prompt_tokens} tokens, "
                  f"{perf.NEW_TOKENS} new: prompt {t.prompt_tps:.3g} tokens/s ({t.prefill_seconds:.3g} s), "
                  f"decode {t.decode_tps:.3g} tokens/s ({t.decode_seconds:.3g} s for {perf.DECODE_TIMED})")
        if args.table:
            print(perf.format_table())
    except perf.PerfModelInputError as exc:
        print(f"npu-harness ime2 predict: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_neuron_plan(args: argparse.Namespace) -> int:
    from vllm_npu.neuron.plan_cli import main as plan_main

    return plan_main(args.vllm_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="npu-harness",
        description="vLLM NPU plugins, device simulators and their conformance suite.",
    )
    from npu_conformance.version import harness_version

    parser.add_argument("--version", action="version", version=f"npu-harness {harness_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    conf = sub.add_parser("conformance", help="run the conformance suite and write the report")
    conf.add_argument("--target", action="append", metavar="T",
                      help="target (repeatable): 'sim' or a target name; default: "
                           "$NPU_HARNESS_TARGET, else sim")
    conf.add_argument("--report", default=DEFAULT_REPORT_DIR, metavar="DIR",
                      help=f"directory for report.json and report.md (default: {DEFAULT_REPORT_DIR})")
    conf.add_argument("--vendor", action="store_true",
                      help="also run the vendors' own vLLM plugins on the selected simulators, as report "
                           "columns beside ours (builds their environments once, cached by lock; needs PyPI "
                           "the first time)")
    conf.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                      help="extra pytest arguments after '--' (e.g. -- -k chunked -n 2)")
    conf.set_defaults(func=_cmd_conformance)

    from npu_conformance.vendor_envs import VENDOR_ENVS

    ve = sub.add_parser("vendor-env", help="build a vendor's own vLLM plugin stack, unpatched, in an environment "
                                           "of its own over our simulator (cached by its lock's digest)")
    ve.add_argument("name", choices=sorted(VENDOR_ENVS),
                    help="; ".join(f"{e.name}: {e.plugin} on {e.sim_target} ({e.size})" for e in VENDOR_ENVS.values()))
    ve.add_argument("--out", metavar="DIR", help="build here instead of <cache>/vendor-envs/<name>-<digest> "
                                                 "(then point $NPU_HARNESS_VENDOR_ENV_<NAME> at it)")
    ve.add_argument("--force", action="store_true", help="rebuild even when a build of the same lock is there")
    ve.set_defaults(func=_cmd_vendor_env)

    doc = sub.add_parser("doctor", help="this CPU's instruction sets and kernel builds; which targets "
                                        "this machine can run, and why not the others")
    doc.add_argument("--require", action="append", metavar="T",
                     help="exit 1 unless target T is available (repeatable; for board runners)")
    doc.set_defaults(func=_cmd_doctor)

    al = sub.add_parser("alias", help="the start-up hook that lets 'import rebel' / 'import qbruntime' "
                                      "load the simulators (npusim.alias)")
    al.add_argument("alias_command", choices=("install", "remove", "status"),
                    help="write or delete the .pth hook in the environment's site-packages, or show "
                         "what each vendor name imports here")
    al.add_argument("--env", metavar="VENV",
                    help="virtual environment directory (default: this interpreter's site-packages)")
    al.set_defaults(func=_cmd_alias)

    mm = sub.add_parser("make-model", help="build a tiny Hugging Face checkpoint locally "
                                           "(qwen3_asr: a Qwen3-ASR checkpoint in the original release "
                                           "layout, fitted to transcribe npusim.tinymodel.asr.CLIPS; "
                                           "qwen2_vl / qwen3_vl: a Qwen2-VL / Qwen3-VL checkpoint)")
    mm.add_argument("--arch", required=True,
                    choices=("llama", "qwen2", "qwen3", "exaone4", "hyperclovax", "qwen3_moe", "qwen3_asr",
                             "qwen2_vl", "qwen3_vl"),
                    help="qwen3_asr: a Qwen3-ASR checkpoint (original release layout, WhisperFeatureExtractor, "
                         "audio-only chat template) whose LM head is fitted so greedy decoding transcribes "
                         "npusim.tinymodel.asr.CLIPS to TRANSCRIPTS; qwen2_vl / qwen3_vl: a random-weight "
                         "Qwen2-VL / Qwen3-VL checkpoint in transformers 5.19's layout (vision tower, "
                         "Qwen2VLImageProcessor preprocessor config, image/video chat template; "
                         "npusim.tinymodel.vlm)")
    mm.add_argument("--out", required=True, metavar="DIR")
    mm.add_argument("--seed", type=int, default=0, metavar="N")
    mm.add_argument("--eagle3", action="store_true",
                    help="also build a one-block EAGLE-3 draft fitted to the base, in DIR/eagle3_draft "
                         "(--arch llama, qwen2 or qwen3; the base gets 4 layers)")
    mm.set_defaults(func=_cmd_make_model)

    mxq = sub.add_parser("mxq", help="Mobilint MXQ artifacts for the npusim.mxq simulator")
    mxq_sub = mxq.add_subparsers(dest="mxq_command", required=True, metavar="MXQ_COMMAND")
    comp = mxq_sub.add_parser("compile", help="compile a tiny HF checkpoint into an MXQ artifact directory")
    comp.add_argument("hf_dir", metavar="HF_DIR")
    comp.add_argument("--out", required=True, metavar="DIR")
    comp.add_argument("--max-batch-size", type=int, default=1, metavar="K", help="cache ids per model (default 1)")
    comp.add_argument("--max-cache-size", type=int, default=None, metavar="T",
                      help="KV capacity in tokens per cache id (default min(max_position_embeddings, 4096))")
    comp.add_argument("--max-width", type=int, default=None, metavar="W",
                      help="max tokens per item per infer call (default max(128, largest chunk); batch MXQs: at most and by default 128)")
    comp.add_argument("--core-mode", default="single", metavar="M",
                      help="auto, single (default), multi, global4 or global8")
    comp.add_argument("--prefill-chunk-size", default="128", metavar="INT|JSON",
                      help='npu_prefill_chunk_size: an integer or e.g. \'{"single": 64, "global4": 256}\'')
    comp.add_argument("--output-logits", default="last", choices=("last", "all"))
    comp.add_argument("--memory-fixed", action="store_true",
                      help="an older compiler's MXQ: never shares an explicitly named core with another model")
    comp.add_argument("--hub-proxy", action="store_true",
                      help="also write the Hub releases' auto_map + proxy_<family>.py (transformers-mblt classes), "
                           "for --trust-remote-code in vllm-mblt's own environment")
    moe = comp.add_argument_group("Mixture-of-Experts release (a qwen3_moe checkpoint)")
    moe.add_argument("--moe-devices", type=int, default=None, metavar="N",
                     help="cards of the default placement (default 3, as the release: shared MXQs round-robin, "
                          "experts on every core, lm_head on 'N-1:0:0')")
    moe.add_argument("--moe-unpacked", action="store_true", help="one file per MXQ instead of per-layer packs")
    moe.add_argument("--moe-last-only", action="store_true",
                     help="the last layer's shared MXQ emits only the last token")
    moe.add_argument("--moe-declare-output-order", action="store_true",
                     help="write moe_shared_output_order to config.json (else found by shape and scale)")
    e3 = comp.add_argument_group("EAGLE-3 release (a llama/qwen2/qwen3 base with its draft in HF_DIR/eagle3_draft)")
    e3.add_argument("--eagle3", action="store_true",
                    help="write the EAGLE-3 release (base.mxq, draft.mxq, fc.mxq); implied by the other --eagle3-* flags")
    e3.add_argument("--eagle3-tree", type=int, nargs=3, default=None, metavar=("DEPTH", "TOPK", "NUM_ASSISTANT_TOKENS"),
                    help="the draft tree written to config.json and generation_config.json (default 5 8 64, the vendor's)")
    e3.add_argument("--eagle3-draft", default=None, metavar="DIR", help="the draft checkpoint (default HF_DIR/eagle3_draft)")
    vl = comp.add_argument_group("Qwen2-VL / Qwen3-VL release (a qwen2_vl / qwen3_vl checkpoint: vision.mxq + text.mxq)")
    vl.add_argument("--vision", choices=("static", "dynamic"), default=None,
                    help="static (default): one fixed frame per vision infer (224x224 Qwen2-VL, 256x256 Qwen3-VL), "
                         "text MXQ without RoPE input; dynamic: any grid up to --vision-max-patches, host-side "
                         "RoPE (and Qwen3-VL position embeddings), text MXQ with a RoPE input")
    vl.add_argument("--text-layout", default=None, metavar="LAYOUT",
                    help="bundled (default) or split (Qwen3-VL: one DeepStack input per layer); the RoPE input "
                         "follows --vision; the explicit bundled_static, bundled_rope, split_static, split_rope must "
                         "agree with it. A bundled RoPE build with --max-batch-size > 1 takes (embeds, rope, "
                         "deepstack), the batch order")
    vl.add_argument("--vision-layout", default=None, metavar="LAYOUT",
                    help="the vision MXQ's inputs: Qwen2-VL dynamic rope (2 inputs, default) or cos_sin (3); "
                         "Qwen3-VL static folded (1,256,1536) (default) or legacy (1024,64,6); Qwen3-VL dynamic "
                         "the slot order rope,pos,folded (default, the shipped 8B's) or folded,pos,rope")
    vl.add_argument("--vision-output-order", default=None, metavar="M,D0,D1,D2",
                    help="Qwen3-VL: indices of the merger and DeepStack 0..2 among the vision MXQ's outputs "
                         "(default 0,2,3,1, transformers-mblt's default); written to vision_config")
    vl.add_argument("--vision-max-patches", type=int, default=None, metavar="N",
                    help="dynamic vision: most pre-merge patches per infer (default 4096)")
    comp.epilog = ("A qwen2_vl / qwen3_vl checkpoint (detected from config.json) becomes a Mobilint VLM release: "
                   "vision.mxq, text.mxq, config.json with vision_config/text_config NPU fields, model.safetensors "
                   "(host embeddings); --max-batch-size applies to the text MXQ; --hub-proxy writes the Hub releases' "
                   "proxy_qwen2_vl.py / proxy_qwen3_vl.py and auto_map; the MoE / EAGLE-3 flags are refused. "
                   "A qwen3_asr checkpoint (detected from config.json) becomes a Qwen3-ASR release: audio_encoder.mxq "
                   "(one 100-frame mel window per infer) and decoder.mxq (the thinker's text model, batch 1, KV 2048 "
                   "tokens by default); --max-batch-size other than 1 and the MoE / EAGLE-3 flags are refused.")
    comp.set_defaults(func=_cmd_mxq_compile)

    rbln = sub.add_parser("rbln", help="Rebellions RBLN plugin (vllm_npu.rbln): architectures, AOT compile")
    rbln_sub = rbln.add_subparsers(dest="rbln_command", required=True, metavar="RBLN_COMMAND")
    archs = rbln_sub.add_parser("architectures", help="the supported architectures per model "
                                                      "implementation, device family and category")
    archs.add_argument("--device", choices=("atom", "rebel100"), help="one device family (default: both)")
    archs.add_argument("--impl", choices=("vllm", "transformers", "optimum"),
                       help="one model implementation; optimum is transformers (default: both)")
    archs.set_defaults(func=_cmd_rbln_architectures)
    rc = rbln_sub.add_parser("compile", help="compile a Hugging Face decoder ahead of time with "
                                             "optimum-rbln into a directory `vllm serve DIR` loads")
    rc.add_argument("hf_dir", metavar="HF_DIR")
    rc.add_argument("--out", required=True, metavar="DIR", help="the compiled directory (new or empty)")
    rc.add_argument("--max-model-len", type=int, metavar="N",
                    help="compiled max_seq_len (default: config.json max_position_embeddings)")
    rc.add_argument("--block-size", type=int, metavar="N",
                    help="KV block: the model length for eager attention (default), or a flash "
                         "attention partition dividing it")
    rc.add_argument("--max-num-seqs", type=int, default=1, metavar="N", help="compiled batch size (default 1)")
    rc.add_argument("--npu", metavar="NAME", help="target NPU, e.g. RBLN-CA25 (default: rebel.get_npu_name(0), "
                                                  "else $RBLN_FORCE_NPU_NAME)")
    rc.add_argument("--decoder-batch-sizes", metavar="B,B,...", help="compiled decode batches, e.g. 4,2,1 "
                                                                     "(default: the batch size)")
    rc.add_argument("--optimum-overrides", metavar="JSON",
                    help="JSON object laid over the derived rbln_config; may not change derived values")
    rc.set_defaults(func=_cmd_rbln_compile)
    ime2 = sub.add_parser("ime2", help="SpacemiT K3 IME2 kernel: the riscv64 QEMU driver, the board's performance model")
    ime2_sub = ime2.add_subparsers(dest="ime2_command", required=True, metavar="IME2_COMMAND")
    bd = ime2_sub.add_parser("build-driver", help="cross-build the riscv64 driver (ime2-qemu target) into "
                                                  "the user cache directory; a no-op when built")
    bd.add_argument("--force", action="store_true", help="rebuild even when the driver exists")
    bd.add_argument("--quiet", action="store_true", help="print nothing on success (errors still go to stderr)")
    bd.set_defaults(func=_cmd_ime2_build_driver)
    pr = ime2_sub.add_parser("predict", help="the SM10 board performance model (npusim.q4x32.perf): GEMM GOP/s "
                                             "of one A100 core, tokens/s of a model, the seed's tables")
    pr.add_argument("--gemm", nargs=3, type=int, metavar=("K", "N", "M"),
                    help="predicted GOP/s and time of one Ime2HpGemm (K a multiple of 32)")
    pr.add_argument("--cores", type=int, default=1, metavar="C",
                    help="A100 cores the N tiles are split over for --gemm (default 1, as the seed's GEMM table)")
    pr.add_argument("--model", metavar="HF_DIR_OR_CONFIG",
                    help="a HF directory with config.json, a config.json, or a shipped model name "
                         "(e.g. 'SmolLM2 135M'): predicted prompt and decode tokens/s of the seed's run")
    pr.add_argument("--path", choices=("ime2", "rvv"), default="ime2",
                    help="for --model: IME2 int4 on eight A100 cores (default) or the stock RVV bf16 path")
    pr.add_argument("--table", action="store_true",
                    help="every row of the seed's three tables, the visible rows with measured value and error")
    pr.add_argument("--params", action="store_true", help="print the fitted parameters and the fits' residuals")
    pr.set_defaults(func=_cmd_ime2_predict)
    neuron = sub.add_parser("neuron", help="AWS Neuron plugin (vllm_npu.neuron): the plan of a configuration")
    neuron_sub = neuron.add_subparsers(dest="neuron_command", required=True, metavar="NEURON_COMMAND")
    np_ = neuron_sub.add_parser("plan", help="print the Neuron plan (compile targets, KV budget and blocks, "
                                             "runner, validation errors) of vllm serve options, as JSON; "
                                             "starts no engine", prefix_chars="\0")
    np_.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="--model DIR [vllm serve options]")
    np_.set_defaults(func=_cmd_neuron_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
