"""The Qwen2-VL / Qwen3-VL MXQ kinds (``FORMAT.md``): vision encoders and the VLM text decoders.

A Mobilint Qwen2-VL / Qwen3-VL release (:mod:`npusim.mxq.compile_vlm`) ships two MXQs: a vision
encoder (kind ``qwen2_vl_vision`` / ``qwen3_vl_vision``, no KV) and a text decoder (kind
``decoder`` with a header ``vlm_text_layout``). transformers-mblt 0.6.1 tells the layouts apart
by their input count (and, inside a count, by each input's last-axis width), read from
``get_model_variant_handle(0).get_model_input_shape()``; docs/mblt-vlm-release.md §2 lists them.

Vision layouts (header ``vision_layout``; ``N`` patches of one image or one video item, ``C`` =
``in_channels * temporal_patch_size * patch_size**2``, ``d`` the vision head size, ``P`` =
``2 * ceil64(d)``, ``H`` the text hidden size):

================ ============= ===================================================== =====================
kind              layout        inputs, in order                                      outputs
================ ============= ===================================================== =====================
qwen2_vl_vision   ``static``    ``pixels`` ``(gh/m*gw/m*ph, m*m*pw, tp*3)`` of the     ``(1, N/m², H)``
                                compiled grid (``(896, 56, 6)`` for 224x224)
qwen2_vl_vision   ``rope``      ``folded (1, N, C)``, ``rope (1, N, P)``               ``(1, N/m², H)``
qwen2_vl_vision   ``cos_sin``   ``folded (1, N, C)``, ``cos (1, N, d)``, ``sin``       ``(1, N/m², H)``
qwen3_vl_vision   ``folded``    ``folded (1, N, C)``, N fixed (256 for 256x256)        4 x ``(1, N/m², H)``
qwen3_vl_vision   ``legacy``    ``pixels (gh/m*gw/m*ph, m*m*pw, tp*3)`` (1024, 64, 6)  4 x ``(1, N/m², H)``
qwen3_vl_vision   ``dynamic``   ``rope (1,N,P)``, ``pos (1,N,hidden)``, ``folded``     4 x ``(1, N/m², H)``
                                (header ``vision_input_order`` permutes the three)
================ ============= ===================================================== =====================

* The static layouts compute with the compiled grid (header ``vision_grid``, ``[t, h, w]`` in
  patches): the re-laid-out ``pixels`` are turned back into the processor's patches (the
  inverse of transformers-mblt's ``_preprocess_image_tokens`` / ``_repreprocess_pixel_values``:
  rows ``(gh/m, gw/m, ph)``, columns ``(m, m, pw)``, channels ``(tp, c)``), and the vision RoPE
  (and, Qwen3-VL, the interpolated position embeddings) of that grid are computed at load, the
  "baked" part of a static encoder.
* The dynamic layouts take the host's side inputs; ``N`` is a runtime dimension from ``m²`` up to
  the header's ``max_width`` (4096 pre-merge patches by default, the vendor's limit), a multiple
  of ``m²``. ``rope`` rows are the host's packed "rotate" rows (:func:`npusim.mxq.eagle3_kinds.pack_rope_rows`).
* Qwen3-VL's four outputs (the merger and the three DeepStack mergers) have one shape; header
  ``vision_output_order`` ``[i_merger, i_ds0, i_ds1, i_ds2]`` says where each goes, with
  transformers-mblt's meaning (default ``[0, 2, 3, 1]``, its own default).
* Any input may carry one more leading axis ``B`` (transformers-mblt stacks several same-shaped
  images on axis 0 in ``core_mode == "multi"``); the outputs then start with ``B``.

The computation is the golden tower's ``forward_patches`` (:mod:`npusim.llm.vision`), so every
output equals the golden encoder bit for bit in float32.

Text layouts (header ``vlm_text_layout``, :data:`VLM_TEXT_INPUTS`): ``inputs_embeds`` ``(1, 1, T, H)``
(Qwen2-VL; ``(1, T, H)`` accepted) / ``(1, T, H)`` (Qwen3-VL), ``rope (1, T, P)`` (``P`` from the text
head_dim), ``deepstack (L, T, H)`` or ``deepstack<i> (1, T, H)``. A layout without ``rope`` rotates
with positions = the cache position on all three M-RoPE rows (the contract's "Static text MXQ");
DeepStack row ``i`` is added to the residual stream after decoder layer ``i``
(:meth:`npusim.llm.Decoder.forward_rope` ``layer_adds``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .eagle3_kinds import rope_row_width, unpack_rope_rows

__all__ = ["DEFAULT_VISION_OUTPUT_ORDER", "QWEN3_INPUT_ORDERS", "VISION_LAYOUTS", "VISION_PREFIX", "VLM_TEXT_INPUTS",
           "VLM_TEXT_LAYOUTS", "VLM_VISION_KINDS", "VLM_VISION_OUTPUTS", "VlmHeaderError", "VlmInputError",
           "VlmTextPart", "VlmVisionPart", "check_vlm_header", "relayout_pixels", "unrelayout_pixels",
           "vision_tensor_names", "vlm_num_inputs"]

#: The vision tower's tensors in a Qwen2-VL / Qwen3-VL checkpoint (transformers 5.x layout) start with this.
VISION_PREFIX = "model.visual."
VLM_VISION_KINDS: tuple[str, ...] = ("qwen2_vl_vision", "qwen3_vl_vision")
#: Output names of each vision kind, in the order of the vision tower (the MXQ emits them in
#: ``vision_output_order``).
VLM_VISION_OUTPUTS: dict[str, tuple[str, ...]] = {
    "qwen2_vl_vision": ("image_embeds",),
    "qwen3_vl_vision": ("merger", "deepstack0", "deepstack1", "deepstack2"),
}
#: ``vision_layout`` values of each kind; the first is the static one(s).
VISION_LAYOUTS: dict[str, tuple[str, ...]] = {
    "qwen2_vl_vision": ("static", "rope", "cos_sin"),
    "qwen3_vl_vision": ("folded", "legacy", "dynamic"),
}
_STATIC_LAYOUTS = ("static", "folded", "legacy")
#: transformers-mblt's default ``vision_output_order`` (merger, deepstack0..2 indices).
DEFAULT_VISION_OUTPUT_ORDER: tuple[int, int, int, int] = (0, 2, 3, 1)
#: The dynamic Qwen3-VL vision input orders: the shipped 8B one (default) and a tutorial recompile's.
QWEN3_INPUT_ORDERS: tuple[tuple[str, str, str], ...] = (("rope", "pos", "folded"), ("folded", "pos", "rope"))
#: The text decoder layouts: header ``vlm_text_layout`` -> input names in ``infer`` order
#: (``deepstack*`` names expand to the release's DeepStack layer count L; listed here for L = 3).
VLM_TEXT_INPUTS: dict[str, tuple[str, ...]] = {
    "qwen2_static": ("inputs_embeds",),
    "qwen2_rope": ("inputs_embeds", "rope"),
    "qwen3_bundled_static": ("inputs_embeds", "deepstack"),
    "qwen3_bundled_rope": ("inputs_embeds", "deepstack", "rope"),
    "qwen3_split_static": ("inputs_embeds", "deepstack0", "deepstack1", "deepstack2"),
    "qwen3_split_rope": ("inputs_embeds", "deepstack0", "deepstack1", "deepstack2", "rope"),
    "qwen3_batch_rope": ("inputs_embeds", "rope", "deepstack"),
}
VLM_TEXT_LAYOUTS: tuple[str, ...] = tuple(VLM_TEXT_INPUTS)


class VlmInputError(ValueError):
    """An input of a VLM MXQ infer has the wrong shape (the message starts with qbruntime's
    ``Input shape is invalid.`` and names the input, expected and got)."""


class VlmHeaderError(ValueError):
    """A VLM MXQ header value outside its rule (named with the rule)."""


def vision_tensor_names(names: Sequence[str]) -> list[str]:
    """The checkpoint tensors a vision MXQ carries, out of ``names``: the vision tower's."""
    return [n for n in names if n.startswith(VISION_PREFIX)]


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _deepstack_layers(header: Mapping[str, Any]) -> int:
    return int(header.get("vlm_deepstack_layers", 3))


