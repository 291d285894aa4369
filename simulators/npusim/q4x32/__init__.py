"""Q4_0 x 32 tile math and the IME2 ``.hp`` instruction model (numpy only).

The SpacemiT K3 "IME2" int4 GEMM (``ime2_hp_gemm_cpu`` in the seed; llama.cpp's SpacemiT backend at
commit 81b0d882 is the public ground truth, summarised in ``shared/reference/ime2.md``).

Modules, one job each:

* :mod:`~npusim.q4x32.quant` - weights to Q4_0 (``qweight [N, K/32, 16]`` uint8, adjacent-pair
  nibbles, low nibble first; ``scales [N, K/32]`` float32) and back; activations to the HP int8
  rows (:class:`QuantizedA`, 4-row groups then single rows).
* :mod:`~npusim.q4x32.layout` - byte-exact packed B (576-byte ``block_q4_0x32`` blocks per 256-K
  superblock) and quantized A (290 bytes per row and superblock) in both directions.
* :mod:`~npusim.q4x32.instr` - one ``vmadot{u,us,su,}.hp`` instruction (i4/i8) on VLEN-1024
  register images, encode/decode, and a register-file step for a SIGILL emulator's oracle.
* :mod:`~npusim.q4x32.options` - the details the spec leaves open (``rounding``, ``dot``,
  ``overflow``, ``order``, ``m4``) as named options, and their switchable defaults
  (:func:`set_defaults`, ``NPUSIM_Q4X32``, a K3 board's answers file via
  :func:`set_defaults_from_answers` / ``NPUSIM_Q4X32_ANSWERS``).
* :mod:`~npusim.q4x32.fp16` - correctly rounded binary16 arithmetic.
* :mod:`~npusim.q4x32.gemm` - :func:`ime2_hp_gemm` at ``level="exact"`` and ``"hardware"``.
* :mod:`~npusim.q4x32.replay` - instruction-by-instruction replay of the kernels (slow oracle).
* :mod:`~npusim.q4x32.metrics` - :func:`nmse` as llama.cpp's test-backend-ops computes it.
* :mod:`~npusim.q4x32.errors` - the exception classes (all ``ValueError`` subclasses).
* :mod:`~npusim.q4x32.perf` - the SM10 board performance model (instruction counts of our IME2
  path, GEMM time of an A100 core, tokens/s on the IME2 and RVV paths; ``npu-harness ime2
  predict``). Imported on demand: ``from npusim.q4x32 import perf``.

Public API::

    from npusim.q4x32 import (quantize_q4_0, dequantize_q4_0, quantize_a, QuantizedA,
                              pack_b, unpack_b, pack_a, unpack_a, a_packed_size, b_packed_size,
                              vmadot_hp, encode_hp, decode_hp, execute_hp, pack_tile, unpack_tile,
                              ime2_hp_gemm, ime2_hp_gemm_prepared, prepare_weight,
                              scalar_tail_gemm, replay_gemm, nmse,
                              get_defaults, set_defaults, reset_defaults, option_defaults,
                              load_answers, set_defaults_from_answers)
"""

from __future__ import annotations

from .errors import (
    AnswersError,
    DTypeError,
    InstructionError,
    KDimensionError,
    LayoutError,
    NonFiniteError,
    OptionError,
    Q4x32Error,
    ShapeMismatchError,
)
from .gemm import PreparedWeight, ime2_hp_gemm, ime2_hp_gemm_prepared, prepare_weight, scalar_tail_gemm
from .instr import (
    VLENB,
    HpInstruction,
    decode_hp,
    encode_hp,
    execute_hp,
    format_hp,
    hp_accumulate,
    pack_tile,
    unpack_tile,
    vmadot_hp,
)
from .layout import (
    A_BLOCK_BYTES,
    A_GROUP_BLOCK_BYTES,
    B_BLOCK_BYTES,
    B_SUPERBLOCK_BYTES,
    a_packed_size,
    b_packed_size,
    b_tiles,
    pack_a,
    pack_b,
    unpack_a,
    unpack_b,
)
from .metrics import nmse
from .options import (
    BUILTIN_DEFAULTS,
    OPTIONS,
    HpMode,
    get_defaults,
    load_answers,
    option_defaults,
    reset_defaults,
    set_defaults,
    set_defaults_from_answers,
)
from .quant import (
    SUPERBLOCK_K,
    QuantizedA,
    codes_from_qweight,
    dequantize_q4_0,
    qweight_from_codes,
    qweight_from_ggml,
    qweight_to_ggml,
    quantize_a,
    quantize_q4_0,
)
from .replay import replay_gemm


__all__ = [
    "AnswersError",
    "A_BLOCK_BYTES",
    "A_GROUP_BLOCK_BYTES",
    "B_BLOCK_BYTES",
    "BUILTIN_DEFAULTS",
    "B_SUPERBLOCK_BYTES",
    "OPTIONS",
    "SUPERBLOCK_K",
    "VLENB",
    "DTypeError",
    "HpInstruction",
    "HpMode",
    "InstructionError",
    "KDimensionError",
    "LayoutError",
    "NonFiniteError",
    "OptionError",
    "PreparedWeight",
    "Q4x32Error",
    "QuantizedA",
    "ShapeMismatchError",
    "a_packed_size",
    "b_packed_size",
    "b_tiles",
    "codes_from_qweight",
    "decode_hp",
    "dequantize_q4_0",
    "encode_hp",
    "execute_hp",
    "format_hp",
    "get_defaults",
    "hp_accumulate",
    "ime2_hp_gemm",
    "ime2_hp_gemm_prepared",
    "load_answers",
    "nmse",
    "option_defaults",
    "pack_a",
    "pack_b",
    "pack_tile",
    "prepare_weight",
    "qweight_from_codes",
    "qweight_from_ggml",
    "qweight_to_ggml",
    "quantize_a",
    "quantize_q4_0",
    "replay_gemm",
    "reset_defaults",
    "scalar_tail_gemm",
    "set_defaults",
    "set_defaults_from_answers",
    "unpack_a",
    "unpack_b",
    "unpack_tile",
    "vmadot_hp",
]