def _text_input_names(layout: str, layers: int) -> tuple[str, ...]:
    names: list[str] = []
    for n in VLM_TEXT_INPUTS[layout]:
        if n == "deepstack0":
            names.extend(f"deepstack{i}" for i in range(layers))
        elif n in ("deepstack1", "deepstack2"):
            continue
        else:
            names.append(n)
    return tuple(names)


def vlm_num_inputs(kind: str, header: Mapping[str, Any]) -> int | None:
    """How many inputs a VLM MXQ takes (None: ``kind``/``header`` is not a VLM MXQ)."""
    if kind == "qwen2_vl_vision":
        return {"static": 1, "rope": 2, "cos_sin": 3}.get(header.get("vision_layout"), 1)
    if kind == "qwen3_vl_vision":
        return 3 if header.get("vision_layout") == "dynamic" else 1
    layout = header.get("vlm_text_layout")
    if kind == "decoder" and layout in VLM_TEXT_INPUTS:
        return len(_text_input_names(layout, _deepstack_layers(header)))
    return None


def check_vlm_header(h: Mapping[str, Any], kind: str) -> None:
    """Check the VLM header keys (FORMAT.md) of an MXQ of ``kind``.

    Raises:
        VlmHeaderError: a key on the wrong kind, or a value outside its rule.
    """
    vision_keys = ("vision_layout", "vision_grid", "vision_input_order", "vision_output_order")
    text_keys = ("vlm_text_layout", "vlm_mrope", "vlm_deepstack_layers")
    if kind not in VLM_VISION_KINDS:
        stray = [k for k in vision_keys if k in h]
        if stray:
            raise VlmHeaderError(f"MXQ header {stray[0]}={h[stray[0]]!r} applies only to kinds {', '.join(VLM_VISION_KINDS)}.")
    if kind != "decoder" or "vlm_text_layout" not in h:
        stray = [k for k in text_keys if k in h]
        if stray:
            raise VlmHeaderError(f"MXQ header {stray[0]}={h[stray[0]]!r} applies only to kind 'decoder' with a "
                                 "vlm_text_layout.")
    if kind in VLM_VISION_KINDS:
        _check_vision_header(h, kind)
    elif kind == "decoder" and "vlm_text_layout" in h:
        _check_text_header(h)


def _check_vision_header(h: Mapping[str, Any], kind: str) -> None:
    layout = h.get("vision_layout")
    if layout not in VISION_LAYOUTS[kind]:
        raise VlmHeaderError(f"MXQ header vision_layout={layout!r} must be one of {list(VISION_LAYOUTS[kind])} "
                             f"for kind {kind!r}.")
    grid = h.get("vision_grid")
    if layout in _STATIC_LAYOUTS:
        if (not isinstance(grid, list) or len(grid) != 3 or any(not _is_int(g) or g < 1 for g in grid)
                or grid[0] != 1):
            raise VlmHeaderError(f"MXQ header vision_grid={grid!r} must be [1, h, w] (patches, one image) for the "
                                 f"static vision layout {layout!r}.")
    elif grid is not None:
        raise VlmHeaderError(f"MXQ header vision_grid={grid!r}: only static vision layouts have a compiled grid.")
    order = h.get("vision_input_order")
    if order is not None and (layout != "dynamic" or not isinstance(order, list) or tuple(order) not in QWEN3_INPUT_ORDERS):
        raise VlmHeaderError(f"MXQ header vision_input_order={order!r} must be one of "
                             f"{[list(o) for o in QWEN3_INPUT_ORDERS]}, for a dynamic Qwen3-VL vision MXQ only.")
    out = h.get("vision_output_order")
    if out is not None and (kind != "qwen3_vl_vision" or not isinstance(out, list)
                            or any(not _is_int(i) for i in out) or sorted(out) != [0, 1, 2, 3]):
        raise VlmHeaderError(f"MXQ header vision_output_order={out!r} must be a permutation of [0, 1, 2, 3] "
                             "(indices of merger, deepstack0, deepstack1, deepstack2), for kind 'qwen3_vl_vision' only.")
    if "outputs" in h:
        raise VlmHeaderError(f"MXQ header outputs={h['outputs']!r}: vision MXQs order their outputs with "
                             "vision_output_order.")


def _check_text_header(h: Mapping[str, Any]) -> None:
    layout = h["vlm_text_layout"]
    if layout not in VLM_TEXT_INPUTS:
        raise VlmHeaderError(f"MXQ header vlm_text_layout={layout!r} must be one of {', '.join(VLM_TEXT_LAYOUTS)}.")
    layers = h.get("vlm_deepstack_layers", 3)
    if not _is_int(layers) or layers < 1 or (layout.startswith("qwen2") and "vlm_deepstack_layers" in h):
        raise VlmHeaderError(f"MXQ header vlm_deepstack_layers={layers!r} must be an integer >= 1, for a Qwen3-VL "
                             "text layout only.")
    mrope = h.get("vlm_mrope")
    if (not isinstance(mrope, dict) or not isinstance(mrope.get("mrope_section"), list)
            or any(not _is_int(s) or s < 0 for s in mrope["mrope_section"])
            or not isinstance(mrope.get("interleaved"), bool)):
        raise VlmHeaderError(f"MXQ header vlm_mrope={mrope!r} must be {{\"mrope_section\": [t, h, w], "
                             "\"interleaved\": bool}.")
    k = h["max_batch_size"]
    if layout == "qwen3_batch_rope" and k == 1:
        raise VlmHeaderError("MXQ header vlm_text_layout='qwen3_batch_rope' (inputs embeds, rope, deepstack) is the "
                             "batch build's order: it needs max_batch_size > 1 (a batch-1 build is 'qwen3_bundled_rope').")
    if layout in ("qwen3_bundled_rope", "qwen2_rope") and k > 1:
        raise VlmHeaderError(f"MXQ header vlm_text_layout={layout!r} with max_batch_size {k}: "
                             + ("a batch Qwen3-VL bundled build takes (embeds, rope, deepstack): 'qwen3_batch_rope'."
                                if layout == "qwen3_bundled_rope" else
                                "Batched Qwen2-VL text MXQs with an external RoPE input are not supported."))


# ---------------------------------------------------------------------------------------------- pixels
def relayout_pixels(patches: np.ndarray, grid: Sequence[int], *, merge: int, temporal: int,
                    channels: int = 3) -> np.ndarray:
    """transformers-mblt's static re-layout of one image's processor patches ``[h*w, c*tp*p*p]``:
    ``(h/m * w/m * p, m*m*p, tp*c)`` (rows ``(h/m, w/m, ph)``, columns ``(mh, mw, pw)``, channels
    ``(tp, c)``). For tests and hosts; the MXQ inverts it (:func:`unrelayout_pixels`).

    Raises:
        ValueError: ``patches`` does not match ``grid``.
    """
    t, gh, gw = (int(g) for g in grid)
    x = np.asarray(patches, dtype=np.float32)
    p = int(round((x.shape[-1] / (temporal * channels)) ** 0.5)) if x.ndim == 2 else 0
    if t != 1 or x.ndim != 2 or x.shape != (gh * gw, channels * temporal * p * p) or gh % merge or gw % merge:
        raise ValueError(f"patches {list(x.shape)} do not match one image of grid {[t, gh, gw]}")
    v = x.reshape(gh // merge, gw // merge, merge, merge, channels, temporal, p, p)
    v = v.transpose(0, 1, 6, 2, 3, 7, 5, 4)
    return np.ascontiguousarray(v).reshape(gh // merge * gw // merge * p, merge * merge * p, temporal * channels)


def unrelayout_pixels(pixels: np.ndarray, grid: Sequence[int], *, merge: int, temporal: int, patch: int,
                      channels: int = 3) -> np.ndarray:
    """The inverse of :func:`relayout_pixels`: the processor's patches ``[h*w, c*tp*p*p]`` (float32)."""
    _, gh, gw = (int(g) for g in grid)
    v = np.asarray(pixels, dtype=np.float32).reshape(gh // merge, gw // merge, patch, merge, merge, patch,
                                                    temporal, channels)
    v = v.transpose(0, 1, 3, 4, 7, 6, 2, 5)
    return np.ascontiguousarray(v).reshape(gh * gw, channels * temporal * patch * patch)


def _tower_classes() -> tuple[Any, Any]:
    """The golden towers (imported late: :mod:`npusim.llm.vision` is only needed by VLM MXQs)."""
    try:
        from ..llm.vision import Qwen2VisionTower, Qwen3VisionTower
    except ImportError:
        from ..llm import Qwen2VisionTower, Qwen3VisionTower  # type: ignore[attr-defined,no-redef]
    return Qwen2VisionTower, Qwen3VisionTower


def _frames(cos: np.ndarray) -> int:
    """How many frames one dynamic item holds: the RoPE rows of a video item repeat per frame
    (every patch of a frame has its own (row, column), hence its own row of angles), so the
    smallest period ``p`` of the rows with ``N % p == 0`` is one frame's ``h * w`` and the item
    has ``N / p`` frames. Attention is then block-diagonal per frame, as upstream's (one frame:
    an image, or transformers-mblt's per-frame Qwen3-VL calls)."""
    rows = np.asarray(cos)
    n = rows.shape[0]
    starts = np.flatnonzero(np.all(rows == rows[0], axis=1))  # a frame starts at the row of patch (0, 0)
    for p in (int(i) for i in starts[1:]):
        if n % p == 0 and np.array_equal(rows[p:], rows[:n - p]):
            return n // p
    return 1


# ---------------------------------------------------------------------------------------------- vision
class VlmVisionPart:
    """One vision MXQ's computation and I/O shapes.

    Attributes:
        kind: ``qwen2_vl_vision`` or ``qwen3_vl_vision``.
        layout: the header's ``vision_layout``.
        grid: the compiled ``(t, h, w)`` of a static layout (None for a dynamic one).
        max_patches: most patches per item (the header's ``max_width``; a static layout's is its grid's).
        input_names: the inputs, in ``infer`` order.
        output_names: the outputs, in the MXQ's order.
    """

    def __init__(self, kind: str, header: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *,
                 source: str = "weights") -> None:
        """Build the golden tower from the header's ``llm_config`` (the checkpoint's ``vision_config``)
        and the payload (``model.visual.*``).

        Raises:
            VlmHeaderError: a static grid that does not fit the tower (not a multiple of the merge
                size, more patches than ``max_width``) or a Qwen3-VL tower whose DeepStack count is not 3.
            CheckpointError / UnsupportedModelError / ValueError: the golden tower refuses config or tensors.
        """
        self.kind = kind
        cfg = dict(header["llm_config"])
        self.layout: str = header["vision_layout"]
        if kind == "qwen3_vl_vision":
            layers = len(cfg.get("deepstack_visual_indexes") or ())
            if layers != 3:
                raise VlmHeaderError(f"{source}: a Qwen3-VL vision MXQ emits the merger and 3 DeepStack mergers; "
                                     f"deepstack_visual_indexes has {layers}")
        q2, q3 = _tower_classes()
        self._tower = (q2 if kind == "qwen2_vl_vision" else q3)(cfg, tensors, prefix=VISION_PREFIX)
        t = self._tower
        self.merge, self.temporal, self.patch = t.merge_size, t.temporal_patch_size, t.patch_size
        self.channels, self.fold = t.in_channels, t.patch_dim
        self.vision_hidden, self.head_dim, self.out_hidden = t.width, t.head_dim, t.out_hidden_size
        self.max_patches = int(header["max_width"])
        self.grid: tuple[int, int, int] | None = None
        self._static: tuple[np.ndarray, ...] = ()
        if self.layout in _STATIC_LAYOUTS:
            t, gh, gw = (int(g) for g in header["vision_grid"])
            if gh % self.merge or gw % self.merge or t * gh * gw > self.max_patches:
                raise VlmHeaderError(f"{source}: vision_grid {[t, gh, gw]} must be multiples of the merge size "
                                     f"{self.merge} and hold at most max_width={self.max_patches} patches")
            self.grid = (t, gh, gw)
            cos, sin = self._tower.rope(self.grid)
            self._static = ((np.asarray(self._tower.pos_embeds(self.grid), np.float32),) if kind == "qwen3_vl_vision"
                            else ()) + (np.asarray(cos, np.float32), np.asarray(sin, np.float32))
        if self.layout == "dynamic":
            order = tuple(header.get("vision_input_order") or QWEN3_INPUT_ORDERS[0])
            self.input_names: tuple[str, ...] = order
        elif self.layout == "rope":
            self.input_names = ("folded", "rope")
        elif self.layout == "cos_sin":
            self.input_names = ("folded", "cos", "sin")
        else:
            self.input_names = ("folded",) if self.layout == "folded" else ("pixels",)
        if kind == "qwen3_vl_vision":
            order = tuple(header.get("vision_output_order") or DEFAULT_VISION_OUTPUT_ORDER)
            names = [""] * 4
            for name, idx in zip(VLM_VISION_OUTPUTS[kind], order):
                names[idx] = name
            self.output_names: tuple[str, ...] = tuple(names)
        else:
            self.output_names = VLM_VISION_OUTPUTS[kind]

    # ------------------------------------------------------------------ shapes
    @property
    def static_patches(self) -> int | None:
        """Patches of the compiled grid (None: dynamic)."""
        return None if self.grid is None else self.grid[0] * self.grid[1] * self.grid[2]

    def _pixels_shape(self) -> tuple[int, int, int]:
        assert self.grid is not None
        _, gh, gw = self.grid
        m, p = self.merge, self.patch
        return (gh // m * gw // m * p, m * m * p, self.temporal * self.channels)

    def input_shapes(self) -> list[tuple[int, ...]]:
        """One shape per input (``-1``: the runtime patch axis of a dynamic layout)."""
        if self.layout in ("static", "legacy"):
            return [self._pixels_shape()]
        if self.layout == "folded":
            return [(1, self.static_patches or 0, self.fold)]
        width = {"folded": self.fold, "rope": rope_row_width(self.head_dim), "cos": self.head_dim,
                 "sin": self.head_dim, "pos": self.vision_hidden}
        return [(1, -1, width[n]) for n in self.input_names]

    def output_shapes(self) -> list[tuple[int, ...]]:
        """One shape per output: ``(1, N/m², H)`` (``-1`` rows for a dynamic layout)."""
        rows = -1 if self.grid is None else (self.static_patches or 0) // self.merge ** 2
        return [(1, rows, self.out_hidden) for _ in self.output_names]

    # ------------------------------------------------------------------ compute
    def check(self, arrays: Sequence[Any]) -> tuple[list[np.ndarray], int | None]:
        """The inputs as float32 arrays with a leading item axis ``[B, ...]``, and ``B`` when the
        caller stacked items on a new axis 0 (None: one item, no extra axis).

        Raises:
            ValueError: the wrong number of inputs (``The number of inputs is invalid``).
            VlmInputError: a shape other than the layout's (names input, expected and got); a
                dynamic patch count that is not a positive multiple of ``m²``, above ``max_width``,
                or different across the inputs.
        """
        if len(arrays) != len(self.input_names):
            raise ValueError(f"The number of inputs is invalid (expected {len(self.input_names)}, got {len(arrays)}).")
        xs = [np.asarray(a, dtype=np.float32) for a in arrays]
        shapes = self.input_shapes()
        batch: int | None = None
        if xs[0].ndim == len(shapes[0]) + 1:
            batch = int(xs[0].shape[0])
        out: list[np.ndarray] = []
        n_dyn: int | None = None
        for i, (name, x, want) in enumerate(zip(self.input_names, xs, shapes)):
            got = list(x.shape)
            shape = tuple(x.shape[1:]) if batch is not None else tuple(x.shape)
            ok = (batch is None or (x.ndim == len(want) + 1 and x.shape[0] == batch and batch >= 1)) \
                and len(shape) == len(want) and all(w in (-1, s) for w, s in zip(want, shape))
            if ok and -1 in want:
                n = shape[1]
                if n_dyn is None:
                    n_dyn = n
                ok = n == n_dyn
            if not ok:
                lead = "" if batch is None else f"{batch}, "
                raise VlmInputError(
                    f"Input shape is invalid. inputs[{i}] ({name}) must be [{lead}{', '.join('N' if w == -1 else str(w) for w in want)}]"
                    + (f" with N the patches of inputs[0]" if -1 in want and i else "")
                    + f" for this {self.kind} MXQ ({self.layout}); got {got}.")
            out.append(x if batch is not None else x[None])
        if n_dyn is not None:
            m2 = self.merge ** 2
            if n_dyn < m2 or n_dyn % m2 or n_dyn > self.max_patches:
                raise VlmInputError(
                    f"Input shape is invalid. The vision MXQ takes N patches with {m2} <= N <= {self.max_patches} "
                    f"(its compiled limit), N a multiple of {m2} (spatial_merge_size {self.merge} squared); got "
                    f"N = {n_dyn} ({list(xs[0].shape)}).")
        return out, batch

    def patches_per_item(self, arrays: Sequence[np.ndarray]) -> int:
        """N of the checked inputs (patches of one item)."""
        if self.grid is not None:
            return self.static_patches or 0
        return int(arrays[self.input_names.index("folded")].shape[-2])

    def run(self, arrays: Sequence[np.ndarray], batch: int | None) -> list[np.ndarray]:
        """The outputs, in the MXQ's order, each float32 ``(1, N/m², H)`` (``(B, N/m², H)`` when
        the inputs were stacked). ``arrays`` passed :meth:`check`. Raises: what the tower raises."""
        per_item: list[list[np.ndarray]] = []
        for b in range(arrays[0].shape[0]):
            named = dict(zip(self.input_names, (a[b] for a in arrays)))
            per_item.append(self._one(named))
        if batch is None:
            return [o[None] for o in per_item[0]]
        return [np.stack([item[i] for item in per_item]) for i in range(len(self.output_names))]

    def _one(self, named: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        if self.layout in ("static", "legacy"):
            assert self.grid is not None
            patches = unrelayout_pixels(named["pixels"], self.grid, merge=self.merge, temporal=self.temporal,
                                        patch=self.patch, channels=self.channels)
        else:
            patches = named["folded"].reshape(-1, self.fold)
        if self.grid is not None:
            side = self._static
        elif self.kind == "qwen2_vl_vision":
            side = (unpack_rope_rows(named["rope"].reshape(-1, rope_row_width(self.head_dim)), self.head_dim)
                    if self.layout == "rope" else (named["cos"].reshape(-1, self.head_dim),
                                                   named["sin"].reshape(-1, self.head_dim)))
        else:
            cos, sin = unpack_rope_rows(named["rope"].reshape(-1, rope_row_width(self.head_dim)), self.head_dim)
            side = (named["pos"].reshape(-1, self.vision_hidden), cos, sin)
        frames = 1 if self.grid is not None else _frames(side[-2])
        if self.kind == "qwen2_vl_vision":
            return [np.asarray(self._tower.forward_patches(patches, *side, frames=frames), dtype=np.float32)]
        embeds, deepstack = self._tower.forward_patches(patches, *side, frames=frames)
        by_name = {"merger": embeds, **{f"deepstack{i}": deepstack[i] for i in range(len(deepstack))}}
        return [np.asarray(by_name[n], dtype=np.float32) for n in self.output_names]


# ---------------------------------------------------------------------------------------------- text
class VlmTextPart:
    """A VLM text decoder MXQ's inputs and computation (around the MXQ's golden ``Decoder``).

    Attributes:
        layout: the header's ``vlm_text_layout``.
        input_names: the inputs, in ``infer`` order.
        uses_rope: whether the host feeds packed RoPE rows (else positions = cache positions).
        deepstack_layers: L (0 for Qwen2-VL).
    """

    def __init__(self, header: Mapping[str, Any], decoder: Any) -> None:
        """Raises: VlmHeaderError: M-RoPE sections that do not cover ``head_dim / 2``."""
        self.layout: str = header["vlm_text_layout"]
        self.deepstack_layers = 0 if self.layout.startswith("qwen2") else _deepstack_layers(header)
        self.input_names = _text_input_names(self.layout, self.deepstack_layers or 3)
        self.uses_rope = "rope" in self.input_names
        self._decoder = decoder
        c = decoder.config
        self.hidden, self.head_dim = c.hidden_size, c.head_dim
        mrope = header["vlm_mrope"]
        self.mrope_section = [int(s) for s in mrope["mrope_section"]]
        self.interleaved = bool(mrope["interleaved"])
        if sum(self.mrope_section) != self.head_dim // 2:
            raise VlmHeaderError(f"MXQ header vlm_mrope mrope_section {self.mrope_section} must sum to head_dim / 2 "
                                 f"= {self.head_dim // 2}")
        self.rope_theta = float(c.rope.theta)

    def input_shapes(self) -> list[tuple[int, ...]]:
        """One shape per input, ``-1`` the token axis: ``(1, -1, H)``, ``(1, -1, P)``, ``(L, -1, H)``."""
        width = {"inputs_embeds": (1, self.hidden), "rope": (1, rope_row_width(self.head_dim)),
                 "deepstack": (self.deepstack_layers, self.hidden)}
        return [(width.get(n, (1, self.hidden))[0], -1, width.get(n, (1, self.hidden))[1]) for n in self.input_names]

    def check(self, arrays: Sequence[Any]) -> tuple[list[np.ndarray], int]:
        """The inputs as 2-D / 3-D float32 arrays (``embeds [S, H]``, ``rope [S, P]``,
        ``deepstack [L, S, H]``, in :attr:`input_names` order) and the rank of ``inputs_embeds``.

        Raises:
            ValueError: the wrong number of inputs.
            VlmInputError: a shape other than the layout's (names input, expected and got), or
                token counts that differ between the inputs.
        """
        if len(arrays) != len(self.input_names):
            raise ValueError(f"The number of inputs is invalid (expected {len(self.input_names)}, got {len(arrays)}).")
        xs = [np.asarray(a, dtype=np.float32) for a in arrays]
        e = xs[0]
        if not (((e.ndim == 3 and e.shape[0] == 1) or (e.ndim == 4 and e.shape[:2] == (1, 1)))
                and e.shape[-1] == self.hidden and e.shape[-2] >= 1):
            raise VlmInputError(f"Input shape is invalid. inputs[0] (inputs_embeds) must be [1, 1, S, {self.hidden}] or "
                                f"[1, S, {self.hidden}] with S >= 1; got {list(e.shape)}.")
        s = e.shape[-2]
        out = [e.reshape(s, self.hidden)]
        for i, (name, x, want) in enumerate(zip(self.input_names[1:], xs[1:], self.input_shapes()[1:]), start=1):
            full = (want[0], s, want[2])
            if x.shape != full:
                raise VlmInputError(f"Input shape is invalid. inputs[{i}] ({name}) must be {list(full)} (S = "
                                    f"{s} tokens of inputs[0]); got {list(x.shape)}.")
            out.append(x if name == "deepstack" else x[0])
        return out, e.ndim

    def run_item(self, arrays: Sequence[np.ndarray], start: int, stop: int, cache: Any) -> np.ndarray:
        """Logits ``[stop - start, vocab]`` (float32) of the rows ``[start, stop)`` of the checked
        inputs, written to ``cache`` at ``cache.length``. Raises: what ``Decoder.forward_rope`` raises."""
        named = dict(zip(self.input_names, arrays))
        embeds = named["inputs_embeds"][start:stop]
        if self.uses_rope:
            cos, sin = unpack_rope_rows(named["rope"][start:stop], self.head_dim)
        else:
            from ..llm.mrope import mrope_cos_sin

            pos = np.arange(cache.length, cache.length + (stop - start), dtype=np.int64)
            cos, sin = mrope_cos_sin(np.stack([pos, pos, pos]), head_dim=self.head_dim, rope_theta=self.rope_theta,
                                     mrope_section=self.mrope_section, interleaved=self.interleaved)
        adds = None
        if self.deepstack_layers:
            if "deepstack" in named:
                ds = named["deepstack"][:, start:stop]
            else:
                ds = np.stack([named[f"deepstack{i}"][start:stop] for i in range(self.deepstack_layers)])
            adds = {i: ds[i] for i in range(self.deepstack_layers)}
        return self._decoder.forward_rope(embeds, cache, cos, sin, layer_adds=adds)
